"""``viz.prediction`` shows ``perf.predict``'s step in parts: the parts add up to the predicted step
(compute less its CPU overhead, that overhead, bubble, exposed communication per axis, optimizer), the
table sets them beside a measured step with their ratio, the planner's table lists every ranked layout
and the grid last, and the figure stacks one bar per row and part."""

from __future__ import annotations

import pytest

from minipar.cost import perf, planner, presets
from viz.prediction import parts, parts_figure, plan_table, prediction_table

MODEL, CLUSTER = presets.MODELS["gpt3-175b"], presets.CLUSTERS["a100-selene"]
GRID = perf.Layout(dp=6, tp=8, pp=64, micro_batch=1, global_batch=1536, recompute="full")


def test_parts_add_up_to_the_predicted_step() -> None:
    pred = perf.predict(MODEL, GRID, CLUSTER, uneven_stages=True)
    got = parts(pred)
    assert sum(got.values()) == pytest.approx(pred.step_seconds, rel=1e-12)
    assert got["compute"] == pred.compute_seconds - pred.overhead_seconds and got["bubble"] == pred.bubble_seconds
    table = prediction_table(pred, pred.step_seconds / 2, CLUSTER, "replayed")
    assert [c.header for c in table.columns][-2:] == ["replayed", "predicted / replayed"]
    assert list(table.columns[-1].cells) == ["2.00"] and "Goal: predicted / replayed within 15 %." in table.caption
    brief = prediction_table(pred, pred.step_seconds, CLUSTER, "replayed", detail=False)
    assert [c.header for c in brief.columns] == ["", "predicted step", "replayed", "predicted / replayed"]
    assert brief.caption == "Goal: predicted / replayed within 15 %." and list(brief.columns[-1].cells) == ["1.00"]


def test_the_plan_table_lists_the_ranked_layouts_then_the_grid() -> None:
    ranked = planner.plan(MODEL, 3072, CLUSTER, 1536)
    grid = perf.predict(MODEL, GRID, CLUSTER, uneven_stages=True)
    table = plan_table(ranked, grid, MODEL, 3072, CLUSTER, 1536)
    assert list(table.columns[0].cells) == [*(str(i + 1) for i in range(len(ranked))), "grid"]
    assert list(table.columns[1].cells)[-1] == "6" and "6 x 8 x 64 grid" in str(table.title)
    fig = parts_figure({"grid": parts(grid), "measured": {"replayed": 1.0}}, "title")
    assert {b.name for b in fig.data} == {*parts(grid), "replayed"} and all(len(b.y) == 2 for b in fig.data)
