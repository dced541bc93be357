"""ZeRO-Offload (``minipar.parallel.offload``) on the budgeted device of ``minipar.tiers``.

- float64: moves between tiers are copies, so offload trains to exactly ``ZeroDataParallel`` stage 2's
  parameters (bit for bit, same buckets) and to one process's ``nn.GPT`` + ``AdamW`` on the global
  batch within ``test_zero``'s tolerances plus AdamW's drift (``tests/tolerances.py``).
- mixed precision: one rank equals a single-process float16 / float32-master reference written here,
  bit for bit (the same float16 sums in the same order); two ranks equal ``ZeroDataParallel`` in mixed
  precision bit for bit (the same reduce-scatter, the same unscale and AdamW, only the place differs).
- DPU: equal to a single-process delayed-update reference written here (the paper's rule, below).
- bytes between tiers per step (the "transfer" trace events) equal the sizes by hand and
  ``zero_offload_bytes``; the device's peak equals the need by hand and never exceeds the budget; a
  budget one byte short raises ``DeviceOutOfMemory`` on every rank, same message, nothing sent;
  mixed-precision model states over 7x the device budget train alike.

Sizes by hand (``zero_helpers.param_sizes``): GPT(vocab 5, seq 3, d 4, 2 heads, 2 layers) has
548 parameters (test_zero's "one model by hand"). With one bucket on N = 2: 548 / 2 = 274 elements per
rank, no padding; float64 items are 8 bytes, so 8 x 274 = 2192 bytes down (gradients) and 2192 up
(parameters) per step, ``8 Psi / N`` each way; float16 items are 2 bytes: 548 each way. The device
holds the parameters (548 items), one bucket of gradients (548) and one updated partition while it
goes up (274): 8 x 1370 = 10960 bytes in float64.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st
from strategies import budget, mpi_jobs, zero_configs
from tolerances import assert_close_after_adamw
from zero_helpers import GRAD_TOL, LR, PARAM_TOL, WEIGHT_DECAY, batch, build, config, padded, param_sizes, rows

from minipar import launch, nn, trace
from minipar.autograd import Tensor
from minipar.cost.offload import zero_offload_bytes
from minipar.optim import AdamW
from minipar.parallel.offload import ZeroOffload, offload_device_need
from minipar.parallel.zero import ZeroDataParallel
from minipar.testing import run_each
from minipar.tiers import DeviceOutOfMemory, Tiers

PSI = 548  # parameters of config(...) by hand, above
BIG_BUDGET = 1 << 30


def one_bucket(world: int, **kw) -> dict:
    return config("offload", world, cap=1 << 20, **kw)


def model_of(c: dict, precision: str) -> nn.GPT:
    if precision == "mixed":
        return nn.GPT(c["vocab"], c["seq"], c["d"], c["heads"], c["layers"], seed=c["seed"], dtype=np.float16)
    return build(c)


def offload_run(comm, c: dict, precision: str = "fp64", delayed: bool = False, warmup: int = 0,
                budget: int = BIG_BUDGET, poison_at: int | None = None) -> dict:
    """This rank's final parameters (after ``flush``), the transfers of each step by direction, the
    device's peak and its largest "device" memory sample. ``poison_at``: rank N-1's loss is infinite
    at that step (mixed precision: its float16 gradients overflow)."""
    model = model_of(c, precision)
    tiers = Tiers(budget)
    off = ZeroOffload(model, comm, tiers, lr=LR, weight_decay=WEIGHT_DECAY, precision=precision,
                      delayed_update=delayed, warmup_steps=warmup, bucket_cap_bytes=c["cap"])
    per_step, samples = [], []
    with trace.recording(comm.rank) as rec:
        for i in range(c["steps"]):
            start = len(rec.events)
            x, y = batch(c, i)
            off.backward(poisoned(comm, off.loss(x[rows(c, comm.rank)], y[rows(c, comm.rank)]), i, poison_at))
            off.step()
            per_step.append(transfers(rec.events[start:]))
        start = len(rec.events)
        off.flush()
        flushed = transfers(rec.events[start:])
        samples = [e.nbytes for e in rec.events if e.kind == "memory" and e.name == "device"]
        cpu = [e.nbytes for e in rec.events if e.kind == "memory" and e.name == "cpu"]
    final = model.state_dict()
    off.close()
    tiers.close()
    return {"final": final, "per_step": per_step, "flushed": flushed, "peak": tiers.peak_device_bytes,
            "max_sample": max(samples, default=0), "cpu": (max(cpu), cpu[-1]),
            "need": offload_device_need(model, comm.size, c["cap"]),
            "skipped": off.skipped, "loss_scale": off.loss_scale, "numels": [b.layout.numel for b in off.buckets]}


def poisoned(comm, loss: Tensor, step: int, poison_at: int | None) -> Tensor:
    return loss * np.float16(np.inf) if step == poison_at and comm.rank == comm.size - 1 else loss


def transfers(events: list) -> dict[str, int]:
    out = {"device->cpu": 0, "cpu->device": 0}
    for e in events:
        if e.kind == "transfer":
            out[f"{e.args['src']}->{e.args['dst']}"] += e.nbytes
    return out


def zero_run(comm, c: dict, precision: str = "fp64", poison_at: int | None = None) -> dict:
    """The same training with ``ZeroDataParallel`` stage 2, nothing offloaded."""
    model = model_of(c, precision)
    zero = ZeroDataParallel(model, comm, stage=2, lr=LR, weight_decay=WEIGHT_DECAY, precision=precision,
                            bucket_cap_bytes=c["cap"])
    for i in range(c["steps"]):
        x, y = batch(c, i)
        zero.backward(poisoned(comm, model.loss(x[rows(c, comm.rank)], y[rows(c, comm.rank)]), i, poison_at))
        zero.step()
    return {"final": model.state_dict(), "skipped": zero.optimizer.skipped, "loss_scale": zero.optimizer.loss_scale}


def reference(c: dict, delayed: bool = False, warmup: int = 0) -> dict:
    """One process, float64 AdamW on the global batch. ``delayed``: the DPU rule of Ren et al. 2021,
    Sec. 5.2, written out: steps 0 .. warmup-1 as usual; from step ``warmup`` on, the gradient of step
    t (computed on the current parameters) is applied one step later, so step t + 1 computes on the
    parameters from before it; ``flush`` (after the loop) applies the last one."""
    model = build(c)
    opt = AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    applied: dict[str, list[np.ndarray]] = {n: [] for n, _ in model.named_parameters()}
    pending = None
    for i in range(c["steps"]):
        x, y = batch(c, i)
        opt.zero_grad()
        model.loss(x, y).backward()
        grads = {n: p.grad.copy() for n, p in model.named_parameters()}
        if not delayed or i < warmup:
            apply(model, opt, grads, applied)
            continue
        if pending is not None:
            apply(model, opt, pending, applied)
        pending = grads
    if pending is not None:
        apply(model, opt, pending, applied)
    return {"final": model.state_dict(), "grads": applied}


def apply(model: nn.Module, opt: AdamW, grads: dict[str, np.ndarray], applied: dict[str, list[np.ndarray]]) -> None:
    """One AdamW step on ``grads``, noted in ``applied`` (each parameter's gradient at every step)."""
    for n, p in model.named_parameters():
        p.grad = grads[n]
        applied[n].append(grads[n])
    opt.step()


def assert_close_to(ref: dict, final: dict) -> None:
    """test_zero's tolerances plus AdamW's drift of the gradients of each step ``ref`` applied: the
    reduce-scatter is ZeroDataParallel's (test_zero asserts GRAD_TOL of its gradients)."""
    assert final.keys() == ref["final"].keys()
    for k, want in ref["final"].items():
        assert_close_after_adamw(final[k], want, ref["grads"][k], LR, GRAD_TOL, PARAM_TOL, err_msg=k)


def assert_equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


# ---- float64: the parameters of training without offload, bytes, peak (drawn) -------------------
@st.composite
def offload_configs(draw: st.DrawFn, world: int | None = None) -> dict:
    """``strategies.zero_configs`` (N 1-4 unless given, tiny GPTs, bucket caps, padding) run with
    ZeRO-Offload, with or without DPU (0-1 warm-up steps), on a device budget of the need plus 0-64
    bytes of slack."""
    c = {**draw(zero_configs(world)), "mode": "offload"}
    c["cap"] = draw(st.sampled_from([200, 700, 2000, 1 << 20]))
    return {**c, "delayed": draw(st.booleans()), "warmup": draw(st.integers(0, 1)), "slack": draw(st.integers(0, 64))}


@budget(12)
@given(c=offload_configs())
@example(c={**config("offload", 1, cap=1 << 20), "delayed": False, "warmup": 0, "slack": 0})
@example(c={**config("offload", 3, cap=200), "delayed": False, "warmup": 0, "slack": 0})
@example(c={**config("offload", 4, cap=700, d=3, heads=1), "delayed": True, "warmup": 1, "slack": 0})
def test_offload_property_threads(c: dict) -> None:
    """Plain: bit-equal to ``ZeroDataParallel``; DPU: the delayed reference. Every step moves this rank's
    padded partitions down and up (8-byte items: 8 sum L/N each way, and ``zero_offload_bytes``); the
    device holds the padded parameters, the largest bucket's gradients and, during the step, the
    largest partition on its way up: on a budget of exactly that (plus slack) the peak is exactly that."""
    numels = launch(refused, c["world"], c=c, budget=BIG_BUDGET)[0][3]
    check_property(c, numels, launch(offload_run, c["world"], **run_args(c, numels)))


def run_args(c: dict, numels: list[int]) -> dict:
    """``offload_run``'s arguments: the drawn DPU settings and a budget of the need by hand + slack."""
    return {"c": c, "delayed": c["delayed"], "warmup": c["warmup"],
            "budget": hand_need(c, numels)["total"] + c["slack"]}


def hand_need(c: dict, numels: list[int]) -> dict[str, int]:
    """Device bytes by hand (float64): padded parameters, the largest padded bucket, its partition."""
    pads = [padded(m, c["world"]) for m in numels]
    need = {"parameters": 8 * sum(pads), "gradient bucket": 8 * max(pads), "upload": 8 * max(pads) // c["world"]}
    return {**need, "total": sum(need.values())}


def check_property(c: dict, numels: list[int], got: list[dict]) -> None:
    n, need = c["world"], hand_need(c, numels)
    assert sum(numels) == sum(param_sizes(c).values())  # every parameter in one bucket
    ref = reference(c, delayed=c["delayed"], warmup=c["warmup"])
    zero = None if c["delayed"] else launch(zero_run, n, c=c)
    moved = {"device->cpu": 8 * sum(padded(m, n) for m in numels) // n}
    moved["cpu->device"] = moved["device->cpu"]
    assert moved == zero_offload_bytes(numels, 8, 8, dp=n)
    for r, g in enumerate(got):
        assert g["numels"] == numels and g["need"] == need
        assert_close_to(ref, g["final"])  # one process (DPU: delayed), test_zero's tolerances
        if zero:
            assert_equal(g["final"], zero[r]["final"])  # moves are copies: bit for bit
        assert all(s["device->cpu"] == moved["device->cpu"] for s in g["per_step"])
        ups = [s["cpu->device"] for s in g["per_step"]] + [g["flushed"]["cpu->device"]]
        assert sum(ups) == c["steps"] * moved["cpu->device"] and set(ups) <= {0, moved["cpu->device"]}
        assert g["peak"] == g["max_sample"] == need["total"]


# ---- bytes between tiers per step, and the device's peak ----------------------------------------
def test_bytes_per_step_and_peak_by_hand() -> None:
    assert sum(param_sizes(one_bucket(2)).values()) == PSI
    for got in launch(offload_run, 2, c=one_bucket(2)):
        # float64, 8-byte items: this rank's 274 gradients down and 274 parameters up, 8 Psi / N each way
        assert got["per_step"] == [{"device->cpu": 8 * 274, "cpu->device": 8 * 274}] * 3
        assert got["per_step"][0] == zero_offload_bytes(PSI, param_bytes=8, grad_bytes=8, dp=2)
        assert got["flushed"] == {"device->cpu": 0, "cpu->device": 0}
        assert got["need"]["total"] == 8 * (548 + 548 + 274) == 10960
        assert got["peak"] == got["max_sample"] == 10960
        # cpu: 274 gradients (8 B), master (8 B) and AdamW's m, v (16 B) after backward; no gradients after
        assert got["cpu"] == (32 * 274, 24 * 274)
    for got in launch(offload_run, 2, c=one_bucket(2), precision="mixed"):  # float16: 2-byte items
        assert got["per_step"] == [{"device->cpu": 2 * 274, "cpu->device": 2 * 274}] * 3
        assert got["per_step"][0] == zero_offload_bytes(PSI, dp=2)  # the paper's 2 Psi / N each way
        assert got["peak"] == 2 * 1370
        assert got["cpu"] == ((2 + 4 + 8) * 274, (4 + 8) * 274)  # float16 gradients, float32 master, m, v


def refused(comm, c: dict, budget: int) -> tuple[str, int, int, list[int]]:
    """The message (or "accepted"), the messages sent, the bytes placed on the device, the buckets' sizes."""
    tiers, off = Tiers(budget), None
    with trace.recording(comm.rank) as rec:
        try:
            off = ZeroOffload(build(c), comm, tiers, bucket_cap_bytes=c["cap"])
            msg = "accepted"
        except DeviceOutOfMemory as exc:
            msg = str(exc)
    return msg, sum(e.kind == "comm" for e in rec.events), tiers.device_bytes, [
        b.layout.numel for b in off.buckets] if off else []


def test_too_small_budget_refused_on_every_rank() -> None:
    c = one_bucket(2)
    results = launch(refused, 2, c=c, budget=10959)
    assert results[0] == results[1]
    msg, sent, placed, _ = results[0]
    assert sent == placed == 0  # nothing sent, nothing placed
    assert "budget 10959 bytes" in msg and "nothing resident" in msg
    assert "parameters 4384, gradient bucket 4384, upload 2192" in msg
    assert "the smallest budget that would have worked is 10960 bytes" in msg
    # enough: the parameters and the gradient bucket placed (the upload's room stays free until a step)
    assert launch(refused, 2, c=c, budget=10960)[0] == ("accepted", 0, 8 * (548 + 548), [548])


# ---- mixed precision -----------------------------------------------------------------------------
def mixed_reference(c: dict, delayed: bool = False, warmup: int = 0, scale: float = 2.0**12) -> dict:
    """One process: float16 model, loss x S backward, float32 unscale, AdamW on a float32 master,
    float16 copy back (no overflow in these steps); ``delayed`` as in ``reference``."""
    model = model_of(c, "mixed")
    params = model.parameters()
    master = [Tensor(p.data.astype(np.float32)) for p in params]
    opt = AdamW(master, lr=LR, weight_decay=WEIGHT_DECAY)

    def apply(grads: list[np.ndarray]) -> None:
        for m, g in zip(master, grads, strict=True):
            m.grad = g
        opt.step()
        for m, p in zip(master, params, strict=True):
            p.data[...] = m.data

    pending = None
    for i in range(c["steps"]):
        x, y = batch(c, i)
        (model.loss(x, y) * scale).backward()
        grads = [p.grad.astype(np.float32) / np.float32(scale) for p in params]
        for p in params:
            p.grad = None
        if not delayed or i < warmup:
            apply(grads)
            continue
        if pending is not None:
            apply(pending)
        pending = grads
    if pending is not None:
        apply(pending)
    return model.state_dict()


def test_mixed_equals_same_precision_references() -> None:
    c1 = one_bucket(1)
    got = launch(offload_run, 1, c=c1, precision="mixed")[0]
    assert got["skipped"] == 0
    assert_equal(got["final"], mixed_reference(c1))
    for warmup in (0, 1):  # DPU in mixed precision: the delayed float16 / float32 reference, bit for bit
        c4 = one_bucket(1, steps=4)
        dpu = launch(offload_run, 1, c=c4, precision="mixed", delayed=True, warmup=warmup)[0]
        assert_equal(dpu["final"], mixed_reference(c4, delayed=True, warmup=warmup))
    c2 = config("offload", 2, cap=200)
    got2 = launch(offload_run, 2, c=c2, precision="mixed")
    want2 = launch(zero_run, 2, c=c2, precision="mixed")
    for g, w in zip(got2, want2, strict=True):
        assert g["final"]["head.weight"].dtype == np.float16
        assert_equal(g["final"], w["final"])


def test_model_states_seven_times_the_device_budget_train_alike() -> None:
    """Mixed precision, one rank, 6 layers, buckets of at most 64 float16 elements (cap 128 B, the
    4 x 16 feed-forward weights alone): the model states are 16 Psi bytes (2 + 2 + K = 12, ZeRO Sec.
    3.1) while the device holds the float16 parameters, the largest bucket's gradients and its update,
    2 (Psi + 64 + 64) bytes: over 7x less. (ZeRO-Offload cannot reach 8x: its device keeps 2 of the 16.)"""
    c = config("offload", 1, cap=128, layers=6, steps=2)
    psi = sum(param_sizes(c).values())
    assert psi == 20 + 12 + 6 * 244 + 8 + 20 == 1524
    device = 2 * (psi + 64 + 64)
    assert 16 * psi / device > 7
    got = launch(offload_run, 1, c=c, precision="mixed", budget=device)[0]
    assert got["peak"] == device
    assert_equal(got["final"], mixed_reference(c))


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")
def test_mixed_overflow_on_one_rank_skips_the_step_everywhere() -> None:
    c = config("offload", 2, cap=200)
    got, want = launch(offload_run, 2, c=c, precision="mixed", poison_at=1), launch(
        zero_run, 2, c=c, precision="mixed", poison_at=1)
    for g, w in zip(got, want, strict=True):
        assert (g["skipped"], g["loss_scale"]) == (w["skipped"], w["loss_scale"]) == (1, 2.0**11)
        assert_equal(g["final"], w["final"])
        assert g["per_step"][1]["cpu->device"] == 0  # the skipped step copies nothing up


# ---- DPU -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("world,warmup", [(1, 0), (2, 1), (3, 0)])
def test_delayed_update_equals_delayed_reference(world: int, warmup: int) -> None:
    c = config("offload", world, cap=300, steps=4)
    ref = reference(c, delayed=True, warmup=warmup)
    plain = reference(c)
    got = launch(offload_run, world, c=c, delayed=True, warmup=warmup)
    for r in got:
        assert_close_to(ref, r["final"])
        # step ``warmup`` uploads nothing (its update is still running); flush uploads the last one
        ups = [s["cpu->device"] for s in r["per_step"]]
        assert ups[warmup] == 0 and ups[:warmup] + ups[warmup + 1:] == [r["per_step"][0]["device->cpu"]] * 3
        assert r["flushed"]["cpu->device"] == r["per_step"][0]["device->cpu"]
    assert any(not np.allclose(ref["final"][k], plain["final"][k]) for k in ref["final"])  # it is delayed


def test_delayed_update_overlaps_the_next_iteration() -> None:
    """The CPU AdamW of step 0 cannot finish until step 1's forward has run (it waits for it): with DPU
    ``step()`` returns at once and the next forward runs beside it, on the parameters from before it."""
    c = config("offload", 1, steps=2)

    def overlapped(comm) -> list:
        model = build(c)
        initial = model.state_dict()
        off = ZeroOffload(model, comm, Tiers(BIG_BUDGET), delayed_update=True)
        forward_ran, step = threading.Event(), off.adam.step

        def slow() -> None:
            if not forward_ran.wait(20):
                raise TimeoutError("the CPU step waited for a forward that never came")
            step()

        off.adam.step = slow
        seen = []
        for i in range(2):
            loss = off.loss(*batch(c, i))
            seen.append(model.state_dict())
            if i == 1:
                forward_ran.set()
            off.backward(loss)
            off.step()
        off.close()
        return [initial, *seen]

    initial, first, second = launch(overlapped, 1, timeout=30)[0]
    assert_equal(first, initial) and assert_equal(second, initial)  # step 1 computed on w_0: delayed


# ---- mpiexec -------------------------------------------------------------------------------------
@pytest.mark.mpi
@budget(2)
@given(job=mpi_jobs(offload_configs, min_size=1, max_size=2))
@example(job=(2, [{**config("offload", 2, cap=300), "delayed": True, "warmup": 1, "slack": 0},
                  {**config("offload", 2, cap=1 << 20), "delayed": False, "warmup": 0, "slack": 0}]))
def test_offload_property_mpiexec(job: tuple[int, list[dict]]) -> None:
    """The threads property under ``mpiexec``: one job per drawn N runs the drawn configurations
    (each rank's bucket sizes taken on threads first, for the budget)."""
    n, cs = job
    numels = [launch(refused, n, c=c, budget=BIG_BUDGET)[0][3] for c in cs]
    args = [run_args(c, m) for c, m in zip(cs, numels, strict=True)]
    for c, m, results in zip(cs, numels, run_each(offload_run, n, args, timeout=90, comm_timeout=30), strict=True):
        check_property(c, m, results)
