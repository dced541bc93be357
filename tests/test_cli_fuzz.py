"""Fuzzed command lines never end in a traceback: ``minipar simulate`` and every lesson's argument parser.

Property: for drawn argument lists (sizes tiny, zero, negative, huge or not numbers at all; schedule
kinds in odd case or unknown; options unknown), ``minipar.cli.main`` returns 0 or 2, and
``lessons/*/lesson.py``'s ``parse_args`` returns or exits with status 2; a 2 prints one error line on
stderr that names the bad argument. Everything runs in this process: arguments are checked before any
work, so an invalid draw costs a parse, and valid draws are tiny (p, m <= 4).
"""

from __future__ import annotations

import contextlib
import io
import re
from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import example, given
from hypothesis import strategies as st
from strategies import budget

from lessons import load
from minipar.cli import main
from minipar.cli_simulate import kinds

LESSONS = sorted(p.parent.name for p in (Path(__file__).resolve().parents[1] / "lessons").glob("*/lesson.py"))

TINY = st.integers(1, 4).map(str)
BAD_NUMBERS = st.one_of(st.sampled_from(["0", "-1", "-64", "x", "1.5", "", "nan", "inf", "1e3", "0x10", "--"]),
                        st.integers(10**5, 10**40).map(str), st.integers(-(10**40), -1).map(str))
NUMBERS = st.one_of(TINY, BAD_NUMBERS)
DURATIONS = st.one_of(st.sampled_from(["0", "1", "2", "0.5", "-1", "nan", "inf", "-inf", "1e300", "abc"]))
WIDTHS = st.one_of(st.sampled_from(["60", "100"]), NUMBERS)
SIMULATE_OPTIONS = {"-p": NUMBERS, "--stages": NUMBERS, "-m": NUMBERS, "--microbatches": NUMBERS, "-v": NUMBERS,
                    "--forward": DURATIONS, "--backward": DURATIONS, "--width": WIDTHS, "--bogus": TINY}


