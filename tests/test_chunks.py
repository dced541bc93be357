"""PatrickStar's chunk manager (``minipar.parallel.offload.chunks``) on the budgeted device of ``minipar.tiers``.

- float64: moves are copies, so training through chunks gives exactly (bit for bit) the parameters of
  ``nn.GPT`` + ``AdamW`` trained plainly, for drawn models, chunk sizes, budgets and both policies.
- the device's peak (``Tiers.peak_device_bytes`` and every "device" memory sample) stays within the budget.
- bytes moved per step, from the "transfer" events: ``2 x chunk bytes x misses``. For ``nn.GPT`` (modules
  used in registration order, backward in reverse) with ``C`` chunks of which ``k`` fit beside the
  activations ``A`` at the start of backward, ``misses = C + max(0, C - k)``: every chunk comes up once
  in forward; backward finds the last ``k`` still there and fetches the other ``C - k`` again. Here ``C``
  comes from packing the parameter sizes written out by hand (``zero_helpers.param_sizes``) and ``A`` from
  ``minipar.memory`` on a plain model's graph.
- a model that reuses its first layer at the end (``Loop``): LRU misses 5 chunks per step, the warm-up's
  order (Belady) 4, counted by hand below.
- a budget below one chunk is refused at construction; below one chunk + the activations the warm-up
  iteration raises ``DeviceOutOfMemory`` before any step.
- N data-parallel ranks (threads, N in 1, 2, 4; and under ``mpiexec``), each on its 1/N of the batch:
  the owned parameters, gathered from every rank, equal one process's ``nn.GPT`` + ``AdamW`` on the
  global batch within test_zero's tolerances and AdamW's drift (``tolerances``; bit for bit at N = 1);
  per rank per step the transfers are ``CB x misses`` each way and the ring sends
  ``(N - 1) CB (misses + G)``, with ``G = ceil(C / N)`` groups and ``misses = G + max(0, G - k)``, ``k``
  the groups of ``N`` chunks fitting beside the local batch's activations, all by hand here
  (``chunk_dp_bytes`` must agree).
- mixed precision: ``test_chunks_mixed.py``.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st
from strategies import budget
from tolerances import assert_close_after_adamw
from zero_helpers import GRAD_TOL, LR, PARAM_TOL, WEIGHT_DECAY, batch, build, config, param_sizes, rows

from minipar import functional as F
from minipar import launch, memory, nn, trace
from minipar.autograd import Function, Tensor
from minipar.cost.offload import chunk_dp_bytes, chunk_offload_bytes, in_order_misses
from minipar.optim import AdamW
from minipar.parallel.offload import ChunkManager
from minipar.parallel.offload.chunks import State
from minipar.testing import run_each
from minipar.tiers import DeviceOutOfMemory, NotOnDevice, Tiers


def reference(c: dict) -> tuple[dict[str, np.ndarray], int]:
    """``nn.GPT`` + ``AdamW`` after ``c["steps"]`` steps, and the activation bytes of one step's graph."""
    model = build(c)
    opt = AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    acts = 0
    for i in range(c["steps"]):
        since = memory.seq_mark()
        loss = model.loss(*batch(c, i))
        acts = memory.activation_bytes(loss, since)
        loss.backward()
        opt.step()
        opt.zero_grad()
    return model.state_dict(), acts


def chunks_by_hand(sizes: list[int], chunk_size: int) -> int:
    """Chunks of ``chunk_size`` filled in order, a tensor that does not fit opening the next."""
    count, used = 0, chunk_size
    for n in sizes:
        if used + n > chunk_size:
            count, used = count + 1, 0
        used += n
    return count


