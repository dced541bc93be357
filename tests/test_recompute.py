"""Activation recomputation (``minipar.recompute``): full (Chen et al. 2016; Korthikanti et al. 2022
Sec. 5) and selective (Korthikanti et al. Sec. 5) give the numbers of no recomputation, on one
process, under tensor parallelism (with and without sequence parallelism) and on a pipeline; one
layer's graph keeps exactly the paper's terms (full: the block's input; selective: everything but
the ``5as/(ht)`` softmax term), full recomputation holds one layer's working set more while that
layer's backward runs, and the extra forward is a span ``R`` of the trace with its collectives
sent again. Expected bytes are derived here from the paper, then held against ``cost.tensor``."""

from __future__ import annotations

import numpy as np
import pytest
from tp_helpers import batch, rand, rows, summarise

from minipar import launch, trace
from minipar.autograd import Tensor
from minipar.cost import tensor as formulas
from minipar.cost.collectives import ring_bytes
from minipar.memory import held_buffers, seq_mark
from minipar.mesh import DeviceMesh
from minipar.nn import GPT, Block
from minipar.parallel.hybrid import HybridGPT
from minipar.parallel.pipeline import Pipeline, partition
from minipar.parallel.tensor import ParallelBlock, TensorParallelGPT, gather_grads
from minipar.testing import run

MODES = ("none", "full", "selective")
C = {"vocab": 8, "seq": 8, "d": 8, "heads": 4, "ff": 16, "batch": 2, "seed": 1, "layers": 2}


def assert_same(got: dict, want: dict) -> None:
    """Loss bit for bit, every gradient to 1e-12 of its largest entry."""
    assert got["loss"] == want["loss"]
    assert got["grads"].keys() == want["grads"].keys()
    for name, g in want["grads"].items():
        np.testing.assert_allclose(got["grads"][name], g, rtol=0, atol=1e-12 * np.abs(g).max(), err_msg=name)


# ---- one process ---------------------------------------------------------------------------------
def single(recompute: str) -> dict:
    model = GPT(C["vocab"], C["seq"], C["d"], C["heads"], C["layers"], C["ff"], seed=C["seed"], recompute=recompute)
    x, y = batch(C, 0)
    loss = model.loss(x, y)
    loss.backward()
    return {"loss": loss.item(), "grads": {n: p.grad for n, p in model.named_parameters()}}


@pytest.mark.parametrize("recompute", ["full", "selective"])
def test_single_process_equals_no_recomputation(recompute: str) -> None:
    assert_same(single(recompute), single("none"))


def paper_layer_numbers(s: int, b: int, h: int, a: int, t: int, sp: bool, recompute: str) -> float:
    """Numbers one layer keeps (Korthikanti et al. 2022: bytes of 16-bit activations / 2), without
    the dropout terms minipar does not have (two sbh masks; with the softmax, its mask and output)."""
    if recompute == "full":  # Sec. 5: only the layer's input, 2sbh bytes (2sbh/t with SP)
        return s * b * h / (t if sp else 1)
    masks = 2 * s * b * h / (t if sp else 1)
    lines = 34 / t if sp else 10 + 24 / t  # Table 2, the sbh terms
    softmax = 5 * a * s / (h * t) if recompute == "none" else 0  # selective: Sec. 5 drops 5as/(ht)
    dropout = 3 * a * s * s * b / t if recompute == "none" else 0
    return (s * b * h * (lines + softmax) - masks - dropout) / 2


def test_single_process_block_keeps_the_papers_terms() -> None:
    """``nn.Block`` (t = 1): full keeps the input alone (sbh numbers), selective drops exactly the
    softmax (a s^2 b), and full's recomputed forward holds what no recomputation keeps. (``nn.Block``
    keeps two sbh more than the paper's layer: its projections' outputs, held by the residual adds,
    which ``ParallelBlock``'s row-parallel linears fuse; the next test holds those to the paper.)"""
    s, b, h, a, w = 12, 2, 8, 4, 8
    x0 = rand(0, b, s, h)
    kept = {}
    for mode in MODES:
        blk = Block(h, a, 4 * h, recompute=mode)
        x = Tensor(x0, requires_grad=True)
        since = seq_mark()
        kept[mode] = sum(n for _, n in held_buffers(blk(x), since).values())
    assert kept["full"] == s * b * h * w == paper_layer_numbers(s, b, h, a, 1, False, "full") * w
    assert kept["none"] - kept["selective"] == a * s * s * b * w
    assert kept["none"] == (paper_layer_numbers(s, b, h, a, 1, False, "none") + 2 * s * b * h) * w
    full = Block(h, a, 4 * h, recompute="full")
    since = seq_mark()
    assert sum(n for _, n in held_buffers(full.math(x), since).values()) == kept["none"]  # what full recomputes


