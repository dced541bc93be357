"""Sharded checkpoints (minipar/parallel/zero/checkpoint.py): saved at one world size, loaded at
others with each rank's shard equal to the slice cut by hand; atomic against a crash at every step
of the save; corrupted, missing and mismatched checkpoints refused alike on every rank."""

from __future__ import annotations

import json
import shutil
import threading
from pathlib import Path

import numpy as np
import pytest

import minipar.parallel.zero.checkpoint as ck
from minipar.testing import run, run_each

# numels not divisible by 4 or 3 (padding matters), mixed dtypes, one array of a single element
# (padding-only shards) and one of none
NUMELS = {"unit0/param": 13, "unit0/exp_avg": 13, "bucket1/master": 7, "tiny": 1, "empty": 0}
DTYPES = {"unit0/param": np.float64, "unit0/exp_avg": np.float32, "bucket1/master": np.float16,
          "tiny": np.float64, "empty": np.float32}


def state(seed: int) -> dict[str, np.ndarray]:
    """Full unpadded arrays; bit patterns that a conversion would change (-0.0, inf, nan, subnormal)."""
    rng = np.random.default_rng(seed)
    out = {n: rng.standard_normal(k).astype(DTYPES[n]) for n, k in NUMELS.items()}
    out["unit0/param"][:4] = [-0.0, np.inf, np.nan, 5e-324]
    return out


