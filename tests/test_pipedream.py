"""Asynchronous pipelines (issue 16, points 3-4): PipeDream with weight stashing / vertical sync, and
PipeDream-2BW, as ``U`` actions run by the unchanged executor.

Proof: the pipeline (threads and mpiexec) equals a single-process numpy reference of the *same*
semantics, written here by hand: an MLP whose stage s runs, for micro-batch i, its forward on the
weight version the paper's analysis gives and its backward (the input's gradient, dx = g W^T) on the
version the semantics give, updates applied per stage in micro-batch order. The versions are the
papers' formulas, not the code's:

- PipeDream (Narayanan et al. 2019, Sec. 3.3), stage r of p: forward and backward of micro-batch i on
  version max(0, i - (p - 1 - r)), its gradient applied to version i (staleness p - 1 - r); vertical
  sync: version max(0, i - (p - 1)) on every stage; without stashing the backward reads version i.
- PipeDream-2BW (Narayanan et al. 2021, Sec. 3.1): update group t = i // a uses version max(t - 1, 0)
  on every stage, its mean gradient applied to version t (delay exactly one).

The versions held per stage, measured on the runtime's arrays, equal the count of distinct versions the
pending micro-batches use (p - r for PipeDream once m >= 2 (p - 1 - r), 2 for 2BW).
"""

from __future__ import annotations

import re

import numpy as np
import pytest

from minipar import testing
from minipar import trace as mtrace
from minipar.cost.pipeline import weight_versions
from minipar.nn import MLP
from minipar.optim import SGD
from minipar.parallel.pipeline import Pipeline, ScheduleError, make_schedule, mlp, simulate, validate
from minipar.parallel.pipeline.asynchronous import pipedream, pipedream_2bw

STEPS = 2
MB = 2  # samples per micro-batch


def cfg(kind: str, p: int, m: int, weights: str = "stash", a: int | None = None, momentum: float = 0.0,
        seed: int = 3) -> dict:
    widths = [3, 5, 4, 6, 2, 4, 3][: p + 1]
    return {"kind": kind, "p": p, "m": m, "weights": weights, "a": a or p, "momentum": momentum, "seed": seed,
            "widths": widths, "lr": 0.2}


def _schedule(c: dict):
    sched = pipedream(c["p"], c["m"]) if c["kind"] == "pipedream" else pipedream_2bw(c["p"], c["m"], c["a"])
    if not c.get("split"):
        return sched
    # every backward split into I and W (zero bubble's halves), written by hand
    return {r: " ".join(f"{r}I{a.microbatch} {r}W{a.microbatch}" if a.op == "B" else str(a) for a in acts)
            for r, acts in sched.items()}


