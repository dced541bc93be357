"""The NVMe tier: one ``.npy`` file per tensor name under a directory, read and written for real by a
thread pool so that disk I/O overlaps compute (ZeRO-Infinity's prefetch and write-back; Rajbhandari
et al. 2021, Sec. 6).

- A write goes to a temporary file in the same directory, is flushed to the disk (``fsync``) and
  renamed over the name's file (``os.replace``, atomic on POSIX): a crash or a full disk mid-write
  leaves the previous file of that name intact, and the failed write's temporary file is removed. A
  full disk (``ENOSPC``, or numpy's short write) raises ``OSError(ENOSPC)`` in one line naming the
  file, the bytes it asked for (header and data) and the bytes free (``os.statvfs``, after the removal).
- Operations on one name run in the order they were submitted (each waits for the one before), so a
  read after a write returns what was written; different names proceed in parallel.
- A name's file is ``<name>.npy`` with every character but ``A-Za-z0-9_.-`` (and a leading ``.``)
  escaped as ``%XX`` of its UTF-8 bytes, so the name is read back from the file name; a name whose
  escaped form is longer than ``LONG`` characters is cut and marked ``~<sha1 of the name>``.
- The directory is made if missing. ``close`` waits for pending I/O, removes the files written (and
  the directory if this made it and it is empty); so does a finalizer at interpreter exit or garbage
  collection if ``close`` was never called. ``close(delete=False)`` keeps them.
- ``reopen=True`` opens a directory a previous object (or process, killed or not) left: every
  ``.npy`` file in it is registered under the name its file name gives (a cut ``~`` name: once an
  operation names it). Each file's header and size are checked first: an unreadable or truncated one
  is refused with an ``OSError`` naming it. Temporaries of unfinished writes (``.<file>.tmp<pid>-<t>``)
  are not registered, not removed, and listed in ``stale``. A reopened directory is kept by ``close()``
  and by the finalizer; only an explicit ``close(delete=True)`` removes its files.
"""

from __future__ import annotations

import errno
import hashlib
import io
import os
import threading
import urllib.parse
import weakref
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from minipar.npy import HEADER

# (name, src, dst, nbytes, t0, t1) -> None: how a move is recorded; (bytes on disk, t) -> None: a sample
OnMove = Callable[[str, str, str, int, float, float], None]
OnDisk = Callable[[int, float], None]


def _write_file(path: str, array: np.ndarray) -> None:
    """Write ``array`` as ``.npy`` at ``path`` and flush it to the disk."""
    with open(path, "wb") as fh:
        np.save(fh, array, allow_pickle=False)
        fh.flush()
        os.fsync(fh.fileno())


def _disk_full(exc: OSError) -> bool:
    """A write that found no room: ``ENOSPC``, or numpy's short write ("3280 requested and 109 written")."""
    return exc.errno == errno.ENOSPC or (exc.errno is None and " requested and " in str(exc))


def _file_bytes(array: np.ndarray) -> int:
    """The bytes of ``array``'s ``.npy`` file: its header (as ``np.save`` writes it) and its data."""
    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(buf, np.lib.format.header_data_from_array_1_0(array))
    return len(buf.getvalue()) + array.nbytes


def _free_bytes(directory: str) -> int:
    """Bytes an unprivileged writer may still use on ``directory``'s filesystem (``os.statvfs``)."""
    st = os.statvfs(directory)
    return st.f_bavail * st.f_frsize


def _header(fh: Any) -> tuple[tuple[int, ...], bool, np.dtype]:
    """(shape, fortran order, dtype) of the ``.npy`` file open in ``fh``, left at its data."""
    with HEADER:  # minipar.npy: ``ast`` is not thread-safe in CPython 3.11
        version = np.lib.format.read_magic(fh)
        read_header = np.lib.format.read_array_header_1_0 if version == (1, 0) else \
            np.lib.format.read_array_header_2_0
        return read_header(fh)


def _read_file(path: str) -> np.ndarray:
    """A ``.npy`` file's array: the header parsed under a lock (the I/O threads read at once), the
    data read without it."""
    with open(path, "rb") as fh:
        shape, fortran, dtype = _header(fh)
        count = int(np.prod(shape, dtype=np.int64))
        data = np.fromfile(fh, dtype=dtype, count=count)
    if data.size != count:
        raise OSError(f"{path}: {data.size} of {count} elements on disk (a truncated file)")
    return data.reshape(shape, order="F" if fortran else "C")


LONG = 200  # longest escaped name kept whole in a file name (a file name has at most 255 bytes)


def file_name(name: str) -> str:
    """The file name of ``name`` (see the module docstring)."""
    if not name:
        raise ValueError("an NVMe name must not be empty")
    enc = urllib.parse.quote(name, safe="").replace("~", "%7E")
    if enc.startswith("."):
        enc = "%2E" + enc[1:]
    if len(enc) > LONG:
        enc = f"{enc[:LONG - 41]}~{hashlib.sha1(name.encode()).hexdigest()}"
    return enc + ".npy"


