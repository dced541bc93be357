"""What a tensor-parallel training step should cost: collectives, bytes per rank, activation bytes.

The measurements in the tests and in lesson 04 are held against these numbers. ``t`` ranks,
tokens ``(batch b, seq s)``, width ``d``, ``H`` heads, MLP width ``d_ff``, ``L`` blocks, vocabulary
``V``, ``w`` bytes per number (2 for a bf16 model: its activations and their gradients travel in
bf16, ``parallel.tensor.comm_ops``; the loss's statistics in float32). ``A = s b d w`` is one
activation of the residual stream.

Collectives (Shoeybi et al. 2019 Sec. 3; Korthikanti et al. 2022 Sec. 4.2.2), ring algorithms:
- per block without sequence parallelism: 2 all-reduces of ``A`` forward (``g`` after attention and
  after the MLP) and 2 backward (``f`` before them); each sends ``2 (t-1)/t A`` per rank.
- with it: 2 all-gathers + 2 reduce-scatters forward; backward 2 reduce-scatters (the column-parallel
  inputs' gradients), 2 all-gathers (``g-bar``'s backward) and 2 more all-gathers: the
  column-parallel linears keep only the sequence shard and gather it again for their weight
  gradients ("an extra all-gather", Korthikanti et al. Sec. 4.2.2). Each sends ``(t-1)/t A``: the
  all-reduces' bytes plus the ``2 (t-1)/t A`` of the re-gathers.
- around the blocks: the embedding (``g`` / reduce-scatter forward), the head's input (``f`` /
  all-gather, re-gathered in backward), the loss (3 all-reduces of ``s b`` numbers: max, sum of
  exponentials, target logit) and, with sequence parallelism, one all-reduce of the replicated
  parameters' gradients.

Activation bytes kept for backward (Korthikanti et al. 2022 Sec. 4.1, Table 2), as measured by
``memory.held_buffers``. Per layer the paper counts ``sbh (34 + 5as/h)`` bytes with 16-bit
activations, ``sbh (10 + 24/t + 5as/(ht))`` with tensor parallelism and ``sbh (34/t + 5as/(ht))``
with sequence parallelism too. minipar has no dropout, so four terms drop: the attention-softmax
dropout mask (``as^2 b``) and its output (``2 as^2 b``), and the two 1-byte masks after attention
and after the MLP (``sbh`` each). What stays is ``layer_terms``: in numbers, ``16 sbh / t + as^2 b
/ t`` per layer with sequence parallelism (``4 sbh + 12 sbh / t + as^2 b / t`` without), times
``w`` bytes each. The paper's ``4sbh`` of layer-norm inputs are the block's input (the previous
block's output) and its first residual sum; minipar counts each block's output (the next block's
layer-norm input) to the block that makes it, so the total per layer is the same.
Around the blocks: ``ln`` + ``3 S`` (the embedding's reduced output and position sum, the final
layer norm's output; ``S = A/t`` under sequence parallelism, ``A`` without), ``tp`` + ``2A`` (the
embedding rows and their masked copy, every position); ``logits`` = logits and the loss's saved
softmax ``2 s b V w / t``, its saved target indices and mask ``s b (8 + 1)`` and the loss ``w``.

Recomputation (``minipar.recompute``; Korthikanti et al. 2022 Sec. 5; Chen et al. 2016 Sec. 3):
"selective" drops the softmax term ``as^2 b / t``; "full" keeps ``S`` per layer (the block's input,
counted as the previous block's output) and holds one layer's whole ``layer_terms`` more while that
layer's backward runs (``recompute_working_bytes``). docs/formulas.md section 4 has the table.
"""

from __future__ import annotations

from minipar.checks import divisible, one_of, whole, wholes
from minipar.cost.collectives import ring_bytes
from minipar.cost.layout import RECOMPUTE


def _megatron(who: str, t: int, n_heads: int, d: int, d_ff: int) -> None:
    """Megatron's split of a block over ``t`` ranks: whole heads and MLP columns per rank."""
    wholes(who, t=t, n_heads=n_heads, d=d, d_ff=d_ff)
    if n_heads % t:
        raise ValueError(f"{who}: n_heads={n_heads} is not divisible by t={t} (Megatron gives each rank whole "
                         f"heads); use a multiple of {t} heads")
    divisible(who, "d", d, n_heads, "n_heads")
    divisible(who, "d_ff", d_ff, t, "t")


