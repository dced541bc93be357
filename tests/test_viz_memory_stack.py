"""``viz.memory_stack`` reads model states from memory samples: a label holds its latest sample until
the next one; "before the step" is the instant the last "opt" span starts; "at the peak" the first
instant of the largest total. Checked on a hand-written trace whose numbers are chosen below, and on
a real FSDP step (gathered units drawn per rank; the report adds the stacked figure)."""

from __future__ import annotations

import numpy as np

from minipar import nn, trace
from minipar.comm import Communicator, launch
from minipar.parallel.zero import FullyShardedDataParallel
from minipar.trace import Event, Trace
from viz import memory_stack as ms
from viz.report import figures_for, render


def sample(rank: int, t: float, name: str, nbytes: int) -> Event:
    return Event(rank, "memory", name, t, t, nbytes=nbytes)


def hand_trace() -> Trace:
    """Rank 0: parameters 100 throughout; gradients 40 at t=2, 10 at t=4 (reduced); optimizer state 30;
    "gradient buckets" 50 at t=3 only (its peak: 100 + 40 + 30 + 50 = 220); opt span from t=5."""
    events = [sample(0, 1.0, "parameters", 100), sample(0, 1.0, "optimizer state", 30),
              sample(0, 2.0, "gradients", 40), sample(0, 3.0, "gradient buckets", 50),
              sample(0, 3.5, "gradient buckets", 0), sample(0, 4.0, "gradients", 10),
              Event(0, "compute", "opt", 5.0, 6.0), sample(0, 6.0, "gradients", 0)]
    return Trace({"world_size": 1}, events)


def test_states_before_the_step_and_at_the_peak() -> None:
    t = hand_trace()
    assert ms.has_model_states(t)
    assert ms.labels_of([t]) == ["parameters", "gradients", "optimizer state", "gradient buckets"]
    assert ms.before_step(t, 0) == {"parameters": 100, "optimizer state": 30, "gradients": 10, "gradient buckets": 0}
    assert ms.at_peak(t, 0) == {"parameters": 100, "optimizer state": 30, "gradients": 40, "gradient buckets": 50}
    fig = ms.stacks_figure([t], ["hand"])
    bars = {(b.name, b.yaxis): list(b.y) for b in fig.data if b.type == "bar"}
    assert bars[("gradients", "y")] == [10] and bars[("gradients", "y2")] == [40]
    assert bars[("gradient buckets", "y")] == [0] and bars[("gradient buckets", "y2")] == [50]
    totals = [list(s.y) for s in fig.data if s.type == "scatter"]
    assert totals == [[140], [220]]


def fsdp_step(comm: Communicator, path: str) -> None:
    with nn.deferred():
        model = nn.GPT(16, 8, 8, 2, 2, seed=0)
    fsdp = FullyShardedDataParallel(model, comm)
    tokens = np.arange(16).reshape(2, 8) % 16
    with trace.record(path, comm):
        fsdp.backward(model.loss(tokens[comm.rank:comm.rank + 1], np.roll(tokens, -1, 1)[comm.rank:comm.rank + 1]))
        fsdp.step()


def test_fsdp_trace_gets_the_gathered_figure_and_the_stack(tmp_path) -> None:
    path = str(tmp_path / "fsdp.json")
    launch(fsdp_step, 2, "threads", path=path)
    t = trace.load(path)
    # 2 ranks; units: tok_emb 16x8, pos_emb 8x8, 2 blocks, ln_f 2x8, head 8x16, each padded to even: no padding
    block = 2 * 8 + 8 * 24 + 24 + 8 * 8 + 8 + 2 * 8 + 8 * 32 + 32 + 32 * 8 + 8
    sizes = [128, 64, block, block, 16, 128]
    gathered = [e.nbytes for e in t.select("memory", rank=0, name="gathered units")]
    assert max(gathered) == 8 * max(a + b for a, b in zip(sizes, sizes[1:], strict=False))
    assert ms.before_step(t, 0)["gathered units"] == 0
    assert ms.before_step(t, 0)["parameters"] == 8 * sum(sizes) // 2
    fig = ms.gathered_figure(t)
    assert [max(s.y) for s in fig.data] == [max(gathered), max(e.nbytes for e in t.select(
        "memory", rank=1, name="gathered units"))]
    assert [k for k, _, _ in figures_for(t, "fsdp")][-1] == "gathered"
    page = render([t], ["fsdp"])
    assert 'id="fig-model-states"' in page and 'id="fig-fsdp-step"' in page
    step = ms.fsdp_step_figure(t)
    curves = [s for s in step.data if s.type == "scatter" and s.name and s.name.endswith("gathered")]
    assert [max(s.y) for s in curves] == [max(s.y) for s in fig.data]
    # the forward unit by unit: gathered while computing = this unit + the prefetched next one (padded)
    table = ms.fsdp_forward_table(t, sizes, 2)
    cells = [list(c.cells) for c in table.columns]
    assert cells[2] == cells[3] == [f"{8 * (a + b):,}" for a, b in zip(sizes, [*sizes[1:], 0], strict=True)]
    assert cells[4][-1] == "0" and len(ms.allgather_calls(t, 2)) == 2 * len(sizes)


def test_totals_table_by_run_and_world_size() -> None:
    t = hand_trace()  # before the step: parameters 100 + optimizer state 30 + gradients 10 + buckets 0
    runs = {(name, n): t for name in ("DDP", "ZeRO-1") for n in (1, 2)}
    table, equal = ms.totals_table(runs, dict.fromkeys(runs, 140), "title")
    assert equal and [c.header for c in table.columns] == ["run", "N = 1", "N = 2"]
    assert list(table.columns[0].cells) == ["DDP", "ZeRO-1"] and list(table.columns[2].cells) == ["140", "140"]
    assert not ms.totals_table(runs, {**dict.fromkeys(runs, 140), ("ZeRO-1", 2): 141}, "title")[1]
