"""Small hand-made traces for the viewer tests (times and bytes chosen so every number is known),
plus ``simulated``: a schedule played by minipar's pipeline simulator, as lesson 2 writes it.

``one_f_one_b()`` is the 1F1B schedule for p=2 stages and m=4 micro-batches with forward = 1 and
backward = 2 time units, written out by hand from PipeDream-Flush's rule (stage s runs p-1-s
warm-up forwards, then alternates one forward and one backward):

    rank 0: F0[0,1] F1[1,2] B0[4,6] F2[6,7] B1[7,9] F3[9,10] B2[10,12] B3[13,15]
    rank 1: F0[1,2] B0[2,4] F1[4,5] B1[5,7] F2[7,8] B2[8,10] F3[10,11] B3[11,13]

Makespan 15, each rank computes 12, so each idles 3 = (p-1)/(m+p-1) * 15.
"""

from __future__ import annotations

from minipar.parallel.pipeline import make_schedule, simulate
from minipar.trace import Event, Trace

ACT_BYTES = 1000  # activation sent forward per micro-batch
GRAD_BYTES = 600  # activation gradient sent backward per micro-batch

SCHEDULE_1F1B = {
    0: [("F", 0, 0, 1), ("F", 1, 1, 2), ("B", 0, 4, 6), ("F", 2, 6, 7), ("B", 1, 7, 9), ("F", 3, 9, 10),
        ("B", 2, 10, 12), ("B", 3, 13, 15)],
    1: [("F", 0, 1, 2), ("B", 0, 2, 4), ("F", 1, 4, 5), ("B", 1, 5, 7), ("F", 2, 7, 8), ("B", 2, 8, 10),
        ("F", 3, 10, 11), ("B", 3, 11, 13)],
}


def one_f_one_b(with_messages: bool = True, with_memory: bool = True) -> Trace:
    events: list[Event] = []
    for rank, spans in SCHEDULE_1F1B.items():
        stash = 0
        if with_memory:
            events.append(Event(rank, "memory", "parameters", 0.0, 0.0, nbytes=5000))
        for name, mb, t0, t1 in spans:
            events.append(Event(rank, "compute", name, float(t0), float(t1), stage=rank, microbatch=mb))
            if with_memory:
                stash += 1 if name == "F" else -1
                events.append(Event(rank, "memory", "activations", float(t1), float(t1), nbytes=stash * 100))
    if with_messages:
        for name, mb, _, t1 in SCHEDULE_1F1B[0]:
            if name == "F":  # activation 0 -> 1 when rank 0 finishes the forward
                for rank, direction in ((0, "send"), (1, "recv")):
                    events.append(Event(rank, "comm", direction, float(t1), float(t1), src=0, dst=1,
                                        nbytes=ACT_BYTES, op="send", microbatch=mb))
        for name, mb, _, t1 in SCHEDULE_1F1B[1]:
            if name == "B":  # gradient 1 -> 0 when rank 1 finishes the backward
                for rank, direction in ((1, "send"), (0, "recv")):
                    events.append(Event(rank, "comm", direction, float(t1), float(t1), src=1, dst=0,
                                        nbytes=GRAD_BYTES, op="send", microbatch=mb))
    meta = {"paradigm": "pipeline", "schedule": "1f1b", "p": 2, "m": 4, "v": 1, "world_size": 2,
            "backend": "hand-made", "time_unit": "units"}
    return Trace(meta, sorted(events, key=lambda e: (e.t0, e.rank)))


def ring_allreduce(p: int = 3, n: int = 3000) -> Trace:
    """Ring all-reduce of n bytes on p ranks: 2(p-1) steps, each rank sends n/p bytes to rank+1 per
    step, taking 1 ms per step; the formula's 2(p-1)/p * n bytes per rank is in the metadata."""
    events: list[Event] = []
    chunk = n // p
    for step in range(2 * (p - 1)):
        t0, t1 = step * 1e-3, (step + 1) * 1e-3
        for r in range(p):
            dst = (r + 1) % p
            events.append(Event(r, "comm", "send", t0, t1, src=r, dst=dst, nbytes=chunk, op="allreduce",
                                algorithm="ring", step=step))
            events.append(Event(dst, "comm", "recv", t0, t1, src=r, dst=dst, nbytes=chunk, op="allreduce",
                                algorithm="ring", step=step))
    for r in range(p):
        events.append(Event(r, "memory", "buffer", 0.0, 0.0, nbytes=n))
        events.append(Event(r, "compute", "opt", 2 * (p - 1) * 1e-3, 2 * (p - 1) * 1e-3 + 5e-4))
    meta = {"paradigm": "collectives", "world_size": p, "backend": "hand-made",
            "expected_bytes": {"allreduce/ring": 2 * (p - 1) / p * n}}
    return Trace(meta, sorted(events, key=lambda e: (e.t0, e.rank)))


def naive_allreduce(p: int = 3, n: int = 3000, t_start: float = 0.0) -> list[Event]:
    """Naive all-reduce of n bytes: step 0 every rank r > 0 sends n to rank 0, step 1 rank 0 sends
    n back to each; so rank 0 sends (p-1) n bytes and every other rank n (1 ms per step)."""
    events: list[Event] = []
    for step, pairs in enumerate(([(r, 0) for r in range(1, p)], [(0, r) for r in range(1, p)])):
        t0, t1 = t_start + step * 1e-3, t_start + (step + 1) * 1e-3
        for src, dst in pairs:
            for rank, name in ((src, "send"), (dst, "recv")):
                events.append(Event(rank, "comm", name, t0, t1, src=src, dst=dst, nbytes=n, op="allreduce",
                                    algorithm="naive", step=step))
    return events


def ring_and_naive(p: int = 3, n: int = 3000) -> Trace:
    """``ring_allreduce`` then ``naive_allreduce``: the ring's formula is one number (every rank sends
    2(p-1)/p n), the naive one's is per rank, ``[(p-1) n, n, ..., n]`` in ``expected_bytes_by_rank``."""
    ring = ring_allreduce(p, n)
    start = max(e.t1 for e in ring.events)
    meta = dict(ring.meta, expected_bytes_by_rank={"allreduce/naive": [(p - 1) * n] + [n] * (p - 1)})
    return Trace(meta, ring.events + naive_allreduce(p, n, start))


def ring_allreduce_twice(p: int = 4, n: int = 4000) -> Trace:
    """Two ring all-reduces back to back (the second starts when the first ends): two calls."""
    first = ring_allreduce(p, n)
    comm = [e for e in first.events if e.kind == "comm"]
    end = max(e.t1 for e in comm)
    second = [Event(e.rank, "comm", e.name, e.t0 + end, e.t1 + end, src=e.src, dst=e.dst, nbytes=e.nbytes,
                    op=e.op, algorithm=e.algorithm, step=e.step) for e in comm]
    return Trace(dict(first.meta), comm + second)


def simulated(kind: str = "1f1b", p: int = 4, m: int = 8, v: int = 1, forward: float | list[float] = 1.0,
              backward: float | list[float] = 2.0) -> Trace:
    """The simulator's trace of ``kind``, its schedule marked "(simulated)" as lesson 2 marks it."""
    trace = simulate(make_schedule(kind, p, m, v), forward=forward, backward=backward).trace
    trace.meta["schedule"] = f"{kind} (simulated)"
    return trace
