"""bf16 mixed precision (``minipar.parallel.bf16``): DDP, ZeRO stages 1 and 2 and FSDP against one process
running the same recipe, the bytes sent and kept, and the recipes refused.

The single-process reference runs the recipe by hand: a bfloat16 GPT, the global batch cut into N
micro-batches as the ranks cut it, each micro-batch's bfloat16 gradient cast to the reduce dtype and
combined as the wrapper combines it (ZeRO and FSDP divide by N, then sum; DDP sums, then divides),
float32 AdamW on a float32 master, bfloat16 working copy. On N <= 2 ranks the ring adds the same two
terms (addition commutes), so the runs are equal bit for bit: losses, reduced gradients, fp32
masters, bf16 parameters. On N > 2 the ring adds in another order: the first step's reduced gradient
is checked against the bound of two recursive sums of the same N terms in the reduce dtype (Higham
2002, "Accuracy and Stability of Numerical Algorithms", Sec. 4.2: each is within
gamma_{N-1} sum |t| of the exact sum, gamma_k = k u / (1 - k u), u = 2^-24 in fp32, 2^-8 in bf16),
plus, for DDP, the two roundings of the division by N.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st
from strategies import budget, mpi_jobs
from zero_helpers import batch, first_gradients, rows

from minipar import nn, trace
from minipar.autograd import BF16, Tensor
from minipar.comm import launch
from minipar.optim import AdamW
from minipar.parallel.bf16 import MasterAdamW
from minipar.parallel.ddp import DistributedDataParallel
from minipar.parallel.zero import FullyShardedDataParallel, ZeroDataParallel
from minipar.testing import run_each

LR, WD = 1e-2, 0.1
UNIT = {"fp32": 2.0**-24, "bf16": 2.0**-8, "fp16": 2.0**-11}  # unit roundoff of the reduce dtype
WIRE = {"fp32": np.dtype(np.float32), "bf16": BF16, "fp16": np.dtype(np.float16)}
MODES = ("ddp", "stage1", "stage2", "fsdp")


def config(mode: str, world: int, reduce: str = "bf16", d: int = 4, heads: int = 2, layers: int = 2, steps: int = 3,
           seed: int = 7, cap: int = 200) -> dict:
    return {"mode": mode, "world": world, "reduce": reduce, "vocab": 5, "seq": 3, "d": d, "heads": heads,
            "layers": layers, "batch": 2 * world, "steps": steps, "seed": seed, "cap": cap}


@st.composite
def bf16_configs(draw: st.DrawFn, world: int | None = None) -> dict:
    world = draw(st.integers(1, 4)) if world is None else world
    heads, mode = draw(st.integers(1, 2)), draw(st.sampled_from(MODES))
    reduces = ["bf16", "fp32"] + ([] if mode == "ddp" else ["fp16"])  # DDP refuses fp16 (test_bf16_cost)
    return {"mode": mode, "world": world, "reduce": draw(st.sampled_from(reduces)),
            "vocab": draw(st.integers(2, 7)), "seq": draw(st.integers(1, 4)), "d": heads * draw(st.integers(2, 3)),
            "heads": heads, "layers": draw(st.integers(1, 2)), "batch": world * draw(st.integers(1, 2)),
            "steps": draw(st.integers(2, 3)), "seed": draw(st.integers(0, 2**16)),
            "cap": draw(st.sampled_from([200, 700, 1 << 20]))}


def build(c: dict) -> nn.GPT:
    return nn.GPT(c["vocab"], c["seq"], c["d"], c["heads"], c["layers"], seed=c["seed"], dtype=BF16)


def make(comm, c: dict):
    """The model, the wrapper and the fp32 masters (as a list of arrays: the optimizer's own)."""
    if c["mode"] == "ddp":
        model = build(c)
        ddp = DistributedDataParallel(model, comm, bucket_cap_bytes=c["cap"], reduce_dtype=c["reduce"])
        return model, ddp, MasterAdamW(model.parameters(), LR, weight_decay=WD)
    if c["mode"] == "fsdp":
        with nn.deferred():
            model = build(c)
        return model, FullyShardedDataParallel(model, comm, lr=LR, weight_decay=WD, precision="bf16",
                                               reduce_dtype=c["reduce"]), None
    return model_zero(comm, c)


def model_zero(comm, c: dict):
    model = build(c)
    return model, ZeroDataParallel(model, comm, stage=int(c["mode"][-1]), lr=LR, weight_decay=WD,
                                   bucket_cap_bytes=c["cap"], precision="bf16", reduce_dtype=c["reduce"]), None


def by_name(comm, groups, arrays) -> dict[str, np.ndarray]:
    """Whole arrays by parameter name from this rank's shards of flat groups (float32 on the wire)."""
    out = {}
    for g, a in zip(groups, arrays, strict=True):
        out.update(zip(g.names, (v.copy() for v in g.layout.views(comm.allgather(a.astype(np.float32)))), strict=True))
    return out


def bf16_run(comm, c: dict) -> dict:
    """This rank's losses, step 0's reduced gradients (as AdamW gets them), the final bf16 parameters and
    fp32 masters (whole, as float32), the bytes it sent by collective and (ZeRO, FSDP) the bytes it held
    after step 0's backward (the optimizer state: after the last step)."""
    model, par, opt = make(comm, c)
    seen, held = first_gradients(par.optimizer) if opt is None else [], {}
    losses = []
    with trace.recording(comm.rank) as rec:
        for i in range(c["steps"]):
            x, y = batch(c, i)
            loss = model.loss(x[rows(c, comm.rank)], y[rows(c, comm.rank)])
            par.backward(loss)
            if i == 0 and opt is None:
                held = dict(par.state_bytes())
            if opt is None:
                par.step()
            else:
                if not seen:
                    seen.append({n: p.grad.astype(np.float32) for n, p in model.named_parameters()})
                opt.step()
                opt.zero_grad()
            losses.append(float(loss.data))
    sent = {}
    for e in rec.events:
        if e.kind == "comm" and e.name == "send" and e.src == comm.rank:
            sent[e.op] = sent.get(e.op, 0) + e.nbytes
    if opt is not None:
        grads, final = seen[0], {n: p.data.astype(np.float32) for n, p in model.named_parameters()}
        master = {n: m.data.copy() for (n, _), m in zip(model.named_parameters(), opt.params, strict=True)}
    else:
        groups = par.units if c["mode"] == "fsdp" else par.buckets
        grads = by_name(comm, groups, seen[0])
        master = by_name(comm, groups, [m.data for m in par.optimizer.master])
        whole = par.full_state_dict() if c["mode"] == "fsdp" else model.state_dict()
        final = {n: v.astype(np.float32) for n, v in whole.items()}
        held["optimizer state"] = par.state_bytes()["optimizer state"]  # AdamW's moments exist once it stepped
    return {"losses": losses, "grads": grads, "final": final, "master": master, "sent": sent, "held": held}


def reference(c: dict) -> dict:
    """One process, the same recipe by hand (module docstring); also each step-0 term's |t| sum."""
    model, n, wire = build(c), c["world"], WIRE[c["reduce"]]
    params = dict(model.named_parameters())
    master = {k: p.data.astype(np.float32) for k, p in params.items()}
    adam = AdamW([Tensor(m) for m in master.values()], LR, weight_decay=WD)
    losses, grads0, mass0 = [], None, None
    for i in range(c["steps"]):
        x, y = batch(c, i)
        terms = {k: [] for k in params}
        for r in range(n):
            loss = model.loss(x[rows(c, r)], y[rows(c, r)])
            loss.backward()
            losses.append(float(loss.data))
            for k, p in params.items():
                t = p.grad.astype(wire)
                if c["mode"] != "ddp":
                    t /= n
                terms[k].append(t)
                p.grad = None
        grads = {}
        for k, ts in terms.items():
            total = ts[0].copy()
            for t in ts[1:]:
                np.add(total, t, out=total)
            if c["mode"] == "ddp":
                total /= n
            grads[k] = total.astype(np.float32)
        if grads0 is None:
            grads0 = grads
            mass0 = {k: sum(np.abs(t.astype(np.float64)) for t in ts) for k, ts in terms.items()}
        for m, k in zip(adam.params, params, strict=True):
            m.grad = grads[k]
        adam.step()
        for m, p in zip(adam.params, params.values(), strict=True):
            p.data[...] = m.data
    final = {k: p.data.astype(np.float32) for k, p in params.items()}
    return {"losses": losses, "grads": grads0, "mass": mass0, "final": final,
            "master": {k: m.data for k, m in zip(params, adam.params, strict=True)}}


def bound(c: dict, mass: np.ndarray) -> np.ndarray:
    """Two recursive sums of the same N terms in the reduce dtype (and, for DDP, two roundings of / N)."""
    n, u = c["world"], UNIT[c["reduce"]]
    gamma = (n - 1) * u / (1 - (n - 1) * u)
    if c["mode"] == "ddp":
        return 2 * (gamma + u * (1 + gamma)) * mass / n
    return 2 * gamma * mass


def check(c: dict, results: list[dict]) -> None:
    want, n = reference(c), c["world"]
    per_rank = np.array([r["losses"] for r in results]).T  # step x rank
    steps = np.array(want["losses"]).reshape(c["steps"], n)
    if n <= 2:  # the same sums: equal bit for bit
        assert (per_rank == steps).all()
    else:  # the first forward precedes any reduce
        assert (per_rank[0] == steps[0]).all()
    for got in results:
        for k, g in want["grads"].items():
            diff = np.abs(got["grads"][k] - g)
            assert (diff <= (0 if n <= 2 else bound(c, want["mass"][k]))).all(), (k, diff.max())
        if n <= 2:
            for k in want["final"]:
                assert np.array_equal(got["final"][k], want["final"][k]), k
                assert np.array_equal(got["master"][k], want["master"][k]), k
        assert all(v.dtype == np.float32 for v in got["master"].values())


@budget(8)
@given(c=bf16_configs())
@example(c=config("stage2", 2))
@example(c=config("fsdp", 2, "fp32"))
@example(c=config("ddp", 2, "fp32"))
@example(c=config("ddp", 2))
@example(c=config("stage1", 2, "fp16"))
@example(c=config("stage1", 3, "fp32"))
@example(c=config("fsdp", 4, "bf16", d=3, heads=1))
@example(c=config("ddp", 4, d=3, heads=1))
def test_bf16_equals_single_process_threads(c: dict) -> None:
    check(c, launch(bf16_run, c["world"], c=c))


@pytest.mark.mpi
@budget(1)
@given(job=mpi_jobs(bf16_configs))
@example(job=(2, [config("ddp", 2), config("stage2", 2, "fp32"), config("fsdp", 2)]))
@example(job=(3, [config("fsdp", 3, "fp32"), config("ddp", 3, "bf16", d=3, heads=1)]))
def test_bf16_equals_single_process_mpiexec(job: tuple[int, list[dict]]) -> None:
    n, cs = job
    for c, results in zip(cs, run_each(bf16_run, n, [{"c": c} for c in cs], timeout=90, comm_timeout=30)):
        check(c, results)


def resume_run(comm, c: dict, path: str, resume: bool) -> dict[str, np.ndarray]:
    """Two steps, a checkpoint, one more step; or (``resume``) the checkpoint, then that step."""
    model, par, _ = make(comm, c)
    steps = [2] if resume else [0, 1, 2]
    if resume:
        par.load_checkpoint(path)
    for i in steps:
        x, y = batch(c, i)
        par.backward(model.loss(x[rows(c, comm.rank)], y[rows(c, comm.rank)]))
        par.step()
        if i == 1:
            par.save_checkpoint(path)
    whole = par.full_state_dict() if c["mode"] == "fsdp" else model.state_dict()
    return {**{n: v.astype(np.float32) for n, v in whole.items()},
            **{f"master/{n}": v for n, v in by_name(comm, par.units if c["mode"] == "fsdp" else par.buckets,
                                                   [m.data for m in par.optimizer.master]).items()}}


@pytest.mark.parametrize("mode", ["stage2", "fsdp"])
def test_bf16_checkpoint_resumes_bit_for_bit(mode: str, tmp_path) -> None:
    """bf16 shards are saved as float32 (exact) with the fp32 master and moments: resuming after step 2
    gives the parameters and masters of never having stopped, bit for bit."""
    c = config(mode, 2, "fp32")
    path = str(tmp_path / "ck")
    straight = launch(resume_run, 2, c=c, path=path, resume=False)
    resumed = launch(resume_run, 2, c=c, path=path, resume=True)
    assert all(np.array_equal(straight[0][k], resumed[0][k]) for k in straight[0])