# ---- tensor parallelism --------------------------------------------------------------------------
def block_run(comm, c: dict) -> dict:
    """Per (SP, mode): the buffers one ParallelBlock's graph keeps, and the largest total the meter
    samples through its forward and backward (kept + the recomputed working set under full)."""
    out = {}
    for sp in (False, True):
        for mode in MODES:
            blk = ParallelBlock(c["d"], c["heads"], comm, c["ff"], sp, recompute=mode)
            x = Tensor(rows(rand(0, c["seq"], c["batch"], c["d"]), comm, sp), requires_grad=True)
            with trace.recording(comm.world_rank) as rec:
                since = seq_mark()
                y = blk(x)
                kept = sorted(n for _, n in held_buffers(y, since).values())
                y.backward(np.ones_like(y.data))
            now, peak = {}, 0
            for e in (e for e in rec.events if e.kind == "memory"):
                now[e.name] = e.nbytes
                peak = max(peak, sum(now.values()))
            out[sp, mode] = {"kept": kept, "peak": peak, "after": sum(now.values()),
                             "R": sum(1 for e in rec.events if e.kind == "compute" and e.name == "R")}
    return out


@pytest.mark.parametrize("t", [1, 2, 4])
def test_parallel_block_keeps_the_papers_terms(t: int) -> None:
    s, b, h, a, w = 12, 2, 8, 4, 8
    c = {"seq": s, "batch": b, "d": h, "heads": a, "ff": 4 * h}
    for got in launch(block_run, t, c=c):
        for (sp, mode), m in got.items():
            paper = paper_layer_numbers(s, b, h, a, t, sp, mode) * w
            assert sum(m["kept"]) == paper, (sp, mode)
            assert m["kept"] == sorted(formulas.layer_terms(t, b, s, h, a, 4 * h, w, sp, mode).values())
            working = paper_layer_numbers(s, b, h, a, t, sp, "none") * w if mode == "full" else 0
            assert working == (formulas.recompute_working_bytes(t, b, s, h, a, 4 * h, w, sp) if working else 0)
            assert m["peak"] == paper + working, (sp, mode)  # one layer's working set on top of what it keeps
            assert m["after"] == 0
            assert m["R"] == {"none": 0, "full": 1, "selective": 1}[mode]  # selective: the attention's R
    full, none = got[False, "full"]["kept"], got[False, "none"]["kept"]
    if t == 1:  # the numbers of the paper's Sec. 5 at this size, in float64
        assert (sum(none), sum(got[False, "selective"]["kept"]), sum(full)) == (33792, 24576, 1536)


def tp_run(comm, c: dict) -> dict:
    out = {}
    for sp in (False, True):
        for mode in MODES:
            model = TensorParallelGPT(c["vocab"], c["seq"], c["d"], c["heads"], c["layers"], comm, c["ff"],
                                      sequence_parallel=sp, seed=c["seed"], recompute=mode)
            x, y = batch(c, 0)
            with trace.recording(comm.world_rank) as rec:
                loss = model.loss(x, y)
                loss.backward()
                model.sync_grads()
            spans = [e for e in rec.events if e.kind == "compute"]
            out[sp, mode] = {"loss": loss.item(), "grads": gather_grads(model, comm),
                             "sent": dict(summarise(rec.events, comm.world_rank)["bytes"]),
                             "R": sorted((e.args.get("layer"), e.args.get("op")) for e in spans if e.name == "R"),
                             "peak": summarise(rec.events, comm.world_rank)["peaks"]}
    return out


