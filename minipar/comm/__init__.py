"""The communicator layer: every byte minipar moves between ranks goes through here.

Two backends pass the same tests: ``mpi`` (mpi4py under ``mpiexec``) and ``threads`` (ranks are
threads of one process, for Jupyter and fast tests). Start ranks with ``launch``; under ``mpiexec``
the world is ``world()``.

    >>> import numpy as np, minipar
    >>> minipar.launch(lambda comm: comm.allreduce(np.ones(3) * comm.rank)[0], 4)
    [6.0, 6.0, 6.0, 6.0]

A ``Communicator`` has ``rank``, ``size``, ``world_rank``, ``backend``, ``group_ranks``;
point-to-point ``send``/``recv``/``isend``/``irecv``/``sendrecv`` on numpy arrays (``base.py``);
collectives ``allreduce``, ``reduce_scatter``, ``allgather``, ``all_to_all``, ``broadcast``,
``reduce``, ``gather``, ``scatter``, ``barrier`` and non-blocking ``iallreduce``,
``ireduce_scatter``, ``iallgather`` (``collectives.py``; algorithms in ``ring.py`` and
``tree.py``); control-plane objects ``send_object``, ``recv_object``, ``broadcast_object``,
``gather_object``, ``allgather_object``; ``split(color, key)`` and ``dup()``.
Waits are guarded by a watchdog (``watchdog.py``; ``MINIPAR_TIMEOUT``) and a failure detector
(``detector.py``: a dead peer is ``PeerLost``; ``MINIPAR_PEER_DEADLINE``; ``faults.py`` kills a
rank on purpose and runs jobs that survive it), collectives are checked
for mismatches in debug mode (``MINIPAR_DEBUG=1``).
"""

from minipar.comm.base import Request
from minipar.comm.collectives import ALGORITHMS_BY_OP, OPS, Communicator, scatter_shape
from minipar.comm.errors import Aborted, CollectiveMismatch, CommError, CommTimeout, PeerLost, RankError
from minipar.comm.launch import launch, world
from minipar.comm.ring import chunk_bounds

__all__ = [
    "ALGORITHMS_BY_OP", "OPS", "Aborted", "CollectiveMismatch", "CommError", "CommTimeout", "Communicator",
    "PeerLost", "RankError", "Request", "chunk_bounds", "launch", "scatter_shape", "world",
]
