"""What the planner prices beyond FLOPs and bytes (issue 30, item 5): the data-parallel reduction
overlapped with the backward, GEMM efficiency against the matmul's shape, the V-shaped zero-bubble
schedules. Expectations are worked out by hand here, never with perf's helpers."""

from __future__ import annotations

from dataclasses import replace

import pytest

from minipar.cost.cluster import Cluster, Link
from minipar.cost.perf import Layout, ModelSpec, predict

# 1 GFLOP/s per GPU, 4 per node, no latency, 50 MB/s, no reduction cost: compute and the reduction
# of a tiny model take comparable time
SLOW = Cluster(name="slow", gpus_per_node=4, peak_flops=2e9, efficiency=0.5, memory_bytes=1e9,
               intra=Link(alpha=0.0, beta=2e-8), inter=Link(alpha=0.0, beta=2e-8), gamma=0.0)
MODEL = ModelSpec(layers=2, hidden=32, heads=2, seq=8, vocab=40)


def test_overlapped_grad_reduce_by_hand() -> None:
    """dp = 4 in one node, m = 2 micro-batches of one sequence. A micro-batch's work: 2 layers of 3
    forwards of 8 (8 h^2 + 4 h f + 4 s h) FLOPs, and the logits 3 x 2 s h V; its first forward is a
    third of the layers' and the logits' work, the backward the rest. Ring collectives of n = 2 Psi
    bytes on 4 ranks: a reduce-scatter or all-gather u = 3/4 n beta, an all-reduce 2u. Overlapped,
    exposed = max(0, collective - the compute it hides behind)."""
    h, s, f, V = 32, 8, 128, 40
    psi = V * h + s * h + 2 * (12 * h * h + 13 * h) + 2 * h + h * V
    u = 3 / 4 * 2 * psi * 2e-8
    work = (2 * 3 * s * (8 * h * h + 4 * h * f + 4 * s * h) + 3 * 2 * s * h * V) / 1e9
    fwd, back = work / 3, 2 * work / 3
    m = 2
    want = {0: max(0, 2 * u - back), 1: max(0, u - back) + u, 2: m * max(0, u - back) + u,
            3: m * (max(0, u - fwd) + max(0, 2 * u - back))}
    plain = {0: 2 * u, 1: 2 * u, 2: (m + 1) * u, 3: m * 3 * u}
    assert 0 < back < 2 * u and u < back  # the case has both hidden and exposed parts
    for z in range(4):
        lay = Layout(dp=4, zero=z, global_batch=8)
        off, on = predict(MODEL, lay, SLOW), predict(MODEL, replace(lay, overlap_grad_reduce=True), SLOW)
        assert off.comm_seconds["dp"] == pytest.approx(plain[z], rel=1e-9), z
        assert on.comm_seconds["dp"] == pytest.approx(want[z], rel=1e-9), z
        assert on.compute_seconds == pytest.approx(m * work, rel=1e-9)
        assert off.step_seconds - on.step_seconds == pytest.approx(plain[z] - want[z], rel=1e-9)


def test_overlap_must_be_a_bool() -> None:
    assert Layout(overlap_grad_reduce="yes").check(MODEL) == [  # type: ignore[arg-type]
        "overlap_grad_reduce='yes': choose True or False"]


def test_the_planner_overlaps_every_layout() -> None:
    from minipar.cost.planner import layouts

    found = layouts(MODEL, 4, SLOW, global_batch=8)
    assert found and all(lay.overlap_grad_reduce for lay in found)


def test_wave_quantization_by_hand() -> None:
    """NVIDIA's guide, Sec. 3.2: 256 x 128 tiles in waves of 108 SMs on an A100."""
    from minipar.cost.gemm import wave_efficiency

    assert wave_efficiency(1, 2048, 2304, 108) == pytest.approx(144 / 216)  # 8 x 18 tiles: 2 waves
    assert wave_efficiency(1, 4096, 2304, 108) == pytest.approx(288 / 324)  # 3 waves
    assert wave_efficiency(2, 2048, 2304, 108) == pytest.approx(288 / 324)  # a batch of two: the same tiles
    assert wave_efficiency(1, 300, 100, 108) == pytest.approx(300 * 100 / (108 * 256 * 128))  # 2 tiles, 1 wave


