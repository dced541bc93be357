"""The parameter server: DistBelief (Dean et al., NeurIPS 2012) and Li et al. (OSDI 2014), with
stale-synchronous parallel consistency (SSP; Ho et al., NeurIPS 2013).

Ranks ``0..S-1`` are SERVERS, ranks ``S..N-1`` the ``W = N - S`` WORKERS. The parameters are
sharded across the servers by whole parameter (Li et al. sec. 3: key ranges; here
``assign_parameters``: largest first, each to the least-loaded server). Every step a worker
PULLS the current values of every server's shard, computes the gradient of its shard of the
global batch, and PUSHES each server the gradient of that server's shard. No message is a
collective: every byte is a point-to-point message on a server link, op "pull" or "push".

Consistency (Li et al. sec. 4.1, "flexible consistency"; Ho et al. for the bound):
- ``mode="sync"`` (bulk synchronous): a server waits for all ``W`` pushes of a step, applies their
  average with the optimizer, then answers the pulls of the next step. Every worker computes step
  ``c`` from the same parameters, so the run equals one process on the global batch.
- ``mode="async"`` with staleness bound ``k``: a server applies each push on arrival (the gradient
  times ``1/W_live``, so ``W`` pushes add up to one averaged step), and answers a worker's pull for
  its step ``c`` as soon as ``version >= c - k``, where the server's ``version`` is the number of
  steps every live worker has pushed (the slowest worker's clock). A worker therefore runs at most
  ``k`` steps ahead of the slowest. For ``k = 0`` and SGD (an update linear in the gradient) this
  equals sync mode up to rounding.
- Each applied gradient leaves a trace mark "apply" with ``worker`` (world rank), ``step`` (the
  worker's clock ``c``), ``computed_from`` (the version its parameters had when pulled),
  ``applied_at`` (the version when applied) and ``staleness = step - computed_from`` (how many
  steps of the slowest worker's updates it missed; ``<= k``, and 0 in sync mode).

Failures (Li et al. sec. 4.3, but for workers only): a server that has answered a worker's pull
and hears no push from it within ``silence_timeout`` seconds declares it lost, and a worker whose
process died (the failure detector, ``minipar.comm.detector``, declared it dead) is lost at once.
A lost worker's pushes not yet received are never applied (a message is applied whole or not at
all); in sync mode with several servers, the servers agree on every step's contributors
(``allgather_object`` among servers) so a worker killed between its pushes to two servers counts on
none. Async with several servers has no such agreement: each server drops the worker when its own
detector declares it (the ``1/W_live`` scaling of the others' pushes may switch at slightly
different moments on different servers), and a worker killed between its pushes leaves its last
step applied to some servers' shards only (each shard's update whole); ``applied`` says which.
Async: the worker is dropped (mark "worker dropped"), the version and averages use the live
workers only, training goes on. Sync: ``WorkerLost`` names the worker (a synchronous step cannot
complete without it) and the run never hangs; or, with ``shrink=True``, the step completes with the
others and training goes on. ``stop_at={rank: c}`` simulates a pre-empted worker: it pulls step
``c`` and then sends nothing more (its process stays alive only to join the final trace/result
collection); ``die_at={rank: c}`` kills it for real (``minipar.comm.faults.kill``).

Servers poll their posted receives with ``Request.test()`` and take pushes in arrival order (every
poll sweep handles all that have arrived); the pushes carry no header beyond the array: a server
knows which step a worker is on from the count of its pushes.

Costs per step, ``n`` parameter bytes, server ``s`` owning ``n_s``: every link (s, w) carries
``n_s`` bytes each way (pull, push); a server sends and receives ``W n_s`` (with one server:
``W n``, the hub's hot link) while a ring all-reduce moves ``2(p-1)/p n`` per rank, evenly.
Memory (trace samples "parameters", "gradients", "optimizer state"): server ``s`` holds ``n_s`` of
parameters and its optimizer's state for them (SGD without momentum: none; Adam: ``2 n_s``); a
worker holds the full ``n`` of parameters and ``n`` of gradients, and no optimizer state.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from minipar import trace
from minipar.comm import faults
from minipar.comm.errors import PeerLost
from minipar.cost import data as cost
from minipar.datasets import shard
from minipar.nn import Module, Parameter
from minipar.optim import SGD, Optimizer

MODES = ("sync", "async")
TAG_PULL, TAG_PUSH = 1, 2


class WorkerLost(PeerLost):
    """Synchronous parameter-server training lost a worker: it stopped pushing gradients, or it died
    (``.rank``: its world rank)."""


def assign_parameters(nbytes: Sequence[int], n_servers: int) -> list[int]:
    """Server of each parameter: largest first, each to the server holding the fewest bytes so far
    (ties: lower parameter index first, then lower server). Balanced within one parameter's size."""
    load = [0] * n_servers
    owner = [0] * len(nbytes)
    for i in sorted(range(len(nbytes)), key=lambda i: (-nbytes[i], i)):
        s = min(range(n_servers), key=lambda s: (load[s], s))
        owner[i] = s
        load[s] += nbytes[i]
    return owner


