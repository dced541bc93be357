"""3-D tensor parallelism (Bian et al. 2021) equals one process; its bytes and memory per rank.

On 8 ranks (q = 2), ``Linear3D`` (with and without bias, with and without the input's gradient) gives
the output and the input, weight and bias gradients of ``nn.Linear`` on the whole arrays, piece by
piece (each piece sliced here by hand from the rank number); ``MLP3D`` and ``Block3D`` give
``nn.FeedForward``'s and ``nn.Block``'s initial parameters, output, loss, input gradient, every
parameter gradient and the parameters after one AdamW step. Each rank's bytes in the trace equal a
count by hand (every collective is a ring on 2 ranks: a rank sends its own half once) and
``minipar.cost.tensor3d``; each rank holds exactly 1/q^3 of every parameter, and of every activation
the single-process module keeps plus the gathered buffers counted by hand. Bad configurations are
refused on every rank before any message (and without touching the communicator).
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st
from strategies import budget
from tolerances import assert_close_after_adamw
from tp_helpers import rand, summarise
from zero_helpers import attempt

from minipar import trace
from minipar.autograd import Tensor
from minipar.cost.tensor import layer_terms
from minipar.cost.tensor3d import (
    block3d_activation_bytes,
    block3d_bytes,
    block3d_parameters,
    linear3d_bytes,
    linear3d_parameters,
    linear3d_total_bytes,
)
from minipar.memory import activation_bytes
from minipar.mesh import DeviceMesh
from minipar.nn import Block, FeedForward, Linear
from minipar.optim import AdamW
from minipar.parallel.tensor.tp3d import (
    MLP3D,
    Block3D,
    Cube3D,
    LayerNorm3D,
    Linear3D,
    cube_3d,
    input_piece,
    output_piece,
)
from minipar.testing import run

TOL = {"rtol": 1e-12, "atol": 1e-12}


def close(got: np.ndarray, whole: np.ndarray, want: np.ndarray, err_msg: str = "") -> None:
    """``got == want`` (a piece of ``whole``) to 1e-12 relative, and absolutely to 1e-12 of ``whole``'s
    largest magnitude: a block's gradients sum terms of that size, and an entry near zero keeps their
    rounding (measured: 1.8e-12 on an entry of 0.59 among entries of ~300)."""
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12 * max(1.0, float(np.abs(whole).max())),
                               err_msg=err_msg)


def close_after_adamw(got: np.ndarray, whole: np.ndarray, want: np.ndarray, grads: list[np.ndarray],
                      whole_grad: np.ndarray, err_msg: str = "") -> None:
    """``got == want`` (a piece of the updated ``whole``) after AdamW steps on ``grads`` (the same piece
    of ``whole_grad``): ``close``'s tolerance plus AdamW's drift of gradients within ``close``'s
    tolerance of the whole's (``tests/tolerances.py``)."""
    grad_tol = {"rtol": 1e-12, "atol": 1e-12 * max(1.0, float(np.abs(whole_grad).max()))}
    tol = {"rtol": 1e-12, "atol": 1e-12 * max(1.0, float(np.abs(whole).max()))}
    assert_close_after_adamw(got, want, grads, ADAMW_LR, grad_tol, tol, eps=ADAMW_EPS, err_msg=err_msg)


def sent(events: list, rank: int) -> Counter:
    return summarise(events, rank)["bytes"]


def layer_run(comm, c: dict) -> dict:
    """One rank: ``Linear3D`` on its input piece; output piece, gradients, parameter size, bytes."""
    cube = cube_3d(comm)
    shape, seed = c["shape"], c["seed"]
    layer = Linear3D(c["in"], c["out"], cube, bias=c["bias"]).init_parameters(seed, "l.")
    x = Tensor(input_piece(rand(seed, *shape), cube), requires_grad=c["x_grad"])
    dy = rand(seed + 1, *shape[:-1], c["out"])
    r, m, q = shape[0] // 4, c["out"] // 2, 2  # this rank's output piece, sliced by hand below
    with trace.record(None, comm) as rec:
        y = layer(x)
        mark = len(rec.events)
        b, k, n = comm.rank // 4, comm.rank // 2 % 2, comm.rank % 2
        mine = dy[(b * q + k) * r:(b * q + k + 1) * r, ..., n * m:(n + 1) * m]
        (y * mine).sum().backward()
    db = layer.bias.grad if c["bias"] else None
    assert np.array_equal(output_piece(dy, cube), mine)  # the helper slices as by hand
    return {"y": y.data, "dx": x.grad, "dw": layer.weight.grad, "db": db, "size": layer.weight.data.size,
            "fwd": sent(rec.events[:mark], comm.world_rank), "bwd": sent(rec.events[mark:], comm.world_rank)}


