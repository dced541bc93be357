"""ZeRO-Infinity's NVMe state survives a kill in the middle of ``step`` (issue 14, "NVMe files: killed
mid-step (simulate), the previous checkpoint or state is intact").

A kill is simulated by the tier's file writer (``minipar.tiers.nvme._write_file``) writing the first k
files of a rank's directory in that step and raising for every later one, as a process that died
after k files would write nothing more. ``step`` writes (workers=1, so in this order) per unit the
state files of the other slot (float64: param, exp_avg, exp_avg_sq, 6 units -> 18 files; mixed:
fp16 param, master, exp_avg, exp_avg_sq -> 24), then the manifest. For every k up to and including
the manifest's turn, the same object and a ``resume=True`` object over the same tier read bit for
bit the state after the first step (parameters, moments, master, counters), and a step from there
gives bit for bit the state of two uninterrupted steps. The expected states are those of an
uninterrupted run, not computed by the code under test's failure path.

N = 2, rank 1 killed: with k = 5 both ranks refuse to commit (they agree first); with k = 18 rank 1
dies at its manifest after rank 0 committed, and rank 0 rewrites its previous manifest (they agree
again); if rank 0 dies too at that rewrite (its k = 19), its files are one step ahead and ``resume``
takes it back to its other slot. In every case both resume at the first step.

A killed process: the same kills, then the objects are dropped without ``close`` (and without the
finalizer that would remove the files: a killed process runs none), a stale temporary of another
process is left in the directory, and a FRESH ``Tiers(reopen=True)`` over the same directory with a
``resume=True`` object reads the first step and continues as above.
"""

from __future__ import annotations

import errno
import os
import threading
from collections import Counter
from collections.abc import Callable

import numpy as np
import pytest
from test_infinity import model_of
from zero_helpers import LR, WEIGHT_DECAY, batch, config, rows

from minipar import launch
from minipar.parallel.offload import ZeroInfinity
from minipar.tiers import Tiers, nvme


class Kill:
    """The tier's two writers (a new file: ``_write_file``; in place: ``_write_into``) that, in a directory
    armed with k, write k files and then raise."""

    def __init__(self) -> None:
        self.real, self.lock = {"_write_file": nvme._write_file, "_write_into": nvme._write_into}, threading.Lock()
        self.armed: dict[str, int] = {}
        self.count: Counter[str] = Counter()

    def writer(self, which: str) -> Callable[..., None]:
        def write(path: str, *args: object) -> None:
            d = os.path.dirname(path)
            with self.lock:
                n = self.count[d] = self.count[d] + (d in self.armed)
            if d in self.armed and n > self.armed[d]:
                raise OSError(errno.EIO, "killed")
            self.real[which](path, *args)
        return write


def states(inf: ZeroInfinity) -> dict[tuple[int, str], np.ndarray]:
    """This rank's shard of every state file in the current slot."""
    return {(u.index, k): inf.tiers.read_nvme(inf.key(u, k)).result() for u in inf.units for k in inf.kinds}


def train_step(inf: ZeroInfinity, comm, c: dict, i: int) -> bool:
    x, y = batch(c, i)
    mine = rows(c, comm.rank)
    inf.backward(inf.loss(x[mine], y[mine]))
    return inf.step()


def make(comm, c: dict, tiers: Tiers, precision: str, resume: bool = False) -> ZeroInfinity:
    return ZeroInfinity(model_of(c, precision), comm, tiers, lr=LR, weight_decay=WEIGHT_DECAY,
                        precision=precision, resume=resume)


def uninterrupted(comm, c: dict, base: str, precision: str) -> dict:
    with Tiers(1 << 30, os.path.join(base, f"rank{comm.rank}"), workers=1) as tiers:
        inf = make(comm, c, tiers, precision)
        out = {}
        for i in range(2):
            train_step(inf, comm, c, i)
            out[i] = (states(inf), inf.steps_applied, inf.loss_scale)
        out["params"] = inf.full_state_dict()
    return out


def two_steps(comm, c: dict, inf: ZeroInfinity, directory: str, kill: Kill, victims: dict[int, int]) -> str:
    """Step 0, then step 1 killed on rank r after ``victims[r]`` files: what step 1 said."""
    train_step(inf, comm, c, 0)
    if comm.rank in victims:
        kill.armed[os.path.abspath(directory)] = victims[comm.rank]
    try:
        msg = "committed" if train_step(inf, comm, c, 1) else "skipped"
    except OSError as exc:
        msg = str(exc)
    kill.armed.pop(os.path.abspath(directory), None)
    return msg


def killed(comm, c: dict, base: str, precision: str, kill: Kill, victims: dict[int, int]) -> dict:
    """Step 0, step 1 killed on rank r after ``victims[r]`` files, then a ``resume`` object's step 1."""
    directory = os.path.join(base, f"rank{comm.rank}")
    with Tiers(1 << 30, directory, workers=1) as tiers:
        inf = make(comm, c, tiers, precision)
        msg = two_steps(comm, c, inf, directory, kill, victims)
        same = (states(inf), inf.steps_applied, inf.loss_scale)
        again = make(comm, c, tiers, precision, resume=True)
        resumed = (states(again), again.steps_applied, again.loss_scale)
        train_step(again, comm, c, 1)
        after = (states(again), again.steps_applied, again.loss_scale)
        return {"msg": msg, "same": same, "resumed": resumed, "after": after, "params": again.full_state_dict()}


