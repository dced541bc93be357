"""HybridGPT on a pp x dp x sp x tp mesh equals one process, and sends on each axis what the formulas say.

Property: for every mesh with product 2, 4 or 8 (tensor or sequence parallelism per stage; pipeline
schedules gpipe, 1f1b, interleaved; Megatron-SP on or off; Ulysses, ring or USP; DDP or ZeRO-1 on the
dp x sp replicas), two AdamW steps on a global batch give the single-process ``nn.GPT``'s losses,
gradients (DDP) and parameters; every rank's bytes on each mesh axis, read from the trace, equal
``minipar.cost.hybrid.traffic_by_axis`` (so no collective runs on the wrong communicator or twice),
and its parameters, gradients and optimizer state equal ``model_state_bytes``. Bad configurations are
refused on every rank with the same message before any message is sent.
"""

from __future__ import annotations

import os
from collections import defaultdict
from contextlib import nullcontext
from types import EllipsisType

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from strategies import budget, hybrid_configs
from tolerances import assert_close_after_adamw

from minipar import nn, trace
from minipar.cost.hybrid import (
    TinyLayout,
    activation_peak_bytes,
    model_state_bytes,
    parameters_per_rank,
    traffic_by_axis,
)
from minipar.mesh import DeviceMesh, MeshShape
from minipar.optim import AdamW
from minipar.parallel.hybrid import HybridGPT
from minipar.testing import run, run_each

LR = 1e-2
STEPS = 2
# Tolerances and why: tests/test_sequence_parallel.py (GRAD_TOL ... LOSS_REL): the same sums taken in
# another order, then two AdamW steps, which turn gradients GRAD_TOL apart into parameters up to
# ``tolerances.adamw_drift`` apart (large only where the exact gradient is zero) beside PARAM_TOL.
GRAD_TOL = {"rtol": 1e-10, "atol": 1e-12}
PARAM_TOL = {"rtol": 1e-10, "atol": 1e-11}
LOSS_REL = [1e-12, 1e-10]


def config(degrees: dict, **kw: object) -> dict:
    base = {"degrees": degrees, "vocab": 16, "seq": 8, "d": 16, "heads": 4, "layers": 4, "batch": 8,
            "schedule": "1f1b", "microbatches": 2, "chunks": 1, "sequence_parallel": False, "sp_method": "ulysses",
            "ulysses": None, "zero_stage": 0, "seed": 3, "layer_counts": None, "zigzag": False}
    return {**base, **kw}


EXAMPLES = [
    config({"pp": 2, "dp": 2, "tp": 2}),
    config({"pp": 2, "dp": 2, "tp": 2}, sequence_parallel=True, zero_stage=1),
    config({"pp": 2, "dp": 2, "sp": 2}, sp_method="ring", schedule="interleaved", chunks=2),
    config({"dp": 2, "sp": 4}, sp_method="hybrid", ulysses=2, microbatches=1, zero_stage=1),
    config({"pp": 4}, schedule="gpipe", microbatches=4),
    config({"dp": 2, "tp": 2}, sequence_parallel=True, microbatches=1),
    config({"pp": 2, "dp": 2}, schedule="naive", layer_counts=(2, 4)),
    config({"dp": 2, "sp": 2}, sp_method="ring", zigzag=True, zero_stage=1),
    config({"pp": 2, "dp": 2}, schedule="zb-h1", zero_stage=1),
    config({"pp": 2, "dp": 2}, schedule="zb-v", chunks=2, microbatches=3, batch=12),
]


