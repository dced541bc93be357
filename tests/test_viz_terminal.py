"""The terminal timeline: lanes derived by hand, and for every trace and width: lines within the
width, labels never touching (every word in a lane is one whole label), collective calls labelled,
cells small enough under load, table headers never cut."""

from __future__ import annotations

import io
import re

import pytest
from rich.console import Console
from viz_traces import naive_allreduce, one_f_one_b, ring_allreduce, ring_and_naive

from minipar.parallel.pipeline import make_schedule, simulate
from minipar.trace import Event, Trace, save
from viz import terminal

WIDTHS = (40, 48, 100, 160)


def _plain(trace_or_path, width: int = 48) -> list[str]:
    buf = io.StringIO()
    console = Console(file=buf, width=width, color_system=None, force_terminal=False)
    terminal.print_timeline(trace_or_path, console=console, width=width)
    return buf.getvalue().splitlines()


def _lanes(lines: list[str]) -> list[str]:
    """The cells of every lane line (``rank r `` and the idle suffix cut off)."""
    return [re.sub(r"\s+idle\s+\d+%$", "", line)[7:] for line in lines if re.match(r"rank \d ", line)]


def _simulated(kind: str, p: int = 4, m: int = 8, v: int = 1) -> Trace:
    return simulate(make_schedule(kind, p, m, v), forward=1.0, backward=2.0).trace


def _loaded(n: int = 16, span: float = 6e-3, gap: float = 9e-3) -> Trace:
    """2 ranks, each n forwards then n backwards of ``span`` seconds with ``gap`` between, rank 1
    ``gap / 2`` later: a step of (2 n - 1)(span + gap) + span + gap / 2 with short spans, as a run on
    a busy machine looks."""
    events = []
    for rank in range(2):
        for i, (name, mb) in enumerate([("F", k) for k in range(n)] + [("B", k) for k in range(n)]):
            t0 = i * (span + gap) + (gap / 2 if rank else 0.0)
            events.append(Event(rank, "compute", name, t0, t0 + span, stage=rank, microbatch=mb))
    return Trace({"paradigm": "pipeline", "world_size": 2, "backend": "hand-made"}, events)