def run(model: nn.Module, tiers: Tiers, chunk_size: int, policy: str, batches: list,
        **kw) -> tuple[ChunkManager, list]:
    """Train through a ``ChunkManager``; per step the transfer bytes (up, down), the largest "device"
    sample and the last "cpu" sample."""
    cm = ChunkManager(model, tiers, chunk_size, policy=policy, lr=LR, weight_decay=WEIGHT_DECAY, **kw)
    per_step = []
    with trace.recording(0) as rec:
        for args in batches:
            start = len(rec.events)
            cm.backward(cm.loss(*args))
            cm.step()
            moves = [e for e in rec.events[start:] if e.kind == "transfer"]
            per_step.append((sum(e.nbytes for e in moves if e.args["dst"] == "device"),
                             sum(e.nbytes for e in moves if e.args["dst"] == "cpu"),
                             max(e.nbytes for e in rec.events[start:] if e.kind == "memory" and e.name == "device"),
                             [e.nbytes for e in rec.events[start:] if e.kind == "memory" and e.name == "cpu"][-1]))
    return cm, per_step


@st.composite
def chunk_configs(draw: st.DrawFn) -> dict:
    heads = draw(st.integers(1, 2))
    c = config("chunks", 1, d=heads * draw(st.integers(2 if heads == 1 else 1, 3)), heads=heads,
               layers=draw(st.integers(1, 2)), steps=draw(st.integers(2, 3)), seed=draw(st.integers(0, 2**16)))
    c.update(vocab=draw(st.integers(2, 6)), seq=draw(st.integers(1, 3)), batch=draw(st.integers(1, 2)))
    largest = max(param_sizes(c).values())
    c.update(chunk_size=largest + draw(st.integers(0, 2 * largest)), fit=draw(st.integers(2, 40)),
             slack=draw(st.floats(0, 0.99)), policy=draw(st.sampled_from(["lru", "warmup"])))
    return c


@budget(12)
@given(chunk_configs())
@example({**config("chunks", 1, steps=3), "chunk_size": 64, "fit": 2, "slack": 0.5, "policy": "warmup"})
@example({**config("chunks", 1, steps=2), "chunk_size": 64, "fit": 40, "slack": 0.0, "policy": "lru"})
def test_chunks_train_to_the_plain_parameters_within_budget_moving_the_formulas_bytes(c):
    want, acts = reference(c)
    n_chunks = chunks_by_hand(list(param_sizes(c).values()), c["chunk_size"])
    chunk_bytes = 8 * c["chunk_size"]
    device_budget = acts + c["fit"] * chunk_bytes + int(c["slack"] * chunk_bytes)
    tiers = Tiers(device_budget)
    cm, per_step = run(build(c), tiers, c["chunk_size"], c["policy"], [batch(c, i) for i in range(c["steps"])])
    got = cm.state_dict()
    assert got.keys() == want.keys()
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
    assert len(cm.chunks) == n_chunks and max(cm.reserve) == acts
    assert tiers.peak_device_bytes <= device_budget
    misses = n_chunks + max(0, n_chunks - c["fit"])
    assert in_order_misses(n_chunks, c["fit"]) == misses
    expected = chunk_offload_bytes(chunk_bytes, misses)
    assert expected == {"cpu->device": chunk_bytes * misses, "device->cpu": chunk_bytes * misses}
    for up, down, peak, _ in per_step:
        assert (up, down) == (expected["cpu->device"], expected["device->cpu"])
        assert peak <= device_budget
    assert cm.state_bytes()["device chunks"] == 0 and tiers.device_bytes == 0


class Loop(nn.Module):
    """Three ``Linear(d, d)`` layers applied 0, 1, 2 and 0 again: the first layer's chunk is used at both
    ends of forward, the pattern where the order of uses beats recency."""

    def __init__(self, d: int, seed: int = 0) -> None:
        self.seed = seed
        self.layers = nn.ModuleList([nn.Linear(d, d) for _ in range(3)])

    def forward(self, x: Tensor) -> Tensor:
        for i in (0, 1, 2, 0):
            x = self.layers[i](x).tanh()
        return x

    def loss(self, x: np.ndarray, y: np.ndarray) -> Tensor:
        return F.mse_loss(self(Tensor(x)), y)