def _data(c: dict, step: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(100 * c["seed"] + step)
    n = c["m"] * MB
    return rng.standard_normal((n, c["widths"][0])), rng.standard_normal((n, c["widths"][-1]))


# ---- the papers' versions ---------------------------------------------------------------------------
def versions(c: dict, r: int, i: int) -> tuple[int, int, int]:
    """(forward version, backward version, version the gradient is applied to) of micro-batch i at
    stage r, from the papers (module docstring)."""
    p = c["p"]
    if c["kind"] == "2bw":
        t = i // c["a"]
        return max(t - 1, 0), max(t - 1, 0), t
    fwd = max(0, i - (p - 1)) if c["weights"] == "vertical" else max(0, i - (p - 1 - r))
    return fwd, (i if c["weights"] == "none" else fwd), i


def groups(c: dict) -> list[list[int]]:
    a = c["a"] if c["kind"] == "2bw" else 1
    return [list(range(g, g + a)) for g in range(0, c["m"], a)]


def expected_peak_versions(c: dict, r: int) -> int:
    """Versions stage r holds at once: right after its update for group g it holds the new one plus
    every older version a micro-batch after that group still uses (forward pending or in flight)."""
    if c["weights"] == "none":
        return 1
    peak = 1
    for g, grp in enumerate(groups(c)):
        later = {versions(c, r, k)[0] for k in range(grp[-1] + 1, c["m"])}
        peak = max(peak, 1 + len({v for v in later if v <= g}))
    return peak


# ---- the single-process reference, plain numpy ------------------------------------------------------
def reference(c: dict) -> tuple[list[list[float]], dict[str, np.ndarray]]:
    """Per-step micro-batch losses and final parameters: layer l = x W + b (ReLU but the last), stage
    r = layer r, MSE loss per micro-batch, each group's mean gradient, SGD (momentum) per stage."""
    p, lr, mu = c["p"], c["lr"], c["momentum"]
    state = MLP(c["widths"], seed=c["seed"]).state_dict()  # only the initial values
    cur = [(state[f"layers.{r}.weight"].copy(), state[f"layers.{r}.bias"].copy()) for r in range(p)]
    bufs: list[list[np.ndarray] | None] = [None] * p
    all_losses = []
    for step in range(STEPS):
        x, y = _data(c, step)
        xs, ys = np.split(x, c["m"]), np.split(y, c["m"])
        hist = [[w] for w in cur]  # hist[r][v]: stage r's version v in this step
        losses = [0.0] * c["m"]
        for grp in groups(c):
            grads = [[np.zeros_like(t) for t in cur[r]] for r in range(p)]
            for i in grp:
                acts, pre = [xs[i]], []
                for r in range(p):
                    w, b = hist[r][versions(c, r, i)[0]]
                    z = acts[-1] @ w + b
                    pre.append(z)
                    acts.append(np.maximum(z, 0) if r < p - 1 else z)
                diff = acts[-1] - ys[i]
                losses[i] = float(np.mean(diff * diff))
                g = 2 * diff / diff.size / len(grp)
                for r in reversed(range(p)):
                    if r < p - 1:
                        g = g * (pre[r] > 0)
                    grads[r][0] += acts[r].T @ g
                    grads[r][1] += g.sum(axis=0)
                    g = g @ hist[r][versions(c, r, i)[1]][0].T  # the weights the backward reads
            for r in range(p):
                if mu:
                    bufs[r] = grads[r] if bufs[r] is None else [mu * b + gr for b, gr in zip(bufs[r], grads[r])]
                    step_dir = bufs[r]
                else:
                    step_dir = grads[r]
                w, b = hist[r][-1]
                hist[r].append((w - lr * step_dir[0], b - lr * step_dir[1]))
        cur = [h[-1] for h in hist]
        all_losses.append(losses)
    final = {f"layers.{r}.{n}": t for r in range(p) for n, t in zip(("weight", "bias"), cur[r])}
    return all_losses, final


# ---- the pipeline ---------------------------------------------------------------------------------------
def async_run(comm, cfgs: list[dict]) -> list[dict]:
    out = []
    for c in cfgs:
        with mtrace.recording(comm.world_rank) as rec:
            pipe = Pipeline(comm, mlp(c["widths"], seed=c["seed"]), _schedule(c), layers=[1] * c["p"],
                            optimizer=lambda ps, c=c: SGD(ps, lr=c["lr"], momentum=c["momentum"]),
                            weights=c["weights"])
            losses = []
            for step in range(STEPS):
                pipe.step(*_data(c, step))
                losses.append(pipe.microbatch_losses)
        shown = [e.args["versions"] for e in rec.events if e.kind == "memory" and e.name == "weight_versions"]
        out.append({"losses": losses, "state": pipe.full_state_dict(), "seen": dict(pipe.versions.seen),
                    "peak": dict(pipe.versions.peak_versions), "shown": max(shown, default=1)})
    return out


def check(c: dict, results: list[list[dict]], index: int) -> None:
    ref_losses, ref_state = reference(c)
    p = c["p"]
    for r in range(p):
        got = results[r][index]
        np.testing.assert_allclose(got["losses"], ref_losses, rtol=1e-12, atol=1e-14, err_msg=f"rank {r} {c}")
        # staleness: the versions each micro-batch used at this stage (last step), the papers' formulas
        assert got["seen"] == {(r, i): list(versions(c, r, i)) for i in range(c["m"])}, c
        assert got["peak"] == {r: expected_peak_versions(c, r)} and got["shown"] == got["peak"][r], c
    state = results[0][index]["state"]
    assert sorted(state) == sorted(ref_state)
    for name, value in ref_state.items():
        np.testing.assert_allclose(state[name], value, rtol=1e-11, atol=1e-13, err_msg=f"{name} {c}")
    if c["weights"] == "stash":  # the simulator's count of the same schedule
        sim = simulate(_schedule(c))
        assert sim.peak_versions == {r: expected_peak_versions(c, r) for r in range(p)}


CONFIGS = [
    cfg("pipedream", 3, 6),
    cfg("pipedream", 4, 7, momentum=0.9),
    cfg("pipedream", 3, 5, weights="vertical"),
    cfg("2bw", 3, 9),
    cfg("2bw", 2, 9, a=3, momentum=0.9),
]


@pytest.mark.parametrize("c", CONFIGS, ids=lambda c: f"{c['kind']}-p{c['p']}-m{c['m']}-{c['weights']}")
def test_asynchronous_schedules_equal_the_same_semantics_on_threads(c):
    check(c, testing.run(async_run, c["p"], "threads", cfgs=[c]), 0)


@pytest.mark.mpi
def test_asynchronous_schedules_equal_the_same_semantics_under_mpiexec():
    job = [cfg("pipedream", 3, 6, momentum=0.9), cfg("pipedream", 3, 7, weights="vertical"),
           cfg("pipedream", 3, 6, weights="none"), cfg("2bw", 3, 12, a=4)]
    results = testing.run(async_run, 3, "mpi", timeout=90, cfgs=job)
    for index, c in enumerate(job):
        check(c, results, index)
    job = [cfg("pipedream", 4, 8, momentum=0.9), cfg("2bw", 4, 10, a=5), cfg("pipedream", 4, 6, weights="vertical")]
    results = testing.run(async_run, 4, "mpi", timeout=90, cfgs=job)
    for index, c in enumerate(job):
        check(c, results, index)


def test_formulas_pipedream_versions_p_minus_r_and_2bw_two():
    """The counts the tests assert, against the papers: PipeDream stage r holds p - r versions (its
    in-flight micro-batches, Sec. 3.3) once m >= 2 (p - 1 - r); vertical sync p on every stage;
    2BW two (Sec. 3.1); staleness p - 1 - r, resp. p - 1, resp. exactly one update."""
    for p in (2, 3, 4, 5):
        m = 2 * (p - 1) + 1
        assert [expected_peak_versions(cfg("pipedream", p, m), r) for r in range(p)] == [p - r for r in range(p)]
        assert [expected_peak_versions(cfg("pipedream", p, 3 * p, "vertical"), r) for r in range(p)] == [p] * p
        assert [expected_peak_versions(cfg("2bw", p, 3 * p), r) for r in range(p)] == [2] * p
        for kind in ("pipedream", "2bw", "1f1b"):  # cost.pipeline's formula, the counts above
            want = [expected_peak_versions(cfg(kind, p, m if kind == "pipedream" else 3 * p), r) if kind != "1f1b"
                    else 1 for r in range(p)]
            assert [weight_versions(kind, p, r) for r in range(p)] == want
        for r in range(p):
            fwd, _, applied = versions(cfg("pipedream", p, m), r, m - 1)
            assert applied - fwd == p - 1 - r
            fwd, _, applied = versions(cfg("2bw", p, 3 * p), r, 3 * p - 1)
            assert applied - fwd == 1
        sim = simulate(pipedream(p, m))  # U takes no time by default: PipeDream's order is 1F1B's
        assert sim.makespan == pytest.approx((m + p - 1) * 3) and sim.peak_versions == {r: p - r for r in range(p)}
        assert simulate(pipedream_2bw(p, 3 * p)).peak_versions == dict.fromkeys(range(p), 2)


def test_without_stashing_the_backward_reads_newer_weights():
    """weights="none": the backward of micro-batch i on stage r reads version i while its forward ran
    on max(0, i - (p - 1 - r)): the pipeline equals the reference of that mismatch and differs from the
    stashed reference by far more than rounding; the last stage (forward and backward back to back)
    never mismatches."""
    c = cfg("pipedream", 3, 6, weights="none")
    stashed = dict(c, weights="stash")
    results = testing.run(async_run, 3, "threads", cfgs=[c, stashed])
    check(c, results, 0)
    check(stashed, results, 1)
    ref_none, ref_stash = reference(c)[1], reference(stashed)[1]
    for name in ("layers.0.weight", "layers.1.weight"):  # dx = g W^T through stages 2 and 1 differ
        gap = np.abs(results[0][0]["state"][name] - results[0][1]["state"][name]).max()
        assert gap > 1e-4 and np.abs(ref_none[name] - ref_stash[name]).max() == pytest.approx(gap, rel=1e-9)
    seen = results[0][0]["seen"]
    assert [seen[(0, i)][:2] for i in range(6)] == [[0, 0], [0, 1], [0, 2], [1, 3], [2, 4], [3, 5]]
    assert all(results[2][0]["seen"][(2, i)][0] == results[2][0]["seen"][(2, i)][1] for i in range(6))


def test_split_backward_with_updates_equals_the_same_semantics():
    """U after W (the weights' gradient, read on the stashed version as the I was): the same values."""
    c = dict(cfg("pipedream", 3, 5, momentum=0.9), split=True)
    check(c, testing.run(async_run, 3, "threads", cfgs=[c]), 0)


# ---- rejected, with the values that would work -----------------------------------------------------------
def test_bad_configurations_name_the_values_that_work():
    with pytest.raises(ValueError, match=r"m=3 with p=4; use microbatches=4 or more"):
        pipedream(4, 3)
    with pytest.raises(ValueError, match=r"per_update=3 with p=4; use per_update=4 or more"):
        pipedream_2bw(4, 8, 3)
    with pytest.raises(ValueError, match=r"m=7 is not a multiple of 3; use microbatches=6 or 9"):
        pipedream_2bw(3, 7)
    with pytest.raises(ScheduleError, match=r"1U0 comes before the backward of micro-batch 0"):
        validate({0: "0F0 0B0 0U0", 1: "1F0 1U0 1B0"})
    with pytest.raises(ScheduleError, match=r"0B1 is the last gradient of stage 0 but no 0U"):
        validate({0: "0F0 0F1 0B0 0U0 0B1", 1: "1F0 1B0 1U0 1F1 1B1 1U1"})
    lowered = validate({0: "0F0 0B0 0U0", 1: "1F0 1B0 1U0"})
    assert [str(a) for a in lowered[1]] == ["1RECV_F0<-0", "1F0", "1B0", "1SEND_B0->0", "1U0"]


def rejected_run(comm) -> list[tuple[str, int]]:
    model = mlp([3, 4, 2], seed=0)
    x, y = np.zeros((4, 3)), np.zeros((4, 2))
    opt = lambda ps: SGD(ps, lr=0.1)  # noqa: E731
    cases = [
        lambda: Pipeline(comm, model, pipedream(2, 2)),  # U actions but no per-stage optimizer
        lambda: Pipeline(comm, model, make_schedule("1f1b", 2, 2), optimizer=opt),  # synchronous: step's
        lambda: Pipeline(comm, model, pipedream_2bw(2, 4), optimizer=opt, weights="vertical"),
        lambda: Pipeline(comm, model, pipedream(2, 2), optimizer=opt, weights="latest"),
        lambda: Pipeline(comm, model, pipedream(2, 2), optimizer=opt).step(x, y, SGD(model_params(comm), 0.1)),
    ]
    out = []
    for case in cases:
        with mtrace.recording(comm.world_rank) as rec:
            try:
                case()
                out.append(("", len(rec.events)))
            except ValueError as exc:
                out.append((str(exc), len(rec.events)))
    return out


def model_params(comm) -> list:
    return list(MLP([3, 4, 2], seed=0).parameters())


def test_bad_pipelines_rejected_on_every_rank_before_any_message():
    results = testing.run(rejected_run, 2, "threads")
    want = ["needs optimizer=lambda params: SGD(params, lr=...)", "only such a schedule takes one",
            "vertical sync is PipeDream's", "weights must be one of ('stash', 'vertical', 'none')",
            "updates each stage in its U actions; call step(x, y)"]
    for res in results:
        for (msg, n_events), text in zip(res, want, strict=True):
            assert text in msg and n_events == 0, (msg, text)


@pytest.mark.parametrize(("spec", "needle"), [
    ({0: "0F0 0F1 0F2 0B0 0B2 0U2 0B1 0U1".split()}, "applies the gradients of micro-batches [0, 2]"),
    ({0: "0F0 0F1 0B0 0U0 0B1 0U1".split(), 1: "1F0 1B0 1F1 1B1 1U1".split()},
     "stage 1's updates after micro-batches [1], stage 0's after [0, 1]"),
])
def test_update_groups_must_be_contiguous_and_the_same_on_every_stage(spec, needle):
    """The loss is scaled by each update group's size: a group that skips a micro-batch, or stages that
    update after different micro-batches, would apply a wrong mean (reviewer)."""
    with pytest.raises(ScheduleError, match=re.escape(needle)):
        validate(spec)
