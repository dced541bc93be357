"""The watchdog: every blocking wait has a deadline, and says what it waited for when it expires.

A rank blocked in a receive or a collective polls its pending requests, spinning for a millisecond
(not at all when the machine runs more ranks than cores) and then sleeping between tests (so it
gives the core back to ranks that compute: MPICH would busy-poll otherwise), and raises
``CommTimeout`` after ``timeout`` seconds. The message names the operation, the peer ranks (world
ranks) it waited for, and this rank's last completed operations. A peer the failure detector
(``detector.py``) declared dead ends the wait earlier, with ``PeerLost``.

The timeout is, in order: the ``timeout=`` argument of ``launch``/``world``, the environment
variable ``MINIPAR_TIMEOUT`` (seconds), or 60 s.
"""

from __future__ import annotations

import os
import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

from minipar.comm.errors import Aborted, CommTimeout

DEFAULT_TIMEOUT = 60.0
HISTORY = 6
SPIN = 1e-3  # seconds a wait spins before it sleeps (see ``poll``)
PACE = 1 / 32  # each sleep of a wait, as a fraction of the time waited so far


def spin_for(local_ranks: int, cores: int | None = None) -> float:
    """``SPIN``, or 0 when this machine runs more ranks than it has cores: a spinning rank then takes
    the core from the very peer it waits for (measured with 4 ranks on 2 cores: a neighbour exchange
    took ~2 ms spinning against ~0.3 ms not; tensor-parallel steps 27-44% faster)."""
    return 0.0 if local_ranks > (cores or os.cpu_count() or 1) else SPIN


WAIT_MODES = ("sleep", "bell", "yield")


def wait_mode(local_ranks: int, cores: int | None = None) -> str:
    """How a wait spends its pauses: ``MINIPAR_WAIT`` (``sleep``: ``time.sleep``; ``bell``: sleep on
    the process's doorbell, ``doorbell.py``, woken when its data is posted; ``yield``:
    ``os.sched_yield``), else ``sleep`` (``local_ranks`` and ``cores`` are for a default that
    depends on oversubscription; ``benchmarks/oversubscribed.py`` measures the modes)."""
    raw = os.environ.get("MINIPAR_WAIT", "").strip().lower()
    if raw:
        if raw not in WAIT_MODES:
            raise ValueError(f"MINIPAR_WAIT={raw!r}: choose one of {', '.join(WAIT_MODES)}")
        return raw
    return "sleep"


def default_timeout(timeout: float | None = None) -> float:
    """Resolve the watchdog timeout: argument, then ``MINIPAR_TIMEOUT``, then 60 s."""
    if timeout is not None:
        value = float(timeout)
    else:
        raw = os.environ.get("MINIPAR_TIMEOUT", "")
        try:
            value = float(raw) if raw else DEFAULT_TIMEOUT
        except ValueError:
            raise ValueError(f"MINIPAR_TIMEOUT={raw!r} is not a number of seconds") from None
    if not value > 0:
        raise ValueError(f"the communication timeout must be > 0 seconds, got {value}")
    return value


def debug_enabled() -> bool:
    """Debug mode (``MINIPAR_DEBUG=1``): collectives check that all ranks entered the same call."""
    return os.environ.get("MINIPAR_DEBUG", "") not in ("", "0", "false", "no")


class RankState:
    """What one rank is doing and did last; shared by all communicators of the rank."""

    def __init__(self, world_rank: int, timeout: float) -> None:
        self.world_rank = world_rank
        self.timeout = timeout
        self.current: str | None = None
        self.history: deque[str] = deque(maxlen=HISTORY)
        self.abort: Callable[[], str | None] = lambda: None  # threads backend: why the launch aborted
        self.detector: Any = None  # detector.Detector once the backend starts one
        self.fail_fast = True  # PeerLost for any dead rank (False: only for a wait's own peers)

    def done(self, what: str) -> None:
        self.history.append(what)

    def timeout_error(self, what: str, peers: Iterable[int], waited: float) -> CommTimeout:
        peer_list = sorted(set(peers))
        last = "; ".join(self.history) if self.history else "none"
        err = CommTimeout(
            f"rank {self.world_rank}: {what} timed out after {waited:.1f} s waiting for rank(s) "
            f"{peer_list} (world ranks); last completed operations: {last}. A rank that never "
            "entered this operation, or entered a different one, is the usual cause; raise the limit "
            "with MINIPAR_TIMEOUT=<seconds> or timeout= if the peers are just slow."
        )
        err.peers = peer_list
        return err


def poll(state: RankState, test: Callable[[], bool], what: str, peers: Iterable[int],
         timeout: float | None = None, spin: float = SPIN, pace: float = PACE,
         rest: Callable[[float], None] = time.sleep) -> None:
    """Call ``test`` until it returns True; ``CommTimeout`` after the deadline.

    MPI moves data only inside MPI calls (MPICH has no progress thread), so a rank asleep between
    tests stalls its own transfers and collectives. The wait first spins for ``spin`` seconds (an
    operation done within it costs what MPI's blocking call costs), then sleeps between tests, each
    sleep ``pace`` times the time waited so far, from 20 us to 1 ms: with the default 1/32 a wait
    ends at most ~3% later than spinning would (an 8 MB native all-reduce: 1.1x MPICH's blocking
    call, 1.3x with 1/8), and a rank idle for more than 32 ms wakes 1000 times a second. A thread that
    overlaps communication with the rank's compute waits with ``spin=0, pace=1/2``: every wake-up
    preempts the compute. ``rest(seconds)`` pauses (``time.sleep``; a doorbell's ``wait`` ends
    early when a peer rings, ``doorbell.py``): the deadline and the detector are checked after
    every pause, so no pause makes a wait outlive them by more than its length (at most 1 ms).
    """
    if test():
        return
    start = time.monotonic()
    deadline = start + (state.timeout if timeout is None else timeout)
    det = state.detector
    while not test():
        reason = state.abort()
        if reason is not None:
            raise Aborted(f"rank {state.world_rank}: {what} abandoned: {reason}")
        if det is not None and det.dead:
            det.raise_if_lost(what, peers, state.fail_fast)
        now = time.monotonic()
        if now > deadline:
            raise state.timeout_error(what, peers, now - start)
        waited = now - start
        if waited >= spin:
            rest(min(1e-3, max(2e-5, waited * pace)))