def killed_process(comm, c: dict, base: str, precision: str, kill: Kill, victims: dict[int, int]) -> dict:
    """Step 0, step 1 killed on rank r after ``victims[r]`` files, the objects dropped as by a kill;
    then new ones over the reopened directory and their step 1."""
    directory = os.path.join(base, f"rank{comm.rank}")
    tiers = Tiers(1 << 30, directory, workers=1)
    inf = make(comm, c, tiers, precision)
    msg = two_steps(comm, c, inf, directory, kill, victims)
    tiers._files._finalizer.detach()  # a killed process removes nothing
    del inf, tiers
    stray = ".unit0%2Fparam.1.npy.tmp999999-1"
    with open(os.path.join(directory, stray), "wb") as fh:
        fh.write(b"\x93NUMPY")
    with Tiers(1 << 30, directory, workers=1, reopen=True) as fresh:
        again = make(comm, c, fresh, precision, resume=True)
        resumed = (states(again), again.steps_applied, again.loss_scale)
        train_step(again, comm, c, 1)
        after = (states(again), again.steps_applied, again.loss_scale)
        return {"msg": msg, "stale": fresh.stale, "resumed": resumed, "after": after,
                "params": again.full_state_dict()}


def run_killed(fn: Callable[..., dict], world: int, c: dict, base: str, precision: str, victims: dict[int, int],
               monkeypatch: pytest.MonkeyPatch) -> list[dict]:
    """``fn`` on ``world`` ranks with the tier's writer replaced by a ``Kill``."""
    kill = Kill()
    for which in kill.real:
        monkeypatch.setattr(nvme, which, kill.writer(which))
    try:
        return launch(fn, world, c=c, base=base, precision=precision, kill=kill, victims=victims)
    finally:
        for which, real in kill.real.items():
            monkeypatch.setattr(nvme, which, real)


def assert_state(got: tuple, want: tuple) -> None:
    assert got[1:] == want[1:]  # applied steps, loss scale
    assert got[0].keys() == want[0].keys()
    for key, a in want[0].items():
        assert got[0][key].dtype == a.dtype and np.array_equal(got[0][key], a), key


@pytest.mark.parametrize(("world", "precision", "cases"), [
    (1, "fp64", [{0: k} for k in (0, 1, 9, 17, 18)]),  # 18: every state file written, the manifest not
    (1, "mixed", [{0: k} for k in (0, 13, 24)]),
    (2, "fp64", [{1: 5}, {1: 18}, {1: 18, 0: 19}]),  # 19: rank 0's rewrite of its previous manifest
])
def test_killed_mid_step_keeps_the_previous_step(world: int, precision: str, cases: list[dict[int, int]],
                                                 tmp_path, monkeypatch) -> None:
    c = config("infinity", world)
    want = launch(uninterrupted, world, c=c, base=str(tmp_path / "ref"), precision=precision)
    assert all(w[0][1] == 1 and w[1][1] == 2 for w in want)
    for i, victims in enumerate(cases):
        got = run_killed(killed, world, c, str(tmp_path / str(i)), precision, victims, monkeypatch)
        for r, (g, w) in enumerate(zip(got, want, strict=True)):
            if r in victims:
                assert g["msg"].endswith(": killed"), (victims, g["msg"])
            else:
                what = "the commit" if victims.get(1) == 18 else "a write"
                assert g["msg"] == f"the step is not committed, {what} failed on another rank"
            assert_state(g["same"], w[0])  # this object reads the first step
            assert_state(g["resumed"], w[0])  # so does a resumed one, on every rank
            assert_state(g["after"], w[1])  # and a step from there: two uninterrupted steps
            for name, a in w["params"].items():
                assert np.array_equal(g["params"][name], a), name


@pytest.mark.parametrize(("world", "precision", "cases"), [
    (1, "fp64", [{0: k} for k in (0, 9, 18)]),
    (1, "mixed", [{0: 24}]),
    (2, "fp64", [{1: 5}, {1: 18, 0: 19}]),
])
def test_killed_process_resumes_over_a_reopened_directory(world: int, precision: str, cases: list[dict[int, int]],
                                                          tmp_path, monkeypatch) -> None:
    c = config("infinity", world)
    want = launch(uninterrupted, world, c=c, base=str(tmp_path / "ref"), precision=precision)
    for i, victims in enumerate(cases):
        got = run_killed(killed_process, world, c, str(tmp_path / str(i)), precision, victims, monkeypatch)
        for r, (g, w) in enumerate(zip(got, want, strict=True)):
            assert g["msg"].endswith(": killed") if r in victims else g["msg"].startswith("the step is not")
            assert g["stale"] == [".unit0%2Fparam.1.npy.tmp999999-1"]
            assert_state(g["resumed"], w[0])  # the fresh objects read the first step
            assert_state(g["after"], w[1])  # and a step from there: two uninterrupted steps
            for name, a in w["params"].items():
                assert np.array_equal(g["params"][name], a), name