def check_tp(c: dict, t: int, results: list[dict]) -> None:
    """Equal to no recomputation; full sends each block's forward collectives again; R spans."""
    a = c["seq"] * c["batch"] * c["d"] * 8
    layers = list(range(c["layers"]))
    for got in results:
        for sp in (False, True):
            none = got[sp, "none"]
            again = {op: c["layers"] * n * ring_bytes(op, a, t)
                     for op, n in formulas.collectives_per_block(sp)["forward"].items()}
            for mode in ("full", "selective"):
                assert_same(got[sp, mode], none)
            assert got[sp, "selective"]["sent"] == none["sent"]
            assert got[sp, "full"]["sent"] == {op: n + again.get(op, 0) for op, n in none["sent"].items()}
            for mode in MODES:  # cost.tensor.expected_bytes prices the same bytes (lesson 04 prints them)
                want = formulas.expected_bytes(t, c["batch"], c["seq"], c["d"], c["layers"], 8, sp, c["seq"],
                                               recompute=mode)
                assert got[sp, mode]["sent"] == want, (sp, mode)
            assert got[sp, "full"]["R"] == [(i, None) for i in layers]
            assert got[sp, "selective"]["R"] == [(None, "attention")] * c["layers"]
            want = formulas.activation_bytes(t, c["batch"], c["seq"], c["d"], c["heads"], c["ff"], c["layers"],
                                             c["vocab"], 8, sp, recompute="selective")
            assert got[sp, "selective"]["peak"] == want


def test_tensor_parallel_equals_no_recomputation() -> None:
    check_tp(C, 2, launch(tp_run, 2, c=C))


@pytest.mark.mpi
def test_tensor_parallel_equals_no_recomputation_mpiexec() -> None:
    check_tp(C, 2, run(tp_run, 2, backend="mpi", timeout=90, comm_timeout=30, c=C))


# ---- pipeline ------------------------------------------------------------------------------------
def pipe_run(comm, c: dict) -> dict:
    out = {}
    for mode in MODES:
        model = partition.gpt(c["vocab"], c["seq"], c["d"], c["heads"], c["layers"], c["ff"], seed=c["seed"],
                              recompute=mode)
        pipe = Pipeline(comm, model, "1f1b", microbatches=2)
        x, y = batch(c, 0)
        with trace.recording(comm.world_rank) as rec:
            loss = pipe.step(x, y)
        samples = [e for e in rec.events if e.kind == "memory" and e.name == "activations"]
        out[mode] = {"loss": loss, "grads": pipe.full_grads(root=None),
                     "R": sum(1 for e in rec.events if e.kind == "compute" and e.name == "R"),
                     "peak": max(e.nbytes for e in samples), "stashed": max(e.args["stashed"] for e in samples),
                     "blocks": sum(1 for s in pipe.stages.values() for i in pipe.layer_ranges[s.index]
                                   if 0 < i <= c["layers"])}
    return out


def test_pipeline_equals_no_recomputation() -> None:
    """Two stages of one block each, 1F1B over 2 micro-batches: every stage recomputes its block
    once per micro-batch; its peak stash shrinks by the dropped terms of each stashed micro-batch's
    blocks (micro-batch b = 1): selective the softmax a s^2 b, full all but the block's output
    (``nn.Block`` keeps paper + 2sbh without recomputation, see above)."""
    s, h, a, w = C["seq"], C["d"], C["heads"], 8
    for got in launch(pipe_run, 2, c={**C, "ff": 4 * h}):  # the paper's 4h MLP
        for mode in ("full", "selective"):
            assert_same(got[mode], got["none"])
        assert (got["full"]["R"], got["selective"]["R"]) == (2, 2)
        n = got["none"]["stashed"] * got["none"]["blocks"]
        assert n and got["none"]["peak"] - got["selective"]["peak"] == n * a * s * s * w
        dropped = (paper_layer_numbers(s, 1, h, a, 1, False, "none") + 2 * s * h - s * h) * w
        assert got["none"]["peak"] - got["full"]["peak"] == n * dropped


