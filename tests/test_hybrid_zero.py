"""Pipeline with ZeRO-2 and ZeRO-3 / FSDP (issue 30, item 4): ``HybridGPT(zero_stage=2 | 3)``.

Property: for every drawn pp = 2 mesh with dp = 2 (and tp or sp of 2 on 8 ranks), any schedule
(GPipe, 1F1B, interleaved, ZB-H1, ZB-V), ZeRO-2 or ZeRO-3 with ``reshard_after_forward`` on or off, two
AdamW steps give the single-process ``nn.GPT``'s losses and parameters; every rank's bytes per mesh
axis equal ``cost.hybrid.traffic_by_axis`` (one reduce-scatter per step, the gathers counted per
action) and its held model states ``model_state_bytes`` (``test_hybrid.check_hybrid``). Sharded means
sharded: a ZeRO-3 rank's ``parameters`` samples are its shards at every moment, its gathered bytes
peak at ``gathered_peak_bytes`` and are non-zero only inside a compute span (``reshard_after_forward``)
or before the step's reduction (without); and the pipeline's activation samples, measured from the
autograd graph, equal ``activation_peak_bytes``: the graph keeps no gathered stage alive.
"""

from __future__ import annotations

import collections
import os
import threading

import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st
from strategies import budget
from test_hybrid import build, check_hybrid, config, holdings_run, hybrid_run, layout_of

from minipar import nn, trace
from minipar.cost.hybrid import gathered_peak_bytes, model_state_bytes, traffic_by_axis
from minipar.mesh import MeshShape
from minipar.parallel.zero import flat
from minipar.testing import run, run_each

EXAMPLES = [
    config({"pp": 2, "dp": 2}, zero_stage=3),
    config({"pp": 2, "dp": 2}, zero_stage=3, reshard_after_forward=False, schedule="zb-h1"),
    config({"pp": 2, "dp": 2}, zero_stage=2, schedule="interleaved", chunks=2),
    config({"pp": 2, "dp": 2, "tp": 2}, zero_stage=3, sequence_parallel=True),  # pp 2 x dp 2 x tp 2
    config({"pp": 2, "dp": 2, "tp": 2}, zero_stage=3, reshard_after_forward=False, schedule="zb-v", chunks=2,
           microbatches=3, batch=12),
    config({"pp": 2, "dp": 2, "tp": 2}, zero_stage=2, schedule="zb-h1", sequence_parallel=True),
    config({"pp": 2, "dp": 2, "sp": 2}, zero_stage=3, sp_method="ring"),  # the dp x sp replicas: 4 shards
    config({"pp": 2, "dp": 2}, zero_stage=3, schedule="dualpipev", chunks=2, microbatches=4, batch=8),
]


@st.composite
def zero_configs(draw: st.DrawFn, world: int) -> dict:
    """pp = 2, dp = 2 and on 8 ranks tp or sp = 2; a schedule, ZeRO-2 or 3, resharding on or off."""
    degrees = {"pp": 2, "dp": 2}
    if world == 8:
        degrees[draw(st.sampled_from(["tp", "sp"]))] = 2
    schedule = draw(st.sampled_from(["gpipe", "1f1b", "interleaved", "zb-h1", "zb-v"]))
    chunks = 2 if schedule in ("interleaved", "zb-v") else 1
    m = 2 * draw(st.integers(1, 2)) if schedule == "interleaved" else draw(st.integers(1, 3))
    heads, stage = 2 * draw(st.integers(1, 2)), draw(st.sampled_from([2, 3]))
    return config(degrees, vocab=2 * draw(st.integers(3, 5)), seq=4, d=heads * draw(st.sampled_from([2, 4])),
                  heads=heads, layers=2 * chunks + draw(st.integers(0, 1)), batch=2 * m * draw(st.integers(1, 2)),
                  schedule=schedule, microbatches=m, chunks=chunks,
                  sequence_parallel="tp" in degrees and draw(st.booleans()), zero_stage=stage,
                  reshard_after_forward=stage == 2 or draw(st.booleans()), seed=draw(st.integers(0, 2**16)))


