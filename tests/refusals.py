"""Configuration refusals in the tests: the error a call raised and what was sent before it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from minipar import trace


def refusal(comm: Any, fn: Callable[[], object], accepted: str = "no error") -> tuple[str, int]:
    """``fn()``'s ValueError message (``accepted`` when it raised none) and how many messages this rank's
    trace recorded meanwhile: a refusal must come before any communication."""
    with trace.recording(comm.world_rank) as rec:
        try:
            fn()
            msg = accepted
        except ValueError as exc:
            msg = str(exc)
    return msg, sum(e.kind == "comm" for e in rec.events)
