"""FSDP2 (``fully_shard``: every parameter a ``[Shard(0)]`` global tensor on the dp axis) equals one
process, sends the bytes counted by hand, holds only its pieces, and matches FSDP1 where nothing pads.

Property drawn by hypothesis (N = 2 to 4 ranks, GPTs whose first dimensions N often does not divide,
prefetch and resharding on or off): after 2 AdamW steps every parameter equals one process's on the
global batch (``test_zero.zero_reference``), the losses too; the bytes each rank sends equal a count
written here (per parameter: all-gathers of every piece but the successor's, a reduce-scatter of every
part but its own, the pieces cut by DTensor's rule written again here) and ``cost.zero.fsdp2_traffic_bytes``;
the parameters held are the pieces (no padding), the gathered units peak at the largest adjacent pair
(one unit without prefetch, every unit without resharding), and nothing is gathered after backward.
The model's parameters hold no values outside a unit's computation. With dimensions N divides (and
units: no padding), FSDP2 sends what FSDP1 sends, ``zero_traffic_bytes(stage=3)``. Threads and mpiexec.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st
from strategies import budget
from test_zero import LOSS_REL, samples_by_step, zero_reference
from tolerances import assert_close_after_adamw
from zero_helpers import GRAD_TOL, LR, PARAM_TOL, WEIGHT_DECAY, build, config, train_steps, unit_sizes

from minipar import launch, nn
from minipar.cost.zero import fsdp2_traffic_bytes, zero_traffic_bytes
from minipar.mesh import DeviceMesh
from minipar.parallel.zero import FullyShardedDataParallel
from minipar.parallel.zero.fsdp2 import fully_shard
from minipar.testing import run_each


def param_shapes(c: dict) -> list[list[tuple[int, ...]]]:
    """Each unit's parameter shapes, from ``minipar.nn``'s definitions: embeddings (V, d) and (S, d); a
    block's layer norms (d,), q, k, v, proj (d, d) + (d,), the feed-forward (d, 4d) + (4d,), (4d, d) +
    (d,); the final layer norm; the head (d, V)."""
    d, v = c["d"], c["vocab"]
    block = [(d,), (d,), *[(d, d), (d,)] * 4, (d,), (d,), (d, 4 * d), (4 * d,), (4 * d, d), (d,)]
    return [[(v, d)], [(c["seq"], d)], *[block] * c["layers"], [(d,), (d,)], [(d, v)]]


def cut(n: int, p: int) -> list[int]:
    """Rows of ``n`` per rank: ``ceil(n/p)`` each until they run out (the last short or empty)."""
    size = -(-n // p)
    return [max(0, min(n, (m + 1) * size) - m * size) for m in range(p)]


def hand_bytes(c: dict, rank: int) -> int:
    """One step's bytes from ``rank``: per parameter of n elements, its pieces s_m (rows x row size),
    all-gathers of n - s_{rank+1} (two when resharding) and a reduce-scatter of n - s_rank."""
    p, total = c["world"], 0
    for shape in (s for unit in param_shapes(c) for s in unit):
        n = int(np.prod(shape))
        s = [r * n // shape[0] for r in cut(shape[0], p)]
        total += (2 if c["reshard"] else 1) * (n - s[(rank + 1) % p]) + n - s[rank]
    return 8 * total if p > 1 else 0


def fsdp_run(comm, c: dict, v2: bool = True) -> dict:
    with nn.deferred():
        model = build(c)
    kw = {"reshard_after_forward": c["reshard"], "prefetch": c["prefetch"], "lr": LR, "weight_decay": WEIGHT_DECAY}
    mesh = DeviceMesh(comm, dp=comm.size)
    par = fully_shard(model, mesh, **kw) if v2 else FullyShardedDataParallel(model, comm, **kw)
    losses, rec = train_steps(comm, c, model, par)
    sharded = all(p.data.size == 0 for p in model.parameters())
    return {"losses": losses, "final": par.full_state_dict(), "memory": samples_by_step(rec.events),
            "sent": sum(e.nbytes for e in rec.events if e.kind == "comm" and e.name == "send" and e.src == comm.rank),
            "pieces": par.checkpoint_shapes() if v2 else None, "sharded": sharded}


def check_fsdp2(c: dict, results: list[dict]) -> None:
    p, ref, units = c["world"], zero_reference(c), param_shapes(c)
    whole = [8 * sum(int(np.prod(s)) for s in unit) for unit in units]
    for r, got in enumerate(results):
        for i, want in enumerate(ref["losses"][:c["steps"]]):
            assert got["losses"][i] == pytest.approx(want[r], rel=LOSS_REL[i]), (r, i)
        for k, want in ref["final"].items():
            assert_close_after_adamw(got["final"][k], want, ref["step_grads"][k], LR, GRAD_TOL, PARAM_TOL,
                                     err_msg=f"rank {r} {k}")
        shapes = [(cut(s[0], p)[r], *s[1:]) for unit in units for s in unit]
        assert list(got["pieces"].values()) == shapes, r  # rows by DTensor's rule, nothing padded
        assert got["sent"] == c["steps"] * hand_bytes(c, r) == c["steps"] * fsdp2_traffic_bytes(
            units, p, 8, r, c["reshard"]), r
        mem = got["memory"]
        held = 8 * sum(int(np.prod(s)) for s in shapes)
        assert set(mem["all"]["parameters"]) == {held}
        assert [s["optimizer state"] for s in mem["after_step"]] == [2 * held] * c["steps"]
        pairs = [a + b for a, b in zip(whole, whole[1:])]
        peak = sum(whole) if not c["reshard"] else max(pairs) if c["prefetch"] else max(whole)
        assert max(mem["all"]["gathered units"]) == (peak if p > 1 else 0), r
        assert [s["gathered units"] for s in mem["after_backward"] + mem["after_step"]] == [0] * 2 * c["steps"]
        assert got["sharded"]


def drawn(world: int, vocab: int, d: int, reshard: bool, prefetch: bool) -> dict:
    return config("fsdp", world, reshard=reshard, prefetch=prefetch, d=d, heads=1, steps=2) | {"vocab": vocab}


EVEN = config("fsdp", 2, steps=2) | {"vocab": 6, "seq": 4}  # every first dimension and unit divides by 2


@budget(4)
@given(c=st.builds(drawn, st.integers(2, 4), st.integers(4, 7), st.integers(3, 5), st.booleans(), st.booleans()))
@example(c=config("fsdp", 3, steps=2))  # vocab 5 on 3 ranks: 2, 2, 1 rows; biases of 4: 2, 2, 0
@example(c=config("fsdp", 4, prefetch=False, d=3, heads=1, steps=2))
@example(c=EVEN)
def test_fsdp2_equals_one_process_threads(c: dict) -> None:
    check_fsdp2(c, launch(fsdp_run, c["world"], c=c))


def test_fsdp2_sends_what_fsdp1_sends_where_nothing_pads() -> None:
    v1, v2 = (launch(fsdp_run, 2, c=EVEN, v2=v) for v in (False, True))
    want = EVEN["steps"] * zero_traffic_bytes(unit_sizes(EVEN), 3, 2)
    assert [r["sent"] for r in v1] == [r["sent"] for r in v2] == [want, want]


def test_uneven_cuts_send_unequal_bytes_by_hand() -> None:
    """vocab 5, d 4 on N = 3, one step with resharding: rank 1's successor (rank 2) holds the fewest
    rows (vocab 5: 2, 2, 1; a bias of 4: 2, 2, 0), so rank 1 sends most; FSDP1 pads to equal chunks."""
    c = config("fsdp", 3, steps=1)
    assert [hand_bytes(c, r) for r in range(3)] == [7152, 10384, 8768]
    assert zero_traffic_bytes(unit_sizes(c), 3, 3) == 3 * 2 * 185 * 8  # FSDP1: 8880 on every rank


def refuse(comm, how: str) -> str:
    model = build(config("fsdp", 2))
    mesh = DeviceMesh(comm, tp=2) if how == "mesh" else DeviceMesh(comm, dp=2)
    with pytest.raises(ValueError) as err:
        fully_shard(model, mesh, precision="bf16") if how == "precision" else fully_shard(model, mesh)
    return str(err.value)


@pytest.mark.parametrize(("how", "want"), [("mesh", "{'tp': 2} has axes other than 'dp'"),
                                           ("precision", "['precision']")])
def test_bad_configurations_refused_on_every_rank(how: str, want: str) -> None:
    out = launch(refuse, 2, how=how)
    assert want in out[0] and out[0] == out[1]


@pytest.mark.mpi
def test_fsdp2_equals_one_process_mpiexec() -> None:
    cases = [config("fsdp", 3, steps=2), config("fsdp", 3, prefetch=False, reshard=False, d=5, heads=1, steps=2)]
    for c, results in zip(cases, run_each(fsdp_run, 3, [{"c": c} for c in cases], timeout=120), strict=True):
        check_fsdp2(c, results)
