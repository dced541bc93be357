"""Parameter server: sync equals one process step by step, async k=0 equals sync, the SSP bound k
holds (read from the workers' traces: how far a worker starts ahead of the slowest) and the loss
falls, traffic per server link and memory per rank equal sizes worked out here from the model, lost
workers, bad configurations. Hypothesis draws world sizes and configurations; under mpiexec each
job runs a drawn list of them."""

from __future__ import annotations

import itertools
import time

import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st
from strategies import budget, mpi_jobs, ps_configs

import minipar
from minipar import datasets, trace
from minipar import functional as F
from minipar.comm import RankError
from minipar.nn import MLP, Module
from minipar.optim import SGD, AdamW
from minipar.parallel import param_server as ps
from minipar.testing import HarnessError, run_each

SIZES = [6, 12, 12, 3]
# float64 bytes of the MLP's parameters in model order: weight 6x12, bias 12, 12x12, 12, 12x3, 3
PARAM_BYTES = [8 * 6 * 12, 8 * 12, 8 * 12 * 12, 8 * 12, 8 * 12 * 3, 8 * 3]
N_BYTES = sum(PARAM_BYTES)  # 2232
X, Y = datasets.regression(12 * 8, SIZES[0], SIZES[-1], seed=3)


def loss_fn(model: Module, x: np.ndarray, y: np.ndarray) -> minipar.Tensor:
    return F.mse_loss(model(minipar.Tensor(x)), minipar.Tensor(y))


def batch_fn(step: int) -> tuple[np.ndarray, np.ndarray]:
    i = step % 8
    return X[12 * i:12 * (i + 1)], Y[12 * i:12 * (i + 1)]


def make_opt(kind: str):
    if kind == "adamw":
        return lambda params: AdamW(params, lr=1e-2)
    return lambda params: SGD(params, lr=0.1)


def single_process(steps: int, seed: int, opt: str) -> tuple[list[float], dict]:
    model = MLP(SIZES, seed=seed)
    optimizer = make_opt(opt)(model.parameters())
    losses = []
    for step in range(steps):
        optimizer.zero_grad()
        loss = loss_fn(model, *batch_fn(step))
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses, model.state_dict()


def ps_rank(comm, seed: int = 0, opt: str = "sgd", **kw):
    """One rank of a parameter-server run; returns its Result and its trace events."""
    with trace.recording(comm.world_rank) as rec:
        result = ps.train(comm, MLP(SIZES, seed=seed), loss_fn, batch_fn, optimizer=make_opt(opt), **kw)
    return result, rec.events


def link_traffic(events_by_rank) -> dict[tuple[int, int], int]:
    links: dict[tuple[int, int], int] = {}
    for events in events_by_rank:
        for e in events:
            if e.kind == "comm" and e.src == e.rank:
                links[(e.src, e.dst)] = links.get((e.src, e.dst), 0) + e.nbytes
    return links


def applied_marks(events_by_rank) -> list[dict]:
    return [e.args for events in events_by_rank for e in events if e.kind == "mark" and e.name == "apply"]


