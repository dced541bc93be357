"""The NVMe tier: one ``.npy`` file per tensor name under a directory, read and written for real by a
thread pool so that disk I/O overlaps compute (ZeRO-Infinity's prefetch and write-back; Rajbhandari
et al. 2021, Sec. 6).

- A write goes to a temporary file in the same directory, is flushed to the disk (``fsync``) and
  renamed over the name's file (``os.replace``, atomic on POSIX): a crash or a full disk mid-write
  leaves the previous file of that name intact, and the failed write's temporary file is removed.
- Operations on one name run in the order they were submitted (each waits for the one before), so a
  read after a write returns what was written; different names proceed in parallel.
- The directory is made if missing. ``close`` waits for pending I/O, removes the files written (and
  the directory if this made it and it is empty); so does a finalizer at interpreter exit or garbage
  collection if ``close`` was never called. ``close(delete=False)`` keeps them.
"""

from __future__ import annotations

import errno
import hashlib
import os
import re
import threading
import weakref
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

# (name, src, dst, nbytes, t0, t1) -> None: how a move is recorded; (bytes on disk, t) -> None: a sample
OnMove = Callable[[str, str, str, int, float, float], None]
OnDisk = Callable[[int, float], None]


def _write_file(path: str, array: np.ndarray) -> None:
    """Write ``array`` as ``.npy`` at ``path`` and flush it to the disk."""
    with open(path, "wb") as fh:
        np.save(fh, array, allow_pickle=False)
        fh.flush()
        os.fsync(fh.fileno())


_HEADER = threading.Lock()  # np.load parses a .npy header with ``ast``, not thread-safe in CPython 3.11 (gh-106905)


def _read_file(path: str) -> np.ndarray:
    """A ``.npy`` file's array: the header parsed under a lock (the I/O threads read at once), the
    data read without it."""
    with open(path, "rb") as fh:
        with _HEADER:
            version = np.lib.format.read_magic(fh)
            read_header = np.lib.format.read_array_header_1_0 if version == (1, 0) else \
                np.lib.format.read_array_header_2_0
            shape, fortran, dtype = read_header(fh)
        count = int(np.prod(shape, dtype=np.int64))
        data = np.fromfile(fh, dtype=dtype, count=count)
    if data.size != count:
        raise OSError(f"{path}: {data.size} of {count} elements on disk (a truncated file)")
    return data.reshape(shape, order="F" if fortran else "C")


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass


class _Disk:
    """What a finalizer needs to clean up, without a reference to the ``NvmeFiles`` object."""

    def __init__(self, directory: str, made: bool) -> None:
        self.directory, self.made = directory, made
        self.files: dict[str, int] = {}  # name -> array bytes in its file
        self.paths: dict[str, str] = {}

    def cleanup(self) -> None:
        for path in list(self.paths.values()):
            _remove(path)
        self.files.clear()
        self.paths.clear()
        if self.made and os.path.isdir(self.directory) and not os.listdir(self.directory):
            os.rmdir(self.directory)


