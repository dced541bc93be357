"""The sequence-parallel attentions called directly (not through ``SequenceParallelGPT``, whose
``check_sequence_config`` runs first) refuse bad arguments with one line, on every rank, before any
message: ``ulysses_attention`` and ``hybrid_attention`` heads that do not split over the Ulysses
ranks (they returned wrong attention, max error 0.869 against one process), ``ring_attention``
operands whose rows are not this rank's ring block (a bare numpy IndexError)."""

from __future__ import annotations

import numpy as np
import pytest
from sp_helpers import Watched

from minipar import launch, trace
from minipar.autograd import Tensor
from minipar.parallel.sequence import (
    OnlineSoftmax,
    SequenceGroup,
    SequenceLayout,
    heads_to_seq,
    hybrid_attention,
    ring_attention,
    seq_to_heads,
    ulysses_attention,
    visibility,
)
from minipar.testing import run

P, B = 4, 2


def _qkv(rows: tuple[int, int, int], width: int) -> list[Tensor]:
    """q, k, v of (B, rows[i], width), requires_grad."""
    rng = np.random.default_rng(0)
    return [Tensor(rng.normal(size=(B, n, width)), requires_grad=True) for n in rows]


CONTIGUOUS = [[(2 * r, 2 * r + 2)] for r in range(P)]  # S = 8 on 4 ring ranks: 2 rows each
BAD = {  # name: (attention, keyword arguments, the whole message)
    "ulysses heads": ("ulysses", {"heads": 6, "width": 12},
                      "ulysses_attention: n_heads=6 is not divisible by the Ulysses degree P_u=4 (the ranks of "
                      "its communicator): each rank needs whole heads; use a multiple of 4 heads or 1, 2, 3 or 6 "
                      "ranks"),
    "ulysses width": ("ulysses", {"heads": 4, "width": 10},
                      "ulysses_attention: the width 10 of q, k, v is not divisible by n_heads=4"),
    "ulysses shapes": ("ulysses", {"heads": 4, "width": 8, "rows": (2, 2, 3)},
                       "ulysses_attention: q, k, v must have one shape (b, n, H d); got q (2, 2, 8), "
                       "k (2, 2, 8), v (2, 3, 8)"),
    "ulysses n_heads": ("ulysses", {"heads": 0, "width": 8},
                        "ulysses_attention: n_heads=0 must be a positive whole number"),
    "hybrid heads": ("hybrid", {"heads": 3, "width": 6},
                     "hybrid_attention: n_heads=3 is not divisible by the Ulysses degree P_u=2 (the ranks of "
                     "its communicator): each rank needs whole heads; use a multiple of 2 heads or 1 or 3 "
                     "ranks"),
    "hybrid rows": ("hybrid", {"heads": 2, "width": 4, "rows": (4, 4, 4)},
                    "hybrid_attention: q, k, v must be (b, 2, H d), this rank's 2 of the 4 positions of its "
                    "ring block; got q (2, 4, 4), k (2, 4, 4), v (2, 4, 4)"),
    "ring rows": ("ring", {"heads": 2, "width": 4, "rows": (3, 3, 3)},
                  "ring_attention: q, k, v must be (b, 2, H d), the 2 positions of this rank's ring block "
                  "(blocks[comm.rank]); got q (2, 3, 4), k (2, 3, 4), v (2, 3, 4)"),
    "ring whole sequence": ("ring", {"heads": 2, "width": 4, "rows": (8, 8, 8)},
                            "ring_attention: q, k, v must be (b, 2, H d), the 2 positions of this rank's ring "
                            "block (blocks[comm.rank]); got q (2, 8, 4), k (2, 8, 4), v (2, 8, 4)"),
    "ring k rows": ("ring", {"heads": 2, "width": 4, "rows": (2, 3, 3)},
                    "ring_attention: q, k, v must have one shape (b, n, H d); got q (2, 2, 4), k (2, 3, 4), "
                    "v (2, 3, 4)"),
    "ring blocks": ("ring", {"heads": 2, "width": 4, "blocks": CONTIGUOUS[:3]},
                    "ring_attention: blocks has 3 entries; it needs one per rank of the ring (comm.size=4)"),
    "ring n_heads": ("ring", {"heads": 2.0, "width": 4},
                     "ring_attention: n_heads=2.0 must be a positive whole number"),
}


def bad_run(comm) -> dict:
    """Every bad call on every rank: (error type and message, comm events recorded before it, the
    communicators' attributes used besides rank and size)."""
    group = SequenceGroup(comm, SequenceLayout(8, 2, 2), "hybrid")  # the 2 x 2 grid (split communicates)
    out = {}
    for name, (method, c) in ((n, (m, c)) for n, (m, c, _) in BAD.items()):
        comms = [Watched(x) for x in ((comm,) if method != "hybrid" else (group.ulysses, group.ring))]
        q, k, v = _qkv(c.get("rows", (2, 2, 2)), c["width"])
        with trace.recording(comm.world_rank) as rec:
            try:
                if method == "ulysses":
                    ulysses_attention(q, k, v, c["heads"], comms[0])
                elif method == "ring":
                    ring_attention(q, k, v, c["heads"], comms[0], c.get("blocks", CONTIGUOUS))
                else:
                    hybrid_attention(q, k, v, c["heads"], comms[0], comms[1], group.blocks)
                msg = "accepted"
            except Exception as exc:  # noqa: BLE001 - the test records what was raised, whatever it is
                msg = f"{type(exc).__name__}: {exc}"
        out[name] = (msg, sum(e.kind == "comm" for e in rec.events), [u for w in comms for u in w.used])
    return out


