"""2.5-D tensor parallelism (Tesseract) equals one process; its bytes and memory per rank.

On ``d`` stacked ``q x q`` grids (q = 2; d = 1 on 4 ranks, d = 2 on 8): ``Linear2p5D``, ``MLP2p5D``,
``LayerNorm2p5D``, ``Attention2p5D`` and ``Block2p5D`` give the output (rows split ``d q`` ways,
features ``q`` ways), the loss (each rank's ``sum(y * r)`` summed over the world), the input and
parameter gradients and the parameters after one AdamW step of ``minipar.nn``'s ``Linear`` /
``FeedForward`` / ``LayerNorm`` / ``CausalSelfAttention`` / ``Block`` on the whole arrays, block by
block, on every layer of the stack (the weights are the same on all ``d``). AdamW's ``eps`` is 1e-3:
the key projection's bias has a gradient that is zero up to rounding (softmax ignores a shift of
every key), which AdamW magnifies by ``lr / eps`` (``tests/tolerances.py``): with 1e-3 the updated
parameters stay within 2 lr / eps = 20 gradient tolerances of the whole's, which the test allows.
Each rank's bytes in the trace equal a count by hand (inside a layer: 2-D SUMMA on ``b/d`` rows; over
the depth: a ring all-reduce of every parameter piece, on 2 ranks each rank sends its whole piece
once) and ``minipar.cost.tensor2p5d``. Each rank holds ``1/q^2`` of every parameter and ``1/(d q^2)``
of the activations kept for backward (plus each layer norm's gathered gain, as in 2-D), measured on
both graphs. Bad configurations are refused on every rank before any message. The same run,
reference and checks serve ``test_tensor2d``'s mpiexec test of ``Block2D`` (``c["two_d"]``).
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st
from strategies import budget
from test_tensor2d import by_hand, randomise
from tolerances import assert_close_after_adamw
from zero_helpers import attempt

from minipar import trace
from minipar.autograd import Tensor
from minipar.cost import tensor2p5d as cost
from minipar.memory import activation_bytes
from minipar.mesh import DeviceMesh
from minipar.nn import Block, CausalSelfAttention, FeedForward, LayerNorm, Linear
from minipar.optim import AdamW
from minipar.parallel.tensor.tp2d import MLP2D, Attention2D, Block2D, Grid2D, LayerNorm2D, Linear2D, block, grid_2d
from minipar.parallel.tensor.tp2p5d import (
    Attention2p5D,
    Block2p5D,
    Grid2p5D,
    LayerNorm2p5D,
    Linear2p5D,
    MLP2p5D,
    block_2p5d,
    grid_2p5d,
)
from minipar.testing import run

TOL = {"rtol": 1e-12, "atol": 1e-12}
Q = 2


def rand(seed: int, *shape: int) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=shape)


ADAMW_LR, ADAMW_EPS = 1e-2, 1e-3


def adamw(params: list) -> AdamW:
    return AdamW(params, lr=ADAMW_LR, eps=ADAMW_EPS, weight_decay=0.1)


WHOLE = {"linear": Linear, "mlp": FeedForward, "norm": LayerNorm, "attn": CausalSelfAttention, "block": Block}
STACKED = {"linear": Linear2p5D, "mlp": MLP2p5D, "norm": LayerNorm2p5D, "attn": Attention2p5D, "block": Block2p5D}
FLAT = {"linear": Linear2D, "mlp": MLP2D, "norm": LayerNorm2D, "attn": Attention2D,
        "block": Block2D}  # c["two_d"]: tensor2d's own, on one grid
NORMS = {"norm": 1, "block": 2}  # layer norms in a layer of each kind


def linears(c: dict) -> list[tuple[int, int, bool]]:
    """(in, out, bias) of each linear in a layer of ``c``, in order."""
    fin, ff = c["in"], c.get("ff")
    return {"linear": [(fin, c.get("out"), c.get("bias"))], "mlp": [(fin, ff, True), (ff, fin, True)], "norm": [],
            "attn": [(fin, fin, True)] * 4, "block": [(fin, fin, True)] * 4 + [(fin, ff, True), (ff, fin, True)]}[
        c["kind"]]


def build(c: dict, grid: Grid2D | None = None) -> tuple:
    """The layer of ``c`` (whole when ``grid`` is None, else on the grids) and its output width."""
    kind, fin, on = c["kind"], c["in"], () if grid is None else (grid,)
    cls = (WHOLE if grid is None else FLAT if c.get("two_d") else STACKED)[kind]
    if kind == "linear":
        return cls(fin, c["out"], *on, bias=c["bias"]).init_parameters(c["seed"], "l."), c["out"]
    if kind == "mlp":
        return cls(fin, c["ff"], *on).init_parameters(c["seed"], "l."), fin
    layer = {"norm": lambda: cls(fin, *on), "attn": lambda: cls(fin, c["heads"], *on),
             "block": lambda: cls(fin, c["heads"], *on, c["ff"])}[kind]()
    randomise(layer, c["seed"])
    return layer, fin


def sent(events: list, rank: int, grid: Grid2D) -> dict[str, Counter]:
    """Bytes ``rank`` sent by op: inside its layer (``layer``) and to another layer (``depth``)."""
    out = {"layer": Counter(), "depth": Counter()}
    for e in events:
        if e.kind == "comm" and e.src == rank:
            across = grid.mesh.shape.coords(e.dst)["pp"] != grid.mesh.coords["pp"]
            out["depth" if across else "layer"][e.op] += e.nbytes
    return out


def layer_run(comm, c: dict) -> dict:
    """One rank: the layer on its blocks; output, loss, gradients, updated parameters, bytes, memory."""
    grid = grid_2d(comm) if c.get("two_d") else grid_2p5d(comm, c["d"])
    split = block if c.get("two_d") else block_2p5d
    layer, width = build(c, grid)
    x = Tensor(split(rand(c["seed"], *c["shape"]), grid), requires_grad=True)
    with trace.record(None, comm) as rec:
        y = layer(x)
        mark = len(rec.events)
        act = activation_bytes(y)
        loss = (y * split(rand(c["seed"] + 1, *c["shape"][:-1], width), grid)).sum()
        loss.backward()
    total = comm.allreduce(loss.data, op="sum")
    grads = {n: p.grad.copy() for n, p in layer.named_parameters()}
    adamw(layer.parameters()).step()
    fwd, bwd = sent(rec.events[:mark], comm.world_rank, grid), sent(rec.events[mark:], comm.world_rank, grid)
    assert not fwd["depth"]  # no activation crosses the depth
    return {"kij": (grid.mesh.coords["pp"], grid.i, grid.j), "y": y.data, "loss": float(total), "act": act,
            "dx": x.grad,
            "params": {n: (p.data.nbytes, grads[n], p.data) for n, p in layer.named_parameters()},
            "fwd": fwd["layer"], "bwd": bwd["layer"], "depth": bwd["depth"]}


def reference(c: dict) -> dict:
    """The single-process layer on the whole arrays."""
    layer, width = build(c)
    x = Tensor(rand(c["seed"], *c["shape"]), requires_grad=True)
    y = layer(x)
    act = activation_bytes(y)
    loss = (y * rand(c["seed"] + 1, *c["shape"][:-1], width)).sum()
    loss.backward()
    grads = {n: p.grad.copy() for n, p in layer.named_parameters()}
    adamw(layer.parameters()).step()
    return {"y": y.data, "loss": float(loss.data), "act": act, "dx": x.grad,
            "params": {n: (p.data.nbytes, grads[n], p.data) for n, p in layer.named_parameters()}}


def rows_block(full: np.ndarray, d: int, k: int, i: int, j: int) -> np.ndarray:
    """Rank (k, i, j)'s block of an activation, sliced by hand: rows block k q + i of d q, features block j."""
    r, f = full.shape[0] // (d * Q), full.shape[-1] // Q
    return full[(k * Q + i) * r:(k * Q + i + 1) * r, ..., j * f:(j + 1) * f]