def check(c: dict, results: list[dict]) -> None:
    shape, seed, fin, fout = c["shape"], c["seed"], c["in"], c["out"]
    ref = Linear(fin, fout, bias=c["bias"]).init_parameters(seed, "l.")
    x = Tensor(rand(seed, *shape), requires_grad=True)
    y = ref(x)
    (y * rand(seed + 1, *shape[:-1], fout)).sum().backward()
    r, kb, kw, m = shape[0] // 4, fin // 2, fin // 4, fout // 2  # q = 2: rows B/q^2, K/q, K/q^2, N/q
    for rank, res in enumerate(results):
        b, k, n = rank // 4, rank // 2 % 2, rank % 2  # rank = (b q + k) q + n
        assert res["size"] * 8 == fin * fout == ref.weight.data.size  # exactly 1/q^3 of the weight
        assert res["db"] is None or res["db"].size * 8 == fout
        np.testing.assert_allclose(res["y"], y.data[(2 * b + k) * r:(2 * b + k + 1) * r, ..., n * m:(n + 1) * m],
                                   **TOL)
        np.testing.assert_allclose(res["dw"], ref.weight.grad[(2 * k + b) * kw:(2 * k + b + 1) * kw,
                                                              n * m:(n + 1) * m], **TOL)
        if c["bias"]:  # entries [n N/q + (b q + k) N/q^3, ...): the bias too is 1/q^3 per rank
            e = fout // 8
            np.testing.assert_allclose(res["db"], ref.bias.grad[n * m + (2 * b + k) * e:n * m + (2 * b + k + 1) * e],
                                       **TOL)
        if c["x_grad"]:
            np.testing.assert_allclose(res["dx"], x.grad[(2 * b + n) * r:(2 * b + n + 1) * r, ..., k * kb:(k + 1) * kb],
                                       **TOL)
        else:
            assert res["dx"] is None


