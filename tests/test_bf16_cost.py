"""bf16 mixed precision's bytes and refusals: per-parameter bytes (``cost.zero.precision_bytes``, K = 12)
from the dtypes' sizes; the bytes DDP, ZeRO 1-2 and FSDP send and hold against sizes written out by hand
from the GPT's definition (``zero_helpers``) and against ``minipar.cost``; the gradients' collectives move
half the bytes in a bf16 reduce that they move in an fp32 one, the parameters' all-gathers the same;
bad recipes refused in one line on every rank before any message (threads and ``mpiexec``)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from test_bf16 import bf16_run, build, config
from zero_helpers import attempt, padded, param_sizes, unit_sizes

from minipar import nn, trace
from minipar.comm import launch
from minipar.cost import data as cost_data
from minipar.cost import zero as cost
from minipar.parallel.ddp import DistributedDataParallel
from minipar.parallel.zero import FullyShardedDataParallel, ZeroDataParallel
from minipar.testing import run

BF16 = np.dtype(ml_dtypes.bfloat16).itemsize  # 2
FP32 = np.dtype(np.float32).itemsize  # 4


def test_bytes_per_parameter_from_the_dtypes() -> None:
    """bf16 working copy 2, fp32 master 4, fp32 m and v 2 x 4: K = 12; gradients 2, or 4 reduced in fp32."""
    for reduce, grad in ((None, BF16), ("bf16", BF16), ("fp32", FP32), ("fp16", np.dtype(np.float16).itemsize)):
        got = cost.precision_bytes("bf16", reduce)
        assert got == {"parameters": BF16, "gradients": grad, "optimizer state": 2 * FP32, "master parameters": FP32}
        assert got["optimizer state"] + got["master parameters"] == 12
    assert cost.precision_bytes("fp64") == {"parameters": 8, "gradients": 8, "optimizer state": 16}
    for bad in (("fp64", "fp32"), ("bf16", "fp8"), ("fp8", None)):
        with pytest.raises(ValueError, match="precision="):
            cost.precision_bytes(*bad)


def groups(c: dict) -> list[int]:
    """Elements of each flat group: FSDP's units, else one bucket of every parameter (cap 1 MiB)."""
    return unit_sizes(c) if c["mode"] == "fsdp" else [sum(param_sizes(c).values())]


