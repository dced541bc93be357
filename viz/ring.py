"""Ring Attention drawn step by step (Liu et al. 2023, "Ring Attention with Blockwise Transformers",
Sec. 3 and Fig. 2): who holds which key/value block at which ring step, where it goes next, and,
on the real time axis, the compute on block k while block k+1 travels.

Read from the trace alone: the ``ring_kv`` messages (``step`` = ring step, ``chunk`` = the K/V
block the message carries, sent to rank r+1 and received from rank r-1) and the ``attention F``
spans (``step``, ``chunk``: one span per score block computed). One **pass** of the ring is one
attention call: P_r - 1 sends per rank. Passes come in time order, so on a model whose every
layer runs Ring Attention once, forward pass i is layer i's forward (the backward's passes follow).

- ``ring_steps(trace, index)``: per rank, per step of forward pass ``index``: the block held, the
  score blocks computed on it (with their times) and the receive of the next block (with its time,
  from posting the receive to the wait that ends it).
- ``compute_time(step)``, ``exposed_wait(step)``: the step's score-block time, and how long the rank
  still waited for the next block after that compute (the transfer the compute did not hide).
- ``step_table(trace, index)``: the same numbers as a rich table, for the terminal.
- ``overlap_summary(trace, link_seconds, network, clock)``: one sentence: forward pass 0's longest
  wait for a block against the alpha-beta formula's, max(0, alpha + n beta - the compute beside it).
- ``score_spans(trace, rank)``: the ``attention F`` spans, one per score block computed.
- ``ring_figure(trace, title)``: two panels. Top, the ring as a step x rank grid: each cell names the
  K/V block the rank computes on at that step (one colour per block; pale when the causal mask hides
  the whole block and no score is computed) and an arrow to the rank that holds it at the next step.
  Bottom, the same pass on the trace's clock (``style.clock``: replayed or wall clock): per rank one
  lane of score-block compute and one of the incoming next block, in the same colours, so a receive
  bar spanning a compute bar is transfer overlapped with compute.

Cost: O(E log E) for E events.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from statistics import median

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from minipar.trace import Event, Trace
from viz import analysis as A
from viz import style
from viz.style import rank_color, shade
from viz.width import Table

KV = "ring_kv"


@dataclass
class Step:
    """One rank at one ring step of one pass."""

    rank: int
    step: int
    block: int  # the K/V block the rank holds (and computes on) at this step
    spans: list[Event] = field(default_factory=list)  # score blocks computed on it
    incoming: Event | None = None  # receive of the next block (None at the last step)
    outgoing: Event | None = None  # send of this block to the next rank


def is_ring(trace: Trace) -> bool:
    """True when the trace holds Ring Attention's K/V messages."""
    return any(e.kind == "comm" and e.op == KV for e in trace.events)


def ring_size(trace: Trace) -> int:
    """P_r: ring steps per pass (the K/V messages' steps run 0 .. P_r - 2)."""
    return 2 + max((e.step or 0 for e in trace.events if e.kind == "comm" and e.op == KV), default=-1)


def _mine(trace: Trace, rank: int, direction: str) -> list[Event]:
    return sorted((e for e in trace.events if e.kind == "comm" and e.op == KV and e.rank == rank
                   and (e.src == rank) == (direction == "send")), key=lambda e: e.t0)


def ring_steps(trace: Trace, index: int = 0) -> dict[int, list[Step]]:
    """Forward pass ``index`` of the ring, per rank (ranks without K/V messages are left out): one
    ``Step`` per ring step. Raises ``ValueError`` when the trace has fewer passes."""
    hops = ring_size(trace) - 1
    out: dict[int, list[Step]] = {}
    for rank in range(trace.world_size):
        sends, recvs = _mine(trace, rank, "send"), _mine(trace, rank, "recv")
        if not sends:
            continue
        if len(sends) < (index + 1) * hops:
            raise ValueError(f"rank {rank} has {len(sends) // hops} ring passes, no pass {index}")
        mine, got = sends[index * hops:(index + 1) * hops], recvs[index * hops:(index + 1) * hops]
        start = mine[0].t0
        end = sends[(index + 1) * hops].t0 if len(sends) > (index + 1) * hops else float("inf")
        spans = [e for e in trace.events if e.kind == "compute" and e.name == "attention F" and e.rank == rank
                 and start <= e.t0 < end]
        blocks = [mine[0].chunk or 0] + [e.chunk or 0 for e in got]
        out[rank] = [Step(rank, s, blocks[s], [e for e in spans if e.step == s],
                          got[s] if s < hops else None, mine[s] if s < hops else None)
                     for s in range(hops + 1)]
    return out


