"""The tier model's measurement (``minipar.tiers.rates``): concurrent requesters, their median, the
sync spread; and ``files.resident``, which maps a move's destination before the move (values, no times)."""

from __future__ import annotations

import os

import numpy as np
import pytest

from minipar import trace
from minipar.tiers import Bandwidth, Tiers, rates
from minipar.tiers.files import PAGE, resident


def test_combine_is_the_field_wise_median_of_the_requesters():
    got = rates.combine([Bandwidth(pcie=1, nvme_read=5, nvme_sync=0.3, source="a"),
                         Bandwidth(pcie=3, nvme_read=4, nvme_sync=0.1, source="b"),
                         Bandwidth(pcie=2, nvme_read=6, nvme_sync=0.2, nvme_sync_spread=1, source="c")])
    assert (got.pcie, got.nvme_read, got.nvme_sync, got.nvme_sync_spread) == (2, 5, 0.2, 0)
    assert got.nvme_write == Bandwidth().nvme_write  # equal everywhere: kept
    assert got.source == "a; the median of 3 requesters at once"


def test_resident_writes_each_page_once_and_returns_the_array():
    a = np.full(3 * PAGE + 5, 7, np.uint8)
    assert resident(a) is a
    touched = np.flatnonzero(a == 0)
    assert touched.tolist() == [0, PAGE, 2 * PAGE, 3 * PAGE, 3 * PAGE + 4]  # a byte in every page, and the last
    assert resident(np.empty(0)).size == 0
    f = np.asfortranarray(np.full((PAGE, 3), 7, np.uint8))  # Fortran order: touched in place too
    assert np.flatnonzero(resident(f).ravel(order="F") == 0).tolist() == [0, PAGE, 2 * PAGE, 3 * PAGE - 1]


def test_moves_into_new_memory_are_still_exact_copies(tmp_path):
    x = np.asfortranarray(np.arange(12.0).reshape(3, 4))
    with trace.recording(0) as rec, Tiers(1 << 20, tmp_path) as t:
        dev = t.to_device("x", x)
        host = t.to_cpu("x")
        t.write_nvme("x", host).result()
        back = t.read_nvme("x").result()
    assert dev.flags.c_contiguous and host.flags.c_contiguous
    for got in (dev, host, back):
        np.testing.assert_array_equal(got, x)
    assert [e.nbytes for e in rec.events if e.kind == "transfer"] == [96] * 4


def test_measure_with_two_requesters_at_once_fits_positive_rates(tmp_path):
    bw = rates.measure(str(tmp_path), (1 << 12, 1 << 16), 2, requesters=2)
    assert all(v > 0 for v in (bw.pcie, bw.nvme_read, bw.nvme_write))
    assert min(bw.nvme_sync, bw.nvme_sync_per_byte) >= 0 and bw.nvme_sync_spread > 0
    assert bw.source.endswith("the median of 2 requesters at once")
    assert os.listdir(tmp_path) == []  # every requester's files and directory removed


def test_a_synced_write_adds_its_latency_and_its_per_byte_cost():
    bw = Bandwidth(nvme_write=1e9, nvme_write_latency=1e-4, nvme_sync=2e-3, nvme_sync_per_byte=1e-9)
    assert bw.seconds("cpu", "nvme", 1 << 20) == pytest.approx(1e-4 + (1 << 20) / 1e9)
    assert bw.seconds("cpu", "nvme", 1 << 20, synced=True) == pytest.approx(1e-4 + (1 << 20) * 2e-9 + 2e-3)


def test_transfer_seconds_latency_and_sync_by_hand(tmp_path):
    bw = Bandwidth(pcie=1e9, nvme_read=5e8, nvme_write=2.5e8, pcie_latency=1e-6, nvme_read_latency=1e-4,
                   nvme_write_latency=2e-4, nvme_sync=3e-3)
    assert bw.seconds("cpu", "device", 1000) == pytest.approx(1e-6 + 1e-6)
    assert bw.seconds("nvme", "cpu", 5e5) == pytest.approx(1e-4 + 1e-3)
    assert bw.seconds("cpu", "nvme", 2.5e5) == pytest.approx(2e-4 + 1e-3)
    assert bw.seconds("cpu", "nvme", 2.5e5, synced=True) == pytest.approx(2e-4 + 1e-3 + 3e-3)
    assert bw.seconds("device", "nvme", 1000, synced=True) == pytest.approx(2e-6 + 2e-4 + 4e-6 + 3e-3)  # staged
    bw.save(tmp_path / "t.json")
    assert Bandwidth.load(tmp_path / "t.json") == bw
    (tmp_path / "bad.json").write_text('{"pcie": -1}')
    with pytest.raises(ValueError, match=r"tier rates file .*bad.json: pcie must be numbers >= 0"):
        Bandwidth.load(tmp_path / "bad.json")


def test_measured_rates_are_positive_and_fit_what_they_timed(tmp_path):
    from minipar.tiers import rates

    bw = rates.measure(str(tmp_path), (1 << 12, 1 << 16), 2)
    assert all(v > 0 for v in (bw.pcie, bw.nvme_read, bw.nvme_write))
    assert all(v >= 0 for v in (bw.pcie_latency, bw.nvme_read_latency, bw.nvme_write_latency, bw.nvme_sync))
    assert os.listdir(tmp_path) == []  # its files and temporary directory removed
    w, r, _ = rates.disk_seconds(str(tmp_path), 1 << 16, 4)
    assert w > 0 and r > 0 and os.listdir(tmp_path) == []
