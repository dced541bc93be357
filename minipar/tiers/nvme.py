"""The NVMe tier: one preallocated, page-aligned ``.npy`` file per tensor name under a directory
(``minipar.tiers.files``), read and written in place with ``os.preadv`` / ``os.pwrite`` from
page-aligned memory, ``O_DIRECT`` where the filesystem allows it, by a thread pool, several requests
in flight, so that disk I/O overlaps compute (ZeRO-Infinity's prefetch and write-back, DeepNVMe;
Rajbhandari et al. 2021, Sec. 6).

- A write (default) is atomic: a new file in the same directory, preallocated (``posix_fallocate``:
  a full disk fails there, before any data), written, flushed (``fdatasync``) and renamed over the
  name's file (``os.replace``): a crash or a full disk mid-write leaves the previous file of that name
  intact, and the failed write's temporary file is removed. A full disk raises ``OSError(ENOSPC)`` in
  one line naming the file, the bytes it asked for (header and data, each padded to a page) and the
  bytes free (``os.statvfs``, after the removal).
- ``in_place=True``: the data written into the name's existing file at once (same dtype and shape;
  otherwise an atomic write makes the file), not flushed: what a step that rewrites its state does.
  Not atomic: a failed or killed one leaves the file part old, part new (a read of it then refuses,
  until a write succeeds), so callers write in place only where a later atomic write commits the
  result (``parallel.offload.commit``: two slots and a manifest). ``sync`` flushes the files written
  in place since the last ``sync`` before such a commit (one ``syncfs``: a cache flush for them all).
- Operations on one name run in the order they were submitted (each waits for the one before), so a
  read after a write returns what was written; different names proceed in parallel.
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

import ctypes
import errno
import os
import threading
import weakref
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from minipar.tiers.files import (
    LONG,
    Layout,
    check_file,
    data_bytes,
    file_name,
    free_bytes,
    layout_of,
    name_of,
    open_file,
    padded,
    page_aligned,
    resident,
)

__all__ = ["LONG", "NvmeFiles", "file_name", "name_of"]

# (name, src, dst, nbytes, t0, t1, synced) -> None: how a move is recorded; (bytes on disk, t) -> None: a sample
OnMove = Callable[[str, str, str, int, float, float, bool], None]
OnDisk = Callable[[int, float], None]


def _pwrite_all(fd: int, raw: np.ndarray, offset: int) -> None:
    view, done = memoryview(raw), 0
    while done < len(view):
        done += os.pwrite(fd, view[done:], offset + done)


def _write_file(path: str, head: bytes, raw: np.ndarray) -> None:
    """A new file at ``path``: preallocated, ``head`` then ``raw`` (whole pages), flushed to the disk."""
    fd, _ = open_file(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    try:
        os.posix_fallocate(fd, 0, len(head) + len(raw))
        page = page_aligned(len(head))
        page[:] = np.frombuffer(head, np.uint8)
        _pwrite_all(fd, page, 0)
        _pwrite_all(fd, raw, len(head))
        os.fdatasync(fd)
    finally:
        os.close(fd)


def _write_into(path: str, fd: int, offset: int, raw: np.ndarray) -> None:
    """``raw`` (whole pages) written into ``path``'s data at ``offset`` through ``fd``, not flushed."""
    _pwrite_all(fd, raw, offset)


def _syncfs() -> Callable[[int], int] | None:
    """The C library's ``syncfs(fd)`` (Linux), or None."""
    try:
        return ctypes.CDLL(None, use_errno=True).syncfs
    except (OSError, AttributeError):
        return None


_SYNCFS = _syncfs()


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass


class _Disk:
    """What a finalizer needs to clean up, without a reference to the ``NvmeFiles`` object."""

    def __init__(self, directory: str, made: bool) -> None:
        self.directory, self.made = directory, made
        self.files: dict[str, Layout] = {}  # name -> its file's layout
        self.total = 0  # array bytes in the files of ``files``
        self.paths: dict[str, str] = {}
        self.cut: dict[str, Layout] = {}  # reopened files of cut names, not named yet: path -> layout
        self.fds: dict[str, tuple[int, bool]] = {}  # path -> (open descriptor, O_DIRECT)
        self.keep = False  # a reopened directory: the finalizer removes nothing

    def close_fd(self, path: str) -> None:
        fd = self.fds.pop(path, None)
        if fd is not None:
            os.close(fd[0])

    def close_fds(self) -> None:
        for path in list(self.fds):
            self.close_fd(path)

    def cleanup(self) -> None:
        self.close_fds()
        if self.keep:
            return
        for path in list(self.cut):
            _remove(path)
        self.cut.clear()
        for path in list(self.paths.values()):
            _remove(path)
        self.files.clear()
        self.paths.clear()
        self.total = 0
        if self.made and os.path.isdir(self.directory) and not os.listdir(self.directory):
            os.rmdir(self.directory)