def check_sharded(c: dict, path: str) -> None:
    """ZeRO-3's memory samples per rank: the shards only, gathered bytes at the formula's peak and only
    inside a compute span (or, kept, only before the step's ``sync``)."""
    if c["zero_stage"] != 3:
        return
    events, layout = trace.load(path).events, layout_of(c)
    for r in range(layout.world):
        mine = [e for e in events if e.rank == r]
        shards = model_state_bytes(layout, r)["parameters"]
        assert {e.nbytes for e in mine if e.kind == "memory" and e.name == "parameters"} == {shards}, r
        gathered = [e for e in mine if e.kind == "memory" and e.name == "gathered parameters"]
        assert max(e.nbytes for e in gathered) == gathered_peak_bytes(layout, r) > 0, r
        spans = [s for s in mine if s.kind == "compute" and s.name in "FBIW"]
        syncs = sorted(s.t0 for s in mine if s.name == "sync")
        for e in gathered:
            if e.nbytes and c.get("reshard_after_forward", True):
                assert any(s.t0 <= e.t0 <= s.t1 for s in spans), (r, e)
            elif e.nbytes:  # kept from the step's first action to its reduction
                assert any(e.t0 < t for t in syncs), (r, e)


def check(c: dict, results: list[dict], path: str) -> None:
    check_hybrid(c, results, path)
    check_sharded(c, path)


def _threads(c: dict, tmp_path_factory) -> None:
    path = str(tmp_path_factory.mktemp("pz") / "t.json")
    check(c, run(hybrid_run, MeshShape(**c["degrees"]).size, "threads", comm_timeout=60, c=c, path=path), path)


for _c in reversed(EXAMPLES):  # every example runs first, as a stack of @example(c=...)
    _threads = example(c=_c)(_threads)
test_pipeline_zero_equals_single_process_threads = budget(8)(given(
    c=st.sampled_from([4, 8]).flatmap(zero_configs))(_threads))


def _mpi_job(world: int, cs: list[dict], tmp: str) -> None:
    jobs = [{"c": c, "path": os.path.join(tmp, f"t{i}.json")} for i, c in enumerate(cs)]
    for job, results in zip(jobs, run_each(hybrid_run, world, jobs, timeout=300, comm_timeout=60), strict=True):
        check(job["c"], results, job["path"])


@pytest.mark.mpi
@budget(1)
@given(drawn=st.lists(zero_configs(4), min_size=1, max_size=1))
def test_pipeline_zero_pp2_dp2_mpiexec(drawn: list[dict], tmp_path_factory) -> None:
    _mpi_job(4, [*EXAMPLES[:3], EXAMPLES[7], *drawn], str(tmp_path_factory.mktemp("pz4")))


@pytest.mark.mpi
@pytest.mark.mpi8
@budget(1)
@given(drawn=st.lists(zero_configs(8), min_size=1, max_size=1))
def test_pipeline_zero_pp2_dp2_tp2_mpiexec(drawn: list[dict], tmp_path_factory) -> None:
    _mpi_job(8, [*EXAMPLES[3:7], *drawn], str(tmp_path_factory.mktemp("pz8")))