def collectives_per_block(sequence_parallel: bool) -> dict[str, dict[str, int]]:
    """Calls per transformer block by phase: ``{"forward": {op: n}, "backward": {op: n}}``."""
    one_of("collectives_per_block", "sequence_parallel", sequence_parallel, (True, False))
    if sequence_parallel:
        return {"forward": {"allgather": 2, "reduce_scatter": 2},
                "backward": {"allgather": 4, "reduce_scatter": 2}}  # 2 of the all-gathers: re-gathers
    return {"forward": {"allreduce": 2}, "backward": {"allreduce": 2}}


def sequence_parallel_params(seq_len: int, d: int, n_layers: int) -> int:
    """Numbers in the gradients ``sync_grads`` all-reduces: 2 layer norms and 2 proj biases per
    block (6 d), the final layer norm (2 d), the position embedding (seq_len d)."""
    wholes("sequence_parallel_params", seq_len=seq_len, d=d, n_layers=n_layers)
    return n_layers * 6 * d + 2 * d + seq_len * d


def expected_bytes(t: int, batch: int, seq: int, d: int, n_layers: int, itemsize: int = 8,
                   sequence_parallel: bool = False, seq_len: int | None = None,
                   recompute: str = "none", loss_itemsize: int | None = None) -> dict[str, float]:
    """Bytes each rank sends in one training step (forward, backward, ``sync_grads``), by op. Full
    recomputation runs every block's forward again in its backward, collectives included (Megatron
    does the same): ``collectives_per_block``'s forward calls once more per layer; selective
    recomputes the attention core alone, which sends nothing. ``itemsize``: the activations' and
    gradients' bytes per number (2 for a bf16 model); ``loss_itemsize`` the loss statistics'
    (``itemsize`` unless given: a bf16 model's cross entropy runs in float32, 4)."""
    loss_itemsize = itemsize if loss_itemsize is None else loss_itemsize
    wholes("expected_bytes", t=t, batch=batch, seq=seq, d=d, n_layers=n_layers, itemsize=itemsize,
           loss_itemsize=loss_itemsize)
    if seq_len is not None:
        whole("expected_bytes", "seq_len", seq_len)
    one_of("expected_bytes", "recompute", recompute, RECOMPUTE)
    a = seq * batch * d * itemsize
    if recompute == "full":
        out = expected_bytes(t, batch, seq, d, n_layers, itemsize, sequence_parallel, seq_len,
                             loss_itemsize=loss_itemsize)
        for op, n in collectives_per_block(sequence_parallel)["forward"].items():
            out[op] += n_layers * n * ring_bytes(op, a, t)
        return out
    loss = 3 * ring_bytes("allreduce", seq * batch * loss_itemsize, t)
    if not sequence_parallel:
        calls = 4 * n_layers + 2  # blocks (2 forward, 2 backward), embedding, head input
        return {"allreduce": calls * ring_bytes("allreduce", a, t) + loss}
    grads = sequence_parallel_params(seq_len or seq, d, n_layers) * itemsize
    gathers = 6 * n_layers + 3  # blocks; the embedding's backward; the head's input and its re-gather
    scatters = 4 * n_layers + 2  # blocks; the embedding's forward; the head input's gradient
    return {"allgather": gathers * ring_bytes("allgather", a, t),
            "reduce_scatter": scatters * ring_bytes("reduce_scatter", a, t),
            "allreduce": loss + ring_bytes("allreduce", grads, t)}


def block_bytes(t: int, batch: int, seq: int, d: int, itemsize: int = 8,
                sequence_parallel: bool = False) -> dict[str, float]:
    """Bytes each rank sends for one block, forward plus backward, by op."""
    wholes("block_bytes", t=t, batch=batch, seq=seq, d=d, itemsize=itemsize)
    a = seq * batch * d * itemsize
    calls = collectives_per_block(sequence_parallel)
    return {op: (calls["forward"].get(op, 0) + n) * ring_bytes(op, a, t) for op, n in calls["backward"].items()}