def _collectives() -> Trace:
    """Lesson 01's shape: a barrier (dissemination), then ring, recursive doubling and naive
    all-reduces of 3000 bytes on 4 ranks, 1 ms per step, with the formulas' bytes in the meta."""
    p, n = 4, 3000
    events = []
    for step in range(2):  # barrier: rank r sends 0 bytes to r + 2^step
        for r in range(p):
            for rank, name in ((r, "send"), ((r + 2 ** step) % p, "recv")):
                events.append(Event(rank, "comm", name, step * 1e-3, (step + 1) * 1e-3, src=r,
                                    dst=(r + 2 ** step) % p, nbytes=0, op="barrier",
                                    algorithm="dissemination", step=step))
    for step in range(2 * (p - 1)):
        for r in range(p):
            for rank, name in ((r, "send"), ((r + 1) % p, "recv")):
                events.append(Event(rank, "comm", name, (2 + step) * 1e-3, (3 + step) * 1e-3, src=r,
                                    dst=(r + 1) % p, nbytes=n // p, op="allreduce", algorithm="ring", step=step))
    for step in range(2):
        for r in range(p):
            for rank, name in ((r, "send"), (r ^ (1 << step), "recv")):
                events.append(Event(rank, "comm", name, (8 + step) * 1e-3, (9 + step) * 1e-3, src=r,
                                    dst=r ^ (1 << step), nbytes=n, op="allreduce",
                                    algorithm="recursive_doubling", step=step))
    events += naive_allreduce(p, n, 10e-3)
    meta = {"paradigm": "collectives", "world_size": p, "backend": "hand-made",
            "expected_bytes": {"allreduce/ring": 2 * (p - 1) / p * n, "allreduce/recursive_doubling": n * 2},
            "expected_bytes_by_rank": {"allreduce/naive": [(p - 1) * n] + [n] * (p - 1)}}
    return Trace(meta, events)


CASES = {
    "hand-made 1f1b": one_f_one_b(),
    "simulated 1f1b": _simulated("1f1b"),
    "simulated gpipe": _simulated("gpipe"),
    "simulated interleaved": _simulated("interleaved", v=2),
    "loaded": _loaded(),
    "ring then naive": ring_and_naive(),
    "collectives": _collectives(),
}


def _valid_words(trace: Trace) -> set[str]:
    """Every whole label a lane may show: F3, B3.1, opt, and the words of "op algorithm"."""
    words = set()
    for e in trace.events:
        if e.kind == "compute":
            mb = "" if e.microbatch is None else str(e.microbatch)
            words |= {e.name + mb, f"{e.name}{mb}.{e.chunk}"}
        elif e.kind == "comm" and e.op not in ("send", "recv"):
            words |= {str(e.op), str(e.algorithm)}
    return words


def test_lanes_exact_at_half_a_unit_per_cell():
    # One cell = 0.5 units: F takes 2 cells, B 4. A label starts one cell after the previous one
    # ends, so F1 (cells 2-3, right after F0) has no room: ">>"; B1 starts at cell 15, not 14.
    (band,) = terminal.lanes(one_f_one_b(with_messages=False), 30)
    assert [t.plain for t in band] == ["F0>>....B0  F2 B1 F3 B2 ..B3  ",
                                       "..F0 B0 F1 B1 F2 B2 F3 B3 ...."]


def test_lanes_fold_into_bands_and_a_block_is_labelled_once():
    # The 30 cells above cut into 2 bands of 15: each band starts free. Rank 0's B1 (cells 14-17)
    # has no room in band 1 ("<"), its label goes in band 2; rank 1's F2 (14-15) gets none.
    first, second = terminal.lanes(one_f_one_b(with_messages=False), 15, bands=2)
    assert [t.plain for t in first] == ["F0>>....B0  F2<", "..F0 B0 F1 B1 >"]
    assert [t.plain for t in second] == ["B1 F3 B2 ..B3  ", ">B2  F3 B3 ...."]


def test_every_line_within_width_and_no_two_labels_touching():
    for name, trace in CASES.items():
        valid = _valid_words(trace)
        for width in WIDTHS:
            lines = _plain(trace, width)
            assert all(len(line) <= width for line in lines), (name, width)
            lanes = _lanes(lines)
            assert len(lanes) % trace.world_size == 0 and lanes, (name, width)
            for lane in lanes:
                words = re.findall(r"[A-Za-z0-9_]+(?:\.\d+)?", lane)
                # a lane's word is a whole label: "F0F1" or "BF4" would not be one
                assert set(words) <= valid, (name, width, lane)


def test_labels_keep_a_blank_cell_between_them():
    for name, trace in CASES.items():
        for width in WIDTHS:
            for lane in _lanes(_plain(trace, width)):
                # a label is followed by a non-label cell: no digit directly followed by a letter
                assert not re.search(r"\d[A-Za-z]", lane), (name, width, lane)


def test_collective_calls_are_labelled_on_every_rank():
    lanes = _lanes(_plain(_collectives(), 160))
    assert len(lanes) == 4  # 12 ms fits one band at 160 columns
    for lane in lanes:
        # ring (6 ms) has room for "allreduce ring", the naive one (2 ms) only for "naive"
        assert "allreduce ring" in lane and "recursive_doubling" in lane and "naive" in lane, lane
        assert "barrier" in lane
    ring = _lanes(_plain(ring_and_naive(), 100))
    assert all("allreduce ring" in lane and "allreduce naive" in lane for lane in ring)


def test_collective_calls_group_steps_of_one_call():
    t = ring_allreduce(p=3)
    calls = terminal.collective_calls(t)[1]
    assert [(c.op, c.algorithm, len(c.events)) for c in calls] == [("allreduce", "ring", 2 * 2 * (3 - 1))]
    assert (calls[0].t0, calls[0].t1) == (0.0, 4e-3)
    twice = Trace(t.meta, t.events + [Event(e.rank, e.kind, e.name, e.t0 + 5e-3, e.t1 + 5e-3, src=e.src,
                                            dst=e.dst, nbytes=e.nbytes, op=e.op, algorithm=e.algorithm,
                                            step=e.step) for e in t.events if e.kind == "comm"])
    native = Event(1, "comm", "native", 0.02, 0.03, nbytes=8, op="allreduce", algorithm="native")
    p2p = Event(1, "comm", "send", 0.04, 0.05, src=1, dst=2, nbytes=8, op="send")
    twice.events += [native, p2p]
    calls = terminal.collective_calls(twice)[1]
    assert [(c.algorithm, len(c.events), c.t0) for c in calls] == [("ring", 8, 0.0), ("ring", 8, 5e-3),
                                                                   ("native", 1, 0.02)]


def test_back_to_back_calls_of_one_kind_share_a_label():
    # two ring all-reduces of 4 ms each, back to back; 16 cells of 0.5 ms: 8 cells each, too few for
    # "allreduce ring" (14), which the 16 cells of both together hold once
    ring = [e for e in ring_allreduce(p=3).events if e.kind == "comm"]
    later = [Event(e.rank, e.kind, e.name, e.t0 + 4e-3, e.t1 + 4e-3, src=e.src, dst=e.dst, nbytes=e.nbytes,
                   op=e.op, algorithm=e.algorithm, step=e.step) for e in ring]
    (band,) = terminal.lanes(Trace({"world_size": 3}, ring + later), 16)
    assert [t.plain for t in band] == ["allreduce ring~~"] * 3


def test_layer_spans_are_named_and_short_calls_do_not_shrink_the_cells():
    # tensor parallelism's spans: one per layer, no micro-batch; 12 ms F spans, 1 cell per ms holds
    # "F embed" (7). Ten 0.1 ms all-gathers between them would ask for 0.01 ms cells: ignored,
    # the compute spans set the cell (F needs 2 cells: 6 ms) -> one band of 24 cells, 1 ms each.
    events = [Event(0, "compute", "F", 12e-3 * i, 12e-3 * (i + 1), args={"layer": layer})
              for i, layer in enumerate(("embed", 0))]
    events += [Event(0, "comm", "send", 24e-3 + 1e-4 * i, 24e-3 + 1e-4 * (i + 1), src=0, dst=0, nbytes=8,
                     op="allgather", algorithm="ring", step=0) for i in range(10)]
    trace = Trace({"world_size": 1}, events)
    assert terminal.layout(trace, 24) == (pytest.approx(25e-3 / 24), 1)
    ((lane,),) = terminal.lanes(trace, 24)
    assert lane.plain.startswith("F embed     F 0")


def test_cells_shrink_under_load_into_at_most_four_bands():
    # Spans of 6 ms in a 31 * 15 + 6 + 4.5 = 475.5 ms step. One band of 82 cells would give 5.8 ms
    # per cell (a span per cell, mush). F15 needs 3 + 1 cells: 1.5 ms per cell, and a quarter of the
    # blocks (F10-F15, B10-B15 of 32) need that -> 475.5 / (82 * 1.5) = 3.9 -> 4 bands.
    lines = _plain(_loaded(), 100)
    assert f"1 cell = {475.5 / (4 * 82):.3g} ms" in "\n".join(lines)
    lanes = _lanes(lines)
    assert len(lanes) == 2 * 4
    for rank in range(2):
        words = re.findall(r"[FB]\d+", " ".join(lanes[rank::2]))
        assert sorted(words) == sorted([f"F{k}" for k in range(16)] + [f"B{k}" for k in range(16)])
    heavy = _loaded(n=64, span=1e-3, gap=30e-3)  # 4 bands are not enough: cells grow, labels drop
    assert len(_lanes(_plain(heavy, 100))) == 2 * terminal.MAX_BANDS


def test_ruler_marks_round_times_at_their_cells():
    # 0.5 units per cell: the widest mark "|15 units" needs 9 + 1 cells = 5 units -> a mark every 10 cells
    assert terminal.ruler(0, 30, 0.5, "units").plain == "|0 units".ljust(10) + "|5 units".ljust(10) + "|10 units "
    assert terminal.ruler(30, 30, 0.5, "units").plain == "|15 units |20 units |25 units "
    # 1.45 ms per cell from cell 82: marks every 20 ms (widest "|240 ms" + 2 = 9 cells > 10 ms)
    ruler = terminal.ruler(82, 82, 1.45e-3, "s").plain
    assert [(m.start(), m.group()) for m in re.finditer(r"\|\d+ ms", ruler)] == [
        (int(t / 1.45) - 82, f"|{t} ms") for t in (120, 140, 160, 180, 200, 220) if int(t / 1.45) - 82 + 7 <= 82]


def test_table_headers_are_never_cut():
    for width in (40, 60, 100):
        out = "\n".join(_plain(_collectives(), width))
        assert "…" not in out
        for word in ("barrier", "dissemination", "recursive_doubling", "naive", "formula", "total"):
            assert word in out, (width, word)
        rows = [[c.strip() for c in line.strip("│").split("│")] for line in out.splitlines()
                if line.startswith("│")]
        # every table has the rank column; rank 0 of the naive all-reduce sends (p - 1) n = 9000
        assert {row[0] for row in rows} == {"0", "1", "2", "3", "formula"}
        assert "9,000" in out and all(len(line) <= width for line in out.splitlines())


def test_no_traffic_table_when_no_message_carries_bytes():
    assert "bytes sent per rank" not in "\n".join(_plain(_simulated("1f1b"), 100))  # simulator: 0 bytes
    assert "bytes sent per rank" in "\n".join(_plain(one_f_one_b(), 100))


def test_traffic_table_bytes_and_formula():
    out = "\n".join(_plain(ring_allreduce(p=3, n=3000), width=70))
    rows = [line for line in out.splitlines() if line.startswith("│")]
    cells = [[c.strip() for c in row.strip("│").split("│")] for row in rows]
    assert cells == [["0", "4,000", "4,000"], ["1", "4,000", "4,000"], ["2", "4,000", "4,000"],
                     ["formula", "4,000", ""]]


def test_traffic_table_per_rank_formula_column_next_to_its_measured_column():
    t = ring_and_naive(p=3, n=3000)
    cells = [[c.strip() for c in row.strip("│").split("│")]
             for row in _plain(t, width=90) if row.startswith("│")]
    # columns: rank | allreduce/ring | allreduce/naive | formula (naive, per rank) | total
    assert cells == [["0", "4,000", "6,000", "6,000", "10,000"], ["1", "4,000", "3,000", "3,000", "7,000"],
                     ["2", "4,000", "3,000", "3,000", "7,000"], ["formula", "4,000", "", "", ""]]
    t.meta["expected_bytes_by_rank"] = {"allreduce": [1, 2, 3]}  # a bare op: after its last column
    lines = _plain(t, width=90)
    cells = [[c.strip() for c in row.strip("│").split("│")] for row in lines if row.startswith("│")]
    assert [row[3] for row in cells] == ["1", "2", "3", ""]
    header = [[c.strip() for c in row.strip("┃").split("┃")] for row in lines if row.startswith("┃")]
    assert [h[3] for h in header] == ["allreduce", "formula"]


def test_hand_made_trace_from_a_file(tmp_path):
    path = tmp_path / "1f1b.json"
    save(one_f_one_b(), path)
    out = _plain(path, 48)
    assert out[:2] == ["pipeline, 1f1b, 2 ranks, hand-made", "step 15 units, bubble 20.0%"]
    assert [line[-9:] for line in out if re.search(r"idle +\d+%$", line)] == ["idle  20%"] * 2


def test_short_span_still_shown_and_colours_by_kind():
    ev = [Event(0, "compute", "F", 0.0, 4.0), Event(0, "compute", "opt", 4.5, 4.6),
          Event(0, "compute", "B", 6.0, 10.0)]
    ((lane,),) = terminal.lanes(Trace({"world_size": 1}, ev), 10)
    assert lane.plain == "F   *.B   "
    styles = [(s.start, s.end, s.style) for s in lane.spans]
    assert styles == [(0, 4, terminal.STYLES["forward"]), (4, 5, terminal.STYLES["optimizer"]),
                      (5, 6, terminal.IDLE_STYLE), (6, 10, terminal.STYLES["backward"])]


def test_colour_codes_under_forced_terminal():
    buf = io.StringIO()
    console = Console(file=buf, width=100, force_terminal=True, color_system="standard")
    terminal.print_timeline(one_f_one_b(), console=console)
    text = buf.getvalue()
    assert "\x1b[1;37;44mF0" in text  # bold white on blue: a forward block
    assert "\x1b[1;30;101mB0" in text or "\x1b[1;30;43mB0" in text  # backward on orange


def test_too_narrow_width_says_what_to_change():
    with pytest.raises(ValueError, match="use a width of at least 22"):
        _plain(one_f_one_b(), width=21)


def test_width_wider_than_a_non_terminal_console_is_kept():
    buf = io.StringIO()
    console = Console(file=buf, width=30, color_system=None)  # narrower than the lanes asked for
    terminal.print_timeline(one_f_one_b(), console=console, width=48)
    assert [len(line) for line in buf.getvalue().splitlines() if re.search(r"idle +\d+%$", line)] == [48, 48]
