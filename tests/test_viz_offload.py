"""``viz.offload`` reads an offload run's steps from its "step" / "flush" marks: a step runs from its
mark to the next, step 0 (placing, warming up) is left out of every median. Checked on a hand-written
trace: steps of 2 and 1 ms after the first, forward + backward 1.0 and 0.5 ms, a CPU AdamW of 0.25 ms,
a gradient bucket down and the parameters up in every step; the DPU model is max(F+B, AdamW) + rest. The
terminal timeline of such a whole run says over how many steps its time is."""

from __future__ import annotations

import io

from rich.console import Console

from minipar.trace import Event, Trace
from viz import offload as views
from viz.terminal import print_timeline

MS = 1e-3


def move(t: float, src: str, dst: str, nbytes: int) -> Event:
    return Event(0, "transfer", "copy", t, t + 0.1 * MS, nbytes=nbytes, args={"src": src, "dst": dst,
                                                                             "modelled_s": 0.05 * MS})


def run_trace(adam: float = 0.25) -> Trace:
    """Marks at 0, 1, 3 and 4 ms: step 0, then steps of 2 and 1 ms; in each, F + B and a CPU AdamW."""
    events = [Event(0, "mark", name, t * MS, t * MS) for name, t in (("step", 0), ("step", 1), ("step", 3),
                                                                     ("flush", 4))]
    events.append(move(-1 * MS, "cpu", "device", 800))  # setup: the parameters placed once
    for a, fb in ((0.0, 0.5), (1.0, 1.0), (3.0, 0.5)):
        events += [Event(0, "compute", "F", a * MS, (a + fb / 2) * MS), Event(0, "compute", "B", (a + fb / 2) * MS,
                                                                             (a + fb) * MS),
                   Event(0, "compute", "cpu adam", (a + fb) * MS, (a + fb + adam) * MS),
                   move((a + fb) * MS, "device", "cpu", 400), move((a + fb + adam) * MS, "cpu", "device", 400)]
    return Trace({"world_size": 1, "time_unit": "s", "steps": 3}, events)


def test_steps_are_read_between_the_marks() -> None:
    t = run_trace()
    parts = views.step_parts(t)
    assert abs(parts["step"] - 1.5 * MS) < 1e-12 and abs(parts["fb"] - 0.75 * MS) < 1e-12
    assert abs(parts["adam"] - 0.25 * MS) < 1e-12
    times = views.step_time(t)
    assert abs(times["measured"] - 0.2 * MS) < 1e-12 and abs(times["modelled"] - 0.1 * MS) < 1e-12


def test_the_tables_set_each_step_beside_the_formula() -> None:
    t = run_trace()
    table = views.offload_bytes_table({"offload": t}, {"offload": 8}, {"offload": {"device->cpu": 400,
                                                                                 "cpu->device": 400}}, 1)
    assert [list(c.cells)[0] for c in table.columns] == ["offload", "8", "800", "400", "400", "0", "400 / 400",
                                                         "same"]
    dpu = views.dpu_table({"zero2": t, "offload": t, "dpu": run_trace(adam=2.0)}, "replayed", "replayed", False)
    # rest = 1.5 - 0.75 - 0.25 = 0.5 ms; offload F+B + AdamW + rest = 1.5; DPU max(0.75, 2.0) + 0.5 = 2.5
    assert [list(c.cells)[1:] for c in dpu.columns][-1] == ["1.50", "2.50"]


def test_the_timeline_of_a_whole_run_says_over_how_many_steps() -> None:
    out = Console(width=80, record=True, file=io.StringIO())
    print_timeline(run_trace(), console=out)  # the window: the first span's start to the last one's end
    assert out.export_text().splitlines()[1].startswith("3 steps traced: 3.75 ms, idle")
