"""minipar.cost.perf: the step-time, throughput and memory model of a hybrid layout. Expected values
are worked out by hand here (or are published numbers), never with perf's own helpers."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from minipar.cost.cluster import Cluster, Link
from minipar.cost.perf import Layout, ModelSpec, predict
from minipar.cost.presets import (
    CLUSTERS,
    MODELS,
    NARAYANAN_TABLE_1,
    SELENE_EFFICIENCY,
    calibrate_efficiency,
    narayanan_row,
)

SELENE = CLUSTERS["a100-selene"]
# a cluster with round numbers, for hand-computed times: 1 TFLOP/s, 8 GPUs per node
TOY = Cluster(name="toy", gpus_per_node=8, peak_flops=2e12, efficiency=0.5, memory_bytes=1e9,
              intra=Link(alpha=1e-6, beta=1e-10), inter=Link(alpha=1e-5, beta=1e-9), gamma=0.0)


def test_parameters_match_nn_gpt_and_the_closed_form() -> None:
    from minipar.nn import GPT

    spec = ModelSpec(layers=2, hidden=4, heads=2, seq=3, vocab=5)
    # V h + s h + l (12 h^2 + 13 h) + 2 h + h V = 20 + 12 + 2 (192 + 52) + 8 + 20
    assert spec.parameters == 548
    gpt = GPT(vocab_size=5, seq_len=3, d_model=4, n_heads=2, n_layers=2)
    assert spec.parameters == sum(p.data.size for p in gpt.parameters())
    wide = ModelSpec(layers=3, hidden=8, heads=2, seq=5, vocab=7, ffn=24)
    gpt = GPT(vocab_size=7, seq_len=5, d_model=8, n_heads=2, n_layers=3, d_ff=24)
    assert wide.parameters == sum(p.data.size for p in gpt.parameters())
    # GPT-3 175B: 12 l h^2 (1 + 13/(12h) + (V + s)/(12 l h)) + 2h (Narayanan et al. Eq. 2, plus the
    # untied head h V and the final layer norm, which Eq. 2 leaves out)
    l, h, v, s = 96, 12288, 51200, 2048
    assert MODELS["gpt3-175b"].parameters == 12 * l * h * h + 13 * l * h + v * h + s * h + 2 * h + h * v


def test_flops_are_narayanan_eq_3() -> None:
    model, B = MODELS["gpt3-175b"], 1536
    s, l, h, V = 2048, 96, 12288, 51200
    assert model.step_flops(B, "full") == pytest.approx(96 * B * s * l * h**2 * (1 + s / (6 * h) + V / (16 * l * h)),
                                                        rel=1e-12)
    assert model.step_flops(B, "none") == pytest.approx(72 * B * s * l * h**2 * (1 + s / (6 * h) + V / (12 * l * h)),
                                                        rel=1e-12)
    # Korthikanti et al. 2022, selective recomputation: 72 B s l h^2 (1 + 2s/(9h) + V/(12 l h))
    assert model.step_flops(B, "selective") == pytest.approx(
        72 * B * s * l * h**2 * (1 + 2 * s / (9 * h) + V / (12 * l * h)), rel=1e-12)


def _table() -> tuple[list[tuple[str, float, float]], float]:
    eff = calibrate_efficiency(*narayanan_row("1.7B")[:2], SELENE, 137)
    cluster = replace(SELENE, efficiency=eff)
    rows = []
    for row in NARAYANAN_TABLE_1:
        model, layout, published = narayanan_row(row[0])
        rows.append((row[0], published, predict(model, layout, cluster).tflops_per_gpu))
    return rows, eff


def test_narayanan_table_1_within_15_percent_with_one_efficiency() -> None:
    """Narayanan et al. 2021, Table 1 (weak scaling, 1.7B to 1T on 32 to 3072 A100s): one efficiency
    for every row, measured on the smallest row (1.7B: 137 TFLOP/s per GPU)."""
    rows, eff = _table()
    table = "\n".join(f"{n:>5}: published {p:5.0f}  predicted {q:6.1f}  {q / p - 1:+.1%}" for n, p, q in rows)
    assert eff == pytest.approx(SELENE_EFFICIENCY, abs=1e-4), table
    assert all(abs(q / p - 1) <= 0.15 for _, p, q in rows), f"efficiency {eff:.4f}\n{table}"
    assert [r[1] for r in rows] == [137, 138, 142, 135, 138, 140, 148, 155, 163, 163]  # the paper's column


def test_narayanan_layouts_are_the_published_ones() -> None:
    """GPUs = t p d; d b m = batch; 530B: 105 layers on 35 stages with v = 3 (1 layer per virtual stage)."""
    model, layout, _ = narayanan_row("530B")
    assert (layout.world, layout.dp, layout.microbatches, model.layers // (layout.pp * layout.chunks)) == \
        (2520, 9, 280, 1)
    model, layout, _ = narayanan_row("1T")
    assert (layout.world, layout.dp, layout.microbatches) == (3072, 6, 512)
    assert model.parameters == pytest.approx(1008e9, rel=0.005)  # the table's 1008 billion


def test_zero_1_model_states_by_hand() -> None:
    model = ModelSpec(layers=4, hidden=64, heads=4, seq=32, vocab=100)
    psi = 100 * 64 + 32 * 64 + 4 * (12 * 64 * 64 + 13 * 64) + 2 * 64 + 64 * 100
    expected = {0: (2, 2, 12), 1: (2, 2, 12 / 4), 2: (2, 2 / 4, 12 / 4), 3: (2 / 4, 2 / 4, 12 / 4)}
    for zero, (p_, g_, o_) in expected.items():
        mem = predict(model, Layout(dp=4, zero=zero, global_batch=4), TOY).memory
        assert mem["parameters"] == pytest.approx(p_ * psi)
        assert mem["gradients"] == pytest.approx(g_ * psi)
        assert mem["optimizer"] == pytest.approx(o_ * psi)
    # float64 AdamW: 8 + 8 + 16 bytes per parameter, nothing partitioned at stage 0
    mem = predict(replace(model, bytes_per_number=8), Layout(global_batch=1), TOY).memory
    assert mem["parameters"] + mem["gradients"] + mem["optimizer"] == pytest.approx(32 * psi)


def test_activations_follow_korthikanti() -> None:
    s, b, h, a, L = 2048, 2, 1024, 16, 8
    model = ModelSpec(layers=L, hidden=h, heads=a, seq=s, vocab=512)
    sbh = s * b * h

    def act(**kw: object) -> float:
        return predict(model, Layout(micro_batch=b, global_batch=b * kw.pop("dp", 1), **kw), TOY).memory["activations"]

    assert act() == pytest.approx(L * sbh * (34 + 5 * a * s / h))
    assert act(tp=4) == pytest.approx(L * sbh * (10 + 24 / 4 + 5 * a * s / (h * 4)))
    assert act(tp=4, sequence_parallel=True) == pytest.approx(L * sbh * (34 / 4 + 5 * a * s / (h * 4)))
    assert act(tp=4, sequence_parallel=True, recompute="selective") == pytest.approx(L * sbh * 34 / 4)
    # full: the block inputs 2 s b h per layer, plus one layer's whole working set while its backward
    # runs (Chen et al. 2016, Sec. 3): s b h (34 + 5 a s / h) once
    assert act(recompute="full") == pytest.approx(L * 2 * sbh + sbh * (34 + 5 * a * s / h))
    assert act(tp=4, sequence_parallel=True, recompute="full") == pytest.approx(
        L * 2 * sbh / 4 + sbh * (34 / 4 + 5 * a * s / (h * 4)))
    assert act(sp=4) == pytest.approx(L * sbh * (34 + 5 * a * s / h) / 4)
    # 1F1B, p = 4, m = 8: the first stage holds 4 micro-batches of L/4 layers: L layers' worth
    one = L * sbh * (34 + 5 * a * s / h)
    mem = predict(model, Layout(pp=4, micro_batch=b, global_batch=8 * b), TOY).memory["activations"]
    assert mem == pytest.approx(one)
    # interleaved, v = 2: (1 + (p-1)/(p v)) = 1 + 3/8 times that (Korthikanti et al. Sec. 4.2.3)
    mem = predict(model, Layout(pp=4, chunks=2, micro_batch=b, global_batch=8 * b), TOY).memory["activations"]
    assert mem == pytest.approx(one * (1 + 3 / 8))


def test_perf_activations_are_cost_tensor_terms_with_dropout() -> None:
    """One home for the activation terms: perf's per-layer bytes equal ``cost.tensor.layer_terms``
    with dropout's four terms (1-byte masks), and without them equal minipar's own model (no
    dropout): the paper's count less ``as^2 b + 2 as^2 b`` (the softmax's mask and dropped output)
    and the two ``sbh`` masks, for w = 2 as the paper and w = 8 as minipar's float64 GPT."""
    from minipar.cost.perf import activation_bytes_per_layer
    from minipar.cost.tensor import layer_terms

    s, b, h, a, f = 256, 2, 128, 8, 512
    for w in (2, 8):
        model = ModelSpec(layers=4, hidden=h, heads=a, seq=s, vocab=512, ffn=f, bytes_per_number=w)
        for t, sp, mode in [(1, False, "none"), (4, False, "none"), (4, True, "none"), (2, True, "selective"),
                            (2, False, "full"), (4, True, "full")]:
            lay = Layout(tp=t, sequence_parallel=sp, micro_batch=b, global_batch=b, recompute=mode)
            # by hand: words of w bytes, then 1-byte masks (softmax mask a s^2 b / t, two s b h masks)
            shard = s * b * h // (t if sp else 1)
            if mode == "full":
                want = shard * w
            else:
                soft = 0 if mode == "selective" else b * a // t * s * s
                words = 4 * shard + 4 * s * b * h // t + 2 * s * b * f // t + 2 * soft  # + softmax, its dropout
                want = words * w + soft + 2 * shard
            assert activation_bytes_per_layer(model, lay) == want, (w, t, sp, mode)
            bare = sum(layer_terms(t, b, s, h, a, f, w, sp, mode).values())
            soft = 0 if mode != "none" else b * a // t * s * s
            drop = 0 if mode == "full" else soft * (1 + w) + 2 * shard
            assert bare == want - drop, (w, t, sp, mode)


