"""The lesson's measurement of a transformer block, wrapped around it once (``Measured``): the
activation bytes its autograd graph keeps for backward and its largest buffer
(``memory.held_buffers``), and optionally one ``F`` and one ``B`` span per call with memory samples,
so the block's own code stays the paper's two lines. Lesson 5 wraps every block of each
sequence-parallel GPT (and of Megatron-SP's, whose blocks record their own spans) to compare them
with ``minipar.cost.sequence``."""

from __future__ import annotations

from typing import Any

from minipar import trace as mtrace
from minipar.autograd import Tensor
from minipar.functional import on_backward
from minipar.memory import held_buffers, seq_mark
from minipar.nn import Module


class Measured(Module):
    """One transformer block, unchanged, with a measurement around it: the activation
    bytes its autograd graph keeps (``memory.held_buffers``: every buffer made inside the block that
    backward needs, views free) and the largest such buffer; with ``spans``, one ``F`` and one ``B``
    span per call and a memory sample of the blocks' bytes held (``meter``, shared by the model's
    blocks) when the block's forward ends and when its backward ends (Megatron-SP's blocks record
    their own spans and samples)."""

    def __init__(self, block: Module, layer: int, spans: bool, meter: dict[str, int]) -> None:
        self.block, self.layer, self.spans, self.meter = block, layer, spans, meter
        self.held, self.largest = 0, 0

    def grad_sync_params(self) -> list[Any]:  # Megatron-SP's replicated layer norms and biases
        return self.block.grad_sync_params()

    def sample(self, change: int) -> None:
        self.meter["held"] += change
        mtrace.memory("activations/blocks", self.meter["held"])

    def forward(self, x: Tensor) -> Tensor:
        if mtrace.current() is None:
            return self.block(x)
        start, began = seq_mark(), [0.0, 0.0]
        if self.spans:
            def done() -> None:
                mtrace.current().add("compute", "B", began[0], mtrace.now(), c0=began[1], c1=mtrace.cpu(),
                                     args={"layer": self.layer})
                self.sample(-self.held)

            def starts() -> None:
                began[:] = mtrace.now(), mtrace.cpu()

            with mtrace.span("F", args={"layer": self.layer}):
                out = on_backward.apply(self.block(on_backward.apply(x, done)), starts)
        else:
            out = self.block(x)
        buffers = [n for _, n in held_buffers(out, start).values()]
        self.held, self.largest = sum(buffers), max(buffers)
        if self.spans:
            self.sample(self.held)
        return out


def measure_blocks(model: Module, spans: bool = True) -> list[Measured]:
    """Wrap every block of ``model.blocks`` in ``Measured`` (one meter shared by them; ``spans``: the
    wrappers record the F/B spans and samples, off for blocks that record their own); the wrappers."""
    blocks, meter = model.blocks._modules, {"held": 0}
    for i, block in enumerate(blocks):
        blocks[i] = Measured(block, i, spans, meter)
    return list(blocks)
