"""Device residency checked where compute happens (``minipar.residency``).

- ``module.loss`` called directly on a ZeRO-Offload model, around the wrapper: a parameter whose data is
  not on the device raises ``NotOnDevice`` in one line naming the parameter and the tier it is on. The
  parameter is swapped for an empty host array, on which the op itself would fail (an ``IndexError``
  from the embedding's gather, a ``ValueError`` from the head's matmul): the residency error instead
  shows the check ran before the op computed. Backward checks too (a parameter swapped after forward).
- ZeRO-Infinity and the chunks register theirs too: ``module.loss`` goes through their units (it
  computes), an op on a parameter outside its unit names "nvme" (Infinity: the values are in files) or
  "cpu" (the chunk the step left on the CPU).
- ``close()`` unregisters: the registry is empty again and the model computes on host memory.
- Nothing guarded: a training step (one process, and data parallel on two thread ranks) never calls
  the check (made to raise here): an op pays one None test.
"""

from __future__ import annotations

import numpy as np
import pytest
from zero_helpers import batch, build, config

from minipar import datasets, launch, residency
from minipar import functional as F
from minipar.autograd import Tensor
from minipar.nn import MLP
from minipar.optim import SGD, AdamW
from minipar.parallel.ddp import DistributedDataParallel, train_step
from minipar.parallel.offload import ChunkManager, ZeroInfinity, ZeroOffload
from minipar.tiers import NotOnDevice, Tiers

C = config("offload", 1)


def swapped(comm, name: str, after_forward: bool) -> str:
    """The error of ``model.loss`` (or of backward, ``after_forward``) with ``name``'s data an empty host array."""
    model = build(C)
    off = ZeroOffload(model, comm, Tiers(1 << 20))
    param = dict(model.named_parameters())[name]
    try:
        loss = model.loss(*batch(C, 0))  # resident: computes
        if not after_forward:
            param.data = np.empty(0)
            loss = model.loss(*batch(C, 0))
        param.data = np.empty(0)
        loss.backward()
    except NotOnDevice as exc:
        return str(exc)
    finally:
        off.close()
    return "computed"


@pytest.mark.parametrize("name", ["tok_emb.weight", "blocks.0.attn.q.weight", "head.weight"])
def test_module_loss_directly_checks_each_parameter_before_its_op(name: str) -> None:
    msg = launch(swapped, 1, name=name, after_forward=False)[0]
    assert msg == (f"parameter {name!r} (float64[0]) is on the cpu, not resident on the device: "
                   "compute reads parameters only on the device")


def test_backward_checks_the_parameters_it_reads() -> None:
    msg = launch(swapped, 1, name="blocks.1.mlp.fc.weight", after_forward=True)[0]
    assert msg.startswith("parameter 'blocks.1.mlp.fc.weight' (float64[0]) is on the cpu") and "\n" not in msg


def test_infinity_and_chunks_check_a_parameter_used_outside_its_unit(tmp_path) -> None:
    x = Tensor(np.ones((1, 4)))

    def infinity(comm) -> tuple[float, str]:
        model = build(C)
        inf = ZeroInfinity(model, comm, Tiers(1 << 20, str(tmp_path / "nvme")))
        loss = float(model.loss(*batch(C, 0)).item())  # through its units: gathered, computed
        try:
            F.linear(x, model.head.weight)
            msg = "computed"
        except NotOnDevice as exc:
            msg = str(exc)
        inf.close()
        return loss, msg

    loss, msg = launch(infinity, 1)[0]
    assert np.isfinite(loss) and msg.startswith("parameter 'head.weight' (float64[0]) is on the nvme, not resident")
    c = config("chunks", 1, steps=1)
    model = build(c)
    cm = ChunkManager(model, Tiers(1 << 20), 64)
    cm.backward(cm.loss(*batch(c, 0)))
    cm.step()  # every chunk to the CPU
    with pytest.raises(NotOnDevice, match=r"^parameter 'head.weight' \(float64\[4, 5\]\) is on the cpu, not"):
        F.linear(x, model.head.weight)
    cm.close()


def test_close_unregisters_and_the_model_computes_on_host_memory() -> None:
    def run(comm) -> tuple[bool, bool, float]:
        model = build(C)
        off = ZeroOffload(model, comm, Tiers(1 << 20))
        guarded = residency.guards is not None and id(model.head.weight) in residency.guards
        off.close()
        still = residency.guards is not None and id(model.head.weight) in residency.guards
        model.head.weight.data = model.head.weight.data.copy()  # host memory: fine once unwrapped
        return guarded, still, float(model.loss(*batch(C, 0)).item())

    guarded, still, loss = launch(run, 1)[0]
    assert (guarded, still) == (True, False) and np.isfinite(loss)


def test_nothing_guarded_never_calls_the_check(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(tensors: object) -> None:
        raise AssertionError("residency.check called while nothing is guarded")

    monkeypatch.setattr(residency, "guards", None)
    monkeypatch.setattr(residency, "check", refuse)
    model = build(C)
    opt = AdamW(model.parameters(), lr=1e-3)
    before = model.head.weight.data.copy()
    model.loss(*batch(C, 0)).backward()
    opt.step()
    assert not np.array_equal(model.head.weight.data, before)  # it trained

    def step(comm) -> float:
        ddp = DistributedDataParallel(MLP([8, 16, 4], seed=0), comm, bucket_cap_bytes=1)
        x, y = datasets.regression(8, 8, 4, seed=0)
        return train_step(ddp, SGD(ddp.parameters(), lr=0.1), lambda m, a, b: F.mse_loss(m(a), b), x, y)

    losses = launch(step, 2, "threads")
    assert len(losses) == 2 and np.isfinite(losses).all()  # each rank's loss on its shard
