"""2-D tensor parallelism (Optimus / SUMMA) equals one process; its bytes and memory per rank.

On 4 ranks (q = 2; one q = 3 example on 9): ``Linear2D``, ``MLP2D`` and ``Block2D`` give the outputs
and the input and parameter gradients of ``nn.Linear`` / ``nn.FeedForward`` / ``nn.Block`` on the
whole arrays, block by block, and the parameters after one SGD step (not AdamW: its first step
divides a near-zero gradient by itself, 1e-8 apart at these tolerances). Each rank's bytes in the
trace equal the SUMMA count worked out by hand here (forward: a broadcast of the input block and one
of the weight block per rank; backward: the same again plus one reduce of each) and
``minipar.cost.tensor2d``; each rank holds ``1/q^2`` of every parameter and of the activations kept
for backward (measured on both graphs).
Bad configurations are refused on every rank before any message.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from refusals import refusal
from strategies import budget

from minipar import trace
from minipar.autograd import Tensor
from minipar.cost.tensor2d import block2d_bytes, linear2d_bytes, linear2d_parameters, summa_bytes
from minipar.memory import activation_bytes
from minipar.mesh import DeviceMesh
from minipar.nn import Block, FeedForward, Linear
from minipar.optim import SGD
from minipar.parallel.tensor.tp2d import MLP2D, Block2D, Grid2D, Linear2D, block, grid_2d
from minipar.testing import run
from viz.analysis import sent_by_op

TOL = {"rtol": 1e-12, "atol": 1e-12}


def rand(seed: int, *shape: int) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=shape)



def randomise(layer, seed: int) -> None:
    """Every parameter set to its slice of a random whole (layer norms are not left at ones and zeros)."""
    for name, p in layer.named_parameters():
        full = np.random.default_rng([seed, len(name), *name.encode()]).normal(size=p.full_shape)
        p.data[...] = full[p.shard] if p.shard is not None else full


def layer_run(comm, c: dict) -> dict:
    """One rank: the layer (``c["kind"]``: linear, mlp or block) on its blocks; outputs, gradients, bytes."""
    grid = grid_2d(comm)
    shape, seed = c["shape"], c["seed"]
    out_shape = shape
    if c["kind"] == "linear":
        layer = Linear2D(c["in"], c["out"], grid, bias=c["bias"]).init_parameters(seed, "l.")
        out_shape = (*shape[:-1], c["out"])
    elif c["kind"] == "mlp":
        layer = MLP2D(c["in"], c["ff"], grid).init_parameters(seed, "l.")
    else:
        layer = Block2D(c["in"], c["heads"], grid, c["ff"])
        randomise(layer, seed)
    x = Tensor(block(rand(seed, *shape), grid), requires_grad=True)
    with trace.record(None, comm) as rec:
        y = layer(x)
        mark = len(rec.events)
        act = activation_bytes(y)
        (y * block(rand(seed + 1, *out_shape), grid)).sum().backward()
    SGD(layer.parameters(), lr=0.1).step()  # elementwise: each piece's update is the whole's, sliced
    params = {n: (p.data.size, p.grad, p.data) for n, p in layer.named_parameters()}
    return {"ij": (grid.i, grid.j), "y": y.data, "act": act, "dx": x.grad, "params": params,
            "fwd": sent_by_op(rec.events[:mark], comm.world_rank),
            "bwd": sent_by_op(rec.events[mark:], comm.world_rank)}


def reference(c: dict) -> tuple[np.ndarray, np.ndarray, dict[str, np.ndarray], int]:
    """The single-process layer: output, input gradient, parameter gradients by name, activation bytes
    kept for backward."""
    shape, seed = c["shape"], c["seed"]
    out_shape = shape
    if c["kind"] == "linear":
        layer = Linear(c["in"], c["out"], bias=c["bias"]).init_parameters(seed, "l.")
        out_shape = (*shape[:-1], c["out"])
    elif c["kind"] == "mlp":
        layer = FeedForward(c["in"], c["ff"]).init_parameters(seed, "l.")
    else:
        layer = Block(c["in"], c["heads"], c["ff"])
        randomise(layer, seed)
    x = Tensor(rand(seed, *shape), requires_grad=True)
    y = layer(x)
    act = activation_bytes(y)
    (y * rand(seed + 1, *out_shape)).sum().backward()
    SGD(layer.parameters(), lr=0.1).step()
    return y.data, x.grad, {n: (p.grad, p.data) for n, p in layer.named_parameters()}, act


def piece(full: np.ndarray, q: int, i: int, j: int) -> np.ndarray:
    """Rank (i, j)'s piece, sliced by hand: a matrix's block (i, j) along its first and last axes; a
    bias's entries [j n/q + i n/q^2, ... + n/q^2)."""
    if full.ndim == 1:
        m = full.size // (q * q)
        return full[j * q * m + i * m:j * q * m + (i + 1) * m]
    r, k = full.shape[0] // q, full.shape[-1] // q
    return full[i * r:(i + 1) * r, ..., j * k:(j + 1) * k]


