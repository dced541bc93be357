"""minipar.cost.overhead's counts are those of the program perf is held against: the autograd ops,
parameter tensors and collective calls and message steps inside HybridGPT's stages (its F and B
spans), counted on the running program (its graph, its parameters, its trace), for a tensor- and a
sequence-parallel mesh."""

from __future__ import annotations

import collections
import threading
from typing import Any

import numpy as np
import pytest

from minipar import autograd, launch
from minipar import trace as mtrace
from minipar.cost.layout import Layout
from minipar.cost.overhead import parameter_tensors, stage_collectives, stage_ops
from minipar.mesh import DeviceMesh
from minipar.parallel.hybrid import HybridGPT

LAYERS, M = 4, 2


def _step(comm: Any, mesh: dict[str, int], made: collections.Counter) -> dict[str, Any]:
    model = HybridGPT(DeviceMesh(comm, **mesh), 16, 8, 16, 4, LAYERS, 32, microbatches=M, seed=0)
    idx = np.random.default_rng(0).integers(0, 16, (4, 8))
    made.pop(threading.get_ident(), None)
    with mtrace.recording(comm.rank) as rec:
        model.forward_backward(idx, np.roll(idx, -1, axis=1))
    spans = [(e.t0, e.t1) for e in rec.events if e.kind == "compute" and e.name in ("F", "B")]
    sends = [e for e in rec.events if e.kind == "comm" and e.src == comm.rank and e.op in ("allreduce", "all_to_all")
             and any(a <= e.t0 <= b for a, b in spans)]  # inside the stages' work, not the gradient sync
    return {"ops": made[threading.get_ident()], "tensors": len(model.pipe.parameters()),
            "calls": sum(e.step == 0 for e in sends), "steps": len(sends)}


@pytest.mark.parametrize("mesh", [{"pp": 2, "dp": 1, "sp": 1, "tp": 2}, {"pp": 2, "dp": 1, "sp": 2, "tp": 1}],
                         ids=["tensor", "sequence"])
def test_counts_are_the_programs(mesh: dict[str, int], monkeypatch: pytest.MonkeyPatch) -> None:
    made: collections.Counter = collections.Counter()
    make = autograd.Tensor._make

    def counting(data: np.ndarray, parents: tuple, backward: Any) -> autograd.Tensor:
        made[threading.get_ident()] += 1
        return make(data, parents, backward)

    monkeypatch.setattr(autograd.Tensor, "_make", staticmethod(counting))
    got = launch(lambda comm: _step(comm, mesh, made), 4)
    layout = Layout(pp=2, tp=mesh["tp"], sp=mesh["sp"], global_batch=M)
    blocks = [LAYERS // 2, LAYERS // 2]
    ops, collectives = stage_ops(blocks, mesh["sp"] > 1), stage_collectives(blocks, layout)
    for rank, g in enumerate(got):
        stage = rank // (mesh["sp"] * mesh["tp"])
        assert g["ops"] == M * ops[stage], (rank, g)
        assert g["tensors"] == parameter_tensors(blocks[stage], stage == 0, stage == 1), (rank, g)
        assert (g["calls"], g["steps"]) == (M * collectives[stage][0], M * collectives[stage][1]), (rank, g)
