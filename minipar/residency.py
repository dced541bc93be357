"""Device residency checked where compute happens: while an offload wrapper lives, every op that reads
one of its parameters first checks that the parameter is on the device (``minipar.tiers``).

A wrapper registers its parameters with ``guard(owner, tiers, named, where)``: each parameter by name,
the ``Tiers`` whose device it must be on, and ``where`` its values are when they are not there (the tier
the error names: ``ZeroOffload`` and ``ChunkManager`` "cpu", ``ZeroInfinity`` "nvme").
``minipar.autograd`` calls ``check`` on a ``Function``'s arguments before its forward, on a node's
inputs before its backward, and ``minipar.functional.embedding`` on its weight before the gather: a
parameter that is not (a view of) a device array of its ``Tiers`` raises ``NotOnDevice`` in one line
naming it and its tier, before that op computes. So calling ``module.loss`` directly, around the
wrapper, is checked as the wrapper's own calls are.

Cost: ``guards`` is None while no wrapper is registered, and autograd tests it before calling
``check``: an op with no offload pays one None test (``tests/test_residency.py`` runs a training step
with ``check`` made to raise). The registry holds weak references to the parameters; a wrapper's
entries go when it calls the finalizer ``guard`` returned (its ``close``) or garbage-collected.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from minipar.tiers import Tiers


class NotOnDevice(ValueError):
    """Compute asked for an array that is not resident on this ``Tiers``' device."""


# id(parameter) -> (a weak reference to it, its name, its Tiers, the tier its values are on otherwise);
# None when empty. Replaced whole under the lock (readers on other threads see one dict or the other).
guards: dict[int, tuple[weakref.ref, str, Tiers, str]] | None = None
_lock = threading.Lock()


def guard(owner: object, tiers: Tiers, named: Iterable[tuple[str, Any]], where: str) -> weakref.finalize:
    """Check ``named``'s parameters on ``tiers``' device at every op that reads them, until the returned
    finalizer is called (the wrapper's ``close``) or ``owner`` is garbage-collected. ``where``: the tier a parameter
    is on when it is not on the device (``"cpu"``, ``"nvme"``)."""
    global guards
    entries = {id(p): (weakref.ref(p), name, tiers, where) for name, p in named}
    with _lock:
        guards = {**(guards or {}), **entries}
    return weakref.finalize(owner, _drop, entries)


def _drop(entries: dict[int, tuple[weakref.ref, str, Tiers, str]]) -> None:
    """Remove ``entries`` (those a later ``guard`` of the same parameters replaced stay)."""
    global guards
    with _lock:
        left = {k: v for k, v in (guards or {}).items() if entries.get(k) is not v}
        guards = left or None


def check(tensors: Iterable[Any]) -> None:
    """Raise ``NotOnDevice`` if a guarded parameter among ``tensors`` is not on its device (autograd
    calls this only while ``guards`` is not None)."""
    table = guards
    if table is None:
        return
    for t in tensors:
        entry = table.get(id(t))
        if entry is None or entry[0]() is not t:
            continue
        _, name, tiers, where = entry
        if not tiers.on_device(t.data):
            raise NotOnDevice(f"parameter {name!r} ({t.data.dtype}{list(t.data.shape)}) is on the {where}, not "
                              "resident on the device: compute reads parameters only on the device")