def check_links(links: dict[tuple[int, int], int], world: int, servers: int, steps: int) -> list[int]:
    """Every worker-server link carries one shard a step each way and nothing else moves; the shards
    are whole parameters, together the model, balanced within one parameter. Returns the shards."""
    workers = range(servers, world)
    assert set(links) == {(a, b) for s in range(servers) for w in workers for a, b in ((s, w), (w, s))}
    shards = []
    for s in range(servers):
        (total,) = {links[(s, w)] for w in workers} | {links[(w, s)] for w in workers}  # pull = push
        assert total % steps == 0
        shards.append(total // steps)
    assert sum(shards) == N_BYTES and min(shards) > 0
    assert max(shards) - min(shards) <= max(PARAM_BYTES)
    assert any(sorted(shards) == sorted(sum(b for b, o in zip(PARAM_BYTES, owner) if o == s)
                                        for s in range(servers))
               for owner in itertools.product(range(servers), repeat=len(PARAM_BYTES)))
    return shards


def lead_over_slowest(events_by_rank, servers: int) -> list[int]:
    """For every step c a worker starts (its "F" span), c minus the fewest steps any worker had begun
    pushing to some server by then: how many steps it runs ahead of the slowest. A pull for step c is
    answered only once the server holds c - k pushes of every worker, and a push is posted before it
    arrives, so SSP with bound k keeps this <= k. Read from the workers' traces alone (one clock)."""
    world = len(events_by_rank)
    pushes: dict[tuple[int, int], list[float]] = {(w, s): [] for w in range(servers, world) for s in range(servers)}
    for events in events_by_rank:
        for e in events:
            if e.kind == "comm" and e.op == "push" and e.src == e.rank:
                pushes[(e.src, e.dst)].append(e.t0)
    return [f.step - min(sum(t < f.t0 for t in posted) for posted in pushes.values())
            for events in events_by_rank for f in events if f.kind == "compute" and f.name == "F"]


def assert_close_state(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_allclose(a[k], b[k], rtol=1e-10, atol=1e-13, err_msg=k)


def check_sync(cfg: dict, out: list, world: int) -> None:
    """Sync equals one process on the global batch step by step (the loss of every step, then the final
    parameters) and moves one shard a step each way on every link."""
    state, losses = ps.merge([r for r, _ in out])
    ref_losses, ref_state = single_process(cfg["steps"], cfg["seed"], cfg["opt"])
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-10)
    assert_close_state(state, ref_state)
    check_links(link_traffic([e for _, e in out]), world, cfg["n_servers"], cfg["steps"])


def sync_config(n_servers: int, steps: int, opt: str = "sgd", seed: int = 7) -> dict:
    return {"n_servers": n_servers, "steps": steps, "seed": seed, "opt": opt}


@budget(10)
@given(st.integers(2, 4).flatmap(lambda n: st.tuples(st.just(n), ps_configs(n))))
@example((4, sync_config(3, 3, "adamw")))  # one worker: three servers
@example((4, sync_config(1, 4)))  # three workers: one hub
def test_sync_equals_single_process_threads(world_cfg):
    world, cfg = world_cfg  # 1..3 workers: each divides the global batch of 12
    check_sync(cfg, minipar.launch(ps_rank, world, mode="sync", **cfg), world)


def test_async_with_staleness_zero_equals_sync():
    kw = dict(steps=5, n_servers=2, slow={3: 0.002})
    sync = minipar.launch(ps_rank, 4, mode="sync", **kw)
    asyn = minipar.launch(ps_rank, 4, mode="async", staleness=0, **kw)
    (s_state, s_losses), (a_state, a_losses) = ps.merge([r for r, _ in sync]), ps.merge([r for r, _ in asyn])
    assert_close_state(a_state, s_state)
    np.testing.assert_allclose(a_losses, s_losses, rtol=1e-10)
    assert set(lead_over_slowest([e for _, e in asyn], 2)) == {0}  # lockstep, though rank 3 is slow


@pytest.mark.parametrize("k", [1, 2])
def test_async_staleness_is_bounded_by_k_and_the_loss_falls(k):
    steps = 16
    out = minipar.launch(ps_rank, 4, steps=steps, n_servers=1, mode="async", staleness=k, slow={1: 0.01})
    marks = applied_marks([e for _, e in out])
    assert len(marks) == 3 * steps  # every push of every worker applied once
    assert {(m["worker"], m["step"]) for m in marks} == {(w, c) for w in (1, 2, 3) for c in range(steps)}
    lead = lead_over_slowest([e for _, e in out], 1)
    assert len(lead) == 3 * steps and min(lead) == 0
    assert 0 < max(lead) <= k  # the fast workers run ahead of the slow rank 1, never more than k steps
    assert max(m["staleness"] for m in marks) <= k  # the server's own record agrees
    model = MLP(SIZES, seed=0)
    before = loss_fn(model, X, Y).item()
    model.load_state_dict(ps.merge([r for r, _ in out])[0])
    after = loss_fn(model, X, Y).item()
    model.load_state_dict(single_process(steps, 0, "sgd")[1])
    synchronous = loss_fn(model, X, Y).item()
    assert after < 0.85 * before and after < 1.05 * synchronous, (before, after, synchronous)


def test_traffic_per_server_link_a_hub_not_a_ring():
    steps, world = 3, 4
    # two servers, largest parameter first to the least-loaded server: the 12x12 weight (1152 bytes)
    # to server 0, then 576, 288, 96, 96 and 24 all to server 1 (1080 bytes, still below 1152)
    out = minipar.launch(ps_rank, world, steps=steps, n_servers=2, mode="sync")
    links = link_traffic([e for _, e in out])
    assert links == {link: steps * shard for s, shard in enumerate([1152, 1080]) for w in (2, 3)
                     for link in ((s, w), (w, s))}
    # one server is a hub: it sends W n per step, while a ring all-reduce rank sends 2(p-1)/p n
    one = minipar.launch(ps_rank, world, steps=1, n_servers=1, mode="sync")
    hub = sum(v for (s, _), v in link_traffic([e for _, e in one]).items() if s == 0)
    assert hub == (world - 1) * N_BYTES > 2 * (world - 1) / world * N_BYTES


def test_assign_parameters_balances_by_size():
    assert ps.assign_parameters([100, 10, 60, 50], 2) == [0, 0, 1, 1]  # 100 -> 0, 60 -> 1, 50 -> 1, 10 -> 0
    assert ps.assign_parameters([5, 5, 5], 3) == [0, 1, 2]


def test_async_drops_a_silent_worker_and_finishes_with_the_others():
    t0 = time.monotonic()
    # silence_timeout 1 s: a live worker thread may wait that long for a core and the GIL on a loaded machine
    out = minipar.launch(ps_rank, 4, steps=6, n_servers=1, mode="async", staleness=1, stop_at={2: 2},
                         silence_timeout=1.0)
    assert time.monotonic() - t0 < 15
    results = [r for r, _ in out]
    assert results[0].dropped == [2]
    assert [len(r.losses) for r in results[1:]] == [6, 2, 6]
    drops = [e for _, ev in out for e in ev if e.kind == "mark" and e.name == "worker dropped"]
    assert len(drops) == 1 and drops[0].args["worker"] == 2 and drops[0].args["step"] == 2
    assert drops[0].args["silence"] >= 1.0
    assert {m["worker"] for m in applied_marks([e for _, e in out]) if m["step"] >= 2} == {1, 3}


def test_sync_fails_naming_the_lost_worker_not_hanging():
    t0 = time.monotonic()
    with pytest.raises(RankError, match="worker rank 3 sent no gradient for step 1") as info:
        minipar.launch(ps_rank, 4, steps=4, n_servers=1, mode="sync", stop_at={3: 1}, silence_timeout=1.0)
    assert isinstance(info.value, ps.WorkerLost) and time.monotonic() - t0 < 15  # the 1 s silence, not a hang


def bad_config(comm, **kw):
    try:
        ps_rank(comm, steps=2, **kw)
    except ValueError as exc:
        return str(exc)
    return None


@pytest.mark.parametrize("kw, words", [
    ({"n_servers": 3}, "leaves no worker"),
    ({"n_servers": 1, "world": 6}, "does not divide over 5 workers"),
    ({"n_servers": 1, "mode": "sync", "staleness": 2}, "staleness applies to mode='async'"),
    ({"n_servers": 1, "mode": "bsp"}, "mode must be one of"),
    ({"n_servers": 1, "stop_at": {0: 1}}, "not workers"),
])
def test_bad_configuration_is_rejected_on_every_rank_before_any_message(kw, words):
    world = kw.pop("world", 3)
    out = minipar.launch(ps_rank_checked, world, **kw)
    assert len({msg for msg, _ in out}) == 1 and words in out[0][0]
    assert all(n == 0 for _, n in out)


def ps_rank_checked(comm, **kw):
    with trace.recording(comm.rank) as rec:
        try:
            ps.train(comm, MLP(SIZES), loss_fn, batch_fn, steps=2, **kw)
        except ValueError as exc:
            return str(exc), len([e for e in rec.events if e.kind == "comm"])
    return None, 0


@pytest.mark.mpi
@budget(2)
@given(mpi_jobs(ps_configs))
@example((4, [sync_config(2, 3, "adamw"), sync_config(1, 2), sync_config(3, 2)]))
def test_under_mpiexec_sync_equals_single_process(job):
    world, cfgs = job
    runs = [dict(cfg, mode="sync") for cfg in cfgs]
    for cfg, out in zip(cfgs, run_each(ps_rank, world, runs, timeout=90)):
        check_sync(cfg, out, world)


@pytest.mark.mpi
def test_under_mpiexec_async_k0_staleness_bound_and_a_lost_worker():
    runs = [dict(steps=4, n_servers=2, mode="async", staleness=0, seed=5),
            dict(steps=8, n_servers=1, mode="async", staleness=2, slow={1: 0.01}),
            # silence_timeout 2 s: processes started on a loaded machine can send their first gradient
            # 0.5 s apart (seen: a live worker declared silent at 0.5 s with two other test runs beside)
            dict(steps=6, n_servers=1, mode="async", staleness=1, stop_at={3: 2}, silence_timeout=2.0)]
    asyn, stale, lost = run_each(ps_rank, 4, runs, timeout=90)
    assert_close_state(ps.merge([r for r, _ in asyn])[0], single_process(4, 5, "sgd")[1])  # k = 0: sync
    assert set(lead_over_slowest([e for _, e in asyn], 2)) == {0}
    assert 0 < max(lead_over_slowest([e for _, e in stale], 1)) <= 2  # one clock: same machine
    assert lost[0][0].dropped == [3] and [len(r.losses) for r, _ in lost[1:]] == [6, 6, 2]


@pytest.mark.mpi
def test_under_mpiexec_sync_fails_naming_the_lost_worker():
    with pytest.raises(HarnessError, match="worker rank 2 sent no gradient for step 1"):
        run_each(ps_rank, 3, [dict(steps=3, n_servers=1, mode="sync", stop_at={2: 1}, silence_timeout=2.0)],
                 timeout=60)


@pytest.mark.parametrize("opt, state_copies", [("sgd", 0), ("adamw", 2)])
def test_memory_servers_hold_their_shard_workers_the_whole_model(opt, state_copies):
    steps, world, servers = 2, 4, 2
    out = minipar.launch(ps_rank, world, steps=steps, n_servers=servers, mode="sync", opt=opt)
    n, shard = N_BYTES, [1152, 1080]  # the split worked out in test_traffic_per_server_link_a_hub_not_a_ring
    for rank, (_, events) in enumerate(out):
        mem: dict[str, list[int]] = {}
        for e in events:
            if e.kind == "memory":
                mem.setdefault(e.name, []).append(e.nbytes)
        if rank < servers:  # its shard of the parameters, and the optimizer state for that shard only
            state = [state_copies * shard[rank]] * steps
            assert mem == {"parameters": [shard[rank]], "optimizer state": state}
        else:  # a full replica of the parameters and the gradients, no optimizer
            assert mem == {"parameters": [n], "gradients": [n] * steps}


def test_updates_group_a_servers_applied_gradients_by_worker_in_order():
    applied = [(1, 0, 0, 0), (2, 0, 0, 1), (1, 1, 1, 2), (3, 0, 0, 3), (1, 2, 2, 4), (2, 1, 1, 5)]
    assert ps.Result(rank=0, role="server", applied=applied).updates() == {1: [0, 1, 2], 2: [0, 1], 3: [0]}
    assert ps.Result(rank=1, role="worker").updates() == {}
