"""Memory tiers: the device budget is never exceeded, moves are copies recorded with their bytes and
modelled time, NVMe files round-trip bit-exactly, overlap compute, survive a crash mid-write and are
cleaned up on close."""

from __future__ import annotations

import errno
import gc
import os
import time

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from strategies import budget

from minipar import trace
from minipar.autograd import Tensor
from minipar.chrome import to_chrome
from minipar.cost import transfer_seconds, zero_offload_bytes
from minipar.tiers import Bandwidth, DeviceOutOfMemory, NotOnDevice, Tiers
from minipar.tiers.nvme import LONG, file_name, name_of


def test_out_of_memory_message_names_budget_resident_request_and_smallest_budget():
    t = Tiers(1000)
    t.to_device("a", np.zeros(50))  # 400 bytes
    t.to_device("b", np.zeros(25, np.float32))  # 100 bytes
    t.to_device("c", np.zeros(300, np.uint8))  # 300 bytes
    with pytest.raises(DeviceOutOfMemory) as info:
        t.to_device("w", np.ones(30))  # 240 bytes: 800 + 240 > 1000
    assert str(info.value) == (
        "device out of memory: budget 1000 bytes, 800 bytes resident (a: 400, c: 300, b: 100), "
        "request 'w': 240 bytes; the smallest budget that would have worked is 1040 bytes")
    assert info.value.smallest_budget == 1040 and isinstance(info.value, MemoryError)
    assert t.resident() == {"a": 400, "b": 100, "c": 300} and t.device_bytes == 800  # nothing charged
    t2 = Tiers(1040)  # the budget the message names works
    for name, n, dt in (("a", 50, np.float64), ("b", 25, np.float32), ("c", 300, np.uint8), ("w", 30, np.float64)):
        t2.to_device(name, np.zeros(n, dt))
    assert t2.device_bytes == 1040 == t2.peak_device_bytes


def test_out_of_memory_message_lists_four_largest_and_the_rest():
    t = Tiers(100)
    for i, n in enumerate([10, 30, 5, 20, 15, 8]):
        t.empty(f"t{i}", n, np.uint8)
    with pytest.raises(DeviceOutOfMemory) as info:
        t.empty("big", 13, np.uint8)
    assert str(info.value) == (
        "device out of memory: budget 100 bytes, 88 bytes resident (t1: 30, t3: 20, t4: 15, t0: 10, "
        "and 2 more: 13), request 'big': 13 bytes; the smallest budget that would have worked is 101 bytes")
    with pytest.raises(DeviceOutOfMemory, match="nothing resident, request 'x': 5 bytes; .* is 5 bytes"):
        Tiers(4).to_device("x", np.zeros(5, np.uint8))


@budget(20)
@given(sizes=st.lists(st.tuples(st.integers(0, 64), st.booleans()), min_size=1, max_size=30),
       cap=st.integers(0, 600))
def test_budget_never_exceeded(sizes, cap):
    """Random allocations (float64, n elements) and frees: resident bytes and every memory sample stay
    within the budget; an allocation fails exactly when resident + request > budget."""
    t = Tiers(cap)
    live: dict[str, int] = {}
    with trace.recording(0) as rec:
        for i, (n, free_one) in enumerate(sizes):
            if free_one and live:
                victim = sorted(live)[0]
                t.free(victim)
                del live[victim]
            fits = sum(live.values()) + 8 * n <= cap
            if fits:
                t.to_device(f"x{i}", np.arange(n, dtype=np.float64))
                live[f"x{i}"] = 8 * n
            else:
                with pytest.raises(DeviceOutOfMemory):
                    t.to_device(f"x{i}", np.arange(n, dtype=np.float64))
            assert t.resident() == live and t.device_bytes == sum(live.values())
    samples = [e.nbytes for e in rec.events if e.kind == "memory" and e.name == "device"]
    assert all(s <= cap for s in samples) and t.peak_device_bytes <= cap
    assert t.peak_device_bytes == max(samples, default=0)


