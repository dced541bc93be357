"""Tensor parallelism (Megatron) with sequence parallelism equals the single-process model.

Properties drawn by hypothesis (t in 1..4 dividing heads, d_ff and vocabulary; sequence parallelism
on/off; shapes; seeds): every layer and the whole GPT give the outputs, loss, gathered gradients
and updated parameters of ``minipar.nn``, on the threads backend and under ``mpiexec``. The trace
gives the collectives per block and the bytes per rank, held against ``formulas``; the memory
samples, measured from the autograd graph, show sequence parallelism dividing the layer-norm
region's activations by exactly t, and equal ``formulas.activation_bytes`` (those memory
properties are in ``test_tensor_parallel_memory.py``).
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import example, given
from refusals import refusal
from strategies import budget, mpi_jobs, tp_configs
from tolerances import assert_close_after_adamw
from tp_helpers import TOL, batch, cols, rand, rows, summarise

from minipar import functional as F
from minipar import launch, trace
from minipar.autograd import Tensor
from minipar.cost import tensor as formulas
from minipar.nn import GPT, Block, Embedding, Linear
from minipar.optim import SGD, AdamW
from minipar.parallel.tensor import (
    ColumnParallelLinear,
    ParallelBlock,
    RowParallelLinear,
    TensorParallelGPT,
    VocabParallelEmbedding,
    gather_array,
    gather_grads,
    gather_logits,
    gather_state_dict,
    sync_sequence_parallel_grads,
    vocab_parallel_cross_entropy,
)
from minipar.testing import run, run_each


def config(t: int, sp: bool, seq: int, opt: str = "adamw", layers: int = 2) -> dict:
    """A hand-picked configuration in ``strategies.tp_configs``' shape (for ``@example``)."""
    return {"t": t, "sp": sp, "heads": 2 * t, "d": 4 * t, "ff": 3 * t, "vocab": 3 * t, "seq": seq, "batch": 2,
            "layers": layers, "seed": 11, "opt": opt}


# sequences longer than one token always run, with and without sequence parallelism
SEQ_EXAMPLES = [config(2, True, 4), config(4, True, 8, "sgd", 1), config(3, False, 5)]


# ---- layers ---------------------------------------------------------------------------------------
def layers_run(comm, c: dict) -> dict:
    """Every parallel layer on the same inputs; outputs and full gradients (gathered)."""
    sp, s, b, d, ff, seed = c["sp"], c["seq"], c["batch"], c["d"], c["ff"], c["seed"]
    out = {}
    col = ColumnParallelLinear(d, ff, comm, gather_output=True, sequence_parallel=sp)
    col.init_parameters(seed, "c.")
    x = Tensor(rows(rand(seed, s, b, d), comm, sp), requires_grad=True)
    y = col(x)
    (y * rand(seed + 1, s, b, ff)).sum().backward()
    out["col"] = (y.data, x.grad, gather_array(col.weight.grad, col.weight, comm),
                  gather_array(col.bias.grad, col.bias, comm))
    row = RowParallelLinear(ff, d, comm, sequence_parallel=sp).init_parameters(seed, "r.")
    z = Tensor(cols(rand(seed + 2, s, b, ff), comm), requires_grad=True)
    y = row(z)
    (y * rows(rand(seed + 3, s, b, d), comm, sp)).sum().backward()
    sync_sequence_parallel_grads(row, comm)
    out["row"] = (y.data, z.grad, gather_array(row.weight.grad, row.weight, comm), row.bias.grad)
    emb = VocabParallelEmbedding(c["vocab"], d, comm, sp).init_parameters(seed, "e.")
    idx = np.random.default_rng(seed).integers(0, c["vocab"], (s, b))
    y = emb(idx)
    (y * rows(rand(seed + 4, s, b, d), comm, sp)).sum().backward()
    out["emb"] = (y.data, gather_array(emb.weight.grad, emb.weight, comm))
    logits = Tensor(cols(rand(seed + 5, s, b, c["vocab"]), comm), requires_grad=True)
    loss = vocab_parallel_cross_entropy(logits, idx, comm)
    loss.backward()
    out["ce"] = (loss.item(), gather_logits(Tensor(logits.grad), comm))
    blk = ParallelBlock(d, c["heads"], comm, ff, sp).init_parameters(seed, "b.")
    x = Tensor(rows(rand(seed + 6, s, b, d), comm, sp), requires_grad=True)
    y = blk(x)
    (y * rows(rand(seed + 7, s, b, d), comm, sp)).sum().backward()
    sync_sequence_parallel_grads(blk, comm)
    out["block"] = (y.data, x.grad, gather_grads(blk, comm))
    return out