class NvmeFiles:
    """Files under ``directory`` read and written by ``workers`` threads; see the module docstring."""

    def __init__(self, directory: str | os.PathLike[str], workers: int = 2) -> None:
        d = os.path.abspath(os.fspath(directory))
        made = False
        try:
            if not os.path.isdir(d):
                os.makedirs(d)
                made = True
            probe = os.path.join(d, f".minipar-probe{os.getpid()}-{threading.get_ident()}")
            with open(probe, "wb") as fh:
                fh.write(b"0")
            os.remove(probe)
        except OSError as exc:
            raise OSError(exc.errno, f"NVMe directory {d} is not writable: {exc.strerror or exc}") from exc
        self.directory = d
        self._disk = _Disk(d, made)
        self._lock = threading.Lock()
        self._pending: dict[str, Future[Any]] = {}  # the last operation submitted per name, until it is done
        self._pool = ThreadPoolExecutor(max(1, workers), thread_name_prefix="minipar-nvme")
        self._finalizer = weakref.finalize(self, _Disk.cleanup, self._disk)
        self.closed = False

    def resident(self) -> dict[str, int]:
        """Array bytes in each name's file."""
        with self._lock:
            return dict(self._disk.files)

    def path(self, name: str) -> str:
        """The file of ``name``: its safe characters and a hash of it (distinct names, distinct files)."""
        safe = re.sub(r"[^A-Za-z0-9_.-]", "_", name)[:80]
        return os.path.join(self.directory, f"{safe}-{hashlib.sha1(name.encode()).hexdigest()[:8]}.npy")

    def write(self, name: str, data: np.ndarray, on_move: OnMove, on_disk: OnDisk, now: Callable[[], float]
              ) -> Future[None]:
        """Write ``data`` (left unchanged until the future completes) to ``name``'s file."""
        path = self.path(name)

        def job() -> None:
            t0 = now()
            tmp = os.path.join(self.directory, f".{os.path.basename(path)}.tmp{os.getpid()}-{threading.get_ident()}")
            try:
                _write_file(tmp, data)
                os.replace(tmp, path)
            except OSError as exc:
                _remove(tmp)
                why = "disk full (ENOSPC)" if exc.errno == errno.ENOSPC else (exc.strerror or str(exc))
                msg = f"NVMe write of {name!r} ({data.nbytes} bytes) to {self.directory} failed: {why}"
                raise (OSError(exc.errno, msg) if exc.errno is not None else OSError(msg)) from exc
            except BaseException:
                _remove(tmp)
                raise
            t1 = now()
            with self._lock:
                self._disk.files[name] = data.nbytes
                self._disk.paths[name] = path
                total = sum(self._disk.files.values())
            on_move(name, "cpu", "nvme", data.nbytes, t0, t1)
            on_disk(total, t1)

        return self._submit(name, job)

    def read(self, name: str, on_move: OnMove, now: Callable[[], float]) -> Future[np.ndarray]:
        """Read ``name``'s file into a new array."""
        path = self.path(name)

        def job() -> np.ndarray:
            if name not in self._disk.files:
                raise KeyError(f"{name!r} has no NVMe file in {self.directory} (written: {sorted(self._disk.files)})")
            t0 = now()
            out = _read_file(path)
            on_move(name, "nvme", "cpu", out.nbytes, t0, now())
            return out

        return self._submit(name, job)

    def delete(self, name: str, on_disk: OnDisk, now: Callable[[], float]) -> Future[None]:
        """Remove ``name``'s file."""
        path = self.path(name)

        def job() -> None:
            _remove(path)
            with self._lock:
                self._disk.files.pop(name, None)
                self._disk.paths.pop(name, None)
                total = sum(self._disk.files.values())
            on_disk(total, now())

        return self._submit(name, job)

    def wait(self) -> None:
        """Block until every submitted operation has finished (errors stay on their futures)."""
        with self._lock:
            pending = list(self._pending.values())
        for f in pending:
            f.exception()

    def close(self, delete: bool = True) -> None:
        """Wait for pending I/O, stop the threads, remove temporaries a failed write left and, with
        ``delete``, the files (and the directory if made here and now empty). Idempotent."""
        if self.closed:
            return
        self.closed = True
        self.wait()
        self._pool.shutdown(wait=True)
        left = os.listdir(self.directory) if os.path.isdir(self.directory) else []
        for fname in left:  # temporaries of this process a crash left behind
            if fname.startswith(".") and f".npy.tmp{os.getpid()}-" in fname:
                _remove(os.path.join(self.directory, fname))
        if delete:
            self._finalizer()
        else:
            self._finalizer.detach()

    def _submit(self, name: str, job: Callable[[], Any]) -> Future[Any]:
        if self.closed:
            raise RuntimeError(f"the NVMe tier in {self.directory} is closed")
        with self._lock:
            prev = self._pending.get(name)

            def run() -> Any:
                if prev is not None:
                    prev.exception()  # wait for the previous operation on this name; its error is its own
                return job()

            fut = self._pool.submit(run)
            self._pending[name] = fut
        fut.add_done_callback(lambda f: self._forget(name, f))  # outside the lock: may run at once
        return fut

    def _forget(self, name: str, fut: Future[Any]) -> None:
        """Drop a finished future (and the array it may hold) unless a later one replaced it."""
        with self._lock:
            if self._pending.get(name) is fut:
                del self._pending[name]
