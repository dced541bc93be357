"""3-D tensor parallelism (Bian et al. 2021) equals one process; its bytes and memory per rank.

On 8 ranks (q = 2), ``Linear3D`` (with and without bias, with and without the input's gradient) gives
the output and the input, weight and bias gradients of ``nn.Linear`` on the whole arrays, piece by
piece (each piece sliced here by hand from the rank number). Each rank's bytes in the trace equal a
count by hand (every collective is a ring on 2 ranks: a rank sends its own half once) and
``minipar.cost.tensor3d``; each rank holds exactly 1/q^3 of the weight and of the bias. Bad
configurations are refused on every rank before any message (and without touching the communicator).
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from strategies import budget
from tp_helpers import rand, summarise
from zero_helpers import attempt

from minipar import trace
from minipar.autograd import Tensor
from minipar.cost.tensor3d import linear3d_bytes, linear3d_parameters, linear3d_total_bytes
from minipar.mesh import DeviceMesh
from minipar.nn import Linear
from minipar.parallel.tensor3d import Cube3D, Linear3D, cube_3d, input_piece, output_piece
from minipar.testing import run

TOL = {"rtol": 1e-12, "atol": 1e-12}


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
           lambda _: layer(Tensor(np.zeros((1, 8)))), lambda _: Cube3D(mesh)]
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
             "sp = 1"]
    for (msg, n, used), want in zip(per_rank[0], wants, strict=True):
        assert want in msg and n == 0 and used == [], msg


@pytest.mark.mpi
@pytest.mark.mpi8
def test_linear3d_under_mpiexec() -> None:
    c = {"shape": (4, 3, 8), "in": 8, "out": 8, "x_grad": True, "bias": True, "seed": 11}
    results = run(layer_run, 8, "mpi", c=c)
    check(c, results)
    check_bytes(c, results)
