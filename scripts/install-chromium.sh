#!/bin/sh
# Install Debian's chromium (used by the real-browser viewer test) if it is not there yet.
# Idempotent and quiet: does nothing when /usr/bin/chromium exists; runs `apt-get update` only
# when the first install attempt fails (e.g. stale or empty package lists).
set -eu

if [ -x /usr/bin/chromium ]; then
    exit 0
fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then
    if command -v sudo >/dev/null 2>&1; then
        SUDO="sudo"
    else
        echo "install-chromium.sh: need root (or sudo) to apt-get install chromium" >&2
        exit 1
    fi
fi

export DEBIAN_FRONTEND=noninteractive
LOG="$(mktemp)"
trap 'rm -f "$LOG"' EXIT

install() {
    $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends chromium \
        >"$LOG" 2>&1
}

if ! install; then
    if ! $SUDO apt-get update -q >"$LOG" 2>&1 || ! install; then
        echo "install-chromium.sh: apt-get install chromium failed:" >&2
        tail -n 20 "$LOG" >&2
        exit 1
    fi
fi

if [ ! -x /usr/bin/chromium ]; then
    echo "install-chromium.sh: chromium installed but /usr/bin/chromium is missing" >&2
    exit 1
fi