def compute_time(st: Step) -> float:
    """Time the rank spent on this step's score blocks."""
    return sum(e.t1 - e.t0 for e in st.spans)


def exposed_wait(st: Step) -> float | None:
    """Time the rank still waited for the next block after this step's compute ended: the part of
    the transfer the compute did not hide (0 when the block had arrived); None at the last step."""
    if st.incoming is None:
        return None
    done = max((e.t1 for e in st.spans), default=st.incoming.t0)
    return max(0.0, st.incoming.t1 - done)


def step_table(trace: Trace, index: int = 0) -> Table:
    """Forward pass ``index`` as a rich table: per rank and ring step, the K/V block, the compute on
    it and the wait for the next block left after that compute (times in ms, or the trace's unit)."""
    steps = ring_steps(trace, index)
    scale, unit = (1e3, "ms") if A.time_unit(trace) == "s" else (1.0, A.time_unit(trace))
    table = Table(title=style.with_clock(f"ring pass {index} (forward): K/V block, compute on it / wait for the next "
                                         f"block after that compute, {unit}", trace), title_justify="left",
                  caption="a wait near 0: the next block arrived while the rank computed (the transfer was hidden)",
                  caption_justify="left")
    table.add_column("rank", justify="right")
    for s in range(ring_size(trace)):
        table.add_column(f"step {s}", justify="right")
    for r, row in sorted(steps.items()):
        cells = []
        for st in row:
            wait = exposed_wait(st)
            cells.append(f"K/V {st.block}: {compute_time(st) * scale:.2f}"
                         + ("" if wait is None else f" / {wait * scale:.2f}"))
        table.add_row(str(r), *cells)
    return table


def overlap_summary(trace: Trace, link_seconds: Callable[[int], float], network: str, clock: str) -> str:
    """Forward pass 0 against the formula's wait for a block, max(0, alpha + n beta - the compute
    beside it), ``link_seconds(n)`` being alpha + n beta on the ``network``'s link, in one sentence
    naming the trace's ``clock``."""
    n = max(e.nbytes or 0 for e in trace.events if e.op == KV)
    hop, steps = link_seconds(n), [st for r in ring_steps(trace).values() for st in r if st.incoming]
    computed = [compute_time(st) * 1e3 for st in steps]
    blocked = max(st.incoming.t1 - (st.incoming.tw or st.incoming.t1) for st in steps) * 1e3
    return (f"A K/V block ({n:,} B) crosses a {network} link in alpha + n beta = {hop * 1e6:.0f} us, under "
            f"a block's compute (median {median(computed):.2f} ms): the formula's wait for it is at most "
            f"{max(0.0, hop * 1e3 - min(computed)):.2f} ms; {clock}, no rank waited more than {blocked:.2f} ms.")


def score_spans(trace: Trace, rank: int | None = None) -> list[Event]:
    """The ``attention F`` spans of ``rank`` (every rank: None), one per score block computed."""
    return [e for e in trace.events if e.kind == "compute" and e.name == "attention F"
            and (rank is None or e.rank == rank)]


def _grid(fig: go.Figure, steps: dict[int, list[Step]], ranks: list[int]) -> None:
    """Top panel: cells (step, rank) with the block held, arrows to where it goes next."""
    row = {r: i for i, r in enumerate(ranks)}
    xs, ys, texts, hovers, colors = [], [], [], [], []
    for r in ranks:
        for st in steps[r]:
            masked = not st.spans
            fig.add_shape(type="rect", x0=st.step - 0.38, x1=st.step + 0.38, y0=row[r] - 0.36, y1=row[r] + 0.36,
                          fillcolor=shade(rank_color(st.block), 1 if masked else 0, 2),
                          line={"color": "white", "width": 1}, layer="below", row=1, col=1)
            what = "masked: skipped" if masked else f"{len(st.spans)} score block{'s' * (len(st.spans) > 1)}"
            xs.append(st.step)
            ys.append(row[r])
            texts.append(f"<b>K/V {st.block}</b><br>{what}")
            colors.append("#555555" if masked else "white")
            nxt = f"; sends it to rank {st.outgoing.dst}" if st.outgoing is not None else "; last step"
            hovers.append(f"rank {r}, ring step {st.step}: computes on K/V block {st.block} ({what}){nxt}")
            if st.outgoing is not None:
                dst = st.outgoing.dst
                fig.add_annotation(x=st.step + 1 - 0.4, y=row[dst], ax=st.step + 0.4, ay=row[r], xref="x", yref="y",
                                   axref="x", ayref="y", showarrow=True, arrowhead=3, arrowsize=1.2,
                                   arrowwidth=1.5, arrowcolor=rank_color(st.block), opacity=0.8, text="")
    fig.add_trace(go.Scatter(x=xs, y=ys, mode="text", text=texts, textfont={"size": 12, "color": colors},
                             hovertext=hovers, hovertemplate="%{hovertext}<extra></extra>", showlegend=False),
                  row=1, col=1)
    hops = max(len(s) for s in steps.values())
    fig.update_xaxes(tickmode="array", tickvals=list(range(hops)), ticktext=[f"step {s}" for s in range(hops)],
                     range=[-0.5, hops - 0.5], showgrid=False, zeroline=False, row=1, col=1)
    fig.update_yaxes(tickmode="array", tickvals=list(range(len(ranks))), ticktext=[f"rank {r}" for r in ranks],
                     range=[len(ranks) - 0.5, -0.5], showgrid=False, zeroline=False, row=1, col=1)


