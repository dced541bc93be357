"""minipar's viewer: Plotly figures, a self-contained HTML report and a rich terminal timeline.

Reads trace files through ``minipar.trace.load`` only; imports nothing else of minipar.

- ``viz.terminal.print_timeline(trace_or_path, console=None, width=None)``: lanes in the terminal.
- ``viz.report.write_report([paths_or_traces], out_html, titles=None)``: one offline HTML file.
- ``viz.figures.timeline / compare / schedule_grid / traffic / memory``: the Plotly figures (for
  notebooks); they live in ``viz.timeline`` (compute and comm lanes; a collective the rank waits in
  inside a compute span is drawn inside it), ``viz.pipeline_grid`` (a schedule as the papers draw it, unit
  costs) and ``viz.figures``, with colours in ``viz.style`` (one per kind) and clock names in ``style.clock``.
- ``viz.ring.ring_figure``: Ring Attention step by step (who holds which K/V block, and the compute
  overlapping the next block's transfer); the report adds it to every trace with ``ring_kv`` messages.
- ``viz.memory_stack``: model states per rank stacked as ZeRO's Fig. 1 (parameters, gradients, optimizer
  state, gathered units) and FSDP's gathered units over time; the report adds them when sampled.
- ``viz.mesh``: a hybrid run's device mesh (which rank holds which stage, slice and replica; one colour per
  sub-communicator) and the bytes each rank sent per mesh axis; the report adds them to a trace with a mesh.
- ``viz.tiers``: bytes per memory tier (device, cpu, nvme) over time per rank and the moves between tiers as
  links; the report adds them to every trace with "transfer" events.
- ``viz.analysis``: the numbers behind them (bubble/idle definition, traffic, memory);
  ``viz.messages``: comm events grouped into collective calls, sends paired with receives, and which
  calls the rank waited in inside a compute span.

Submodules load lazily so that ``import viz`` does not pay for Plotly when only the terminal is used.
"""

from __future__ import annotations

import importlib
from typing import Any

_MODULES = ("analysis", "figures", "memory_stack", "mesh", "messages", "pipeline_grid", "report", "ring", "style",
            "terminal", "tiers", "timeline")
__all__ = [*_MODULES, "print_timeline", "write_report"]


def __getattr__(name: str) -> Any:
    if name in _MODULES:
        return importlib.import_module(f"viz.{name}")
    if name == "print_timeline":
        return importlib.import_module("viz.terminal").print_timeline
    if name == "write_report":
        return importlib.import_module("viz.report").write_report
    raise AttributeError(f"module 'viz' has no attribute {name!r}")
