"""DistributedDataParallel equals one process on the global batch; buckets, overlap, bytes, errors.

The property runs on the threads backend (drawn world sizes 1-4 and configurations) and under real
mpiexec (each job a drawn world size and a list of drawn configurations); every world size 1-4 and
every all-reduce algorithm, ``native`` included, always run as ``@example``s. Bytes per rank are held
against closed forms written out here (the ring's chunks of n // p or n // p + 1 elements).
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st
from strategies import budget, ddp_configs, mpi_jobs
from tolerances import assert_close_after_adamw

import minipar
from minipar import datasets, trace
from minipar import functional as F
from minipar.cost import allreduce_bytes
from minipar.nn import GPT, MLP, Linear, Module
from minipar.optim import SGD, AdamW
from minipar.parallel.ddp import DistributedDataParallel, bucket_assignment, train_step
from minipar.testing import run_each

STEPS = 3
MLP_SIZES = [6, 10, 8, 3]
ADAMW_LR = 1e-2
# Gradients (the last step's): the ring adds the ranks' sums in another order than one process.
GRAD_TOL = {"rtol": 1e-9, "atol": 1e-12}
# Parameters after the steps. SGD is linear in the gradients (momentum 0.9, lr 0.1, 3 steps: at most
# 0.1 (1 + 1.9 + 2.71) = 0.56 times their differences), nothing to amplify: the tolerance it always had.
# AdamW: the update's own rounding, plus its drift of gradients GRAD_TOL apart (tests/tolerances.py),
# large only where the exact gradient is zero (the attention's key bias: softmax ignores a shift shared
# by all keys).
SGD_TOL, ADAMW_TOL = {"rtol": 1e-9, "atol": 1e-10}, {"rtol": 1e-10, "atol": 1e-11}


def build(kind: str, seed: int) -> Module:
    if kind == "mlp":
        return MLP(MLP_SIZES, seed=seed)
    return GPT(vocab_size=8, seq_len=4, d_model=8, n_heads=2, n_layers=1, seed=seed)


def batch(kind: str, size: int, step: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    if kind == "mlp":
        x, y = datasets.regression(size * (STEPS + 1), MLP_SIZES[0], MLP_SIZES[-1], seed=seed)
        return x[step * size:(step + 1) * size], y[step * size:(step + 1) * size]
    return datasets.lm_batch(datasets.token_stream(300, 8, seed=seed), size, 4, step=step, seed=seed)


def loss_fn(model: Module, x: np.ndarray, y: np.ndarray) -> minipar.Tensor:
    if isinstance(model, GPT):
        return model.loss(x, y)
    return F.mse_loss(model(minipar.Tensor(x)), minipar.Tensor(y))


def make_opt(model: Module, kind: str):
    if kind == "adamw":
        return AdamW(model.parameters(), lr=ADAMW_LR)
    return SGD(model.parameters(), lr=0.1, momentum=0.9)


def single_process(cfg: dict) -> tuple[list[float], dict, dict]:
    """The reference: one process, one backward on the whole global batch per step. Returns the losses,
    the final parameters and each parameter's gradients of every step."""
    model = build(cfg["model"], cfg["seed"])
    opt = make_opt(model, cfg["opt"])
    losses, grads = [], {n: [] for n, _ in model.named_parameters()}
    for step in range(STEPS):
        x, y = batch(cfg["model"], cfg["batch"], step, cfg["seed"])
        opt.zero_grad()
        loss = loss_fn(model, x, y)
        loss.backward()
        for n, p in model.named_parameters():
            grads[n].append(p.grad.copy())
        opt.step()
        losses.append(loss.item())
    return losses, model.state_dict(), grads