def layers_reference(c: dict) -> dict:
    s, b, d, ff, seed = c["seq"], c["batch"], c["d"], c["ff"], c["seed"]
    out = {}
    lin = Linear(d, ff).init_parameters(seed, "c.")
    x = Tensor(rand(seed, s, b, d), requires_grad=True)
    y = lin(x)
    (y * rand(seed + 1, s, b, ff)).sum().backward()
    out["col"] = (y.data, x.grad, lin.weight.grad, lin.bias.grad)
    lin = Linear(ff, d).init_parameters(seed, "r.")
    z = Tensor(rand(seed + 2, s, b, ff), requires_grad=True)
    y = lin(z)
    (y * rand(seed + 3, s, b, d)).sum().backward()
    out["row"] = (y.data, z.grad, lin.weight.grad, lin.bias.grad)
    emb = Embedding(c["vocab"], d).init_parameters(seed, "e.")
    idx = np.random.default_rng(seed).integers(0, c["vocab"], (s, b))
    y = emb(idx)
    (y * rand(seed + 4, s, b, d)).sum().backward()
    out["emb"] = (y.data, emb.weight.grad)
    logits = Tensor(rand(seed + 5, s, b, c["vocab"]), requires_grad=True)
    loss = F.cross_entropy(logits, idx)
    loss.backward()
    out["ce"] = (loss.item(), logits.grad)
    blk = Block(d, c["heads"], ff).init_parameters(seed, "b.")
    x = Tensor(rand(seed + 6, s, b, d).transpose(1, 0, 2), requires_grad=True)  # nn.Block: (batch, seq, d)
    y = blk(x)
    (y * rand(seed + 7, s, b, d).transpose(1, 0, 2)).sum().backward()
    out["block"] = (y.data.transpose(1, 0, 2), x.grad.transpose(1, 0, 2),
                    {n: p.grad for n, p in blk.named_parameters()})
    return out


def check_layers(c: dict, results: list[dict]) -> None:
    ref = layers_reference(c)
    for r, got in enumerate(results):
        class Comm:  # the rank's view, for slicing the reference
            rank, size = r, c["t"]
        sp = c["sp"]
        y, gx, gw, gb = got["col"]
        ry, rgx, rgw, rgb = ref["col"]
        for a, b in ((y, ry), (gx, rows(rgx, Comm, sp)), (gw, rgw), (gb, rgb)):
            np.testing.assert_allclose(a, b, **TOL)
        y, gz, gw, gb = got["row"]
        ry, rgz, rgw, rgb = ref["row"]
        for a, b in ((y, rows(ry, Comm, sp)), (gz, cols(rgz, Comm)), (gw, rgw), (gb, rgb)):
            np.testing.assert_allclose(a, b, **TOL)
        np.testing.assert_allclose(got["emb"][0], rows(ref["emb"][0], Comm, sp), **TOL)
        np.testing.assert_allclose(got["emb"][1], ref["emb"][1], **TOL)
        assert got["ce"][0] == pytest.approx(ref["ce"][0], rel=1e-12)
        np.testing.assert_allclose(got["ce"][1], ref["ce"][1], **TOL)
        y, gx, grads = got["block"]
        ry, rgx, rgrads = ref["block"]
        np.testing.assert_allclose(y, rows(ry, Comm, sp), **TOL)
        np.testing.assert_allclose(gx, rows(rgx, Comm, sp), **TOL)
        assert grads.keys() == rgrads.keys()
        for name in grads:
            np.testing.assert_allclose(grads[name], rgrads[name], err_msg=name, **TOL)


@budget(20)
@given(c=tp_configs())
@example(c=SEQ_EXAMPLES[0])
@example(c=SEQ_EXAMPLES[1])
@example(c=SEQ_EXAMPLES[2])
def test_layers_equal_single_process_threads(c: dict) -> None:
    check_layers(c, launch(layers_run, c["t"], c=c))