def test_step_time_by_hand_tp_and_pipeline() -> None:
    """tp = 2 and pp = 2 inside one node (neighbouring stages 2 ranks apart), m = 4, gamma = 0."""
    model = ModelSpec(layers=4, hidden=256, heads=4, seq=128, vocab=1000)
    layout = Layout(tp=2, pp=2, micro_batch=1, global_batch=4)
    p = predict(model, layout, TOY)
    s, h, V, b = 128, 256, 1000, 1
    layer_fwd = s * b * (24 * h * h + 4 * s * h)
    stage = 2 * 3 * layer_fwd + 3 * 2 * s * b * h * V  # 2 layers, and the logits on the last stage
    assert p.compute_seconds == pytest.approx(4 * stage / 2 / 1e12)  # gamma = 0: no memory-bound term
    assert p.bubble_seconds == pytest.approx(p.compute_seconds * (2 - 1) / 4)
    A = s * b * h * 2
    allreduce = 2 * 1 * 1e-6 + 2 * 1 / 2 * A * 1e-10  # ring on 2 ranks, intra link
    assert p.comm_seconds["tp"] == pytest.approx(4 * 2 * 4 * allreduce)  # m x layers per stage x 4 all-reduces
    send = 1e-6 + A / 2 * 1e-10  # stages 2 ranks apart: intra; s b h / t (scatter/gather)
    assert p.comm_seconds["pp"] == pytest.approx(2 * (4 + 2 - 1) * send)
    assert p.comm_seconds["dp"] == 0 and p.comm_seconds["sp"] == 0
    assert p.step_seconds == pytest.approx(p.compute_seconds + p.bubble_seconds + sum(p.comm_seconds.values()))
    assert p.tflops_per_gpu == pytest.approx(model.step_flops(4) / p.step_seconds / 4 / 1e12)
    assert "compute" in p.explain() and "GiB" in p.explain()


