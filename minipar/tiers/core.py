"""The device pool and the ``Tiers`` object (see the package docstring); NVMe I/O is in ``nvme.py``."""

from __future__ import annotations

import json
import os
import threading
from concurrent.futures import Future
from dataclasses import asdict, dataclass, fields
from typing import Any

import numpy as np

from minipar import trace
from minipar.cost.offload import transfer_seconds
from minipar.residency import NotOnDevice
from minipar.tiers.files import aligned_copy, resident
from minipar.tiers.nvme import NvmeFiles, OnDisk, OnMove


class DeviceOutOfMemory(MemoryError):
    """An allocation past the device budget. ``budget``, ``resident`` (name -> bytes), ``name``,
    ``request`` and ``smallest_budget`` (resident + request) are attributes; the message names them."""

    SHOWN = 4  # resident tensors named in the message, largest first

    def __init__(self, budget: int, resident: dict[str, int], name: str, request: int) -> None:
        self.budget, self.resident, self.name, self.request = budget, dict(resident), name, request
        used = sum(resident.values())
        self.smallest_budget = used + request
        items = sorted(resident.items(), key=lambda kv: (-kv[1], kv[0]))
        shown = ", ".join(f"{k}: {v}" for k, v in items[: self.SHOWN])
        rest = items[self.SHOWN:]
        if rest:
            shown += f", and {len(rest)} more: {sum(v for _, v in rest)}"
        held = f"{used} bytes resident ({shown})" if items else "nothing resident"
        super().__init__(
            f"device out of memory: budget {budget} bytes, {held}, request {name!r}: {request} bytes; "
            f"the smallest budget that would have worked is {self.smallest_budget} bytes"
        )


