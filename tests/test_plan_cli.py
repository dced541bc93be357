"""``minipar plan`` with a model of your own (``--layers --hidden --heads --seq --vocab``): the plan
it prints is ``planner.plan``'s, and impossible or incomplete models are one-line errors (status 2)."""

from __future__ import annotations

import pytest

from minipar.cli import main
from minipar.cost.layout import ModelSpec
from minipar.cost.planner import plan
from minipar.cost.presets import CLUSTERS, MODELS

CUSTOM = ["--layers", "24", "--hidden", "2048", "--heads", "16", "--seq", "2048", "--vocab", "51200"]


def _error(capsys: pytest.CaptureFixture[str]) -> str:
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("minipar: error: ") and err.count("\n") == 1 and "Traceback" not in err
    return err.strip()


def test_a_custom_model_is_planned(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", *CUSTOM, "--gpus", "64", "--top", "3", "--global-batch", "512"]) == 0
    out = capsys.readouterr().out
    model = ModelSpec(layers=24, hidden=2048, heads=16, seq=2048, vocab=51200)
    first = plan(model, 64, CLUSTERS["a100-selene"], 512, top=3)[0]
    lay, pr = first.layout, first.prediction
    assert "GPT l24 h2048 a16 s2048 V51200: 64 GPUs on a100-selene, global batch 512" in out
    row = next(line for line in out.splitlines() if line.startswith("│"))
    cells = [c.strip() for c in row.strip("│").split("│")]
    assert cells[:9] == [str(lay.dp), str(lay.tp), str(lay.pp), lay.kind if lay.pp > 1 else "-", str(lay.sp),
                         str(lay.chunks), str(lay.micro_batch), str(lay.zero),
                         lay.recompute + (" +SP" if lay.sequence_parallel else "")]
    assert cells[9:12] == [f"{pr.step_seconds:.2f}", f"{pr.tflops_per_gpu:.0f}", f"{pr.memory['total'] / 2**30:.1f}"]
    assert f"Step {pr.step_seconds:.3g} s" in out


def test_a_pipelined_plan_shows_its_schedule(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--model", "narayanan-18b", "--gpus", "16", "--global-batch", "64", "--zero", "0", "1",
                 "--top", "1"]) == 0
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("│"))
    first = plan(MODELS["narayanan-18b"], 16, CLUSTERS["a100-selene"], 64, top=1, zero_stages=(0, 1))[0]
    assert first.layout.schedule == "zb-v" and [c.strip() for c in row.strip("│").split("│")][3] == "zb-v"


@pytest.mark.parametrize(("argv", "message"), [
    (["--layers", "24", "--hidden", "100", "--heads", "7", "--seq", "2048", "--vocab", "51200"],
     "minipar: error: hidden=100 is not divisible by heads=7: each head takes hidden/heads features; "
     "choose heads dividing 100"),
    (["--layers", "24", "--hidden", "128", "--heads", "8", "--vocab", "51200"],
     "minipar: error: missing --seq: give --model PRESET or all of --layers --hidden --heads --seq --vocab"),
    (["--model", "gpt3-175b", "--layers", "24"],
     "minipar: error: --model gpt3-175b and --layers: give a preset or the five sizes of your own model, not both"),
    ([], "minipar: error: missing --layers --hidden --heads --seq --vocab: give --model PRESET or all of "
         "--layers --hidden --heads --seq --vocab"),
    (["--layers", "0", "--hidden", "128", "--heads", "8", "--seq", "16", "--vocab", "64"],
     "minipar: error: --layers must be between 1 and 10,000, got 0"),
    (["--layers", "2", "--hidden", "128", "--heads", "-8", "--seq", "16", "--vocab", "64"],
     "minipar: error: --heads must be between 1 and 100,000, got -8"),
])
def test_impossible_or_incomplete_models_are_refused(argv: list[str], message: str,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", *argv, "--gpus", "8"]) == 2
    assert _error(capsys) == message