def _measured(fig: go.Figure, steps: dict[int, list[Step]], ranks: list[int], scale: float, unit: str) -> None:
    """Bottom panel: per rank a compute lane (score blocks) and a lane of the incoming next block."""
    t0 = min(st.outgoing.t0 for r in ranks for st in steps[r] if st.outgoing is not None)
    bars: dict[int, dict[str, list]] = {}

    def bar(block: int, y: float, a: float, b: float, text: str, hover: str) -> None:
        d = bars.setdefault(block, {"y": [], "base": [], "x": [], "text": [], "hover": []})
        d["y"].append(y)
        d["base"].append((a - t0) * scale)
        d["x"].append((b - a) * scale)
        d["text"].append(text)
        d["hover"].append(hover)

    ticks = []
    for i, r in enumerate(ranks):
        ticks += [(2 * i, f"rank {r} compute"), (2 * i + 1, f"rank {r} K/V in")]
        for st in steps[r]:
            for e in st.spans:
                bar(st.block, 2 * i, e.t0, e.t1, f"K/V {st.block}",
                    f"rank {r} step {st.step}: scores on K/V {st.block}, {(e.t1 - e.t0) * scale:.3g} {unit}")
            if st.incoming is not None:
                e = st.incoming
                bar(e.chunk or 0, 2 * i + 1, e.t0, e.t1, f"K/V {e.chunk} from {e.src}",
                    f"rank {r} step {st.step}: K/V block {e.chunk} from rank {e.src} ({A.fmt_bytes(e.nbytes or 0)}), "
                    f"receive posted to wait done: {(e.t1 - e.t0) * scale:.3g} {unit}")
    for block in sorted(bars):
        d = bars[block]
        fig.add_trace(go.Bar(orientation="h", y=d["y"], base=d["base"], x=d["x"], width=0.8, name=f"K/V block {block}",
                             marker={"color": rank_color(block), "line": {"color": "white", "width": 1}},
                             text=d["text"], textposition="inside", insidetextanchor="middle", textangle=0,
                             hovertext=d["hover"], hovertemplate="%{hovertext}<extra></extra>"), row=2, col=1)
    fig.update_yaxes(tickmode="array", tickvals=[y for y, _ in ticks], ticktext=[t for _, t in ticks],
                     range=[len(ticks) - 0.5, -0.5], showgrid=False, zeroline=False, row=2, col=1)
    fig.update_xaxes(title_text=f"time since the pass began ({unit})", row=2, col=1)


def ring_figure(trace: Trace, title: str = "Ring Attention", index: int = 0) -> go.Figure:
    """The ring of forward pass ``index`` (layer ``index``): step x rank grid, then measured lanes."""
    steps = ring_steps(trace, index)
    ranks = sorted(steps)
    unit = A.time_unit(trace)
    scale, shown = (1e3, "ms") if unit == "s" else (1.0, unit)
    fig = make_subplots(rows=2, cols=1, row_heights=[0.42, 0.58], vertical_spacing=0.14, subplot_titles=(
        f"who holds which K/V block at each ring step (forward pass {index}); arrows: where it goes next",
        f"{style.clock(trace) or 'measured'}: each rank computes on one block (upper lane) while the next one arrives "
        "(lower lane)"))
    _grid(fig, steps, ranks)
    _measured(fig, steps, ranks, scale, shown)
    height = 260 + 120 * len(ranks)
    fig.update_layout(title={"text": f"ring: {title}", "yref": "container", "y": 1 - 12 / height, "yanchor": "top"},
                      height=height, barmode="overlay", bargap=0, plot_bgcolor="#F4F5F7",
                      margin={"l": 120, "r": 40, "t": 110, "b": 50}, uniformtext={"minsize": 8, "mode": "hide"},
                      legend={"orientation": "h", "yref": "container", "y": 1 - 44 / height, "yanchor": "top"})
    return fig