def ddp_rank(comm, cfg: dict) -> tuple[list[float], dict, dict]:
    """One rank of the DDP run; the replicas start from different seeds (the broadcast fixes it)."""
    model = build(cfg["model"], cfg["seed"] + 1000 * comm.rank)
    if comm.rank == 0:
        model.init_parameters(cfg["seed"])
    ddp = DistributedDataParallel(model, comm, bucket_cap_bytes=cfg["cap"], algorithm=cfg["algorithm"])
    opt = make_opt(model, cfg["opt"])
    losses = [train_step(ddp, opt, loss_fn, *batch(cfg["model"], cfg["batch"], step, cfg["seed"]),
                         accumulation=cfg["accumulation"]) for step in range(STEPS)]
    return losses, model.state_dict(), {n: p.grad.copy() for n, p in model.named_parameters()}


def assert_equal_to_single(cfg: dict, results: list) -> None:
    ref_losses, ref_params, ref_grads = single_process(cfg)
    np.testing.assert_allclose(np.mean([r[0] for r in results], axis=0), ref_losses, rtol=1e-10, atol=1e-12)
    for _, params, grads in results:
        for name in ref_params:
            np.testing.assert_allclose(grads[name], ref_grads[name][-1], err_msg=name, **GRAD_TOL)
            if cfg["opt"] == "adamw":
                assert_close_after_adamw(params[name], ref_params[name], ref_grads[name], ADAMW_LR, GRAD_TOL,
                                         ADAMW_TOL, err_msg=name)
            else:
                np.testing.assert_allclose(params[name], ref_params[name], err_msg=name, **SGD_TOL)


def config(world: int, algorithm: str, model: str = "mlp", accumulation: int = 1, cap: int = 400,
        opt: str = "sgd", seed: int = 3) -> dict:
    return {"model": model, "seed": seed, "cap": cap, "algorithm": algorithm, "accumulation": accumulation,
            "batch": 2 * world * accumulation, "opt": opt}


# every world size 1-4 and every all-reduce algorithm (native included) always run
@budget(6)
@given(st.integers(1, 4).flatmap(lambda p: st.tuples(st.just(p), ddp_configs(p))))
@example((1, config(1, "ring", "gpt", opt="adamw")))
@example((2, config(2, "native", accumulation=2)))
@example((3, config(3, "recursive_doubling", "gpt", cap=64)))
@example((4, config(4, "naive", accumulation=3, opt="adamw", cap=1 << 20)))
def test_ddp_equals_single_process_threads(world_cfg):
    world, c = world_cfg
    assert_equal_to_single(c, minipar.launch(ddp_rank, world, cfg=c))


@pytest.mark.mpi
@budget(1)  # the simplest drawn job (p = 2) beside the @examples; thorough: 10 drawn jobs
@given(mpi_jobs(ddp_configs))
@example((4, [config(4, alg, model, acc, cap, opt) for alg, model, acc, cap, opt in [
    ("ring", "gpt", 2, 64, "adamw"), ("recursive_doubling", "mlp", 1, 1 << 20, "sgd"),
    ("naive", "mlp", 3, 400, "adamw"), ("native", "mlp", 1, 2048, "sgd")]]))
@example((3, [config(3, "native", accumulation=2), config(3, "recursive_doubling", opt="adamw")]))
def test_ddp_equals_single_process_mpi(job):
    world, cfgs = job
    for c, results in zip(cfgs, run_each(ddp_rank, world, [{"cfg": c} for c in cfgs], timeout=90)):
        assert_equal_to_single(c, results)


def test_bucket_assignment_follows_the_cap_in_reverse_order():
    model = MLP(MLP_SIZES)  # bytes: w0 480, b0 80, w1 640, b1 64, w2 192, b2 24
    nbytes = [p.data.nbytes for p in model.parameters()]
    f64 = [np.dtype(np.float64)] * 6
    assert bucket_assignment(nbytes, f64, 1 << 20) == [[5, 4, 3, 2, 1, 0]]
    assert bucket_assignment(nbytes, f64, 300) == [[5, 4, 3], [2], [1], [0]]  # 24+192+64 = 280
    assert bucket_assignment(nbytes, f64, 100) == [[5], [4], [3], [2], [1], [0]]
    assert bucket_assignment([8, 8, 8], [np.float32, np.float64, np.float64], 100) == [[2, 1], [0]]
    with pytest.raises(ValueError, match="bucket_cap_bytes"):
        bucket_assignment(nbytes, f64, 0)