def check(results: list[dict], cases: dict[str, str]) -> None:
    """The same error on every rank, the expected line, raised before any message."""
    assert len(results) == P
    for got in results:
        assert got == results[0]
    for name, want in cases.items():
        assert results[0][name] == (f"ValueError: {want}", 0, []), name


def test_bad_attention_arguments_refused_on_every_rank_threads() -> None:
    check(launch(bad_run, P), {name: want for name, (_, _, want) in BAD.items()})


@pytest.mark.mpi
def test_bad_attention_arguments_refused_on_every_rank_mpiexec() -> None:
    check(run(bad_run, P, backend="mpi", timeout=60, comm_timeout=20), {name: w for name, (_, _, w) in BAD.items()})


OTHERS = {  # name: (call on a communicator, the whole message)
    "seq_to_heads width": (lambda c: seq_to_heads.apply(_qkv((2, 2, 2), 10)[0], c),
                           "seq_to_heads: w=10 of the activation (2, 2, 10) is not divisible by the 4 ranks of the "
                           "all-to-all"),
    "heads_to_seq rows": (lambda c: heads_to_seq.apply(_qkv((6, 6, 6), 2)[0], c),
                          "heads_to_seq: n=6 of the activation (2, 6, 2) is not divisible by the 4 ranks of the "
                          "all-to-all"),
    "heads_to_seq shape": (lambda c: heads_to_seq.apply(Tensor(np.zeros((8, 2))), c),
                           "heads_to_seq: the activation must be (b, n, w), got shape (8, 2)"),
    "group method": (lambda c: SequenceGroup(c, SequenceLayout(8, 1, 4), "tree"),
                     "SequenceGroup: method='tree'; choose one of 'ulysses', 'ring', 'hybrid'"),
    "group layout": (lambda c: SequenceGroup(c, SequenceLayout(8, 2, 2), "ring"),
                     "SequenceGroup: layout=SequenceLayout(seq_len=8, ulysses=2, ring=2, zigzag=False) is not a ring "
                     "layout of the communicator's 4 ranks; make it with check_sequence_config"),
    "layout rank": (lambda c: SequenceLayout(8, 1, 4).positions(4),
                    "SequenceLayout: rank=4 must be one of the 4 ranks of the layout (0..3)"),
}


def others_run(comm) -> dict:
    out = {}
    for name, (call, _) in OTHERS.items():
        watched = Watched(comm)
        with trace.recording(comm.world_rank) as rec:
            try:
                call(watched)
                msg = "accepted"
            except Exception as exc:  # noqa: BLE001 - the test records what was raised, whatever it is
                msg = f"{type(exc).__name__}: {exc}"
        out[name] = (msg, sum(e.kind == "comm" for e in rec.events), watched.used)
    return out


def test_bad_all_to_all_group_and_rank_refused_on_every_rank_threads() -> None:
    """The all-to-alls, ``SequenceGroup`` and ``SequenceLayout.positions`` refuse what they cannot
    split (numpy's reshape error, a hybrid group for an unknown method, an empty position list before)."""
    check(launch(others_run, P), {name: want for name, (_, want) in OTHERS.items()})


@pytest.mark.mpi
def test_bad_all_to_all_group_and_rank_refused_on_every_rank_mpiexec() -> None:
    check(run(others_run, P, backend="mpi", timeout=60, comm_timeout=20), {name: w for name, (_, w) in OTHERS.items()})


@pytest.mark.parametrize(("call", "want"), [
    (lambda: SequenceLayout(8, 1, 4).shard(np.zeros((2, 6)), 0),
     "SequenceLayout.shard: tokens of shape (2, 6) must be (batch, 8, ...): the whole sequence of seq_len=8 "
     "positions on axis 1"),
    (lambda: visibility((4, 2), (0, 2), True),
     "visibility: q_piece=(4, 2) must be positions (start, stop) with 0 <= start <= stop"),
    (lambda: OnlineSoftmax(2, 0, 4, 2, np.float64), "OnlineSoftmax: heads=0 must be a positive whole number"),
], ids=["shard", "visibility", "online softmax"])
def test_bad_layout_and_block_arguments_refused(call, want: str) -> None:
    """Pure functions of one rank: a short token array (silently cut before), a reversed piece (a
    block computed as hidden before), no heads (an empty buffer before)."""
    with pytest.raises(ValueError) as err:
        call()
    assert str(err.value) == want