def param_piece(full: np.ndarray, i: int, j: int) -> np.ndarray:
    """Rank (·, i, j)'s piece of a parameter, the same on every layer: a matrix's block (i, j); a
    vector's entries [j n/q + i n/q^2, ... + n/q^2)."""
    if full.ndim == 1:
        m = full.size // (Q * Q)
        return full[j * Q * m + i * m:j * Q * m + (i + 1) * m]
    r, k = full.shape[0] // Q, full.shape[1] // Q
    return full[i * r:(i + 1) * r, j * k:(j + 1) * k]


def check(c: dict, results: list[dict]) -> None:
    """Blocks equal to the whole's on every layer; 1/q^2 of every parameter; 1/(d q^2) of the
    activations kept for backward (+ each layer norm's gathered gain, d_model/q numbers)."""
    ref, d = reference(c), c["d"]
    norms = NORMS.get(c["kind"], 0)
    gains = norms * c["in"] // Q * 8
    whole_params = sum(nbytes for nbytes, _, _ in ref["params"].values())
    assert len(results) == d * Q * Q and {r["kij"] for r in results} == {
        (k, i, j) for k in range(d) for i in range(Q) for j in range(Q)}
    for res in results:
        k, i, j = res["kij"]
        assert (res["act"] - gains) * d * Q * Q == ref["act"]
        assert cost.activation_bytes(ref["act"], Q, d, norms, c["in"]) == res["act"]
        assert sum(nbytes for nbytes, _, _ in res["params"].values()) * Q * Q == whole_params
        np.testing.assert_allclose(res["loss"], ref["loss"], **TOL)
        np.testing.assert_allclose(res["y"], rows_block(ref["y"], d, k, i, j), **TOL)
        np.testing.assert_allclose(res["dx"], rows_block(ref["dx"], d, k, i, j), **TOL)
        for name, (_, grad, updated) in ref["params"].items():
            _, local_grad, local_updated = res["params"][name]
            np.testing.assert_allclose(local_grad, param_piece(grad, i, j), **TOL)
            assert_close_after_adamw(local_updated, param_piece(updated, i, j), [param_piece(grad, i, j)], ADAMW_LR,
                                     TOL, TOL, eps=ADAMW_EPS, err_msg=name)