def traced_steps(comm, cap: int, algorithm: str, overlap: bool, sizes: list[int], rows: int, steps: int,
                 accumulation: int = 1):
    model = MLP(sizes, seed=0)
    ddp = DistributedDataParallel(model, comm, bucket_cap_bytes=cap, algorithm=algorithm, overlap=overlap)
    opt = SGD(model.parameters(), lr=0.01)
    x, y = datasets.regression(rows * comm.size, sizes[0], sizes[-1], seed=1)
    with trace.recording(comm.rank) as rec:
        for _ in range(steps):
            train_step(ddp, opt, loss_fn, x, y, accumulation)
    return rec.events, len(ddp.buckets), [ddp.bytes_per_step(r) for r in range(comm.size)], \
        [b.numel for b in ddp.buckets]


def test_one_allreduce_per_bucket_per_step_and_none_inside_no_sync():
    p, steps, acc = 3, 2, 3
    out = minipar.launch(traced_steps, p, cap=300, algorithm="ring", overlap=True, sizes=MLP_SIZES, rows=6,
                         steps=steps, accumulation=acc)
    for events, n_buckets, _, _ in out:
        assert n_buckets == 4
        assert len([e for e in events if e.kind == "mark" and e.name == "bucket"]) == steps * n_buckets
        sends = [e for e in events if e.kind == "comm" and e.src == e.rank and e.op == "allreduce"]
        assert len(sends) == steps * n_buckets * 2 * (p - 1)  # ring: 2(p-1) messages per all-reduce
        assert len([e for e in events if e.name == "B"]) == steps * acc


@pytest.mark.parametrize("overlap", [True, False])
def test_first_bucket_starts_before_backward_ends_only_with_overlap(overlap):
    sizes = [128, 256, 256, 256, 256, 8]
    out = minipar.launch(traced_steps, 2, cap=256 * 256 * 8, algorithm="ring", overlap=overlap, sizes=sizes,
                         rows=256, steps=2)
    for events, n_buckets, _, _ in out:
        assert n_buckets >= 3
        for step in range(2):
            b = [e for e in events if e.name == "B"][step]
            first = min(e.t0 for e in events if e.kind == "comm" and e.op == "allreduce"
                        and e.t0 > [e for e in events if e.name == "F"][step].t0)
            if not overlap:  # nothing is sent before the last gradient is ready (with overlap, whether the
                # worker thread gets a core before backward ends is the scheduler's choice on a loaded
                # machine: test_ddp_overlap checks it on the replayed clock)
                assert first >= b.t1, (first, b.t1)
            # with overlap every bucket but the first layer's is launched while backward still runs
            # (an order, not a duration: it holds however loaded the machine is); without, none
            launches = [e.t0 for e in events if e.kind == "mark" and e.name == "bucket"]
            launches = launches[step * n_buckets:(step + 1) * n_buckets]
            inside = sum(t < b.t1 for t in launches)
            assert (inside >= n_buckets - 1) if overlap else inside == 0, (inside, n_buckets)