class NvmeFiles:
    """Files under ``directory`` read and written by ``workers`` threads; ``reopen`` registers the
    files already there (``stale``: the temporaries found). See the module docstring."""

    def __init__(self, directory: str | os.PathLike[str], workers: int = 4, reopen: bool = False) -> None:
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
        self._torn: set[str] = set()  # names whose in-place write failed part-way
        self._unsynced: set[str] = set()  # paths written in place since the last sync
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
                layout = check_file(path)
                name = name_of(fname)
                if name is None:
                    disk.cut[path] = layout
                else:
                    disk.files[name], disk.paths[name] = layout, path
                    disk.total += layout.nbytes

    def _named(self, name: str, path: str) -> None:
        """A reopened file of a cut name, named now (call under the lock)."""
        if path in self._disk.cut:
            self._disk.files[name] = self._disk.cut.pop(path)
            self._disk.paths[name] = path
            self._disk.total += self._disk.files[name].nbytes

    def resident(self) -> dict[str, int]:
        """Array bytes in each name's file (a reopened cut name's once an operation named it)."""
        with self._lock:
            return {k: v.nbytes for k, v in self._disk.files.items()}

    def path(self, name: str) -> str:
        """The file of ``name`` (see the module docstring; distinct names, distinct files)."""
        return os.path.join(self.directory, file_name(name))

    def _fd(self, path: str, layout: Layout) -> tuple[int, bool]:
        """The open descriptor of ``path`` (``O_DIRECT`` when its data is page-aligned)."""
        if path not in self._disk.fds:
            self._disk.fds[path] = open_file(path, os.O_RDWR, direct=layout.aligned)
        return self._disk.fds[path]

    def write(self, name: str, data: np.ndarray, on_move: OnMove, on_disk: OnDisk, now: Callable[[], float],
              in_place: bool = False, raw: np.ndarray | None = None) -> Future[None]:
        """Write ``data`` (left unchanged until the future completes) to ``name``'s file, atomically or
        (``in_place``, when its file has ``data``'s layout) into it. ``raw``: ``data``'s bytes already
        page-aligned in whole pages (``files.aligned_copy``), else they are copied so if need be."""
        path = self.path(name)

        def job() -> None:
            t0 = now()
            layout, head = layout_of(data)
            data_raw = raw if raw is not None else data_bytes(data, layout)
            with self._lock:
                self._named(name, path)
                same = self._disk.files.get(name) == layout
            if in_place and same:
                self._in_place(name, path, layout, data_raw)
            else:
                self._atomic(name, path, layout, head, data_raw)
            t1 = now()
            with self._lock:
                self._disk.cut.pop(path, None)
                old = self._disk.files.get(name)
                self._disk.files[name], self._disk.paths[name] = layout, path
                self._disk.total += layout.nbytes - (0 if old is None else old.nbytes)
                total = self._disk.total
            on_move(name, "cpu", "nvme", data.nbytes, t0, t1, not (in_place and same))
            on_disk(total, t1)

        return self._submit(name, job)

    def _in_place(self, name: str, path: str, layout: Layout, raw: np.ndarray) -> None:
        try:
            _write_into(path, self._fd(path, layout)[0], layout.offset, raw)
        except OSError as exc:
            self._torn.add(name)
            raise OSError(exc.errno, f"NVMe write of {name!r} in place ({layout.nbytes} bytes) to {path} failed "
                          f"part-way: {exc.strerror or exc}") from exc
        self._torn.discard(name)
        with self._lock:
            self._unsynced.add(path)

    def _atomic(self, name: str, path: str, layout: Layout, head: bytes, raw: np.ndarray) -> None:
        tmp = os.path.join(self.directory, f".{os.path.basename(path)}.tmp{os.getpid()}-{threading.get_ident()}")
        try:
            _write_file(tmp, head, raw)
            self._disk.close_fd(path)  # the descriptor of the file the rename replaces
            os.replace(tmp, path)
        except OSError as exc:
            _remove(tmp)
            if exc.errno == errno.ENOSPC:
                raise OSError(errno.ENOSPC, f"NVMe write of {name!r} failed, disk full: {path} asked for "
                              f"{layout.file_bytes} bytes, {free_bytes(self.directory)} free") from exc
            msg = f"NVMe write of {name!r} ({layout.nbytes} bytes) to {self.directory} failed: {exc.strerror or exc}"
            raise OSError(exc.errno, msg) from exc
        except BaseException:
            _remove(tmp)
            raise
        self._torn.discard(name)
        with self._lock:
            self._unsynced.discard(path)

    def read(self, name: str, on_move: OnMove, now: Callable[[], float], out: np.ndarray | None = None
             ) -> Future[np.ndarray]:
        """Read ``name``'s file into a new page-aligned array, or into ``out`` (its dtype and shape; without a
        copy when it lies in page-aligned memory, ``files.aligned_empty``)."""
        path = self.path(name)

        def job() -> np.ndarray:
            with self._lock:
                self._named(name, path)
                layout = self._disk.files.get(name)
            if layout is None:
                raise KeyError(f"{name!r} has no NVMe file in {self.directory} (written: {sorted(self._disk.files)})")
            if name in self._torn:
                raise OSError(errno.EIO, f"NVMe file {path} of {name!r} is torn: its last write in place failed "
                              "part-way; write it again")
            if out is not None and (out.dtype != layout.dtype or out.shape != layout.shape):
                raise ValueError(f"read_nvme({name!r}, out=): out is {out.dtype}{list(out.shape)}, the file holds "
                                 f"{layout.dtype}{list(layout.shape)}")
            own = None if out is None or layout.fortran != (out.flags.f_contiguous and not out.flags.c_contiguous) \
                else padded(out)
            raw = own if own is not None else resident(page_aligned(layout.nbytes))  # no page faults in the move
            t0 = now()
            fd, direct = self._fd(path, layout)
            want = len(raw) if direct else layout.nbytes
            got = os.preadv(fd, [memoryview(raw)[:want]], layout.offset) if want else 0
            if got < layout.nbytes:
                raise OSError(f"{path}: {got} of {layout.nbytes} array bytes on disk (a truncated file)")
            result = layout.array(raw) if out is None else out
            if out is not None and own is None:
                np.copyto(out, layout.array(raw))
            on_move(name, "nvme", "cpu", layout.nbytes, t0, now(), False)
            return result

        return self._submit(name, job)

    def delete(self, name: str, on_disk: OnDisk, now: Callable[[], float]) -> Future[None]:
        """Remove ``name``'s file."""
        path = self.path(name)

        def job() -> None:
            self._disk.close_fd(path)
            _remove(path)
            self._torn.discard(name)
            with self._lock:
                self._unsynced.discard(path)
                self._disk.cut.pop(path, None)
                old = self._disk.files.pop(name, None)
                self._disk.paths.pop(name, None)
                self._disk.total -= 0 if old is None else old.nbytes
                total = self._disk.total
            on_disk(total, now())

        return self._submit(name, job)

    def sync(self) -> None:
        """Wait for every operation, then flush the files written in place since the last ``sync`` to
        the disk: one ``syncfs`` of their filesystem where the C library has it (one cache flush for
        them all), else ``fdatasync`` each; ``OSError`` in one line naming what failed."""
        self.wait()
        with self._lock:
            paths, self._unsynced = sorted(self._unsynced), set()
        fds = [self._disk.fds[p][0] for p in paths if p in self._disk.fds]
        if not fds:
            return
        try:
            if _SYNCFS is not None:
                if _SYNCFS(fds[0]) != 0:
                    err = ctypes.get_errno()
                    raise OSError(err, os.strerror(err))
            else:
                for fd in fds:
                    os.fdatasync(fd)
        except OSError as exc:
            raise OSError(exc.errno, f"NVMe sync of {len(fds)} files in {self.directory} failed: "
                          f"{exc.strerror or exc}") from exc

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
            self._disk.close_fds()
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