def check_bytes(c: dict, results: list[dict]) -> None:
    """Inside a layer: 2-D SUMMA on b/d rows (``by_hand``: each rank sends q - 1 of its blocks per
    broadcast or reduce of each matrix); a layer norm: a ring all-reduce on 2 ranks sends each rank's
    array once (mean and variance of its b/(d q) rows forward, again plus two sums backward), gain and
    shift pieces (d_model/q^2) once each way. Over the depth (d = 2): a ring all-reduce on 2 ranks
    sends half of each piece in each of its two phases, so each rank sends its own parameter bytes once."""
    d, rows, norms = c["d"], int(np.prod(c["shape"][:-1])), NORMS.get(c["kind"], 0)
    fwd, bwd = Counter(), Counter()
    for fin, fout, bias in linears(c):
        f, b = by_hand(rows // d, fin, fout, Q, bias)
        fwd.update(f)
        bwd.update(b)
    local, piece = rows // d // Q * 8, c["in"] // (Q * Q) * 8
    fwd.update({"allreduce": norms * 2 * local, "allgather": norms * 2 * piece})
    bwd.update({"allreduce": norms * 4 * local, "reduce_scatter": norms * 2 * piece})
    fwd, bwd = +fwd, +bwd  # no zero counts
    for res in results:
        own = sum(nbytes for nbytes, _, _ in res["params"].values())
        depth = Counter({"allreduce": own} if d == 2 else {})
        assert (res["fwd"], res["bwd"], res["depth"]) == (fwd, bwd, depth)
        k, i, j = res["kij"]
        parts = [cost.linear2p5d_bytes(rows, fin, fout, Q, d, i, j, k, bias=bias) for fin, fout, bias in linears(c)]
        parts += [cost.layernorm2p5d_bytes(rows, c["in"], Q, d, i, j, k)] * norms
        model = {ph: sum((p[ph] for p in parts), Counter()) for ph in ("forward", "backward", "depth")}
        assert model == {"forward": fwd, "backward": bwd, "depth": depth}
        if c["kind"] == "block":
            assert cost.block2p5d_bytes(rows, c["in"], c["ff"], Q, d, i, j, k) == model
            assert cost.block2p5d_parameters(c["in"], c["ff"], Q) * 8 == own


@st.composite
def configs(draw: st.DrawFn, kind: str) -> dict:
    """A layer of ``kind`` on d = 1 or 2 stacked 2 x 2 grids: batch a multiple of d q, widths of q
    (q^2 where a bias or layer norm splits them q^2 ways), heads of q."""
    d = draw(st.sampled_from([1, 2]))
    tails = [(1,), (2,)] if kind in ("attn", "block") else [(), (1,), (3,)]  # attention takes (batch, seq, d)
    lead = (d * Q * draw(st.integers(1, 2)), *draw(st.sampled_from(tails)))
    c = {"kind": kind, "d": d, "seed": draw(st.integers(0, 10**6))}
    if kind == "linear":
        c["bias"] = draw(st.booleans())
        c["in"], c["out"] = Q * draw(st.integers(1, 3)), (Q * Q if c["bias"] else Q) * draw(st.integers(1, 2))
    elif kind == "mlp":
        c["in"], c["ff"] = Q * Q * draw(st.integers(1, 2)), Q * Q * draw(st.integers(1, 2))
    elif kind == "norm":
        c["in"] = Q * Q * draw(st.integers(1, 3))
    else:
        c["heads"] = Q * draw(st.integers(1, 2))
        c["in"] = Q * Q * c["heads"] // Q * draw(st.integers(1, 2))
        c["ff"] = Q * Q * draw(st.integers(1, 2))
    c["shape"] = (*lead, c["in"])
    return c


def check_all(c: dict, backend: str = "threads") -> None:
    results = run(layer_run, c["d"] * Q * Q, backend, c=c)
    check(c, results)
    check_bytes(c, results)


@budget(8)
@given(configs("linear"))
@example({"kind": "linear", "d": 2, "seed": 3, "bias": True, "in": 6, "out": 8, "shape": (8, 3, 6)})
def test_linear2p5d_equals_one_process(c: dict) -> None:
    check_all(c)


@budget(4)
@given(configs("mlp"))
def test_mlp2p5d_equals_one_process(c: dict) -> None:
    check_all(c)


@budget(3)
@given(st.sampled_from(["norm", "attn"]).flatmap(configs))
@example({"kind": "norm", "d": 2, "seed": 8, "in": 8, "shape": (4, 3, 8)})
@example({"kind": "attn", "d": 2, "seed": 9, "heads": 4, "in": 8, "shape": (8, 2, 8)})
def test_layernorm_and_attention2p5d_equal_one_process(c: dict) -> None:
    check_all(c)


@budget(6)
@given(configs("block"))
@example({"kind": "block", "d": 2, "seed": 5, "heads": 2, "in": 4, "ff": 8, "shape": (4, 3, 4)})
@example({"kind": "block", "d": 1, "seed": 6, "heads": 4, "in": 8, "ff": 4, "shape": (2, 2, 8)})
def test_block2p5d_equals_one_process(c: dict) -> None:
    check_all(c)


@pytest.mark.mpi
@pytest.mark.mpi8
def test_block2p5d_under_mpiexec_on_8_ranks() -> None:
    check_all({"kind": "block", "d": 2, "seed": 11, "heads": 2, "in": 8, "ff": 8, "shape": (4, 2, 8)}, "mpi")


def accumulate(comm) -> tuple:
    """Two backward passes on a Linear2p5D (d = 2), the first with the depth's sum off."""
    grid = grid_2p5d(comm, 2)
    layer = Linear2p5D(4, 8, grid).init_parameters(1, "l.")
    for step in range(2):
        layer.depth_allreduce.sync = step == 1
        y = layer(Tensor(block_2p5d(rand(10 + step, 8, 4), grid)))
        (y * block_2p5d(rand(20 + step, 8, 8), grid)).sum().backward()
    return grid.i, grid.j, layer.weight.grad, layer.bias.grad


def test_accumulation_sums_over_the_depth_once() -> None:
    """With ``sync = False`` on all but the last of several backward passes (DDP's ``no_sync``), the
    accumulated gradients equal one process's over the same batches."""
    ref = Linear(4, 8).init_parameters(1, "l.")
    for step in range(2):
        (ref(Tensor(rand(10 + step, 8, 4))) * rand(20 + step, 8, 8)).sum().backward()
    for i, j, dw, db in run(accumulate, 8):
        np.testing.assert_allclose(dw, param_piece(ref.weight.grad, i, j), **TOL)
        np.testing.assert_allclose(db, param_piece(ref.bias.grad, i, j), **TOL)


def test_closed_forms() -> None:
    """The closed forms against the exact counts where every division is exact, and the paper's
    bandwidth term q times ours (whole matrices as the unit, b = h; cost module's docstring)."""
    b = h = 16
    for q, d in ((2, 2), (4, 2), (2, 4)):
        exact = cost.linear2p5d_bytes(b, h, h, q, d, 0, 0, 0, itemsize=1, bias=False)
        form = cost.linear_closed_form(b, h, q, d)
        assert sum(exact["forward"].values()) + sum(exact["backward"].values()) == form["layer"]
        assert sum(exact["depth"].values()) == form["depth"]
        assert cost.paper_bandwidth(q, d) == pytest.approx(q * form["layer"] / (h * h))


def refusals(comm, depth: int, world_ok: bool) -> list[tuple[str, int, list[str]]]:
    """Each bad configuration's message, the messages sent while refusing it and the communicator's
    attributes it used besides rank and size (``zero_helpers.attempt``)."""
    if not world_ok:
        return [attempt(comm, lambda w: grid_2p5d(w, depth))]
    grid = grid_2p5d(comm, depth)
    layer = Linear2p5D(4, 8, grid)
    bad = [lambda: Linear2p5D(3, 8, grid), lambda: Linear2p5D(4, 6, grid), lambda: Block2p5D(8, 3, grid, 8),
           lambda: block_2p5d(np.zeros((2, 3, 4)), grid), lambda: block_2p5d(np.zeros((4, 3, 5)), grid),
           lambda: layer(Tensor(np.zeros((2, 4)))), lambda: Grid2p5D(DeviceMesh(comm, pp=2, dp=4, tp=1))]
    return [attempt(comm, lambda _, fn=fn: fn()) for fn in bad]


def test_bad_configurations_refused_before_any_message() -> None:
    for world, depth, want in ((6, 2, "not 2 x a square: launch 8 ranks"), (4, 3, "launch 12 ranks")):
        for ((msg, n, used),) in run(refusals, world, depth=depth, world_ok=False):
            assert (n, used) == (0, []) and f"the world has {world} ranks" in msg and want in msg, msg
    per_rank = run(refusals, 8, depth=2, world_ok=True)
    assert all(r == per_rank[0] for r in per_rank)  # the same on every rank
    wants = ["in_features=3 is not a multiple of 2", "out_features=6 is not a multiple of 4",
             "n_heads=3 is not a multiple of 2", "batch=2 is not a multiple of 4",
             "features=5 is not a multiple of 2", "input block has 4 features", "dp = tp = q"]
    for (msg, n, used), want in zip(per_rank[0], wants, strict=True):
        assert want in msg and (n, used) == (0, []), msg
