"""PatrickStar's chunk-based memory manager, on one rank or N data-parallel ranks (Fang et al. 2021,
"PatrickStar: Parallel Training of Pre-trained Models via Chunk-based Memory Management", Sec. 4-5).

**Chunks.** The parameters are packed in registration order into chunks of ``chunk_size`` elements
(a tensor that does not fit in the current chunk's rest opens the next chunk; no tensor is split, so
``chunk_size`` must hold the largest one). A chunk is the unit of placement and of movement: it lives
on the device *or* on the CPU, never both, and moves whole (``Tiers.to_device`` / ``to_cpu`` + ``free``:
copies, each a recorded "transfer" of ``chunk_size x itemsize`` bytes). Every parameter's ``.data``
is a view of its chunk wherever the chunk is. The CPU also keeps, per chunk, the master copy of the
parameters and AdamW's two moments (the paper's optimizer-state chunks, "model states on CPU").

**Tensor states** (the paper's Sec. 4.1) and their transitions here::

    FREE            not managed: before the chunks are filled, and after close() (the parameters then
                    keep plain host views of their chunks)
    HOLD            values in the chunk, not in use             FREE -> HOLD (packed); HOLD_AFTER_BWD -> HOLD
                                                                (the CPU step wrote the updated values)
    COMPUTE         in use by an operator: its chunk must be    HOLD -> COMPUTE before its module's forward;
                    on the device and may not be evicted        HOLD_AFTER_FWD -> COMPUTE before its backward
    HOLD_AFTER_FWD  used by forward, needed again by backward   COMPUTE -> HOLD_AFTER_FWD after the forward
    HOLD_AFTER_BWD  its slot holds its gradient (the paper      COMPUTE -> HOLD_AFTER_BWD when its gradient is
                    reuses the parameter's memory for it)       complete (autograd's hook): copied in its place

A chunk moves to the device when one of its tensors becomes COMPUTE and it is on the CPU; when the
device budget would be exceeded the manager evicts (moves to the CPU) a resident chunk none of whose
tensors is COMPUTE, chosen by the policy (``chunk_policy``: ``"lru"`` or ``"warmup"``, Belady's rule
on the order of uses recorded in warm-up). At the step every chunk goes to the CPU (its gradients),
AdamW (fp64) runs there on the master copy of each HOLD_AFTER_BWD tensor, the updated values are
written into the chunk, which comes back to the device on its next use.

**Non-model data** (the paper's Sec. 5, the runtime memory tracer). The device also holds the
activations. The first iteration (warm-up) measures them at every *moment*, i.e. before and after
each module's forward and before its backward: the bytes of the autograd graph made this iteration
(``minipar.memory.held_buffers`` from the module inputs and outputs so far and, in backward, the
loss; minipar's engine frees nothing before backward ends, so backward's value is the whole graph).
At each moment the manager holds exactly that many bytes on the device as one allocation named
"non-model data" (measured in warm-up, replayed from the record later), so the chunks get the budget
minus the activations of that moment, and ``Tiers`` enforces the sum. The replay assumes the warm-up's
batch shape: ``backward`` measures the whole graph and refuses one larger than warm-up's. The activations that primitive
ops capture in closures (``cross_entropy``'s softmax, ``relu``'s mask) are not seen
(``held_buffers``' limit). A budget below one chunk raises ``DeviceOutOfMemory`` at construction;
below what some moment needs (its activations plus its COMPUTE chunks, at least one chunk) it raises
in the warm-up iteration, at that moment, before any step changed a parameter.

**Bytes per step.** Every chunk is on the CPU when an iteration starts (the step put it there), so
each miss (a chunk needed while on the CPU) moves it up and, later, by eviction or at the step, down:
``2 x chunk bytes x misses``. For a model that uses its modules in registration order and backward
in reverse (``nn.GPT``, an MLP), with ``C`` chunks of which ``k = (budget - A) // chunk bytes`` fit
beside the activations ``A`` at the start of backward: ``misses = C + max(0, C - k)`` under either
policy (both keep the most recently used chunks here); a model that reuses a module out of order is
where the recorded order beats LRU (``minipar.cost.offload.chunk_offload_bytes``, docs/formulas.md 7).

**Mixed precision** (``precision="mixed"``, a model built with ``dtype=np.float16``; ZeRO's placement,
Rajbhandari et al. 2020, Sec. 3.1, with Micikevicius et al. 2018's loss scaling): the chunks hold float16
parameters and, after backward, float16 gradients of ``loss x S``; the CPU keeps a float32 master and
float32 moments for the owned chunks (K = 12 bytes per parameter). The step unscales ``fp32(g) / S``;
an inf or nan on any rank (one all-reduce when N > 1) skips it, changing nothing, and halves S
(initially 2^12, ``minipar.parallel.zero.precision``); otherwise AdamW updates the master, cast to
float16 into the chunk. Chunks of 2-byte items move a quarter of float64's bytes for the same misses.

**N ranks** (``comm``; the paper's Sec. 5, "scale to multiple GPUs"). The chunk list is padded with
empty chunks to a multiple of N and cut into communication groups of N consecutive chunks; rank r owns
chunk r of each group: only its owned chunks have a CPU payload, a master copy and AdamW's moments here.
A group moves as a unit: when a tensor of it becomes COMPUTE the owned chunk goes up (a transfer) and
the group is all-gathered (ring, ``(N - 1) x chunk bytes`` sent per rank), its N chunks charged to the
budget; evicting it moves the owned chunk down and frees the others (their parameters are unchanged).
When every tensor of a group is HOLD_AFTER_BWD its gradient chunks are reduce-scattered (averaged over
the ranks, ``(N - 1) x chunk bytes`` sent); the rank keeps its owned chunk's and frees the rest. A
group holding some gradients but not yet reduced is not evicted (its other chunks' gradients would be
lost). Every rank trains on its 1/N of the batch; the averaged gradient is the global batch's, so the
owned chunks' AdamW step is one process's. Parameters of chunks not gathered are empty arrays (as
FSDP's resharded ones); ``state_dict`` returns this rank's owned parameters. With N > 1 every
parameter must get a gradient each step. The all-gather's receive buffer is not charged to the budget.
Bytes per step: ``chunk bytes x misses`` each way, misses now counted in groups, and ``(N - 1) x chunk
bytes x (misses + groups)`` sent (``minipar.cost.offload.chunk_dp_bytes``).

Usage (one rank): ``cm = ChunkManager(model, tiers, chunk_size, policy="warmup")``; per step
``loss = cm.loss(x, y)`` (or ``model.loss`` / ``model(x)`` directly: the hooks are on the modules),
``cm.backward(loss)``, ``cm.step()``; ``cm.state_dict()`` reads the master copy; ``cm.close()``.
Not supported: gradient accumulation (a forward after backward without a step is refused).
Trace: spans "F", "B", "opt"; the tiers' "transfer" events and "device" samples; a "non-model data"
sample when the reservation changes, a "cpu" sample (``state_bytes``' cpu entries) after each move.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from minipar import memory, residency, trace
from minipar.autograd import Tensor
from minipar.comm import Communicator
from minipar.functional import on_backward  # identity whose backward calls back: FSDP's unshard hook
from minipar.nn import Module, Parameter
from minipar.optim import AdamW
from minipar.parallel.offload.chunk_groups import Chunk, Groups, LossScaling, Slot, State, pack
from minipar.parallel.offload.chunk_policy import POLICIES
from minipar.parallel.zero.precision import PRECISIONS
from minipar.tiers import DeviceOutOfMemory, Tiers

NON_MODEL = "non-model data"


class ChunkManager(Groups, LossScaling):
    """PatrickStar's chunks for ``module`` on ``tiers`` (module docstring), AdamW on the CPU."""

    def __init__(self, module: Module, tiers: Tiers, chunk_size: int, policy: str = "warmup", lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.01,
                 comm: Communicator | None = None, precision: str = "fp64", loss_scale: float = 2.0**12,
                 growth_interval: int = 2000) -> None:
        named = list(module.named_parameters())
        if not named:
            raise ValueError("ChunkManager: the module has no parameters")
        largest = max(named, key=lambda kv: kv[1].size)
        if chunk_size < largest[1].size:
            raise ValueError(f"ChunkManager: chunk_size={chunk_size} elements cannot hold {largest[0]!r} "
                             f"({largest[1].size} elements); tensors are not split across chunks")
        if policy not in POLICIES:
            raise ValueError(f"ChunkManager: policy {policy!r}; choose one of {sorted(POLICIES)}")
        if len({p.dtype for _, p in named}) != 1 or len({id(p) for _, p in named}) != len(named):
            raise ValueError("ChunkManager: the parameters must share one dtype and not be tied")
        dtype = named[0][1].dtype
        if precision not in PRECISIONS or (precision == "mixed" and dtype != np.float16):
            raise ValueError(f"ChunkManager: precision {precision!r} with {np.dtype(dtype)} parameters; choose "
                             "'fp64', or 'mixed' with a float16 model")
        self.mixed, self.growth_interval = precision == "mixed", growth_interval
        self.loss_scale = loss_scale if self.mixed else 1.0
        self.clean_steps = self.skipped = 0
        master_dtype = np.float32 if self.mixed else dtype
        self.comm = comm
        self.world, self.rank = (comm.size, comm.rank) if comm is not None else (1, 0)
        group_bytes = self.world * chunk_size * np.dtype(dtype).itemsize
        if tiers.device_bytes + group_bytes > tiers.device_budget:  # not even one group fits: refuse now
            what = "one chunk" if self.world == 1 else f"one group of {self.world} chunks"
            raise DeviceOutOfMemory(tiers.device_budget, tiers.resident("device"), what, group_bytes)
        self.module, self.tiers, self.chunk_size = module, tiers, chunk_size
        self.policy = POLICIES[policy]()
        self.chunks: list[Chunk] = []
        self.slots: list[Slot] = []
        packed = pack(named, chunk_size)
        packed += [[] for _ in range(-len(packed) % self.world)]  # empty chunks: whole groups
        for c, members in enumerate(packed):
            chunk = Chunk(c, chunk_size, dtype, owned=c % self.world == self.rank, master_dtype=master_dtype)
            for name, p, offset in members:
                slot = Slot(len(self.slots), name, p, c, offset)
                if chunk.owned:
                    slot.view(chunk.cpu)[...] = p.data
                    slot.view(chunk.master)[...] = p.data
                    slot.master = slot.view(chunk.master)
                slot.state = State.HOLD
                chunk.slots.append(slot)
                self.slots.append(slot)
            chunk.point()
            self.chunks.append(chunk)
        self._slot_of = {id(s.param): s for s in self.slots}
        self.owned = [s for s in self.slots if s.master is not None]
        self._adam_index = {s.index: i for i, s in enumerate(self.owned)}
        self.adam = AdamW([Tensor(s.master) for s in self.owned] or [Tensor(np.zeros(0, master_dtype))], lr, betas, eps,
                          weight_decay)  # a rank whose owned chunks are all padding: an empty placeholder
        self.reduced: set[int] = set()  # groups whose gradients are reduce-scattered this iteration
        self._hooks = [s.param.register_hook(self._on_grad_ready) for s in self.slots]
        self._unguard = residency.guard(self, tiers, named, "cpu")  # every op: its parameters on the device
        self._wrapped = self._owners(module)
        for m in self._wrapped:
            m.forward = self._wrap(m, m.forward)  # an instance attribute: the class's forward stays
        self.iteration = 0
        self.moments: list[tuple[str, int]] = []  # the warm-up's moments (kind, module id) in order
        self.reserve: list[int] = []  # ... and the non-model bytes measured at each
        self.uses: list[int] = []  # the chunks used, in order, in warm-up
        self._reset_iteration()

    @staticmethod
    def _owners(module: Module) -> list[Module]:
        """The modules that hold parameters themselves (Linear, LayerNorm, Embedding), outermost first."""
        out, stack = [], [module]
        while stack:
            m = stack.pop(0)
            if any(isinstance(v, Parameter) for v in vars(m).values()):
                out.append(m)
            stack[:0] = [child for _, child in m.children()]
        return out

    def _reset_iteration(self) -> None:
        self._moment = 0
        self._position = 0  # uses made this iteration
        self._roots: list[Tensor] = []
        self._since = memory.seq_mark()

    @property
    def warming_up(self) -> bool:
        return self.iteration == 0

    @property
    def chunk_bytes(self) -> int:
        return self.chunks[0].nbytes

    # ---- hooks ----------------------------------------------------------------------------------
    def _wrap(self, m: Module, forward: Callable[..., Tensor]) -> Callable[..., Tensor]:
        mine = [self._slot_of[id(v)] for v in vars(m).values() if isinstance(v, Parameter)]

        def wrapped(*args: Any, **kwargs: Any) -> Tensor:
            if any(s.state is State.HOLD_AFTER_BWD for s in self.slots):
                raise RuntimeError("ChunkManager: forward after backward without step(): the chunks hold "
                                   "gradients (gradient accumulation is not supported)")
            if self.warming_up:
                self._roots.extend(a for a in args if isinstance(a, Tensor))
            self._set(mine, State.COMPUTE)
            self._at(("pre-forward", id(m)), mine)
            out = forward(*args, **kwargs)
            self._set(mine, State.HOLD_AFTER_FWD)
            if self.warming_up:
                self._roots.append(out)
            self._at(("post-forward", id(m)), [])
            return on_backward.apply(out, lambda: self._pre_backward(m, mine))
        return wrapped

    def _pre_backward(self, m: Module, mine: list[Slot]) -> None:
        todo = [s for s in mine if s.state is not State.HOLD_AFTER_BWD]
        self._set(todo, State.COMPUTE)
        self._at(("pre-backward", id(m)), todo)

    def _on_grad_ready(self, p: Tensor) -> None:
        """The gradient is complete: copy it into the tensor's own place in its chunk (on the device,
        where the tensor is COMPUTE), HOLD_AFTER_BWD."""
        s = self._slot_of[id(p)]
        if s.state is not State.COMPUTE:
            raise RuntimeError(f"ChunkManager: {s.name}'s gradient arrived in state {s.state.name} (a second "
                               "backward without step()? gradient accumulation is not supported)")
        s.view(self.chunks[s.chunk].payload)[...] = p.grad
        p.grad = None
        s.state = State.HOLD_AFTER_BWD
        g = s.chunk // self.world
        if self.world > 1 and all(t.state is State.HOLD_AFTER_BWD for c in self.group(g) for t in c.slots):
            self._reduce_scatter(g)

    @staticmethod
    def _set(slots: list[Slot], state: State) -> None:
        for s in slots:
            s.state = state

    # ---- moments: the non-model reservation and the chunks in use ----------------------------------
    def _at(self, key: tuple[str, int], computing: list[Slot]) -> None:
        """One moment: reserve its non-model bytes (measured in warm-up, replayed later), then bring
        the chunks of the COMPUTE tensors to the device, evicting by the policy."""
        if self.warming_up:
            self.moments.append(key)
            self.reserve.append(self._measure(key[0] == "pre-backward"))
        elif self._moment >= len(self.moments) or self.moments[self._moment] != key:
            raise RuntimeError(f"ChunkManager: moment {self._moment} ({key[0]}) differs from the warm-up's "
                               "order; the model must run its modules in the same order every iteration")
        self._reserve(self.reserve[self._moment])
        self._moment += 1
        needed = sorted({s.chunk // self.world for s in computing})  # groups (chunks when N = 1)
        for g in needed:
            if self.warming_up:
                self.uses.append(g)
            self.policy.touch(g)
            self._position += 1
        for g in needed:
            if g in self.reduced:
                raise RuntimeError(f"ChunkManager: group {g} is needed after its gradients were reduce-scattered")
            if not self._resident(g):
                self._make_room(sum(c.nbytes for c in self.group(g)))
                self._gather(g)

    def _measure(self, backward: bool) -> int:
        """Bytes of the autograd graph made this iteration, reachable from the roots (and the loss)."""
        roots = self._roots + ([self._loss] if backward and self._loss is not None else [])
        if not roots:
            return 0
        top = Tensor(np.empty(0, np.uint8))
        top._parents, top._backward = tuple(roots), lambda g: ()
        return memory.activation_bytes(top, self._since)

    def _reserve(self, nbytes: int) -> None:
        held = self.tiers.resident("device").get(NON_MODEL)
        if held == nbytes or (held is None and nbytes == 0):
            return
        if held is not None:
            self.tiers.free(NON_MODEL)
        if nbytes:
            self._make_room(nbytes)
            self.tiers.empty(NON_MODEL, nbytes, np.uint8)
        trace.memory(NON_MODEL, nbytes)

    def _make_room(self, nbytes: int) -> None:
        """Evict chunks (policy's choice among those with no COMPUTE tensor) until ``nbytes`` fit;
        if they cannot, the allocation that follows raises ``DeviceOutOfMemory``."""
        while self.tiers.device_bytes + nbytes > self.tiers.device_budget:
            candidates = [g for g in range(self.n_groups) if self._evictable(g)]
            if not candidates:
                return
            self._evict(self.policy.choose(candidates, self._position))

    def _up(self, chunk: Chunk) -> None:
        chunk.device = self.tiers.to_device(chunk.name, chunk.cpu)
        chunk.cpu = None
        chunk.point()
        self._sample()

    def _down(self, chunk: Chunk) -> None:
        chunk.cpu = self.tiers.to_cpu(chunk.name)
        self.tiers.free(chunk.name)
        chunk.device = None
        chunk.point()
        self._sample()

    def _sample(self) -> None:
        """A "cpu" memory sample: the host bytes now (the device pool samples itself)."""
        if trace.current() is not None:
            trace.memory("cpu", sum(v for k, v in self.state_bytes().items() if k.startswith("cpu")))

    # ---- a training step ------------------------------------------------------------------------------
    _loss: Tensor | None = None

    def loss(self, *args: Any) -> Tensor:
        """``module.loss(*args)`` (the hooks place the chunks)."""
        with trace.span("F"):
            return self.module.loss(*args)

    def backward(self, loss: Tensor) -> None:
        """``loss.backward()``: chunks come back as their modules' backward needs them; every gradient
        lands in its tensor's place (HOLD_AFTER_BWD). The non-model reservation is released after."""
        if self.mixed:
            loss = loss * self.loss_scale
        self._loss = loss
        if not self.warming_up and self.reserve:  # the replayed reservation must still cover the graph
            now = memory.activation_bytes(loss, self._since)
            if now > max(self.reserve):
                raise RuntimeError(f"ChunkManager: this iteration's activations ({now} bytes) exceed the "
                                   f"warm-up's ({max(self.reserve)}): the batch shape must stay as in warm-up")
        try:
            with trace.span("B"):
                loss.backward()
        finally:
            self._loss = None
        self._reserve(0)
        for s in self.slots:  # a tensor whose module ran but that got no gradient: not updated
            if s.state is State.COMPUTE:
                s.state = State.HOLD_AFTER_FWD
        if self.world > 1 and len(self.reduced) != self.n_groups:
            raise RuntimeError("ChunkManager: with N > 1 every parameter needs a gradient each step (groups "
                               f"{sorted(set(range(self.n_groups)) - self.reduced)} were not reduce-scattered)")

    def step(self) -> bool:
        """Every chunk to the CPU; AdamW on the master copy of each tensor that has a gradient, the
        updated values written into the chunk (HOLD). Mixed precision: the gradients unscaled into
        float32; on an overflow (any rank) nothing changes and the loss scale halves. False when skipped.
        The warm-up's order is learned after iteration 0."""
        with trace.span("opt"):
            for chunk in self.chunks:
                if chunk.device is not None:
                    self._off_device(chunk)
            grads = {s.index: self._grad(s) for s in self.owned if s.state is State.HOLD_AFTER_BWD}
            applied = not self.mixed or not self._overflow(list(grads.values()))
            for chunk in self.chunks:
                for s in chunk.slots:
                    if chunk.owned:
                        if applied and s.index in grads:
                            self.adam.update(s.master, grads[s.index], self.adam.state[self._adam_index[s.index]])
                        s.view(chunk.cpu)[...] = s.master  # mixed: the fp32 master cast to fp16
                    s.state = State.HOLD
            self.reduced.clear()
        if self.warming_up:
            self.policy.learn(self.uses)
        self._reserve(0)
        self._sample()
        self.iteration += 1
        self._reset_iteration()
        return applied

    # ---- reading it back --------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, np.ndarray]:
        """This rank's owned parameters' current values (the CPU's master copy, in the model's dtype), by
        name (every parameter when N = 1)."""
        return {s.name: s.master.astype(self.chunks[s.chunk].dtype) for s in self.owned}

    def state_bytes(self) -> dict[str, int]:
        """Bytes held now: chunks on the device and on the CPU, the master copy, AdamW's moments."""
        return {"device chunks": sum(c.nbytes for c in self.chunks if c.device is not None),
                "cpu chunks": sum(c.nbytes for c in self.chunks if c.cpu is not None),
                "cpu master parameters": sum(c.master.nbytes for c in self.chunks if c.owned),
                "cpu optimizer state": self.adam.state_bytes()}

    def close(self) -> None:
        """Free the device: the chunks come to the CPU, the parameters keep views of them (FREE: no
        longer managed); the modules' forwards and the gradient hooks are removed."""
        for m in self._wrapped:
            vars(m).pop("forward", None)
        for h in self._hooks:
            h.remove()
        self._unguard()
        self._reserve(0)
        for chunk in self.chunks:
            if chunk.device is not None:
                self._off_device(chunk)
            self._set(chunk.slots, State.FREE)
