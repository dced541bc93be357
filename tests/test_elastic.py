"""Elastic restart (``minipar.elastic``, ``minipar run --elastic``): the restart loop on a fake
launcher (no MPI), the global batch kept or refused, and under real ``mpiexec`` a rank of a DDP or
ZeRO-3 job killed at a drawn step: the job restarts smaller, resumes from the last complete
checkpoint, leaves no half-written one, ends in bounded time, and ends with the parameters of one
process that trained on every global batch without interruption."""

from __future__ import annotations

import functools
import importlib.util
import json
import operator
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st
from strategies import budget
from tolerances import assert_close_after_adamw

from minipar import elastic, nn
from minipar.cli import main as cli_main
from minipar.comm import launch
from minipar.elastic import (
    STATUS_SHELL,
    RunResult,
    accumulation,
    elastic_loop,
    load_ddp,
    restart_info,
    save_ddp,
    supervise,
)
from minipar.optim import AdamW
from minipar.parallel.zero import checkpoint
from minipar.testing import ROOT

SCRIPT = ROOT / "examples" / "elastic_train.py"
_spec = importlib.util.spec_from_file_location("elastic_train", SCRIPT)
example_script = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(example_script)


# ---- the loop, on a fake launcher -------------------------------------------------------------------
class FakeLauncher:
    """Plays back one dict of per-rank exit statuses per run (runs past the list: every rank 0) and
    keeps what each run was given. A rank left out recorded no status: torn down after an
    ``MPI_Abort`` of the first rank listed (its marker), or, with ``gone=True``, its shell died with it.
    mpiexec's status is the ranks' statuses OR-ed (Hydra's), 1 when some rank recorded none."""

    def __init__(self, runs: list[dict[int, int]], gone: bool = False) -> None:
        self.runs, self.calls, self.gone = runs, [], gone

    def __call__(self, n: int, env: dict[str, str]) -> RunResult:
        k = len(self.calls)
        statuses = self.runs[k] if k < len(self.runs) else dict.fromkeys(range(n), 0)
        self.calls.append((n, dict(env)))
        missing = len(statuses) < n
        aborted = frozenset([min(statuses, default=0)]) if missing and not self.gone else frozenset()
        status = 1 if missing else functools.reduce(operator.or_, statuses.values(), 0)
        return RunResult(n, status, statuses, 0.5, aborted)


def quiet(lines: list[str]):
    return lines.append


def test_success_first_time_runs_once_with_restart_count_zero():
    fake, log = FakeLauncher([{0: 0, 1: 0, 2: 0}]), []
    status, runs = elastic_loop(3, fake, max_restarts=3, log=quiet(log))
    assert (status, len(runs)) == (0, 1)
    assert fake.calls == [(3, {"MINIPAR_RESTART_COUNT": "0", "MINIPAR_MAX_RESTARTS": "3", "MINIPAR_WORLD_SIZE": "3",
                               "MINIPAR_LOST_RANKS": ""})]


def test_a_killed_rank_restarts_the_survivors_who_learn_it():
    fake, log = FakeLauncher([{0: 1, 1: 137, 2: 1}, {0: 0, 1: 0}]), []
    status, runs = elastic_loop(3, fake, max_restarts=2, log=quiet(log))
    assert status == 0 and [n for n, _ in fake.calls] == [3, 2]
    assert fake.calls[1][1] == {"MINIPAR_RESTART_COUNT": "1", "MINIPAR_MAX_RESTARTS": "2", "MINIPAR_WORLD_SIZE": "2",
                                "MINIPAR_LOST_RANKS": "1"}
    assert runs[0].lost == [1] and runs[1].lost == []
    assert "rank 1 lost (killed by signal 9)" in log[0] and "2 ranks (3 - 1 lost)" in log[1]


def test_a_failure_that_lost_no_rank_is_not_restarted():
    # every rank refused (status 2), or ranks torn down by mpiexec after an MPI_Abort (no status): no loss
    for statuses in ({0: 2, 1: 2}, {0: 1}):
        fake, log = FakeLauncher([statuses]), []
        status, runs = elastic_loop(2, fake, max_restarts=3, log=quiet(log))
        assert (status, len(runs)) == ((2 if statuses == {0: 2, 1: 2} else 1), 1)
        assert "lost no rank" in log[-1]


