"""`minipar simulate`: the schedule, the simulator's numbers, a trace file, one-line errors."""

from __future__ import annotations

from minipar import trace
from minipar.cli import main


def test_simulate_prints_order_and_numbers_and_writes_the_trace(tmp_path, capsys):
    out = tmp_path / "sim.json"
    assert main(["simulate", "1f1b", "-p", "2", "-m", "4", "-o", str(out), "--width", "60"]) == 0
    text = capsys.readouterr().out
    assert "rank 0: 0F0 0F1 0B0 0F2 0B1 0F3 0B2 0B3" in text
    assert "rank 1: 1F0 1B0 1F1 1B1 1F2 1B2 1F3 1B3" in text
    assert "makespan 15" in text and "bubble fraction 20.0%" in text and "[2, 1]" in text
    t = trace.load(out)
    assert len(t.select("compute", name="F")) == 8 and t.meta["backend"] == "simulator"


def test_simulate_bad_configuration_is_one_line(capsys):
    assert main(["simulate", "interleaved", "-p", "2", "-m", "3", "-v", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "multiple of" in err[0]
