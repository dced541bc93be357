"""ZeRO stages 1 and 2 and FSDP (ZeRO-3) equal the single process on the global batch; traffic and
memory per rank are exactly the hand-derived sizes; FSDP never holds the model whole.

Property drawn by hypothesis (``strategies.zero_configs``: stage 1, 2 or FSDP with reshard after
forward, prefetch and deferred construction each on or off, N = 1-4, bucket caps, tiny GPTs whose
groups need padding, seeds, 2-3 AdamW steps), on the threads backend and under ``mpiexec``: every
rank's loss is the mean cross-entropy of its rows, step 0's reduce-scattered gradients (all-gathered)
and the parameters after the steps equal ``minipar.nn.GPT`` with ``minipar.optim.AdamW`` on the global
batch, and the padding stays zero. From the trace: the bytes each rank sends per step are 2 (N-1)/N
of the padded bucket bytes (stages 1, 2), 3 (N-1)/N of the padded unit bytes (FSDP; 2 without
reshard after forward); the memory samples are the shard sizes times 8 (parameters, gradients) or 16
(AdamW's two moments), and FSDP's gathered units peak at the largest adjacent pair of units with
prefetch, the largest unit without, every unit without reshard after forward. Every size is
computed here from the GPT's definition (``zero_helpers``). Bad configurations raise the same
message on every rank before the communicator is touched.
"""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest
from hypothesis import example, given
from sp_helpers import token_losses
from strategies import budget, mpi_jobs, zero_configs
from tolerances import assert_close_after_adamw
from zero_helpers import (
    GRAD_TOL,
    LR,
    PARAM_TOL,
    WEIGHT_DECAY,
    attempt,
    batch,
    build,
    config,
    first_gradients,
    padded,
    param_sizes,
    ring_bytes,
    rows,
    train_steps,
    unit_sizes,
)

from minipar import launch, nn
from minipar.optim import AdamW
from minipar.parallel.zero import FullyShardedDataParallel, ZeroDataParallel
from minipar.testing import run, run_each

EXAMPLES = [config("stage2", 4, cap=200, d=3, heads=1), config("fsdp", 3, prefetch=True),
            config("fsdp", 2, reshard=False, d=3, heads=3), config("stage1", 3, cap=700, layers=1, steps=2)]


# ---- the triple -----------------------------------------------------------------------------------
def make(comm, c: dict):
    """The model (FSDP: built under ``nn.deferred()`` when ``c["deferred"]``) and its wrapper."""
    if c["mode"] == "fsdp":
        if c["deferred"]:
            with nn.deferred():
                model = build(c)
        else:
            model = build(c)
        return model, FullyShardedDataParallel(model, comm, reshard_after_forward=c["reshard"],
                                               prefetch=c["prefetch"], lr=LR, weight_decay=WEIGHT_DECAY)
    model = build(c)
    return model, ZeroDataParallel(model, comm, stage=int(c["mode"][-1]), lr=LR, weight_decay=WEIGHT_DECAY,
                                   bucket_cap_bytes=c["cap"])


def samples_by_step(events: list) -> dict:
    """Memory samples by label: all of them, the last before each step's "opt" span (after backward),
    the first after it (after the step), and the "gradients" samples inside each "B" span."""
    mem = [e for e in events if e.kind == "memory"]
    spans = {name: [e for e in events if e.kind == "compute" and e.name == name] for name in ("B", "opt")}

    def where(pick) -> list[dict]:
        return [{label: [e.nbytes for e in mem if e.name == label and pick(e, s)] for label in {e.name for e in mem}}
                for s in spans["opt"]]

    return {"all": {label: [e.nbytes for e in mem if e.name == label] for label in {e.name for e in mem}},
            "after_backward": [{k: v[-1] for k, v in d.items()} for d in where(lambda e, s: e.t0 <= s.t0)],
            "after_step": [{k: v[0] for k, v in d.items()} for d in where(lambda e, s: e.t0 >= s.t1)],
            "in_backward": [[e.nbytes for e in mem if e.name == "gradients" and b.t0 <= e.t0 <= b.t1]
                            for b in spans["B"]]}