def test_dp_allreduce_across_nodes() -> None:
    model = ModelSpec(layers=2, hidden=64, heads=2, seq=16, vocab=50)
    p = predict(model, Layout(dp=16, global_batch=16), TOY)  # 16 ranks: 2 nodes, the network link
    n = 2 * model.parameters
    assert p.comm_seconds["dp"] == pytest.approx(2 * 15 * 1e-5 + 2 * 15 / 16 * n * 1e-9)


def test_bad_layouts_list_every_problem() -> None:
    model = ModelSpec(layers=6, hidden=96, heads=6, seq=100, vocab=1001, ffn=382)
    layout = Layout(dp=3, tp=4, pp=4, sp=3, micro_batch=2, global_batch=10)
    problems = layout.check(model)
    text = "\n".join(problems)
    for needle in ("heads=6", "ffn=382", "vocab=1001", "seq=100", "layers=6", "global_batch=10"):
        assert needle in text, text
    with pytest.raises(ValueError) as err:
        predict(model, layout, TOY)
    assert all(p in str(err.value) for p in problems)
    assert Layout(tp=1, sequence_parallel=True).check(model) == [
        "sequence_parallel (Megatron-SP) needs tp > 1: set tp or turn it off"]
    assert "divisible by pp=2" in " ".join(Layout(pp=2, chunks=3, global_batch=3).check(model))