@dataclass
class Result:
    """What one rank returns. Workers: ``losses`` (shard loss per step run). Servers: ``params``
    (final values of the parameters they own), ``applied`` ((worker, step, computed_from,
    applied_at) per applied gradient), ``dropped`` (worker ranks declared lost); ranks are ``comm``'s
    (trace marks: world ranks)."""

    rank: int
    role: str
    losses: list[float] = field(default_factory=list)
    params: dict[str, np.ndarray] = field(default_factory=dict)
    applied: list[tuple[int, int, int, int]] = field(default_factory=list)
    dropped: list[int] = field(default_factory=list)

    def updates(self) -> dict[int, list[int]]:
        """A server's ``applied`` by worker: the steps of each worker's gradients it applied, in order of
        application (``[0, 1, ..., s - 1]`` for a worker whose s pushes were each applied once)."""
        steps: dict[int, list[int]] = {}
        for worker, step, _, _ in self.applied:
            steps.setdefault(worker, []).append(step)
        return steps


class Layout:
    """Who owns what: servers, workers, and each server's parameters (in model order)."""

    def __init__(self, model: Module, world_size: int, n_servers: int) -> None:
        self.named = list(model.named_parameters())
        self.servers = list(range(n_servers))
        self.workers = list(range(n_servers, world_size))
        owner = assign_parameters([p.data.nbytes for _, p in self.named], n_servers)
        self.owned = [[i for i, o in enumerate(owner) if o == s] for s in self.servers]

    def shard_bytes(self, s: int) -> int:
        return sum(self.named[i][1].data.nbytes for i in self.owned[s])

    def shard_sizes(self) -> list[int]:
        """Bytes each server owns, by server."""
        return [self.shard_bytes(s) for s in self.servers]

    def flat(self, s: int, attr: str) -> np.ndarray:
        return np.concatenate([getattr(self.named[i][1], attr).reshape(-1) for i in self.owned[s]])

    def unflatten(self, s: int, flat: np.ndarray, attr: str) -> None:
        off = 0
        for i in self.owned[s]:
            p = self.named[i][1]
            part = flat[off:off + p.data.size].reshape(p.data.shape)
            off += p.data.size
            if attr == "grad":
                p.grad = part
            else:
                p.data[...] = part


def link_bytes(model: Module, world_size: int, n_servers: int, steps: int) -> dict[tuple[int, int], int]:
    """Payload bytes per directed link ``(src, dst)`` over ``steps`` steps with no failure, for this
    model's layout (``minipar.cost.data.ps_link_bytes``)."""
    return cost.ps_link_bytes(Layout(model, world_size, n_servers).shard_sizes(), world_size, steps)


def run_meta(model: Module, world_size: int, n_servers: int, steps: int, mode: str,
             staleness: int = 0) -> dict[str, Any]:
    """Trace metadata of a run: config and ``expected_bytes`` (pull: per server, the mean over
    servers; push: per worker) plus the exact ``expected_bytes_by_rank`` (``cost.data.ps_bytes``)."""
    lay = Layout(model, world_size, n_servers)
    n_w = len(lay.workers)
    by_rank = cost.ps_bytes(lay.shard_sizes(), world_size, steps)
    label = f"async, k={staleness}" if mode == "async" else "sync"
    return {"paradigm": f"parameter server ({label})",
            "mode": mode, "staleness": staleness, "servers": n_servers, "workers": n_w, "steps": steps,
            "expected_bytes": {"pull": sum(by_rank["pull"]) / n_servers, "push": sum(by_rank["push"]) / n_w},
            "expected_bytes_by_rank": by_rank}