def zero_run(comm, c: dict) -> dict:
    """This rank's losses, step 0's gradients as AdamW receives them (every rank's shards gathered into
    the flat groups), the final parameters, the bytes it sent and its memory samples."""
    model, par = make(comm, c)
    groups = par.units if c["mode"] == "fsdp" else par.buckets
    fresh = all(not any(p.data.strides) for p in model.parameters())
    seen = first_gradients(par.optimizer)
    losses, rec = train_steps(comm, c, model, par)
    sharded = all(not any(p.data.strides) for p in model.parameters())
    grads = [comm.allgather(g) for g in seen[0]]  # after the recording: not part of the traffic
    params = [comm.allgather(g.shard.data) for g in groups]
    final = par.full_state_dict() if c["mode"] == "fsdp" else model.state_dict()
    return {"losses": losses, "names": [list(g.names) for g in groups], "grads": grads, "params": params,
            "final": final, "shard_sizes": [g.layout.shard_size for g in groups],
            "sent": sum(e.nbytes for e in rec.events if e.kind == "comm" and e.name == "send" and e.src == comm.rank),
            "memory": samples_by_step(rec.events), "fresh": fresh, "sharded": sharded}


def zero_reference(c: dict) -> dict:
    """One process, AdamW on the global batch: each rank's loss (the mean cross-entropy of its rows,
    by hand from the logits), step 0's gradients, every step's ("step_grads"), the final parameters."""
    model = build(c)
    opt = AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    out: dict = {"losses": [], "step_grads": {n: [] for n, _ in model.named_parameters()}}
    for i in range(c["steps"]):
        x, y = batch(c, i)
        tokens = token_losses(model(x).data, y)
        out["losses"].append([tokens[rows(c, r)].mean() for r in range(c["world"])])
        opt.zero_grad()
        model.loss(x, y).backward()
        for n, p in model.named_parameters():
            out["step_grads"][n].append(p.grad.copy())
        opt.step()
    out["grads"] = {n: g[0] for n, g in out["step_grads"].items()}
    out["final"] = model.state_dict()
    return out


# Losses: a mean of O(1) terms in another order (seen over 120 draws: 4e-16 rel); later steps inherit
# the parameters' differences below times an O(1) loss gradient (seen: 2e-14): rel 1e-12, 1e-10 after.
LOSS_REL = [1e-12, 1e-10, 1e-10]
# Gradients: zero_helpers.GRAD_TOL; parameters after the steps: zero_helpers.PARAM_TOL plus AdamW's drift.