def block_parameters(t: int, d: int, d_ff: int) -> int:
    """Numbers of a Megatron block held per rank on ``t`` ranks: q, k, v and fc split by columns (weight
    and bias), both projections by rows (their biases whole, as the layer norms)."""
    wholes("block_parameters", t=t, d=d, d_ff=d_ff)
    divisible("block_parameters", "d", d, t, "t")
    divisible("block_parameters", "d_ff", d_ff, t, "t")
    return 2 * 2 * d + 3 * (d * d // t + d // t) + (d * d // t + d) + (d * d_ff // t + d_ff // t) + (d_ff // t * d + d)


def layer_terms(t: int, batch: int, seq: int, d: int, n_heads: int, d_ff: int, itemsize: int = 8,
                sequence_parallel: bool = False, recompute: str = "none", dropout: bool = False) -> dict[str, int]:
    """Bytes one transformer layer keeps for backward on each rank, term by term: Korthikanti et al.
    2022 Sec. 4.1 without the dropout terms (module docstring), in the order a block makes them.
    ``dropout=True`` (a GPT with dropout, as the paper's and Megatron-LM's; not minipar's ``nn.GPT``)
    adds the paper's four: the softmax's 1-byte mask and its dropped output (``itemsize``), the 1-byte
    masks after attention and after the MLP; with ``itemsize=2`` the sum is the paper's ``sbh (34 +
    5as/h)`` (``10 + 24/t``, ``34/t`` with t and SP) per layer, what ``cost.perf`` charges.
    ``recompute`` (Korthikanti et al. Sec. 5): "selective" drops the softmax terms (``5as^2b`` with
    dropout), "full" keeps the block's input alone (minipar counts a block's output, the next one's
    input, as for "none"), and ``recompute_working_bytes`` more while the layer's backward runs.
    Refuses head counts ``t`` does not divide, as Megatron does."""
    _megatron("layer_terms", t, n_heads, d, d_ff)
    wholes("layer_terms", batch=batch, seq=seq, itemsize=itemsize)
    one_of("layer_terms", "recompute", recompute, RECOMPUTE)
    one_of("layer_terms", "dropout", dropout, (False, True))
    n, w = seq * batch, itemsize
    shard = n * d * w // t if sequence_parallel else n * d * w  # the layer-norm region's tensors
    if recompute == "full":
        return {"residual 2 (next ln1 input)": shard}
    local = n * d * w // t  # one of q, k, v or the attention output on this rank's heads
    hidden = n * (d_ff // t) * w
    terms = {"ln1 output (q k v input)": shard, "q k v": 3 * local,
             "softmax": batch * (n_heads // t) * seq * seq * w, "attention output (proj input)": local,
             "residual 1 (ln2 input)": shard, "ln2 output (fc input)": shard,
             "gelu input": hidden, "gelu output (proj input)": hidden, "residual 2 (next ln1 input)": shard}
    if dropout:  # 1-byte masks; the dropped softmax has the activations' itemsize (Korthikanti et al. 4.1)
        scores = batch * (n_heads // t) * seq * seq
        terms.update({"softmax dropout mask": scores, "softmax dropout output": scores * w,
                      "attention dropout mask": shard // w, "mlp dropout mask": shard // w})
    if recompute == "selective":
        for key in ("softmax", "softmax dropout mask", "softmax dropout output"):
            terms.pop(key, None)
    return terms


def recompute_working_bytes(t: int, batch: int, seq: int, d: int, n_heads: int, d_ff: int, itemsize: int = 8,
                            sequence_parallel: bool = False, dropout: bool = False) -> int:
    """Bytes one layer's recomputed forward holds while its backward runs under full recomputation
    (Chen et al. 2016, Sec. 3): the whole ``layer_terms`` of no recomputation, its output included
    (a fresh copy of the block's output, not the one kept)."""
    return sum(layer_terms(t, batch, seq, d, n_heads, d_ff, itemsize, sequence_parallel, dropout=dropout).values())


LN_TERMS = ("ln1 output (q k v input)", "residual 1 (ln2 input)", "ln2 output (fc input)",
            "residual 2 (next ln1 input)")  # the rest are made inside the tensor-parallel regions


def activation_bytes(t: int, batch: int, seq: int, d: int, n_heads: int, d_ff: int, n_layers: int,
                     vocab: int, itemsize: int = 8, sequence_parallel: bool = False,
                     index_itemsize: int = 8, recompute: str = "none") -> dict[str, int]:
    """Activation bytes held per rank after the forward pass, by memory-sample label (module
    docstring); ``index_itemsize`` = bytes of the targets' integer type (int64: 8). Under full
    recomputation backward holds ``recompute_working_bytes`` more, one layer at a time."""
    wholes("activation_bytes", n_layers=n_layers, vocab=vocab, index_itemsize=index_itemsize)
    w, n = itemsize, seq * batch
    a = n * d * w
    s_ = a // t if sequence_parallel else a
    terms = layer_terms(t, batch, seq, d, n_heads, d_ff, itemsize, sequence_parallel, recompute)
    ln = sum(v for k, v in terms.items() if k in LN_TERMS)
    return {"activations/ln": n_layers * ln + 3 * s_,
            "activations/tp": n_layers * (sum(terms.values()) - ln) + 2 * a,
            "activations/logits": 2 * n * (vocab // t) * w + n * (index_itemsize + 1) + w}