def check_ps_config(comm: Any, model: Module, batch_fn: Callable[[int], tuple[np.ndarray, np.ndarray]],
                 steps: int, n_servers: int, mode: str, staleness: int, silence_timeout: float,
                 stop_at: dict[int, int], slow: dict[int, float]) -> None:
    """Reject a bad configuration with the same ``ValueError`` on every rank, before any message."""
    size = comm.size
    if mode not in MODES:
        raise ValueError(f"parameter server: mode must be one of {MODES}, got {mode!r}")
    if not isinstance(staleness, int) or staleness < 0:
        raise ValueError(f"parameter server: staleness must be an int >= 0, got {staleness!r}")
    if mode == "sync" and staleness:
        raise ValueError("parameter server: staleness applies to mode='async' (sync is staleness 0)")
    if not isinstance(n_servers, int) or not 1 <= n_servers < size:
        raise ValueError(f"parameter server: n_servers={n_servers!r} with world size {size} leaves no "
                         f"worker; need 1 <= n_servers < {size}")
    if not isinstance(steps, int) or steps < 1:
        raise ValueError(f"parameter server: steps must be an int >= 1, got {steps!r}")
    params = model.parameters()
    if len(params) < n_servers:
        raise ValueError(f"parameter server: {n_servers} servers but only {len(params)} parameters to shard "
                         "by parameter; use fewer servers")
    if len({p.data.dtype for p in params}) != 1:
        raise ValueError("parameter server: the model's parameters must share one dtype (flat messages)")
    n_w = size - n_servers
    x, y = batch_fn(0)
    if x.shape[0] % n_w or y.shape[0] != x.shape[0]:
        raise ValueError(f"parameter server: global batch of {x.shape[0]} samples (targets {y.shape[0]}) "
                         f"does not divide over {n_w} workers; make it a multiple of {n_w}")
    if not 0 < silence_timeout < comm.timeout:
        raise ValueError(f"parameter server: silence_timeout={silence_timeout} must be > 0 and below the "
                         f"communication timeout ({comm.timeout} s), or waiting workers would time out first")
    for name, table in (("stop_at", stop_at), ("slow", slow)):
        bad = [r for r in table if not n_servers <= r < size]
        if bad:
            raise ValueError(f"parameter server: {name} names ranks {bad} that are not workers "
                             f"({n_servers}..{size - 1})")


def train(comm: Any, model: Module, loss_fn: Callable[[Module, np.ndarray, np.ndarray], Any],
          batch_fn: Callable[[int], tuple[np.ndarray, np.ndarray]], steps: int, *, n_servers: int = 1,
          mode: str = "sync", staleness: int = 0,
          optimizer: Callable[[list[Parameter]], Optimizer] = lambda ps: SGD(ps, lr=0.1),
          silence_timeout: float = 10.0, stop_at: dict[int, int] | None = None,
          slow: dict[int, float] | None = None, shrink: bool = False,
          die_at: dict[int, int] | None = None) -> Result:
    """Run parameter-server training on every rank of ``comm`` (call on all ranks).

    ``model``: the same model on every rank (servers keep their shard's values, workers pull before
    each step); ``loss_fn(model, x, y)`` -> scalar Tensor; ``batch_fn(step)`` -> the GLOBAL batch
    ``(x, y)``, worker ``w`` (0-based) uses its ``shard``; ``optimizer(params)`` builds a server's
    optimizer for the parameters it owns; ``slow={rank: seconds}`` adds compute time to a worker's
    steps (a straggler); ``stop_at={rank: step}`` silences a worker (see the module docstring);
    ``die_at={rank: step}`` kills a worker (``faults.kill``) at that step, after its push reached
    the first server only; ``shrink``: sync mode goes on without a dead worker instead of stopping.
    """
    stop_at, slow, die_at = dict(stop_at or {}), dict(slow or {}), dict(die_at or {})
    check_ps_config(comm, model, batch_fn, steps, n_servers, mode, staleness, silence_timeout,
                    {**stop_at, **die_at}, slow)
    lay = Layout(model, comm.size, n_servers)
    state = comm.state
    fail_fast, state.fail_fast = state.fail_fast, not (mode == "async" or shrink)
    try:
        # sync with several servers: they agree on each step's contributors (a worker may die between pushes)
        servers = comm.split(int(comm.rank >= n_servers)) if mode == "sync" and n_servers > 1 else None
        if comm.rank < n_servers:
            return _serve(comm, lay, optimizer, steps, mode, staleness, silence_timeout, shrink, servers)
        return _work(comm, lay, model, loss_fn, batch_fn, steps, stop_at.get(comm.rank), slow.get(comm.rank, 0.0),
                     die_at.get(comm.rank))
    finally:
        state.fail_fast = fail_fast