def check_zero(c: dict, results: list[dict]) -> None:
    n, sizes, ref = c["world"], param_sizes(c), zero_reference(c)
    names = results[0]["names"]
    numels = [sum(sizes[k] for k in group) for group in names]
    pads, shards = [padded(m, n) for m in numels], [padded(m, n) // n for m in numels]
    assert sorted(k for group in names for k in group) == sorted(sizes)  # every parameter in one group
    if c["mode"] == "fsdp":
        assert numels == unit_sizes(c)
    for r, got in enumerate(results):
        assert got["names"] == names and got["shard_sizes"] == shards, r
        for i, want in enumerate(ref["losses"][:c["steps"]]):
            assert got["losses"][i] == pytest.approx(want[r], rel=LOSS_REL[i]), (r, i)
        for flats, what in ((got["grads"], "grad"), (got["params"], "param")):
            assert [len(f) for f in flats] == pads, what
            for group, flat, m in zip(names, flats, numels, strict=True):
                assert not flat[m:].any(), (r, what, "padding")  # zeros in, zeros out
                if what == "grad":
                    offsets = np.cumsum([0] + [sizes[k] for k in group])
                    for k, a, b in zip(group, offsets[:-1], offsets[1:], strict=True):
                        np.testing.assert_allclose(flat[a:b], ref["grads"][k].ravel(), err_msg=f"rank {r} {k}",
                                                   **GRAD_TOL)
        assert got["final"].keys() == ref["final"].keys()
        for k, want in ref["final"].items():
            assert_close_after_adamw(got["final"][k], want, ref["step_grads"][k], LR, GRAD_TOL, PARAM_TOL,
                                     err_msg=f"rank {r} {k}")
        check_traffic_and_memory(c, got, numels, pads, shards)


def check_traffic_and_memory(c: dict, got: dict, numels: list[int], pads: list[int], shards: list[int]) -> None:
    n, steps, mode = c["world"], c["steps"], c["mode"]
    rings = 2 if mode != "fsdp" or not c["reshard"] else 3  # reduce-scatter, all-gather (, all-gather again)
    assert got["sent"] == steps * rings * sum(ring_bytes(m, n) for m in numels)
    mem, shard, full = got["memory"], 8 * sum(shards), 8 * sum(numels)
    assert set(mem["all"]) == {"parameters", "gradients", "optimizer state"} | (
        {"gathered units"} if mode == "fsdp" else set())
    assert set(mem["all"]["parameters"]) == {shard if mode == "fsdp" else 8 * sum(pads)}
    assert max(mem["all"]["optimizer state"]) == 2 * shard  # AdamW's m and v of this rank's shard
    assert [s["optimizer state"] for s in mem["after_backward"]] == [0] + [2 * shard] * (steps - 1)
    assert [s["optimizer state"] for s in mem["after_step"]] == [2 * shard] * steps
    # after backward: stage 1 holds every full gradient, stage 2 and FSDP only the reduced shards
    assert [s["gradients"] for s in mem["after_backward"]] == [full if mode == "stage1" else shard] * steps
    assert [s["gradients"] for s in mem["after_step"]] == [0] * steps
    if mode == "fsdp":  # unit i's full gradients just before its reduce-scatter, beside the shards of
        # the units after it (reduced before it: backward runs the units in reverse)
        grad_peak = max(8 * (numels[i] + sum(shards[i + 1:])) for i in range(len(numels)))
    else:
        grad_peak = full if mode == "stage1" else shard
    assert max(mem["all"]["gradients"]) == grad_peak
    if mode == "stage2":  # the k-th bucket reduced: at most the full gradients of the buckets after it
        bound = [8 * (sum(numels[k + 1:]) + sum(shards[:k + 1])) for k in range(len(numels))]
        for inside in mem["in_backward"]:
            assert len(inside) == len(numels) and inside[-1] == shard
            assert all(a <= b for a, b in zip(inside, bound, strict=True)), (inside, bound)
    if mode == "fsdp":
        pairs = [a + b for a, b in zip(pads, pads[1:])] or pads  # a unit and the next, prefetched
        peak = sum(pads) if not c["reshard"] else max(pairs) if c["prefetch"] else max(pads)
        peak = 0 if n == 1 else peak  # one rank: the shard is the whole unit, nothing is gathered
        assert max(mem["all"]["gathered units"]) == 8 * peak
        assert [s["gathered units"] for s in mem["after_backward"] + mem["after_step"]] == [0] * 2 * steps
        assert got["fresh"] and got["sharded"]  # after construction and after the steps: shards only


def always(prop):
    for c in reversed(EXAMPLES):
        prop = example(c=c)(prop)
    return prop


@budget(20)
@given(c=zero_configs())
@always
def test_zero_equals_single_process_threads(c: dict) -> None:
    check_zero(c, launch(zero_run, c["world"], c=c))


@pytest.mark.mpi
@budget(1)  # the simplest drawn job (p = 2) beside the @examples; thorough: 10 drawn jobs
@given(job=mpi_jobs(zero_configs))
@example(job=(3, [config("fsdp", 3, deferred=False), config("stage2", 3, cap=700, layers=1)]))
@example(job=(4, [EXAMPLES[0], config("fsdp", 4, reshard=False, prefetch=False, d=3, heads=1, steps=2)]))
def test_zero_equals_single_process_mpiexec(job: tuple[int, list[dict]]) -> None:
    """One mpiexec job per drawn N runs a drawn list of configurations."""
    n, cs = job
    for c, results in zip(cs, run_each(zero_run, n, [{"c": c} for c in cs], timeout=90, comm_timeout=30)):
        check_zero(c, results)


# ---- one model by hand ----------------------------------------------------------------------------
# GPT(vocab 5, seq 3, d 4, 2 heads, 2 layers) on N = 3, one step. Units: tok_emb 5 x 4 = 20, pos_emb
# 3 x 4 = 12, each block 2 x 8 (layer norms) + 4 x 20 (q, k, v, proj) + (4 x 16 + 16) + (16 x 4 + 4)
# = 244, ln_f 8, head 4 x 5 = 20: 548 elements. Padded to multiples of 3: 21, 12, 246, 246, 9, 21 =
# 555, shards of 7, 4, 82, 82, 3, 7 = 185 elements. One bucket (stages): 548 -> 549, shard 183.
HAND_UNITS, HAND_SHARDS = [20, 12, 244, 244, 8, 20], [7, 4, 82, 82, 3, 7]
BY_HAND = {  # name: (config, bytes sent, parameters, optimizer state, gradients after backward, gathered peak)
    # FSDP: 3 rings x (N-1) = 2 blocks x 185 x 8 B; the largest adjacent pair, two blocks: 2 x 246 x 8
    "fsdp": (config("fsdp", 3, steps=1), 3 * 2 * 185 * 8, 185 * 8, 185 * 16, 185 * 8, 2 * 246 * 8),
    "fsdp no prefetch": (config("fsdp", 3, prefetch=False, steps=1), 3 * 2 * 185 * 8, 1480, 2960, 1480, 246 * 8),
    "fsdp no reshard": (config("fsdp", 3, reshard=False, steps=1), 2 * 2 * 185 * 8, 1480, 2960, 1480, 555 * 8),
    # stages: 2 rings x 2 blocks x 183 x 8 B; every rank holds the padded 549; stage 1 the 548 gradients
    "stage1": (config("stage1", 3, cap=1 << 20, steps=1), 2 * 2 * 183 * 8, 549 * 8, 183 * 16, 548 * 8, None),
    "stage2": (config("stage2", 3, cap=1 << 20, steps=1), 2 * 2 * 183 * 8, 549 * 8, 183 * 16, 183 * 8, None),
}


@pytest.mark.parametrize("name", BY_HAND)
def test_sizes_bytes_and_memory_by_hand(name: str) -> None:
    c, sent, params, state, grads, gathered = BY_HAND[name]
    assert unit_sizes(c) == HAND_UNITS and sum(HAND_UNITS) == 548
    for got in launch(zero_run, 3, c=c):
        assert got["shard_sizes"] == (HAND_SHARDS if c["mode"] == "fsdp" else [183])
        assert got["sent"] == sent
        mem = got["memory"]
        assert set(mem["all"]["parameters"]) == {params}
        assert mem["after_step"][0]["optimizer state"] == state and mem["after_backward"][0]["gradients"] == grads
        assert max(mem["all"].get("gathered units", [None])) == gathered


# ---- FSDP never holds the model whole -------------------------------------------------------------
BIG = {"vocab": 16, "seq": 8, "d": 64, "heads": 2, "layers": 2, "seed": 1}
PYTHON_TRANSIENT = 32 << 10  # lists, generators and frames alive only during construction (seen: <= 20 KiB)


def construction_memory(comm) -> dict:
    """tracemalloc during this rank's ``nn.deferred()`` GPT + FSDP construction, the ranks one after
    another (tracemalloc sees every thread; the others wait in the barrier): peak, the array bytes and
    the Python-object bytes still alive at the end, the shard elements."""
    np.random.default_rng(0).normal(size=1)  # numpy.random's lazy imports, before measuring
    out: dict = {}
    for r in range(comm.size):
        if r == comm.rank:
            tracemalloc.start()
            with nn.deferred():
                model = build(BIG)
            fsdp = FullyShardedDataParallel(model, comm)
            peak = tracemalloc.get_traced_memory()[1]
            snap = tracemalloc.take_snapshot()
            tracemalloc.stop()
            alive = [sum(t.size for t in snap.filter_traces([
                tracemalloc.DomainFilter(inside, np.lib.tracemalloc_domain)]).traces) for inside in (True, False)]
            out = {"peak": peak, "arrays": alive[0], "python": alive[1], "n_params": len(model.parameters()),
                   "shards": [u.shard.data.size for u in fsdp.units],
                   "unallocated": all(not any(p.data.strides) for p in model.parameters())}
        comm.barrier()
    return out


def test_fsdp_construction_never_holds_the_model() -> None:
    """Per rank: arrays = the shards (+ 8 B per placeholder's shared zero); peak <= those + the largest
    unit shard again (``init_shard`` draws a piece's rows, <= the piece + 2 rows, before copying them
    in) + 2 rows of the widest parameter (4d) + one initialisation tile + the Python objects. Building
    the GPT whole holds every parameter: more than that bound."""
    if tracemalloc.is_tracing():  # started outside (python -X tracemalloc): its peak is not ours to reset
        pytest.skip("tracemalloc is already tracing")
    whole = 8 * sum(param_sizes(BIG).values())
    for got in launch(construction_memory, 4):
        units = [padded(m, 4) // 4 for m in unit_sizes(BIG)]
        assert got["shards"] == units and got["unallocated"]
        shards = 8 * sum(units)
        assert shards <= got["arrays"] <= shards + 16 * got["n_params"]
        bound = got["arrays"] + 8 * (max(units) + 2 * 4 * BIG["d"] + nn.TILE**2) + got["python"] + PYTHON_TRANSIENT
        assert got["peak"] <= bound < whole, (got, bound, whole)
    tracemalloc.start()
    build(BIG)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak > whole > bound


# ---- bad configurations ---------------------------------------------------------------------------
BAD = {  # name: (wrapper, keyword arguments, phrases the message must contain)
    "stage 3": ("zero", {"stage": 3}, ["stage=3 is not a ZeRO stage", "FullyShardedDataParallel for stage 3"]),
    "stage 0": ("zero", {"stage": 0}, ["stage=0 is not a ZeRO stage", "use 1 (optimizer state) or 2"]),
    "cap 0": ("zero", {"bucket_cap_bytes": 0}, ["bucket_cap_bytes=0 must be > 0"]),
    "cap < 0": ("zero", {"bucket_cap_bytes": -8}, ["bucket_cap_bytes=-8 must be > 0"]),
    "both": ("zero", {"stage": 3, "bucket_cap_bytes": 0}, ["stage=3", "bucket_cap_bytes=0"]),
    "policy wraps nothing": ("fsdp", {"policy": lambda name, m: False}, ["the wrapping policy wraps no module"]),
    "policy leaves parameters": ("fsdp", {"policy": lambda name, m: name == "head"},
                                 ["'tok_emb.weight', 'pos_emb.weight', 'blocks.0.ln1.weight'", "in no unit",
                                  "policy=transformer_units"]),
}


def construct(comm, kind: str, kwargs: dict) -> None:
    if kind == "zero":
        ZeroDataParallel(build(EXAMPLES[0]), comm, **kwargs)
    else:
        with nn.deferred():
            FullyShardedDataParallel(build(EXAMPLES[0]), comm, **kwargs)


def bad_run(comm) -> dict:
    """Every bad configuration on every rank: ``attempt``'s (message, comm events, attributes used)."""
    return {name: attempt(comm, lambda c, k=kind, kw=kwargs: construct(c, k, kw))
            for name, (kind, kwargs, _) in BAD.items()}


def check_bad(results: list[dict]) -> None:
    assert len(results) == 3 and all(got == results[0] for got in results)  # the same message on every rank
    for name, (_, _, phrases) in BAD.items():
        msg, events, used = results[0][name]
        assert all(p in msg for p in phrases), (name, msg)
        assert (events, used) == (0, []), name  # nothing sent, the communicator untouched


def test_bad_configurations_rejected_on_every_rank_threads() -> None:
    check_bad(launch(bad_run, 3))


@pytest.mark.mpi
def test_bad_configurations_rejected_on_every_rank_mpiexec() -> None:
    check_bad(run(bad_run, 3, backend="mpi", timeout=60, comm_timeout=20))
