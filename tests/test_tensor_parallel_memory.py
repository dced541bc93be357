"""Tensor parallelism's activation memory, measured from the autograd graph: one layer keeps what
Korthikanti et al. 2022 count, sequence parallelism divides the layer-norm region by exactly t, and
the vocabulary-parallel loss never forms the full logits. The equality properties are in
``test_tensor_parallel.py``."""

from __future__ import annotations

import numpy as np
import pytest
from tp_helpers import TOL, batch, graph_arrays, rand, rows, summarise

from minipar import functional as F
from minipar import launch, trace
from minipar.autograd import Tensor
from minipar.cost import tensor as formulas
from minipar.memory import held_buffers, seq_mark
from minipar.nn import GPT
from minipar.parallel.tensor import ParallelBlock, TensorParallelGPT, gather_logits


def memory_run(comm, c: dict) -> dict:
    """Peak and final activation bytes by label for one training step, with and without SP."""
    out = {}
    for sp in (False, True):
        model = TensorParallelGPT(c["vocab"], c["seq"], c["d"], c["heads"], c["layers"], comm, c["ff"],
                                  sequence_parallel=sp)
        x, y = batch(c, 0)
        with trace.recording(comm.world_rank) as rec:
            model.loss(x, y).backward()
        samples = [e for e in rec.events if e.kind == "memory"]
        out[sp] = {"peak": summarise(rec.events, comm.world_rank)["peaks"],
                   "final": {e.name: e.nbytes for e in samples}}  # the last sample of each label
    return out


def test_sequence_parallel_divides_layer_norm_activations_by_t() -> None:
    """Measured from the graph (every buffer once): the layer-norm/residual region (4 arrays per
    block, 3 around) is t times smaller with SP, the tensor-parallel regions are the same (the
    column-parallel linears keep the shard and gather again in backward); the logits are 1/t of
    the vocabulary either way; backward releases everything."""
    c = {"vocab": 8, "seq": 8, "d": 8, "heads": 4, "ff": 16, "batch": 2, "seed": 1, "layers": 2}
    t, a = 4, 8 * 2 * 8 * 8  # a = seq x batch x d x 8 bytes
    for got in launch(memory_run, t, c=c):
        plain, sp = got[False]["peak"], got[True]["peak"]
        for flag in (False, True):
            assert got[flag]["peak"] == formulas.activation_bytes(
                t, c["batch"], c["seq"], c["d"], c["heads"], c["ff"], 2, c["vocab"], 8, flag)
        assert plain["activations/ln"] == t * sp["activations/ln"] == (4 * 2 + 3) * a
        assert sp["activations/tp"] == plain["activations/tp"]
        assert plain["activations/logits"] == sp["activations/logits"] < 8 * 2 * c["vocab"] * 8
        for run_ in got.values():  # backward releases every layer's activations
            assert run_["final"] == dict.fromkeys(run_["peak"], 0)


def block_memory_run(comm, c: dict) -> dict:
    """The buffers one block's graph keeps for backward (made by the block), sorted by size."""
    out = {}
    for sp in (False, True):
        blk = ParallelBlock(c["d"], c["heads"], comm, c["ff"], sp)
        x = Tensor(rows(rand(0, c["seq"], c["batch"], c["d"]), comm, sp), requires_grad=True)
        since = seq_mark()
        out[sp] = sorted(n for _, n in held_buffers(blk(x), since).values())
    return out


@pytest.mark.parametrize("t", [1, 2, 4])
def test_one_layer_keeps_what_korthikanti_et_al_count(t: int) -> None:
    """Korthikanti et al. 2022, Sec. 4.1 and Table 2: one layer keeps sbh (34/t + 5as/(ht)) bytes of
    16-bit activations with tensor and sequence parallelism, sbh (10 + 24/t + 5as/(ht)) with tensor
    parallelism alone. Without dropout four terms go: the softmax's dropout mask (as^2 b) and output
    (2 as^2 b), and the 1-byte masks after attention and after the MLP (sbh each, on the shard under
    SP). Measured here in float64 (8 bytes a number instead of 2), term by term."""
    s, b, h, heads = 12, 2, 8, 4  # softmax (a s^2 b) and GELU (4 s b h) terms of different sizes
    c = {"seq": s, "batch": b, "d": h, "heads": heads, "ff": 4 * h}  # the paper's 4h MLP
    w = 8
    for got in launch(block_memory_run, t, c=c):
        for sp, measured in got.items():
            if sp:
                paper = s * b * h * (34 / t + 5 * heads * s / (h * t))
                dropout = heads * s * s * b / t + 2 * heads * s * s * b / t + 2 * s * b * h / t
            else:
                paper = s * b * h * (10 + 24 / t + 5 * heads * s / (h * t))
                dropout = heads * s * s * b / t + 2 * heads * s * s * b / t + 2 * s * b * h
            assert sum(measured) == (paper - dropout) / 2 * w, sp
            ln = s * b * h * w // (t if sp else 1)  # ln1 output, residual 1, ln2 output, block output
            local = s * b * h * w // t
            terms = [ln, 3 * local, heads * s * s * b * w // t, local, ln, ln, 4 * local, 4 * local, ln]
            assert measured == sorted(terms), sp  # q, k, v are one buffer: the fused projection's output
            assert measured == sorted(formulas.layer_terms(t, b, s, h, heads, 4 * h, w, sp).values())


def vocab_run(comm, c: dict) -> dict:
    model = TensorParallelGPT(c["vocab"], c["seq"], c["d"], c["heads"], 1, comm, c["ff"], seed=3)
    x, y = batch(c, 0)
    with trace.recording(comm.world_rank) as rec:
        loss = model.loss(x, y)
    logits = gather_logits(model(x), comm)
    sizes = {n for a in graph_arrays(loss) for n in a.shape}
    biggest = max(e.nbytes for e in rec.events if e.kind == "comm" and e.src == comm.world_rank)
    return {"loss": loss.item(), "logits": logits, "axes": sizes, "biggest_message": biggest,
            "peak_logits": summarise(rec.events, comm.world_rank)["peaks"]["activations/logits"]}


def test_vocab_parallel_loss_never_forms_the_full_logits() -> None:
    c = {"vocab": 40, "seq": 4, "d": 8, "heads": 4, "ff": 8, "batch": 2, "seed": 2}
    t, n = 4, 4 * 2
    results = launch(vocab_run, t, c=c)
    x, y = batch(c, 0)
    want = F.cross_entropy(Tensor(results[0]["logits"]), y).item()
    ref = GPT(c["vocab"], c["seq"], c["d"], c["heads"], 1, c["ff"], seed=3)
    np.testing.assert_allclose(results[0]["logits"], ref(x).data, **TOL)
    for got in results:
        assert got["loss"] == pytest.approx(want, rel=1e-12)
        assert c["vocab"] not in got["axes"]  # no array in the graph spans the vocabulary
        assert c["vocab"] // t in got["axes"]
        held = formulas.activation_bytes(t, 2, 4, 8, 4, 8, 1, c["vocab"])["activations/logits"]
        assert got["peak_logits"] == held == 2 * n * (c["vocab"] // t) * 8 + n * (8 + 1) + 8
        assert held < n * c["vocab"] * 8  # less than the full logits of one rank
        assert got["biggest_message"] == n * c["d"] * 8 // t  # an activation chunk, never logits