def test_warmup_order_moves_fewer_bytes_than_lru_on_a_reused_layer():
    """d = 32: each layer is 32 x 32 + 32 = 1056 elements, one chunk each (chunk_size 1056, 8448 bytes);
    the budget holds two chunks beside the activations (A < one chunk, so never three).
    Chunk uses per step: forward 0 1 2 0, backward 0 (pinned: COMPUTE until its gradient is complete
    after its first use's backward) 2 1 0.
    LRU:    0 miss, 1 miss, 2 miss (evict 0), 0 miss (evict 1) | 0 hit, 2 hit, 1 miss (evict 2), 0 hit: 5.
    Belady: 0 miss, 1 miss, 2 miss (evict 1: next use in backward, 0's is the 4th), 0 hit | 0, 2 hit,
    1 miss (evict 2), 0 hit: 4. The warm-up iteration itself runs LRU: 5 for both."""
    d, rows = 32, 2
    xs = [np.random.default_rng(i).normal(size=(rows, d)) for i in range(3)]
    ys = [np.random.default_rng(10 + i).normal(size=(rows, d)) for i in range(3)]
    ref = Loop(d, seed=3)
    opt = AdamW(ref.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    for x, y in zip(xs, ys):
        since = memory.seq_mark()
        loss = ref.loss(x, y)
        acts = memory.activation_bytes(loss, since)
        loss.backward()
        opt.step()
        opt.zero_grad()
    chunk_bytes = 8 * (d * d + d)
    assert acts < chunk_bytes
    moved = {}
    for policy in ("lru", "warmup"):
        tiers = Tiers(acts + 2 * chunk_bytes)
        cm, per_step = run(Loop(d, seed=3), tiers, d * d + d, policy, list(zip(xs, ys)))
        assert len(cm.chunks) == 3 and tiers.peak_device_bytes <= acts + 2 * chunk_bytes
        for name, p in ref.named_parameters():
            np.testing.assert_array_equal(cm.state_dict()[name], p.data, err_msg=name)
        moved[policy] = [(up // chunk_bytes, down // chunk_bytes) for up, down, _, _ in per_step]
    assert moved == {"lru": [(5, 5)] * 3, "warmup": [(5, 5), (4, 4), (4, 4)]}


def test_budget_below_one_chunk_plus_activations_raises_before_any_step():
    c = config("chunks", 1, steps=1)
    initial = build(c).state_dict()
    _, acts = reference(c)
    with pytest.raises(DeviceOutOfMemory, match="budget 511 bytes"):
        ChunkManager(build(c), Tiers(511), 64)  # one chunk of 64 float64 is 512 bytes
    device_budget = acts + 512 - 1
    cm = ChunkManager(build(c), Tiers(device_budget), 64)
    with pytest.raises(DeviceOutOfMemory) as info:
        cm.backward(cm.loss(*batch(c, 0)))
    assert info.value.budget == device_budget and info.value.smallest_budget > device_budget
    assert cm.iteration == 0
    for name, value in cm.state_dict().items():
        np.testing.assert_array_equal(value, initial[name], err_msg=name)


class _Spy(Function):
    """Identity whose backward calls ``record()``: it runs inside the module's backward."""

    @staticmethod
    def forward(ctx, x, record):
        ctx.record = record
        return x

    @staticmethod
    def backward(ctx, g):
        ctx.record()
        return g, None


class Probe(nn.Module):
    """``x * w``, noting its parameter's state at the start of its forward and inside its backward."""

    def __init__(self, d: int) -> None:
        self.w = nn.Parameter((d,), ("uniform", 1.0))
        self.seen: list = []
        self.state = lambda: None

    def forward(self, x: Tensor) -> Tensor:
        self.seen.append(("forward", self.state()))
        return _Spy.apply(x * self.w, lambda: self.seen.append(("backward", self.state())))


class Probes(nn.Module):
    def __init__(self, d: int) -> None:
        self.a, self.b = Probe(d), Probe(d)

    def loss(self, x: np.ndarray, y: np.ndarray) -> Tensor:
        return F.mse_loss(self.b(self.a(Tensor(x))), y)


def test_tensor_states_follow_forward_backward_and_step():
    model = Probes(3)
    cm = ChunkManager(model, Tiers(1 << 20), 3)  # one chunk per probe
    for probe in (model.a, model.b):
        probe.state = lambda p=probe: cm._slot_of[id(p.w)].state
    x, y = np.ones((2, 3)), np.zeros((2, 3))
    assert {s.state for s in cm.slots} == {State.HOLD}
    loss = cm.loss(x, y)
    assert {s.state for s in cm.slots} == {State.HOLD_AFTER_FWD}
    cm.backward(loss)
    assert model.a.seen == model.b.seen == [("forward", State.COMPUTE), ("backward", State.COMPUTE)]
    assert {s.state for s in cm.slots} == {State.HOLD_AFTER_BWD}
    with pytest.raises(RuntimeError, match="without step"):
        cm.loss(x, y)
    cm.step()
    assert {s.state for s in cm.slots} == {State.HOLD}
    cm.close()
    assert {s.state for s in cm.slots} == {State.FREE}
    model.loss(x, y).backward()  # a plain model again: no hooks, gradients in .grad
    assert all(p.grad is not None for p in model.parameters())
    assert model.a.seen[-2:] == [("forward", State.FREE), ("backward", State.FREE)]


def test_model_states_over_8x_the_device_budget_train_alike():
    """GPT(vocab 5, seq 2, d 8, 2 heads, 4 layers), one sequence per step: 32 bytes of model states per
    parameter (the parameter's chunk, the master, AdamW's two moments, float64) against a device of two
    chunks of the largest tensor (fc, 8 x 32 = 256 elements: 2048 bytes) beside the activations."""
    c = {**config("chunks", 1, d=8, heads=2, layers=4, steps=2), "seq": 2, "batch": 1}
    want, acts = reference(c)
    psi = sum(param_sizes(c).values())
    device_budget = acts + 2 * 8 * 256
    assert 32 * psi >= 8 * device_budget
    tiers = Tiers(device_budget)
    cm, per_step = run(build(c), tiers, 256, "warmup", [batch(c, i) for i in range(c["steps"])])
    n_chunks = chunks_by_hand(list(param_sizes(c).values()), 256)
    assert [cpu for *_, cpu in per_step] == [2 * 2048 * n_chunks + 16 * psi] * c["steps"]  # chunks, master, m, v
    assert cm.state_bytes() == {"device chunks": 0, "cpu chunks": 2048 * n_chunks,
                                "cpu master parameters": 2048 * n_chunks, "cpu optimizer state": 16 * psi}
    for name, value in cm.state_dict().items():
        np.testing.assert_array_equal(value, want[name], err_msg=name)
    assert tiers.peak_device_bytes <= device_budget


def test_compute_needs_the_chunk_on_the_device_and_a_larger_batch_than_warmup_is_refused():
    """After the step every chunk is on the CPU: compute on a parameter there is refused. A batch with
    more rows than warm-up's would need more activation memory than the replayed reservation."""
    c = config("chunks", 1, steps=1)
    tiers = Tiers(1 << 20)
    model = build(c)
    cm = ChunkManager(model, tiers, 64)
    x, y = batch(c, 0)
    cm.backward(cm.loss(x, y))
    cm.step()
    with pytest.raises(NotOnDevice):
        tiers.require_device(model.head.weight)
    with pytest.raises(RuntimeError, match="exceed the warm-up"):
        cm.backward(cm.loss(np.concatenate([x, x]), np.concatenate([y, y])))


# ---- N data-parallel ranks ---------------------------------------------------------------------------
def dp_run(comm, c: dict, device_budget: int) -> dict:
    """Train on this rank's rows through a ``ChunkManager`` on ``comm``; its owned parameters, per step
    the transfer bytes (up, down) and the bytes it sent, the device's peak, the chunks and CPU masters."""
    tiers = Tiers(device_budget)
    cm = ChunkManager(build(c), tiers, c["chunk_size"], policy=c["policy"], lr=LR, weight_decay=WEIGHT_DECAY,
                      comm=comm)
    mine, per_step = rows(c, comm.rank), []
    with trace.recording(comm.rank) as rec:
        for i in range(c["steps"]):
            start, (x, y) = len(rec.events), batch(c, i)
            cm.backward(cm.loss(x[mine], y[mine]))
            cm.step()
            ev = rec.events[start:]
            moves = [e for e in ev if e.kind == "transfer"]
            per_step.append({"cpu->device": sum(e.nbytes for e in moves if e.args["dst"] == "device"),
                             "device->cpu": sum(e.nbytes for e in moves if e.args["dst"] == "cpu"),
                             "sent": sum(e.nbytes for e in ev if e.kind == "comm" and e.name == "send")})
    out = {"final": cm.state_dict(), "per_step": per_step, "peak": tiers.peak_device_bytes, "chunks": len(cm.chunks),
           "master": cm.state_bytes()["cpu master parameters"]}
    cm.close()
    return out


def local_activations(c: dict) -> int:
    """Activation bytes of one rank's batch (rows 1/N of the global batch) on a plain model."""
    since = memory.seq_mark()
    x, y = batch(c, 0)
    return memory.activation_bytes(build(c).loss(x[rows(c, 0)], y[rows(c, 0)]), since)


def global_reference(c: dict) -> tuple[dict[str, np.ndarray], dict[str, list[np.ndarray]]]:
    """One process on the global batch: the final parameters and every step's gradients."""
    model = build(c)
    opt = AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    grads: dict[str, list[np.ndarray]] = {k: [] for k, _ in model.named_parameters()}
    for i in range(c["steps"]):
        model.loss(*batch(c, i)).backward()
        for k, p in model.named_parameters():
            grads[k].append(p.grad.copy())
        opt.step()
        opt.zero_grad()
    return model.state_dict(), grads


def check_dp(c: dict, device_budget: int, results: list[dict]) -> None:
    n, want, grads = c["world"], *global_reference(c)
    cb = 8 * c["chunk_size"]
    groups = -(-chunks_by_hand(list(param_sizes(c).values()), c["chunk_size"]) // n)
    fit = (device_budget - local_activations(c)) // (n * cb)
    misses = groups + max(0, groups - fit)
    by_hand = {"cpu->device": cb * misses, "device->cpu": cb * misses, "sent": (n - 1) * cb * (misses + groups)}
    assert chunk_dp_bytes(cb, n, in_order_misses(groups, fit), groups) == by_hand
    got: dict[str, np.ndarray] = {}
    for r, res in enumerate(results):
        assert res["chunks"] == n * groups and res["master"] == cb * groups, r
        assert res["per_step"] == [by_hand] * c["steps"], r
        assert res["peak"] <= device_budget, r
        assert not got.keys() & res["final"].keys(), r  # each parameter owned by one rank
        got.update(res["final"])
    assert got.keys() == want.keys()
    for k, w in want.items():
        if n == 1:
            np.testing.assert_array_equal(got[k], w, err_msg=k)
            continue
        # the ring sums the gradients as ZeRO's does (test_zero asserts GRAD_TOL of those)
        assert_close_after_adamw(got[k], w, grads[k], LR, GRAD_TOL, PARAM_TOL, err_msg=k)


@st.composite
def dp_configs(draw: st.DrawFn) -> dict:
    c = draw(chunk_configs())
    world = draw(st.sampled_from([1, 2, 4]))
    return {**c, "world": world, "batch": world * draw(st.integers(1, 2)), "fit": draw(st.integers(2, 8))}


def dp_budget(c: dict) -> int:
    return local_activations(c) + c["fit"] * c["world"] * 8 * c["chunk_size"] + int(c["slack"] * 8 * c["chunk_size"])


@budget(8)
@given(dp_configs())
@example({**config("chunks", 2, steps=2), "chunk_size": 64, "fit": 2, "slack": 0.0, "policy": "warmup"})
@example({**config("chunks", 4, steps=2), "chunk_size": 64, "fit": 2, "slack": 0.5, "policy": "lru"})
def test_data_parallel_chunks_equal_one_process_on_the_global_batch_moving_the_formulas_bytes(c):
    device_budget = dp_budget(c)
    check_dp(c, device_budget, launch(dp_run, c["world"], c=c, device_budget=device_budget))


def test_data_parallel_example_of_the_formulas_doc():
    """docs/formulas.md 7: GPT(5, 3, 4, 2 heads, 2 layers), chunk_size 64: C = 12 chunks of 512 bytes,
    A = 8408 bytes for 2 sequences; k = 2 groups beside them. N = 2: G = 6, 6 + 4 = 10 misses, 5120
    bytes each way, 512 x 16 = 8192 sent; N = 4: G = 3, 3 + 1 = 4 misses, 2048 each way, 3 x 512 x 7."""
    for n, (up, sent) in ((2, (5120, 8192)), (4, (2048, 10752))):
        c = {**config("chunks", n, steps=1), "chunk_size": 64, "policy": "warmup"}
        assert local_activations(c) == 8408
        res = launch(dp_run, n, c=c, device_budget=8408 + 2 * n * 512)
        assert [r["per_step"] for r in res] == [[{"cpu->device": up, "device->cpu": up, "sent": sent}]] * n


@pytest.mark.mpi
@budget(1)
@given(drawn=dp_configs())
def test_data_parallel_chunks_under_mpiexec(drawn: dict):
    """N = 2 under ``mpiexec``, one job: both policies, a padded group (C odd), a tight budget, and a
    configuration hypothesis draws (moved to N = 2)."""
    drawn = {**drawn, "world": 2, "batch": 2 * (drawn["batch"] // drawn["world"])}
    configs = [{**config("chunks", 2, steps=2, d=3, heads=1), "chunk_size": 48, "fit": 2, "slack": 0.0,
                "policy": "warmup"},
               {**config("chunks", 2, steps=2), "chunk_size": 100, "fit": 3, "slack": 0.3, "policy": "lru"}, drawn]
    budgets = [dp_budget(c) for c in configs]
    jobs = run_each(dp_run, 2, [{"c": c, "device_budget": b} for c, b in zip(configs, budgets, strict=True)])
    for c, b, results in zip(configs, budgets, jobs, strict=True):
        check_dp(c, b, results)


def refused_group(comm, device_budget: int) -> tuple[str, int]:
    """Build a manager on a device too small for one group: the error's message, the messages recorded."""
    with trace.recording(comm.rank) as rec:
        try:
            ChunkManager(build(config("chunks", comm.size)), Tiers(device_budget), 64, comm=comm)
            msg = "accepted"
        except DeviceOutOfMemory as e:
            msg = str(e)
    return msg, sum(e.kind == "comm" for e in rec.events)


def test_a_budget_below_one_group_is_refused_on_every_rank_before_anything_is_sent():
    """N = 2, chunk_size 64: a group is 2 x 512 bytes; 1023 is refused, 1024 accepted."""
    for msg, sent in launch(refused_group, 2, device_budget=1023):
        assert "budget 1023 bytes" in msg and "one group of 2 chunks" in msg and sent == 0
    assert launch(refused_group, 2, device_budget=1024) == [("accepted", 0)] * 2