def by_hand(c: dict) -> tuple[dict[str, int], dict[str, int]]:
    """Bytes rank 0 sends per step by collective and holds after backward, written out: a ring
    all-gather or reduce-scatter of a group padded to L sends (N-1) L/N elements; DDP's ring
    all-reduce of n elements (N dividing n here) 2 (N-1) n/N; bf16 parameters, gradients in the
    reduce dtype once reduced, fp32 master and moments on the shard."""
    n, w = c["world"], {"bf16": BF16, "fp32": FP32}[c["reduce"]]
    sizes = groups(c)
    if c["mode"] == "ddp":
        return {"allreduce": 2 * (n - 1) * sizes[0] // n * w}, {}
    ring = sum((n - 1) * padded(s, n) // n for s in sizes)
    shard = sum(padded(s, n) // n for s in sizes)
    gathers = 2 if c["mode"] == "fsdp" else 1
    sent = {"allgather": gathers * ring * BF16, "reduce_scatter": ring * w} if n > 1 else {}
    params = shard * BF16 if c["mode"] == "fsdp" else padded(sizes[0], n) * BF16
    grads = sum(sizes) * BF16 if c["mode"] == "stage1" else shard * w  # full bf16 gradients until the step
    return sent, {"parameters": params, "gradients": grads, "optimizer state": 2 * FP32 * shard,
                  "master parameters": FP32 * shard}


CASES = [config(m, n, r, steps=1, cap=1 << 20) for m in ("ddp", "stage1", "stage2", "fsdp") for n in (2, 4)
         for r in ("bf16", "fp32")]


@pytest.mark.parametrize("c", CASES, ids=lambda c: f"{c['mode']}-{c['world']}-{c['reduce']}")
def test_bytes_sent_and_held_by_hand_and_by_formula(c: dict) -> None:
    want_sent, want_held = by_hand(c)
    results = launch(bf16_run, c["world"], c=c)
    stage = {"ddp": 0, "stage1": 1, "stage2": 2, "fsdp": 3}[c["mode"]]
    grad = {"bf16": 2, "fp32": 4}[c["reduce"]]
    formula = cost.zero_traffic_by_op(groups(c), stage, c["world"], 2, grad)
    for r, got in enumerate(results):
        assert got["sent"] == want_sent == formula
        total = cost.zero_traffic_bytes(groups(c), stage, c["world"], 2, r, grad_itemsize=grad)
        assert total == sum(want_sent.values())
        if stage:
            held = {k: v for k, v in got["held"].items() if k != "gathered units"}
            assert held == want_held == cost.zero_state_bytes(groups(c), stage, c["world"], r, "bf16", c["reduce"])
    if stage == 0:
        assert want_sent["allreduce"] == cost_data.ddp_bytes([(groups(c)[0], grad)], c["world"], 0, "ring")


@pytest.mark.parametrize("mode", ["ddp", "stage1", "stage2", "fsdp"])
def test_gradient_traffic_halves_in_a_bf16_reduce(mode: str) -> None:
    """The same run reduced in bf16 and in fp32 (N = 3: padding, chunks of unequal size): the
    gradients' collective sends exactly half the bytes, the parameters' all-gathers the same."""
    sent = {r: launch(bf16_run, 3, c=config(mode, 3, r, steps=2, d=3, heads=1))[1]["sent"] for r in ("bf16", "fp32")}
    grad_op = "allreduce" if mode == "ddp" else "reduce_scatter"
    assert 2 * sent["bf16"][grad_op] == sent["fp32"][grad_op] > 0
    assert sent["bf16"].get("allgather") == sent["fp32"].get("allgather")


# ---- refusals --------------------------------------------------------------------------------------
def refusal_cases() -> dict[str, tuple]:
    """name: (constructor, expected message part)."""
    c = config("stage2", 2)

    def zero(**kw):
        return lambda comm: ZeroDataParallel(build(c), comm, precision=kw.pop("precision", "bf16"), **kw)

    def fsdp(**kw):
        def make(comm):
            with nn.deferred():
                model = build(c)
            return FullyShardedDataParallel(model, comm, precision="bf16", **kw)
        return make

    def fp64_zero(comm):
        return ZeroDataParallel(nn.GPT(5, 3, 4, 2, 1), comm, reduce_dtype="fp32")

    return {
        "loss scale with bf16": (zero(loss_scale=2.0**12), "precision='bf16' takes no loss scale"),
        "fp8 reduce": (fsdp(reduce_dtype="float8_e4m3fn"), "reduce_dtype='float8_e4m3fn' cannot hold"),
        "reduce dtype without bf16": (fp64_zero, "reduce_dtype='fp32' is for precision='bf16'"),
        "bf16 model as fp16 mixed": (zero(precision="mixed"), "precision='mixed' computes in float16"),
        "ddp fp16 reduce": (lambda comm: DistributedDataParallel(build(c), comm, reduce_dtype="fp16"),
                            "reduce_dtype='fp16' is not offered here"),
        "ddp reduce dtype on fp64": (lambda comm: DistributedDataParallel(nn.GPT(5, 3, 4, 2, 1), comm,
                                                                          reduce_dtype="fp32"),
                                     "is for a bfloat16 model"),
    }


def refusals(comm) -> dict[str, tuple[str, int]]:
    return {name: attempt(comm, make)[:2] for name, (make, _) in refusal_cases().items()}


def fp16_overflow(comm) -> tuple[str, dict[str, int]]:
    """ZeRO-2 reducing bf16 gradients in fp16 with |g| ~ 1e5 on the last rank: the message and what was
    sent (the one max all-reduce, no gradient)."""
    c = config("stage2", comm.size, "fp16")
    model = build(c)
    zero = ZeroDataParallel(model, comm, precision="bf16", reduce_dtype="fp16", bucket_cap_bytes=1 << 20)
    x = np.zeros((1, 3), dtype=int)
    with trace.recording(comm.rank) as rec:
        loss = model.loss(x, x) * (1e5 if comm.rank == comm.size - 1 else 1.0)
        try:
            zero.backward(loss)
            msg = "accepted"
        except ValueError as exc:
            msg = str(exc)
    ops = {}
    for e in rec.events:
        if e.kind == "comm" and e.name == "send":
            ops[e.op] = ops.get(e.op, 0) + 1
    return msg, ops


def check_refusals(results: list[dict]) -> None:
    for name, (_, part) in refusal_cases().items():
        msgs = {r[name][0] for r in results}
        assert len(msgs) == 1, name
        msg = msgs.pop()
        assert part in msg and "\n" not in msg, name
        assert all(r[name][1] == 0 for r in results), name  # nothing sent


def check_overflow(results: list[tuple[str, dict]]) -> None:
    assert len({m for m, _ in results}) == 1
    assert results[0][0].startswith("reduce_dtype='fp16' cannot hold this gradient sum: max |g|")
    assert all(set(ops) == {"allreduce"} for _, ops in results)  # the check's max; no reduce-scatter


def test_bad_recipes_refused_on_every_rank_threads() -> None:
    check_refusals(launch(refusals, 2))
    check_overflow(launch(fp16_overflow, 2))


@pytest.mark.mpi
def test_bad_recipes_refused_on_every_rank_mpiexec() -> None:
    check_refusals(run(refusals, 2, backend="mpi", timeout=90))
    check_overflow(run(fp16_overflow, 3, backend="mpi", timeout=90))
