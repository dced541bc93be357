"""``minipar.cost.zero`` against numbers worked out by hand and against the paper.

- Model states per rank are the paper's Sec. 5 formulas (hand-worked for Psi = 1000, N = 4) and
  reproduce the printed Table 1 of Rajbhandari et al. 2020 (7.5B parameters, every N).
- On the flat padded layout (each bucket or unit padded to a multiple of N, rank r owning slice r),
  the exact bytes by component are hand-worked with padding visible ([10, 7] on N = 4) and equal the
  paper's formulas whenever nothing is padded (K = 12 mixed precision, 8 + 8 + 16 bytes in float64).
- Bytes sent per step: stages 1 and 2 move a DDP all-reduce's bytes, stage 3 / FSDP 3/2 of that,
  2/2 without ``reshard_after_forward``; hand-worked with padding and the root unit.
- Gathered units alive at once equal a walk through FSDP's forward and backward written here.
"""

from __future__ import annotations

from decimal import ROUND_HALF_UP, Decimal

import pytest
from hypothesis import given
from hypothesis import strategies as st
from strategies import budget

from minipar.cost import (
    fsdp_gathered_peak,
    hsdp_traffic_bytes,
    paper_table,
    zero_model_states,
    zero_state_bytes,
    zero_traffic_by_op,
    zero_traffic_bytes,
)
from minipar.cost.data import ddp_bytes
from minipar.cost.zero import paper_gb

FP64 = {"param_bytes": 8, "grad_bytes": 8, "optimizer_bytes": 16}  # AdamW's m and v, no master copy


def test_model_states_by_hand() -> None:
    # Psi = 1000, N = 4, K = 12: 16 Psi; 4 Psi + 12 Psi/4; 2 Psi + 14 Psi/4; 16 Psi/4
    assert [zero_model_states(1000, s, 4) for s in range(4)] == [16000, 7000, 5500, 4000]
    # float64: 8 + 8 + 16 bytes per parameter: 32 Psi; 16 Psi + 16 Psi/4; 8 Psi + 24 Psi/4; 32 Psi/4
    assert [zero_model_states(1000, s, 4, **FP64) for s in range(4)] == [32000, 20000, 14000, 8000]
    # N = 1: nothing to partition
    assert {zero_model_states(1000, s, 1) for s in range(4)} == {16000}
    with pytest.raises(ValueError, match=r"unknown ZeRO stage 4; choose one of 0 \(baseline\), 1 \(P_os\), 2 "):
        zero_model_states(1000, 4, 4)


# Rajbhandari et al. 2020, Table 1, the 7.5B model (GB per device), as printed: N, P_os, P_os+g, P_os+g+p
TABLE_1_7_5B = [("1", "120", "120", "120"), ("4", "52.5", "41.3", "30"), ("16", "35.6", "21.6", "7.5"),
                ("64", "31.4", "16.6", "1.88"), ("256", "30.4", "15.4", "0.47"), ("1024", "30.1", "15.1", "0.12")]


def as_printed(value: float, printed: str) -> str:
    """``value`` rounded half up to the decimals of ``printed`` (41.25 is printed 41.3)."""
    decimals = len(printed.split(".")[1]) if "." in printed else 0
    return str(Decimal(repr(value)).quantize(Decimal(1).scaleb(-decimals), rounding=ROUND_HALF_UP))


def test_paper_table_1() -> None:
    rows = paper_table(7_500_000_000, [int(r[0]) for r in TABLE_1_7_5B])
    for row, (n, *printed) in zip(rows, TABLE_1_7_5B, strict=True):
        assert row["dp"] == int(n) and row["baseline"] == 120.0  # (2 + 2 + 12) 7.5e9 B
        got = [as_printed(row[k], p) for k, p in zip(("P_os", "P_os+g", "P_os+g+p"), printed, strict=True)]
        assert got == printed, n
    # worked by hand (GB, exact): 128B on N = 4: 4 x 128 + 12 x 128/4, 2 x 128 + 14 x 128/4, 16 x 128/4;
    # 1T on N = 64: 4000 + 12000/64, 2000 + 14000/64, 16000/64
    for row, (_, *printed) in zip(rows, TABLE_1_7_5B, strict=True):  # as the paper prints them
        assert [paper_gb(row[k]) for k in ("baseline", "P_os", "P_os+g", "P_os+g+p")] == ["120", *printed]
    assert (paper_gb(41.25), paper_gb(1.875), paper_gb(0.5)) == ("41.3", "1.88", "0.5")
    (b128,) = paper_table(128_000_000_000, [4])
    assert (b128["baseline"], b128["P_os"], b128["P_os+g"], b128["P_os+g+p"]) == (2048, 896, 704, 512)
    (t1,) = paper_table(1_000_000_000_000, [64], k=12)
    assert (t1["P_os"], t1["P_os+g"], t1["P_os+g+p"]) == (4187.5, 2218.75, 250)