@dataclass(frozen=True)
class Bandwidth:
    """Bytes per second of each link, host <-> device (``pcie``), NVMe reads and writes, and seconds per
    request beside them (``*_latency``; ``nvme_sync``: what a synced, atomic write adds: a new file,
    ``fdatasync``, a rename, plus ``nvme_sync_per_byte`` seconds per byte written; ``nvme_sync_spread``:
    its interquartile range, measured, not modelled).
    The defaults are typical PCIe 4 and NVMe figures, not measured, with no latency;
    ``minipar.tiers.rates.measure`` fits them on this machine, ``save`` / ``load`` keep them."""

    pcie: float = 16e9
    nvme_read: float = 3e9
    nvme_write: float = 2e9
    pcie_latency: float = 0.0
    nvme_read_latency: float = 0.0
    nvme_write_latency: float = 0.0
    nvme_sync: float = 0.0
    nvme_sync_spread: float = 0.0
    nvme_sync_per_byte: float = 0.0
    source: str = "typical PCIe 4 and NVMe figures (not measured)"

    def seconds(self, src: str, dst: str, nbytes: int, synced: bool = False) -> float:
        """Modelled time to move ``nbytes`` from tier ``src`` to ``dst`` (see ``transfer_seconds``)."""
        return transfer_seconds(nbytes, src, dst, self, synced)

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write these rates as JSON, whole or not at all (a temporary file renamed over ``path``)."""
        tmp = f"{os.fspath(path)}.tmp{os.getpid()}"
        with open(tmp, "w") as fh:
            json.dump(asdict(self), fh, indent=2, sort_keys=True)
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Bandwidth:
        """The rates ``save`` wrote; ``ValueError`` in one line naming the file and what is wrong."""
        with open(path) as fh:
            try:
                data = json.load(fh)
            except json.JSONDecodeError as exc:
                raise ValueError(f"tier rates file {path}: not JSON ({exc})") from None
        names = {f.name for f in fields(cls)}
        if not isinstance(data, dict) or set(data) - names:
            raise ValueError(f"tier rates file {path}: expected an object with fields {sorted(names)}")
        bad = [k for k, v in data.items() if k != "source" and not (isinstance(v, (int, float)) and v >= 0)]
        if bad:
            raise ValueError(f"tier rates file {path}: {', '.join(bad)} must be numbers >= 0")
        return cls(**data)


class Tiers:
    """One rank's memory tiers: a device pool of ``device_budget`` bytes, host memory, and NVMe files
    under ``nvme_dir`` (made if missing; its files removed by ``close``, the directory too if this
    made it) read and written by ``workers`` threads. ``reopen=True`` opens an existing ``nvme_dir``
    with the files a previous object or process left in it (``minipar.tiers.nvme``: checked, named
    from their file names; ``stale`` lists the temporaries of unfinished writes found); its files are
    kept by ``close()`` unless ``close(delete=True)``. Use as a context manager: a normal exit waits
    for pending I/O and removes the files (a reopened directory's: kept); an exit by exception keeps
    them (intact, for inspection)."""

    def __init__(self, device_budget: int, nvme_dir: str | None = None, bandwidth: Bandwidth = Bandwidth(),
                 workers: int = 4, reopen: bool = False) -> None:
        if device_budget < 0:
            raise ValueError(f"device_budget must be >= 0, got {device_budget}")
        self.device_budget = int(device_budget)
        self.bandwidth = bandwidth
        self._lock = threading.Lock()
        self._device: dict[str, np.ndarray] = {}
        self._ids: set[int] = set()
        self.device_bytes = 0
        self.peak_device_bytes = 0
        if reopen and nvme_dir is None:
            raise ValueError("reopen=True needs the nvme_dir to reopen")
        self._files = None if nvme_dir is None else NvmeFiles(nvme_dir, workers, reopen)
        self.nvme_dir = None if self._files is None else self._files.directory
        self.stale: list[str] = [] if self._files is None else list(self._files.stale)

    # ---- device ----------------------------------------------------------------------------

    def to_device(self, name: str, array: np.ndarray) -> np.ndarray:
        """Copy ``array`` to the device under ``name`` and return the device copy. If ``name``
        is resident with the same shape and dtype, its buffer is overwritten in place (no new
        allocation); a different shape or dtype must be ``free``d first."""
        array = np.asarray(array)
        src = "device" if self.on_device(array) else "cpu"  # a device-to-device copy is free in the model
        rec = trace.current()
        old = self._device.get(name)
        if old is not None:
            if old.shape != array.shape or old.dtype != array.dtype:
                raise ValueError(f"{name!r} is resident as {old.dtype}{list(old.shape)}; free it before placing "
                                 f"a {array.dtype}{list(array.shape)}")
            t0 = trace.now()
            np.copyto(old, array)
            dev, t1 = old, trace.now()
        else:
            self._charge(name, array.nbytes)
            dev = resident(np.empty(array.shape, array.dtype))  # allocated and mapped: the allocator's, not the move's
            t0 = trace.now()  # the move is the copy: the pool's bookkeeping before and after is not in it
            np.copyto(dev, array)
            t1 = trace.now()
            self._place(name, dev, rec)
        self._transfer(rec, name, src, "device", array.nbytes, t0, t1)
        return dev

    def adopt(self, name: str, array: np.ndarray) -> np.ndarray:
        """Charge ``array``, the result of compute on the device (an activation, a gradient), to the
        pool under ``name`` without copying it; returns it, now device-resident."""
        if name in self._device:
            raise ValueError(f"{name!r} is already resident on the device; free it first")
        if self.on_device(array):
            raise ValueError(f"{name!r}: this array is already device memory (or a view of it); adopting it "
                             "would count its bytes twice")
        self._charge(name, array.nbytes)
        self._place(name, array, trace.current())
        return array

    def empty(self, name: str, shape: int | tuple[int, ...], dtype: Any = np.float32) -> np.ndarray:
        """Allocate an uninitialised device array under ``name`` (charged before it is made)."""
        if name in self._device:
            raise ValueError(f"{name!r} is already resident on the device; free it first")
        self._charge(name, int(np.prod(shape)) * np.dtype(dtype).itemsize)
        dev = np.empty(shape, dtype)
        self._place(name, dev, trace.current())
        return dev

    def device_array(self, name: str) -> np.ndarray:
        """The device array resident under ``name``."""
        try:
            return self._device[name]
        except KeyError:
            raise KeyError(f"{name!r} is not resident on the device (resident: {sorted(self._device)})") from None

    def free(self, name: str) -> None:
        """Release ``name``'s device memory; its array no longer passes ``require_device``."""
        with self._lock:
            if name not in self._device:
                raise KeyError(f"{name!r} is not resident on the device (resident: {sorted(self._device)})")
            arr = self._device.pop(name)
            self._ids.discard(id(arr))
            self.device_bytes -= arr.nbytes
            used = self.device_bytes
        trace.memory("device", used)

    def to_cpu(self, name: str, array: np.ndarray | None = None) -> np.ndarray:
        """Copy a device array (``name``'s when ``array`` is None) to a new host array. The device copy
        stays resident: ``free`` it when done."""
        array = self.device_array(name) if array is None else array
        self.require_device(array)
        host = resident(np.empty_like(array))  # allocated and mapped before the move, as pinned buffers are
        t0 = trace.now()
        np.copyto(host, array)
        self._transfer(trace.current(), name, "device", "cpu", host.nbytes, t0, trace.now())
        return host

    def require_device(self, *arrays: Any) -> None:
        """Raise ``NotOnDevice`` unless every array (or tensor's ``.data``) is resident on this device,
        or a view of such an array: compute only runs on device-resident data."""
        for i, a in enumerate(arrays):
            if not isinstance(a, np.ndarray):
                a = getattr(a, "data", a)
            if not self.on_device(a):
                what = f"{a.dtype}{list(a.shape)}" if isinstance(a, np.ndarray) else type(a).__name__
                raise NotOnDevice(f"argument {i} ({what}) is not resident on the device: compute runs only on "
                                  "arrays placed by to_device, adopt or empty (and not freed since)")

    def on_device(self, array: Any) -> bool:
        """Whether ``array`` is a device array of this pool, or a view of one."""
        a = array
        while isinstance(a, np.ndarray):
            if id(a) in self._ids:
                return True
            a = a.base
        return False

    def resident(self, tier: str = "device") -> dict[str, int]:
        """Bytes held per name in ``tier`` (``"device"`` or ``"nvme"``; host memory is not pooled)."""
        if tier == "device":
            return {k: v.nbytes for k, v in self._device.items()}
        if tier == "nvme":
            return {} if self._files is None else self._files.resident()
        raise ValueError(f"tier {tier!r}: resident() tracks 'device' and 'nvme' (cpu is ordinary numpy memory)")

    def _charge(self, name: str, nbytes: int) -> None:
        with self._lock:
            if self.device_bytes + nbytes > self.device_budget:
                raise DeviceOutOfMemory(self.device_budget, self.resident("device"), name, nbytes)
            self.device_bytes += nbytes
            self.peak_device_bytes = max(self.peak_device_bytes, self.device_bytes)

    def _place(self, name: str, arr: np.ndarray, rec: trace.Recorder | None) -> None:
        with self._lock:
            self._device[name] = arr
            self._ids.add(id(arr))
            used = self.device_bytes
        if rec is not None:
            t = trace.now()
            rec.add("memory", "device", t, t, nbytes=used)

    def _transfer(self, rec: trace.Recorder | None, name: str, src: str, dst: str, nbytes: int,
                  t0: float, t1: float, synced: bool = False) -> None:
        if rec is not None:
            args = {"src": src, "dst": dst, "modelled_s": self.bandwidth.seconds(src, dst, nbytes, synced)}
            rec.add("transfer", name, t0, t1, nbytes=int(nbytes), args={**args, "synced": True} if synced else args)

    # ---- NVMe ------------------------------------------------------------------------------

    def write_nvme(self, name: str, array: np.ndarray, copy: bool = True, in_place: bool = False) -> Future[None]:
        """Write host ``array`` to ``name``'s file in the background; the future completes when the
        file is in place. With ``copy`` (default) the array is snapshotted now (into page-aligned
        memory, written from there), so the caller may change it at once; without, it must stay
        unchanged until the future completes. Operations on one name run in the order submitted.
        A write is atomic and flushed: a failed one (full disk, crash) leaves the previous file intact
        and the future's exception says why in one line (a full disk: the file, the bytes it asked
        for and the bytes free). ``in_place``: written into the name's file when it holds an array
        of the same dtype and shape, not flushed until ``sync_nvme``, and not atomic (see
        ``minipar.tiers.nvme``): for state that a later atomic write commits."""
        files = self._need_files()
        if self.on_device(array):
            raise NotOnDevice(f"{name!r}: write_nvme takes host arrays; copy it with to_cpu first")
        data, raw = aligned_copy(np.asarray(array)) if copy else (np.asarray(array), None)
        rec = trace.current()
        return files.write(name, data, self._mover(rec), self._disk_sampler(rec), trace.now, in_place, raw)

    def sync_nvme(self) -> None:
        """Wait for every NVMe operation and flush the files written in place since the last call."""
        self._need_files().sync()

    def read_nvme(self, name: str, out: np.ndarray | None = None) -> Future[np.ndarray]:
        """Read ``name``'s file into a new host array in the background (after any I/O on ``name``
        submitted before); the future's result is the array, bit-exact as written. ``out``: read into
        this array instead (its dtype and shape; in place, without a copy, when made by
        ``minipar.tiers.files.aligned_empty``)."""
        if out is not None and self.on_device(out):
            raise NotOnDevice(f"{name!r}: read_nvme reads into host arrays, not device memory")
        return self._need_files().read(name, self._mover(trace.current()), trace.now, out)

    def delete_nvme(self, name: str) -> Future[None]:
        """Remove ``name``'s file in the background (after pending I/O on it)."""
        return self._need_files().delete(name, self._disk_sampler(trace.current()), trace.now)

    def wait(self) -> None:
        """Block until every submitted NVMe read and write has finished (errors stay on the futures)."""
        if self._files is not None:
            self._files.wait()

    def close(self, delete: bool | None = None) -> None:
        """Wait for pending I/O, stop the threads and (``delete``) remove this object's files, and the
        directory if this object made it and it is now empty. ``delete`` defaults to True, and to
        False for a reopened directory (its files are kept unless asked). Idempotent."""
        if self._files is not None:
            self._files.close(delete)

    def __enter__(self) -> Tiers:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        self.close(delete=None if exc_type is None else False)

    def _need_files(self) -> NvmeFiles:
        if self._files is None:
            raise ValueError("this Tiers has no NVMe tier: pass nvme_dir to use write_nvme / read_nvme")
        return self._files

    def _mover(self, rec: trace.Recorder | None) -> OnMove:
        """Records a move on ``rec`` (captured on the caller's thread: the I/O threads have no recorder)."""
        def on_move(name: str, src: str, dst: str, nbytes: int, t0: float, t1: float, synced: bool) -> None:
            self._transfer(rec, name, src, dst, nbytes, t0, t1, synced)
        return on_move

    @staticmethod
    def _disk_sampler(rec: trace.Recorder | None) -> OnDisk:
        def on_disk(nbytes: int, t: float) -> None:
            if rec is not None:
                rec.add("memory", "nvme", t, t, nbytes=int(nbytes))
        return on_disk