def test_limits_max_restarts_min_ranks_and_restart_n():
    lose_one = [{0: 137, **{r: 1 for r in range(1, n)}} for n in (5, 4, 3, 2)]  # rank 0 lost each time
    status, runs = elastic_loop(5, FakeLauncher(lose_one), max_restarts=1, log=quiet([]))
    assert (status, [r.ranks for r in runs]) == (137, [5, 4])  # one restart, then give up
    status, runs = elastic_loop(5, FakeLauncher(lose_one), max_restarts=9, min_ranks=3, log=quiet([]))
    assert (status, [r.ranks for r in runs]) == (137, [5, 4, 3])  # 2 left would be below 3
    fake = FakeLauncher([{0: 1, 1: 137, 2: 137}, {r: 0 for r in range(4)}])
    status, runs = elastic_loop(3, fake, restart_n=4, log=quiet([]))
    assert (status, [r.ranks for r in runs]) == (0, [3, 4])  # replacement machines: a new N
    with pytest.raises(ValueError, match="below --min-ranks"):
        elastic_loop(2, fake, min_ranks=3)


@given(st.integers(2, 6), st.lists(st.sets(st.integers(0, 5), min_size=1, max_size=2), max_size=4),
       st.integers(0, 4))
@budget(20)
def test_world_sizes_shrink_by_the_lost_ranks(n, losses, max_restarts):
    runs, sizes = [], [n]
    for lost in losses:  # run k loses ``lost`` (those below its size): statuses 137, the others 1
        size = sizes[-1]
        runs.append({r: (137 if r in lost else 1) for r in range(size)})
        sizes.append(size - len({r for r in lost if r < size}))
        if sizes[-1] == size or sizes[-1] < 1:
            break
    status, done = elastic_loop(n, FakeLauncher(runs), max_restarts=max_restarts, log=quiet([]))
    # by hand: a run with no loss ends the loop; so do a spent restart budget and an empty world
    expected = [n]
    for k in range(len(runs)):
        if sizes[k + 1] == sizes[k] or k >= max_restarts or sizes[k + 1] < 1:
            break
        expected.append(sizes[k + 1])
    assert [r.ranks for r in done] == expected
    last = len(expected) - 1
    assert status == (0 if last == len(runs) else 137 if sizes[last + 1] < sizes[last] else 1)


def test_a_machine_gone_is_lost_and_a_crash_is_not():
    # a rank with no status while nobody aborted: its shell died with it (the machine went): lost;
    # a rank killed by SIGSEGV (139) or SIGABRT (134): the program's own crash: not lost, no restart
    fake, log = FakeLauncher([{0: 1, 2: 1}], gone=True), []
    status, runs = elastic_loop(3, fake, max_restarts=3, log=quiet(log))
    assert runs[0].lost == [1] and [n for n, _ in fake.calls] == [3, 2] and status == 0
    for crash in (139, 134):
        status, runs = elastic_loop(2, FakeLauncher([{0: 1, 1: crash}]), max_restarts=3, log=quiet([]))
        assert runs[0].lost == [] and len(runs) == 1 and status == 1 | crash


def test_status_shell_records_how_each_rank_ended(tmp_path):
    # the shell mpiexec starts each rank under: a SIGKILLed rank is 137 (lost), an exit its status
    # and the rank's own pid (the inner sh becomes the rank), which minipar run kills when it is stuck
    for rank, code, want in ((3, "os.kill(os.getpid(), signal.SIGKILL)", 137), (0, "sys.exit(7)", 7)):
        env = dict(os.environ, PMI_RANK=str(rank), MINIPAR_ELASTIC_STATUS=str(tmp_path))
        code = f"import os, signal, sys; open(sys.argv[1], 'w').write(str(os.getpid())); {code}"
        proc = subprocess.run(["sh", "-c", STATUS_SHELL, sys.executable, "-c", code, str(tmp_path / "me")], env=env)
        assert proc.returncode == want and (tmp_path / f"rank{rank}").read_text() == f"{want}\n"
        assert (tmp_path / f"pid{rank}").read_text().strip() == (tmp_path / "me").read_text()
    assert RunResult(4, 137, {0: 7, 1: 1, 2: 1, 3: 137}).lost == [3]
    assert RunResult(4, 137, {0: 7, 3: 137}, aborted=frozenset({0})).lost == [3]  # 1, 2 torn down by the abort
    assert RunResult(4, 137, {0: 7, 3: 137}).lost == [1, 2, 3]  # nobody aborted: 1, 2 went with their shells
    assert RunResult(4, 9, {}).lost == []  # the whole job torn down: which machine went is unknown