def test_measured_curve_is_log_linear_and_flat_beyond_its_ends() -> None:
    from minipar.cost.gemm import curve_efficiency

    curve = ((16.0, 0.2), (64.0, 0.6), (256.0, 1.0))
    assert curve_efficiency(32, 32, 32, curve) == pytest.approx(0.4)  # halfway between 16 and 64 in log
    assert curve_efficiency(2, 4, 8, curve) == pytest.approx(0.2)
    assert curve_efficiency(1024, 512, 4096, curve) == pytest.approx(1.0)
    assert curve_efficiency(64, 128, 256, curve) == pytest.approx(0.8)  # side 128: halfway from 64 to 256


def test_block_gemms_add_up_to_the_layer_flops() -> None:
    from minipar.cost.gemm import block_gemms

    model = ModelSpec(layers=2, hidden=256, heads=8, seq=64, vocab=512, ffn=768)
    for t, u, b in [(1, 1, 1), (2, 1, 3), (4, 2, 2), (1, 4, 1)]:
        lay = Layout(tp=t, sp=u, micro_batch=b, global_batch=b)
        flops = sum(2 * n * m * k * c for n, m, k, c in block_gemms(model, lay))
        assert flops == pytest.approx(model.layer_flops(b * 64) / (t * u), rel=1e-12)


def test_step_compute_with_quantized_tiles_by_hand() -> None:
    """One SM (every tile its own wave): a GEMM's share is m n / (tiles x 256 x 128). h = s = V = 128,
    f = 256, one head, one sequence: every output of every forward and backward GEMM is 128 x 128,
    128 x 256 or 128 x 384, half of its tiles' area, except the second MLP matmul's weight gradient,
    256 x 128: one whole tile."""
    h, s, f, V = 128, 128, 256, 128
    model = ModelSpec(layers=1, hidden=h, heads=1, seq=s, vocab=V, ffn=f)
    one_sm = replace(SLOW, gemm_sms=1, intra=Link(0.0, 0.0), inter=Link(0.0, 0.0))
    rate = 1e9
    layer = s * (8 * h * h + 4 * h * f + 4 * s * h)  # forward FLOPs
    fc2 = 2 * s * f * h
    block = (3 * layer - fc2) / (rate * 0.5) + fc2 / rate
    head = 3 * 2 * s * h * V / (rate * 0.5)
    p = predict(model, Layout(micro_batch=1, global_batch=2), one_sm)
    assert p.compute_seconds == pytest.approx(2 * (block + head), rel=1e-12)
    flat = predict(model, Layout(micro_batch=1, global_batch=2), replace(one_sm, gemm_sms=0))
    assert flat.compute_seconds == pytest.approx(2 * (3 * layer + 3 * 2 * s * h * V) / rate, rel=1e-12)


def test_a_larger_micro_batch_is_faster_per_flop_on_an_a100() -> None:
    """Narayanan et al.'s 18B layout (t = 8, d = 32, no pipeline): with every matmul at one efficiency
    the micro-batch changes nothing; with the A100's waves, b = 1's q k v output (2048 x 2304: 144
    tiles, 2 waves of 108) uses 2/3 of its tiles and b = 8's (16384 x 2304: 1152 tiles, 11 waves)
    97%: the larger micro-batch is faster."""
    from minipar.cost.presets import CLUSTERS, narayanan_row

    model, row, _ = narayanan_row("18B")
    a100 = CLUSTERS["a100-selene"]
    step = {b: predict(model, replace(row, micro_batch=b), a100).step_seconds for b in (1, 2, 4, 8)}
    assert step[8] < step[4] < step[1] and step[2] < step[1]
    flat = {b: predict(model, replace(row, micro_batch=b), replace(a100, gemm_sms=0)).compute_seconds
            for b in (1, 8)}
    assert flat[1] == pytest.approx(flat[8], rel=1e-12)


