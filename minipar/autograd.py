"""A small reverse-mode autograd engine over numpy arrays.

In the spirit of micrograd (Karpathy) but on arrays: every op makes a new ``Tensor`` that remembers
its parents and a closure computing the parents' gradients from its own. Each op's backward is
written right next to its forward (``minipar.tensor_ops``: the ops ``Tensor`` inherits; this module
is the engine: the graph, the backward sweep, grad mode, bf16 rounding, ``Function``).
``Tensor.backward`` walks the graph from the output, always taking the most recently created node
whose consumers are all done (PyTorch's engine does the same by sequence number), so the last
layer's parameters are finished first. A leaf's gradient is
accumulated into ``.grad`` (like PyTorch) the moment its last consumer has been processed, and its
hooks fire then: data-parallel bucketing and ZeRO-2 start communication from those hooks.

``Function`` lets other modules define a custom forward/backward pair (Megatron's ``f`` and ``g``
operators, communication inside the graph).

bfloat16 (``ml_dtypes.bfloat16``) is emulated: numpy has no bfloat16 matmul kernels and promotes
bfloat16 with python floats to float32, so a parameter stored in bfloat16 (two bytes, as it is sent)
is read by ops as float32 and every op with a bfloat16 input computes in float32 and rounds its
result to bfloat16, held in a float32 array (an activation costs four bytes here, two on a GPU). A
matmul thus multiplies bf16-rounded operands and sums in float32, as a tensor core does; what is not
emulated is the order of the float32 sums inside an op. Gradients flowing into such a value are
rounded to bfloat16 too; a parameter's gradient is stored in bfloat16 (``_accumulate``).
"""

from __future__ import annotations

import heapq
import itertools
import threading
from collections.abc import Callable, Sequence
from typing import Any

import ml_dtypes
import numpy as np

from minipar import residency
from minipar.tensor_ops import TensorOps, unbroadcast

ArrayLike = Any
_seq = itertools.count()
_mode = threading.local()  # grad mode is per thread: ranks of the threads backend are threads
BF16 = np.dtype(ml_dtypes.bfloat16)


def bf16_round(a: np.ndarray) -> np.ndarray:
    """``a`` rounded to the nearest bfloat16 (to nearest even), held in float32 (module docstring)."""
    return np.asarray(a).astype(BF16).astype(np.float32)


def is_grad_enabled() -> bool:
    return getattr(_mode, "enabled", True)


class no_grad:  # noqa: N801 - PyTorch's name
    """Ops inside the block build no graph (like ``torch.no_grad``). A class rather than a generator
    (``contextlib.contextmanager`` costs several microseconds a use): every ``Function.apply`` enters one."""

    def __enter__(self) -> None:
        self.prev = is_grad_enabled()
        _mode.enabled = False

    def __exit__(self, *exc: object) -> None:
        _mode.enabled = self.prev


class enable_grad(no_grad):  # noqa: N801 - PyTorch's name
    """Ops inside the block build a graph again (``torch.enable_grad``): recomputation re-runs a
    forward inside a backward (``minipar.recompute``)."""

    def __enter__(self) -> None:
        self.prev = is_grad_enabled()
        _mode.enabled = True


class HookHandle:
    def __init__(self, hooks: list, fn: Callable) -> None:
        self._hooks, self._fn = hooks, fn

    def remove(self) -> None:
        if self._fn in self._hooks:
            self._hooks.remove(self._fn)


