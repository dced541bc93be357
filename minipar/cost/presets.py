"""Published models, layouts and clusters the cost model is held against, each with its source.

- ``MODELS``: GPT-3 175B (Brown et al. 2020, Table 2.1: 96 layers, d_model 12288, 96 heads, context
  2048; vocabulary 51200 as Megatron-LM pads GPT-2's 50257 to a multiple of 128 x t) and the ten
  models of Narayanan et al. 2021 ("Efficient Large-Scale Language Model Training on GPU Clusters
  Using Megatron-LM", SC21), Table 1.
- ``NARAYANAN_TABLE_1``: that table's rows (heads, hidden, layers, t, p, GPUs, batch, achieved
  TFLOP/s per GPU, % of peak), as printed in the paper and transcribed in NVIDIA/Megatron-LM's
  README; the micro-batch sizes and interleaving (layers per virtual stage) the paper does not
  print are those of ``examples/sc21/run_table_1.sh`` in NVIDIA/Megatron-LM (the script that
  reproduces the table: full recomputation, "--recompute-method uniform", on every row).
- ``calibrate_efficiency``: the efficiency at which ``perf.predict`` matches a published row.
- ``CLUSTERS``: ``a100-selene``, NVIDIA Selene's DGX A100 nodes as Narayanan et al. 2021 Sec. 5
  describe them (8 x 80 GB A100 per node, NVLink/NVSwitch inside, 8 x 200 Gb/s HDR InfiniBand per
  node).
- ``NETWORKS``: what ``minipar.replay`` replays a trace on: ``local`` (this machine with one core per
  rank, measured), ``nvlink`` (every rank in one NVLink node), ``infiniband`` (every rank its own
  node), ``a100-selene``. A replay keeps each span's measured CPU time and takes the links and
  ``gamma`` (per byte a collective reduces) from these.
"""

from __future__ import annotations

from dataclasses import replace

from minipar.checks import number
from minipar.cost.cluster import Cluster, Link
from minipar.cost.layout import check_specs
from minipar.cost.perf import Layout, ModelSpec, predict

NARAYANAN = "Narayanan et al. 2021, SC21, Table 1"
MEGATRON_VOCAB = 51200  # GPT-2's 50257 padded (Narayanan et al. 2021, Sec. 5: "vocabulary size of 51,200")

# (name, heads, hidden, layers, t, p, GPUs, batch, micro-batch, chunks v, TFLOP/s per GPU, % of peak)
NARAYANAN_TABLE_1 = (
    ("1.7B", 24, 2304, 24, 1, 1, 32, 512, 16, 1, 137, 44),
    ("3.6B", 32, 3072, 30, 2, 1, 64, 512, 16, 1, 138, 44),
    ("7.5B", 32, 4096, 36, 4, 1, 128, 512, 16, 1, 142, 46),
    ("18B", 48, 6144, 40, 8, 1, 256, 1024, 8, 1, 135, 43),
    ("39B", 64, 8192, 48, 8, 2, 512, 1536, 4, 1, 138, 44),
    ("76B", 80, 10240, 60, 8, 4, 1024, 1792, 2, 3, 140, 45),  # 5 layers per virtual stage: 15/5
    ("145B", 96, 12288, 80, 8, 8, 1536, 2304, 2, 2, 148, 47),  # 10/5
    ("310B", 128, 16384, 96, 8, 16, 1920, 2160, 1, 2, 155, 50),  # 6/3
    ("530B", 128, 20480, 105, 8, 35, 2520, 2520, 1, 3, 163, 52),  # 3/1
    ("1T", 160, 25600, 128, 8, 64, 3072, 3072, 1, 1, 163, 52),
)


def narayanan_row(name: str) -> tuple[ModelSpec, Layout, float]:
    """The model, the layout and the published TFLOP/s per GPU of one row of Table 1."""
    for row in NARAYANAN_TABLE_1:
        if row[0] == name:
            _, a, h, l, t, p, gpus, batch, b, v, tflops, _ = row
            model = ModelSpec(layers=l, hidden=h, heads=a, seq=2048, vocab=MEGATRON_VOCAB, name=f"GPT {name}")
            layout = Layout(dp=gpus // (t * p), tp=t, pp=p, micro_batch=b, global_batch=batch, chunks=v,
                            recompute="full")
            return model, layout, float(tflops)
    raise ValueError(f"narayanan_row: name={name!r} is no row of {NARAYANAN}; rows: "
                     f"{[r[0] for r in NARAYANAN_TABLE_1]}")


MODELS: dict[str, ModelSpec] = {
    "gpt3-175b": ModelSpec(layers=96, hidden=12288, heads=96, seq=2048, vocab=MEGATRON_VOCAB,
                           name="GPT-3 175B (Brown et al. 2020, Table 2.1)"),
    **{f"narayanan-{row[0].lower()}": narayanan_row(row[0])[0] for row in NARAYANAN_TABLE_1},
}

