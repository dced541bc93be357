"""minipar.cost.planner: stage slicing by dynamic programming (against brute force), the layout
search (against an independent enumeration), the no-fit shortfall (by hand), GPT-3 175B on 3072
A100s against the 6 x 8 x 64 grid, and ``minipar plan``."""

from __future__ import annotations

import itertools
import random
from dataclasses import replace

import pytest

from minipar.cli import main
from minipar.cost.cluster import Cluster, Link
from minipar.cost.perf import Layout, ModelSpec, predict
from minipar.cost.planner import NoFit, layouts, plan
from minipar.cost.presets import CLUSTERS, MODELS, narayanan_row
from minipar.cost.stages import layer_costs, partition_layers

SELENE = CLUSTERS["a100-selene"]
TOY = Cluster(name="toy", gpus_per_node=4, peak_flops=1e12, efficiency=0.5, memory_bytes=2e8,
              intra=Link(alpha=1e-6, beta=1e-10), inter=Link(alpha=1e-5, beta=1e-9), gamma=1e-11)


def _brute_force(costs: list[float], stages: int) -> float:
    """The smallest slowest stage over every way to cut ``costs`` into ``stages`` non-empty pieces."""
    n, best = len(costs), float("inf")
    for cuts in itertools.combinations(range(1, n), stages - 1):
        bounds = (0, *cuts, n)
        best = min(best, max(sum(costs[a:b]) for a, b in zip(bounds, bounds[1:])))
    return best


def test_partition_layers_matches_brute_force() -> None:
    rng = random.Random(7)
    for _ in range(200):
        n = rng.randint(1, 9)
        stages = rng.randint(1, n)
        costs = [float(rng.randint(0, 20)) for _ in range(n)]
        counts = partition_layers(costs, stages)
        assert len(counts) == stages and sum(counts) == n and min(counts) >= 1
        bounds = list(itertools.accumulate([0, *counts]))
        slowest = max(sum(costs[a:b]) for a, b in zip(bounds, bounds[1:]))
        assert slowest == _brute_force(costs, stages), (costs, stages, counts)
    assert partition_layers([5, 1, 1, 1, 1, 5], 3) == [1, 4, 1]
    with pytest.raises(ValueError, match="3 layers into 4"):
        partition_layers([1, 2, 3], 4)


def test_layer_costs_and_an_embedding_heavy_split() -> None:
    model = ModelSpec(layers=4, hidden=8, heads=2, seq=4, vocab=1000)
    s, h, V = 4, 8, 1000
    block = 3 * s * (24 * h * h + 4 * s * h)
    head = 3 * 2 * s * h * V
    assert layer_costs(model) == [2 * s * h, block, block, block, block, head]
    assert head > 6 * block  # a big vocabulary: the head alone is the slowest stage
    assert partition_layers(layer_costs(model), 3) == [3, 2, 1]  # 2 blocks per stage before the head


def _independent_search(model: ModelSpec, gpus: int, cluster: Cluster, batch: int) -> float:
    """The fastest fitting step by trying every degree tuple, option and schedule the planner tries
    (1F1B, ZB-H1, ZB-V, DualPipeV), letting predict refuse."""
    best = float("inf")
    for tp, sp, pp in itertools.product(range(1, gpus + 1), repeat=3):
        if gpus % (tp * sp * pp) or tp > cluster.gpus_per_node:
            continue
        for v, b, z, r, seqp, k in itertools.product(range(1, model.layers + 1), (1, 2, 4, 8, 16), (0, 1, 2, 3),
                                                     ("none", "selective", "full"), (False, True),
                                                     ("1f1b", "zb-h1", "zb-v", "dualpipev")):
            if z >= 2 and pp > 1:  # DeepSpeed refuses ZeRO-2/3 with pipelining
                continue
            lay = Layout(dp=gpus // (tp * sp * pp), tp=tp, pp=pp, sp=sp, zero=z, micro_batch=b, global_batch=batch,
                         chunks=v, recompute=r, sequence_parallel=seqp, schedule=k, overlap_grad_reduce=True)
            try:
                p = predict(model, lay, cluster, uneven_stages=True)
            except ValueError:
                continue
            if p.fits:
                best = min(best, p.step_seconds)
    return best