def test_state_bytes_with_padding_by_hand() -> None:
    # two groups of 10 and 7 elements on N = 4: padded to 12 and 8, a shard is 3 + 2 = 5 elements;
    # replicated components count the 17 real elements, partitioned ones the 5 of the shard; the
    # full parameters of stages 1 and 2 live in the padded flat buckets: 12 + 8 = 20 elements
    fp64 = [zero_state_bytes([10, 7], s, 4) for s in range(4)]
    assert fp64 == [{"parameters": 17 * 8, "gradients": 17 * 8, "optimizer state": 17 * 16},
                    {"parameters": 20 * 8, "gradients": 17 * 8, "optimizer state": 5 * 16},
                    {"parameters": 20 * 8, "gradients": 5 * 8, "optimizer state": 5 * 16},
                    {"parameters": 5 * 8, "gradients": 5 * 8, "optimizer state": 5 * 16}]
    assert zero_state_bytes([10, 7], 1, 4, precision="mixed") == \
        {"parameters": 20 * 2, "gradients": 17 * 2, "optimizer state": 5 * 8, "master parameters": 5 * 4}
    assert zero_state_bytes([10, 7], 3, 4, precision="mixed") == \
        {"parameters": 5 * 2, "gradients": 5 * 2, "optimizer state": 5 * 8, "master parameters": 5 * 4}
    # every rank's shard has the same length (the padding sits in the last rank's slices)
    assert all(zero_state_bytes([10, 7], 3, 4, rank=r) == fp64[3] for r in range(4))
    with pytest.raises(ValueError, match="precision='fp8'"):
        zero_state_bytes([10, 7], 3, 4, precision="fp8")
    with pytest.raises(ValueError, match="rank=4 is not one of the N=4 ranks"):
        zero_state_bytes([10, 7], 3, 4, rank=4)


@budget(30)
@given(dp=st.integers(1, 8), blocks=st.lists(st.integers(0, 50), min_size=1, max_size=6), stage=st.integers(0, 3))
def test_state_bytes_are_the_papers_formulas_without_padding(dp: int, blocks: list[int], stage: int) -> None:
    numels = [dp * b for b in blocks]  # multiples of N: no padding
    psi = sum(numels)
    assert sum(zero_state_bytes(numels, stage, dp, precision="mixed").values()) == zero_model_states(psi, stage, dp)
    assert sum(zero_state_bytes(numels, stage, dp).values()) == zero_model_states(psi, stage, dp, **FP64)


@budget(30)
@given(dp=st.integers(1, 8), numels=st.lists(st.integers(0, 50), min_size=1, max_size=6))
def test_padding_costs_at_most_n_minus_1_elements_per_group(dp: int, numels: list[int]) -> None:
    shard = zero_state_bytes(numels, 3, dp)["parameters"] // 8
    assert 0 <= shard * dp - sum(numels) <= (dp - 1) * len(numels)
    assert zero_state_bytes(numels, 0, dp)["parameters"] == 8 * sum(numels)


def test_traffic_by_hand() -> None:
    # [10, 7] on N = 4, float64: padded 12 and 8; a reduce-scatter or all-gather of one group sends
    # 3 of its 4 chunks: 3 x 3 + 3 x 2 = 15 elements for both groups
    assert zero_traffic_bytes([10, 7], 1, 4) == zero_traffic_bytes([10, 7], 2, 4) == 2 * 15 * 8
    assert zero_traffic_bytes([10, 7], 3, 4) == 3 * 15 * 8
    assert zero_traffic_bytes([10, 7], 3, 4, reshard_after_forward=False) == 2 * 15 * 8
    # the root unit (index 0, 12 elements padded) is gathered once: 2 x 9 + 3 x 6 elements
    assert zero_traffic_bytes([10, 7], 3, 4, root=0) == (2 * 9 + 3 * 6) * 8
    # by collective: each ring reduce-scatter and all-gather of a padded group sends 3 of its 4 chunks
    assert zero_traffic_by_op([10, 7], 1, 4) == {"allgather": 15 * 8, "reduce_scatter": 15 * 8}
    assert zero_traffic_by_op([10, 7], 3, 4) == {"allgather": 2 * 15 * 8, "reduce_scatter": 15 * 8}
    assert zero_traffic_by_op([10, 7], 0, 4) == {"allreduce": zero_traffic_bytes([10, 7], 0, 4)}
    # fp16 working parameters and gradients: 2 bytes each
    assert zero_traffic_bytes([10, 7], 3, 4, itemsize=2) == 3 * 15 * 2
    # stage 0 is DDP on the unpadded buckets: ring chunks of 10 are (3, 3, 2, 2), of 7 (2, 2, 2, 1);
    # rank r sends all chunks but r in the reduce-scatter and all but r + 1 in the all-gather
    assert zero_traffic_bytes([10, 7], 0, 4, rank=0) == ((20 - 3 - 3) + (14 - 2 - 2)) * 8
    assert zero_traffic_bytes([10, 7], 0, 4, rank=3) == ((20 - 2 - 3) + (14 - 1 - 2)) * 8
    assert all(zero_traffic_bytes([10, 7], s, 1) == 0 for s in range(4))  # one rank sends nothing
    with pytest.raises(ValueError, match="root=2 is not the index of a unit"):
        zero_traffic_bytes([10, 7], 3, 4, root=2)