def test_cluster_file_with_missing_fields_is_refused(tmp_path) -> None:
    data = json.loads(SELENE.to_json())
    del data["gamma"], data["inter"]
    path = tmp_path / "cluster.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"missing fields \['gamma', 'inter'\]"):
        Cluster.load(str(path))
    path.write_text(SELENE.to_json())
    assert Cluster.load(str(path)) == SELENE


def test_memory_bound_term_by_hand() -> None:
    """4 moves of every byte Korthikanti et al. count (5 with full recomputation), gamma / 3 each."""
    s, b, h, a, L = 256, 2, 128, 4, 3
    model = ModelSpec(layers=L, hidden=h, heads=a, seq=s, vocab=64)
    cluster = replace(TOY, gamma=3e-12)  # 1e-12 s per byte moved
    kept = s * b * h * (34 + 5 * a * s / h)
    for recompute, moves, forwards in (("none", 4, 3), ("full", 5, 4)):
        p = predict(model, Layout(micro_batch=b, global_batch=2 * b, recompute=recompute), cluster)
        assert p.memory_bound_seconds == pytest.approx(2 * L * moves * kept * 1e-12)
        matmuls = 2 * (L * forwards * s * b * (24 * h * h + 4 * s * h) + 3 * 2 * s * b * h * 64) / 1e12
        assert p.compute_seconds == pytest.approx(matmuls + p.memory_bound_seconds)


def test_zero_stage_traffic_by_hand() -> None:
    """Per step, N = 4 ranks inside a node, m = 2 micro-batches, no latency, no reduction cost:
    ZeRO-0/1 one all-reduce 2 (N-1)/N n; ZeRO-2 a reduce-scatter per micro-batch and one all-gather;
    ZeRO-3 two all-gathers and a reduce-scatter per micro-batch: (N-1)/N n each."""
    cluster = replace(TOY, intra=Link(alpha=0.0, beta=1e-9), gamma=0.0)
    model = ModelSpec(layers=2, hidden=32, heads=2, seq=8, vocab=40)
    n = 2 * model.parameters
    dp = {z: predict(model, Layout(dp=4, zero=z, global_batch=8), cluster).comm_seconds["dp"] for z in range(4)}
    unit = 3 / 4 * n * 1e-9
    assert dp[0] == dp[1] == pytest.approx(2 * unit)
    assert dp[2] == pytest.approx((2 + 1) * unit)
    assert dp[3] == pytest.approx(2 * 3 * unit)


def test_tp_with_megatron_sp_and_ulysses_seconds_by_hand() -> None:
    s, b, h, L = 64, 1, 32, 2
    model = ModelSpec(layers=L, hidden=h, heads=4, seq=s, vocab=40)
    cluster = replace(TOY, gamma=0.0)  # intra: alpha 1e-6, beta 1e-10
    A = s * b * h * 2
    one = 1e-6 + 1 / 2 * A * 1e-10  # a ring all-gather or reduce-scatter on t = 2
    # Korthikanti et al. 2022 Sec. 4.2.2: forward 2 all-gathers + 2 reduce-scatters, backward the same
    # (the 2 re-gathers of the column-parallel inputs overlap the input-gradient GEMM): 8 per layer,
    # the volume of 4 all-reduces of A
    p = predict(model, Layout(tp=2, sequence_parallel=True, global_batch=1), cluster)
    assert p.comm_seconds["tp"] == pytest.approx(L * 8 * one)
    allreduce = 2 * 1e-6 + 2 * 1 / 2 * A * 1e-10
    assert p.comm_seconds["tp"] - L * 4 * allreduce == pytest.approx(0.0, abs=1e-18)
    # full recomputation runs the forward's 2 + 2 again: 12 per layer
    p = predict(model, Layout(tp=2, sequence_parallel=True, global_batch=1, recompute="full"), cluster)
    assert p.comm_seconds["tp"] == pytest.approx(L * 12 * one)
    # Ulysses on u = 2: 4 all-to-alls of the (b, s/2, h) shard forward, 4 backward; pairwise, 1 step
    shard = s // 2 * b * h * 2
    p = predict(model, Layout(sp=2, global_batch=1), cluster)
    assert p.comm_seconds["sp"] == pytest.approx(L * 8 * (1e-6 + shard / 2 * 1e-10))
    p = predict(model, Layout(sp=2, global_batch=1, recompute="full"), cluster)
    assert p.comm_seconds["sp"] == pytest.approx(L * 12 * (1e-6 + shard / 2 * 1e-10))