def test_plan_finds_the_fastest_fitting_layout() -> None:
    model = ModelSpec(layers=4, hidden=256, heads=8, seq=256, vocab=4096)
    result = plan(model, 8, TOY, global_batch=16, top=4)
    steps = [c.prediction.step_seconds for c in result]
    assert steps == sorted(steps) and len(result) == 4
    for c in result:
        lay = c.layout
        assert lay.world == 8 and lay.tp <= 4 and c.prediction.fits and lay.check(model) == []
    assert steps[0] == pytest.approx(_independent_search(model, 8, TOY, 16), rel=1e-12)
    assert all(" the next (" in c.why() for c in result)  # the last against the first not shown


def test_nothing_fits_names_the_shortfall() -> None:
    # one GPU: the least memory is full recomputation with micro-batch 1 (ZeRO does nothing on one
    # GPU): 16 bytes per parameter + 2 s b h bytes per layer + one layer's working set while its
    # backward runs, s b h (34 + 5 a s / h) (selective would keep 34 s b h per layer: 68 > 4 + 44)
    model = ModelSpec(layers=2, hidden=512, heads=8, seq=128, vocab=1000)
    psi = 1000 * 512 + 128 * 512 + 2 * (12 * 512 * 512 + 13 * 512) + 2 * 512 + 512 * 1000
    sbh = 128 * 512
    need = 16 * psi + 2 * 2 * sbh + sbh * (34 + 5 * 8 * 128 / 512)
    small = Cluster(name="small", gpus_per_node=1, peak_flops=1e12, efficiency=0.5, memory_bytes=1e6,
                    intra=TOY.intra, inter=TOY.inter, gamma=0.0)
    with pytest.raises(NoFit) as err:
        plan(model, 1, small, global_batch=4)
    assert err.value.shortfall == pytest.approx(need - 1e6)
    assert f"{(need - 1e6) / 2**30:.1f} GiB" in str(err.value)
    assert isinstance(err.value, ValueError)


def test_gpt3_175b_on_3072_gpus_against_the_6_8_64_grid() -> None:
    """The 6 x 8 x 64 grid is Narayanan et al.'s 1T layout (128 layers on 64 stages); GPT-3 has 96
    layers, which Megatron cannot split evenly over 64 stages: half the stages get 2 blocks."""
    model = MODELS["gpt3-175b"]
    grid = Layout(dp=6, tp=8, pp=64, micro_batch=1, global_batch=1536, recompute="full")
    assert any("96 is not divisible by pp x chunks=64" in q for q in grid.check(model))
    uneven = predict(model, grid, SELENE, uneven_stages=True)
    assert uneven.fits
    best = plan(model, 3072, SELENE, global_batch=1536, top=3)
    assert best[0].prediction.step_seconds <= uneven.step_seconds
    assert best[0].layout.world == 3072 and best[0].layout.tp <= 8 and best[0].prediction.fits
    # the grid's bubble: (p-1)/m of its busy time, m = 1536 / 6 = 256 micro-batches
    assert uneven.bubble_seconds == pytest.approx(uneven.compute_seconds * 63 / 256)


def test_cli_plan(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--model", "narayanan-18b", "--gpus", "256", "--preset", "a100-selene", "--top", "2",
                 "--global-batch", "1024"]) == 0
    out = capsys.readouterr().out
    assert "TFLOP/s" in out and "dp" in out and "faster than the next" in out
    assert main(["plan", "--model", "gpt3-175b", "--gpus", "8", "--preset", "a100-selene"]) == 1
    assert "GiB" in capsys.readouterr().err
    assert main(["plan", "--model", "nope", "--gpus", "8"]) == 2
    assert "no model preset 'nope'" in capsys.readouterr().err
    assert main(["plan", "--model", "narayanan-1.7b", "--gpus", "32", "--global-batch", "512", "--top", "3",
                 "--zero", "2"]) == 0
    out = capsys.readouterr().out
    assert "DeepSpeed refuses ZeRO-2/3 with pipelining" in out and "zero2" in out and "zero1" not in out
    assert main(["plan", "--model", "narayanan-1.7b", "--gpus", "32", "--zero", "4"]) == 2
    assert "invalid choice: 4" in capsys.readouterr().err