def cut(full: np.ndarray, world: int, rank: int) -> np.ndarray:
    """Rank ``rank``'s shard, by hand: pad with zeros to a multiple of ``world``, take slice ``rank``."""
    size = -(-full.size // world)
    padded = np.concatenate([full, np.zeros(size * world - full.size, full.dtype)])
    return padded[rank * size:(rank + 1) * size]


def same(a: np.ndarray, b: np.ndarray) -> bool:
    """Bit-for-bit equal (nan included), same dtype and shape."""
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def save_rank(comm, directory: str, seed: int, meta: dict | None = None) -> None:
    full = state(seed)
    ck.save(directory, comm, {n: cut(a, comm.size, comm.rank) for n, a in full.items()}, dict(NUMELS), meta)


def load_rank(comm, directory: str, numels: dict | None = None):
    """``(shards, meta)``, or the ``ValueError`` message."""
    try:
        return ck.load(directory, comm, numels)
    except ValueError as exc:
        return str(exc)


def save_then_load(comm, directory: str, seed: int):
    save_rank(comm, directory, seed, {"step": seed})
    return load_rank(comm, directory)


def assert_shards(results: list, seed: int, meta: dict | None = None) -> None:
    full = state(seed)
    for rank, (shards, got_meta) in enumerate(results):
        assert set(shards) == set(NUMELS)
        for name, a in full.items():
            assert same(shards[name], cut(a, len(results), rank)), (rank, name)
        assert got_meta == ({} if meta is None else meta)


def try_(fn, *args):
    try:
        return fn(*args)
    except ValueError as exc:
        return str(exc)


def refusal(results: list) -> str:
    """The one message every rank raised."""
    assert all(isinstance(r, str) for r in results), results
    assert len(set(results)) == 1, results
    return results[0]


@pytest.fixture
def saved(tmp_path: Path) -> Path:
    directory = tmp_path / "ck"
    run(save_rank, 4, directory=str(directory), seed=1, meta={"step": 7, "loss_scale": 1024.0})
    return directory


@pytest.mark.parametrize("world", [4, 2, 1, 3])
def test_load_recuts_to_any_world_size(saved: Path, world: int) -> None:
    assert_shards(run(load_rank, world, directory=str(saved)), 1, {"step": 7, "loss_scale": 1024.0})


def test_files_on_disk_and_consolidate(saved: Path) -> None:
    assert sorted(p.name for p in saved.parent.iterdir()) == ["ck"]
    assert sorted(p.name for p in saved.iterdir()) == ["meta.json"] + [f"rank0000{r}.npz" for r in range(4)]
    full, meta = ck.consolidate(saved)
    assert set(full) == set(NUMELS) and meta == {"step": 7, "loss_scale": 1024.0}
    for name, a in state(1).items():
        assert same(full[name], a), name


# old files holding part of each new rank's range, by hand: 13 elements are cut in 4s at N=4, in 7s
# at N=2 (rank 1: [7, 13) -> files 1..3), in 5s at N=3; 7 elements in 2s at N=4, 4s at N=2, 3s at N=3
READS = {4: [{0}, {1}, {2}, {3}], 2: [{0, 1}, {1, 2, 3}], 3: [{0, 1}, {1, 2}, {2, 3}], 1: [{0, 1, 2, 3}]}


@pytest.mark.parametrize("world", [4, 2, 3, 1])
def test_a_rank_reads_only_the_files_it_needs(saved: Path, world: int, monkeypatch) -> None:
    reads, real = [], ck._read_file
    monkeypatch.setattr(ck, "_read_file", lambda p: reads.append((threading.get_ident(), p.name)) or real(p))
    idents = run(lambda comm: (load_rank(comm, str(saved)), threading.get_ident())[1], world)
    got = [{int(f[4:9]) for i, f in reads if i == ident and f.endswith(".npz")} for ident in idents]
    assert got == READS[world]


def test_padding_only_files_are_still_checked(tmp_path: Path) -> None:
    directory = tmp_path / "ck"
    tiny = np.array([3.5])
    run(lambda comm: ck.save(directory, comm, {"tiny": cut(tiny, 4, comm.rank)}, {"tiny": 1}), 4)
    shards = run(lambda comm: ck.load(directory, comm)[0]["tiny"], 2)
    assert same(shards[0], np.array([3.5])) and same(shards[1], np.array([0.0]))
    (directory / "rank00003.npz").unlink()  # holds only padding: no rank needs it at N=2
    assert refusal(run(load_rank, 2, directory=str(directory))) == f"load {directory}: rank00003.npz: missing"


class Crash(BaseException):
    """A rank dying: not an Exception, so nothing in save catches it and nothing is cleaned up."""


def raise_when(name: str, what, exc: BaseException):
    """``ck.<name>`` raising ``exc`` on the calls for which ``what(*args)`` holds."""
    real = getattr(ck, name)

    def fake(*args):
        if what(*args):
            raise exc
        return real(*args)
    return fake


# where the crash happens -> (patched step, when it crashes, which checkpoint load sees after it)
CRASHES = {
    "writing rank 2's file": ("_write_file", lambda p, data: p.name == "rank00002.npz", 1),
    "writing meta.json": ("_write_file", lambda p, data: p.name == "meta.json.part", 1),
    "before the first rename": ("_rename", lambda src, dst: src.name == "ck", 1),
    "between the renames": ("_rename", lambda src, dst: ".tmp-" in src.name, 2),
    "before deleting the old one": ("_remove_tree", lambda p: ".old-" in p.name, 2),
}


@pytest.mark.parametrize("where", list(CRASHES))
def test_a_crash_leaves_the_old_or_the_new_checkpoint(saved: Path, where: str, monkeypatch) -> None:
    name, when, seed = CRASHES[where]
    with monkeypatch.context() as m:
        m.setattr(ck, name, raise_when(name, when, Crash(name)))
        with pytest.raises(Crash):
            run(save_rank, 4, directory=str(saved), seed=2, meta={"step": 8, "loss_scale": 1024.0})
    assert len(list(saved.parent.iterdir())) > 1  # leftovers: the crash cleaned nothing up
    assert saved.exists() == (where != "between the renames")
    meta = {"step": 7 if seed == 1 else 8, "loss_scale": 1024.0}
    assert_shards(run(load_rank, 2, directory=str(saved)), seed, meta)
    full, got_meta = ck.consolidate(saved)
    assert got_meta == meta and all(same(full[n], a) for n, a in state(seed).items())
    # the next save finishes or undoes the interrupted commit and removes the leftovers
    run(save_rank, 3, directory=str(saved), seed=3)
    assert sorted(p.name for p in saved.parent.iterdir()) == ["ck"]
    assert_shards(run(load_rank, 3, directory=str(saved)), 3)


# a step that fails (an OSError, which save catches, unlike a crash): on one rank's file, on meta.json,
# on the second rename (the first one is then undone)
FAILURES = {"rank 1's file": ("_write_file", lambda p, data: p.name == "rank00001.npz"),
            "meta.json": ("_write_file", lambda p, data: p.name.startswith("meta.json")),
            "the second rename": ("_rename", lambda src, dst: ".tmp-" in src.name)}


@pytest.mark.parametrize("where", list(FAILURES))
def test_a_failed_step_is_refused_everywhere_and_changes_nothing(saved: Path, where: str, monkeypatch) -> None:
    with monkeypatch.context() as m:
        m.setattr(ck, FAILURES[where][0], raise_when(*FAILURES[where], OSError(28, "No space left on device")))
        msg = refusal(run(lambda comm: try_(save_rank, comm, str(saved), 2), 4))
    assert msg == f"save {saved}: [Errno 28] No space left on device"
    assert sorted(p.name for p in saved.parent.iterdir()) == ["ck"]
    assert_shards(run(load_rank, 4, directory=str(saved)), 1, {"step": 7, "loss_scale": 1024.0})


def flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("world", [4, 2])
def test_corrupted_file_refused_on_every_rank(saved: Path, world: int) -> None:
    flip_byte(saved / "rank00002.npz")
    msg = refusal(run(load_rank, world, directory=str(saved)))
    assert msg.startswith(f"load {saved}: rank00002.npz: corrupted (sha256 ")
    with pytest.raises(ValueError, match=r"rank00002\.npz: corrupted"):
        ck.consolidate(saved)


def test_missing_file_refused_on_every_rank(saved: Path) -> None:
    (saved / "rank00001.npz").unlink()
    assert refusal(run(load_rank, 3, directory=str(saved))) == f"load {saved}: rank00001.npz: missing"
    with pytest.raises(ValueError, match=r"rank00001\.npz: missing"):
        ck.consolidate(saved)
    (saved / "meta.json").unlink()
    assert refusal(run(load_rank, 2, directory=str(saved))) == f"load {saved}: meta.json: missing in {saved}"
    assert refusal(run(load_rank, 2, directory=str(saved.parent / "nothing"))) == \
        f"load {saved.parent / 'nothing'}: no checkpoint at {saved.parent / 'nothing'}"


def test_mismatched_numels_refused_on_every_rank(saved: Path) -> None:
    assert_shards(run(load_rank, 2, directory=str(saved), numels=dict(NUMELS)), 1, {"step": 7, "loss_scale": 1024.0})
    wrong = dict(NUMELS, **{"unit0/param": 12, "extra": 3})
    del wrong["tiny"]
    assert refusal(run(load_rank, 2, directory=str(saved), numels=wrong)) == (
        f"load {saved}: 'extra' is not in the checkpoint; the checkpoint has 'tiny', not expected; "
        "'unit0/param' has 13 elements in the checkpoint, expected 12")


def test_save_refuses_inconsistent_arguments_on_every_rank(saved: Path) -> None:
    def disagree(comm):
        numels = dict(NUMELS, tiny=2 if comm.rank == 1 else 1)
        return try_(ck.save, saved, comm, {n: cut(a, 4, comm.rank) for n, a in state(2).items()}, numels)

    assert refusal(run(disagree, 4)) == (f"save {saved}: ranks [1] differ from rank 0 in directory, array names, "
                                         "numels, dtypes or meta; every rank must pass the same")

    def short(comm):
        return try_(ck.save, saved, comm, {"x": np.zeros(2 if comm.rank == 3 else 3)}, {"x": 10})

    assert refusal(run(short, 4)) == f"save {saved}: 'x': shard has 2 elements, but numel 10 over 4 ranks needs 3"
    assert sorted(p.name for p in saved.parent.iterdir()) == ["ck"]
    assert_shards(run(load_rank, 4, directory=str(saved)), 1, {"step": 7, "loss_scale": 1024.0})


@pytest.mark.mpi
def test_save_and_recut_under_mpiexec(tmp_path: Path) -> None:
    directory, broken = tmp_path / "ck", tmp_path / "broken"
    (four,) = run_each(save_then_load, 4, [{"directory": str(directory), "seed": 5}], backend="mpi", timeout=60)
    assert_shards(four, 5, {"step": 5})
    shutil.copytree(directory, broken)
    flip_byte(broken / "rank00000.npz")
    three, refused = run_each(load_rank, 3, [{"directory": str(directory)}, {"directory": str(broken)}],
                              backend="mpi", timeout=60)
    assert_shards(three, 5, {"step": 5})
    assert refusal(refused).startswith(f"load {broken}: rank00000.npz: corrupted")


def test_save_never_replaces_what_is_not_a_checkpoint(tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir()
    (home / "notes.txt").write_text("keep me")
    lookalike = tmp_path / "home.old-best"  # a sibling whose name only resembles a leftover
    lookalike.mkdir()
    assert refusal(run(lambda comm: try_(save_rank, comm, str(home), 1), 2)) == \
        f"save {home}: {home} holds ['notes.txt'], so it is not a checkpoint; refusing to replace it"
    assert (home / "notes.txt").read_text() == "keep me"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["home", "home.old-best"]
    run(save_rank, 2, directory=str(tmp_path / "home.old"), seed=1)  # "home.old" + "-best" is not a leftover
    assert sorted(p.name for p in tmp_path.iterdir()) == ["home", "home.old", "home.old-best"]


def test_a_meta_json_that_disagrees_with_the_files_is_refused(saved: Path) -> None:
    doc = json.loads((saved / "meta.json").read_text())
    doc["arrays"][[a["name"] for a in doc["arrays"]].index("unit0/param")]["numel"] = 17  # 5 a rank, not 4
    (saved / "meta.json").write_text(json.dumps(doc))
    assert refusal(run(load_rank, 4, directory=str(saved))) == (
        f"load {saved}: " + "; ".join(f"rank0000{r}.npz: 'unit0/param' is (4,) float64, meta.json says 17 elements "
                                      "over 4 ranks, <f8" for r in range(4)))
    (saved / "meta.json").write_text("{not json")
    assert refusal(run(load_rank, 2, directory=str(saved))).startswith(f"load {saved}: meta.json: unreadable (")


def test_meta_goes_through_json_numpy_scalars_included(tmp_path: Path) -> None:
    directory = tmp_path / "ck"
    meta = {"step": np.int64(5), "loss_scale": np.float32(0.1), "betas": (0.9, 0.999), "precision": "mixed"}
    run(lambda comm: ck.save(directory, comm, {"x": np.arange(2.0) + 2 * comm.rank}, {"x": 3}, meta), 2)
    got = run(lambda comm: ck.load(directory, comm)[1], 2)
    assert got == [{"step": 5, "loss_scale": float(np.float32(0.1)), "betas": [0.9, 0.999], "precision": "mixed"}] * 2
    assert type(got[0]["step"]) is int and got[0]["loss_scale"] == 0.10000000149011612
    assert refusal(run(lambda comm: try_(ck.save, directory, comm, {"x": np.zeros(2)}, {"x": 3}, {"f": object}), 2)) \
        == f"save {directory}: meta must be a JSON-serializable dict: type <class 'object'> is not JSON-serializable"
