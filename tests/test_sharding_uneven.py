"""Uneven shards, as PyTorch DTensor cuts them: ``ceil(n/p)`` rows a piece, the last ones shorter or empty.

- ``cost.sharding``'s cut (``shard_bounds``, nested ``piece_bounds``) against tables written by hand.
- ``step_bytes`` with unequal pieces against counts by hand, and its refusal of sizes that do not fit.
- Megatron's MLP (``sharding.nn.FeedForward``, ``MEGATRON`` placements) with a hidden width the ranks do
  not divide (d_ff = 10 on 3 ranks: 4, 4, 2 columns; on 4: 3, 3, 3, 1): output, the input's gradient and
  every parameter's gradient equal ``minipar.nn`` on one process, each rank holds only its uneven
  piece, and the bytes each rank sends are one all-reduce of the activation a phase, counted by hand
  (the cut does not reach the activation); threads and mpiexec.

The seed's 16 placement pairs on 2 and 3 ranks are in test_sharding_propagate.py, uneven redistribution
between every pair of placement lists in test_sharding.py.
"""

from __future__ import annotations

import numpy as np
import pytest

from minipar import nn, trace
from minipar.autograd import Tensor
from minipar.comm import launch
from minipar.cost.sharding import piece_bounds, shard_bounds, step_bytes
from minipar.mesh import DeviceMesh
from minipar.sharding import GlobalTensor, Replicate, ops
from minipar.sharding import nn as snn
from minipar.testing import run_each

B = Replicate()


@pytest.mark.parametrize(("n", "p", "want"), [
    (5, 2, [(0, 3), (3, 5)]),
    (4, 3, [(0, 2), (2, 4), (4, 4)]),           # the last piece empty
    (10, 4, [(0, 3), (3, 6), (6, 9), (9, 10)]),
    (1, 4, [(0, 1), (1, 1), (1, 1), (1, 1)]),
    (0, 2, [(0, 0), (0, 0)]),
    (6, 3, [(0, 2), (2, 4), (4, 6)]),           # even: equal blocks
])
def test_shard_bounds_by_hand(n: int, p: int, want: list) -> None:
    assert [shard_bounds(n, p, c) for c in range(p)] == want


def test_nested_cuts_by_hand() -> None:
    """5 rows over dp = 2 then tp = 2: dp cuts 3, 2; tp cuts those 2, 1 and 1, 1. A dimension on one axis
    only is cut once; a replicated or partial axis does not cut."""
    got = [piece_bounds((5, 7), (2, 2), (i, j), ["S(0)", "S(0)"]) for i in range(2) for j in range(2)]
    assert got == [[(0, 2), (0, 7)], [(2, 3), (0, 7)], [(3, 4), (0, 7)], [(4, 5), (0, 7)]]
    assert piece_bounds((5, 7), (2, 3), (1, 2), ["P", "S(1)"]) == [(0, 5), (6, 7)]
    assert piece_bounds((5, 7), (2, 3), (1, 2), ["S(1)", "B"]) == [(0, 5), (4, 7)]


@pytest.mark.parametrize(("args", "sizes", "want"), [
    # all-gather of pieces 3, 3, 3, 1 rows of 8 bytes: every piece but the successor's
    (("S(0)", "B", 3, 8, 4, 0), [3, 3, 3, 1], 8 * (10 - 3)),
    (("S(0)", "B", 3, 8, 4, 2), [3, 3, 3, 1], 8 * (10 - 1)),
    (("S(0)", "B", 1, 8, 4, 3), [3, 3, 3, 1], 8 * (10 - 3)),
    # reduce-scatter of 10 elements to 3, 3, 3, 1: every part but its own
    (("P", "S(0)", 10, 8, 4, 3), [3, 3, 3, 1], 8 * 9),
    (("P", "S(0)", 10, 8, 4, 0), [3, 3, 3, 1], 8 * 7),
    # all-to-all of a 2x5 piece to columns 3, 2: keeps 2x3, sends 2x2
    (("S(0)", "S(1)", 10, 8, 2, 0), [6, 4], 8 * 4),
    (("S(0)", "S(1)", 10, 8, 2, 0), None, 8 * 5),  # no sizes: even blocks
])
def test_uneven_step_bytes_by_hand(args: tuple, sizes: list | None, want: int) -> None:
    assert step_bytes(*args, sizes=sizes) == want


