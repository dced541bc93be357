"""What a move between tiers costs on this machine, measured: the disk and memory copies.

- ``disk_seconds``: the disk's own time for ``count`` sequential requests of ``size`` bytes into one
  preallocated file, one at a time (``os.pwrite`` / ``os.preadv`` from page-aligned memory): the
  reference the NVMe tier is held against (``benchmarks/offload.py``) and what ``measure`` fits.
- ``measure(directory)``: ``Bandwidth`` of this machine (``minipar calibrate``, lesson 7,
  ``benchmarks/offload.py``), per request ``t = latency + n / bandwidth``: each bandwidth is the slope
  fitted (``rates.fit_line``, relative least squares) to sequential disk writes and reads at ``SIZES``
  (4 KiB .. 16 MiB, the sizes offload moves) and to copies (``Tiers.to_device``: a move between host
  and device is a copy here, the device being host memory); each latency is what a one-page move
  through the tier itself takes beyond its bytes (``tier_page_seconds``),
  its bookkeeping and recording included, as lesson 7's moves are timed; ``nvme_sync`` is what the tier's atomic write
  (a new file, ``fdatasync``, the rename: ``nvme.NvmeFiles``' default write) takes beyond an in-place one
  (medians), ``nvme_sync_spread`` the atomic writes' interquartile range, ``nvme_sync_per_byte`` what
  an atomic write's slope (``synced_seconds`` at ``sizes``: new extents written, then flushed) has
  beyond an in-place write's.
- Requesters sharing the disk and the cores: ``measure(..., requesters=k)`` times ``k`` processes measuring
  at once (``minipar calibrate -n k``), and lesson 7's ranks all measure together (``combine``: the
  field-wise median of theirs), so the rates are those of as many concurrent requesters as the run has
  (a disk's bandwidth and a machine's cores are shared among the requests in flight: each of ``k``
  gets about ``1/k`` when they saturate them, which measuring them together captures, instead of
  modelling the share).
"""

from __future__ import annotations

import multiprocessing
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Sequence
from dataclasses import fields, replace

import numpy as np

from minipar import trace
from minipar.rates import fit_line
from minipar.tiers.core import Bandwidth, Tiers
from minipar.tiers.files import PAGE, open_file, page_aligned

SIZES = (1 << 12, 1 << 14, 1 << 16, 1 << 18, 1 << 20, 1 << 22, 1 << 24)  # 4 KiB .. 16 MiB
QUICK_SIZES = (1 << 12, 1 << 16, 1 << 20, 1 << 24)
SPAN = 32 << 20  # bytes each size is timed over (at least 2 requests, at most REQUESTS)
REQUESTS = 512  # 4 KiB requests: 2 MiB (8,192 took 14 s on a shared disk)
EVICT = 8 << 20  # bytes of copy sources taken in turn: four times a core's L2 here (2 MiB)


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