def check(c: dict, results: list[dict], q: int) -> None:
    """Blocks equal to the whole's; 1/q^2 of every parameter and of the activations kept for backward
    (measured from both graphs), plus, in a block, each layer norm's gathered gain (d/q numbers)."""
    y, dx, grads, act = reference(c)
    gains = 2 * c["in"] // q * 8 if c["kind"] == "block" else 0
    for res in results:
        assert res["act"] * q * q == act + gains * q * q
        i, j = res["ij"]
        np.testing.assert_allclose(res["y"], piece(y, q, i, j), **TOL)
        np.testing.assert_allclose(res["dx"], piece(dx, q, i, j), **TOL)
        for name, (g, updated) in grads.items():
            size, local, local_updated = res["params"][name]
            assert size * q * q == g.size  # 1/q^2 of every parameter on every rank
            np.testing.assert_allclose(local, piece(g, q, i, j), **TOL)
            np.testing.assert_allclose(local_updated, piece(updated, q, i, j), **TOL)


def by_hand(rows: int, fin: int, fout: int, q: int, bias: bool) -> tuple[dict, dict]:
    """Bytes every rank sends, from SUMMA's steps: each of the q broadcasts along a row (column) sends
    q - 1 messages in all and every rank is the root once, so a rank sends q - 1 of its blocks; the
    same for the backward's broadcasts and reduces (a reduce: every non-root sends once)."""
    a, w = rows * fin // q // q * 8, fin * fout // q // q * 8
    fwd, bwd = {"broadcast": (q - 1) * (a + w)}, {"broadcast": (q - 1) * (w + a), "reduce": (q - 1) * (a + w)}
    if bias:
        fwd["allgather"] = bwd["reduce_scatter"] = (q - 1) * fout // q // q * 8
    return fwd, bwd


def check_bytes(c: dict, results: list[dict], q: int) -> None:
    rows = int(np.prod(c["shape"][:-1]))
    dims = [(c["in"], c["out"], c["bias"])] if c["kind"] == "linear" else [(c["in"], c["ff"], True),
                                                                            (c["ff"], c["in"], True)]
    fwd, bwd = Counter(), Counter()
    for fin, fout, bias in dims:
        f, b = by_hand(rows, fin, fout, q, bias)
        fwd.update(f)
        bwd.update(b)
    for res in results:
        assert res["fwd"] == fwd and res["bwd"] == bwd
        model = [linear2d_bytes(rows, fin, fout, q, *res["ij"], bias=bias) for fin, fout, bias in dims]
        assert sum((Counter(m["forward"]) for m in model), Counter()) == fwd
        assert sum((Counter(m["backward"]) for m in model), Counter()) == bwd


@st.composite
def linear_configs(draw: st.DrawFn) -> dict:
    bias = draw(st.booleans())
    lead = draw(st.sampled_from([(2,), (4,), (6,), (2, 3), (4, 1)]))
    fin = 2 * draw(st.integers(1, 4))
    fout = (4 if bias else 2) * draw(st.integers(1, 3))
    return {"kind": "linear", "shape": (*lead, fin), "in": fin, "out": fout, "bias": bias,
            "seed": draw(st.integers(0, 10**6))}


@budget(8)
@given(linear_configs())
def test_linear2d_equals_one_process(c: dict) -> None:
    results = run(layer_run, 4, c=c)
    check(c, results, 2)
    check_bytes(c, results, 2)
    assert results[0]["params"]["weight"][0] == linear2d_parameters(c["in"], c["out"], 2, False)