FROZEN = "import os, signal; os.kill(os.getpid(), signal.SIGSTOP)"
ONCE_1_IS_FROZEN = """
import os, pathlib, sys, time
f = pathlib.Path(os.environ['MINIPAR_ELASTIC_STATUS'])
def stopped():
    try:
        return ') T ' in pathlib.Path(f'/proc/{int((f / "pid1").read_text())}/stat').read_text()
    except (OSError, ValueError):
        return False
while not stopped():
    time.sleep(0.01)
if sys.argv[1] == 'declare':  # what its failure detector does: then it gives up (PeerLost: status 1)
    (f / 'declared0').write_text('1')
    raise SystemExit(1)
"""


def two_ranks(folder: Path, rank0: tuple[str, ...], rank1: tuple[str, ...]) -> subprocess.Popen:
    """Two ranks (``python -c code args...``) under the status shell, as mpiexec starts them (without MPI):
    a process that waits for both."""
    launcher = ("import json, os, subprocess, sys; shell, exe, ranks = sys.argv[1:3] + [json.loads(sys.argv[3])]; "
                "ps = [subprocess.Popen(['sh', '-c', shell, exe, '-c', *argv], env=dict(os.environ, PMI_RANK=str(r))) "
                "for r, argv in enumerate(ranks)]; [p.wait() for p in ps]")
    return subprocess.Popen([sys.executable, "-c", launcher, STATUS_SHELL, sys.executable, json.dumps([rank0, rank1])],
                            env=dict(os.environ, MINIPAR_ELASTIC_STATUS=str(folder)))


@pytest.mark.parametrize("declared", [True, False])
def test_the_loop_kills_a_frozen_rank_and_calls_it_lost(tmp_path, declared):
    # rank 1 freezes (SIGSTOP). Declared dead by rank 0 (its failure detector's note): killed at once;
    # not declared (frozen after its goodbye, rank 0 ended normally): killed --attempt-timeout later
    proc = two_ranks(tmp_path, (ONCE_1_IS_FROZEN, "declare" if declared else "leave"), (FROZEN,))
    start = time.monotonic()
    stalled = supervise(proc, tmp_path, 2, limit=0.5)
    assert time.monotonic() - start < 30  # no hang (the frozen rank would keep the shells waiting for ever)
    result = RunResult(2, proc.returncode, elastic._statuses(tmp_path), stalled=stalled)
    assert result.lost == [1] and result.statuses[1] == 137
    why = ("declared dead by rank 0 while its process was stopped (SIGSTOP)" if declared else
           "still stopped (SIGSTOP) 0.5 s after rank 0 ended (--attempt-timeout)")
    assert f"rank 1 lost ({why}; killed by minipar run)" in result.describe()


def test_accumulation_keeps_the_global_batch_or_names_what_works():
    assert [accumulation(12, w, 2) for w in (1, 2, 3, 6)] == [6, 3, 2, 1]
    with pytest.raises(ValueError, match=r"12 cannot be kept on 4 ranks.*world sizes that keep it: \[1, 2, 3, 6\]"):
        accumulation(12, 4, 2)


def test_restart_info_reads_the_environment():
    info = restart_info({"MINIPAR_RESTART_COUNT": "2", "MINIPAR_MAX_RESTARTS": "3", "MINIPAR_WORLD_SIZE": "4",
                         "MINIPAR_LOST_RANKS": "0,3"})
    assert (info.count, info.max_restarts, info.world_size, info.lost) == (2, 3, 4, (0, 3))
    assert restart_info({}).count == 0 and restart_info({}).world_size is None


def test_cli_refuses_bad_input_with_status_2(capsys, tmp_path):
    assert cli_main(["run", "-n", "2", str(tmp_path / "missing.py")]) == 2
    assert "no script" in capsys.readouterr().err
    assert cli_main(["run", "-n", "2", "--max-restarts", "1", str(SCRIPT)]) == 2
    assert "need --elastic" in capsys.readouterr().err
    assert cli_main(["run", "--elastic", "-n", "1", "--min-ranks", "2", str(SCRIPT)]) == 2


