"""Autograd on global tensors, and Megatron written as weight placements.

- Megatron's MLP, attention and whole block as ``minipar.sharding.nn`` layers with ``MEGATRON``
  placements equal the hand-written ``minipar.parallel.tensor`` layers on every rank: outputs, the
  input's gradient, every parameter's gradient piece, and the bytes each rank sends forward and
  backward (both counted from the trace; the hand-written layers are themselves tested against one
  process in test_tensor_parallel.py, and the outputs here against ``minipar.nn`` too).
- Data parallelism in annotations: batch rows split, weights replicated: the weights' gradients come
  out whole by one all-reduce each (DDP's), nothing sent forward.
- Drawn op chains (matmul, elementwise with broadcasting, GELU, exp, scale, sum, softmax, layer norm,
  reshape, transpose, logsumexp) on drawn placements over 1-D and 2-D meshes: the global result and
  every input's gradient equal ``minipar.autograd`` on the whole arrays.
- Vocabulary-parallel embedding and cross-entropy: loss and gradients equal one process.
- Bad annotations refused on every rank before any message.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st
from strategies import budget
from test_sharding_propagate import check_refused
from tp_helpers import rand, summarise

from minipar import functional as F
from minipar import nn, trace
from minipar.autograd import Tensor
from minipar.comm import launch
from minipar.mesh import DeviceMesh
from minipar.parallel.tensor.model import ParallelAttention, ParallelBlock, ParallelMLP
from minipar.sharding import GlobalTensor, Partial, Placement, Replicate, Shard, ops
from minipar.sharding import nn as snn
from minipar.testing import run

B, P, S0, S1 = Replicate(), Partial(), Shard(0), Shard(1)
TOL = {"rtol": 1e-11, "atol": 1e-12}
KINDS = {  # kind: (annotated layer, hand-written layer, hand-written input layout (s, b, d))
    "mlp": (lambda m, d, h: snn.FeedForward(d, 2 * d, m, ("tp",), snn.MEGATRON),
            lambda c, d, h: ParallelMLP(d, 2 * d, c), False, lambda d, h: nn.FeedForward(d, 2 * d)),
    "attention": (lambda m, d, h: snn.CausalSelfAttention(d, h, m, ("tp",), snn.MEGATRON),
                  lambda c, d, h: ParallelAttention(d, h, c), True, lambda d, h: nn.CausalSelfAttention(d, h)),
    "block": (lambda m, d, h: snn.Block(d, h, m, ("tp",), snn.prefixed("attn.", snn.MEGATRON)
                                        | snn.prefixed("mlp.", snn.MEGATRON), d_ff=2 * d),
              lambda c, d, h: ParallelBlock(d, h, c, d_ff=2 * d), True, lambda d, h: nn.Block(d, h, 2 * d)),
}


def sent(events: list, rank: int) -> dict:
    return dict(summarise(events, rank)["bytes"])


def run_megatron(comm, c: dict) -> dict:
    """One rank: the annotated and the hand-written layer on the same input and output gradient."""
    d, h, seed = c["d"], c["heads"], c["seed"]
    annotated, hand, seq_first, _ = KINDS[c["kind"]]
    x, dy = rand(seed, c["b"], c["s"], d), rand(seed + 1, c["b"], c["s"], d)
    mesh = DeviceMesh(comm, tp=comm.size)
    layer = annotated(mesh, d, h).init_parameters(seed, "m.")
    gx = GlobalTensor.from_global(x, mesh, ("tp",), [B]).requires_grad_()
    with trace.recording(comm.world_rank) as rec:
        y = ops.redistribute(layer(gx), [B])
        mark = len(rec.events)
        ops.sum(ops.mul(y, GlobalTensor.from_global(dy, mesh, ("tp",), [B]))).backward()
    ref = hand(comm, d, h).init_parameters(seed, "m.")
    swap = (lambda a: a.transpose(1, 0, 2)) if seq_first else (lambda a: a)
    tx = Tensor(swap(x).copy(), requires_grad=True)
    with trace.recording(comm.world_rank) as rec2:
        ty = ref(tx)
        mark2 = len(rec2.events)
        (ty * swap(dy)).sum().backward()
    grads = {n: (p.grad.local, p.grad.placements) for n, p in layer.named_parameters()}
    me = comm.world_rank
    return {"y": y.local, "dx": gx.grad.local, "dx_placements": gx.grad.placements, "grads": grads,
            "ref_y": swap(ty.data), "ref_dx": swap(tx.grad),
            "ref_grads": {n: p.grad for n, p in ref.named_parameters()},
            "fwd": sent(rec.events[:mark], me), "bwd": sent(rec.events[mark:], me),
            "ref_fwd": sent(rec2.events[:mark2], me), "ref_bwd": sent(rec2.events[mark2:], me)}


def check_megatron(c: dict, results: list[dict]) -> None:
    one = KINDS[c["kind"]][3](c["d"], c["heads"]).init_parameters(c["seed"], "m.")
    whole = one(Tensor(rand(c["seed"], c["b"], c["s"], c["d"]))).data
    t, act = len(results), c["b"] * c["s"] * c["d"] * 8  # bytes of one activation
    all_reduces = {"mlp": 1, "attention": 1, "block": 2}[c["kind"]]
    for r in results:
        np.testing.assert_allclose(r["y"], r["ref_y"], **TOL)
        np.testing.assert_allclose(r["y"], whole, **TOL)
        np.testing.assert_allclose(r["dx"], r["ref_dx"], **TOL)
        assert r["dx_placements"] == (B,)
        assert set(r["grads"]) == set(r["ref_grads"])
        for name, (g, where) in r["grads"].items():
            np.testing.assert_allclose(g, r["ref_grads"][name], **TOL, err_msg=name)
            want = next((tuple(v) for k, v in snn.MEGATRON.items() if name == k or name.endswith("." + k)), (B,))
            assert where == want, (name, where)  # as annotated; replicated ones whole
        # Megatron: one all-reduce of the activation per MLP / attention forward and one backward
        # (ring: 2 (t-1)/t of it per rank), nothing else, annotated and hand-written alike
        want = {"allreduce": all_reduces * 2 * (t - 1) * act // t}
        assert r["fwd"] == r["ref_fwd"] == want, (r["fwd"], r["ref_fwd"])
        assert r["bwd"] == r["ref_bwd"] == want, (r["bwd"], r["ref_bwd"])


@pytest.mark.parametrize("kind", ["mlp", "attention", "block"])
@pytest.mark.parametrize("t", [2, 4])
def test_annotated_megatron_equals_hand_written(kind: str, t: int) -> None:
    c = {"kind": kind, "d": 8, "heads": 4, "b": 2, "s": 3, "seed": 11 + t}
    check_megatron(c, launch(run_megatron, t, "threads", c))


@pytest.mark.mpi
def test_annotated_megatron_block_under_mpiexec() -> None:
    c = {"kind": "block", "d": 8, "heads": 2, "b": 2, "s": 4, "seed": 5}
    check_megatron(c, run(run_megatron, 2, "mpi", c=c))


# ---- data parallelism as annotations ---------------------------------------------------------------------
def run_data_parallel(comm) -> dict:
    mesh = DeviceMesh(comm, dp=comm.size)
    layer = snn.FeedForward(4, 8, mesh, ("dp",)).init_parameters(2, "m.")  # nothing named: all replicated
    x = GlobalTensor.from_global(rand(2, 8, 4), mesh, ("dp",), [S0])
    with trace.recording(comm.world_rank) as rec:
        y = layer(x)
        mark = len(rec.events)
        ops.mean(ops.mul(y, y)).backward()
    return {"y": y.local, "y_placements": y.placements, "fwd": sent(rec.events[:mark], comm.world_rank),
            "bwd": sent(rec.events[mark:], comm.world_rank),
            "grads": {n: (p.grad.local, p.grad.placements) for n, p in layer.named_parameters()}}


def test_data_parallel_in_annotations_is_ddp() -> None:
    out = launch(run_data_parallel, 2, "threads")
    ref = nn.FeedForward(4, 8).init_parameters(2, "m.")
    y = ref(Tensor(rand(2, 8, 4)))
    (y * y).mean().backward()
    numel = {n: p.data.size for n, p in ref.named_parameters()}
    for r, o in enumerate(out):
        assert o["y_placements"] == (S0,)
        np.testing.assert_allclose(o["y"], y.data[4 * r:4 * r + 4], **TOL)
        assert o["fwd"] == {}
        for n, p in ref.named_parameters():
            np.testing.assert_allclose(o["grads"][n][0], p.grad, **TOL)
            assert o["grads"][n][1] == (B,)
        # one ring all-reduce per weight on 2 ranks: each rank sends its whole gradient (8 bytes a number)
        assert o["bwd"] == {"allreduce": 8 * sum(numel.values())}


# ---- drawn op chains: global result and gradients equal minipar.autograd on whole arrays ---------------
CHAIN_OPS = ["matmul", "add_row", "mul", "gelu", "exp", "scale", "softmax", "softmax0", "layer_norm", "transpose",
             "reshape", "sum_keep", "broadcast"]


def apply_chain(chain: list[str], x, operands: dict, lib: str):
    """``chain`` on ``x`` of shape (4, 4, 4) with either library (``lib`` "global" or "local")."""
    g = lib == "global"
    for i, op in enumerate(chain):
        o = operands.get(i)
        if op == "matmul":
            x = ops.matmul(x, o) if g else x @ o
        elif op == "add_row":
            x = ops.add(x, o) if g else x + o
        elif op == "mul":
            x = ops.mul(x, o) if g else x * o
        elif op in ("gelu", "exp"):
            x = (ops.unary(op, ops.scale(x, 0.5)) if g else
                 (F.gelu(x * 0.5) if op == "gelu" else (x * 0.5).exp()))
        elif op == "scale":
            x = ops.scale(x, -1.5) if g else x * -1.5
        elif op == "softmax":
            x = ops.softmax(x, -1) if g else F.softmax(x, -1)
        elif op == "softmax0":  # along a leading axis
            x = ops.softmax(x, 0) if g else F.softmax(x, 0)
        elif op == "sum_keep":  # sum over axis 1 kept, broadcast back by the next op
            x = ops.mul(x, ops.sum(x, 1, keepdims=True)) if g else x * x.sum(axis=1, keepdims=True)
        elif op == "broadcast":  # (4, 4, 4) -> its first row broadcast: a size-1 dimension
            x = ops.broadcast_to(ops.sum(x, 0, keepdims=True), (4, 4, 4)) if g else (
                x.sum(axis=0, keepdims=True) + Tensor(np.zeros((4, 4, 4))))
        elif op == "layer_norm":
            w, b = o
            x = snn.layer_norm(x, w, b) if g else F.layer_norm(x, w, b)
        elif op == "transpose":
            x = ops.transpose(x, (1, 0, 2)) if g else x.transpose(1, 0, 2)
        elif op == "reshape":  # (4, 4, 4) -> (4, 2, 2, 4) -> back: a split dimension 1 survives both ways
            x = ops.reshape(ops.reshape(x, (4, 2, 2, 4)), (4, 4, 4)) if g else x.reshape(4, 2, 2, 4).reshape(4, 4, 4)
    out = ops.logsumexp(x, -1) if g else x[..., 0] - F.log_softmax(x, -1)[..., 0]
    return ops.sum(ops.mul(out, out)) if g else (out * out).sum()


def operand_shapes(chain: list[str]) -> dict[int, tuple]:
    return {i: {"matmul": (4, 4), "add_row": (4,), "mul": (4, 4, 4), "layer_norm": ((4,), (4,))}[op]
            for i, op in enumerate(chain) if op in ("matmul", "add_row", "mul", "layer_norm")}


def draw_values(seed: int, chain: list[str]) -> tuple[np.ndarray, dict]:
    rng = np.random.default_rng(seed)
    vals = {i: tuple(rng.normal(size=s) for s in sh) if isinstance(sh[0], tuple) else rng.normal(size=sh)
            for i, sh in operand_shapes(chain).items()}
    return rng.normal(size=(4, 4, 4)), vals


def valid_placements(shape: tuple, sizes: list[int], drawn: list[Placement]) -> list[Placement]:
    """``drawn`` (one placement per mesh axis of ``sizes``) made valid for ``shape``: a ``Shard(d)`` becomes
    ``B`` where ``d`` is not a dimension of the tensor (a length the axes do not divide is cut unevenly)."""
    return [B if isinstance(p, Shard) and p.dim >= len(shape) else p for p in drawn]


def run_chain(comm, c: dict) -> dict:
    mesh = DeviceMesh(comm, **c["mesh"])
    axes = tuple(c["mesh"])
    x, vals = draw_values(c["seed"], c["chain"])
    pick = iter(c["placements"])

    def place(a: np.ndarray) -> GlobalTensor:
        want = valid_placements(a.shape, [c["mesh"][ax] for ax in axes], [next(pick) for _ in axes])
        return GlobalTensor.from_global(a, mesh, axes, want).requires_grad_()

    gx = place(x)
    operands = {i: tuple(place(a) for a in v) if isinstance(v, tuple) else place(v) for i, v in vals.items()}
    loss = apply_chain(c["chain"], gx, operands, "global")
    loss.backward()
    leaves = [gx, *[t for v in operands.values() for t in (v if isinstance(v, tuple) else (v,))]]
    return {"loss": loss.to_global(), "grads": [t.grad.to_global() for t in leaves]}


def reference_chain(c: dict) -> tuple[float, list[np.ndarray]]:
    x, vals = draw_values(c["seed"], c["chain"])
    tx = Tensor(x, requires_grad=True)
    operands = {i: tuple(Tensor(a, requires_grad=True) for a in v) if isinstance(v, tuple)
                else Tensor(v, requires_grad=True) for i, v in vals.items()}
    loss = apply_chain(c["chain"], tx, operands, "local")
    loss.backward()
    leaves = [tx, *[t for v in operands.values() for t in (v if isinstance(v, tuple) else (v,))]]
    return float(loss.data), [t.grad for t in leaves]


PLACEMENT = st.sampled_from([S0, S1, Shard(2), B, P])
MESHES = [{"tp": 2}, {"tp": 3}, {"dp": 2, "tp": 2}, {"pp": 2, "dp": 2, "tp": 2}]  # tp = 3: 4 rows cut 2, 2, 0


@budget(4)
@given(chain=st.lists(st.sampled_from(CHAIN_OPS), min_size=1, max_size=4), mesh=st.sampled_from(MESHES),
       placements=st.lists(PLACEMENT, min_size=20, max_size=20), seed=st.integers(0, 10**6))
@example(chain=["matmul", "gelu", "matmul"], mesh={"tp": 2}, placements=[B, S1, S0] + [B] * 17, seed=1)
# found drawn at random: three axes of 2 split a dimension of 4 (unevenly: 2, 2, then 1, 0)
@example(chain=["softmax", "mul"], mesh={"pp": 2, "dp": 2, "tp": 2}, placements=[Shard(2)] * 20, seed=3)
@example(chain=["layer_norm", "softmax", "transpose", "reshape"], mesh={"dp": 2, "tp": 2},
         placements=[S0, Shard(2), B, P, P, B] + [S1] * 14, seed=2)
@example(chain=["matmul", "layer_norm", "reshape", "sum_keep"], mesh={"tp": 3}, placements=[S1, S0, Shard(2)] * 7,
         seed=4)  # uneven cuts: the contraction split 2, 2, 0; (4, 2, 2, 4) does not cut as (4, 4, 4)
def test_drawn_chains_equal_one_process(chain: list[str], mesh: dict, placements: list, seed: int) -> None:
    c = {"chain": chain, "mesh": mesh, "placements": placements, "seed": seed}
    want_loss, want_grads = reference_chain(c)
    for r in launch(run_chain, int(np.prod(list(mesh.values()))), "threads", c):
        np.testing.assert_allclose(r["loss"], want_loss, rtol=1e-10)
        assert len(r["grads"]) == len(want_grads)
        for got, want in zip(r["grads"], want_grads, strict=True):
            np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-11)


# ---- embedding and cross-entropy: vocabulary-parallel as Megatron splits them ---------------------------
def run_vocab(comm, table_at: Placement, logits_at: Placement) -> dict:
    mesh = DeviceMesh(comm, tp=2)
    rng = np.random.default_rng(4)
    table, head, ids, targets = rng.normal(size=(6, 4)), rng.normal(size=(4, 6)), rng.integers(0, 6, (2, 3)), \
        rng.integers(0, 6, (2, 3))
    t = GlobalTensor.from_global(table, mesh, ("tp",), [table_at]).requires_grad_()
    w = GlobalTensor.from_global(head, mesh, ("tp",), [logits_at]).requires_grad_()
    with trace.recording(comm.world_rank) as rec:
        x = ops.embedding(t, GlobalTensor.from_global(ids, mesh, ("tp",), [B]))
        x_placements = x.placements
        logits = ops.matmul(x, w)
        loss = snn.cross_entropy(logits, targets)
        loss.backward()
    return {"x_at": x_placements, "logits_at": logits.placements, "loss": loss.to_global(),
            "dt": t.grad.to_global(), "dw": w.grad.to_global(), "sent": sent(rec.events, comm.world_rank)}


@pytest.mark.parametrize(("table_at", "logits_at", "x_at"), [(S0, S1, P), (B, S1, B), (S1, B, Shard(2))])
def test_embedding_and_cross_entropy_equal_one_process(table_at, logits_at, x_at) -> None:
    rng = np.random.default_rng(4)
    table, head, ids, targets = (Tensor(rng.normal(size=(6, 4)), requires_grad=True),
                                 Tensor(rng.normal(size=(4, 6)), requires_grad=True),
                                 rng.integers(0, 6, (2, 3)), rng.integers(0, 6, (2, 3)))
    loss = F.cross_entropy(F.embedding(table, ids) @ head, targets)
    loss.backward()
    for o in launch(run_vocab, 2, "threads", table_at, logits_at):
        assert o["x_at"] == (x_at,)  # S(0) table: each rank's rows, a partial sum (Megatron's embedding)
        np.testing.assert_allclose(o["loss"], loss.data, **TOL)
        np.testing.assert_allclose(o["dt"], table.grad, **TOL)
        np.testing.assert_allclose(o["dw"], head.grad, **TOL)


# ---- bad annotations: refused on every rank before any message -----------------------------------------
BAD = [
    (lambda m: snn.Linear(4, 8, m, ("tp",), {"weight": [S0, S1]}), "give one placement per axis"),
    (lambda m: snn.CausalSelfAttention(6, 4, m, ("tp",), snn.MEGATRON), "not divisible by n_heads"),
    (lambda m: ops.embedding(GlobalTensor.from_global(np.ones((4, 2)), m, ("tp",), [S0]),
                             GlobalTensor.from_global(np.array([1, 4]), m, ("tp",), [B])), "integers in [0, 4)"),
]


@pytest.mark.parametrize("i", range(len(BAD)), ids=[n for _, n in BAD])
def test_bad_annotations_refused_on_every_rank(i: int) -> None:
    check_refused(BAD, i)


# ---- review findings, pinned ----------------------------------------------------------------------------
def backward_bytes(comm, make) -> tuple[dict, list]:
    """Forward ``make(mesh)`` -> (loss, leaves), backward under a trace: bytes this rank sent, the
    leaves' whole gradients."""
    mesh = DeviceMesh(comm, tp=comm.size)
    loss, leaves = make(mesh)
    with trace.recording(comm.world_rank) as rec:
        loss.backward()
    return sent(rec.events, comm.world_rank), [t.grad.to_global() for t in leaves]


