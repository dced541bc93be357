"""`minipar simulate`: the schedule, the simulator's numbers, a trace file, one-line errors."""

from __future__ import annotations

from minipar import trace
from minipar.cli import main


def _error(capsys) -> str:
    out, err = capsys.readouterr()
    assert out == "", out
    (line,) = err.strip().splitlines()
    assert line.startswith("minipar: error: ")
    return line


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
    assert "multiple of" in _error(capsys)


def test_interleaved_defaults_to_two_chunks_and_says_so(capsys):
    assert main(["simulate", "interleaved", "-p", "2", "-m", "4", "--width", "100"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "interleaved with 2 model chunks per rank (the default; --chunks V to change)"
    # v = 2 on p = 2: rank 0 holds stages 0 and 2, rank 1 stages 1 and 3 (Narayanan et al. 2021, 2.2.2)
    assert lines[1].startswith("rank 0: 0F0 0F1 2F0 2F1") and lines[2].startswith("rank 1: 1F0 1F1 3F0")
    assert "= 11.1%" in "\n".join(lines)  # (p - 1) / (v m + p - 1) = 1 / 9


def test_chunks_that_do_not_apply_are_one_line_errors(capsys):
    assert main(["simulate", "interleaved", "--chunks", "1"]) == 2
    assert "interleaved needs --chunks >= 2 model chunks per rank, got 1" in _error(capsys)
    assert main(["simulate", "gpipe", "--chunks", "2"]) == 2
    assert "--chunks 2 applies to the interleaved schedule only" in _error(capsys)


def test_unwritable_output_fails_before_printing_or_writing(tmp_path, capsys):
    missing = tmp_path / "nonexistent" / "x.json"
    assert main(["simulate", "1f1b", "-o", str(missing)]) == 2
    line = _error(capsys)
    assert f"cannot write output {missing} (-o): directory {missing.parent} does not exist" in line
    assert main(["simulate", "1f1b", "-o", str(tmp_path)]) == 2
    assert f"{tmp_path} is a directory; give a file name" in _error(capsys)
    assert list(tmp_path.iterdir()) == []  # no trace, no temporary file


def test_too_narrow_width_is_one_line(capsys):
    assert main(["simulate", "1f1b", "--width", "10"]) == 2
    assert "--width 10 is too narrow; use at least 40" in _error(capsys)


def test_a_grid_too_big_to_draw_is_downsampled_and_fits_the_width(capsys):
    assert main(["simulate", "1f1b", "-p", "20", "-m", "20", "--width", "80"]) == 0
    out = capsys.readouterr().out
    assert "overview (20 ranks are more than 16 lanes)" in out and "16 of 20 ranks" in out
    lanes = [line for line in out.splitlines() if line.startswith("rank ") and line.endswith("%")]
    assert [line.split()[1] for line in lanes][::15] == ["0", "19"] and len(lanes) == 16
    assert "(4 more ranks not listed" in out and "peak stashed micro-batches per rank [20, 19," in out
    assert max(len(line) for line in out.splitlines()) <= 80


def test_kinds_in_any_case_and_every_kind_of_the_runtime(capsys):
    for kind in ("1F1B", "GPipe", "Interleaved", "ZB-V", "Chimera", "PipeDream", "2BW"):
        assert main(["simulate", kind, "-p", "2", "-m", "4", "--width", "60"]) == 0, capsys.readouterr().err
    assert main(["simulate", "chimera", "-p", "4", "-m", "8", "--forward", "1", "--backward", "1",
                 "--width", "100"]) == 0
    out = capsys.readouterr().out
    assert "rank 0: d0F0 d0F1 u3F4" in out and "bubble fraction 11.1% (formula (p-2)/(2m+p-2) = 11.1%)" in out
