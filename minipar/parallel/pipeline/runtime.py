"""The pipeline runtime: run any valid schedule over real ranks, one action at a time.

GPipe (Huang et al. 2018) splits a mini-batch into m micro-batches and the model into stages on
consecutive ranks; 1F1B / PipeDream-Flush and interleaved 1F1B (Narayanan et al. 2021, "Efficient
Large-Scale Language Model Training on GPU Clusters Using Megatron-LM", section 2.2) only change the
*order* in which each rank runs its forwards and backwards. So the executor here knows no schedule:
it interprets the lowered program (``lowering.py``) of its rank, action by action, like the
``_step_microbatches`` loop of ``torch.distributed.pipelining``'s runtime schedules:

==============  ===========================================================================
``sF i``        input = micro-batch i of the data (stage 0) or the activation received for
                (s, i), a leaf tensor with ``requires_grad`` so its gradient can go back;
                output = stage s applied to it; stash (input, output). The last stage computes
                the micro-batch's mean loss scaled by 1/m (mean of m equal micro-batch means =
                the global-batch mean, so accumulated gradients equal single-process ones).
``sB i``        ``output.backward(received gradient)`` (last stage: ``loss.backward()``);
                parameter gradients accumulate over micro-batches; input.grad is what goes
                upstream; the stash entry is freed.
``sI i``        the same backward without the weights' gradient (``split_backward``: zero
                bubble's B); what the weights' gradient needs is kept for ``sW i``.
``sW i``        the weights' gradient of micro-batch i, accumulated; frees what ``sI i`` kept.
``sU i``        the stage's own optimizer (``optimizer=`` factory) on its accumulated gradients,
                inside the step; F/B/I/W then run on the weight version their micro-batch uses
                (PipeDream's weight stashing, PipeDream-2BW: ``asynchronous.py``).
``sSEND_F i``   non-blocking ``isend`` of the activation (``SEND_B``: of the input gradient).
``sRECV_F i``   blocking ``recv`` of stage s's input (``RECV_B``: of its output's gradient).
==============  ===========================================================================

Tensors between stages on the same rank (interleaving with p = 1, hand-written layouts) are handed
over in memory. A bf16 model's activations and their gradients cross a boundary as bfloat16 (2 bytes
an element, exact: ``minipar.parallel.bf16.to_wire``). Message tags encode (direction, stage
boundary, micro-batch), so messages in flight between two ranks never match the wrong receive. After
the program: wait for the outstanding sends, broadcast the loss from the last stage to every rank,
run the optimizer on this rank's parameters.

Trace (``minipar.trace``, same format as ``simulate``): compute spans "F"/"B" with stage,
micro-batch, chunk (and ``args`` action, iteration), "opt" for the optimizer; memory samples
"activations" after every change, ``nbytes`` = bytes the stashed micro-batches' graphs keep alive
(``memory.activation_bytes``, plus the received input) and ``args["stashed"]`` = how many micro-batches are stashed (the
simulator's count, so the measured peak equals ``simulate(...).peak_stash``), measured only while a
trace records (no graph walk otherwise); messages are recorded
by the comm layer (op "send"), each side's event labelled with the stage, micro-batch and chunk of
the SEND/RECV action in that rank's program, as the simulator labels them: the sender's event
carries the stage the tensor leaves (``sSEND_F i``: stage s's output activation; ``sSEND_B i``:
the gradient of stage s's input), the receiver's event the stage it enters (``sRECV_F i``: stage
s's input, from stage s - 1; ``sRECV_B i``: the gradient of stage s's output, from stage s + 1).
Per step, rank r sends at most 2 m v messages of one micro-batch's activation (or gradient) each
(``minipar.cost.pipeline.send_bytes`` gives the exact bytes, ``trace_meta`` puts them in the trace); memory: peak
stash x (activations of one stage on one micro-batch).

Bad configurations raise ``ValueError`` (``ScheduleError`` for schedules) on every rank before any
message is sent: a schedule for another number of ranks, more stages than layers, m not a multiple
of p for interleaved, a batch not divisible by m.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import numpy as np

from minipar import trace
from minipar.autograd import Tensor
from minipar.comm.base import MAX_TAG
from minipar.cost import pipeline as cost
from minipar.memory import activation_bytes
from minipar.nn import Parameter
from minipar.optim import Optimizer
from minipar.parallel.bf16 import from_wire, to_wire
from minipar.split_backward import WeightGradients

from . import asynchronous
from .generators import make_schedule
from .partition import LayeredModel, Stage, split_layers
from .schedule import Action, Schedule
from .validate import as_schedule, validate

ScheduleLike = str | Mapping[int, Sequence[Action | str]] | Sequence[Sequence[str] | str]


class Pipeline:
    """This rank's stages of ``model`` and the program it runs for ``schedule``.

    ``schedule``: a kind (``"naive" | "gpipe" | "1f1b" | "interleaved"``, built for p = comm.size
    with ``microbatches`` and ``chunks``), or a schedule (``make_schedule(...)``, a hand-written
    ``{rank: ["0F0", ...]}``, compute-only or lowered). ``layers``: layer counts per virtual stage
    (default balanced). Every rank constructs it with the same arguments; checks happen here, before
    any communication. ``step(x, y, optimizer)`` trains on one global batch."""

    def __init__(self, comm: Any, model: LayeredModel, schedule: ScheduleLike = "1f1b",
                 microbatches: int | None = None, chunks: int = 1,
                 layers: Sequence[int] | None = None, optimizer: Callable[[list[Parameter]], Optimizer] | None = None,
                 weights: str = "stash") -> None:
        self.comm, self.model = comm, model
        if isinstance(schedule, str):
            if microbatches is None:
                raise ValueError(f"pipeline: schedule={schedule!r} needs microbatches=m "
                                 f"(e.g. 2 * p = {2 * comm.size})")
            sched = make_schedule(schedule, comm.size, microbatches, chunks)
        else:
            sched = as_schedule(schedule)
            if microbatches is not None and microbatches != sched.microbatches:
                raise ValueError(f"pipeline: microbatches={microbatches} but the schedule runs "
                                 f"{sched.microbatches}; drop the argument or fix the schedule")
        if len(sched) != comm.size:
            raise ValueError(f"pipeline: the schedule is for {len(sched)} ranks but the communicator has "
                             f"{comm.size}; run with mpiexec -n {len(sched)} or build the schedule for "
                             f"{comm.size} stages")
        self.program: Schedule = validate(sched)
        self.kind, self.microbatches = sched.kind, sched.microbatches
        self.n_stages = self.program.virtual_stages
        self.chunks = max(1, self.n_stages // comm.size)
        try:
            self.layer_ranges = split_layers(model.n_layers, self.n_stages, layers)
        except ValueError as exc:
            raise ValueError(f"pipeline ({self.kind}, {comm.size} ranks x {self.chunks} chunks = "
                             f"{self.n_stages} stages): {exc}") from None
        if 2 * self.n_stages * self.microbatches > MAX_TAG:
            raise ValueError(f"pipeline: {self.n_stages} stages x {self.microbatches} micro-batches need "
                             f"more message tags than the comm layer has ({MAX_TAG}); "
                             "use fewer micro-batches")
        self.owner = {a.stage: r for r, acts in self.program.items() for a in acts if a.is_compute}
        self.actions: list[Action] = self.program[comm.rank]
        mine = sorted(s for s, r in self.owner.items() if r == comm.rank)
        self.chunk_of = {s: c for c, s in enumerate(mine)}
        self.stages: dict[int, Stage] = {s: Stage(s, model, self.layer_ranges[s]) for s in mine}
        self.last_stage = self.n_stages - 1
        self.iteration = 0
        self.peak_stash = 0
        self.microbatch_losses: list[float] = []
        self.versions: asynchronous.WeightVersions | None = None  # with U actions: per-stage updates
        if asynchronous.has_updates(self.program) != (optimizer is not None):
            raise ValueError(f"pipeline: a schedule with U actions (per-stage updates, {self.kind}) needs "
                             "optimizer=lambda params: SGD(params, lr=...), and only such a schedule takes one; "
                             "otherwise pass the optimizer to step()")
        if optimizer is not None:
            self.versions = asynchronous.WeightVersions(self.program, self.stages, optimizer, weights)

    # ---- parameters ---------------------------------------------------------------------------
    def named_parameters(self) -> list[tuple[str, Parameter]]:
        """This rank's parameters with their full-model names, stage by stage."""
        return [item for s in sorted(self.stages) for item in self.stages[s].named_parameters()]

    def parameters(self) -> list[Parameter]:
        return [p for _, p in self.named_parameters()]

    def state_dict(self) -> dict[str, np.ndarray]:
        return {name: p.data.copy() for name, p in self.named_parameters()}

    def grads(self) -> dict[str, np.ndarray]:
        """Gradients accumulated by the last ``step`` (zeros for a parameter that got none)."""
        return {n: (p.grad if p.grad is not None else np.zeros_like(p.data)).copy()
                for n, p in self.named_parameters()}

    def full_state_dict(self, root: int | None = 0) -> dict[str, np.ndarray] | None:
        """The whole model's state dict assembled from every rank's stages: on ``root`` (None
        elsewhere), or on every rank with ``root=None``. Control-plane objects: not traced."""
        return self._assemble(self.state_dict(), root)

    def full_grads(self, root: int | None = 0) -> dict[str, np.ndarray] | None:
        """The last step's gradients by full parameter name, assembled like ``full_state_dict``."""
        return self._assemble(self.grads(), root)

    def _assemble(self, part: dict[str, np.ndarray], root: int | None) -> dict[str, np.ndarray] | None:
        comm = self.comm
        parts = comm.allgather_object(part) if root is None else comm.gather_object(part, root=root)
        return None if parts is None else {k: v for d in parts for k, v in d.items()}

    def load_state_dict(self, full_state: Mapping[str, np.ndarray]) -> None:
        """Copy this rank's parameters out of the single-process model's full state dict."""
        own = dict(self.named_parameters())
        missing = sorted(own.keys() - full_state.keys())
        if missing:
            raise KeyError(f"state dict lacks this rank's parameters {missing[:5]}; "
                           "pass the full model's state_dict()")
        for name, p in own.items():
            p.data[...] = full_state[name]

    def trace_meta(self, boundary_bytes: int | Sequence[int] | None = None, steps: int = 1) -> dict[str, Any]:
        """Metadata for ``trace.record``: paradigm, schedule, p, m, v, per-rank actions, stage layers;
        with ``boundary_bytes`` (``minipar.cost.pipeline.send_bytes``: one micro-batch's activation at
        each stage boundary) also the formula the viewer draws next to the measured traffic,
        ``expected_bytes_by_rank = {"send": bytes per rank over steps}``."""
        meta = {"paradigm": "pipeline", "schedule": self.kind, "p": self.comm.size, "m": self.microbatches,
                "v": self.chunks, "model": self.model.kind, "activation_unit": "bytes",
                "actions": {str(r): [str(a) for a in acts] for r, acts in self.program.items()},
                "stage_layers": {str(s): [self.model.names[i] for i in rng]
                                 for s, rng in enumerate(self.layer_ranges)}}
        if boundary_bytes is not None:
            per_step = cost.send_bytes([self.owner[s] for s in range(self.n_stages)], self.microbatches,
                                       boundary_bytes)
            meta["expected_bytes_by_rank"] = {"send": [steps * b for b in per_step]}
        return meta

    # ---- one training step ---------------------------------------------------------------------
    def step(self, x: np.ndarray, y: np.ndarray, optimizer: Optimizer | None = None) -> float:
        """Forward and backward of all m micro-batches of the batch ``(x, y)`` in schedule order, then
        ``optimizer.step()`` when given. Every rank passes the same batch (stage 0 reads ``x``, the
        last stage ``y``). Returns the global-batch mean loss, on every rank.

        The same as ``begin(x, y, optimizer)``, ``run(self.actions)``, ``finish(optimizer)``: a caller
        that runs several pipelines on one rank (``chimera.py``) interleaves their ``run`` calls."""
        self.begin(x, y, optimizer)
        self.run(self.actions)
        return self.finish(optimizer)

    def begin(self, x: np.ndarray, y: np.ndarray, optimizer: Optimizer | None = None) -> None:
        """Check the batch, split it into the m micro-batches and clear the step's state and gradients."""
        m = self.microbatches
        n = len(x)
        if len(y) != n:
            raise ValueError(f"pipeline: x has {n} samples but y has {len(y)}; "
                             "pass matching inputs and targets")
        if n % m:
            lo, hi = (n // m) * m, (n // m + 1) * m
            sizes = f"{lo} or {hi}" if lo else f"{hi}"
            raise ValueError(f"pipeline: batch of {n} samples is not divisible by m={m} micro-batches; "
                             f"use a batch of {sizes}, or another m")
        if self.versions is not None and optimizer is not None:
            raise ValueError("pipeline: this schedule updates each stage in its U actions; call step(x, y)")
        xs, ys = np.split(np.asarray(x), m), np.split(np.asarray(y), m)
        if self.versions is not None:
            self.versions.begin_step()
        for p in self.parameters():
            p.grad = None
        self._xs, self._ys = xs, ys
        self._stash: dict[tuple[int, int], tuple[Any, Tensor]] = {}
        self._inbox: dict[tuple[str, int, int], np.ndarray] = {}   # (F|B, stage, mb) -> tensor for that stage
        self._outbox: dict[tuple[str, int, int], np.ndarray] = {}  # (F|B, stage, mb) -> tensor to send
        self._sends: list[Any] = []
        self._loss = 0.0
        self.microbatch_losses = [0.0] * m
        self.peak_stash = 0
        self._stash_bytes: dict[tuple[int, int], int] = {}
        self._later: dict[tuple[int, int], WeightGradients] = {}  # (stage, mb) -> its W, after its I
        trace.memory("activations", 0, args={"stashed": 0})

    def run(self, actions: Sequence[Action]) -> None:
        """Run actions of this rank's lowered program (between ``begin`` and ``finish``), in order."""
        for action in actions:
            getattr(self, "_" + action.op)(action)
            self._sends = [r for r in self._sends if not r.test()]  # progress; drops finished sends

    @property
    def stashed(self) -> int:
        """Micro-batches whose activations this rank holds now (a split backward's until its W)."""
        return len(self._stash) + len(self._later)

    def finish(self, optimizer: Optimizer | None = None) -> float:
        """Wait for the outstanding sends, broadcast the loss, run ``optimizer.step()`` when given."""
        for req in self._sends:
            req.wait()
        self._sends = []
        loss = self._broadcast_loss()
        if optimizer is not None:
            with trace.span("opt", args={"iteration": self.iteration}):
                optimizer.step()
        self.iteration += 1
        return loss

    def _broadcast_loss(self) -> float:
        root = self.owner[self.last_stage]
        mine = np.array([self._loss] + self.microbatch_losses) if self.comm.rank == root else None
        out = self.comm.broadcast(mine, root=root) if self.comm.size > 1 else mine
        self.microbatch_losses = [float(v) for v in out[1:]]
        return float(out[0])

    # ---- the actions -----------------------------------------------------------------------------
    def _where(self, a: Action) -> dict[str, Any]:
        return {"stage": a.stage, "microbatch": a.microbatch, "chunk": self.chunk_of[a.stage],
                "args": {"action": str(a), "iteration": self.iteration}}

    def _tag(self, direction: str, edge: int, mb: int) -> int:
        """Tag of the message across the boundary between stages ``edge`` and ``edge + 1``."""
        return 2 * (edge * self.microbatches + mb) + (direction == "B")

    def _sample(self) -> None:
        n = self.stashed  # a split backward's micro-batch is held until its W
        self.peak_stash = max(self.peak_stash, n)
        if trace.current() is not None:
            trace.memory("activations", sum(self._stash_bytes.values()), args={"stashed": n})

    def _F(self, a: Action) -> None:
        s, i = a.stage, a.microbatch
        with trace.span("F", **self._where(a)):
            if s == 0:
                inp: Any = self._xs[i]
            else:
                inp = from_wire(self._inbox.pop(("F", s, i)))
            with self._weights(a):
                out = self.stages[s](inp)
            if s == self.last_stage:
                loss = self.model.loss(out, self._ys[i])
                self.microbatch_losses[i] = loss.item()
                self._loss += loss.item() / self.microbatches
                v = self.versions  # asynchronous: 1 / micro-batches per update
                out = loss * (1.0 / self.microbatches if v is None else v.loss_scale(i))
            elif self.owner[s + 1] == self.comm.rank:
                self._inbox[("F", s + 1, i)] = to_wire(out)
            else:
                self._outbox[("F", s, i)] = to_wire(out)
            self._stash[(s, i)] = (inp, out)
            if trace.current() is not None:  # measuring walks the graph: only while a trace records
                held = activation_bytes(out) + (inp.data.nbytes if isinstance(inp, Tensor) else 0)
                self._stash_bytes[(s, i)] = held
        self._sample()

    def _B(self, a: Action) -> None:
        s, i = a.stage, a.microbatch
        with trace.span(a.op, **self._where(a)):
            inp, out = self._stash.pop((s, i))
            self._stash_bytes.pop((s, i), None)
            later = WeightGradients(self.stages[s].parameters()) if a.op == "I" else None
            with self._weights(a):
                out.backward(None if s == self.last_stage else self._inbox.pop(("B", s, i)), weights=later)
            if later is not None:  # kept until this micro-batch's W
                self._later[(s, i)] = later
                if trace.current() is not None:  # what W needs (the input too, where a weight op saved it)
                    self._stash_bytes[(s, i)] = later.nbytes()
            if s > 0:
                grad = to_wire(inp, inp.grad if inp.grad is not None else np.zeros_like(inp.data))
                inp.grad = None  # handed on: the input itself may stay alive until W (a layer norm saved it)
                if self.owner[s - 1] == self.comm.rank:
                    self._inbox[("B", s - 1, i)] = grad
                else:
                    self._outbox[("B", s, i)] = grad
        self._sample()

    _I = _B  # the backward without the weights' gradient (zero bubble's B): ``_B`` with a WeightGradients

    def _W(self, a: Action) -> None:
        """The weights' gradient of (stage, micro-batch), whose I ran earlier; frees what it kept."""
        with trace.span("W", **self._where(a)):
            with self._weights(a):
                self._later.pop((a.stage, a.microbatch)).run()
            self._stash_bytes.pop((a.stage, a.microbatch), None)
        self._sample()

    def _weights(self, a: Action) -> AbstractContextManager[None]:
        return nullcontext() if self.versions is None else self.versions.use(a)

    def _U(self, a: Action) -> None:
        """The stage's optimizer update inside the step (``asynchronous.WeightVersions.update``)."""
        with trace.span("U", **self._where(a)):
            self.versions.update(a)  # type: ignore[union-attr]

    def _labels(self, a: Action) -> dict[str, int]:
        """Trace labels of a SEND/RECV action's message on this rank (see the module docstring)."""
        return {"stage": a.stage, "microbatch": a.microbatch, "chunk": self.chunk_of[a.stage]}

    def _SEND_F(self, a: Action) -> None:
        data = self._outbox.pop(("F", a.stage, a.microbatch))
        tag = self._tag("F", a.stage, a.microbatch)
        self._sends.append(self.comm.isend(data, a.peer, tag, **self._labels(a)))

    def _SEND_B(self, a: Action) -> None:
        data = self._outbox.pop(("B", a.stage, a.microbatch))
        tag = self._tag("B", a.stage - 1, a.microbatch)
        self._sends.append(self.comm.isend(data, a.peer, tag, **self._labels(a)))

    def _RECV_F(self, a: Action) -> None:
        tag = self._tag("F", a.stage - 1, a.microbatch)
        self._inbox[("F", a.stage, a.microbatch)] = self.comm.recv(a.peer, tag, **self._labels(a))

    def _RECV_B(self, a: Action) -> None:
        tag = self._tag("B", a.stage, a.microbatch)
        self._inbox[("B", a.stage, a.microbatch)] = self.comm.recv(a.peer, tag, **self._labels(a))