@budget(4)
@given(st.sampled_from([(2, 4), (4, 4), (2, 1, 4)]), st.sampled_from([4, 8, 12]), st.integers(0, 10**6))
def test_mlp2d_equals_one_process(shape: tuple, ff: int, seed: int) -> None:
    c = {"kind": "mlp", "shape": shape, "in": shape[-1], "ff": ff, "seed": seed}
    results = run(layer_run, 4, c=c)
    check(c, results, 2)
    check_bytes(c, results, 2)


def test_q3_on_nine_ranks() -> None:
    """q = 3: a binomial tree on 3 ranks (root sends 2, the middle rank 0 or 1 by position), still
    (q-1) blocks per rank over the 3 roots; a block on 9 ranks (uneven all-reduce chunks)."""
    c = {"kind": "linear", "shape": (6, 3), "in": 3, "out": 9, "bias": True, "seed": 5}
    results = run(layer_run, 9, c=c)
    check(c, results, 3)
    check_bytes(c, results, 3)
    a, w = 2 * 1 * 8, 1 * 3 * 8
    assert summa_bytes(a, w, 3) == {"forward": 2 * (16 + 24), "backward": 4 * (16 + 24)}
    assert results[4]["fwd"]["broadcast"] == 80 and results[4]["bwd"]["reduce"] == 80
    c = {"kind": "block", "shape": (3, 2, 9), "in": 9, "heads": 3, "ff": 9, "seed": 2}
    results = run(layer_run, 9, c=c)
    check(c, results, 3)
    for res in results:  # a ring all-reduce of 2 (4) numbers on 3 ranks: chunks 1, 1, 0 (2, 1, 1)
        assert block2d_bytes(6, 9, 9, 3, *res["ij"]) == {"forward": res["fwd"], "backward": res["bwd"]}


def first_layer(comm) -> tuple:
    """A Linear2D whose input needs no gradient: backward runs only dW = X^T dY's SUMMA."""
    grid = grid_2d(comm)
    layer = Linear2D(4, 8, grid).init_parameters(1, "l.")
    with trace.record(None, comm) as rec:
        (layer(Tensor(block(rand(1, 6, 4), grid))) * block(rand(2, 6, 8), grid)).sum().backward()
    return grid.i, grid.j, layer.weight.grad, sent_by_op(rec.events, comm.world_rank)


def test_input_without_gradient_skips_its_summa() -> None:
    ref = Linear(4, 8).init_parameters(1, "l.")
    (ref(Tensor(rand(1, 6, 4))) * rand(2, 6, 8)).sum().backward()
    a, w = 3 * 2 * 8, 2 * 4 * 8  # X block 3 x 2, W block 2 x 4; q = 2: one of each per rank and pass
    for i, j, dw, nbytes in run(first_layer, 4):
        np.testing.assert_allclose(dw, piece(ref.weight.grad, 2, i, j), **TOL)
        assert nbytes == {"broadcast": (a + w) + a, "reduce": w, "allgather": 16, "reduce_scatter": 16}


def refusals(comm, world_ok: bool) -> list[tuple[str, int]]:
    """Each bad configuration's message and the messages sent while refusing it."""
    out = []

    def attempt(fn) -> None:
        out.append(refusal(comm, fn, "accepted"))

    if not world_ok:
        attempt(lambda: grid_2d(comm))
        return out
    grid = grid_2d(comm)
    attempt(lambda: Linear2D(3, 8, grid))
    attempt(lambda: Linear2D(4, 6, grid))
    attempt(lambda: block(np.zeros((3, 4)), grid))
    layer = Linear2D(4, 8, grid)
    attempt(lambda: layer(Tensor(np.zeros((2, 4)))))
    attempt(lambda: Grid2D(DeviceMesh(comm, dp=4, tp=1)))
    return out