@budget(30)
@given(dp=st.integers(1, 8), blocks=st.lists(st.integers(0, 40), min_size=1, max_size=6),
       itemsize=st.sampled_from([2, 8]), data=st.data())
def test_stage_3_sends_one_and_a_half_ddp_all_reduces(dp: int, blocks: list[int], itemsize: int,
                                                     data: st.DataObject) -> None:
    numels = [dp * b for b in blocks]  # no padding
    rank = data.draw(st.integers(0, dp - 1))
    ddp = ddp_bytes([(n, itemsize) for n in numels], dp, rank, "ring")
    assert ddp == 2 * (dp - 1) * sum(blocks) * itemsize  # 2 (N-1)/N Psi, by hand
    for stage in (0, 1, 2):
        assert zero_traffic_bytes(numels, stage, dp, itemsize, rank) == ddp
    assert 2 * zero_traffic_bytes(numels, 3, dp, itemsize, rank) == 3 * ddp
    assert zero_traffic_bytes(numels, 3, dp, itemsize, rank, reshard_after_forward=False) == ddp


def walk_fsdp(sizes: list[int], prefetch: bool, reshard: bool, root: int | None) -> int:
    """The most elements gathered at once, walking forward then backward: a unit is gathered for its
    compute, the neighbour that runs next is prefetched, a unit is freed after its forward (when
    ``reshard``) and after its backward's reduce-scatter. The root (the outermost module, whose
    forward encloses the others') is gathered when forward starts and freed when backward ends."""
    live: set[int] = set() if root is None else {root}
    peak = 0
    n = len(sizes)
    for i, nxt in [(i, i + 1) for i in range(n)] + [(i, i - 1) for i in reversed(range(n))]:
        live.add(i)
        if prefetch and 0 <= nxt < n:
            live.add(nxt)
        peak = max(peak, sum(sizes[j] for j in live))
        backward = nxt < i
        if i != root and (backward or reshard):
            live.discard(i)
    return peak


def test_gathered_peak_by_hand() -> None:
    # [10, 7, 5, 13] on N = 4: gathered units are padded, 12, 8, 8, 16 elements
    assert fsdp_gathered_peak([10, 7, 5, 13], 4) == (8 + 16) * 8  # the last pair
    assert fsdp_gathered_peak([10, 7, 5, 13], 4, prefetch=False) == 16 * 8
    assert fsdp_gathered_peak([10, 7, 5, 13], 4, reshard_after_forward=False) == (12 + 8 + 8 + 16) * 8
    assert fsdp_gathered_peak([10, 7, 5, 13], 4, root=3) == (12 + 8 + 16) * 8  # the first pair + the root
    assert fsdp_gathered_peak([10, 7, 5, 13], 4, itemsize=2, prefetch=False, root=0) == (12 + 16) * 2
    assert fsdp_gathered_peak([5], 2) == 6 * 8


@budget(30)
@given(dp=st.integers(1, 6), numels=st.lists(st.integers(0, 40), min_size=1, max_size=7), prefetch=st.booleans(),
       reshard=st.booleans(), data=st.data())
def test_gathered_peak_equals_a_walk_through_fsdp(dp: int, numels: list[int], prefetch: bool, reshard: bool,
                                                 data: st.DataObject) -> None:
    root = data.draw(st.none() | st.integers(0, len(numels) - 1))
    sizes = [-(-n // dp) * dp for n in numels]
    walked = 0 if dp == 1 else 8 * walk_fsdp(sizes, prefetch, reshard, root)  # one rank: nothing gathered
    assert fsdp_gathered_peak(numels, dp, 8, prefetch, reshard_after_forward=reshard, root=root) == walked


def test_hsdp_traffic_by_hand() -> None:
    # units of 12 and 8 elements, N = 4 ranks in shard groups of G = 2 (R = 2 replicas): inside a
    # group stage 3 sends 3 x (1/2) x 20 elements; the gradient shards (6 + 4) are all-reduced
    # across 2 replicas: 2 x (1/2) x 10 elements; 8 bytes each
    assert hsdp_traffic_bytes([12, 8], 2, 4) == (30 + 10) * 8
    # G = N is plain stage 3; G = 1 replicates everything: one all-reduce of the whole, DDP's
    assert hsdp_traffic_bytes([12, 8], 4, 4) == 3 * 3 * 5 * 8
    assert hsdp_traffic_bytes([12, 8], 1, 4) == 2 * 3 * 5 * 8
    with pytest.raises(ValueError, match="does not divide"):
        hsdp_traffic_bytes([12, 8], 3, 4)