# ---- DDP checkpoints re-cut (threads backend) --------------------------------------------------------
def _ddp_after_steps(comm, directory, steps, save):
    from minipar.parallel.ddp import DistributedDataParallel, train_step

    model = nn.GPT(**example_script.MODEL, seed=4)
    ddp = DistributedDataParallel(model, comm)
    opt = AdamW(model.parameters(), lr=0.05)
    if not save:
        meta = load_ddp(directory, ddp, opt)
        return meta, {n: p.data.copy() for n, p in model.named_parameters()}, opt.state
    for step in range(steps):
        train_step(ddp, opt, lambda m, x, y: m.loss(x, y), *example_script.batch(4, step, 6))
    save_ddp(directory, ddp, opt, {"step": steps})
    return None, {n: p.data.copy() for n, p in model.named_parameters()}, opt.state


@pytest.mark.parametrize("saved, loaded", [(3, 2), (2, 3), (3, 1)])
def test_ddp_checkpoint_is_one_nth_per_rank_and_loads_at_any_world_size(tmp_path, saved, loaded):
    _, want, state = launch(_ddp_after_steps, saved, "threads", tmp_path / "ck", 2, True)[0]
    numel = sum(v.size for v in want.values())
    per_rank = -(-numel // saved)  # ceil: every rank writes one padded slice of each flat array
    for r in range(saved):
        with np.load(tmp_path / "ck" / f"rank{r:05d}.npz") as f:
            assert [f[k].shape for k in f.files] == [(per_rank,)] * 3  # param, exp_avg, exp_avg_sq
    for meta, params, got in launch(_ddp_after_steps, loaded, "threads", tmp_path / "ck", 0, False):
        assert (meta["step"], meta["adam_step"]) == (2, 2)
        assert params.keys() == want.keys() and all(np.array_equal(params[n], want[n]) for n in want)
        for s, w in zip(got, state, strict=True):
            assert s["step"] == w["step"] == 2
            assert np.array_equal(s["exp_avg"], w["exp_avg"]) and np.array_equal(s["exp_avg_sq"], w["exp_avg_sq"])


# ---- under mpiexec ------------------------------------------------------------------------------
STEPS, GLOBAL, MICRO, DEADLINE = 4, 12, 2, 1.0
BOUND = 30.0  # seconds for a whole elastic job: two launches, a detection (DEADLINE), a margin for CI


def reference(steps: int, seed: int = 0) -> tuple[dict[str, np.ndarray], dict[str, list[np.ndarray]]]:
    """One process, no interruption: AdamW on each whole global batch (the loss: its mean). The final
    parameters and each parameter's gradient at every step."""
    model = nn.GPT(**example_script.MODEL, seed=seed)
    opt = AdamW(model.parameters(), lr=example_script.LR, weight_decay=example_script.WEIGHT_DECAY)
    grads: dict[str, list[np.ndarray]] = {n: [] for n, _ in model.named_parameters()}
    for step in range(steps):
        x, y = example_script.batch(seed, step, GLOBAL)
        opt.zero_grad()
        model.loss(x, y).backward()
        for n, p in model.named_parameters():
            grads[n].append(p.grad.copy())
        opt.step()
    return {n: p.data for n, p in model.named_parameters()}, grads


# The elastic run's gradients (micro-batches accumulated, then DDP's or FSDP's ring) differ from one
# process's by what test_data_parallel and test_zero assert (the looser: rtol 1e-9); AdamW's drift of
# that (tests/tolerances.py: large only where the exact gradient is zero, as the key bias's) on top of
# the tolerance the parameters always had.
GRAD_TOL, PARAM_TOL = {"rtol": 1e-9, "atol": 1e-12}, {"rtol": 1e-10, "atol": 1e-10}


def run_cli(tmp: Path, *args: str) -> tuple[subprocess.CompletedProcess, float]:
    env = dict(os.environ, MINIPAR_TIMEOUT="5", MINIPAR_PEER_DEADLINE=str(DEADLINE), OPENBLAS_NUM_THREADS="1")
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "minipar.cli", "run", *args], capture_output=True, text=True,
                          env=env, timeout=120, cwd=tmp)
    return proc, time.monotonic() - start


@pytest.mark.mpi
@given(paradigm=st.sampled_from(["ddp", "zero3"]), ranks=st.sampled_from([2, 3]), victim=st.integers(0, 2),
       step=st.integers(0, STEPS - 1), phase=st.sampled_from(["step", "save"]))