def test_cluster_files_carry_the_gemm_model(tmp_path) -> None:
    import json

    path = tmp_path / "c.json"
    curved = replace(SLOW, gemm_curve=((16.0, 0.25), (384.0, 1.0)))
    curved.save(str(path))
    assert Cluster.load(str(path)) == curved
    data = json.loads(path.read_text())
    for key in ("gemm_sms", "gemm_curve"):
        del data[key]
    assert Cluster.from_dict(data) == SLOW  # a file from before: flat
    with pytest.raises(ValueError, match=r"gemm_curve must be \[\[side, relative rate\], \.\.\.\] with sides "
                                         r"increasing"):
        Cluster.from_dict({**data, "gemm_curve": [[64, 1.0], [16, 0.5]]})
    with pytest.raises(ValueError, match="gemm_sms must be a whole number >= 0, got -1"):
        Cluster.from_dict({**data, "gemm_sms": -1})


def test_v_shaped_schedules_by_hand() -> None:
    """ZB-V and DualPipeV on p = 2 ranks, 8 layers (2 per virtual stage), m = 4 micro-batches, no
    communication cost: rank 0 holds stages 0 and 3, so the embedding and the head; its work per
    micro-batch is 4 blocks and the logits; idle (p-1)/(6m) of it (Qi et al. 2024, Sec. 6, F = I =
    W); it stashes 2p = 4 chunk-micro-batches of 2 layers (ZB-V), 2p + 1 = 5 (DualPipeV)."""
    h, s, V = 32, 8, 40
    model = ModelSpec(layers=8, hidden=h, heads=2, seq=s, vocab=V)
    free = replace(SLOW, intra=Link(0.0, 0.0), inter=Link(0.0, 0.0), memory_bytes=1e12)
    block = 3 * s * (8 * h * h + 4 * h * 4 * h + 4 * s * h)
    work = (4 * block + 3 * 2 * s * h * V) / 1e9
    per_layer = s * h * (34 + 5 * 2 * s / h)
    psi = 4 * (12 * h * h + 13 * h) + (V * h + s * h) + (2 * h + h * V)  # 4 blocks, embedding, head
    for kind, stash in (("zb-v", 4), ("dualpipev", 5)):
        lay = Layout(pp=2, chunks=2, schedule=kind, global_batch=4)
        assert lay.check(model) == [] and lay.kind == kind
        p = predict(model, lay, free)
        assert p.compute_seconds == pytest.approx(4 * work, rel=1e-12)
        assert p.bubble_seconds == pytest.approx(4 * work * 1 / (6 * 4), rel=1e-12)
        assert p.memory["activations"] == pytest.approx(stash * 2 * per_layer, rel=1e-12)
        assert p.memory["parameters"] == pytest.approx(2 * psi, rel=1e-12)


def test_v_shaped_schedules_are_refused_where_they_cannot_run() -> None:
    model = ModelSpec(layers=8, hidden=32, heads=2, seq=8, vocab=40)
    assert Layout(pp=2, chunks=1, schedule="zb-v", global_batch=4).check(model) == [
        "zb-v places two chunks per rank in a V: chunks must be 2, got 1"]
    assert Layout(pp=2, chunks=2, schedule="dualpipev", global_batch=3).check(model) == [
        "dualpipev's bubble formula needs microbatches >= 4, got 3"]
    assert Layout(pp=2, chunks=2, schedule="zb-v", global_batch=4).check(replace(model, layers=6))[0].startswith(
        "layers=6 is not divisible by pp x chunks=4")


def test_the_planner_tries_the_v_shapes() -> None:
    from minipar.cost.planner import layouts, plan

    model = ModelSpec(layers=8, hidden=64, heads=4, seq=16, vocab=64)
    found = layouts(model, 4, SLOW, global_batch=16)
    v = [lay for lay in found if lay.schedule in ("zb-v", "dualpipev")]
    assert {(lay.pp, lay.chunks) for lay in v} == {(2, 2), (4, 2)}  # 2p divides 8 layers
    assert all(lay.microbatches >= 2 * lay.pp - (lay.schedule == "zb-v") for lay in v)
    ranked = plan(model, 4, SLOW, global_batch=16, top=10_000, zero_stages=(0, 1))
    order = [c.layout for c in ranked]
    for lay in v:  # DualPipeV ties ZB-V's step with one more chunk stashed: right after it
        if lay.schedule == "dualpipev" and replace(lay, schedule="zb-v") in order:
            assert order.index(replace(lay, schedule="zb-v")) < order.index(lay)
