"""A step over many NVMe files made atomic across files and ranks (``ZeroInfinity``'s state).

Every state file exists in two slots, ``<name>.0`` and ``<name>.1``; a small manifest names the slot
holding the current state. A step reads the current slot, writes the other one, waits for every
write, agrees with the other ranks that none failed (N > 1: one all-reduce) and only then commits by
one atomic write of the manifest (``minipar.tiers.nvme``: temporary, fsync, rename), and agrees
again (a rank whose commit failed: the others rewrite their previous manifest). A failure or a kill
before the manifest is in place leaves the previous step's state whole in the current slot; the next
step writes the other slot again (its files are reused, step after step). A rank killed between the
two agreements, before its commit, is one step behind the others, who then resume from their other
slot (still the previous step's): the manifest keeps the counters of the step before for that.

Manifest (float64, 6 entries = 48 bytes): slot, applied steps, loss scale, clean steps, and the loss
scale and clean steps before the step.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from minipar.comm import Communicator

ALGORITHM = "ring"
MANIFEST_ITEMS = 6


def manifest(slot: int, steps: int, scale: float, clean: int, prev_scale: float, prev_clean: int) -> np.ndarray:
    """The manifest's array (see the module docstring)."""
    return np.array([slot, steps, scale, clean, prev_scale, prev_clean], dtype=np.float64)


def resume_point(comm: Communicator, saved: np.ndarray) -> tuple[int, int, float, int]:
    """(slot, applied steps, loss scale, clean steps) of the last step committed on every rank, from
    this rank's manifest (a rank one step ahead goes back to its other slot). Every rank calls this."""
    slot, steps, scale, clean, prev_scale, prev_clean = (float(v) for v in saved)
    low = -comm.allreduce(np.array([-steps]), op="max", algorithm=ALGORITHM)[0] if comm.size > 1 else steps
    if steps - low not in (0, 1):
        raise ValueError(f"resume: this rank's files are at step {int(steps)}, another rank's at {int(low)}: "
                         "only one step apart can be resumed")
    if steps == low + 1:
        slot, steps, scale, clean = 1 - slot, low, prev_scale, prev_clean
    return int(slot), int(steps), scale, int(clean)


def agree(comm: Communicator, work: Callable[[], None], what: str, undo: Callable[[], None] | None = None) -> None:
    """Run ``work``; raise on every rank if it raised on some rank (one all-reduce when N > 1), after
    ``undo`` on the ranks where it succeeded. Every rank calls this."""
    failed: Exception | None = None
    try:
        work()
    except Exception as exc:
        failed = exc
    flag = np.array([float(failed is not None)])
    if comm.size > 1:
        flag = comm.allreduce(flag, op="sum", algorithm=ALGORITHM)
    if flag[0] == 0:
        return
    if failed is not None:
        raise failed
    if undo is not None:
        undo()
    raise OSError(f"the step is not committed, {what} failed on another rank")