def broadcast_then_split(mesh):
    x = GlobalTensor.from_global(np.arange(4.0), mesh, ("tp",), [B]).requires_grad_()
    m = GlobalTensor.from_global(np.ones((64, 4)), mesh, ("tp",), [S0])
    return ops.sum(ops.mul(ops.broadcast_to(x, (64, 4)), m)), [x]


def sequence_split_weight(mesh):
    rng = np.random.default_rng(0)
    x = GlobalTensor.from_global(rng.normal(size=(4, 8, 4)), mesh, ("tp",), [S1]).requires_grad_()
    w = GlobalTensor.from_global(rng.normal(size=(4, 2)), mesh, ("tp",), [B]).requires_grad_()
    y = ops.matmul(x, w)
    return ops.sum(ops.mul(y, y)), [x, w]


def test_a_split_gradient_of_a_replicated_tensor_is_not_gathered() -> None:
    """d(broadcast x) arrives split by rows: summed where it is (a partial sum of 4 numbers), all-reduced
    at the leaf: 2 (p-1)/p x 32 bytes = 32 on 2 ranks, not an all-gather of the 64 x 4 gradient."""
    for nbytes, (dx,) in launch(backward_bytes, 2, "threads", broadcast_then_split):
        assert nbytes == {"allreduce": 32}
        np.testing.assert_array_equal(dx, np.full(4, 64.0))


