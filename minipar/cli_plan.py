"""``minipar plan``: rank the layouts of a GPT on a cluster by predicted step time (``cost.planner``).

    minipar plan --model gpt3-175b --gpus 3072 [--preset a100-selene | --cluster FILE] [--zero 0 1]
    minipar plan --layers 24 --hidden 2048 --heads 16 --seq 2048 --vocab 51200 --gpus 64   any GPT

The model is a preset (``--model``) or your own: all five of ``--layers --hidden --heads --seq
--vocab``. Every argument is checked before planning, and one that cannot be planned is a one-line
``minipar: error:`` (exit status 2): a preset and sizes together, some sizes missing, a size out of
range, heads not dividing the hidden size (``planner.layouts``' check). Layouts whose ``tp`` does
not divide the heads are never proposed (``Layout.check``). When nothing fits, the shortfall is
printed and the status is 1.
"""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from minipar.cli_args import UsageError

if TYPE_CHECKING:
    from minipar.cost.layout import ModelSpec

MAX_GPUS = 65536  # the planner tries every divisor of --gpus (O(gpus) each)
# plan's own model: option -> what it is, and its largest value (the search tries divisors of the layers)
CUSTOM_MODEL = {"layers": "transformer blocks", "hidden": "hidden size", "heads": "attention heads",
                "seq": "sequence length", "vocab": "vocabulary size"}
MAX_CUSTOM = {"layers": 10**4, "hidden": 10**6, "heads": 10**5, "seq": 10**7, "vocab": 10**8}


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="a model preset: gpt3-175b, narayanan-1.7b ... narayanan-1t")
    own = p.add_argument_group("a model of your own", "all five of these instead of --model")
    for name, what in CUSTOM_MODEL.items():
        own.add_argument(f"--{name}", type=int, metavar="N", help=what)
    p.add_argument("--gpus", type=int, required=True, help="how many GPUs to split the model over")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--cluster", metavar="FILE", help="a cluster file (JSON, minipar.cost.cluster)")
    where.add_argument("--preset", default="a100-selene", help="a cluster preset (default a100-selene)")
    p.add_argument("--global-batch", type=int, default=1536, help="sequences per step (default 1536)")
    p.add_argument("--top", type=int, default=5, help="layouts to show (default 5)")
    p.add_argument("--zero", type=int, nargs="+", choices=range(4), default=[0, 1, 2, 3], metavar="STAGE",
                   help="ZeRO stages to try (default 0 1 2 3; 2 and 3 only with pp = 1, as DeepSpeed requires)")


def _model(args: argparse.Namespace, presets: dict[str, ModelSpec]) -> ModelSpec:
    """``--model``'s preset, or the GPT of ``--layers --hidden --heads --seq --vocab`` (all five);
    ``UsageError`` for both, neither, some of the five, or a size out of range (heads not dividing the
    hidden size: ``planner.layouts`` refuses it)."""
    given = {name: getattr(args, name) for name in CUSTOM_MODEL if getattr(args, name) is not None}
    if args.model is not None and given:
        raise UsageError(f"--model {args.model} and {' '.join('--' + n for n in given)}: give a preset or the "
                         "five sizes of your own model, not both")
    if args.model is not None:
        if args.model not in presets:
            raise UsageError(f"no model preset {args.model!r}; choose one of {', '.join(presets)}")
        return presets[args.model]
    missing = [f"--{n}" for n in CUSTOM_MODEL if n not in given]
    if missing:
        raise UsageError(f"missing {' '.join(missing)}: give --model PRESET or all of --layers --hidden --heads "
                         "--seq --vocab")
    for name, value in given.items():
        if not 1 <= value <= MAX_CUSTOM[name]:
            raise UsageError(f"--{name} must be between 1 and {MAX_CUSTOM[name]:,}, got {value}")
    from minipar.cost.layout import ModelSpec
    name = "GPT l{layers} h{hidden} a{heads} s{seq} V{vocab}".format(**given)
    return ModelSpec(**given, name=name)


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from minipar.cost.cluster import Cluster
    from minipar.cost.planner import NoFit, plan
    from minipar.cost.presets import CLUSTERS, MODELS

    model = _model(args, MODELS)
    for option, value, most in (("--gpus", args.gpus, MAX_GPUS), ("--top", args.top, 1000),
                                ("--global-batch", args.global_batch, 10**8)):
        if not 1 <= value <= most:
            raise UsageError(f"{option} must be between 1 and {most:,}, got {value}")
    if args.cluster:
        try:
            cluster = Cluster.load(args.cluster)
        except (OSError, ValueError) as exc:
            raise UsageError(str(exc)) from None
    elif args.preset in CLUSTERS:
        cluster = CLUSTERS[args.preset]
    else:
        raise UsageError(f"no cluster preset {args.preset!r}; choose one of {', '.join(CLUSTERS)} or --cluster FILE")
    try:
        ranked = plan(model, args.gpus, cluster, args.global_batch, zero_stages=tuple(sorted(set(args.zero))),
                      top=args.top)
    except NoFit as exc:
        print(f"minipar: {exc}", file=sys.stderr)
        return 1
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    table = Table(title=f"{model.name}: {args.gpus} GPUs on {cluster.name}, global batch {args.global_batch}")
    for col in ("dp", "tp", "pp", "schedule", "sp", "v", "b", "zero", "recompute", "step s", "TFLOP/s/GPU",
                "memory GiB", "why"):
        table.add_column(col, justify="left" if col in ("schedule", "recompute", "why") else "right")
    for c in ranked:
        lay, pr = c.layout, c.prediction
        pp = str(lay.pp) + (" uneven" if c.label().endswith(" uneven") else "")
        table.add_row(str(lay.dp), str(lay.tp), pp, lay.kind if lay.pp > 1 else "-", str(lay.sp), str(lay.chunks),
                      str(lay.micro_batch), str(lay.zero), lay.recompute + (" +SP" if lay.sequence_parallel else ""),
                      f"{pr.step_seconds:.2f}", f"{pr.tflops_per_gpu:.0f}", f"{pr.memory['total'] / 2**30:.1f}",
                      c.why())
    Console(width=200).print(table)
    print(ranked[0].prediction.explain())
    return 0
