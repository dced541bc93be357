"""Errors raised by the communicator layer.

Every error names the rank(s) involved and the operation, so a failure on one of many ranks can be
traced back without a debugger.
"""

from __future__ import annotations


class CommError(RuntimeError):
    """Base class of communication errors."""


class CommTimeout(CommError):
    """A wait that lasted longer than the watchdog's timeout (``MINIPAR_TIMEOUT``, ``timeout=``);
    ``.peers`` are the world ranks it waited for."""

    peers: list[int] = []


class PeerLost(CommError):
    """A rank this wait depends on is dead: the failure detector (``detector.py``) heard nothing from
    it for ``MINIPAR_PEER_DEADLINE`` seconds. ``.rank`` (world rank of the dead one), ``.operation``
    (what this rank waited in), ``.declared_by`` (this world rank), ``.silence`` (seconds unheard)."""

    rank: int = -1
    operation: str = ""
    declared_by: int = -1
    silence: float = 0.0


class CollectiveMismatch(CommError):
    """Debug mode (``MINIPAR_DEBUG=1``): ranks entered different collectives, shapes or dtypes."""


class Aborted(CommError):
    """This rank was woken out of a wait because another rank of the launch failed."""


class RankError(Exception):
    """A rank of ``launch(..., backend="threads")`` raised; ``.rank`` and ``.error`` say which and what.

    ``launch`` re-raises the first failure as an instance of a class that derives from both
    ``RankError`` and the original exception's class when Python allows it, so callers may catch
    either (``except ValueError`` works for a configuration error raised on every rank).
    """

    rank: int
    error: BaseException

    def __init__(self, message: str, rank: int = -1, error: BaseException | None = None) -> None:
        super().__init__(message)
        self.rank = rank
        self.error = error if error is not None else self


def rank_error(rank: int, error: BaseException, detail: str = "") -> RankError:
    """Build the exception ``launch`` raises for ``error`` on ``rank``."""
    message = f"rank {rank} failed: {type(error).__name__}: {error}{detail}"
    base = type(error)
    if isinstance(error, RankError):
        base = Exception
    try:
        cls = type(f"RankError[{base.__name__}]", (RankError, base), {"__str__": lambda self: self.args[0]})
        exc = BaseException.__new__(cls, message)
        exc.args = (message,)
    except TypeError:  # incompatible instance layouts (OSError & co): plain RankError
        exc = RankError.__new__(RankError, message)
        exc.args = (message,)
    exc.rank = rank
    exc.error = error
    return exc