def test_a_sequence_split_weight_gradient_is_one_all_reduce() -> None:
    """x (4, 8, 4) split by sequence on 4 ranks, W (4, 2) whole: dW is a partial sum from the local
    products (no message) and one all-reduce of its 64 bytes at the leaf, 2 (3/4) 64 = 96 per rank."""
    rng = np.random.default_rng(0)
    x, w = Tensor(rng.normal(size=(4, 8, 4)), requires_grad=True), Tensor(rng.normal(size=(4, 2)), requires_grad=True)
    y = x @ w
    (y * y).sum().backward()
    for nbytes, (dx, dw) in launch(backward_bytes, 4, "threads", sequence_split_weight):
        assert nbytes == {"allreduce": 96}
        np.testing.assert_allclose(dx, x.grad, **TOL)
        np.testing.assert_allclose(dw, w.grad, **TOL)


def run_aliasing(comm) -> tuple[float, float]:
    mesh = DeviceMesh(comm, tp=2)
    x, y = (GlobalTensor.from_global(np.ones(4), mesh, ("tp",), [B]).requires_grad_() for _ in range(2))
    g = GlobalTensor.from_global(np.full(4, 3.0), mesh, ("tp",), [B])
    ops.add(x, y).backward(g)
    x.grad.local *= 0.5  # neither y's gradient nor the caller's array may change
    g.local[...] = 7.0
    return float(y.grad.local[0]), float(x.grad.local[0])


