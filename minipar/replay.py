"""A trace re-timed on a modelled cluster: each rank's recorded work at its CPU time, its recorded
messages on alpha-beta links, in the order the run recorded them.

This is SimGrid's offline replay of MPI traces (Desprez, Markomanolis, Quinson & Suter 2011,
"Assessing the performance of MPI applications through time-independent trace replay"; Casanova et
al. 2014, "Versatile, scalable, and accurate simulation of distributed applications and platforms",
JPDC 74(10)) and what ASTRA-sim 2.0 does with Chakra execution traces (Won et al. 2023; Sridharan et
al. 2023): wall-clock time taken with more ranks than cores measures the scheduler; CPU time and the
recorded dependencies do not. ``replay(trace.load("run.json"), cluster_named("local"))``.

Each thread of each rank (``Event.thread``: its own, a communicator's worker) runs its recorded
events in the order they happened on it (docs/formulas.md, section 11, has the rules at length):

- a compute span lasts its CPU time (``c1 - c0``) less the CPU time of the communication recorded
  inside it (a wait, the gap between two steps of one collective call); a span without CPU times
  lasts its wall time (``meta["replay"]["spans_without_cpu"]``); time outside spans is free; with
  ``costs="median"`` (the default) the repeats of the same work (``median_scales``) all last the
  median of their CPU times, which time-sharing inflates span by span (``costs="cpu"``: each its own);
- a message of ``n`` bytes leaves when posted, once its sender's outgoing and its receiver's incoming
  port are free (one message at a time each way), and takes ``alpha + n beta`` of ``cluster.intra``
  (both ranks in one node of ``gpus_per_node``) or ``cluster.inter``; a send never blocks its rank;
- a receive, matched to its send as MPI matches them (``cid``, ``tag``, source, destination, in
  posting order), completes when its rank waits for it (``tw``; never waited: where ``test()`` found
  it) and the data has arrived, plus ``n gamma`` where the collective reduces what it receives;
- a native collective starts when the last rank of its group enters it and lasts ``collective_time``
  of the algorithm minipar writes by hand for it (``NATIVE_AS``);
- a non-blocking collective's job starts on its worker thread when posted and after the worker's
  previous job; the caller's wait ends when the job has;
- memory samples, marks and transfers keep their place between their thread's neighbours, by
  wall-clock fraction;
- with ``host=True`` the ranks replay as this machine ran them: a thread's CPU time outside spans
  and waits is compute too (the collectives' worker's posting, testing and adding), and all threads
  of a rank share its one core, first come first served (the worker then delays the compute it
  overlaps, as it does here; without it the worker is a GPU's communication engine).

The result has the trace format, ``meta["clock"] = "replay"`` and ``meta["cluster"]``, so every viewer
reads it. Only the viewer, the lessons and the CLI import this module. Cost: O(E log E), E events.
"""

from __future__ import annotations

import bisect
import heapq
import os
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from minipar.cost.cluster import Cluster, Link
from minipar.cost.collectives import collective_time
from minipar.cost.presets import NETWORKS
from minipar.replay_program import (
    ReplayError,
    coll_key,
    group_sizes,
    is_message,
    match_receives,
    points,
    program,
    reduces,
)
from minipar.span_costs import COSTS, median_scales
from minipar.trace import Event, Trace, has_cpu_times

NATIVE_AS = {"allreduce": "ring", "reduce_scatter": "ring", "allgather": "ring", "broadcast": "tree",
             "reduce": "tree", "all_to_all": "pairwise", "barrier": "dissemination"}
PRESETS: dict[str, Cluster] = NETWORKS  # local, nvlink, infiniband, a100-selene (minipar.cost.presets)


def cluster_named(spec: str) -> Cluster:
    """A preset (``PRESETS``) by name, else the cluster file at path ``spec`` (``minipar calibrate``)."""
    if spec in PRESETS:
        return PRESETS[spec]
    if not os.path.exists(spec) and not spec.endswith(".json"):
        raise ReplayError(f"no cluster preset {spec!r}; choose one of {', '.join(PRESETS)} or give a cluster file")
    try:
        return Cluster.load(spec)
    except OSError as exc:
        raise ReplayError(f"cannot read cluster file {spec}: {exc.strerror or exc}") from None
    except (ValueError, KeyError, TypeError) as exc:
        raise ReplayError(str(exc).splitlines()[0]) from None