def allreduce_bytes_by_hand(algorithm: str, numel: int, p: int, rank: int, itemsize: int = 8) -> int:
    """Bytes ``rank`` sends in one all-reduce of ``numel`` elements, from the algorithms' definitions.

    ring (Patarasuk and Yuan 2009): the array is cut into p chunks, chunk i of numel // p elements
    plus one for i < numel % p; in the reduce-scatter rank r sends every chunk but its own, in the
    all-gather every chunk but its right neighbour's: 2(p-1)/p * numel when p divides numel.
    naive: rank 0 gathers p-1 arrays and sends the result back to each; the others send theirs once.
    recursive doubling (Thakur et al. 2005): lg p exchanges of the whole array; with p = 3 ranks 0 and 1
    fold first (rank 0 sends its array to rank 1), ranks 1 and 2 exchange once, rank 1 sends the result
    back to rank 0.
    """
    if algorithm == "ring":
        chunk = [numel // p + (1 if i < numel % p else 0) for i in range(p)]
        return (2 * numel - chunk[rank] - chunk[(rank + 1) % p]) * itemsize
    n = numel * itemsize
    if algorithm == "naive":
        return (p - 1) * n if rank == 0 else n
    return {2: [n, n], 3: [n, 2 * n, n], 4: [2 * n] * 4}[p][rank]


@pytest.mark.parametrize("algorithm", ["ring", "recursive_doubling", "naive"])
@pytest.mark.parametrize("p", [2, 3, 4])
def test_bytes_per_rank_per_step_equal_the_closed_forms(p, algorithm):
    steps, sizes = 2, [3, 5, 7]
    numels = [5 * 3, 5, 7 * 5, 7]  # weights and biases: 62 elements, few of them divisible by p
    for cap, buckets in ((1 << 20, [sum(numels)]), (8, numels)):  # one bucket; one per parameter
        out = minipar.launch(traced_steps, p, cap=cap, algorithm=algorithm, overlap=True, sizes=sizes, rows=2,
                             steps=steps)
        assert sorted(out[0][3]) == sorted(buckets)
        sent = [sum(e.nbytes for e in events if e.kind == "comm" and e.src == r and e.op == "allreduce")
                for r, (events, _, _, _) in enumerate(out)]
        want = [sum(allreduce_bytes_by_hand(algorithm, n, p, r) for n in buckets) for r in range(p)]
        assert sent == [steps * w for w in want], (cap, sent, want)
        assert out[0][2] == want  # the trace meta's expected bytes per step agree


def test_allreduce_bytes_by_hand():
    # p = 4, 8 elements: 2(p-1) chunks of 2 elements each
    assert [allreduce_bytes(8, 8, 4, r, "ring") for r in range(4)] == [2 * 3 * 2 * 8] * 4
    assert [allreduce_bytes(5, 4, 2, r, "ring") for r in range(2)] == [(10 - 3 - 2) * 4, (10 - 2 - 3) * 4]
    assert [allreduce_bytes(4, 8, 3, r, "recursive_doubling") for r in range(3)] == [32, 64, 32]
    assert allreduce_bytes(4, 8, 4, 0, "native") == 0 and allreduce_bytes(4, 8, 1, 0, "ring") == 0


def test_native_records_one_event_per_bucket():
    out = minipar.launch(traced_steps, 2, cap=400, algorithm="native", overlap=True, sizes=MLP_SIZES, rows=2,
                         steps=1)
    for events, _, _, numels in out:
        native = [e for e in events if e.kind == "comm" and e.algorithm == "native"]
        assert sorted(e.nbytes for e in native) == sorted(8 * n for n in numels)


def wrap_from(comm, root: int):
    model = MLP(MLP_SIZES, seed=comm.rank)
    DistributedDataParallel(model, comm, broadcast_from=root)
    return model.state_dict()


def test_parameters_broadcast_from_the_chosen_rank_at_wrap_time():
    states = minipar.launch(wrap_from, 3, root=1)
    expected = MLP(MLP_SIZES, seed=1).state_dict()
    for st_ in states:
        for k in expected:
            np.testing.assert_array_equal(st_[k], expected[k])


def bad_step(comm, what: str):
    with trace.recording(comm.rank) as rec:
        try:
            if what == "batch":
                model = MLP(MLP_SIZES)
                ddp = DistributedDataParallel(model, comm)
                rec.events.clear()
                x, y = datasets.regression(7, MLP_SIZES[0], MLP_SIZES[-1])
                train_step(ddp, SGD(model.parameters()), loss_fn, x, y)
            elif what == "algorithm":
                DistributedDataParallel(MLP(MLP_SIZES), comm, algorithm="tree")
            else:
                DistributedDataParallel(MLP(MLP_SIZES), comm, broadcast_from=comm.size)
        except ValueError as exc:
            return str(exc), len([e for e in rec.events if e.kind == "comm"])
    return None, 0


@pytest.mark.parametrize("what, words", [("batch", "multiple of 3"),
                                         ("algorithm", "unknown algorithm 'tree'"),
                                         ("root", "broadcast_from=3")])
def test_bad_configuration_is_rejected_on_every_rank_before_any_message(what, words):
    out = minipar.launch(bad_step, 3, what=what)
    assert len({msg for msg, _ in out}) == 1 and words in out[0][0]
    assert all(n == 0 for _, n in out)


class TwoHeads(Module):
    def __init__(self) -> None:
        self.a, self.b = Linear(3, 2), Linear(3, 2)

    def forward(self, x):
        return self.a(x)


def unused(comm):
    model = TwoHeads()
    ddp = DistributedDataParallel(model, comm, bucket_cap_bytes=64)
    try:
        ddp.backward(model(minipar.Tensor(np.ones((2, 3)))).sum())
    except RuntimeError as exc:
        return str(exc)
    return None


def test_an_unused_parameter_is_named_not_silently_skipped():
    for msg in minipar.launch(unused, 2):
        assert msg is not None and "b.weight" in msg and "b.bias" in msg


def memory_samples(comm, opt_kind: str):
    model = MLP(MLP_SIZES, seed=0)
    ddp = DistributedDataParallel(model, comm, bucket_cap_bytes=300)
    opt = make_opt(model, opt_kind)
    x, y = datasets.regression(4 * comm.size, MLP_SIZES[0], MLP_SIZES[-1], seed=1)
    with trace.recording(comm.rank) as rec:
        for _ in range(2):
            train_step(ddp, opt, loss_fn, x, y)
    samples: dict[str, list[int]] = {}
    for e in rec.events:
        if e.kind == "memory":
            samples.setdefault(e.name, []).append(e.nbytes)
    return samples, [b.nbytes for b in ddp.buckets]


@pytest.mark.parametrize("opt_kind, state_copies", [("sgd", 1), ("adamw", 2)])
def test_memory_per_rank_is_a_full_replica_plus_the_buckets_in_flight(opt_kind, state_copies):
    n = sum(p.data.nbytes for p in MLP(MLP_SIZES).parameters())  # 1480 bytes of float64
    for samples, buckets in minipar.launch(memory_samples, 3, opt_kind=opt_kind):
        assert samples["parameters"] == [n, n] and samples["gradients"] == [n, n]
        assert samples["optimizer state"] == [state_copies * n] * 2  # momentum: n; Adam's m and v: 2n
        # per step: the bytes in flight grow bucket by bucket up to n, then drop to 0 at write-back
        per_step = [*np.cumsum(buckets).tolist(), 0]
        assert samples["gradient buckets"] == per_step * 2 and per_step[-2] == n


def local_after_remove_hooks(comm):
    model = MLP(MLP_SIZES, seed=0)
    ddp = DistributedDataParallel(model, comm)
    ddp.remove_hooks()
    x, y = datasets.regression(2, MLP_SIZES[0], MLP_SIZES[-1], seed=comm.rank)
    with trace.recording(comm.rank) as rec:
        loss_fn(model, x, y).backward()
    return len([e for e in rec.events if e.kind == "comm"]), model.layers[0].weight.grad.copy()


def test_remove_hooks_makes_backward_local_again():
    (n0, g0), (n1, g1) = minipar.launch(local_after_remove_hooks, 2)
    assert n0 == n1 == 0 and not np.allclose(g0, g1)  # no all-reduce: each rank keeps its own gradient