def _captured(call: Callable[[list[str]], object], argv: list[str]) -> tuple[int, str, str]:
    """(exit status: ``call``'s int result, a ``SystemExit``'s code, else 0; stdout; stderr). Not pytest's
    ``capsys``: a function-scoped fixture is not reset between hypothesis's examples."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            result = call(argv)
            status = result if isinstance(result, int) else 0
        except SystemExit as exc:
            status = 0 if exc.code is None else exc.code if isinstance(exc.code, int) else 1
    return status, out.getvalue(), err.getvalue()


def _odd_case(draw: st.DrawFn, word: str) -> str:
    return "".join(c.upper() if draw(st.booleans()) else c for c in word)


@st.composite
def simulate_argv(draw: st.DrawFn) -> list[str]:
    """``simulate KIND [options]``: a known kind in any case, or an unknown one; options with tiny,
    bad or huge values, sometimes one that does not exist."""
    if draw(st.booleans()):
        kind = _odd_case(draw, draw(st.sampled_from(kinds())))
    else:
        kind = draw(st.sampled_from(["", "zb", "1f2b", "pipe dream", "chimera2", "-1"]))
    chosen = draw(st.lists(st.sampled_from(sorted(SIMULATE_OPTIONS)), max_size=4, unique=True))
    argv = ["simulate", kind]
    for option in chosen:
        argv += [option, draw(SIMULATE_OPTIONS[option])]
    return argv


def _words(argv: list[str]) -> set[str]:
    """What an error line may name: the options given (long and short spellings, and the value's name as
    a library message says it, e.g. ``m=``) and the kind."""
    names = {"-p": ["--stages", "stages", "p="], "--stages": ["-p", "stages", "p="],
             "-m": ["--microbatches", "microbatches", "m="], "--microbatches": ["-m", "microbatches", "m="],
             "-v": ["--chunks", "chunks"], "--chunks": ["-v", "chunks"]}
    out = {w for w in argv[2:] if w in SIMULATE_OPTIONS} | ({argv[1].lower()} - {""})
    for w in argv:
        out.update(names.get(w, []))
    return out | {"kind"}


@budget(30)
@given(argv=simulate_argv())
@example(argv=["simulate", "1F1B", "-p", "2", "-m", "2", "--width", "60"])
@example(argv=["simulate", "GPipe", "-p", "2", "-m", "2", "--width", "60"])
@example(argv=["simulate", "Interleaved", "-p", "2", "-m", "2", "--width", "60"])
@example(argv=["simulate", "ZB-V", "-p", "2", "-m", "2", "--width", "60"])
@example(argv=["simulate", "zb-v", "-m", "2", "--width", "60"])
@example(argv=["simulate", "Chimera", "-p", "2", "-m", "2", "--width", "60"])
@example(argv=["simulate", "pipedream", "-p", "2", "-m", "2", "--width", "60"])
@example(argv=["simulate", "2BW", "-p", "2", "-m", "4", "--width", "60"])
@example(argv=["simulate", "chimera", "-p", "3"])
@example(argv=["simulate", "1f1b", "-p", "0"])
@example(argv=["simulate", "1f1b", "-p", "-3"])
@example(argv=["simulate", "1f1b", "-p", "100000000000000000000"])
@example(argv=["simulate", "1f1b", "-p", "4096", "-m", "65536"])
@example(argv=["simulate", "nope"])
@example(argv=["simulate", "1f1b", "--forward", "nan"])
@example(argv=["simulate", "1f1b", "--width", "100000000"])
def test_simulate_never_raises(argv):
    status, out, err = _captured(main, argv)
    assert status in (0, 2), (argv, status, err)
    if status == 0:
        assert "makespan" in out and err == ""
        return
    assert out == "" and "Traceback" not in err
    (line,) = err.strip().splitlines()
    assert line.startswith("minipar: error: ")
    assert any(w in line.lower() for w in _words(argv)), (argv, line)


def test_help_lists_every_kind_and_each_runs(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["simulate", "--help"])
    assert exit_.value.code == 0
    text = " ".join(capsys.readouterr().out.split()).replace("- ", "-")  # argparse may wrap at "zb-h1"
    for kind in kinds():
        assert kind in text
        sizes = {"2bw": ["-m", "4"], "chimera": ["-m", "2"], "dualpipev": ["-m", "4"]}.get(kind, ["-m", "2"])
        assert main(["simulate", kind.upper(), "-p", "2", *sizes, "--width", "60"]) == 0, capsys.readouterr().err
    assert {"chimera", "pipedream", "2bw", "zb-v", "interleaved"} <= set(kinds())


def test_no_closed_form_is_said_not_raised(capsys):
    assert main(["simulate", "zb-v", "-m", "2", "--width", "60"]) == 0  # the formula needs m >= 2p - 1
    assert "no closed form" in capsys.readouterr().out
    assert main(["simulate", "chimera", "-p", "2", "-m", "2", "--width", "60"]) == 0  # B != F: slots differ
    assert "no closed form" in capsys.readouterr().out


# --- the lessons ------------------------------------------------------------------------------------

LESSON_OPTIONS = {"--steps": NUMBERS, "--ranks": st.one_of(st.sampled_from(["0", "2", "4", "8"]), NUMBERS),
                  "--microbatches": NUMBERS, "--pp": NUMBERS, "--dp": NUMBERS, "--sp": NUMBERS, "--tp": NUMBERS,
                  "--n": NUMBERS, "--reps": NUMBERS, "--clock": st.sampled_from(["replay", "wall", "Wall", "x"]),
                  "--cluster": st.sampled_from(["local", "nvlink", "warp-drive"]), "--bogus": TINY}


@st.composite
def lesson_argv(draw: st.DrawFn) -> tuple[str, list[str]]:
    name = draw(st.sampled_from(LESSONS))
    chosen = draw(st.lists(st.sampled_from(sorted(LESSON_OPTIONS)), max_size=3, unique=True))
    argv: list[str] = []
    for option in chosen:
        argv += [option, draw(LESSON_OPTIONS[option])]
    return name, argv


def test_every_lesson_has_a_parser():
    assert LESSONS and all(hasattr(load(name), "parse_args") for name in LESSONS), LESSONS


@budget(40)
@given(case=lesson_argv())
@example(case=("04_tensor_parallel", ["--ranks", "0"]))
@example(case=("04_tensor_parallel", ["--ranks", "3"]))
@example(case=("08_hybrid", ["--ranks", "0", "--tp", "0"]))
@example(case=("08_hybrid", ["--pp", "64", "--dp", "64"]))
@example(case=("02_pipeline", ["--microbatches", "0"]))
@example(case=("02b_zero_bubble", ["--microbatches", "-1"]))
@example(case=("00_autograd", ["--steps", "-5"]))
@example(case=("10_faults", ["--ranks", "100000000000000000000"]))
@example(case=("03_data_parallel", ["--steps", "1e3"]))
def test_lesson_parsers_never_raise(case):
    name, argv = case
    status, _, err = _captured(load(name).parse_args, argv)
    assert status in (0, 2), (name, argv, status, err)
    if status == 2:
        assert "Traceback" not in err
        line = err.strip().splitlines()[-1]
        assert re.search(r"error: (argument |unrecognized arguments: )", line), (name, argv, line)
        # an option given (or the value argparse could not place), or --ranks: the world size they ask for
        assert any(w in line for w in argv if w) or "argument --ranks: " in line, (name, argv, line)


DOCUMENTED = [("01_collectives", ["--reps", "0", "--n", "64"]), ("08_hybrid", ["--ranks", "0"]),
              ("08_hybrid", ["--pp", "2", "--dp", "2", "--sp", "2", "--tp", "1"]),
              ("02_pipeline", ["--steps", "3", "--microbatches", "8"]), ("00_autograd", ["--steps", "300"]),
              ("10_faults", ["--ranks", "4"])]  # command lines the docs, notebooks and tests use


@pytest.mark.parametrize(("name", "argv"), DOCUMENTED)
def test_the_documented_command_lines_still_parse(name, argv):
    assert load(name).parse_args(argv) is not None
