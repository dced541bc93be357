"""The NVMe tier's files at disk speed (``minipar.tiers.files``, ``nvme``): page-aligned ``.npy`` files
written in place, a torn in-place write refused on read, ``O_DIRECT`` where the filesystem allows it
and a clean fallback where not, reads into a caller's buffer."""

from __future__ import annotations

import errno
import os

import numpy as np
import pytest

from minipar import trace
from minipar.tiers import Tiers
from minipar.tiers.files import aligned_empty


def test_files_are_page_aligned_npy_and_writes_in_place_keep_the_file(tmp_path):
    d = tmp_path / "nv"
    a = np.arange(1000, dtype=np.float32)  # 4000 bytes: one page of data, padded
    with Tiers(0, d) as t, trace.recording(0) as rec:
        t.write_nvme("a", a).result()
        path = d / "a.npy"
        inode = path.stat().st_ino
        assert path.stat().st_size == 2 * 4096
        np.testing.assert_array_equal(np.load(path), a)  # np.load reads it: the header is padded, not changed
        t.write_nvme("a", a * 2, in_place=True).result()  # same dtype and shape: into the file
        assert path.stat().st_ino == inode and t._files._unsynced == {str(path)}
        t.sync_nvme()
        assert t._files._unsynced == set()
        t.write_nvme("a", np.ones(3), in_place=True).result()  # another shape: a new file, atomically
        assert path.stat().st_ino != inode
        np.testing.assert_array_equal(t.read_nvme("a").result(), np.ones(3))
        got = t.read_nvme("a").result()
        assert got.ctypes.data % 4096 == 0  # read into page-aligned memory
    writes = [e.args.get("synced", False) for e in rec.events if e.kind == "transfer" and e.args["dst"] == "nvme"]
    assert writes == [True, False, True]


def test_a_failed_write_in_place_leaves_a_torn_file_that_reads_refuse(tmp_path, monkeypatch):
    with Tiers(0, tmp_path) as t:
        t.write_nvme("s", np.arange(4.0)).result()

        def dies(path, fd, offset, raw):
            raise OSError(errno.EIO, "killed")

        monkeypatch.setattr("minipar.tiers.nvme._write_into", dies)
        with pytest.raises(OSError, match=r"write of 's' in place \(32 bytes\) to .*s.npy failed part-way: killed"):
            t.write_nvme("s", np.zeros(4), in_place=True).result()
        monkeypatch.undo()
        with pytest.raises(OSError, match=r"s.npy of 's' is torn: its last write in place failed part-way"):
            t.read_nvme("s").result()
        t.write_nvme("s", np.full(4, 5.0), in_place=True).result()  # a whole write mends it
        np.testing.assert_array_equal(t.read_nvme("s").result(), np.full(4, 5.0))


def test_open_file_falls_back_without_o_direct(tmp_path, monkeypatch):
    real = os.open

    def no_direct(path, flags, mode=0o777):
        if flags & getattr(os, "O_DIRECT", 0):
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(path, flags, mode)

    monkeypatch.setattr(os, "open", no_direct)
    with Tiers(0, tmp_path) as t:
        t.write_nvme("a", np.arange(5000.0)).result()
        t.write_nvme("a", np.arange(5000.0) + 1, in_place=True).result()
        np.testing.assert_array_equal(t.read_nvme("a").result(), np.arange(5000.0) + 1)
        assert [direct for _, direct in t._files._disk.fds.values()] == [False]


def test_read_into_a_buffer_in_place_or_by_copy(tmp_path):
    a = np.arange(3000, dtype=np.float32).reshape(3, 1000)
    with Tiers(0, tmp_path) as t:
        t.write_nvme("a", a).result()
        into = aligned_empty((3, 1000), np.float32)
        assert t.read_nvme("a", out=into).result() is into and into.ctypes.data % 4096 == 0
        plain = np.zeros((3, 1000), np.float32)  # not page-aligned memory: read, then copied in
        assert t.read_nvme("a", out=plain).result() is plain
        np.testing.assert_array_equal(into, a)
        np.testing.assert_array_equal(plain, a)
        with pytest.raises(ValueError, match=r"out is float64\[3, 1000\], the file holds float32\[3, 1000\]"):
            t.read_nvme("a", out=np.zeros((3, 1000))).result()