@pytest.mark.parametrize(("args", "sizes", "what"), [
    (("P", "S(0)", 10, 8, 4, 0), [3, 3, 3], "4 members' element counts"),
    (("P", "S(0)", 10, 8, 4, 0), [3, 3, 3, 2], "adding up to numel=10"),
    (("S(0)", "B", 2, 8, 4, 0), [3, 3, 3, 1], "this rank's being numel=2"),
    (("S(0)", "B", 3, 8, 2, 0), [3, -1], "whole numbers >= 0"),
])
def test_step_bytes_refuses_sizes_that_do_not_fit(args: tuple, sizes: list, what: str) -> None:
    with pytest.raises(ValueError, match="step_bytes") as err:
        step_bytes(*args, sizes=sizes)
    assert what in str(err.value)


# ---- Megatron's MLP with a hidden width the ranks do not divide -------------------------------------------
BATCH, SEQ, D, D_FF, SEED = 2, 3, 6, 10, 5


def run_mlp(comm) -> dict:
    rng = np.random.default_rng(SEED)
    x, r = rng.normal(size=(BATCH, SEQ, D)), rng.normal(size=(BATCH, SEQ, D))
    mesh = DeviceMesh(comm, tp=comm.size)
    layer = snn.FeedForward(D, D_FF, mesh, ("tp",), snn.MEGATRON).init_parameters(SEED, "m.")
    gx = GlobalTensor.from_global(x, mesh, ("tp",), [B]).requires_grad_()
    with trace.recording(comm.world_rank) as rec:
        y = ops.redistribute(layer(gx), [B], "output")
        mark = len(rec.events)
        ops.sum(ops.mul(y, GlobalTensor.from_global(r, mesh, ("tp",), [B]))).backward()
    sent = [sum(e.nbytes for e in part if e.kind == "comm" and e.src == comm.rank)
            for part in (rec.events[:mark], rec.events[mark:])]
    return {"y": y.local, "dx": gx.grad.local, "sent": sent,
            "shapes": {n: p.local.shape for n, p in layer.named_parameters()},
            "grads": {n: p.grad.to_global() for n, p in layer.named_parameters()}}


def one_process() -> dict:
    rng = np.random.default_rng(SEED)
    x, r = rng.normal(size=(BATCH, SEQ, D)), rng.normal(size=(BATCH, SEQ, D))
    ref = nn.FeedForward(D, D_FF).init_parameters(SEED, "m.")
    tx = Tensor(x, requires_grad=True)
    ty = ref(tx)
    (ty * r).sum().backward()
    return {"y": ty.data, "dx": tx.grad, "grads": {n: p.grad for n, p in ref.named_parameters()}}


def ring_allreduce_bytes(n: int, p: int, c: int) -> int:
    """A ring all-reduce of ``n`` float64 over ``p`` ranks, chunks as np.array_split: every chunk but the
    rank's own, then every chunk but its successor's."""
    chunk = [n // p + (i < n % p) for i in range(p)]
    return 8 * (2 * n - chunk[c] - chunk[(c + 1) % p])


def check_mlp(results: list[dict]) -> None:
    p, want = len(results), one_process()
    cols = [b - a for a, b in (shard_bounds(D_FF, p, c) for c in range(p))]  # 4, 4, 2 on 3; 3, 3, 3, 1 on 4
    for c, res in enumerate(results):
        np.testing.assert_allclose(res["y"], want["y"], rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(res["dx"], want["dx"], rtol=1e-12, atol=1e-12)
        for name, g in want["grads"].items():
            np.testing.assert_allclose(res["grads"][name], g, rtol=1e-12, atol=1e-12, err_msg=name)
        assert res["shapes"] == {"fc.weight": (D, cols[c]), "fc.bias": (cols[c],),
                                 "proj.weight": (cols[c], D), "proj.bias": (D,)}
        one = ring_allreduce_bytes(BATCH * SEQ * D, p, c)  # forward: y from P; backward: dx from P
        assert res["sent"] == [one, one], (c, res["sent"])


@pytest.mark.parametrize("p", [3, 4])
def test_megatron_mlp_with_uneven_hidden_width_threads(p: int) -> None:
    check_mlp(launch(run_mlp, p, "threads"))


@pytest.mark.mpi
def test_megatron_mlp_with_uneven_hidden_width_mpiexec() -> None:
    [results] = run_each(run_mlp, 3, [{}], timeout=120)
    check_mlp(results)