def test_gradients_are_not_aliased() -> None:
    assert launch(run_aliasing, 2, "threads") == [(3.0, 1.5)] * 2


def run_partial_leaf(comm) -> tuple:
    mesh = DeviceMesh(comm, tp=2)
    base = GlobalTensor.from_global(np.arange(4.0), mesh, ("tp",), [B])
    leaf = ops.redistribute(base, [P]).requires_grad_()  # made by a redistribution, but a leaf
    ops.sum(ops.mul(leaf, leaf)).backward()
    return leaf.grad.placements, leaf.grad.to_global()


def test_a_partial_leaf_gets_a_whole_gradient() -> None:
    for where, g in launch(run_partial_leaf, 2, "threads"):
        assert where == (B,)
        np.testing.assert_array_equal(g, 2 * np.arange(4.0))


def run_split_ids(comm, ids: np.ndarray) -> tuple[str, int]:
    mesh = DeviceMesh(comm, tp=2)
    table = GlobalTensor.from_global(np.ones((4, 2)), mesh, ("tp",), [B])
    with trace.recording(comm.world_rank) as rec, pytest.raises(ValueError) as err:
        ops.embedding(table, GlobalTensor.from_global(ids, mesh, ("tp",), [S0]))
    return str(err.value), sum(e.kind == "comm" and e.op != "allreduce" for e in rec.events)


def test_split_ids_out_of_range_are_refused_on_every_rank() -> None:
    out = launch(run_split_ids, 2, "threads", np.array([0, 1, 2, 9]))  # only rank 1 holds the bad id
    assert all("integers in [0, 4)" in msg and n == 0 for msg, n in out)


def test_cross_entropy_refuses_targets_out_of_range() -> None:
    def body(comm):
        mesh = DeviceMesh(comm, tp=2)
        with pytest.raises(ValueError, match=r"in \[0, 4\)"):
            snn.cross_entropy(GlobalTensor.from_global(np.zeros((2, 4)), mesh, ("tp",), [B]), np.array([1, 7]))
    launch(body, 2, "threads")