def test_bytes_by_hand() -> None:
    """EXAMPLES[0]'s model (vocab 16, S 8, d 16, 4 blocks, d_ff 64) on pp 2 x dp 2, 1F1B, m = 2: pp rank 0
    runs the embeddings and blocks 0-1, rank 1 blocks 2-3, ln_f and the head, counted from ``nn.GPT``.
    Each stage is one unit of n elements cut in 2 shards of n/2 (n even: no padding); a ring all-gather
    or reduce-scatter over 2 ranks sends one shard, 8 n/2 bytes. ZeRO-3 resharding: m forwards + m
    backwards gather, then one reduce-scatter: 5 shards; kept gathered: 1 + 1; ZeRO-2: reduce-scatter +
    all-gather, 2. Held: ZeRO-3 a shard each of parameters and gradients and two of AdamW's moments,
    the whole stage gathered at most; ZeRO-2 the whole parameters and a shard of the rest."""
    sizes = {n: p.data.size for n, p in nn.GPT(16, 8, 16, 4, 4).named_parameters()}
    stage0 = sum(v for n, v in sizes.items() if n.startswith(("tok_emb", "pos_emb", "blocks.0.", "blocks.1.")))
    stage1 = sum(sizes.values()) - stage0
    assert (stage0, stage1) == (6944, 6848)
    for r, n in ((0, stage0), (4 // 2, stage1)):  # rank = pp_i x 2 + dp_i
        shard = 8 * n // 2
        layouts = {(s, raf): layout_of({**EXAMPLES[0], "zero_stage": s, "reshard_after_forward": raf})
                   for s, raf in ((3, True), (3, False), (2, True))}
        assert traffic_by_axis(layouts[3, True], r)["dp"] == 5 * shard
        assert traffic_by_axis(layouts[3, False], r)["dp"] == 2 * shard
        assert traffic_by_axis(layouts[2, True], r)["dp"] == 2 * shard
        assert model_state_bytes(layouts[3, True], r) == {"parameters": shard, "gradients": shard,
                                                          "optimizer state": 2 * shard}
        assert model_state_bytes(layouts[2, True], r) == {"parameters": 2 * shard, "gradients": shard,
                                                          "optimizer state": 2 * shard}
        assert gathered_peak_bytes(layouts[3, True], r) == gathered_peak_bytes(layouts[3, False], r) == 2 * shard
        assert gathered_peak_bytes(layouts[2, True], r) == 0
    # ZB-H1 splits each backward into I and W: W gathers too, 3 m + 1 = 7 shards
    assert traffic_by_axis(layout_of({**EXAMPLES[0], "schedule": "zb-h1"}), 0)["dp"] == 7 * 8 * stage0 // 2



def test_holdings_count_the_stages_parameters() -> None:
    """Under ZeRO-3 a rank's parameters are freed between actions; ``holdings`` still names its stages'
    parameter counts (6944 on pp rank 0, 6848 on pp rank 1: ``test_bytes_by_hand``)."""
    assert [h["params"] for h in run(holdings_run, 4, "threads", c=EXAMPLES[0])] == [6944, 6944, 6848, 6848]



def _built(comm, c: dict) -> tuple[int, int, int, int]:
    """Build only: this thread's id, the numbers of its ZeRO-3 shards, the two rows per parameter
    ``init_shard`` may draw beyond them (the partial rows at a piece's ends) and its stages' whole count."""
    units = build(comm, c).sharded.units.values()
    shapes = [s for u in units for s in u.layout.shapes]
    shard = sum(u.shard.data.size for u in units)
    slack = sum(2 * int(np.prod(s[1:])) for s in shapes if len(s) > 1)
    return threading.get_ident(), shard, slack, sum(int(np.prod(s)) for s in shapes)


def test_zero3_stages_are_built_sharded(monkeypatch) -> None:
    """Sharded from the start (nn.deferred): building a ZeRO-3 HybridGPT draws on each rank its shard's
    initial values (and at most two rows per parameter more), never its stages' whole parameters, which
    a model built whole and then cut draws; the values are one process's (the equality tests)."""
    drawn: collections.Counter[int] = collections.Counter()
    real = nn.init_values

    def counting(seed, name, full_shape, init, index=None, out=None):
        values = real(seed, name, full_shape, init, index, out)
        drawn[threading.get_ident()] += values.size
        return values

    monkeypatch.setattr(nn, "init_values", counting)
    monkeypatch.setattr(flat, "init_values", counting)
    for degrees in ({"pp": 2, "dp": 2}, {"pp": 2, "dp": 2, "tp": 2}):
        drawn.clear()
        c = {**EXAMPLES[0], "degrees": degrees, "zero_stage": 3}
        for ident, shard, slack, whole in run(_built, MeshShape(**degrees).size, "threads", c=c):
            assert shard <= drawn[ident] <= shard + slack < whole, (degrees, drawn[ident], shard, whole)