def tier_page_seconds(directory: str, repeats: int) -> dict[str, float]:
    """Median seconds of one-page moves through the tier itself, as their trace events time them (the
    tier's bookkeeping and recording included): ``"in place"`` writes, ``"read"``s and ``"copy"``s up and
    down between host and device taking turns, then the ``"atomic"`` writes, so that requesters measuring
    at once meet each other's requests of the same kind (a read beside another's ``fdatasync`` waits for
    the flush); ``"atomic spread"``: the atomic writes' interquartile range (``fdatasync``'s variance)."""
    page = np.ones(PAGE // 8)
    with trace.recording(0) as rec, Tiers(PAGE, os.path.join(directory, f"tier{os.getpid()}"), workers=1) as t:
        t.write_nvme("x", page).result()
        for _ in range(repeats):
            t.write_nvme("x", page, in_place=True).result()
            t.read_nvme("x").result()
            t.to_cpu("x", t.to_device("x", page))
            t.free("x")
        t.sync_nvme()
        for _ in range(repeats):
            t.write_nvme("x", page).result()
    moves: dict[str, list[float]] = {}
    for e in rec.events:
        if e.kind == "transfer":
            kind = "copy" if "device" in (e.args["src"], e.args["dst"]) else \
                {"nvme": "atomic" if e.args.get("synced") else "in place", "cpu": "read"}[e.args["dst"]]
            moves.setdefault(kind, []).append(e.duration)
    quartiles = statistics.quantiles(moves["atomic"], n=4)
    return {**{k: statistics.median(v) for k, v in moves.items()}, "atomic spread": quartiles[2] - quartiles[0]}


def synced_seconds(directory: str, size: int, repeats: int) -> float:
    """Median seconds of the tier's atomic write (``Tiers.write_nvme``'s default: a new file, written,
    ``fdatasync``, renamed) of ``size`` bytes, as its trace event times it."""
    a = np.ones(size // 8)
    with trace.recording(0) as rec, Tiers(0, os.path.join(directory, f"synced{os.getpid()}"), workers=1) as t:
        for _ in range(repeats):
            t.write_nvme("x", a).result()
    return statistics.median(e.duration for e in rec.events if e.kind == "transfer")


def copy_seconds(size: int, repeats: int) -> float:
    """Median seconds of ``Tiers.to_device`` of ``size`` bytes as its trace event times it (then ``free``):
    a new array copied, what a move between host and device is on this machine; the sources taken in
    turn from ``EVICT`` bytes of arrays, so that each comes from beyond the core's cache, as a move's
    source mostly does after the compute or the disk read between moves (the same array each time:
    1.6 us at 64 KiB here, 4-5x faster than from elsewhere)."""
    sources, tiers = [np.full(size // 8, float(i)) for i in range(max(2, EVICT // size))], Tiers(size)
    with trace.recording(0) as rec:
        for i in range(repeats):
            tiers.to_device("x", sources[i % len(sources)])
            tiers.free("x")
    return statistics.median(e.duration for e in rec.events if e.kind == "transfer")


def combine(rates: Sequence[Bandwidth]) -> Bandwidth:
    """The field-wise median of rates measured at once by concurrent requesters (one per rank)."""
    values = {f.name: statistics.median(getattr(r, f.name) for r in rates) for f in fields(Bandwidth)
              if f.name != "source"}
    return replace(rates[0], **values, source=f"{rates[0].source}; the median of {len(rates)} requesters at once")


def measure(directory: str, sizes: Sequence[int] = SIZES, repeats: int = 5, requesters: int = 1) -> Bandwidth:
    """This machine's ``Bandwidth`` (module docstring): disk and copy timed at ``sizes`` (medians of
    ``repeats``) in a temporary directory under ``directory`` (an existing one), fitted as latency +
    bytes / bandwidth; ``requesters`` processes measuring at once (``combine``)."""
    if requesters > 1:
        with multiprocessing.get_context("spawn").Pool(requesters) as pool:
            return combine(pool.starmap(measure, [(directory, sizes, repeats)] * requesters))
    work = tempfile.mkdtemp(prefix=".minipar-disk", dir=directory)
    try:
        return _measure(work, sizes, repeats)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _measure(directory: str, sizes: Sequence[int], repeats: int) -> Bandwidth:
    writes, reads, direct = [], [], True
    for size in sizes:
        count = min(REQUESTS, max(2, SPAN // size))
        runs = [disk_seconds(directory, size, count) for _ in range(repeats)]
        writes.append(statistics.median(r[0] for r in runs) / count)
        reads.append(statistics.median(r[1] for r in runs) / count)
        direct = direct and all(r[2] for r in runs)
    copies = [copy_seconds(size, 5 * repeats) for size in sizes]
    w_beta, r_beta, c_beta = (fit_line(sizes, t)[1] for t in (writes, reads, copies))
    tier = tier_page_seconds(directory, 5 * repeats)  # the latency: a one-page move through the tier itself
    w_lat, r_lat = max(0.0, tier["in place"] - PAGE * w_beta), max(0.0, tier["read"] - PAGE * r_beta)
    c_lat = max(0.0, tier["copy"] - PAGE * c_beta)
    sync = max(0.0, tier["atomic"] - tier["in place"])
    synced_beta = fit_line(sizes, [synced_seconds(directory, size, repeats) for size in sizes])[1]
    how = "O_DIRECT" if direct else "buffered (no O_DIRECT here: reads from the page cache)"
    return Bandwidth(pcie=1 / c_beta if c_beta > 0 else np.inf, nvme_read=1 / r_beta if r_beta > 0 else np.inf,
                     nvme_write=1 / w_beta if w_beta > 0 else np.inf, pcie_latency=c_lat, nvme_read_latency=r_lat,
                     nvme_write_latency=w_lat, nvme_sync=sync, nvme_sync_spread=tier["atomic spread"],
                     nvme_sync_per_byte=max(0.0, synced_beta - w_beta),
                     source=f"measured {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} under {directory}: "
                            f"{how} requests of {min(sizes)}-{max(sizes)} B, one at a time; copies Tiers.to_device; "
                            "latencies from the tier's own one-page moves")