def _work(comm: Any, lay: Layout, model: Module, loss_fn: Callable[..., Any],
          batch_fn: Callable[[int], tuple[np.ndarray, np.ndarray]], steps: int, stop: int | None,
          slow: float, die: int | None = None) -> Result:
    out = Result(comm.rank, "worker")
    w, n_w = comm.rank - len(lay.servers), len(lay.workers)
    trace.memory("parameters", sum(p.data.nbytes for _, p in lay.named))
    for c in range(steps):
        pulls = [comm.irecv(s, TAG_PULL, op="pull", step=c) for s in lay.servers]
        for s, req in zip(lay.servers, pulls):
            lay.unflatten(s, req.wait(), "data")
        if stop == c:
            trace.mark("worker stops", worker=comm.rank, step=c)
            return out
        x, y = batch_fn(c)
        with trace.span("F", step=c):
            if slow:
                trace.compute_sleep(slow)  # slept, yet charged as compute: a replay keeps the straggler
            loss = loss_fn(model, shard(x, w, n_w), shard(y, w, n_w))
        model.zero_grad()
        with trace.span("B", step=c):
            loss.backward()
        trace.memory("gradients", sum(p.grad.nbytes for _, p in lay.named))
        if die == c:  # pre-empted mid-push: the first server gets this step's gradient, the others not
            if len(lay.servers) > 1:
                comm.send(lay.flat(lay.servers[0], "grad"), lay.servers[0], TAG_PUSH, op="push", step=c)
            faults.kill(comm)
        pushes = [comm.isend(lay.flat(s, "grad"), s, TAG_PUSH, op="push", step=c) for s in lay.servers]
        for req in pushes:
            req.wait()
        out.losses.append(float(loss.data))
    return out