# The efficiency: the fraction of the bf16 peak Megatron-LM's step sustains in its large matmuls,
# measured on Table 1's smallest row (1.7B on 32 GPUs, 137 TFLOP/s per GPU = 44% of peak) with this
# model's communication and its GEMMs' tile and wave quantization (cost.gemm, A100_SMS) for that row
# taken out: calibrate_efficiency(*narayanan_row("1.7B")[:2], cluster, 137) with this cluster gives
# 0.6358 (tests/test_cost_perf.py checks it; 0.5933 before the quantization was modelled).
SELENE_EFFICIENCY = 0.6358
# Streaming multiprocessors of an A100: GEMM tiles run in waves of 108 (NVIDIA, "Matrix Multiplication
# Background User's Guide", DU-09799-001, Sec. 3.2: "an NVIDIA A100 GPU has 108 SMs", one 256 x 128 tile each)
A100_SMS = 108

# An "80 GB" A100 holds 80 GiB: nvidia-smi reports its memory total as 81920 MiB, not 80e9 bytes (74.5
# GiB). What PyTorch can allocate is a little less (the CUDA context and the driver keep some): the
# planner's "fits" is an upper bound.
A100_80GB_BYTES = 80 * 2**30

CLUSTERS: dict[str, Cluster] = {
    "a100-selene": Cluster(
        name="a100-selene", gpus_per_node=8, peak_flops=312e12, efficiency=SELENE_EFFICIENCY,
        memory_bytes=A100_80GB_BYTES, gemm_sms=A100_SMS,
        intra=Link(alpha=5.7e-6, beta=1 / 300e9), inter=Link(alpha=6.6e-6, beta=1 / 25e9),
        gamma=1.5e-12,
        source=("Narayanan et al. 2021 Sec. 5 (Selene: DGX A100, 8 x 80 GB A100 per node, NVLink/NVSwitch, "
                "8 x 200 Gb/s HDR InfiniBand per node); NVIDIA A100 datasheet (312 TFLOP/s bf16 dense, 80 GB, "
                "80 GiB = 81920 MiB as nvidia-smi reports it; NVLink 600 GB/s both directions: 300 GB/s each way; "
                "HBM2e 2039 GB/s, gamma = 3 bytes moved "
                "per byte reduced / 2039 GB/s); inter beta: one 200 Gb/s HDR port per GPU = 25 GB/s; alpha: "
                "NCCL's ring/Simple per-step latencies (src/graph/tuning.cc hwLat: NVLink 5.7 us, network "
                "6.6 us); efficiency calibrated on Table 1's 1.7B row (presets.SELENE_EFFICIENCY); GEMM tiles "
                "in waves of 108 SMs (NVIDIA Matrix Multiplication Background guide, Sec. 3.2; minipar.cost.gemm)"),
    ),
}


def calibrate_efficiency(model: ModelSpec, layout: Layout, cluster: Cluster, tflops_per_gpu: float) -> float:
    """The ``cluster.efficiency`` at which ``predict`` gives ``tflops_per_gpu`` (TFLOP/s, e.g. a
    published row) for ``model`` under ``layout``: bisection, the throughput rising with it."""
    check_specs("calibrate_efficiency", model=model, layout=layout, cluster=cluster)
    if number("calibrate_efficiency", "tflops_per_gpu", tflops_per_gpu) == 0:
        raise ValueError("calibrate_efficiency: tflops_per_gpu=0 must be a positive throughput")
    lo, hi = 1e-6, 1.0
    if predict(model, layout, replace(cluster, efficiency=hi)).tflops_per_gpu < tflops_per_gpu:
        raise ValueError(f"{tflops_per_gpu} TFLOP/s per GPU is above what the model predicts at the full peak")
    for _ in range(80):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if predict(model, layout, replace(cluster, efficiency=mid)).tflops_per_gpu < \
            tflops_per_gpu else (lo, mid)
    return (lo + hi) / 2


ONE_NODE = 1 << 20  # gpus_per_node of a network that puts every rank in one node
_SELENE = CLUSTERS["a100-selene"]
NETWORKS: dict[str, Cluster] = {
    "local": Cluster(
        name="local", gpus_per_node=ONE_NODE, peak_flops=63.4e9, efficiency=0.83, memory_bytes=12638031872.0,
        intra=Link(13.4e-6, 1 / 11.2e9), inter=Link(13.4e-6, 1 / 11.2e9), gamma=1 / 20.0e9,
        source="this machine with one core per rank: minipar calibrate -n 2 (mpi, MPICH shared memory) on the idle "
               "2-core development machine, 2026-11-27: neighbour exchange alpha 13.4 us and 11.2 GB/s through "
               "minipar's message path; gamma = np.add alone, 20.0 GB/s (a reduction's addition: calibrate's "
               "gamma, 0.84 GB/s, is a GPT step's memory-bound work per byte); 63.4 GFLOP/s one rank alone, "
               "52.7 per rank with both cores busy"),
    "nvlink": replace(_SELENE, name="nvlink", gpus_per_node=ONE_NODE, inter=_SELENE.intra,
                      source="every rank in one NVLink/NVSwitch node: a100-selene's intra link. " + _SELENE.source),
    "infiniband": replace(_SELENE, name="infiniband", gpus_per_node=1, intra=_SELENE.inter,
                          source="every rank its own node on HDR InfiniBand: a100-selene's inter link. "
                                 + _SELENE.source),
    "a100-selene": _SELENE,
}
