"""What a move between tiers costs on this machine, measured: the disk and memory copies.

- ``disk_seconds``: the disk's own time for ``count`` sequential requests of ``size`` bytes into one
  preallocated file, one at a time (``os.pwrite`` / ``os.preadv`` from page-aligned memory): the
  reference the NVMe tier is held against (``benchmarks/offload.py``) and what ``measure`` fits.
- ``measure(directory)``: ``Bandwidth`` fitted on this machine (``minipar calibrate``, lesson 7,
  ``benchmarks/offload.py``): per request ``t = latency + n / bandwidth`` (``rates.fit_line``,
  relative least squares) for sequential disk writes and reads at ``SIZES`` (64 KiB .. 16 MiB, the
  sizes offload moves), for the copy a move between host and device is here (``np.array(copy=True)``:
  the device is host memory), and the extra cost of a synced write (a new file, ``fdatasync``, the
  rename that makes it atomic: ``nvme.NvmeFiles``' default write) as the median over small files.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Sequence

import numpy as np

from minipar.rates import fit_line
from minipar.tiers.core import Bandwidth
from minipar.tiers.files import PAGE, open_file, page_aligned

SIZES = (1 << 16, 1 << 18, 1 << 20, 1 << 22, 1 << 24)  # 64 KiB .. 16 MiB
QUICK_SIZES = (1 << 16, 1 << 20, 1 << 24)
SPAN = 32 << 20  # bytes each size is timed over (at least 2 requests)


def disk_seconds(directory: str, size: int, count: int) -> tuple[float, float, bool]:
    """(write seconds, read seconds, direct) of ``count`` sequential requests of ``size`` bytes (a
    multiple of ``PAGE``), one at a time, into and back from one preallocated file under
    ``directory`` (written once before, so no request allocates); one ``fdatasync`` ends the writes.
    Without ``O_DIRECT`` the reads come from the page cache."""
    path = os.path.join(directory, f".minipar-disk{os.getpid()}")
    buf = page_aligned(size)
    buf[:] = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8)
    fd, direct = open_file(path, os.O_RDWR | os.O_CREAT)
    try:
        os.posix_fallocate(fd, 0, size * count)
        for i in range(count):  # first touch: the extents exist and are written
            os.pwrite(fd, buf, i * size)
        t0 = time.perf_counter()
        for i in range(count):
            os.pwrite(fd, buf, i * size)
        os.fdatasync(fd)
        t1 = time.perf_counter()
        for i in range(count):
            os.preadv(fd, [buf], i * size)
        t2 = time.perf_counter()
    finally:
        os.close(fd)
        os.remove(path)
    return t1 - t0, t2 - t1, direct


def synced_write_seconds(directory: str, repeats: int) -> float:
    """Median seconds of an atomic small write as the tier's default write makes it: a new file,
    preallocated, one page written, ``fdatasync``, renamed over the previous one."""
    buf, path, times = page_aligned(PAGE), os.path.join(directory, f".minipar-sync{os.getpid()}"), []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fd, _ = open_file(path + ".tmp", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        try:
            os.posix_fallocate(fd, 0, PAGE)
            os.pwrite(fd, buf, 0)
            os.fdatasync(fd)
        finally:
            os.close(fd)
        os.replace(path + ".tmp", path)
        times.append(time.perf_counter() - t0)
    os.remove(path)
    return statistics.median(times)


def copy_seconds(size: int, repeats: int) -> float:
    """Median seconds of ``np.array(a, copy=True)`` of ``size`` bytes (a new array: what a move
    between host and device is on this machine)."""
    a = np.ones(size // 8)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        b = np.array(a, copy=True)
        times.append(time.perf_counter() - t0)
        del b
    return statistics.median(times)


def measure(directory: str, sizes: Sequence[int] = SIZES, repeats: int = 5) -> Bandwidth:
    """This machine's ``Bandwidth`` (module docstring): disk and copy timed at ``sizes`` (medians of
    ``repeats``), fitted as latency + bytes / bandwidth."""
    os.makedirs(directory, exist_ok=True)
    writes, reads, direct = [], [], True
    for size in sizes:
        count = max(2, SPAN // size)
        runs = [disk_seconds(directory, size, count) for _ in range(repeats)]
        writes.append(statistics.median(r[0] for r in runs) / count)
        reads.append(statistics.median(r[1] for r in runs) / count)
        direct = direct and all(r[2] for r in runs)
    copies = [copy_seconds(size, max(3, repeats)) for size in sizes]
    (w_lat, w_beta), (r_lat, r_beta), (c_lat, c_beta) = (fit_line(sizes, t) for t in (writes, reads, copies))
    sync = max(0.0, synced_write_seconds(directory, max(3, repeats)) - w_lat - PAGE * w_beta)
    how = "O_DIRECT" if direct else "buffered (no O_DIRECT here: reads from the page cache)"
    return Bandwidth(pcie=1 / c_beta if c_beta > 0 else np.inf, nvme_read=1 / r_beta if r_beta > 0 else np.inf,
                     nvme_write=1 / w_beta if w_beta > 0 else np.inf, pcie_latency=c_lat, nvme_read_latency=r_lat,
                     nvme_write_latency=w_lat, nvme_sync=sync,
                     source=f"measured {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} under {directory}: "
                            f"{how} requests of {min(sizes)}-{max(sizes)} B, one at a time; copies np.array")