def test_copies_are_copies_and_free_releases():
    t = Tiers(1 << 10)
    src = np.arange(6, dtype=np.float32)
    dev = t.to_device("w", src)
    src[:] = -1
    np.testing.assert_array_equal(dev, np.arange(6, dtype=np.float32))
    assert t.device_array("w") is dev
    host = t.to_cpu("w")
    dev[0] = 99
    assert host[0] == 0 and t.resident() == {"w": 24}  # to_cpu copies and keeps the device copy
    same = t.to_device("w", np.full(6, 7, np.float32))  # same shape and dtype: overwritten in place
    assert same is dev and (dev == 7).all() and t.device_bytes == 24
    with pytest.raises(ValueError, match="free it before"):
        t.to_device("w", np.zeros(3))
    t.free("w")
    assert t.device_bytes == 0 and t.peak_device_bytes == 24 and t.resident() == {}
    with pytest.raises(KeyError):
        t.free("w")


def test_require_device_rejects_host_and_freed_arrays():
    t = Tiers(1 << 10)
    w = t.to_device("w", np.ones((3, 4)))
    g = t.adopt("g", w @ w.T)  # a result of device compute, charged without a copy
    t.require_device(w, w.T, w[1:], g, Tensor(w))  # views and tensors of device arrays are on the device
    assert t.device_bytes == 96 + 72
    host = np.ones((3, 4))
    with pytest.raises(NotOnDevice, match=r"argument 1 \(float64\[3, 4\]\) is not resident on the device"):
        t.require_device(w, host)
    with pytest.raises(NotOnDevice):
        t.to_cpu("h", host)
    t.free("w")
    with pytest.raises(NotOnDevice):
        t.require_device(w)
    t.require_device(g)
    with pytest.raises(ValueError, match="already device memory"):
        t.adopt("g again", g[1:])


def test_transfer_events_bytes_direction_and_modelled_time(tmp_path):
    bw = Bandwidth(pcie=1000.0, nvme_read=100.0, nvme_write=50.0)
    with Tiers(1 << 12, tmp_path / "nv", bandwidth=bw) as t, trace.recording(3) as rec:
        dev = t.to_device("p", np.zeros(10, np.float16))  # 20 bytes
        host = t.to_cpu("p", dev)
        t.write_nvme("m", np.zeros(5)).result()  # 40 bytes
        t.read_nvme("m").result()
        t.free("p")
    moves = [(e.name, e.nbytes, e.args["src"], e.args["dst"], e.args["modelled_s"])
             for e in rec.events if e.kind == "transfer"]
    assert moves == [("p", 20, "cpu", "device", 20 / 1000), ("p", 20, "device", "cpu", 20 / 1000),
                     ("m", 40, "cpu", "nvme", 40 / 50), ("m", 40, "nvme", "cpu", 40 / 100)]
    assert all(e.rank == 3 and e.t1 >= e.t0 for e in rec.events)
    mem = [(e.name, e.nbytes) for e in rec.events if e.kind == "memory"]
    assert mem == [("device", 20), ("nvme", 40), ("device", 0)]
    assert host.dtype == np.float16


def test_bandwidth_model_by_hand():
    bw = Bandwidth()
    assert bw.seconds("cpu", "device", 16e9) == 1.0 == bw.seconds("device", "cpu", 16e9)
    assert bw.seconds("nvme", "cpu", 3e9) == 1.0 and bw.seconds("cpu", "nvme", 2e9) == 1.0
    assert transfer_seconds(6e9, "nvme", "device", bw) == 6e9 / 3e9 + 6e9 / 16e9  # staged through host
    assert bw.seconds("cpu", "cpu", 10) == 0.0
    with pytest.raises(ValueError, match="unknown tier 'gpu'"):
        bw.seconds("gpu", "cpu", 1)


