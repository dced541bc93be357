"""Lesson 9, part 1: the seed's 4x5 by 5x8 matmul under every pair of placements on one mesh axis of
2 ranks (OneFlow's SBP table, Yuan et al. 2021), measured and predicted.

For each pair (A's placement, B's placement) the chooser (``minipar.sharding.propagate``) names the
placements it redistributes A and B to, the output's placement and the bytes; the matmul runs under a
trace and the bytes each rank sent are counted from it. A dimension that 2 does not divide (A's 5
columns, B's 5 rows) cannot be split: those pairs are refused before any message, as every rank says.
"""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import plotly.graph_objects as go

from minipar import trace
from minipar.mesh import DeviceMesh
from minipar.sharding import GlobalTensor, Partial, Replicate, Shard, ops, plan
from minipar.sharding.placement import describe
from minipar.sharding.propagate import matmul_strategies
from viz.analysis import sent_by_op
from viz.width import Table

M, K, N = 4, 5, 8
ONE = [Shard(0), Shard(1), Replicate(), Partial()]


def operands() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    return rng.integers(-3, 4, (M, K)).astype(np.float64), rng.integers(-3, 4, (K, N)).astype(np.float64)


def steps_of(name: str, src: tuple, dst: tuple) -> list[str]:
    return [f"{s.collective.replace('_', '-')} {name}" for s in plan(src, dst) if s.collective != "none"]


def run(mesh: DeviceMesh) -> list[dict[str, Any]]:
    """Every pair on the mesh's ``tp`` axis (2 ranks; other axes compute the same): one row each."""
    x, y = operands()
    rows = []
    for pa, pb in itertools.product(ONE, repeat=2):
        row: dict[str, Any] = {"A": str(pa), "B": str(pb)}
        try:
            a = GlobalTensor.from_global(x, mesh, ("tp",), [pa])
            b = GlobalTensor.from_global(y, mesh, ("tp",), [pb])
        except ValueError as err:  # every rank raises alike, before any message
            rows.append({**row, "refused": str(err).split(";")[0].removeprefix("sharding: ")})
            continue
        na, nb, pc, predicted = matmul_strategies(a, b)[0]
        with trace.recording(mesh.rank) as rec:
            c = ops.matmul(a, b)
        sent = sum(sent_by_op(rec.events, mesh.rank).values())
        right = bool(np.array_equal(c.to_global(), x @ y))
        rows.append({**row, "needs": f"{describe(na)} x {describe(nb)}", "C": describe(pc)[1:-1],
                     "how": ", ".join(steps_of("A", (pa,), na) + steps_of("B", (pb,), nb)) or "none (local)",
                     "predicted": int(predicted), "sent": int(sent), "equal": right})
    return rows


def table(rows: list[dict[str, Any]]) -> Table:
    t = Table(title=f"C = A @ B, A {M}x{K}, B {K}x{N} float64, on 2 ranks: bytes one rank sends",
              title_justify="left")
    for col in ("A", "B", "needs", "C", "collective", "predicted", "measured", "C == A @ B"):
        t.add_column(col, justify="right" if col in ("predicted", "measured") else "left")
    for r in rows:
        if "refused" in r:
            t.add_row(r["A"], r["B"], f"[dim]refused: {r['refused']}[/dim]", "", "", "", "", "")
        else:
            t.add_row(r["A"], r["B"], r["needs"], r["C"], r["how"], str(r["predicted"]), str(r["sent"]),
                      "yes" if r["equal"] else "[red]no[/red]")
    return t


def figure(rows: list[dict[str, Any]]) -> go.Figure:
    """Bytes per pair, predicted vs measured, coloured by the output's placement."""
    done = [r for r in rows if "refused" not in r]
    labels = [f"{r['A']} x {r['B']}" for r in done]
    fig = go.Figure([go.Bar(name="predicted (cost.sharding)", x=labels, y=[r["predicted"] for r in done],
                            marker_color="#bbbbbb"),
                     go.Bar(name="measured (trace)", x=labels, y=[r["sent"] for r in done],
                            text=[f"-> {r['C']}" for r in done], textposition="outside", marker_color="#4c78a8")])
    fig.update_layout(barmode="group", height=380, title=f"the seed's {M}x{K} @ {K}x{N} matmul: bytes one rank "
                      "sends to make each pair of placements legal (label: C's placement)",
                      yaxis_title="bytes sent per rank", xaxis_title="A's placement x B's placement")
    return fig