# ---- the whole GPT ----------------------------------------------------------------------------------
ADAMW_LR = 1e-2
# Gradients (step 0's): the all-reduces add the ranks' partial sums in another order than one process:
# a few ulps of the largest term, as in test_zero and test_sequence_parallel.
GRAD_TOL = {"rtol": 1e-10, "atol": 1e-12}
# Parameters after the two steps: SGD is linear in the gradients (TOL, the layers' tolerance); AdamW
# adds its drift of gradients GRAD_TOL apart (tests/tolerances.py), large only where the exact gradient
# is zero (the key bias: softmax ignores a shift shared by a query's scores; q and k on one token).


def optimizer(c: dict, params):
    if c["opt"] == "adamw":
        return AdamW(params, lr=ADAMW_LR, weight_decay=0.1)
    return SGD(params, lr=0.1, momentum=0.9)


def gpt_run(comm, c: dict, steps: int = 2) -> dict:
    model = TensorParallelGPT(c["vocab"], c["seq"] + 1, c["d"], c["heads"], c["layers"], comm, c["ff"],
                              sequence_parallel=c["sp"], seed=c["seed"])
    opt = optimizer(c, model.parameters())
    out: dict = {"init": gather_state_dict(model, comm), "losses": []}
    for step in range(steps):
        x, y = batch(c, step)
        if step == 0:
            out["logits"] = gather_logits(model(x), comm)
        with trace.recording(comm.world_rank) as rec:
            loss = model.loss(x, y)
            opt.zero_grad()
            loss.backward()
            model.sync_grads()
            opt.step()
        out["losses"].append(loss.item())
        if step == 0:
            out.update(summarise(rec.events, comm.world_rank), grads=gather_grads(model, comm))
    out["final"] = gather_state_dict(model, comm)
    return out


def gpt_reference(c: dict, steps: int = 2) -> dict:
    model = GPT(c["vocab"], c["seq"] + 1, c["d"], c["heads"], c["layers"], c["ff"], seed=c["seed"])
    opt = optimizer(c, model.parameters())
    out: dict = {"init": model.state_dict(), "losses": [], "step_grads": {n: [] for n, _ in model.named_parameters()}}
    for step in range(steps):
        x, y = batch(c, step)
        if step == 0:
            out["logits"] = model(x).data
        loss = model.loss(x, y)
        opt.zero_grad()
        loss.backward()
        for n, p in model.named_parameters():
            out["step_grads"][n].append(p.grad.copy())
        opt.step()
        out["losses"].append(loss.item())
    out["grads"] = {n: g[0] for n, g in out["step_grads"].items()}
    out["final"] = model.state_dict()
    return out


def check_gpt(c: dict, results: list[dict]) -> None:
    ref, t = gpt_reference(c), c["t"]
    itemsize = 8
    want_bytes = formulas.expected_bytes(t, c["batch"], c["seq"], c["d"], c["layers"], itemsize, c["sp"],
                                         seq_len=c["seq"] + 1)
    want_mem = formulas.activation_bytes(t, c["batch"], c["seq"], c["d"], c["heads"], c["ff"], c["layers"],
                                         c["vocab"], itemsize, c["sp"])
    per_call = formulas.collectives_per_block(c["sp"])
    for got in results:
        for key in ("init", "grads", "final"):
            assert got[key].keys() == ref[key].keys()
        for name in ref["init"]:
            np.testing.assert_allclose(got["init"][name], ref["init"][name], err_msg=f"init {name}", **TOL)
            np.testing.assert_allclose(got["grads"][name], ref["grads"][name], err_msg=f"grads {name}", **GRAD_TOL)
            if c["opt"] == "adamw":
                assert_close_after_adamw(got["final"][name], ref["final"][name], ref["step_grads"][name], ADAMW_LR,
                                         GRAD_TOL, TOL, err_msg=f"final {name}")
            else:
                np.testing.assert_allclose(got["final"][name], ref["final"][name], err_msg=f"final {name}", **TOL)
        np.testing.assert_allclose(got["logits"], ref["logits"], **TOL)
        np.testing.assert_allclose(got["losses"], ref["losses"], rtol=1e-10)
        assert got["peaks"] == want_mem
        for layer in range(c["layers"]):
            for phase, name in (("forward", "F"), ("backward", "B")):
                calls = {op: n for op, n in got["calls"][(layer, name)].items() if n}
                assert calls == (per_call[phase] if t > 1 else {}), (layer, phase, calls)
            sent = {op: n for (lay, op), n in got["block_bytes"].items() if lay == layer}
            want = formulas.block_bytes(t, c["batch"], c["seq"], c["d"], 8, c["sp"]) if t > 1 else {}
            assert sent == want, (layer, sent, want)
    for op, per_rank in want_bytes.items():  # chunks of the loss's all-reduces may differ by rank
        total = sum(got["bytes"].get(op, 0) for got in results)
        assert total == pytest.approx(t * per_rank if t > 1 else 0, rel=1e-12), op
    if t > 1 and c["sp"]:  # the re-gathers: all-gathers exceed reduce-scatters by 2 per block + the head's
        a = c["seq"] * c["batch"] * c["d"] * itemsize
        for got in results:
            assert got["regathers"] == 2 * c["layers"] + 1
            extra = got["bytes"]["allgather"] - got["bytes"]["reduce_scatter"]
            assert extra == (2 * c["layers"] + 1) * (t - 1) * a // t