def check_replayable(trace: Trace) -> None:
    """``ReplayError`` in one line unless ``trace`` carries what a replay needs."""
    if trace.version < 2:
        raise ReplayError(f"trace format version {trace.version} has no CPU times, so it cannot be replayed; "
                          "record it again with this minipar")
    if trace.meta.get("clock") == "replay":
        raise ReplayError(f"this trace is already a replay (on {trace.meta.get('cluster')}); replay the recorded one")
    if trace.meta.get("lost_ranks"):
        raise ReplayError(f"the trace lost ranks {trace.meta['lost_ranks']}: their last messages are missing, "
                          "and a replay needs every message; view it with --clock wall")
    if not has_cpu_times(trace):
        raise ReplayError(f"the trace has no CPU times (backend {trace.meta.get('backend', 'unknown')}: "
                          "only a recorded run has them); nothing to replay")


def replay(trace: Trace, cluster: Cluster, costs: str = "median", samples: Sequence[Trace] = (),
           host: bool = False) -> Trace:
    """``trace`` re-timed on ``cluster`` (module docstring); ``ReplayError`` if it cannot be.
    ``costs``: ``"median"`` (the default), every repeat of the same work (``median_scales``, pooled
    with the spans of ``samples``: ``earlier_steps``) lasts the median of their CPU times; ``"cpu"``,
    each span its own CPU time. ``host``: the rank as this machine ran it, all its threads on its one
    core and their CPU time outside spans charged too (the non-blocking collectives' worker's
    posting, testing and adding: LogP's overhead o, Culler et al. 1993); by default only spans take
    a core's time and every thread has its own, as a GPU's communication engine beside its compute."""
    if costs not in COSTS:
        raise ReplayError(f"costs={costs!r}: choose one of {', '.join(COSTS)}")
    check_replayable(trace)
    events = trace.events
    stats = {"spans_without_cpu": 0}
    scale = median_scales(events, samples) if costs == "median" else {}
    lanes = {k: program(events, pts, stats, scale, host) for k, pts in sorted(points(events).items())}
    match, sizes = match_receives(events), group_sizes(events)
    sim = _Sim(events, lanes, match, sizes, cluster, host)
    sim.run()
    meta = {**trace.meta, "clock": "replay", "cluster": cluster.name,
            "replay": {"from_clock": trace.meta.get("clock", "wall"), "cluster_source": cluster.source, **stats,
                       "costs": costs, "samples": len(samples) if costs == "median" else 0, "host": host,
                       "label": f"replayed: one core per rank, network {cluster.name}"
                       + (", span costs: own CPU time" if costs == "cpu" else "")
                       + (", every thread's CPU on it" if host else "")}}
    return Trace(meta, sim.retimed(), trace.version)


