"""Pipeline parallelism: schedules as data, a validator and a simulator.

GPipe (Huang et al. 2018), 1F1B / PipeDream-Flush and interleaved 1F1B (Narayanan et al. 2021,
"Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM"), DAPPLE, and
zero-bubble schedules (Qi et al. 2024).

- ``schedule.py``: the action IR (``Action``, ``"1F3"``), ``Schedule``, parse/print, tables.
- ``generators.py``: ``make_schedule(kind, stages, microbatches, chunks=1)``, ``GENERATORS`` (kind ->
  generator); naive, GPipe, 1F1B, interleaved.
- ``zero_bubble.py``: ZB-H1, ZB-H2 and ZB-V (backwards split into I and W, Qi et al. 2024).
- ``dualpipe.py``: DualPipeV (DeepSeek-V3's DualPipe folded into ZB-V's V; PyTorch's ``ScheduleDualPipeV`` order).
- ``chimera.py``: Chimera (Li & Hoefler 2021): two pipelines in opposite directions on the same ranks,
  each stage's two replicas' gradients all-reduced.
- ``asynchronous.py``: PipeDream (weight stashing, vertical sync; Narayanan et al. 2019) and
  PipeDream-2BW (Narayanan et al. 2021): schedules with per-stage updates ``U`` and weight versions.
- ``lowering.py``: ``lower`` inserts the SEND/RECV actions a runtime executes.
- ``validate.py``: ``validate`` rejects schedules that cannot run, with a step-by-rank table.
- ``simulate.py``: ``simulate`` gives makespan, bubble, idle time, stash and a trace.
"""

from .generators import GENERATORS, KINDS, gpipe, interleaved, make_schedule, naive, one_f_one_b
from .lowering import is_lowered, lower
from .schedule import Action, Schedule, ScheduleError, format_schedule, format_table, parse_schedule
from .simulate import SimResult, simulate
from .validate import Stuck, execute, validate

__all__ = [
    "GENERATORS", "KINDS", "Action", "Schedule", "ScheduleError", "SimResult", "Stuck", "execute", "format_schedule",
    "format_table", "gpipe", "interleaved", "is_lowered", "lower", "make_schedule", "naive", "one_f_one_b",
    "parse_schedule", "simulate", "validate",
]

# The runtime (partition.py, runtime.py): cut a model into stages and run any valid schedule over ranks.
from .asynchronous import WeightVersions, peak_versions, pipedream, pipedream_2bw, versions_used  # noqa: E402
from .chimera import Chimera, chimera_schedule, simulate_chimera  # noqa: E402
from .partition import LayeredModel, Stage, build_stage, gpt, gpt_layer_counts, mlp, split_layers  # noqa: E402
from .runtime import Pipeline  # noqa: E402

__all__ += [
    "Chimera", "WeightVersions", "chimera_schedule", "peak_versions", "simulate_chimera",
    "pipedream", "pipedream_2bw", "versions_used",
    "LayeredModel", "Pipeline", "Stage", "build_stage", "gpt",
    "gpt_layer_counts", "mlp", "split_layers",
]