def test_zero_offload_bytes_by_hand():
    # Ren et al. 2021: 2 Psi of fp16 gradients down, 2 Psi of fp16 parameters up per step.
    assert zero_offload_bytes(1000) == {"device->cpu": 2000, "cpu->device": 2000}
    assert zero_offload_bytes(1000, param_bytes=4, grad_bytes=8) == {"device->cpu": 8000, "cpu->device": 4000}
    assert zero_offload_bytes(1000, dp=4) == {"device->cpu": 500, "cpu->device": 500}
    # groups of 10 and 7 on 4 ranks pad to 12 and 8: shards of 3 + 2 = 5 elements
    assert zero_offload_bytes([10, 7], dp=4) == {"device->cpu": 10, "cpu->device": 10}


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
def test_nvme_round_trip_bit_exact(tmp_path, dtype):
    rng = np.random.default_rng(0)
    a = rng.standard_normal((7, 5)).astype(dtype)
    a.flat[[0, 1, 2]] = [np.inf, -0.0, np.nan]
    with Tiers(0, tmp_path) as t:
        f = t.write_nvme("layer.0/w", a)
        a[:] = 0  # snapshotted at submit: the file holds the values before this
        r = t.read_nvme("layer.0/w").result()  # ordered after the write on the same name
        assert f.done() and r.dtype == np.dtype(dtype) and r.shape == (7, 5)
        b = np.random.default_rng(0).standard_normal((7, 5)).astype(dtype)
        b.flat[[0, 1, 2]] = [np.inf, -0.0, np.nan]
        assert r.tobytes() == b.tobytes()  # the same draw: bit-exact, -0.0 and nan included
        assert t.resident("nvme") == {"layer.0/w": a.nbytes}


def test_nvme_read_overlaps_compute(tmp_path):
    a = np.arange(1 << 18, dtype=np.float64)  # 2 MB
    with Tiers(0, tmp_path, workers=2) as t, trace.recording(0) as rec:
        t.write_nvme("a", a).result()
        c0 = trace.now()
        fut = t.read_nvme("a")
        x, deadline = np.ones((64, 64)), time.monotonic() + 10
        while not fut.done() and time.monotonic() < deadline:  # the main thread computes meanwhile
            x = np.tanh(x @ x / 64)
        c1 = trace.now()
        assert fut.done()  # finished while the main thread was still computing
        np.testing.assert_array_equal(fut.result(), a)
    (read,) = [e for e in rec.events if e.kind == "transfer" and e.args["dst"] == "cpu"]
    assert c0 <= read.t0 and read.t1 <= c1 and read.nbytes == a.nbytes


def test_crash_mid_write_leaves_previous_file(tmp_path, monkeypatch):
    d = tmp_path / "nv"
    with Tiers(0, d) as t:
        t.write_nvme("s", np.arange(4.0)).result()

        def killed(src, dst):  # the new bytes are in the temporary file; the rename never happens
            assert os.path.getsize(src) > 0
            raise OSError(errno.EIO, "killed")

        monkeypatch.setattr(os, "replace", killed)
        f = t.write_nvme("s", np.full(4, 9.0))
        with pytest.raises(OSError, match=r"NVMe write of 's' \(32 bytes\) to .*nv failed: killed"):
            f.result()
        monkeypatch.undo()
        np.testing.assert_array_equal(t.read_nvme("s").result(), np.arange(4.0))
        assert len(os.listdir(d)) == 1  # the temporary file is gone

        def half(path, head, raw):  # a write that dies half-way through the temporary file
            with open(path, "wb") as fh:
                fh.write(head[:6])
            raise OSError(errno.ENOSPC, "No space left on device")

        def no_room(fd, offset, length):  # the preallocation finds no room: nothing written
            raise OSError(errno.ENOSPC, "No space left on device")

        def failed(target: str, fn) -> OSError:  # the write's error with ``target`` patched, 12288 bytes free
            monkeypatch.setattr(os, "statvfs", lambda _: type("St", (), {"f_bavail": 3, "f_frsize": 4096}))
            monkeypatch.setattr(target, fn)
            with pytest.raises(OSError) as info:
                t.write_nvme("s", array).result()
            monkeypatch.undo()
            return info.value

        for array in (np.zeros(100), np.zeros(1000)):  # a page of header + the data padded to pages
            info, real = failed("minipar.tiers.nvme._write_file", half), failed("os.posix_fallocate", no_room)
            want = f"[Errno 28] NVMe write of 's' failed, disk full: {d / 's.npy'} asked for " \
                   f"{4096 + -(-array.nbytes // 4096) * 4096} bytes, 12288 free"
            assert info.errno == real.errno == errno.ENOSPC
            assert str(info) == str(real) == want
            np.testing.assert_array_equal(t.read_nvme("s").result(), np.arange(4.0))
            assert os.listdir(d) == ["s.npy"]  # no temporary left: the previous file, whole