class Tensor(TensorOps):
    """An n-d array that records how it was computed. float64 unless given another float dtype."""

    __array_priority__ = 1000  # numpy defers to our operators: ``ndarray * Tensor`` -> Tensor

    def __init__(self, data: ArrayLike, requires_grad: bool = False, dtype: Any = None) -> None:
        if isinstance(data, Tensor):
            data = data.data
        if dtype is None and not isinstance(data, np.ndarray | np.generic):
            dtype = np.float64  # python numbers and lists; numpy inputs keep their dtype
        self.data: np.ndarray = np.asarray(data, dtype=dtype)
        self.grad: np.ndarray | None = None
        self.requires_grad = requires_grad
        self._parents: tuple[Tensor, ...] = ()
        self._backward: Callable[[np.ndarray], Sequence[np.ndarray | None]] | None = None
        self._hooks: list[Callable[[Tensor], None]] = []
        self._retain = False
        self._ctx: Context | None = None  # a Function's saved state (memory.held_buffers counts it)
        self._bf16 = False  # an op's result rounded to bfloat16 (module docstring)
        self._seq = next(_seq)

    # -- graph plumbing ---------------------------------------------------------------------
    @staticmethod
    def _make(data: np.ndarray, parents: tuple[Tensor, ...],
              backward: Callable[[np.ndarray], Sequence[np.ndarray | None]]) -> Tensor:
        out = Tensor(data)
        if any(p._bf16 or p.data.dtype == BF16 for p in parents):
            out.data, out._bf16 = bf16_round(out.data), True
        if is_grad_enabled() and any(p.requires_grad for p in parents):
            out.requires_grad = True
            out._parents = parents
            out._backward = backward
        return out

    @property
    def is_leaf(self) -> bool:
        return self._backward is None

    def register_hook(self, fn: Callable[[Tensor], None]) -> HookHandle:
        """Call ``fn(self)`` once this leaf's ``.grad`` for the running backward is complete
        (PyTorch's ``register_post_accumulate_grad_hook``)."""
        if not self.is_leaf:
            raise ValueError("hooks are for leaf tensors (parameters); use retain_grad() for others")
        self._hooks.append(fn)
        return HookHandle(self._hooks, fn)

    def retain_grad(self) -> Tensor:
        """Keep ``.grad`` on this non-leaf tensor after backward."""
        self._retain = True
        return self

    def backward(self, grad: ArrayLike | None = None, weights: Any = None) -> None:
        """Reverse-mode sweep from this tensor; leaf gradients accumulate into ``.grad``. With
        ``weights`` (a ``split_backward.WeightGradients``) the gradients of its weights are left for
        its ``run()`` (zero-bubble's B now, W later)."""
        if not self.requires_grad:
            raise RuntimeError("backward() on a tensor that does not require grad")
        if grad is None:
            if self.data.size != 1:
                raise RuntimeError("backward() without a gradient needs a scalar output")
            grad = np.ones_like(self.data)
        grad = np.asarray(grad, dtype=self.data.dtype).reshape(self.data.shape)
        # count, for every node reachable from here, how many consumers will send it a gradient
        pending: dict[int, int] = {}
        stack, seen = [self], {id(self)}
        while stack:
            node = stack.pop()
            for p in node._parents:
                if p.requires_grad:
                    pending[id(p)] = pending.get(id(p), 0) + 1
                    if id(p) not in seen:
                        seen.add(id(p))
                        stack.append(p)
        grads: dict[int, np.ndarray] = {id(self): grad}
        handed: set[int] = set()  # gradient arrays already stored in some leaf's .grad
        ready = [(-self._seq, self)]
        while ready:
            _, node = heapq.heappop(ready)
            g = grads.pop(id(node))
            if node.is_leaf or node._retain:
                node._accumulate(g, owned=False)  # the caller's array, or one this node's backward reads
                if node.is_leaf:
                    continue
            done: list[Tensor] = []
            if residency.guards is not None:  # an offload wrapper lives: its parameters on the device
                residency.check(node._parents)
            parent_grads = node._backward(g) if weights is None else weights.split(node, g)
            for p, pg in zip(node._parents, parent_grads, strict=True):
                if not p.requires_grad or (weights is not None and weights.defers(p)):
                    continue
                if pg is not None:
                    prev = grads.get(id(p))
                    pg = pg if prev is None else prev + pg
                    grads[id(p)] = bf16_round(pg) if p._bf16 else pg
                pending[id(p)] -= 1
                if pending[id(p)] == 0:
                    if id(p) not in grads:  # every consumer passed None: a zero gradient
                        grads[id(p)] = np.zeros_like(p.data)
                    if p.is_leaf:  # accumulate (and fire hooks) at once, like PyTorch's AccumulateGrad
                        done.append(p)
                    else:
                        heapq.heappush(ready, (-p._seq, p))
            for p in done:
                pg = grads.pop(id(p))
                # keep the array itself (no copy) only when nothing else can see it
                owned = (pg.flags.owndata and pg.flags.writeable and id(pg) not in handed
                         and pg is not g and all(v is not pg for v in grads.values()))
                handed.add(id(pg))
                p._accumulate(pg, owned)

    def _accumulate(self, g: np.ndarray, owned: bool) -> None:
        g = unbroadcast(np.asarray(g), self.data.shape).astype(self.data.dtype, copy=False)
        if self.grad is not None:
            self.grad = self.grad + g
        else:
            self.grad = g if owned and g.flags.owndata else np.array(g, copy=True)
        for hook in list(self._hooks):
            hook(self)

    def zero_grad(self) -> None:
        self.grad = None

    def detach(self) -> Tensor:
        return Tensor(self.data)

    # -- properties -------------------------------------------------------------------------
    @property
    def shape(self) -> tuple[int, ...]:
        return self.data.shape

    @property
    def ndim(self) -> int:
        return self.data.ndim

    @property
    def dtype(self) -> np.dtype:
        return self.data.dtype

    @property
    def size(self) -> int:
        return self.data.size

    def numpy(self) -> np.ndarray:
        return self.data

    def item(self) -> float:
        return self.data.item()

    def __len__(self) -> int:
        return len(self.data)

    def __repr__(self) -> str:
        flag = ", requires_grad=True" if self.requires_grad else ""
        return f"Tensor({np.array2string(self.data, precision=4, threshold=20)}{flag})"