def tokens(c: dict, step: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng([c["seed"], step])
    return tuple(rng.integers(0, c.get("token_vocab", c["vocab"]), (c["batch"], c["seq"])) for _ in range(2))


def build(comm, c: dict) -> HybridGPT:
    mesh = DeviceMesh(comm, **c["degrees"])
    return HybridGPT(mesh, c["vocab"], c["seq"], c["d"], c["heads"], c["layers"], schedule=c["schedule"],
                     microbatches=c["microbatches"], chunks=c["chunks"], sequence_parallel=c["sequence_parallel"],
                     sp_method=c["sp_method"], ulysses=c["ulysses"], zero_stage=c["zero_stage"], lr=LR,
                     seed=c["seed"], layers=c.get("layer_counts"), zigzag=c.get("zigzag", False),
                     reshard_after_forward=c.get("reshard_after_forward", True), dtype=c.get("dtype", np.float64))


def slices(model: HybridGPT, attr: str) -> dict[str, tuple[np.ndarray, tuple | None]]:
    """This rank's own piece of every parameter it holds (or of its gradient), with where it sits."""
    return {n: (np.array(getattr(p, attr) if getattr(p, attr) is not None else np.zeros_like(p.data)), p.shard)
            for n, p in model.pipe.named_parameters()}


def hybrid_run(comm, c: dict, path: str) -> dict:
    model = build(comm, c)
    out: dict = {"losses": []}
    with trace.record(path, comm=comm, **model.trace_meta()):
        for step in range(STEPS):
            out["losses"].append(model.forward_backward(*tokens(c, step)))
            if step == 0 and c["zero_stage"] == 0:
                out["grads"], out["grad_slices"] = model.full_grads(), slices(model, "grad")
            if step == STEPS - 1:
                out["states"] = model.state_bytes()
            model.optimizer_step()
    with model.sharded.whole() if model.sharded is not None else nullcontext():  # ZeRO-3: the shards gathered
        out["final_slices"] = slices(model, "data")
    out["final"] = model.full_state_dict()
    return out


def hybrid_reference(c: dict) -> dict:
    model = nn.GPT(c["vocab"], c["seq"], c["d"], c["heads"], c["layers"], seed=c["seed"])
    opt = AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    out: dict = {"losses": [], "step_grads": {n: [] for n, _ in model.named_parameters()}}
    for step in range(STEPS):
        model.zero_grad()
        loss = model.loss(*tokens(c, step))
        loss.backward()
        out["losses"].append(loss.item())
        for n, p in model.named_parameters():
            out["step_grads"][n].append(p.grad.copy())
        opt.step()
    out["grads"] = {n: g[0] for n, g in out["step_grads"].items()}
    out["final"] = model.state_dict()
    return out


def assert_final_equals(got: np.ndarray, ref: dict, name: str, at: tuple | EllipsisType = ...,
                        err_msg: str = "") -> None:
    """``got``, the piece ``at`` of parameter ``name`` after the steps, equals the reference's (PARAM_TOL
    plus AdamW's drift of gradients GRAD_TOL apart)."""
    assert_close_after_adamw(got, ref["final"][name][at], [g[at] for g in ref["step_grads"][name]], LR, GRAD_TOL,
                             PARAM_TOL, err_msg=err_msg or f"final {name}")


def layout_of(c: dict) -> TinyLayout:
    return TinyLayout(c["vocab"], c["seq"], c["d"], c["heads"], c["layers"], 4 * c["d"], c["batch"],
                      microbatches=c["microbatches"], chunks=c["chunks"], sequence_parallel=c["sequence_parallel"],
                      sp_method=c["sp_method"], ulysses=c["ulysses"], zero_stage=c["zero_stage"],
                      stage_layers=c.get("layer_counts"), schedule=c["schedule"],
                      reshard_after_forward=c.get("reshard_after_forward", True), **c["degrees"])


def sent_by_axis(path: str, shape: MeshShape) -> tuple[dict[int, dict[str, int]], dict[int, int]]:
    """Bytes each rank sent, by the mesh axes between sender and receiver (from the sender's events),
    and each rank's peak "activations" memory sample (the pipeline's stash)."""
    out: dict[int, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    peak: dict[int, int] = defaultdict(int)
    for e in trace.load(path).events:
        if e.kind == "comm" and e.rank == e.src:
            out[e.rank][shape.axis_of(e.src, e.dst)] += e.nbytes
        if e.kind == "memory" and e.name == "activations":
            peak[e.rank] = max(peak[e.rank], e.nbytes)
    return out, peak


def check_hybrid(c: dict, results: list[dict], path: str) -> None:
    ref = hybrid_reference(c)
    for step, want in enumerate(ref["losses"]):
        for r, got in enumerate(results):
            assert got["losses"][step] == pytest.approx(want, rel=LOSS_REL[step]), (step, r)
    for r, got in enumerate(results):  # every rank's own pieces, every replica
        assert got["final"].keys() == ref["final"].keys()
        if c["zero_stage"] == 0:
            for name, (piece, where) in got["grad_slices"].items():
                want = ref["grads"][name][where if where is not None else ...]
                np.testing.assert_allclose(piece, want, err_msg=f"rank {r} grads {name}", **GRAD_TOL)
        for name, (piece, where) in got["final_slices"].items():
            assert_final_equals(piece, ref, name, where if where is not None else ..., f"rank {r} final {name}")
    got = results[0]  # and the whole model as full_grads / full_state_dict assemble it
    if c["zero_stage"] == 0:
        for name, want in ref["grads"].items():
            np.testing.assert_allclose(got["grads"][name], want, err_msg=f"grads {name}", **GRAD_TOL)
    for name in ref["final"]:
        assert_final_equals(got["final"][name], ref, name)
    shape, layout = MeshShape(**c["degrees"]), layout_of(c)
    sent, peak = sent_by_axis(path, shape)
    for r, res in enumerate(results):
        want = {a: STEPS * n for a, n in traffic_by_axis(layout, r).items()}
        assert dict(sent[r]) == want, (r, c["degrees"])
        assert res["states"] == model_state_bytes(layout, r), r
        if layout.sp == 1 and layout.chunks == 1 and not c["schedule"].startswith("zb"):  # (a W keeps other bytes)
            assert peak[r] == activation_peak_bytes(layout, r, c["schedule"]), r


@pytest.mark.parametrize("c", EXAMPLES, ids=[str(MeshShape(**c["degrees"])) for c in EXAMPLES])
def test_examples_equal_single_process_threads(c: dict, tmp_path) -> None:
    path = str(tmp_path / "t.json")
    check_hybrid(c, run(hybrid_run, MeshShape(**c["degrees"]).size, "threads", c=c, path=path), path)


@budget(8)
@given(c=st.sampled_from([2, 4, 8]).flatmap(lambda w: hybrid_configs(w)))
def test_drawn_meshes_equal_single_process_threads(c: dict, tmp_path_factory) -> None:
    path = str(tmp_path_factory.mktemp("hy") / "t.json")
    check_hybrid(c, run(hybrid_run, MeshShape(**c["degrees"]).size, "threads", c=c, path=path), path)


def _mpi_job(world: int, fixed: list[dict], drawn: list[dict], tmp: str) -> None:
    cs = fixed + drawn
    paths = [os.path.join(tmp, f"t{i}.json") for i in range(len(cs))]
    jobs = [{"c": c, "path": p} for c, p in zip(cs, paths, strict=True)]
    for c, p, results in zip(cs, paths, run_each(hybrid_run, world, jobs, timeout=240, comm_timeout=60), strict=True):
        check_hybrid(c, results, p)


@pytest.mark.mpi
@budget(1)
@given(drawn=st.lists(hybrid_configs(4), min_size=1, max_size=2))
def test_meshes_of_4_mpiexec(drawn: list[dict], tmp_path_factory) -> None:
    fixed = [config({"pp": 2, "tp": 2}, sequence_parallel=True), config({"dp": 2, "sp": 2}, sp_method="ring",
                                                                        zero_stage=1)]
    _mpi_job(4, fixed, drawn, str(tmp_path_factory.mktemp("hy4")))


@pytest.mark.mpi
@pytest.mark.mpi8
@budget(1)
@given(drawn=st.lists(hybrid_configs(8), min_size=1, max_size=1))
def test_meshes_of_8_mpiexec(drawn: list[dict], tmp_path_factory) -> None:
    _mpi_job(8, [EXAMPLES[0], EXAMPLES[1]], drawn, str(tmp_path_factory.mktemp("hy8")))


# ---- bad configurations: the same message on every rank, no message sent ------------------------------
BAD = [
    (config({"dp": 2, "tp": 2}, heads=3, d=12), "n_heads=3 is not divisible by t=2"),
    (config({"tp": 2, "sp": 2}), "either tensor-parallel"),
    (config({"pp": 4}, layers=2), "2 blocks cannot give each of 4 stages a block"),
    (config({"dp": 4}, sequence_parallel=True), "it needs tp > 1"),
    (config({"sp": 4}, heads=2, d=8), "n_heads=2"),
    (config({"pp": 2, "dp": 2}, zero_stage=4), "zero_stage=4: the data-parallel axis runs DDP (0) or ZeRO stage 1, 2"),
    (config({"pp": 2, "dp": 2}, zero_stage=2, reshard_after_forward=False), "reshard_after_forward=False keeps ZeRO-3"),
    (config({"pp": 2, "dp": 2}, zero_stage=3, dtype=np.float32), "zero_stage=3 trains in float64 here"),
    (config({"pp": 2, "dp": 2}, schedule="interleaved", chunks=2, microbatches=3), "multiple of"),
    (config({"dp": 4}, batch=6), "global batch of 6 is not divisible by dp x m = 4 x 2; use a multiple of 8"),
    (config({"pp": 2}, vocab=12, token_vocab=16), "must lie in [0, 12)"),  # on every rank, not one stage
    (config({"dp": 2}, sp_method="foo"), "sp_method='foo'"),
    (config({"pp": 2}, layer_counts=(3, 2)), "layers=[3, 2] (per virtual stage, counting the embedding"),
]


def bad_run(comm, c: dict, path: str) -> str:
    with trace.record(path, comm=comm):
        try:
            build(comm, c).step(*tokens(c, 0))
        except ValueError as exc:
            return str(exc)
    return "no error"


@pytest.mark.parametrize(("c", "needle"), BAD, ids=[n[:24] for _, n in BAD])
def test_bad_configurations_refused_on_every_rank(c: dict, needle: str, tmp_path) -> None:
    path = str(tmp_path / "t.json")
    msgs = run(bad_run, MeshShape(**c["degrees"]).size, "threads", c=c, path=path)
    assert len(set(msgs)) == 1 and needle in msgs[0], msgs[0]
    assert [e for e in trace.load(path).events if e.kind == "comm"] == []


def holdings_run(comm, c: dict) -> dict:
    return build(comm, c).holdings(c["batch"])


def test_holdings_name_each_ranks_layers_slices_and_rows() -> None:
    c = EXAMPLES[0]  # pp 2 x dp 2 x tp 2: rank = (pp_i x 2 + dp_i) x 2 + tp_i; 4 heads, d_ff 64, vocab 16
    held = run(holdings_run, 8, "threads", c=c)
    shape, layout = MeshShape(**c["degrees"]), layout_of(c)
    for r, h in enumerate(held):
        co = shape.coords(r)
        assert h["layers"] == ("embed, blocks 0-1" if co["pp"] == 0 else "blocks 2-3, head"), r  # head: ln_f + head
        vocab = f"vocab {8 * co['tp']}:{8 * co['tp'] + 8}"  # the embedding's rows or the head's columns
        t = co["tp"]
        assert h["slices"] == f"heads {2 * t}-{2 * t + 1}, fc {32 * t}:{32 * t + 32}, {vocab}"
        assert h["data"] == f"rows {4 * co['dp']}:{4 * co['dp'] + 4}"
        assert h["params"] == parameters_per_rank(layout, co["pp"])