def test_close_deletes_files_and_the_directory_it_made(tmp_path):
    d = tmp_path / "made"
    t = Tiers(0, d)
    futs = [t.write_nvme(f"w{i}", np.ones(1000)) for i in range(6)]
    t.close()  # waits for the pending writes
    assert all(f.done() and f.exception() is None for f in futs)
    assert not d.exists() and t.resident("nvme") == {}
    keep = tmp_path / "theirs"
    keep.mkdir()
    (keep / "other.txt").write_text("not mine")
    with Tiers(0, keep) as t:
        t.write_nvme("x", np.ones(3))
    assert os.listdir(keep) == ["other.txt"]
    with pytest.raises(RuntimeError, match="boom"), Tiers(0, keep) as t:  # an exception keeps the files
        t.write_nvme("x", np.ones(3)).result()
        raise RuntimeError("boom")
    assert len(os.listdir(keep)) == 2


def test_unwritable_directory_and_no_directory(tmp_path):
    (tmp_path / "file").write_text("a file, not a directory")
    bad = tmp_path / "file" / "nvme"
    with pytest.raises(OSError, match=f"NVMe directory {bad} is not writable"):
        Tiers(0, bad)
    with Tiers(0) as t, pytest.raises(ValueError, match="no NVMe tier"):
        t.write_nvme("x", np.ones(1))
    gone = tmp_path / "gone"
    with Tiers(0, gone) as t:
        os.rmdir(gone)  # the directory disappears after it was checked
        with pytest.raises(OSError, match=f"NVMe write of 'x' \\(8 bytes\\) to {gone} failed: No such file"):
            t.write_nvme("x", np.ones(1)).result()


def test_transfer_events_survive_save_load_and_chrome(tmp_path):
    with Tiers(1 << 10, tmp_path / "nv") as t, trace.recording(0) as rec:
        t.write_nvme("m", t.to_cpu("p", t.to_device("p", np.ones(4)))).result()
    path = tmp_path / "t.json"
    trace.save(trace.Trace({"world_size": 1}, rec.events), path)
    loaded = trace.load(path)
    assert [(e.name, e.args["src"], e.args["dst"]) for e in loaded.select("transfer")] == [
        ("p", "cpu", "device"), ("p", "device", "cpu"), ("m", "cpu", "nvme")]
    to_chrome(loaded, tmp_path / "c.json")


@budget(15)
@given(shape=st.lists(st.integers(0, 6), max_size=3),
       dtype=st.sampled_from(["float16", "float32", "float64", "int8", "int64", "bool", "complex128"]),
       seed=st.integers(0, 2**16), fortran=st.booleans())
def test_nvme_round_trip_any_array(tmp_path_factory, shape, dtype, seed, fortran):
    raw = np.random.default_rng(seed).integers(0, 256, size=int(np.prod(shape)) * np.dtype(dtype).itemsize,
                                               dtype=np.uint8)
    a = raw.view(np.bool_ if dtype == "bool" else dtype).reshape(shape)  # every bit pattern, nan payloads too
    if dtype == "bool":
        a = a.astype(bool)
    a = np.asfortranarray(a) if fortran else a
    with Tiers(0, tmp_path_factory.mktemp("nv")) as t:
        t.write_nvme("x", a)
        out = t.read_nvme("x").result()
    assert out.dtype == a.dtype and out.shape == a.shape
    assert np.ascontiguousarray(out).tobytes() == np.ascontiguousarray(a).tobytes()


def test_operations_on_one_name_run_in_order_and_finished_futures_are_dropped(tmp_path):
    with Tiers(0, tmp_path, workers=4) as t:
        for i in range(20):
            t.write_nvme("w", np.full(1000, float(i)))
        reads = [t.read_nvme("w") for _ in range(3)]
        t.write_nvme("w", np.full(1000, -1.0))
        assert [r.result()[0] for r in reads] == [19.0] * 3
        assert t.read_nvme("w").result()[0] == -1.0
        t.delete_nvme("w").result()
        with pytest.raises(KeyError, match="'w' has no NVMe file"):
            t.read_nvme("w").result()
        t.wait()
        deadline = time.monotonic() + 5  # a done-callback runs just after the future's waiters wake
        while t._files._pending and time.monotonic() < deadline:
            time.sleep(0.001)
        assert t.resident("nvme") == {} and t._files._pending == {}  # no finished result kept alive