@budget(20)
@given(c=tp_configs())
@example(c=SEQ_EXAMPLES[0])
@example(c=SEQ_EXAMPLES[1])
@example(c=SEQ_EXAMPLES[2])
def test_gpt_equals_single_process_threads(c: dict) -> None:
    check_gpt(c, launch(gpt_run, c["t"], c=c))


def layers_and_gpt(comm, c: dict) -> tuple[dict, dict]:
    return layers_run(comm, c), gpt_run(comm, c)


@pytest.mark.mpi
@budget(1)  # the simplest drawn job (p = 2) beside the @examples; thorough: 10 drawn jobs
@given(job=mpi_jobs(lambda t: tp_configs(t=t), min_size=2, max_size=3))
@example(job=(2, [SEQ_EXAMPLES[0], config(2, False, 3, "sgd")]))
@example(job=(4, [SEQ_EXAMPLES[1], config(4, False, 2)]))
def test_layers_and_gpt_equal_single_process_mpiexec(job: tuple[int, list[dict]]) -> None:
    """One mpiexec job per drawn t runs a drawn list of configurations."""
    t, cs = job
    for c, results in zip(cs, run_each(layers_and_gpt, t, [{"c": c} for c in cs], timeout=90, comm_timeout=30)):
        check_layers(c, [lay for lay, _ in results])
        check_gpt(c, [gpt for _, gpt in results])


# ---- bad configurations -----------------------------------------------------------------------------
BAD = {  # name: (constructor overrides, phrase the message must contain)
    "heads": ({"heads": 3, "d": 6}, "n_heads=3 is not divisible by t=2"),
    "d_ff": ({"ff": 5}, "d_ff=5 is not divisible by t=2"),
    "vocab": ({"vocab": 7}, "vocab_size=7 is not divisible by t=2"),
    "d_model": ({"d": 9}, "d_model=9 is not divisible by n_heads=2"),
    "tp": ({"tp": 4}, "tp=4 but the communicator has 2 ranks"),
    "seq": ({"sp": True, "seq": 3}, "use a sequence length that is a multiple of 2"),
    "tokens": ({"token": 99}, "must lie in [0, 8); got values in [99, 99]"),
}


def bad_run(comm) -> dict:
    """Every bad configuration on every rank: (error message, comm events recorded before it)."""
    out = {}
    for name, (over, _) in BAD.items():
        c = {"vocab": 8, "seq": 4, "d": 8, "heads": 2, "ff": 8, "sp": False, "tp": None, "token": 0, **over}

        def build_and_run(c: dict = c) -> None:
            model = TensorParallelGPT(c["vocab"], 4, c["d"], c["heads"], 1, comm, c["ff"],
                                      sequence_parallel=c["sp"], tp=c["tp"])
            x = np.full((1, c["seq"]), c["token"])
            model.loss(x, x)

        out[name] = refusal(comm, build_and_run, "accepted")
    return out


def check_bad(results: list[dict]) -> None:
    for got in results:
        assert got == results[0]  # the same error on every rank
        for name, (_, phrase) in BAD.items():
            msg, events = got[name]
            assert phrase in msg, (name, msg)
            assert events == 0, name  # rejected before any message


def test_bad_configurations_rejected_on_every_rank_threads() -> None:
    check_bad(launch(bad_run, 2))


@pytest.mark.mpi
def test_bad_configurations_rejected_on_every_rank_mpiexec() -> None:
    check_bad(run(bad_run, 2, backend="mpi", timeout=60, comm_timeout=20))
