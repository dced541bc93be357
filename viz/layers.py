"""Bytes per transformer layer, read from a trace whose layers record an ``F`` and a ``B`` span each
(``args["layer"]``): the messages a rank sent inside a layer's span are that layer's (lesson 5's
sequence-parallel attentions, whose blocks ``minipar.parallel.sequence.measure`` wraps).

- ``layer_traffic(trace, rank, ops)``: bytes ``rank`` sent inside each layer's ``F`` and ``B`` span.
- ``per_rank(values)``: one number when every rank has it, else one per rank.
- ``layer_table(traces, want, title, ops)``: per run, one layer's bytes forward and backward on every
  rank beside the formula's (and a warning when the layers differ).

Cost: O(S x E) for S spans and E messages.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from minipar.trace import Trace
from viz.width import Table


def layer_traffic(trace: Trace, rank: int, ops: Sequence[str]) -> dict[tuple[int, str], int]:
    """Bytes ``rank`` sent (messages of ``ops``) inside each layer's span: {(layer, "F" or "B"): bytes}."""
    sent = [e for e in trace.events if e.kind == "comm" and e.rank == rank and e.src == rank and e.op in ops]
    out: dict[tuple[int, str], int] = {}
    for span in trace.events:
        layer = span.args.get("layer")
        if span.kind == "compute" and span.rank == rank and span.name in ("F", "B") and isinstance(layer, int):
            out[(layer, span.name)] = sum(e.nbytes or 0 for e in sent if span.t0 <= e.t0 <= span.t1)
    return out


def per_rank(values: Sequence[float]) -> str:
    """One number when every rank has it, else one per rank."""
    return f"{values[0]:,.0f}" if len(set(values)) == 1 else " / ".join(f"{v:,.0f}" for v in values)


def layer_table(traces: Mapping[str, Trace], want: Mapping[str, tuple[float, float]], title: str,
                ops: Sequence[str], show_ops: bool = True) -> Table:
    """Per run (``traces``' keys name them): layer 0's bytes forward and backward on every rank beside
    ``want`` (forward, backward: the formula's), "(layers differ!)" when another layer sent other bytes;
    ``show_ops``: the message kinds seen."""
    table = Table(title=title, title_justify="left")
    for col in ("method", *(("ops",) if show_ops else ()), "forward measured", "forward formula",
                "backward measured", "backward formula"):
        table.add_column(col, justify="right")
    for name, trace in traces.items():
        per = [layer_traffic(trace, r, ops) for r in range(trace.world_size)]
        cells = []
        for i, phase in enumerate(("F", "B")):
            layers = {n for p in per for (_, ph), n in p.items() if ph == phase}
            cells += [per_rank([p[(0, phase)] for p in per]) + ("" if len(layers) == 1 else " (layers differ!)"),
                      f"{want[name][i]:,.0f}"]
        seen = sorted({e.op for e in trace.events if e.kind == "comm" and e.op in ops})
        table.add_row(name, *((", ".join(seen),) if show_ops else ()), *cells)
    return table