def name_of(fname: str) -> str | None:
    """The name whose file is ``fname``; None for a cut (``~``) name or a file this tier does not name."""
    if not fname.endswith(".npy") or "~" in fname:
        return None
    try:
        name = urllib.parse.unquote(fname[:-4], errors="strict")
    except UnicodeDecodeError:
        return None
    return name if name and file_name(name) == fname else None


def check_file(path: str) -> int:
    """The array bytes of the ``.npy`` file at ``path``; ``OSError`` naming it if its header is
    unreadable or its size is not the header's plus the array's."""
    try:
        with open(path, "rb") as fh:
            shape, _, dtype = _header(fh)
            start = fh.tell()
        size = os.path.getsize(path)
    except (OSError, ValueError) as exc:
        raise OSError(f"NVMe file {path} is unreadable: {exc}") from exc
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if size != start + nbytes:
        raise OSError(f"NVMe file {path} is truncated: {size - start} of {nbytes} array bytes on disk")
    return nbytes


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
        self.cut: dict[str, int] = {}  # reopened files of cut names, not named yet: path -> array bytes
        self.keep = False  # a reopened directory: the finalizer removes nothing

    def cleanup(self) -> None:
        if self.keep:
            return
        for path in list(self.cut):
            _remove(path)
        self.cut.clear()
        for path in list(self.paths.values()):
            _remove(path)
        self.files.clear()
        self.paths.clear()
        if self.made and os.path.isdir(self.directory) and not os.listdir(self.directory):
            os.rmdir(self.directory)


class NvmeFiles:
    """Files under ``directory`` read and written by ``workers`` threads; ``reopen`` registers the
    files already there (``stale``: the temporaries found). See the module docstring."""

    def __init__(self, directory: str | os.PathLike[str], workers: int = 2, reopen: bool = False) -> None:
        d = os.path.abspath(os.fspath(directory))
        made = False
        if reopen and not os.path.isdir(d):
            raise FileNotFoundError(errno.ENOENT, f"NVMe directory {d} to reopen does not exist")
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
        self.reopened = reopen
        self.stale: list[str] = []
        if reopen:
            self._register()
        self._lock = threading.Lock()
        self._pending: dict[str, Future[Any]] = {}  # the last operation submitted per name, until it is done
        self._pool = ThreadPoolExecutor(max(1, workers), thread_name_prefix="minipar-nvme")
        self._finalizer = weakref.finalize(self, _Disk.cleanup, self._disk)
        self.closed = False

    def _register(self) -> None:
        """``reopen``: check and register every ``.npy`` file, list the temporaries."""
        disk = self._disk
        disk.keep = True
        for fname in sorted(os.listdir(self.directory)):
            path = os.path.join(self.directory, fname)
            if fname.startswith(".") and ".npy.tmp" in fname:
                self.stale.append(fname)
            elif fname.endswith(".npy") and not fname.startswith(".") and os.path.isfile(path):
                nbytes = check_file(path)
                name = name_of(fname)
                if name is None:
                    disk.cut[path] = nbytes
                else:
                    disk.files[name], disk.paths[name] = nbytes, path

    def _named(self, name: str, path: str) -> None:
        """A reopened file of a cut name, named now (call under the lock)."""
        if path in self._disk.cut:
            self._disk.files[name] = self._disk.cut.pop(path)
            self._disk.paths[name] = path

    def resident(self) -> dict[str, int]:
        """Array bytes in each name's file (a reopened cut name's once an operation named it)."""
        with self._lock:
            return dict(self._disk.files)

    def path(self, name: str) -> str:
        """The file of ``name`` (see the module docstring; distinct names, distinct files)."""
        return os.path.join(self.directory, file_name(name))

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
                if _disk_full(exc):
                    raise OSError(errno.ENOSPC, f"NVMe write of {name!r} failed, disk full: {path} asked for "
                                  f"{_file_bytes(data)} bytes, {_free_bytes(self.directory)} free") from exc
                msg = f"NVMe write of {name!r} ({data.nbytes} bytes) to {self.directory} failed: {exc.strerror or exc}"
                raise (OSError(exc.errno, msg) if exc.errno is not None else OSError(msg)) from exc
            except BaseException:
                _remove(tmp)
                raise
            t1 = now()
            with self._lock:
                self._disk.cut.pop(path, None)
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
            with self._lock:
                self._named(name, path)
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
                self._disk.cut.pop(path, None)
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

    def close(self, delete: bool | None = None) -> None:
        """Wait for pending I/O, stop the threads, remove temporaries a failed write of this process
        left and, with ``delete``, the files (and the directory if made here and now empty). ``delete``
        defaults to True, to False for a reopened directory. Idempotent."""
        if delete is None:
            delete = not self.reopened
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
            self._disk.keep = False
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
