"""ZeRO stages 2 and 3 under pipelining: the data-parallel axis of ``HybridGPT`` sharding gradients
(stage 2) and parameters (stage 3, FSDP) of the stages a rank runs (Rajbhandari et al. 2020, Sec. 5;
Zhao et al. 2023, "PyTorch FSDP", Sec. 3.2-3.3).

A pipeline runs m micro-batches' forwards and backwards before one optimizer step. DeepSpeed's
pipeline engine refuses ZeRO-2 and ZeRO-3 because they would reduce (and gather) once per
micro-batch; Megatron-LM's distributed optimizer and torchtitan's pipeline x FSDP instead accumulate
every micro-batch's gradients unsharded and reduce-scatter them once, after the step's last backward
(torchtitan: ``set_requires_gradient_sync(last micro-batch)``). Here, on the ``dp x sp`` replicas:

    stage 2   full gradients accumulate over the m micro-batches (as DDP's); after the last backward
              (or W) one reduce-scatter per bucket, the full gradients dropped: the optimizer step and
              what a rank holds between steps are ZeRO-2's (sharded gradients); AdamW on the shard,
              all-gather of the updated parameters. Bytes: ZeRO-1's, the all-reduce's volume.
    stage 3   each virtual stage of the rank is one FSDP unit (``zero.fsdp.Unit``): only its shard is
              held, from the start (``HybridGPT`` builds the stages under ``nn.deferred()``, and each
              unit draws its shard's initial values alone, ``flat.init_shard``).
              ``reshard_after_forward=True``: every F, B, I and W action all-gathers its stage and
              frees it afterwards (2m gathers per stage, plus one per split backward's W);
              ``False``: the first action of the step gathers the stage, which stays gathered until
              the gradients are reduce-scattered (1 gather; torchtitan's choice for pipelines).

Gradients stay full-size between micro-batches in both (the price of one reduce-scatter per step
rather than m). ``minipar.cost.hybrid`` gives the bytes each rank sends (``traffic_by_axis``), holds
(``model_state_bytes``) and gathers at most (``gathered_peak_bytes``); ``docs/formulas.md``
section 8 derives them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager

import numpy as np

from minipar import trace
from minipar.comm import Communicator
from minipar.nn import Module
from minipar.parallel.pipeline import Pipeline
from minipar.parallel.pipeline.schedule import Action
from minipar.parallel.zero import Unit, ZeroDataParallel
from minipar.parallel.zero.precision import ShardedAdamW

PIPELINE_ZERO_STAGES = (2, 3)


class GatheringPipeline(Pipeline):
    """A ``Pipeline`` whose compute actions (F, B, I, W) run inside ``gather(stage)``: ZeRO-3's window
    in which the stage's parameters are whole."""

    gather: Callable[[int], AbstractContextManager[None]] | None = None

    def _weights(self, a: Action) -> AbstractContextManager[None]:
        return super()._weights(a) if self.gather is None else self.gather(a.stage)


class PipelineZero:
    """ZeRO ``stage`` (2 or 3) of ``pipe``'s parameters over ``replicas`` with AdamW (float64).
    ``reduce()`` after the pipeline's step, then ``step()``."""

    def __init__(self, pipe: Pipeline, module: Module, replicas: Communicator, stage: int,
                 reshard_after_forward: bool, lr: float, betas: tuple[float, float], eps: float,
                 weight_decay: float) -> None:
        self.pipe, self.replicas, self.stage = pipe, replicas, stage
        self.reshard_after_forward = reshard_after_forward
        self.inner: ZeroDataParallel | None = None
        self.units: dict[int, Unit] = {}
        if stage == 2:  # ZeroDataParallel's buckets with no per-gradient hooks: reduced in reduce()
            self.inner = ZeroDataParallel(module, replicas, stage=1, lr=lr, betas=betas, eps=eps,
                                          weight_decay=weight_decay)
            self.optimizer = self.inner.optimizer
            return
        self.units = {s: Unit(i, f"stage{s}", list(st.named_parameters()), replicas, st.seed)
                      for i, (s, st) in enumerate(sorted(pipe.stages.items()))}
        self.optimizer = ShardedAdamW([u.shard for u in self.units.values()], replicas, "fp64", lr, betas, eps,
                                      weight_decay)
        if not isinstance(pipe, GatheringPipeline):
            raise TypeError("PipelineZero: ZeRO-3 gathers around the actions of a GatheringPipeline")
        pipe.gather = self.gathered_stage
        self._sample()

    @contextmanager
    def gathered_stage(self, stage: int) -> Iterator[None]:
        """Stage ``stage``'s parameters whole while an action computes; freed after it unless
        ``reshard_after_forward`` is off (then at ``reduce``)."""
        unit = self.units[stage]
        gathered = unit.full is not None
        unit.unshard()
        if not gathered:
            self._sample()
        yield
        if self.reshard_after_forward:
            unit.reshard()
            self._sample()

    @contextmanager
    def shapes_only(self) -> Iterator[None]:
        """Every resharded parameter a zero-stride array of its shape (no bytes): for code after the
        pipeline that reads only shapes, e.g. Megatron-SP's gradient all-reduce."""
        for unit in self.units.values():
            for p, shape in zip(unit.params, unit.layout.shapes, strict=True):
                p.data = np.broadcast_to(np.zeros((), dtype=unit.shard.dtype), shape)
        try:
            yield
        finally:
            for unit in self.units.values():
                unit.reshard()

    @contextmanager
    def whole(self) -> Iterator[None]:
        """Every unit gathered (for ``full_state_dict``: control plane, after a step)."""
        for unit in self.units.values():
            unit.unshard()
        try:
            yield
        finally:
            for unit in self.units.values():
                unit.reshard()

    def reduce(self) -> None:
        """After the last micro-batch's backward: one reduce-scatter per bucket (2) or unit (3) of
        the accumulated gradients; ZeRO-3's kept units freed."""
        for group in (self.inner.buckets if self.inner is not None else self.units.values()):
            if isinstance(group, Unit):
                group.reduce_scatter()
                group.reshard()
            else:
                group.reduce_scatter(self.replicas)
        self._sample()

    def step(self) -> None:
        """AdamW on this rank's shards; stage 2 all-gathers the updated parameters (stage 3 gathers
        them when the next step's actions need them)."""
        with trace.span("opt", args={"iteration": self.pipe.iteration - 1}):
            self.optimizer.step()
            if self.inner is not None:
                for b in self.inner.buckets:
                    b.all_gather(self.replicas)
        self._sample()

    def gathered_bytes(self) -> int:
        """Bytes of ZeRO-3 parameters gathered beside the shards now."""
        return sum(u.gathered_bytes for u in self.units.values())

    def state_bytes(self) -> dict[str, int]:
        """Parameters (stage 2: the padded buckets; 3: the shards), gradients (full ones alive plus
        the shards), optimizer state."""
        if self.inner is not None:
            return self.inner.state_bytes()
        units = self.units.values()
        full = sum(p.grad.nbytes for u in units for p in u.params if p.grad is not None)
        return {"parameters": sum(u.shard.data.nbytes for u in units),
                "gradients": full + sum(u.shard.grad.nbytes for u in units if u.shard.grad is not None),
                **self.optimizer.state_bytes()}

    def _sample(self) -> None:
        if trace.current() is not None:
            for label, nbytes in self.state_bytes().items():
                trace.memory(label, nbytes)
            if self.units:
                trace.memory("gathered parameters", self.gathered_bytes())