class _Sim:
    """The discrete-event replay: every thread is a lane with a clock; the lane with the earliest
    clock runs its next op, so messages take the ports in the order of their posting times."""

    def __init__(self, events: list[Event], lanes: dict[tuple[int, int], list[tuple[str, Any]]],
                 match: dict[int, int], sizes: dict[tuple[Any, int], int], cluster: Cluster,
                 host: bool = False) -> None:
        self.events, self.lanes, self.match, self.sizes, self.cluster = events, lanes, match, sizes, cluster
        self.host = host
        self.core: dict[int, float] = defaultdict(float)  # rank -> its one core free at (host)
        self.clock = dict.fromkeys(lanes, 0.0)
        self.pc = dict.fromkeys(lanes, 0)
        self.reached: dict[tuple[int, str], float] = {}  # (event, what) -> replay time reached
        self.left: dict[tuple[int, str], float] = {}  # (event, what) -> replay time left (after a block)
        self.arrival: dict[int, float] = {}  # send event -> arrival of its data
        self.free: dict[tuple[str, int], float] = defaultdict(float)  # ("out"|"in", rank) -> port free at
        self.blocked: dict[Any, list[tuple[int, int]]] = defaultdict(list)
        self.async_at: dict[tuple[int, str, int, str], float] = {}  # (rank, cid, job, mark) -> time
        seen: dict[tuple[Any, ...], int] = defaultdict(int)
        self.native_of: dict[int, tuple[Any, ...]] = {}  # native event -> (cid, group, ordinal)
        self.native_in: dict[tuple[Any, ...], dict[int, float]] = defaultdict(dict)
        self.native_end: dict[tuple[Any, ...], float] = {}
        self.native_bytes: dict[tuple[Any, ...], list[int]] = defaultdict(list)
        for i in (p.i for ops in lanes.values() for what, p in ops if what == "native"):
            e = events[i]  # each rank's k-th native call on a group meets the others' k-th
            mine = (e.rank, e.cid, tuple(e.args.get("group", ())))
            self.native_of[i] = key = (*mine[1:], seen[mine])
            seen[mine] += 1
            self.native_bytes[key].append(e.nbytes or 0)

    def link(self, a: int, b: int) -> Link:
        g = self.cluster.gpus_per_node
        return self.cluster.intra if a // g == b // g else self.cluster.inter

    def run(self) -> None:
        heap = [(0.0, n, lane) for n, lane in enumerate(self.lanes)]
        seq = len(heap)
        while heap:
            _, _, lane = heapq.heappop(heap)
            woken = self.step(lane)
            if woken is None:
                continue  # blocked: a later event pushes it again
            for w in woken:
                seq += 1
                heapq.heappush(heap, (self.clock[w], seq, w))
        stuck = [lane for lane in self.lanes if self.pc[lane] < len(self.lanes[lane])]
        if stuck:
            where = "; ".join(self._where(lane) for lane in stuck[:3])
            more = f" (and {len(stuck) - 3} more)" if len(stuck) > 3 else ""
            raise ReplayError(f"the replay cannot go on: {where}{more}")

    def _where(self, lane: tuple[int, int]) -> str:
        what, p = self.lanes[lane][self.pc[lane]]
        e = self.events[p.i]
        return f"rank {lane[0]} thread {lane[1]} waits at {what} ({e.kind} {e.name} {e.op or ''})"

    def _block(self, key: Any, lane: tuple[int, int]) -> None:
        self.blocked[key].append(lane)

    def _wake(self, key: Any) -> list[tuple[int, int]]:
        return self.blocked.pop(key, [])

    def step(self, lane: tuple[int, int]) -> list[tuple[int, int]] | None:
        """Run ``lane``'s next op: the lanes to schedule next (itself first), or None if it blocked."""
        ops, k = self.lanes[lane], self.pc[lane]
        if k >= len(ops):
            return []
        what, arg = ops[k]
        t = self.clock[lane]
        woken: list[tuple[int, int]] = []
        if what == "compute":
            if self.host:  # the rank's threads share its core: the first to come runs
                t = self.core[lane[0]] = max(t, self.core[lane[0]]) + arg
            else:
                t += arg
            self.clock[lane] = t
        elif what != "anchor":
            e = self.events[arg.i]
            self.reached.setdefault((arg.i, what), t)
            if what == "post" and e.rank == e.src:
                start = max(t, self.free[("out", e.src)], self.free[("in", e.dst)])  # type: ignore[index]
                end = start + self.link(e.src, e.dst).seconds(e.nbytes or 0)  # type: ignore[arg-type]
                self.free[("out", e.src)] = self.free[("in", e.dst)] = end  # type: ignore[index]
                self.arrival[arg.i] = end
                woken = self._wake(("msg", arg.i))
            elif what == "wait" and e.rank == e.dst:
                sent = self.match.get(arg.i)
                if sent not in self.arrival:
                    self._block(("msg", sent), lane)
                    return None
                t = max(t, self.arrival[sent])
                if coll_key(e) and not self.host \
                        and reduces(e.op, e.algorithm, e.step, self.sizes.get((e.cid, e.rank), 1)):  # host: in CPU
                    t += (e.nbytes or 0) * self.cluster.gamma
            elif what == "native":
                t, woken = self._native(arg.i, lane, t)
                if t is None:
                    return None
            elif what == "op":
                t, woken = self._async(e, lane, t)
                if t is None:
                    return None
            self.clock[lane] = t
            self.left[(arg.i, what)] = t
        self.pc[lane] = k + 1
        return [lane, *woken]

    def _native(self, i: int, lane: tuple[int, int], t: float) -> tuple[Any, list[tuple[int, int]]]:
        key = self.native_of[i]
        if key in self.native_end:
            return max(t, self.native_end[key]), []
        self.native_in[key][lane[0]] = t
        members = self.native_in[key]
        group = key[1] or (lane[0],)
        if len(members) < len(group):
            self._block(("native", key), lane)
            return None, []
        e, p = self.events[i], len(group)
        sizes = self.native_bytes[key]
        n = sum(sizes) if e.op == "allgather" else max(sizes)
        nodes = {r // self.cluster.gpus_per_node for r in group}
        link = self.cluster.intra if len(nodes) == 1 else self.cluster.inter
        alg = NATIVE_AS.get(str(e.op), "ring")
        cost = collective_time(str(e.op), alg, n, p, link.alpha, link.beta, self.cluster.gamma)
        self.native_end[key] = end = max(members.values()) + cost
        return end, self._wake(("native", key))

    def _async(self, e: Event, lane: tuple[int, int], t: float) -> tuple[Any, list[tuple[int, int]]]:
        job = (e.rank, e.args.get("cid"), e.args.get("job"))
        need = {"async start": "async posted", "async wait": "async end"}.get(e.name)
        if need is None:  # posted, end: a time the other thread waits for
            self.async_at[(*job, e.name)] = t
            return t, self._wake((*job, e.name))
        if (*job, need) not in self.async_at:
            self._block((*job, need), lane)
            return None, []
        return max(t, self.async_at[(*job, need)]), []

    def retimed(self) -> list[Event]:
        """The events with their replay times (anchors placed between their thread's neighbours)."""
        out = list(self.events)
        timed = {lane: [(p.wall, self.reached[(p.i, w)], self.left[(p.i, w)]) for w, p in ops
                        if w not in ("compute", "anchor")] for lane, ops in self.lanes.items()}
        for lane, ops in self.lanes.items():
            mine = timed[lane] or timed.get((lane[0], 0), [])  # a thread of anchors alone: the rank's own
            walls = [w for w, _, _ in mine]
            for what, p in ops:
                if what == "anchor":
                    t, e = _between(mine, walls, p.wall), self.events[p.i]
                    if p.what == "anchor1":
                        out[p.i] = replace(out[p.i], t1=t)
                    else:
                        out[p.i] = replace(out[p.i], t0=t, t1=t if e.t1 == e.t0 else e.t1)
        for i, e in enumerate(out):
            if e.kind == "compute":
                out[i] = replace(e, t0=self.reached[(i, "begin")], t1=self.reached[(i, "end")])
            elif is_message(e):
                t1 = self.arrival[i] if e.rank == e.src else self.left[(i, "wait")]
                out[i] = replace(e, t0=self.reached[(i, "post")], t1=t1, tw=self.reached.get((i, "wait")))
            elif (i, "native") in self.reached:
                out[i] = replace(e, t0=self.reached[(i, "native")], t1=self.left[(i, "native")])
            elif (i, "op") in self.reached:  # a job's start when it started, the others when reached
                t = (self.left if e.name == "async start" else self.reached)[(i, "op")]
                out[i] = replace(e, t0=t, t1=t)
        return out


def _between(timed: list[tuple[float, float, float]], walls: list[float], wall: float) -> float:
    """Replay time of a wall time on a thread: between its neighbouring points, by wall fraction."""
    k = bisect.bisect_right(walls, wall)
    if not timed:
        return 0.0
    if k == 0:
        return timed[0][1]
    if k == len(timed):
        return timed[-1][2]
    (w0, _, t0), (w1, t1, _) = timed[k - 1], timed[k]
    return t0 if w1 <= w0 else t0 + (t1 - t0) * (wall - w0) / (w1 - w0)

