"""The offload methods' runs read from their traces (lesson 7): step times from the "step" / "flush"
marks, the delayed CPU AdamW against its formula, and the tables that set measured bytes beside
``minipar.cost.offload``'s. Every trace here is a whole run, traced from building the wrapper on, with
a "step" mark at each step's start and a "flush" mark after the last (``viz.tiers.per_step_moves``).

- ``step_parts(trace, rank)``: medians over the steps after the first of the step, its forward +
  backward spans and the CPU AdamW span, on the trace's clock.
- ``hidden_ms(trace, rank)``: the delayed (DPU) CPU AdamW: its total, the part inside forward or
  backward spans, the steps' wait for it, and that wait by the formula.
- ``step_time(trace, rank)``: medians over the steps after the first of the step and of its moves'
  measured and modelled seconds.
- ``sweep_row(trace, method, budget, bandwidth)``: one row of a device-budget sweep (``sweep_table``,
  ``viz.tiers.budget_figure``): step time, bytes per step, their measured and modelled time.
- ``offload_bytes_table``, ``dpu_table``, ``moves_table``, ``infinity_table``, ``chunks_table``,
  ``sweep_table``: the terminal's, each run's measured numbers beside the formula's the caller gives.

Cost: O(E log E) for E events.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from typing import Any

from minipar.trace import Event, Trace
from viz import style
from viz.tiers import moves, per_step_moves
from viz.width import Table


def _windows(trace: Trace, rank: int) -> list[tuple[float, float]]:
    """(start, end) of steps 1.. on ``rank``: from each "step" mark to the next, the last to "flush"."""
    marks = sorted(e.t0 for e in trace.select("mark", rank=rank) if e.name in ("step", "flush"))
    return list(zip(marks[1:-1], marks[2:], strict=True))


def step_parts(trace: Trace, rank: int = 0) -> dict[str, float]:
    """Medians over the steps after the first, on the trace's clock: the step, its forward + backward
    spans (``fb``), the CPU AdamW span (``adam``; 0 without one)."""
    bounds, spans = _windows(trace, rank), trace.select("compute", rank=rank)
    adam = [e.duration for e in spans if e.name == "cpu adam"]
    return {"step": statistics.median(b - a for a, b in bounds),
            "fb": statistics.median(sum(e.duration for e in spans if e.name in ("F", "B") and a <= e.t0 < b)
                                    for a, b in bounds),
            "adam": statistics.median(adam) if adam else 0.0}


def hidden_ms(trace: Trace, rank: int = 0) -> dict[str, float]:
    """The delayed CPU AdamW on ``rank``, in ms: its total, the part inside F or B spans, how long the
    steps waited for it, and that wait by the formula: per job, max(0, AdamW - the rank's work from its
    post to its wait), the AdamW on a core of its own beside that work."""
    spans = trace.select("compute", rank=rank)
    fb = [(e.t0, e.t1) for e in spans if e.name in ("F", "B")]
    adam = [e for e in spans if e.name == "cpu adam" and e.args.get("delayed")]
    job = {(e.name, e.args["job"]): e.t0 for e in trace.select("mark", rank=rank) if e.args.get("cid") == "cpu adam"}
    ends = [(job[("async posted", k)], job[("async wait", k)], job[("async end", k)]) for _, k in
            sorted(key for key in job if key[0] == "async end")]
    return {"total": sum(e.duration for e in adam) * 1e3,
            "inside": sum(max(0.0, min(e.t1, b) - max(e.t0, a)) for e in adam for a, b in fb) * 1e3,
            "waited": sum(max(0.0, end - wait) for _, wait, end in ends) * 1e3,
            "formula": sum(max(0.0, e.duration - (wait - post)) for e, (post, wait, _) in
                           zip(sorted(adam, key=lambda e: e.t0), ends, strict=True)) * 1e3}


def step_time(trace: Trace, rank: int = 0) -> dict[str, float]:
    """Medians over steps 1..: the step's time and its moves' measured and modelled seconds."""
    windows, mine = _windows(trace, rank), moves(trace, rank)

    def median(value: Callable[[Event], float]) -> float:
        return statistics.median(sum(value(e) for e in mine if a <= e.t0 < b) for a, b in windows)

    return {"step": statistics.median(b - a for a, b in windows), "measured": median(lambda e: e.duration),
            "modelled": median(lambda e: e.args["modelled_s"])}


def sweep_row(trace: Trace, method: str, budget: int, bandwidth: Any) -> dict[str, Any]:
    """Rank 0's medians over steps 1..: step time, bytes moved per step, their measured time and their
    time at ``bandwidth`` (a ``minipar.tiers.Bandwidth``; per link: bytes / the link's bandwidth)."""
    t, steps = step_time(trace), per_step_moves(trace, 0)[1:-1]
    modelled = [sum(bandwidth.seconds(*k.split("->"), b) for k, b in s.items()) for s in steps]
    return {"method": method, "budget": budget, "step_s": t["step"], "bytes": statistics.median(
        sum(s.values()) for s in steps), "moves_s": t["measured"], "modelled_s": statistics.median(modelled)}


def _per_step(values: list[int]) -> str:
    """One number when every step moved the same, else one per step."""
    return f"{values[0]:,}" if len(set(values)) == 1 else " ".join(f"{v:,}" for v in values)


def offload_bytes_table(traces: dict[str, Trace], items: dict[str, int], want: dict[str, dict[str, int]], n: int,
                        verbose: bool = True) -> Table:
    """Bytes between device and CPU per step on each rank of each ZeRO-Offload run (title: trace, its
    bytes per item and ``zero_offload_bytes``' ``want``); ``verbose`` adds the setup, the flush and
    whether every rank moved the same."""
    table = Table(title=f"bytes between device and CPU per step on each rank (N = {n}), measured from the trace",
                  title_justify="left",
                  caption="setup: the working parameters placed once when the wrapper is built. Formula: "
                          "zero_offload_bytes(bucket sizes, item, item, dp=N): each padded bucket's 1/N, "
                          "gradients down and parameters up. DPU: step i's update goes up during step i + 1 "
                          "(the last one at flush)." if verbose else None, caption_justify="left")
    for col in ("run", "item B", *(("setup up",) if verbose else ()), "per step: down", "per step: up",
                *(("flush up",) if verbose else ()), "formula down / up", *(("every rank",) if verbose else ())):
        table.add_column(col, justify="right")
    for title, trace in traces.items():
        per_rank = [per_step_moves(trace, r) for r in range(n)]
        setup, steps, flush = per_rank[0][0], per_rank[0][1:-1], per_rank[0][-1]
        down, up = (_per_step([s.get(k, 0) for s in steps]) for k in ("device->cpu", "cpu->device"))
        table.add_row(title, str(items[title]), *((f"{setup.get('cpu->device', 0):,}",) if verbose else ()), down, up,
                      *((f"{flush.get('cpu->device', 0):,}",) if verbose else ()),
                      f"{want[title]['device->cpu']:,} / {want[title]['cpu->device']:,}",
                      *(("same" if all(p == per_rank[0] for p in per_rank) else "differ",) if verbose else ()))
    return table


def dpu_table(traces: dict[str, Trace], label: str, short: str, verbose: bool = True) -> Table:
    """One step's time (rank 0, median of steps 1..) of three runs, titled by ``traces``' keys: ZeRO-2
    in memory, ZeRO-Offload, ZeRO-Offload with DPU, on the clock ``label`` / ``short`` names; and the
    model from each run's own F+B and AdamW and the offload run's rest (its step less those two:
    collectives, copies between tiers, bookkeeping): no DPU F+B + AdamW + rest, DPU max(F+B, AdamW) + rest."""
    table = Table(title=f"time of one step in ms, {label} (rank 0, median of steps 1..)", title_justify="left",
                  caption="modelled: the run's F+B and AdamW and the offload run's rest (its step less the two: "
                          "collectives, copies between tiers, bookkeeping); the CPU AdamW after forward and backward "
                          "(no DPU) or beside the next ones on a core of its own (DPU: max(F+B, AdamW))."
                          if verbose else None, caption_justify="left")
    for col in ("run", "F+B", "CPU AdamW", f"step {short}", "step modelled"):
        table.add_column(col, justify="right")
    (zero2, t0), (offload, t1), (dpu, t2) = traces.items()
    p0 = step_parts(t1)
    rest = max(0.0, p0["step"] - p0["fb"] - p0["adam"])
    table.add_row(zero2, "-", "-", f"{step_parts(t0)['step'] * 1e3:.2f}", "-")
    for title, p in ((offload, p0), (dpu, step_parts(t2))):
        modelled = (max(p["fb"], p["adam"]) if title == dpu else p["fb"] + p["adam"]) + rest
        table.add_row(title, *(f"{p[k] * 1e3:.2f}" for k in ("fb", "adam", "step")), f"{modelled * 1e3:.2f}")
    return table


def moves_table(trace: Trace, bandwidth: Any) -> Table:
    """Every move of rank 0, measured beside the time of ``bandwidth`` (a ``minipar.tiers.Bandwidth``), ms."""
    table = Table(title=style.with_clock("every move between tiers on rank 0 (times in ms)", trace),
                  title_justify="left", caption="modelled: latency + nbytes / bandwidth of the link crossed "
                  f"(host <-> device {bandwidth.pcie / 1e9:.3g} GB/s, NVMe read {bandwidth.nvme_read / 1e9:.3g}, write "
                  f"{bandwidth.nvme_write / 1e9:.3g}; {bandwidth.source}); measured: this machine's copies and file "
                  "I/O.", caption_justify="left")
    for col in ("move", "bytes", "measured", "modelled"):
        table.add_column(col, justify="right")
    for e in moves(trace, rank=0):
        table.add_row(f"{e.args['src']} -> {e.args['dst']}", f"{e.nbytes:,}", f"{e.duration * 1e3:.3f}",
                      f"{e.args['modelled_s'] * 1e3:.3f}")
    return table


def infinity_table(trace: Trace, want: dict[str, int], n: int, manifest: int) -> Table:
    """ZeRO-Infinity's bytes between tiers per step on rank 0 against ``want`` (``zero_infinity_bytes``
    on ``n`` ranks, plus the ``manifest`` bytes each applied step writes)."""
    table = Table(title=f"ZeRO-Infinity: bytes between tiers per step on rank 0 (N = {n}, float64), measured vs "
                        "zero_infinity_bytes", title_justify="left",
                  caption="nvme->cpu: this rank's shard before each unit's forward and backward (2 x 8 s) and the "
                          "step's reads of shard and moments (24 s); cpu->nvme: the step's writes (24 s) and the "
                          f"manifest that commits them ({manifest} bytes); cpu->device: the shard up twice (16 s); "
                          "device->cpu: the gradient partition (8 s); s = Psi / N.",
                  caption_justify="left")
    steps = per_step_moves(trace, 0)[1:-1]
    for col in ("move", *(f"step {i}" for i in range(len(steps))), "formula"):
        table.add_column(col, justify="right")
    for key in want:
        table.add_row(key, *(f"{s.get(key, 0):,}" for s in steps), f"{want[key]:,}")
    return table


def chunks_table(results: dict[tuple[str, str], dict[str, Any]], traces: dict[tuple[str, str], Trace],
                 want: dict[tuple[str, str], int]) -> Table:
    """PatrickStar's chunks per (model, policy): bytes up per step against ``want`` (chunk bytes x
    misses: ``chunk_offload_bytes``)."""
    table = Table(title="PatrickStar chunks on one rank: bytes up (cpu -> device) per step, LRU vs the warm-up's "
                        "order", title_justify="left",
                  caption="step 0 is the warm-up (both policies evict by recency while it records the order). "
                          "formula: chunk bytes x misses; GPT: in_order_misses(C, k) = C + (C - k); the loop "
                          "(layers 0 1 2 0) by hand: LRU 5, warm-up order 4 (tests/test_chunks.py).",
                  caption_justify="left")
    for col in ("model", "policy", "chunks C", "fit k", "budget (acts + k chunks)", "peak", "up per step",
                "formula"):
        table.add_column(col, justify="right")
    for key, r in results.items():
        steps = per_step_moves(traces[key], 0)[1:-1]
        table.add_row(*key, str(r["chunks"]), str(r["fit"]), f"{r['acts']:,} + {r['fit']} x {r['chunk_bytes']:,}",
                      f"{r['peak']:,}", " ".join(f"{s.get('cpu->device', 0):,}" for s in steps), f"{want[key]:,}")
    return table


def sweep_table(rows: Sequence[dict[str, Any]], n: int) -> Table:
    """A device-budget sweep's rows (``sweep_row`` plus ``formula``, and ``fit`` / ``chunks`` for chunks)."""
    table = Table(title=f"step time vs device budget on rank 0, wall clock (the files' and copies' own time: a "
                        f"replay does not model it; N = {n}; chunks: one rank, half the batch; ms, medians of "
                        "steps 1..; bytes per step)", title_justify="left",
                  caption="bytes: every move between tiers in one step; modelled: those bytes at the Bandwidth "
                          "model (PCIe 16 GB/s, NVMe read 3, write 2 GB/s), link by link; measured: this machine's "
                          "copies and fsync'ed files, on a shared machine: they vary from run to run. The last "
                          "budget of ZeRO-Offload and ZeRO-Infinity holds ZeRO-2's model states: they move the "
                          "same bytes at every budget (their schedules ignore spare memory); the chunks' last "
                          "budget holds every chunk beside the activations (k of C chunks fit). formula: "
                          "zero_offload_bytes, zero_infinity_bytes (+ the manifest), chunk_offload_bytes with "
                          "in_order_misses(C, k), both directions.",
                  caption_justify="left", key=2)  # split to fit: each part keeps the method and the budget
    for col in ("method", "device budget", "step measured", "bytes per step", "formula", "moves measured",
                "moves modelled"):
        table.add_column(col, justify="right", no_wrap=col == "method")
    for r in rows:
        name = r["method"] + (f", k = {r['fit']} of {r['chunks']}" if "fit" in r else "")
        table.add_row(name, f"{r['budget']:,}", f"{r['step_s'] * 1e3:.2f}", f"{r['bytes']:,.0f}", f"{r['formula']:,}",
                      f"{r['moves_s'] * 1e3:.3f}", f"{r['modelled_s'] * 1e3:.4f}")
    return table