def test_megatron_sp_needs_seq_divisible_by_tp() -> None:
    """HybridGPT splits the sequence over tp under Megatron-SP: seq 1026 on tp 4 is refused."""
    model = ModelSpec(layers=2, hidden=64, heads=4, seq=1026, vocab=128)
    assert Layout(tp=4, sequence_parallel=True).check(model) == [
        "sequence_parallel (Megatron-SP) splits the sequence over tp: tp=4 does not divide seq=1026; choose tp "
        "dividing the sequence length or turn it off"]
    assert Layout(tp=4).check(model) == []
    assert Layout(tp=2, sequence_parallel=True).check(model) == []  # 1026 = 2 x 513


def test_a_world_inside_one_node_uses_nvlink_for_every_axis() -> None:
    """World 6 (tp 3 x pp 2) on an 8-GPU node: 3 does not divide 8, but every rank is in node 0."""
    from minipar.cost.perf import group_link

    assert group_link(TOY, 3, 6) == TOY.intra and group_link(TOY, 6, 6) == TOY.intra
    assert group_link(TOY, 3, 12) == TOY.inter  # ranks 6-8 straddle two nodes
    assert group_link(TOY, 4, 16) == TOY.intra and group_link(TOY, 16, 16) == TOY.inter
    model = ModelSpec(layers=2, hidden=48, heads=3, seq=16, vocab=30)
    p = predict(model, Layout(tp=3, pp=2, global_batch=4), replace(TOY, gamma=0.0))
    A = 16 * 1 * 48 * 2
    send = 1e-6 + A / 3 * 1e-10  # s b h w / t on the intra link
    assert p.comm_seconds["pp"] == pytest.approx(2 * (4 + 2 - 1) * send)
    allreduce = 2 * 2 * 1e-6 + 2 * 2 / 3 * A * 1e-10  # ring on 3 ranks, intra
    assert p.comm_seconds["tp"] == pytest.approx(4 * 1 * 4 * allreduce)  # m x 1 block per stage x 4


def test_uneven_stages_memory_and_compute_follow_the_partition() -> None:
    """5 blocks on 2 stages with a head 12 times a block's FLOPs: the DP puts the embedding and all 5
    blocks on stage 0 and the head alone on stage 1 (any other cut leaves the head plus a block
    last). Stage 0 then holds 5 blocks' parameters and 2 micro-batches of 5 blocks (not ceil(5/2) = 3)."""
    s, h, a = 8, 16, 2
    V = 144 * h + 24 * s  # 2 h V = 12 (24 h^2 + 4 s h): the head is 12 blocks
    model = ModelSpec(layers=5, hidden=h, heads=a, seq=s, vocab=V)
    block_fwd, head_fwd = s * (24 * h * h + 4 * s * h), 2 * s * h * V
    assert head_fwd == 12 * block_fwd
    p = predict(model, Layout(pp=2, global_batch=2), TOY, uneven_stages=True)
    emb, block = V * h + s * h, 12 * h * h + 13 * h
    per_layer = s * h * (34 + 5 * a * s / h)  # b = 1
    assert p.memory["activations"] == pytest.approx(2 * 5 * per_layer)
    assert p.memory["parameters"] == pytest.approx(2 * (emb + 5 * block))
    assert p.memory["total"] == pytest.approx(16 * (emb + 5 * block) + 2 * 5 * per_layer)
    assert p.compute_seconds == pytest.approx(2 * 3 * head_fwd / 1e12)  # m = 2, the head's stage, gamma = 0
    assert p.memory_bound_seconds == 0.0
    # tp = 2: the stage with the most blocks (5) sets the tp communication: m x 5 x 4 all-reduces
    p = predict(model, Layout(tp=2, pp=2, global_batch=2), TOY, uneven_stages=True)
    A = s * h * 2
    assert p.comm_seconds["tp"] == pytest.approx(2 * 5 * 4 * (2 * 1e-6 + A * 1e-10))


def test_selene_a100_holds_80_gib() -> None:
    assert SELENE.memory_bytes == 81920 * 2**20 == 85_899_345_920  # nvidia-smi: 81920MiB


