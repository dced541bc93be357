"""Global tensors with sharding annotations: one numpy array split over a ``DeviceMesh``.

GSPMD (Xu et al. 2021, "GSPMD: General and Scalable Parallelization for ML Computation Graphs")
annotates tensors with how they are split over a device mesh and lets the compiler insert the
collectives; OneFlow (Yuan et al. 2021, "OneFlow: Redesign the Distributed Deep Learning Framework
from Scratch") names the three placements SBP: split ``S(i)``, broadcast ``B`` and partial-sum ``P``.
Here a tensor is given one placement per mesh axis it is laid out on, and converting between
placements picks the collective on that axis's traced communicator.

- ``placement.py``: ``Shard(dim)``, ``Replicate()``, ``Partial("sum")`` (printed ``S(0)``, ``B``, ``P``).
- ``tensor.py``: ``GlobalTensor`` (the rank's piece, the global shape, the mesh, the axes and one
  placement per axis), the layout checks (a cut that does not divide is uneven, as DTensor's: ``ceil(n/p)``
  rows, the last shorter) and ``from_global`` / ``to_global`` for tests and examples.
- ``agree.py``: the ranks' agreement on a tensor's mesh (by value), shape and placements, checked when
  a tensor is made (one small untraced collective) and, in debug mode, before every op.
- ``plan.py``: the cheapest redistribution (``cheapest``): a shortest path over single-axis steps
  (all-reduce, reduce-scatter, all-gather, all-to-all, local slice, local zeroing) and two-axis
  exchanges, by the bytes of the busiest rank.
- ``redistribute.py``: ``redistribute(t, placements)`` runs that plan (or, ``plan="greedy"``, the
  single-axis steps in a documented fixed order that ``greedy`` lists).
- ``propagate.py``: the rules of a matmul and of elementwise ops (OneFlow's SBP signatures, per mesh
  axis as GSPMD does) and the chooser of the cheapest legal strategy (bytes, then fewest changes).
- ``chain.py``: whole-chain propagation: the strategies of a chain of ops of least total bytes, by
  dynamic programming over the chain (``plan``), beside the ops' one-op-ahead choices (``greedy``).
- ``ops.py``: every op the tiny GPT needs on global tensors (matmul, elementwise, unary, reductions,
  softmax, logsumexp, reshape, transpose, embedding), each propagated and differentiable.
- ``autograd.py``: the graph the ops record and the rules of gradients' placements (where partial
  ones are reduced); ``engine.py``: the backward pass itself, made of the same ops.
- ``nn.py``: ``minipar.nn``'s layers with placed weights; ``MEGATRON``: Megatron as annotations.
- ``minipar/cost/sharding.py``: the bytes each step sends per rank, from the collective formulas.
"""

from minipar.sharding import engine
from minipar.sharding.ops import add, matmul, mul
from minipar.sharding.placement import Partial, Placement, Replicate, Shard
from minipar.sharding.plan import Exchange, Step, cheapest
from minipar.sharding.propagate import matmul_strategies
from minipar.sharding.redistribute import greedy, redistribute, to_global
from minipar.sharding.tensor import GlobalTensor, check_layout, local_slices

# PyTorch's ``t.backward()`` and DTensor's ``t.full_tensor()``: methods whose code sits in the layers
# above tensor.py, bound here, at the package's top, so that tensor.py imports none of them (importing
# any module of the package runs this file first).
GlobalTensor.backward = engine.backward  # type: ignore[attr-defined]
GlobalTensor.to_global = to_global  # type: ignore[attr-defined]

__all__ = ["Exchange", "GlobalTensor", "Partial", "Placement", "Replicate", "Shard", "Step", "add", "cheapest",
           "check_layout", "greedy", "local_slices", "matmul", "matmul_strategies", "mul", "redistribute"]