def hybrid_run(comm, c: dict) -> dict:
    out = {}
    for mode in c["modes"]:
        mesh = DeviceMesh(comm, **c["degrees"])
        model = HybridGPT(mesh, c["vocab"], c["seq"], c["d"], c["heads"], c["layers"], c["ff"], microbatches=2,
                          sequence_parallel=c["degrees"].get("tp", 1) > 1, seed=c["seed"], recompute=mode)
        with trace.recording(comm.world_rank) as rec:
            loss = model.forward_backward(*batch(c, 0))
        out[mode] = {"loss": loss, "grads": model.full_grads(),
                     "R": sum(1 for e in rec.events if e.kind == "compute" and e.name == "R")}
    return out


@pytest.mark.parametrize("degrees,modes", [({"pp": 2, "tp": 2}, MODES), ({"pp": 2, "sp": 2}, ("none", "full"))])
def test_hybrid_equals_no_recomputation(degrees: dict, modes: tuple[str, ...]) -> None:
    """Pipeline stages of tensor-parallel blocks (Megatron-SP) or of Ulysses blocks: every mode gives
    the numbers of no recomputation; each rank recomputes its stage's block (or its attention) once
    per micro-batch."""
    for got in launch(hybrid_run, 4, c={**C, "degrees": degrees, "modes": modes}):
        for mode in modes[1:]:
            assert_same(got[mode], got["none"])
            assert got[mode]["R"] == 2


# ---- bad values ------------------------------------------------------------------------------------
def bad_run(comm) -> list[str]:
    messages = []
    with trace.recording(comm.world_rank) as rec:
        for build in (lambda: TensorParallelGPT(8, 8, 8, 4, 1, comm, 16, recompute="partial"),
                      lambda: ParallelBlock(8, 4, comm, 16, recompute="partial"),
                      lambda: GPT(8, 8, 8, 4, 1, recompute="partial"),
                      lambda: partition.gpt(8, 8, 8, 4, 1, recompute="partial")):
            with pytest.raises(ValueError) as err:
                build()
            messages.append(str(err.value))
    assert not [e for e in rec.events if e.kind == "comm"]
    return messages


def hybrid_bad_run(comm, degrees: dict, schedule: str, recompute: str) -> str:
    with trace.recording(comm.world_rank) as rec, pytest.raises(ValueError) as err:
        HybridGPT(DeviceMesh(comm, **degrees), 8, 8, 8, 4, 2, 16, schedule=schedule, microbatches=2,
                  recompute=recompute)
    assert not [e for e in rec.events if e.kind == "comm"]
    return str(err.value)


@pytest.mark.parametrize("degrees,schedule,recompute,needle", [
    ({"pp": 2}, "1f1b", "partial", "recompute='partial'; choose one of"),
    ({"pp": 2}, "zb-h1", "full", "schedule='zb-h1' would have no W left to place"),
    ({"sp": 2}, "1f1b", "selective", "the sequence-parallel attentions keep their own"),
])
def test_hybrid_refuses_recompute_it_cannot_run(degrees: dict, schedule: str, recompute: str, needle: str) -> None:
    first, second = launch(hybrid_bad_run, 2, degrees=degrees, schedule=schedule, recompute=recompute)
    assert first == second and needle in first and "\n" not in first


def test_bad_recompute_refused_in_one_line_before_any_message() -> None:
    first, second = launch(bad_run, 2)
    assert first == second
    for msg in first:
        assert "recompute='partial'; choose one of 'none', 'selective', 'full'" in msg and "\n" not in msg
    with pytest.raises(ValueError, match="recompute='partial'"):
        formulas.layer_terms(2, 2, 8, 8, 4, 16, recompute="partial")


def test_recompute_span_is_a_kind_of_its_own() -> None:
    """Every block's extra forward is one span ``R``: the viewer's "recompute", in a colour and a
    terminal style no other compute kind or collective has."""
    from viz.analysis import kind_of
    from viz.style import COLORS, COMM_COLORS
    from viz.terminal import STYLES

    with trace.recording(0) as rec:
        single("full")
    spans = [e for e in rec.events if e.kind == "compute" and e.name == "R"]
    assert len(spans) == C["layers"] and {kind_of(e) for e in spans} == {"recompute"}
    others = [c for k, c in COLORS.items() if k != "recompute"] + list(COMM_COLORS.values())
    assert COLORS["recompute"] not in others
    assert STYLES["recompute"] not in [s for k, s in STYLES.items() if k != "recompute"]