def test_cpu_overheads_by_hand() -> None:
    """pp = 2, tp = 2, m = 2 on a cluster whose FLOPs, bytes and links cost nothing: only the CPU
    overheads remain. Per micro-batch stage 0 runs 2 blocks of 15 autograd ops and the embedding's 4,
    9 all-reduces (4 per block, the embedding's g) of 2 ring steps each; stage 1 2 x 15 ops and the
    head's and loss's 4, 12 all-reduces (4 per block, the head's f, the loss's 3). Stage 1 is slower;
    1F1B stretches it by (p-1)/m; 2 (m + p - 1) transfers pay a call and a step; then AdamW."""
    c, k, o, ts, og = 1e-4, 2e-4, 5e-5, 1e-5, 1e-10
    cluster = replace(TOY, peak_flops=1e30, gamma=0.0, intra=Link(0.0, 0.0), inter=Link(0.0, 0.0), op_seconds=c,
                      call_seconds=k, message_seconds=o, tensor_seconds=ts, optimizer_gamma=og)
    h, f, s, V = 32, 64, 16, 32
    model = ModelSpec(layers=4, hidden=h, heads=4, seq=s, vocab=V, ffn=f, bytes_per_number=8)
    p = predict(model, Layout(pp=2, tp=2, micro_batch=2, global_batch=4), cluster)
    stage0, stage1 = 34 * c + 9 * k + 18 * o, 34 * c + 12 * k + 24 * o
    assert stage1 > stage0
    assert p.compute_seconds == pytest.approx(2 * stage1) and p.overhead_seconds == pytest.approx(2 * stage1)
    assert p.bubble_seconds == pytest.approx(2 * stage1 * (2 - 1) / 2)
    assert p.comm_seconds["tp"] == 0.0 and p.comm_seconds["pp"] == pytest.approx(2 * (2 + 2 - 1) * (k + o))
    block = 4 * h * h + 4 * h + 2 * h * f + f + h + 4 * h  # attention, MLP, two layer norms
    first, last = 2 * block + V * h + s * h, 2 * block + 2 * h + h * V
    # 16 tensors a block; token and position tables; ln_f's 2 and the head; 8 + 8 + 16 bytes a parameter over t
    optimizer = max(34 * ts + 32 * first / 2 * og, 35 * ts + 32 * last / 2 * og)
    assert p.optimizer_seconds == pytest.approx(optimizer)
    assert p.step_seconds == pytest.approx(3 * stage1 + 6 * (k + o) + optimizer)
    assert "CPU overhead" in p.explain() and "optimizer" in p.explain()


def test_cpu_overheads_of_ulysses_and_recomputation_by_hand() -> None:
    """One stage, u = 2: a block is 16 ops and 8 all-to-alls of 1 step, the embedding 3 ops and the head
    4; full recomputation adds half of each block's ops and its 4 forward all-to-alls again."""
    c, k, o = 1e-4, 2e-4, 5e-5
    cluster = replace(TOY, peak_flops=1e30, gamma=0.0, intra=Link(0.0, 0.0), inter=Link(0.0, 0.0), op_seconds=c,
                      call_seconds=k, message_seconds=o)
    model = ModelSpec(layers=4, hidden=32, heads=4, seq=16, vocab=32, bytes_per_number=8)
    p = predict(model, Layout(sp=2, global_batch=1), cluster)
    assert p.compute_seconds == pytest.approx((4 * 16 + 3 + 4) * c + 4 * 8 * (k + o))
    p = predict(model, Layout(sp=2, global_batch=1, recompute="full"), cluster)
    assert p.compute_seconds == pytest.approx((4 * 24 + 3 + 4) * c + 4 * 12 * (k + o))
    assert p.optimizer_seconds == 0.0  # no optimizer costs on this cluster


def test_published_clusters_have_no_cpu_overheads() -> None:
    """At GPU scale kernels dominate: every preset's overheads are 0, so its predictions are the
    papers' formulas alone (the Table 1 test above holds them to the paper)."""
    for cluster in CLUSTERS.values():
        assert (cluster.op_seconds, cluster.call_seconds, cluster.message_seconds, cluster.tensor_seconds,
                cluster.optimizer_gamma) == (0.0,) * 5
    model, layout, _ = narayanan_row("145B")
    p = predict(model, layout, SELENE)
    assert p.overhead_seconds == 0.0 and p.optimizer_seconds == 0.0