def test_files_removed_when_close_is_never_called(tmp_path):
    d = tmp_path / "forgotten"
    t = Tiers(0, d)
    t.write_nvme("a", np.ones(10)).result()
    assert len(os.listdir(d)) == 1
    del t
    gc.collect()
    assert not d.exists()


@given(st.text(st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=90))
def test_file_names_give_back_their_names(name):
    fname = file_name(name)
    assert len(fname.encode()) <= 255 and not fname.startswith(".") and "/" not in fname
    assert name_of(fname) == (None if "~" in fname else name)
    safe = set("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_.-")
    escaped = sum(1 if c in safe else 3 * len(c.encode()) for c in name) + 2 * name.startswith(".")
    assert ("~" in fname) == (escaped > LONG)



def test_foreign_file_names_give_no_name():
    assert [name_of(f) for f in ("%FF.npy", "%41.npy", "a.txt", ".npy", "a~b.npy")] == [None] * 5
    assert name_of("unit0%2Fparam.0.npy") == "unit0/param.0"


def test_reopen_registers_the_files_left_and_keeps_them(tmp_path):
    d = tmp_path / "nv"
    arrays = {"a": np.arange(3.0), "unit0/param.0": np.arange(5, dtype=np.float16), ".dot": np.ones((2, 2), np.int32),
              "u ~\u00fc": np.zeros(0), "n" * 300: np.arange(4, dtype=np.uint8)}
    old = Tiers(0, d)
    for name, a in arrays.items():
        old.write_nvme(name, a).result()
    old.close(delete=False)
    (d / ".a.npy.tmp999-7").write_bytes(b"\x93NUMPY half")  # a write a killed process left
    (d / "notes.txt").write_text("not ours")
    before = sorted(os.listdir(d))
    t = Tiers(0, d, reopen=True)
    assert t.stale == [".a.npy.tmp999-7"]
    assert t.resident("nvme") == {"a": 24, "unit0/param.0": 10, ".dot": 16, "u ~\u00fc": 0}  # the cut name: unnamed
    for name, a in arrays.items():
        got = t.read_nvme(name).result()
        assert got.dtype == a.dtype and np.array_equal(got, a), name
    assert t.resident("nvme")["n" * 300] == 4  # named by the read
    t.write_nvme("a", np.full(2, 7.0)).result()
    t.close()  # a reopened directory is kept
    assert sorted(os.listdir(d)) == before
    with Tiers(0, d, reopen=True) as t:
        np.testing.assert_array_equal(t.read_nvme("a").result(), [7.0, 7.0])
    assert sorted(os.listdir(d)) == before  # a normal exit keeps it too
    t = Tiers(0, d, reopen=True)
    del t
    gc.collect()  # and so does the finalizer
    assert sorted(os.listdir(d)) == before
    Tiers(0, d, reopen=True).close(delete=True)  # only when asked: every .npy file, not the others
    assert sorted(os.listdir(d)) == [".a.npy.tmp999-7", "notes.txt"]


def test_reopen_refuses_truncated_unreadable_and_missing(tmp_path):
    d = tmp_path / "nv"
    with pytest.raises(FileNotFoundError, match=r"NVMe directory .*nv to reopen does not exist"):
        Tiers(0, d, reopen=True)
    with pytest.raises(ValueError, match="reopen=True needs the nvme_dir"):
        Tiers(0, reopen=True)
    t = Tiers(0, d)
    t.write_nvme("w", np.arange(10.0)).result()
    t.close(delete=False)
    path = d / "w.npy"
    assert path.stat().st_size == 2 * 4096  # a page of header, the data padded to a page
    os.truncate(path, 4096 + 72)
    with pytest.raises(OSError, match=rf"NVMe file {path} is truncated: 72 of 80 array bytes on disk"):
        Tiers(0, d, reopen=True)
    path.write_bytes(b"junk")
    with pytest.raises(OSError, match=rf"NVMe file {path} is unreadable"):
        Tiers(0, d, reopen=True)
    assert os.listdir(d) == ["w.npy"]  # a refused directory is left as it was