def test_cli_plan_cluster_file(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "c.json"
    SELENE.save(str(path))
    assert main(["plan", "--model", "narayanan-1.7b", "--gpus", "32", "--cluster", str(path), "--top", "1",
                 "--global-batch", "512"]) == 0
    assert "a100-selene" in capsys.readouterr().out
    path.write_text('{"name": "x"}')
    assert main(["plan", "--model", "narayanan-1.7b", "--gpus", "32", "--cluster", str(path)]) == 2
    assert "missing fields" in capsys.readouterr().err


def test_a_model_that_fits_only_with_zero_3() -> None:
    """One layer, one head: tp, sp and pp are all 1, so 4 GPUs are dp = 4 and only ZeRO shrinks the
    model states: 16 Psi (ZeRO-0), 2 + 2 + 12/4 = 7 Psi (1), 2 + 14/4 = 5.5 Psi (2), 16/4 = 4 Psi (3)."""
    h, s, V = 256, 8, 64
    model = ModelSpec(layers=1, hidden=h, heads=1, seq=s, vocab=V)
    psi = V * h + s * h + 12 * h * h + 13 * h + 2 * h + h * V
    assert psi == 825_088
    small = Cluster(name="small", gpus_per_node=4, peak_flops=1e12, efficiency=0.5, memory_bytes=4e6,
                    intra=TOY.intra, inter=TOY.inter, gamma=0.0)
    # the least: ZeRO-2 and selective recomputation, 34 s b h; full keeps 2 s b h and one layer's
    # working set s b h (34 + 5 a s / h) while the backward runs, more on one layer
    with pytest.raises(NoFit) as err:
        plan(model, 4, small, global_batch=4, zero_stages=(0, 1, 2))
    assert err.value.shortfall == pytest.approx(5.5 * psi + 34 * s * h - 4e6)
    assert str(err.value).endswith("; ZeRO 3 not tried (zero_stages, --zero)")
    best = plan(model, 4, small, global_batch=4)
    assert {(c.layout.dp, c.layout.zero) for c in best} == {(4, 3)}
    # the step is the exposed ZeRO-3 collectives': m (2 ag + rs) whatever the compute they hide, so the
    # three recomputation modes tie and the least memory goes first: selective 34 s b h, none
    # s b h (34 + 5 a s / h), full 2 s b h and one layer's working set on top
    assert [c.layout.recompute for c in best[:3]] == ["selective", "none", "full"]
    assert best[0].prediction.step_seconds == pytest.approx(best[2].prediction.step_seconds, rel=1e-12)
    assert best[1].prediction.memory["total"] == pytest.approx(4 * psi + s * h * (34 + 5 * s / h))
    assert "ZeRO-3 with pp = 1 (DeepSpeed refuses ZeRO-2/3 with pipelining)" in best[0].why()


def test_zero_2_and_3_are_not_paired_with_pipelining() -> None:
    model = ModelSpec(layers=4, hidden=64, heads=4, seq=16, vocab=64)
    found = layouts(model, 8, TOY, global_batch=16)
    assert {lay.zero for lay in found if lay.pp == 1} == {0, 1, 2, 3}
    assert {lay.zero for lay in found if lay.pp > 1} == {0, 1}
    assert {lay.micro_batch for lay in found if lay.dp == 8} == {1, 2}  # dp x b divides the batch, 16
    assert {lay.micro_batch for lay in found if lay.dp == 1} == {1, 2, 4, 8, 16}


def test_table_1_small_rows_micro_batch_16_is_enumerated() -> None:
    model, row, _ = narayanan_row("1.7B")
    found = layouts(model, 32, CLUSTERS["a100-selene"], global_batch=512)
    assert row.micro_batch == 16 and replace(row, overlap_grad_reduce=True) in found


def test_plan_tries_uneven_stages() -> None:
    """3 blocks on 2 stages: [embedding, block | block, block, head] leaves its slowest stage at 2
    blocks plus the head, [embedding, block, block | block, head] at 2 blocks plus the embedding (2 s h
    FLOPs, less than the head's 6 s h V): the DP cuts 2 blocks + 1 block."""
    h, s, V = 16, 8, 32
    model = ModelSpec(layers=3, hidden=h, heads=1, seq=s, vocab=V)
    assert partition_layers(layer_costs(model), 2) == [3, 2]
    ranked = plan(model, 2, TOY, global_batch=4, top=10_000)
    uneven = [c for c in ranked if c.layout.pp == 2]
    assert uneven and all(c.label().endswith(" uneven") for c in uneven)
    c = next(c for c in uneven if (c.layout.micro_batch, c.layout.zero, c.layout.recompute, c.layout.schedule)
             == (1, 0, "none", "1f1b"))
    # stage 0: embedding + 2 blocks, 1F1B holds min(p, m) = 2 micro-batches of its 2 blocks
    emb, block, per_layer = V * h + s * h, 12 * h * h + 13 * h, s * h * (34 + 5 * s / h)
    assert c.prediction.memory["total"] == pytest.approx(16 * (emb + 2 * block) + 2 * 2 * per_layer)
    assert "uneven stages (blocks per stage 2,1)" in c.why()


def test_zero_bubble_wins_a_deep_pipeline_with_few_micro_batches() -> None:
    """16 layers on 8 GPUs that hold little: ZB-H1's bubble (p-1)/(3m+p-1) beats 1F1B's (p-1)/(m+p-1)
    at the same layout, and the planner ranks a zero-bubble layout first."""
    model = ModelSpec(layers=16, hidden=256, heads=4, seq=64, vocab=256)
    small = replace(TOY, memory_bytes=3e7)  # ZeRO-3 on dp 2 x tp 4, its gathers overlapped, wins with 2e8
    best = plan(model, 8, small, global_batch=8, top=3)[0]
    assert best.layout.schedule == "zb-h1" and best.layout.pp > 1 and " zb-h1 " in best.label()
    same = predict(model, best.layout, small, uneven_stages=True)
    one_f1b = predict(model, replace(best.layout, schedule="1f1b"), small, uneven_stages=True)
    assert same.step_seconds == best.prediction.step_seconds < one_f1b.step_seconds
    p, m = best.layout.pp, best.layout.microbatches
    assert same.bubble_seconds == pytest.approx(same.compute_seconds * (p - 1) / (3 * m))
    assert one_f1b.bubble_seconds == pytest.approx(one_f1b.compute_seconds * (p - 1) / m)
    with_h2 = plan(model, 8, small, global_batch=8, top=10_000, schedules=("1f1b", "zb-h1", "zb-h2"))
    h2 = [c for c in with_h2 if c.layout.schedule == "zb-h2"]
    assert h2 and with_h2[0].layout.schedule == "zb-h1"  # equal bubble, 2p - 1 stashed: never ahead
    found = layouts(model, 8, TOY, global_batch=8)
    assert {lay.schedule for lay in found if lay.pp == 1} == {"1f1b"}
    assert {lay.schedule for lay in found if lay.chunks > 1} == {"1f1b", "zb-v", "dualpipev"}  # V: chunks 2
    assert all(lay.microbatches >= lay.pp for lay in found if lay.schedule == "zb-h1")


def test_no_layout_splits_heads_and_hidden_must_divide() -> None:
    model = ModelSpec(layers=4, hidden=96, heads=6, seq=16, vocab=64)
    found = layouts(model, 8, TOY, global_batch=16)
    assert found and {lay.tp for lay in found} == {1, 2}  # 4 does not divide 6 heads
    assert all(model.heads % (lay.tp * lay.sp) == 0 for lay in found)
    with pytest.raises(ValueError, match=r"^hidden=100 is not divisible by heads=7: .*choose heads dividing 100$"):
        plan(ModelSpec(layers=4, hidden=100, heads=7, seq=16, vocab=64), 8, TOY, global_batch=16)
