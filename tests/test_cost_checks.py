"""Every public formula of ``minipar.cost`` refuses a bad argument with one line naming it: the
function, the argument, its value and what is allowed (``minipar.checks``)."""

from __future__ import annotations

import re

import pytest

from minipar.cost import (
    collectives,
    data,
    hybrid,
    offload,
    overhead,
    perf,
    planner,
    presets,
    sharding,
    stages,
    tensor2d,
    tensor2p5d,
    tensor3d,
    zero,
)
from minipar.cost import pipeline as pipe_cost
from minipar.cost import sequence as seq_cost
from minipar.cost import tensor as tp_cost
from minipar.cost.layout import Layout, ModelSpec
from minipar.tiers import Bandwidth

GPT = ModelSpec(layers=2, hidden=8, heads=2, seq=4, vocab=16)
CLUSTER = presets.NETWORKS["local"]
TINY = hybrid.TinyLayout(vocab=16, seq=4, d=8, heads=2, layers=2, d_ff=16, batch=2, pp=2)


def test_megatron_softmax_needs_heads_divisible_by_t() -> None:
    """Megatron splits attention by heads: 2 heads on 4 ranks gave a softmax term of 0 (2 // 4)."""
    assert tp_cost.layer_terms(2, 1, 4, 8, 4, 16)["softmax"] == 1 * (4 // 2) * 4 * 4 * 8  # whole heads: kept
    with pytest.raises(ValueError) as err:
        tp_cost.layer_terms(4, 1, 4, 8, 2, 16)
    assert str(err.value) == ("layer_terms: n_heads=2 is not divisible by t=4 (Megatron gives each rank whole "
                              "heads); use a multiple of 4 heads")


def test_ulysses_bytes_needs_heads_divisible_by_p() -> None:
    """h = 12 splits over 4 ranks, 6 heads of 2 do not: Ulysses gives each rank whole heads."""
    assert seq_cost.ulysses_bytes(1, 8, 12, 4, n_heads=4) == 4 * 3 * 1 * 2 * 3 * 8
    for call in (lambda: seq_cost.ulysses_bytes(1, 8, 12, 4, n_heads=6),
                 lambda: seq_cost.attention_bytes("ulysses", 1, 8, 12, 4, n_heads=6)):
        with pytest.raises(ValueError) as err:
            call()
        assert str(err.value).endswith("n_heads=6 is not divisible by the Ulysses degree P_u=4 (each rank needs "
                                       "whole heads)")
    with pytest.raises(ValueError, match=r"^hybrid_bytes: n_heads=3 is not divisible by the Ulysses degree P_u=2"):
        seq_cost.hybrid_bytes(1, 8, 12, 2, 2, n_heads=3)


BAD = [  # (function, args, keywords, what the message must contain: the argument and its value)
    (seq_cost.ulysses_bytes, (1, 8, 8, 0), {}, "p=0"),
    (seq_cost.ulysses_bytes, (1, 10, 8, 4), {}, "s=10"),
    (seq_cost.ring_attention_bytes, (1, 8, 8, 4, 0), {}, "itemsize=0"),
    (seq_cost.hybrid_bytes, (1, 8, 6, 4, 2), {}, "h=6"),
    (seq_cost.attention_bytes, ("tree", 1, 8, 8, 4), {}, "method='tree'"),
    (seq_cost.attention_bytes, ("hybrid", 1, 8, 8, 4, 3), {}, "ulysses=3"),
    (seq_cost.megatron_sp_bytes, (1, 8, 8, -2), {}, "t=-2"),
    (seq_cost.score_bytes, ("ring", 1, 8, 4, 2.0), {}, "p=2.0"),
    (seq_cost.score_bytes, ("ring", 1, 12, 4, 4), {"zigzag": True}, "s=12"),
    (seq_cost.causal_blocks, (0, False), {}, "p=0"),
    (seq_cost.causal_score_elements, (6, 4, False), {}, "s=6"),
    (seq_cost.activation_terms, ("ring", 1, 8, 10, 4, 16, 2), {}, "h=10"),
    (seq_cost.activation_bytes, ("ulysses", 1, 8, 8, 2, 16, 4), {}, "n_heads=2"),
    (seq_cost.grad_sync_bytes, (-1, 4), {}, "numel=-1"),
    (seq_cost.step_bytes_by_op, ("ring", 1, 8, 8, 0, 4, 100), {}, "layers=0"),
    (seq_cost.longest_sequence, (len, 100, 0), {}, "multiple=0"),
    (tp_cost.collectives_per_block, (1,), {}, "sequence_parallel=1"),
    (tp_cost.sequence_parallel_params, (8, 0, 2), {}, "d=0"),
    (tp_cost.expected_bytes, (2, 1, 8, 8, True), {}, "n_layers=True"),
    (tp_cost.block_bytes, (0, 1, 8, 8), {}, "t=0"),
    (tp_cost.block_parameters, (4, 8, 6), {}, "d_ff=6"),
    (tp_cost.layer_terms, (2, 1, 4, 9, 3, 16), {}, "n_heads=3"),
    (tp_cost.layer_terms, (2, 1, 4, 10, 4, 16), {}, "d=10"),
    (tp_cost.activation_bytes, (2, 1, 4, 8, 4, 16, 2, 0), {}, "vocab=0"),
    (collectives.ring_bytes, ("broadcast", 8, 2), {}, "op='broadcast'"),
    (collectives.ring_bytes, ("allreduce", -8, 2), {}, "nbytes=-8"),
    (collectives.allreduce_bytes, (8, 8, 4, 4, "ring"), {}, "rank=4"),
    (collectives.allreduce_bytes, (8, 8, 0, 0, "ring"), {}, "p=0"),
    (collectives.tree_broadcast_bytes, (8, 4, 0, 5), {}, "root=5"),
    (collectives.collective_time, ("allreduce", "ring", 8, 4, -1e-6, 1e-9), {}, "alpha=-1e-06"),
    (data.ddp_bytes, ([(8, 8)], 2, 0, "tree"), {}, "algorithm='tree'"),
    (data.ddp_bytes, ([8], 2, 0, "ring"), {}, "buckets=[8]"),
    (data.ps_bytes, ([8, 8], 2, 1), {}, "world_size=2"),
    (data.ps_link_bytes, ([8, -8], 4, 1), {}, "shard_bytes=[8, -8]"),
    (pipe_cost.bubble_fraction, ("gpipe", 0, 4), {}, "p=0"),
    (pipe_cost.bubble_fraction, ("tree", 2, 4), {}, "kind='tree'"),
    (pipe_cost.bubble_time, ("1f1b", 4, -1.0, 1.0, 1.0), {}, "forward=-1.0"),
    (pipe_cost.peak_stash, ("1f1b", 4, 8, 4), {}, "rank=4"),
    (pipe_cost.chimera_peak_stash, (3, 0), {}, "p=3"),
    (pipe_cost.chimera_bubble_time, (4, 1.0, float("nan")), {}, "backward=nan"),
    (pipe_cost.chimera_bubble_fraction, (4, 0), {}, "m=0"),
    (pipe_cost.weight_versions, ("pipedream", 4, -1), {}, "rank=-1"),
    (pipe_cost.bubble_formula, ("tree",), {}, "kind='tree'"),
    (pipe_cost.stage_owner, (4, 0), {}, "v=0"),
    (pipe_cost.send_bytes, ([0, 1], 0, 8), {}, "m=0"),
    (zero.padded, (-1, 4), {}, "numel=-1"),
    (zero.zero_model_states, (100, 1, 4, 0), {}, "optimizer_bytes=0"),
    (zero.zero_traffic_bytes, ([8], 1, 2, 0), {}, "itemsize=0"),
    (zero.fsdp_gathered_peak, ([8], 2, 0), {}, "itemsize=0"),
    (zero.paper_table, (100, [4, -1]), {}, "dp_sizes=[4, -1]"),
    (zero.paper_gb, (0.0,), {}, "value=0"),
    (zero.hsdp_traffic_bytes, ([8], 8, 4), {}, "shard_group=8"),
    (offload.transfer_seconds, (-1, "cpu", "device", Bandwidth()), {}, "nbytes=-1"),
    (offload.zero_offload_bytes, (100,), {"dp": 0}, "dp=0"),
    (offload.zero_infinity_bytes, ([],), {}, "units=[]"),
    (offload.zero_infinity_bytes, ([8],), {"precision": "bf16"}, "precision='bf16'"),
    (offload.zero_infinity_device_need, ([8],), {"itemsize": 0}, "itemsize=0"),
    (offload.in_order_misses, (4, 0), {}, "fit=0"),
    (offload.chunk_offload_bytes, (8, -1), {}, "misses=-1"),
    (offload.chunk_dp_bytes, (8, 0, 1, 1), {}, "world=0"),
    (sharding.collective, ("S0", "B"), {}, "src='S0'"),
    (sharding.step_bytes, ("P", "B", 8, 8, 2, 2), {}, "coord=2"),
    (sharding.redistribute_bytes, ((4, 4), 8, [2], [0, 0], ["B", "B"], []), {}, "degrees=[2]"),
    (sharding.redistribute_bytes, ((4, 4), 8, [2], [0], ["B"], [(0, "P", "B")]), {}, "starts from P"),
    (stages.layer_costs, (GPT,), {"recompute": "half"}, "recompute='half'"),
    (stages.layer_costs, ((2, 8, 2, 4, 16),), {}, "model=(2, 8, 2, 4, 16)"),
    (stages.uneven_stage_blocks, (GPT, 0), {}, "stages=0"),
    (stages.partition_layers, ([1.0, -2.0], 1), {}, "cost=-2.0"),
    (tensor2d.tree_reduce_bytes, (8, 4, 4), {}, "rank=4"),
    (tensor2d.summa_bytes, (8, 8, 0), {}, "q=0"),
    (tensor2d.linear2d_bytes, (4, 4, 4, 2, 0, 2), {}, "col=2"),
    (tensor2d.linear2d_bytes, (4, 3, 4, 2, 0, 0), {}, "in_features=3"),
    (tensor2d.linear2d_parameters, (4, 4, -2), {}, "q=-2"),
    (tensor2d.layernorm2d_bytes, (4, 8, 2, 2, 0), {}, "row=2"),
    (tensor2d.block2d_bytes, (4, 8, 16, 2, 0, 0), {"itemsize": 0}, "itemsize=0"),
    (tensor2p5d.depth_bytes, ([8], 2, 2), {}, "k=2"),
    (tensor2p5d.linear_pieces, (0, 4, 2), {}, "in_features=0"),
    (tensor2p5d.block_pieces, (8, 16, 0), {}, "q=0"),
    (tensor2p5d.linear2p5d_bytes, (6, 4, 4, 2, 4, 0, 0, 0), {}, "batch_rows=6"),
    (tensor2p5d.layernorm2p5d_bytes, (8, 8, 2, 2, 0, 0, 2), {}, "depth=2"),
    (tensor2p5d.block2p5d_bytes, (8, 8, 16, 2, 0, 0, 0, 0), {}, "d=0"),
    (tensor2p5d.linear_closed_form, (8, 8, 2, 0), {}, "d=0"),
    (tensor2p5d.paper_bandwidth, (0, 2), {}, "q=0"),
    (tensor2p5d.block2p5d_parameters, (8, 0, 2), {}, "d_ff=0"),
    (tensor2p5d.activation_bytes, (81, 2, 2), {}, "whole=81"),
    (tensor3d.linear3d_bytes, (8, 8, 8, 0), {}, "q=0"),
    (tensor3d.linear3d_bytes, (6, 8, 8, 2), {}, "batch_rows=6"),
    (tensor3d.linear3d_total_bytes, (8, 8, 8, 2, 0), {}, "itemsize=0"),
    (tensor3d.linear3d_parameters, (8, -8, 2), {}, "out_features=-8"),
    (tensor3d.plane_bytes, (8, 0), {}, "q=0"),
    (tensor3d.layernorm3d_bytes, (8, 8, 2, 3), {}, "k=3"),
    (tensor3d.block3d_linears, (8, 0), {}, "d_ff=0"),
    (tensor3d.block3d_bytes, (8, 8, 16, 2, -1), {}, "k=-1"),
    (tensor3d.block3d_parameters, (0, 16, 2), {}, "d=0"),
    (tensor3d.block3d_activation_bytes, (1, 4, 8, 0, 16, 2), {}, "n_heads=0"),
    (overhead.block_ops, (False, "half"), {}, "recompute='half'"),
    (overhead.stage_ops, ([], False), {}, "blocks=[]"),
    (overhead.block_collectives, ("tp=2",), {}, "layout='tp=2'"),
    (overhead.stage_collectives, ([1, -1], Layout()), {}, "blocks=[1, -1]"),
    (overhead.parameter_tensors, (-1, True, True), {}, "blocks=-1"),
    (overhead.optimizer_seconds, (4, 8.0, None), {}, "cluster=None"),
    (perf.stage_blocks, (GPT, None), {}, "layout=None"),
    (perf.activation_bytes_per_layer, (None, Layout()), {}, "model=None"),
    (perf.memory_traffic_bytes, (GPT, {}), {}, "layout={}"),
    (perf.memory_bytes, ("gpt", Layout()), {}, "model='gpt'"),
    (perf.group_link, (CLUSTER, 0, 4), {}, "span=0"),
    (perf.comm_seconds, (GPT, Layout(), "local"), {}, "cluster='local'"),
    (perf.optimizer_step_seconds, (GPT, Layout(), None), {}, "cluster=None"),
    (perf.predict, (GPT, Layout(tp=3), CLUSTER), {}, "tp=3 does not divide heads=2"),
    (hybrid.parameters_per_rank, (TINY, 2), {}, "pp_rank=2"),
    (hybrid.traffic_by_axis, (TINY, -1), {}, "rank=-1"),
    (hybrid.model_state_bytes, ({}, 0), {}, "c={}"),
    (hybrid.activation_peak_bytes, (TINY, 2), {}, "rank=2"),
    (planner.layouts, (GPT, 0, CLUSTER, 8), {}, "gpus=0"),
    (planner.layouts, (GPT, 2, CLUSTER, 8), {"zero_stages": (4,)}, "zero_stages=4"),
    (planner.plan, (GPT, 2, CLUSTER, 8), {"top": 0}, "top=0"),
    (presets.narayanan_row, ("2T",), {}, "name='2T'"),
    (presets.calibrate_efficiency, (GPT, Layout(), CLUSTER, -1.0), {}, "tflops_per_gpu=-1.0"),
    (GPT.layer_flops, (0,), {}, "tokens=0"),
    (TINY.stages_of, (2,), {}, "pp_rank=2"),
    (TINY.coords, (2,), {}, "rank=2"),
    (GPT.head_flops, (2.5,), {}, "tokens=2.5"),
    (GPT.step_flops, (1, "half"), {}, "recompute='half'"),
]


@pytest.mark.parametrize(("fn", "args", "keywords", "names"), BAD,
                         ids=[f"{fn.__name__}-{names}" for fn, _, _, names in BAD])
def test_bad_argument_refused_in_one_line(fn, args, keywords, names: str) -> None:
    with pytest.raises(ValueError) as err:
        fn(*args, **keywords)
    msg = str(err.value)
    assert "\n" not in msg and names in msg, msg
    assert re.match(r"[A-Za-z_0-9.]+: ", msg), msg  # the function (it or the one it hands the argument to), then what
