"""Every byte, memory and time formula minipar's measurements are held against: one home.

- ``collectives.py``: bytes per rank of each collective algorithm (ring, recursive doubling, naive)
  and their time in the alpha-beta-gamma model.
- ``data.py``: DDP's bytes per step, the parameter server's links.
- ``pipeline.py``: bubble, stashed micro-batches, bytes across stage boundaries.
- ``tensor.py``: Megatron tensor (and sequence) parallelism: collectives per block, bytes per rank,
  activation bytes kept for backward (Korthikanti et al.'s terms).
- ``sequence.py``: Ulysses, Ring Attention and their hybrid: bytes per rank per layer, the largest
  score buffer, causal score blocks per ring rank, activation bytes of one block, gradient sync.
- ``zero.py``: ZeRO stages 0-3 and FSDP: model states per rank (the paper's Table 1, and exactly for
  the flat padded shards), bytes sent per step, gathered units alive at once.
- ``precision.py``: bytes per parameter of fp32, fp16 + loss scale, bf16 (gradients reduced in bf16 or
  fp32) and FP8 training, and the gradient all-reduce's bytes.
- ``offload.py``: the modelled time of a move between memory tiers; ZeRO-Offload's bytes per step.
- ``cluster.py``: a cluster (FLOP/s, memory, alpha-beta links inside and across nodes, gamma, CPU overheads)
  and its file.
- ``layout.py``: a GPT (``ModelSpec``) and a layout (``Layout``, with ``check``), what perf and the planner take.
- ``perf.py``: a GPT's step time, TFLOP/s per GPU and memory per GPU under a dp x tp x pp x sp layout.
- ``overhead.py``: what a step costs a CPU beyond FLOPs and bytes (per autograd op, per collective call
  and message step, the optimizer's tensors and bytes), counted on minipar's hybrid GPT; 0 on GPU presets.
- ``presets.py``: published models (GPT-3 175B, Narayanan et al. 2021 Table 1) and clusters (a100-selene);
  the networks a replay runs on (local, nvlink, infiniband).
- ``planner.py``: every layout of a GPU count ranked by predicted step time; pipeline stage slicing.
- ``hybrid.py``: HybridGPT's exact bytes per mesh axis per rank, model states, activation peak.
- ``sharding.py``: global tensors: the collective each placement change needs and its bytes per rank.
- ``tensor2d.py``: 2-D (SUMMA) tensor parallelism: bytes per rank of a linear, an MLP, a block.
- ``tensor2p5d.py``: 2.5-D (Tesseract) tensor parallelism on d stacked q x q grids: bytes per rank in the layer and
  over the depth, parameters 1/q^2, activations 1/(d q^2).
- ``tensor3d.py``: 3-D tensor parallelism on a q x q x q cube: bytes per rank of a linear and of a transformer block;
  parameters and activations per rank.
- ``calibrate`` (``minipar/calibrate.py``, not here: it measures) writes the cluster files ``perf`` reads.

Traces, tests and lessons import from here; the derivations are in each module's docstring and in
``docs/formulas.md``.
"""

from minipar.cost import sequence, zero
from minipar.cost.collectives import ALLREDUCE_ALGORITHMS, allreduce_bytes, collective_time, ring_bytes
from minipar.cost.offload import transfer_seconds, zero_offload_bytes
from minipar.cost.perf import Layout, ModelSpec, Prediction, predict
from minipar.cost.planner import Candidate, NoFit, plan
from minipar.cost.stages import layer_costs, partition_layers
from minipar.cost.zero import (
    fsdp_gathered_peak,
    hsdp_traffic_bytes,
    paper_table,
    zero_model_states,
    zero_state_bytes,
    zero_traffic_by_op,
    zero_traffic_bytes,
)

__all__ = ["ALLREDUCE_ALGORITHMS", "allreduce_bytes", "collective_time", "fsdp_gathered_peak", "hsdp_traffic_bytes",
           "paper_table",
           "ring_bytes", "sequence", "zero", "zero_model_states", "zero_state_bytes", "zero_traffic_by_op",
           "zero_traffic_bytes",
           "transfer_seconds", "zero_offload_bytes",
           "Candidate", "Layout", "ModelSpec", "NoFit", "Prediction", "layer_costs", "partition_layers", "plan",
           "predict"]
