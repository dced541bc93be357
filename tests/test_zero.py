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

import numpy as np
import pytest
from hypothesis import example, given
from sp_helpers import token_losses
from strategies import budget, mpi_jobs, zero_configs
from zero_helpers import LR, WEIGHT_DECAY, batch, build, config, padded, param_sizes, ring_bytes, rows, unit_sizes

from minipar import launch, nn, trace
from minipar.optim import AdamW
from minipar.parallel.zero import FullyShardedDataParallel, ZeroDataParallel
from minipar.testing import run_each

EXAMPLES = [config("stage2", 4, cap=200), config("fsdp", 3, prefetch=True), config("fsdp", 2, reshard=False),
            config("stage1", 3, cap=700, d=2, layers=1, steps=2)]


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
    seen, step = [], par.optimizer.step

    def spy() -> bool:  # read the shards' gradients the moment AdamW gets them (cleared after)
        if not seen:
            seen.append([s.grad.copy() for s in par.optimizer.shards])
        return step()

    par.optimizer.step = spy
    losses = []
    with trace.recording(comm.rank) as rec:
        for i in range(c["steps"]):
            x, y = batch(c, i)
            loss = model.loss(x[rows(c, comm.rank)], y[rows(c, comm.rank)])
            par.backward(loss)
            par.step()
            losses.append(loss.item())
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
    by hand from the logits), step 0's gradients, the final parameters."""
    model = build(c)
    opt = AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    out: dict = {"losses": []}
    for i in range(c["steps"]):
        x, y = batch(c, i)
        tokens = token_losses(model(x).data, y)
        out["losses"].append([tokens[rows(c, r)].mean() for r in range(c["world"])])
        opt.zero_grad()
        model.loss(x, y).backward()
        if i == 0:
            out["grads"] = {n: p.grad.copy() for n, p in model.named_parameters()}
        opt.step()
    out["final"] = model.state_dict()
    return out


# Losses: a mean of O(1) terms in another order (seen: 1e-15 rel); later steps inherit the parameters'
# differences below times an O(1) loss gradient: rel 1e-12, 1e-10 after.
LOSS_REL = [1e-12, 1e-10, 1e-10]
# Gradients: each rank sums its rows, the ring adds N partial sums in another order than one process,
# then / N: a few ulps of the largest term (seen: 1e-13 on O(1) entries).
GRAD_TOL = {"rtol": 1e-10, "atol": 1e-12}
# Parameters after 2-3 AdamW steps, as in test_sequence_parallel.py: where step 0's |g| >= 1e-4 an
# update lr m / (sqrt(v) + eps) has slope lr eps / g^2 <= 1e-2 in g, so 1e-9 gradient errors move a
# parameter by 1e-11 (seen: 1e-12). Below that the slope grows to lr / eps = 1e6: the key bias's
# gradient is zero up to rounding (softmax ignores a shift shared by a query's scores) and such
# cancellations of O(1) terms round by up to 1e-14 differently on each side, 1e6 x 1e-14 = 1e-8 per
# step on those entries: 3e-8 for 3 steps.
PARAM_TOL, SMALL_GRAD, SMALL_GRAD_TOL = {"rtol": 1e-10, "atol": 1e-11}, 1e-4, {"rtol": 0, "atol": 3e-8}


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
            small = np.abs(ref["grads"][k]) < SMALL_GRAD
            for part, tol in ((~small, PARAM_TOL), (small, SMALL_GRAD_TOL)):
                np.testing.assert_allclose(got["final"][k][part], want[part], err_msg=f"rank {r} {k}", **tol)
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
    assert max(mem["all"]["gradients"]) == (full if mode == "stage1" else shard)
    if mode == "stage2":  # the k-th bucket reduced: at most the full gradients of the buckets after it
        bound = [8 * (sum(numels[k + 1:]) + sum(shards[:k + 1])) for k in range(len(numels))]
        for inside in mem["in_backward"]:
            assert len(inside) == len(numels) and inside[-1] == shard
            assert all(a <= b for a, b in zip(inside, bound, strict=True)), (inside, bound)
    if mode == "fsdp":
        pairs = [a + b for a, b in zip(pads, pads[1:])] or pads  # a unit and the next, prefetched
        peak = sum(pads) if not c["reshard"] else max(pairs) if c["prefetch"] else max(pads)
        assert max(mem["all"]["gathered units"]) == 8 * peak
        assert [s["gathered units"] for s in mem["after_backward"] + mem["after_step"]] == [0] * 2 * steps
        assert got["fresh"] and got["sharded"]  # after construction and after the steps: shards only


def always(prop):
    for c in reversed(EXAMPLES):
        prop = example(c=c)(prop)
    return prop


@budget(8)
@given(c=zero_configs())
@always
def test_zero_equals_single_process_threads(c: dict) -> None:
    check_zero(c, launch(zero_run, c["world"], c=c))


@pytest.mark.mpi
@budget(2)
@given(job=mpi_jobs(zero_configs))
@example(job=(3, [config("fsdp", 3, deferred=False), config("stage2", 3, cap=700, layers=1)]))
def test_zero_equals_single_process_mpiexec(job: tuple[int, list[dict]]) -> None:
    """One mpiexec job per drawn N runs a drawn list of configurations."""
    n, cs = job
    for c, results in zip(cs, run_each(zero_run, n, [{"c": c} for c in cs], timeout=90, comm_timeout=30)):
        check_zero(c, results)