def test_bad_configurations_refused_before_any_message() -> None:
    for res in run(refusals, 3, world_ok=False):
        ((msg, n),) = res
        assert n == 0 and "3 ranks, not a square" in msg and "launch 4 ranks" in msg
    per_rank = run(refusals, 4, world_ok=True)
    assert all(r == per_rank[0] for r in per_rank)  # the same on every rank
    wants = ["in_features=3 is not a multiple of 2", "out_features=6 is not a multiple of 4",
             "batch=3 is not a multiple of 2", "input block has 4 features", "dp = tp = q"]
    for (msg, n), want in zip(per_rank[0], wants, strict=True):
        assert want in msg and n == 0, msg


@budget(4)
@given(st.sampled_from([(2, 1), (2, 3), (4, 2)]), st.sampled_from([(4, 2), (8, 2), (8, 4)]), st.sampled_from([4, 8]),
       st.integers(0, 10**6))
def test_block2d_equals_one_process(bs: tuple, dh: tuple, ff: int, seed: int) -> None:
    (b, s), (d, heads) = bs, dh
    c = {"kind": "block", "shape": (b, s, d), "in": d, "heads": heads, "ff": ff, "seed": seed}
    results = run(layer_run, 4, c=c)
    check(c, results, 2)
    rl = b * s // 2  # local rows; a ring all-reduce on 2 ranks sends each rank's whole array once
    fwd, bwd = Counter(), Counter()
    for fin, fout in [(d, d)] * 4 + [(d, ff), (ff, d)]:
        f, g = by_hand(b * s, fin, fout, 2, True)
        fwd.update(f)
        bwd.update(g)
    fwd.update({"allreduce": 2 * 2 * rl * 8, "allgather": 2 * 2 * d // 4 * 8})  # 2 layer norms: mean, var
    bwd.update({"allreduce": 2 * 4 * rl * 8, "reduce_scatter": 2 * 2 * d // 4 * 8})  # again + 2 sums
    for res in results:
        assert res["fwd"] == fwd and res["bwd"] == bwd
        assert block2d_bytes(b * s, d, ff, 2, *res["ij"]) == {"forward": fwd, "backward": bwd}


@pytest.mark.mpi
def test_linear_and_mlp_under_mpiexec() -> None:
    for c in ({"kind": "linear", "shape": (4, 3, 6), "in": 6, "out": 8, "bias": True, "seed": 7},
              {"kind": "mlp", "shape": (2, 4), "in": 4, "ff": 8, "seed": 3},
              {"kind": "block", "shape": (2, 3, 8), "in": 8, "heads": 4, "ff": 8, "seed": 1}):
        results = run(layer_run, 4, backend="mpi", c=c)
        check(c, results, 2)
        if c["kind"] != "block":
            check_bytes(c, results, 2)


def frozen_linear(comm, path: str) -> None:
    lin = Linear2D(4, 8, DeviceMesh(comm, dp=2, tp=2))
    for p in lin.parameters():
        p.requires_grad = False
    x = Tensor(np.ones((3, 2)), requires_grad=True)
    with trace.record(path, comm=comm):
        lin(x).sum().backward()


def test_a_frozen_bias_sends_no_reduce_scatter(tmp_path) -> None:
    """Only the input's gradient is wanted: SUMMA's dA (broadcasts down columns, a reduce along the row),
    no weight or bias gradient and so no reduce-scatter (reviewer)."""
    path = str(tmp_path / "t.json")
    run(frozen_linear, 4, "threads", path=path)
    ops = {e.op for e in trace.load(path).events if e.kind == "comm"}
    assert "reduce_scatter" not in ops and {"broadcast", "reduce"} <= ops


@pytest.mark.mpi
def test_block2d_adamw_step_under_mpiexec() -> None:
    """Block2D on 4 ranks under mpiexec: the loss (each rank's ``sum(y * r)`` summed over the world), the
    gradients and the parameters after one AdamW step equal one process's ``nn.Block``, and each rank's
    bytes the count by hand; the run, reference and checks are ``test_tensor2p5d``'s (depth d = 1,
    its layout then being ``block``'s) with tensor2d's own ``Block2D`` on ``grid_2d``."""
    from test_tensor2p5d import check_all  # here, not at the top: test_tensor2p5d imports this module

    check_all({"kind": "block", "two_d": True, "d": 1, "seed": 4, "heads": 2, "in": 8, "ff": 8, "shape": (2, 3, 8)},
              "mpi")