@example(paradigm="ddp", ranks=3, victim=1, step=2, phase="step")  # resume at 2 ranks, 3 micro-batches each
@example(paradigm="zero3", ranks=3, victim=0, step=1, phase="save")  # rank 0 dies mid-save: its temporary folder
@example(paradigm="zero3", ranks=3, victim=2, step=0, phase="step")  # no checkpoint yet: the restart starts afresh
@example(paradigm="ddp", ranks=2, victim=0, step=3, phase="save")  # down to 1 rank, 6 micro-batches; the last step
@budget(1)
def test_killed_rank_restarts_smaller_and_ends_as_one_process(tmp_path_factory, paradigm, ranks, victim, step, phase):
    victim %= ranks
    tmp = tmp_path_factory.mktemp("elastic")
    proc, wall = run_cli(tmp, "--elastic", "-n", str(ranks), "--max-restarts", "2", str(SCRIPT),
                         "--paradigm", paradigm, "--steps", str(STEPS), "--global-batch", str(GLOBAL),
                         "--micro-batch", str(MICRO), "--ckpt", "ckpt", "--out", "final.npz",
                         "--kill-rank", str(victim), "--kill-step", str(step), "--kill-phase", phase)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert wall < BOUND
    runs = re.findall(r"minipar run: run (\d): (\d) ranks, exit status (\d+) in ([\d.]+) s \(rank:status ([^;)]*)",
                      proc.stderr)
    assert [int(r[1]) for r in runs] == [ranks, ranks - 1]
    assert float(runs[0][3]) < BOUND / 2  # the survivors of the kill did not hang: they ended by themselves
    statuses = [dict(s.split(":") for s in r[4].split(", ")) for r in runs]
    # survivors: 1 after the failure detector's PeerLost naming the victim (not the watchdog's CommTimeout,
    # MINIPAR_TIMEOUT=5 s later), or '-' (torn down by mpiexec after an MPI_Abort), and at least one reports
    assert statuses[0][str(victim)] == "137" and len(statuses[0]) == ranks
    survivors = [r for r in range(ranks) if r != victim]
    assert all(statuses[0][str(r)] in ("1", "-") for r in survivors)
    said_lost = rf"PeerLost: rank (\d+): .*rank {victim} \(world\) is dead"
    reported = [r for r in survivors if str(r) in re.findall(said_lost, proc.stderr)]
    assert reported and all(r in reported for r in survivors if statuses[0][str(r)] == "1"), proc.stderr[-3000:]
    assert "CommTimeout" not in proc.stderr
    assert statuses[1] == {str(r): "0" for r in range(ranks - 1)}
    # killed at step s, before its compute or inside its save: the last complete checkpoint had done s steps
    said = [line for line in proc.stdout.splitlines() if line.startswith(("fresh start", "resumed"))]
    m0, m1 = GLOBAL // (ranks * MICRO), GLOBAL // ((ranks - 1) * MICRO)  # micro-batches per rank: 2, 3 or 3, 6
    assert said == [f"fresh start on {ranks} ranks, {m0} micro-batches of {MICRO} per rank (restart 0)",
                    f"resumed at step {step} on {ranks - 1} ranks, {m1} micro-batches of {MICRO} per rank (restart 1, "
                    f"lost [{victim}])" if step else
                    f"fresh start on {ranks - 1} ranks, {m1} micro-batches of {MICRO} per rank (restart 1)"]
    assert sorted(p.name for p in tmp.iterdir()) == ["ckpt", "final.npz"]  # no ckpt.tmp-X / ckpt.old-X
    assert sorted(p.name for p in (tmp / "ckpt").iterdir()) == ["meta.json"] + [f"rank{r:05d}.npz"
                                                                               for r in range(ranks - 1)]
    want, grads = reference(STEPS)
    final = np.load(tmp / "final.npz")
    saved = checkpoint.state_dict(tmp / "ckpt")
    assert sorted(final.files) == sorted(want) == sorted(saved)
    for name, value in want.items():
        for got in (final[name], saved[name]):
            assert_close_after_adamw(got, value, grads[name], example_script.LR, GRAD_TOL, PARAM_TOL, err_msg=name)


@pytest.mark.mpi
def test_a_global_batch_the_ranks_cannot_keep_is_refused_and_not_restarted(tmp_path):
    proc, _ = run_cli(tmp_path, "--elastic", "-n", "2", str(SCRIPT), "--global-batch", "6", "--micro-batch", "2",
                      "--ckpt", "ckpt")
    assert proc.returncode == 2
    assert ("refused: the global batch of 6 cannot be kept on 2 ranks with micro-batches of 2: 6 / (2 x 2) is not "
            "an integer; world sizes that keep it: [1, 3]") in proc.stderr
    assert "lost no rank" in proc.stderr and "restart 1" not in proc.stderr
    assert not (tmp_path / "ckpt").exists()