class Context:
    """What a ``Function``'s forward leaves for its backward.

    ``saved``: what forward passed to ``save_for_backward``, except that an array that was a leaf
    argument's ``data`` (a parameter) is read from the leaf again when backward asks for it, as a
    PyTorch saved tensor shares its parameter's storage. ZeRO-3 / FSDP rely on it: they free a
    unit's gathered parameters after forward and gather them again before its backward."""

    def __init__(self, needs_input_grad: tuple[bool, ...] = ()) -> None:
        self._saved: tuple[Any, ...] = ()
        self.needs_input_grad = needs_input_grad  # per forward argument: a Tensor that requires grad
        self.tensor_slots: tuple[int, ...] = ()  # the forward argument of each graph parent (set by apply)

    def save_for_backward(self, *values: Any) -> None:
        self._saved = values

    @property
    def saved(self) -> tuple[Any, ...]:
        return tuple(v.data if isinstance(v, Tensor) else v for v in self._saved)

    def _refer_to_leaves(self, args: Sequence[Any]) -> None:
        """Replace saved arrays that are a leaf argument's current ``data`` by the leaf itself."""
        leaves = {id(a.data): a for a in args if isinstance(a, Tensor) and a.is_leaf and a.requires_grad}
        if leaves:
            self._saved = tuple(leaves.get(id(v), v) for v in self._saved)


class Function:
    """A custom op: subclass, define ``forward(ctx, *args)`` and ``backward(ctx, grad)``.

    ``forward`` receives numpy arrays for Tensor arguments (other arguments as given) and returns
    an array. ``backward`` returns one gradient (array or None) per argument of forward. Call with
    ``MyOp.apply(x, ...)``, as in ``torch.autograd.Function``.
    """

    @staticmethod
    def forward(ctx: Context, *args: Any) -> np.ndarray:
        raise NotImplementedError

    @staticmethod
    def backward(ctx: Context, grad: np.ndarray) -> Any:
        raise NotImplementedError

    @classmethod
    def apply(cls, *args: Any) -> Tensor:
        if residency.guards is not None:  # an offload wrapper lives: its parameters on the device
            residency.check(args)
        ctx = Context(tuple(isinstance(a, Tensor) and a.requires_grad for a in args))
        raw = [a.data if isinstance(a, Tensor) else a for a in args]
        with no_grad():
            out = np.asarray(cls.forward(ctx, *raw))
        ctx._refer_to_leaves(args)
        slots = [i for i, a in enumerate(args) if isinstance(a, Tensor)]
        parents = tuple(args[i] for i in slots)
        ctx.tensor_slots = tuple(slots)  # forward argument of each parent (split_backward masks by it)

        n_args = len(args)  # not ``args``: the closure must not keep the inputs' graph alive

        def backward(g: np.ndarray) -> list[np.ndarray | None]:
            grads = cls.backward(ctx, g)
            if not isinstance(grads, tuple | list):
                grads = (grads,)
            if len(grads) != n_args:
                raise RuntimeError(f"{cls.__name__}.backward returned {len(grads)} gradients for {n_args} inputs")
            return [grads[i] for i in slots]

        result = Tensor._make(out, parents, backward)
        if result._backward is not None:
            result._ctx = ctx
        return result