def by_hand(rows: int, fin: int, fout: int, x_grad: bool, bias: bool) -> tuple[dict, dict]:
    """q = 2: a ring all-gather or reduce-scatter on 2 ranks sends half of the whole block once. The
    pieces: X (rows/4 x fin/2), W (fin/4 x fout/2), Y (rows/4 x fout/2), 8 bytes a number; the bias:
    its fout/8 piece (gathered along k), then fout/4 (along b), the same back in backward."""
    x, w, y = rows // 4 * fin // 2 * 8, fin // 4 * fout // 2 * 8, rows // 4 * fout // 2 * 8
    b = (fout // 8 + fout // 4) * 8 if bias else 0
    fwd = {"allgather": x + w + b, "reduce_scatter": y}
    bwd = {"allgather": y, "reduce_scatter": w + (x if x_grad else 0) + b}
    return fwd, bwd


def check_bytes(c: dict, results: list[dict]) -> None:
    rows = int(np.prod(c["shape"][:-1]))
    fwd, bwd = by_hand(rows, c["in"], c["out"], c["x_grad"], c["bias"])
    model = linear3d_bytes(rows, c["in"], c["out"], 2, input_grad=c["x_grad"], bias=c["bias"])
    assert model == {"forward": fwd, "backward": bwd}
    if c["x_grad"] and not c["bias"]:
        assert sum(fwd.values()) == sum(bwd.values()) == linear3d_total_bytes(rows, c["in"], c["out"], 2)
    for res in results:
        assert res["fwd"] == fwd and res["bwd"] == bwd


@st.composite
def linear_configs(draw: st.DrawFn) -> dict:
    lead = draw(st.sampled_from([(4,), (8,), (4, 3), (8, 2), (12,)]))
    fin = 4 * draw(st.integers(1, 3))
    bias = draw(st.booleans())
    fout = (8 if bias else 2) * draw(st.integers(1, 3))
    return {"shape": (*lead, fin), "in": fin, "out": fout, "x_grad": draw(st.booleans()), "bias": bias,
            "seed": draw(st.integers(0, 10**6))}


@budget(5)
@given(linear_configs())
def test_linear3d_equals_one_process(c: dict) -> None:
    results = run(layer_run, 8, c=c)
    check(c, results)
    check_bytes(c, results)
    bias = 0 if results[0]["db"] is None else results[0]["db"].size
    assert results[0]["size"] + bias == linear3d_parameters(c["in"], c["out"], 2, c["bias"])


def test_bytes_by_hand_example() -> None:
    """X 8 x 8, W 8 x 4 on q = 2: pieces X 2 x 4, W 2 x 2, Y 2 x 2 (8 bytes a number); each ring sends
    one piece: forward 64 + 32 (all-gathers) + 32 (reduce-scatter), backward 32 + (32 + 64)."""
    c = {"shape": (8, 8), "in": 8, "out": 4, "x_grad": True, "bias": False, "seed": 3}
    results = run(layer_run, 8, c=c)
    check(c, results)
    for res in results:
        assert res["fwd"] == {"allgather": 96, "reduce_scatter": 32}
        assert res["bwd"] == {"allgather": 32, "reduce_scatter": 96}
    assert linear3d_total_bytes(8, 8, 4, 2) == (8 * 8 + 8 * 4 + 8 * 4) // 8 * 8 == 96 + 32
    assert linear3d_bytes(8, 8, 4, 2)["forward"] == {"allgather": 96, "reduce_scatter": 32}


def refusals(comm, world_ok: bool) -> list[tuple[str, int, list[str]]]:
    """Each bad configuration's message, the messages sent while refusing it and the communicator's
    attributes it used besides rank and size (``zero_helpers.attempt``)."""
    if not world_ok:
        mesh = DeviceMesh(comm, pp=2, dp=2)
        return [attempt(comm, cube_3d), attempt(comm, lambda _: Cube3D(mesh))]
    cube = cube_3d(comm)
    layer = Linear3D(8, 4, cube)
    mesh = DeviceMesh(comm, dp=2, sp=2, tp=2)
    bad = [lambda _: Linear3D(6, 4, cube), lambda _: Linear3D(8, 3, cube),
           lambda _: Linear3D(8, 4, cube, bias=True),  # the bias is split q^3 = 8 ways
           lambda _: input_piece(np.zeros((6, 8)), cube), lambda _: input_piece(np.zeros((4, 7)), cube),
           lambda _: layer(Tensor(np.zeros((1, 8)))), lambda _: Cube3D(mesh),
           lambda _: Block3D(12, 2, cube), lambda _: Block3D(16, 3, cube, 16), lambda _: MLP3D(8, 12, cube),
           lambda _: LayerNorm3D(8, cube)(Tensor(np.zeros((1, 8))))]
    return [attempt(comm, make) for make in bad]


def test_bad_configurations_refused_before_any_message() -> None:
    for res in run(refusals, 4, world_ok=False):
        (msg, n, used), (msg2, n2, used2) = res
        assert n == 0 and used == [] and "4 ranks, not a cube" in msg and "launch 8 or 27 ranks" in msg
        assert n2 == 0 and used2 == [] and "pp = dp = tp = q" in msg2
    per_rank = run(refusals, 8, world_ok=True)
    assert all(r == per_rank[0] for r in per_rank)  # the same on every rank
    wants = ["in_features=6 is not a multiple of 4", "out_features=3 is not a multiple of 2",
             "out_features=4 is not a multiple of 8",
             "batch=6 is not a multiple of 4", "features=7 is not a multiple of 2", "input piece has 8 features",
             "sp = 1", "d_model=12 is not a multiple of q^3=8", "n_heads=3 is not a multiple of q=2",
             "d_ff=12 is not a multiple of q^3=8", "LayerNorm3D: this rank's input piece has 8 features"]
    for (msg, n, used), want in zip(per_rank[0], wants, strict=True):
        assert want in msg and n == 0 and used == [], msg
    assert "d_model=16 is not a multiple of n_heads=3" in per_rank[0][-3][0]  # every problem in one message


@pytest.mark.mpi
@pytest.mark.mpi8
def test_linear3d_under_mpiexec() -> None:
    c = {"shape": (4, 3, 8), "in": 8, "out": 8, "x_grad": True, "bias": True, "seed": 11}
    results = run(layer_run, 8, "mpi", c=c)
    check(c, results)
    check_bytes(c, results)


# ---- the transformer block: MLP3D and Block3D ------------------------------------------------------

def coords(rank: int, q: int) -> tuple[int, int, int]:
    return rank // (q * q), rank // q % q, rank % q  # rank = (b q + k) q + n


def act_piece(a: np.ndarray, q: int, b: int, k: int, n: int) -> np.ndarray:
    """A block input's (and output's) piece on rank (b, k, n): rows [b B/q + n B/q^2, ...), features block k."""
    r, c = a.shape[0] // q ** 2, a.shape[-1] // q
    return a[(q * b + n) * r:(q * b + n + 1) * r, ..., k * c:(k + 1) * c]


def param_piece(name: str, full: np.ndarray, q: int, b: int, k: int, n: int) -> np.ndarray:
    """By hand: a weight's rows [(k q + b) K/q^2, ...) and columns block n; a vector's entries
    [n N/q + (b q + k) N/q^3, ...). The layer norms and the second linear of each pair sit on the
    swapped cube: k and n exchanged."""
    if name.startswith("ln") or "proj." in name:
        k, n = n, k
    if full.ndim == 1:
        m = full.size // q ** 3
        return full[q * q * n * m + (q * b + k) * m:q * q * n * m + (q * b + k + 1) * m]
    kk, nn = full.shape[0] // q ** 2, full.shape[1] // q
    return full[(q * k + b) * kk:(q * k + b + 1) * kk, n * nn:(n + 1) * nn]


def randomise(model, seed: int) -> None:
    """Every parameter set to its slice of a random whole (the layer norms not left at ones and zeros)."""
    for name, p in model.named_parameters():
        full = rand(seed + sum(name.encode()), *p.full_shape)
        p.data[...] = full[p.shard] if p.shard is not None else full


ADAMW_LR, ADAMW_EPS = 1e-3, 1e-3


def adamw(params):
    """lr 1e-3, eps 1e-3: attention's key bias has a zero gradient in exact arithmetic (softmax ignores a
    constant added to all of a query's scores), so both runs hold rounding noise there and AdamW's
    first step moves it by lr g / (|g| + eps): with eps 1e-8 the two runs' noise D would differ by up to
    2 lr D / eps = 2e5 D after the step (``tests/tolerances.py``); with 1e-3, by 2 D."""
    return AdamW(params, lr=ADAMW_LR, eps=ADAMW_EPS, weight_decay=0.1)


def model_step(model, x: Tensor, r: np.ndarray, seed: int, rec=None) -> dict:
    """Forward, activation bytes kept, the loss sum(y r), backward and one AdamW step; the first
    parameters (``init_parameters``) are recorded before ``randomise``. ``mark``: where backward's
    events begin in ``rec``."""
    init = {name: p.data.copy() for name, p in model.named_parameters()}
    randomise(model, seed)
    y = model(x)
    mark = len(rec.events) if rec is not None else 0
    act = activation_bytes(y)
    loss = (y * r).sum()
    loss.backward()
    adamw(model.parameters()).step()
    return {"y": y.data, "act": act, "loss": float(loss.data), "dx": x.grad, "mark": mark,
            "params": {name: (init[name], p.grad, p.data) for name, p in model.named_parameters()}}


def block_run(comm, c: dict) -> dict:
    """One rank: ``MLP3D`` or ``Block3D`` on its input piece; output, loss share, gradients, bytes."""
    cube = cube_3d(comm)
    assert repr(cube.swapped()) == f"Cube3D(q={cube.q}, b={cube.b}, k={cube.n}, n={cube.k}, swapped)"
    assert repr(cube.swapped().swapped()) == repr(cube) and cube.swapped().along_k is cube.along_n
    d, seed = c["shape"][-1], c["seed"]
    model = MLP3D(d, c["ff"], cube) if c["heads"] is None else Block3D(d, c["heads"], cube, c["ff"],
                                                                       causal=c["causal"])
    model.init_parameters(seed, "m.")
    x = Tensor(input_piece(rand(seed, *c["shape"]), cube), requires_grad=True)
    with trace.record(None, comm) as rec:
        res = model_step(model, x, input_piece(rand(seed + 1, *c["shape"]), cube), seed, rec)
    mark = res.pop("mark")
    res.update(fwd=sent(rec.events[:mark], comm.world_rank), bwd=sent(rec.events[mark:], comm.world_rank))
    return res


def block_reference(c: dict) -> dict:
    d, seed = c["shape"][-1], c["seed"]
    model = FeedForward(d, c["ff"]) if c["heads"] is None else Block(d, c["heads"], c["ff"], causal=c["causal"])
    model.init_parameters(seed, "m.")
    x = Tensor(rand(seed, *c["shape"]), requires_grad=True)
    res = model_step(model, x, rand(seed + 1, *c["shape"]), seed)
    if c["heads"]:  # Korthikanti et al.'s terms without dropout (cost.tensor) and the two proj outputs
        terms = layer_terms(1, *c["shape"][:2], d, c["heads"], c["ff"])
        assert res["act"] == sum(terms.values()) + 2 * x.data.nbytes
    return res


def block_by_hand(c: dict) -> tuple[Counter, Counter]:
    """q = 2: each linear as ``by_hand``; a layer norm's ring all-reduce of m numbers on 2 ranks sends
    m (two chunks: one in the reduce-scatter, one in the all-gather): forward 2 of B/4 (mean,
    variance), backward those again and one of 2 B/4; its gain and its shift: d/8 then d/4 numbers
    each way."""
    rows, d, ff = int(np.prod(c["shape"][:-1])), c["shape"][-1], c["ff"]
    fwd, bwd = Counter(), Counter()
    for fin, fout in [(d, ff), (ff, d)] + ([(d, d)] * 4 if c["heads"] else []):
        f, b = by_hand(rows, fin, fout, True, True)
        fwd.update(f)
        bwd.update(b)
    if c["heads"]:  # k and v use q's gathered input: 2 fewer gathers of X (B/4 x d/2) and reduce-scatters of dX
        fwd["allgather"] -= 2 * rows // 4 * d // 2 * 8
        bwd["reduce_scatter"] -= 2 * rows // 4 * d // 2 * 8
        fwd.update({"allreduce": 2 * 2 * rows // 4 * 8, "allgather": 4 * (d // 8 + d // 4) * 8})  # 2 x (gain, shift)
        bwd.update({"allreduce": 2 * 4 * rows // 4 * 8, "reduce_scatter": 4 * (d // 8 + d // 4) * 8})
    return fwd, bwd


def kept_by_hand(c: dict, q: int) -> int:
    """Bytes of the gathered buffers a rank keeps for backward: each linear's W_kn (in/q x out/q) and X_bk
    (B/q x in/q; one for q, k and v), each layer norm's gain (d/q)."""
    rows, d, ff = int(np.prod(c["shape"][:-1])), c["shape"][-1], c["ff"]
    kept = sum(rows // q * fin // q + fin // q * fout // q
               for fin, fout in [(d, ff), (ff, d)] + ([(d, d)] * 4 if c["heads"] else []))
    if c["heads"]:
        kept += 2 * d // q - 2 * (rows // q * d // q)  # two gains; k and v keep q's X_bk, not their own
    return kept * 8


def check_block(c: dict, results: list[dict], q: int = 2) -> None:
    """Every rank's pieces equal the whole's, sliced by hand; the loss shares add up to the loss; 1/q^3
    of every parameter and of the activations plus the gathered buffers; bytes by hand (q = 2) and
    from ``cost.tensor3d``."""
    ref, p = block_reference(c), q ** 3
    loss = sum(res["loss"] for res in results)
    assert abs(loss - ref["loss"]) <= 1e-12 * max(1.0, abs(ref["loss"]))
    rows, d, ff = int(np.prod(c["shape"][:-1])), c["shape"][-1], c["ff"]
    whole = sum(g.size for _, g, _ in ref["params"].values())
    for rank, res in enumerate(results):
        b, k, n = coords(rank, q)
        close(res["y"], ref["y"], act_piece(ref["y"], q, b, k, n))
        close(res["dx"], ref["dx"], act_piece(ref["dx"], q, b, k, n))
        for name, (init, grad, updated) in ref["params"].items():
            mine = res["params"][name]
            assert mine[1].size * p == grad.size  # exactly 1/q^3 of every parameter
            np.testing.assert_array_equal(mine[0], param_piece(name, init, q, b, k, n))  # a slice, bit for bit
            close(mine[1], grad, param_piece(name, grad, q, b, k, n), name)
            close_after_adamw(mine[2], updated, param_piece(name, updated, q, b, k, n),
                              [param_piece(name, grad, q, b, k, n)], grad, name)
        assert res["act"] * p == ref["act"] + kept_by_hand(c, q) * p  # 1/q^3 of the whole's + gathered buffers
        if q == 2:
            assert (res["fwd"], res["bwd"]) == block_by_hand(c)
        if c["heads"]:
            assert sum(m[1].size for m in res["params"].values()) * p == whole == p * block3d_parameters(d, ff, q)
            assert block3d_bytes(rows, d, ff, q, k) == {"forward": res["fwd"], "backward": res["bwd"]}
            cost = block3d_activation_bytes(*c["shape"][:2], d, c["heads"], ff, q)
            assert cost["pieces"] * p == ref["act"] and sum(cost.values()) == res["act"]


@st.composite
def block_configs(draw: st.DrawFn, mlp: bool = False) -> dict:
    d, heads = draw(st.sampled_from([(8, 2), (16, 2), (16, 4)]))
    shape = (draw(st.sampled_from([4, 8])), draw(st.integers(1, 3)), d)
    return {"shape": shape, "ff": 8 * draw(st.integers(1, 3)), "heads": None if mlp else heads,
            "causal": draw(st.booleans()), "seed": draw(st.integers(0, 10**6))}


@budget(5)
@given(block_configs(mlp=True))
def test_mlp3d_equals_one_process(c: dict) -> None:
    check_block(c, run(block_run, 8, c=c))


@budget(10)
@given(block_configs())
@example({"shape": (8, 3, 16), "ff": 24, "heads": 4, "causal": True, "seed": 1})
def test_block3d_equals_one_process(c: dict) -> None:
    check_block(c, run(block_run, 8, c=c))


def test_block3d_on_27_ranks() -> None:
    """q = 3: rings of 3 ranks; a layer norm all-reduces 18/9 x 2 = 4 row sums per rank along k, in
    chunks 2, 1, 1: rank k sends every chunk but k in the reduce-scatter and all but k + 1 in the
    all-gather (5, 6, 5 numbers for k = 0, 1, 2); backward's 8 numbers go in chunks 3, 3, 2 (10, 11, 11)."""
    c = {"shape": (18, 2, 27), "ff": 54, "heads": 9, "causal": True, "seed": 4}
    results = run(block_run, 27, c=c)
    check_block(c, results, q=3)
    for rank, res in enumerate(results):
        k = coords(rank, 3)[1]
        stat, pair = (5, 6, 5)[k], (10, 11, 11)[k]
        assert res["fwd"]["allreduce"] == 2 * 2 * stat * 8 and res["bwd"]["allreduce"] == 2 * (2 * stat + pair) * 8


def test_block_bytes_closed_form() -> None:
    """``cost.tensor3d``'s docstring, per phase: ``(q-1)/q^3 (8 B d + 2 B d_ff + 4 d^2 + 2 d d_ff)``
    numbers for the products, ``(q-1)(5d + d_ff)(1/q^3 + 1/q^2)`` for the biases, the same with
    ``d`` for each of the two layer norms' gain and shift, and the layer norms' ring all-reduces of
    ``B/q^2`` numbers, ``2 (q-1)/q`` of them each: two per layer norm forward, four backward."""
    for q, rows, d, ff in ((2, 12, 8, 32), (3, 27, 27, 108)):
        products = (q - 1) * (8 * rows * d + 2 * rows * ff + 4 * d * d + 2 * d * ff) // q ** 3
        biases = (q - 1) * (5 * d + ff) * (q + 1) // q ** 3
        gains = 2 * 2 * (q - 1) * (d // q ** 3 + d // q ** 2)
        stat = 2 * (q - 1) * (rows // q ** 2) // q
        cost = block3d_bytes(rows, d, ff, q, 0)
        assert sum(cost["forward"].values()) == (products + biases + gains + 2 * 2 * stat) * 8
        assert sum(cost["backward"].values()) == (products + biases + gains + 2 * 4 * stat) * 8


@pytest.mark.mpi
@pytest.mark.mpi8
def test_block3d_under_mpiexec() -> None:
    c = {"shape": (4, 3, 16), "ff": 16, "heads": 4, "causal": True, "seed": 5}
    check_block(c, run(block_run, 8, "mpi", c=c))