def _serve(comm: Any, lay: Layout, optimizer: Callable[[list[Parameter]], Optimizer], steps: int, mode: str,
           k: int, silence_timeout: float, shrink: bool = False, servers: Any = None) -> Result:
    s = comm.rank
    world = list(comm.group_ranks)  # communicator rank -> world rank (the detector and trace marks speak world)
    out = Result(s, "server")
    opt = optimizer([lay.named[i][1] for i in lay.owned[s]])
    trace.memory("parameters", lay.shard_bytes(s))
    clock = dict.fromkeys(lay.workers, 0)  # pushes received from each worker
    live = set(lay.workers)
    asked = set(lay.workers)  # workers waiting for the pull of their step clock[w]
    pulled_at: dict[int, tuple[int, float]] = {}  # worker -> (version sent, when)
    round_grads: dict[int, np.ndarray] = {}  # sync: this step's pushes, by worker
    recvs = {w: comm.irecv(w, TAG_PUSH, op="push", step=0) for w in lay.workers}
    sends: list[tuple[int, Any]] = []

    def version() -> int:
        return min((clock[w] for w in live), default=steps)

    def apply(grad: np.ndarray) -> None:
        with trace.span("opt"):
            lay.unflatten(s, grad, "grad")
            opt.step()
        trace.memory("optimizer state", opt.state_bytes())

    def record(w: int, c: int, v_at: int) -> None:
        v_from = pulled_at[w][0]
        trace.mark("apply", worker=world[w], step=c, computed_from=v_from, applied_at=v_at, staleness=c - v_from)
        out.applied.append((w, c, v_from, v_at))

    def answer_pulls() -> None:
        v = version()
        for w in sorted(asked & live):
            if clock[w] < steps and v >= clock[w] - k:
                sends.append((w, comm.isend(lay.flat(s, "data"), w, TAG_PULL, op="pull", step=clock[w])))
                asked.discard(w)
                pulled_at[w] = (v, time.monotonic())

    def on_push(w: int, grad: np.ndarray) -> None:
        if mode == "async":
            record(w, clock[w], version())
            apply(grad / len(live))
        else:
            round_grads[w] = grad
        clock[w] += 1
        asked.add(w)
        if clock[w] < steps:
            recvs[w] = comm.irecv(w, TAG_PUSH, op="push", step=clock[w])
        else:
            del recvs[w]
        if mode == "sync" and len(round_grads) == len(live):  # every push of this step is in
            finish_round()

    def lose(w: int, why: str, **args: Any) -> None:
        """Drop worker ``w``: its pushes not yet received are never applied; in sync mode its push of the
        unfinished step is discarded whole, and the step completes with the others."""
        live.discard(w)
        out.dropped.append(w)
        round_grads.pop(w, None)
        trace.mark("worker dropped", worker=world[w], step=clock[w], reason=why, **args)
        if mode == "sync" and round_grads and len(round_grads) == len(live):
            finish_round()
        answer_pulls()  # the slowest clock may have moved

    def finish_round() -> None:
        c = min(clock[u] for u in round_grads) - 1
        if servers is not None:  # a worker killed between its pushes reached some servers only: count it nowhere
            agreed = set.intersection(*map(set, servers.allgather_object(sorted(round_grads))))
            for u in sorted(set(round_grads) - agreed):
                del round_grads[u]
                live.discard(u)
                out.dropped.append(u)
                trace.mark("worker dropped", worker=world[u], step=c, reason="lost by another server")
        for u in sorted(round_grads):
            record(u, c, c)
        apply(sum(round_grads[u] for u in sorted(round_grads)) / len(round_grads))
        round_grads.clear()

    det = comm.state.detector
    answer_pulls()
    delay = 0.0
    while any(clock[w] < steps for w in live):
        if det is not None and det.dead:  # det.dead holds WORLD ranks; live, lay.* are communicator ranks
            det.raise_if_lost(f"parameter server rank {s}: serving", [world[r] for r in lay.servers], False)
            for w in sorted(w for w in live if world[w] in det.dead):
                det.mark()
                silence = det.dead[world[w]][2]
                if mode == "sync" and not shrink:
                    err = WorkerLost(
                        f"parameter server rank {s} (sync): worker rank {w} died (world rank {world[w]}; no "
                        f"heartbeat for {silence:.2f} s) during step {clock[w]}; a synchronous step needs every "
                        "worker. Pass shrink=True to go on with the others, or use mode='async'")
                    err.rank, err.operation, err.declared_by = world[w], f"push of step {clock[w]}", comm.world_rank
                    raise err
                lose(w, "dead", silence=round(silence, 3))
        arrived = [w for w in sorted(recvs) if w in live and recvs[w].test()]
        for w in arrived:
            on_push(w, recvs[w].wait())
        if arrived:
            answer_pulls()
        now = time.monotonic()
        for w in sorted(live):
            if w not in asked and clock[w] < steps and now - pulled_at[w][1] > silence_timeout:
                if mode == "sync":
                    raise WorkerLost(
                        f"parameter server rank {s} (sync): worker rank {w} sent no gradient for step "
                        f"{clock[w]} within silence_timeout={silence_timeout} s; a synchronous step needs "
                        "every worker. Use mode='async' to go on without it, or raise silence_timeout if it "
                        "is only slow")
                lose(w, "silent", silence=round(now - pulled_at[w][1], 3))
        sends = [(w, r) for w, r in sends if not r.test()]
        if arrived:
            delay = 0.0
        else:  # back off, giving the core to the workers (20 us doubling up to 1 ms)
            delay = min(1e-3, max(2e-5, 2 * delay))
            time.sleep(delay)
    for w, req in sends:
        if w in live:
            req.wait()
    out.params = {lay.named[i][0]: lay.named[i][1].data.copy() for i in lay.owned[s]}
    return out


def merge(results: Sequence[Result]) -> tuple[dict[str, np.ndarray], list[float]]:
    """The full final ``state_dict`` (from the servers) and the loss per step: the mean over the
    workers that ran that step (in sync mode, the global-batch loss)."""
    state = {k: v for r in results if r.role == "server" for k, v in r.params.items()}
    workers = [r.losses for r in results if r.role == "worker"]
    steps = max((len(ls) for ls in workers), default=0)
    losses = [float(np.mean([ls[c] for ls in workers if len(ls) > c])) for c in range(steps)]
    return state, losses
