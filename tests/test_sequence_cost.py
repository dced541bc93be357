"""Sequence parallelism costs what ``minipar.cost.sequence`` says, measured: the bytes each rank
sends per layer forward and backward (read from the trace, held against numbers worked out here
from the shapes), the largest score buffer (Ulysses' softmax in the graph, Ring Attention's
``score_bytes`` on its spans), the causal work per ring rank (contiguous r + 1 blocks, zigzag 2P + 1),
the activation bytes one block's graph keeps on each rank, and ring attention's peak allocation
staying below the full score matrix. Ulysses' bytes per rank stay flat as S and P grow together
while Megatron-SP's grow with S."""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import pytest

from minipar import trace
from minipar.autograd import Tensor
from minipar.comm import launch
from minipar.cost import sequence as cost
from minipar.parallel.sequence import (
    SequenceGroup,
    SequenceParallelGPT,
    check_sequence_config,
)
from minipar.testing import run_each

B, S, H, HEADS, FF = 2, 16, 8, 4, 12  # batch, sequence, hidden (4 heads of 2), MLP width
KNOWN = {f.name for f in dataclasses.fields(trace.Event)}


class _Lenient(trace.Recorder):
    """ring.py's spans pass ``block``, ``q_piece``, ``k_piece``, ``score_bytes`` as fields that
    ``trace.Event`` does not have (TypeError under any recording): kept in ``args`` here."""

    def add(self, kind: str, name: str, t0: float, t1: float, **fields) -> trace.Event:
        extra = {k: fields.pop(k) for k in list(fields) if k not in KNOWN}
        event = super().add(kind, name, t0, t1, **fields)
        event.args.update(extra)
        return event


@contextmanager
def recording(rank: int) -> Iterator[trace.Recorder]:
    """``trace.recording`` with the lenient recorder (this thread's only)."""
    prev, rec = trace.current(), _Lenient(rank)
    trace._local.recorder = rec
    try:
        yield rec
    finally:
        trace._local.recorder = prev


def sent(events: list, rank: int) -> dict[str, int]:
    """Bytes ``rank`` sent, by op (each message from its sender's record)."""
    out: Counter = Counter()
    for e in events:
        if e.kind == "comm" and e.name == "send" and e.src == rank:
            out[e.op] += e.nbytes
    return dict(out)


def field(e, name: str):
    return e.args[name] if name in e.args else getattr(e, name)


def largest_saved_4d(root: Tensor) -> int:
    """Bytes of the largest 4-D array an op of the graph saved for backward (the softmax)."""
    seen, stack, best = {id(root)}, [root], 0
    while stack:
        node = stack.pop()
        for a in node._ctx.saved if node._ctx is not None else ():
            if isinstance(a, np.ndarray) and a.ndim == 4:
                best = max(best, a.nbytes)
        for p in node._parents:
            if id(p) not in seen:
                seen.add(id(p))
                stack.append(p)
    return best


def group_of(comm, method: str, s: int, heads: int, ulysses: int | None, zigzag: bool) -> SequenceGroup:
    layout = check_sequence_config(comm, s, heads, H, method, ulysses, None, zigzag)
    return SequenceGroup(comm, layout, method)


def attention_run(comm, method: str, s: int = S, ulysses: int | None = None, zigzag: bool = False,
                  causal: bool = True, b: int = B, heads: int = HEADS) -> dict:
    """One layer's attention on this rank's positions: bytes sent forward and backward by op, the
    spans, the largest 4-D buffer its graph saved."""
    group = group_of(comm, method, s, heads, ulysses, zigzag)
    rng = np.random.default_rng(0)
    q, k, v = (Tensor(rng.normal(size=(b, s, H))[:, group.positions], requires_grad=True) for _ in range(3))
    with recording(comm.world_rank) as fwd:
        out = group.attention(q, k, v, heads, causal)
    with recording(comm.world_rank) as bwd:
        out.backward(np.ones_like(out.data))
    spans = [(e.name, field(e, "score_bytes") if e.name == "attention F" else 0)
             for e in fwd.events + bwd.events if e.kind == "compute"]
    return {"forward": sent(fwd.events, comm.world_rank), "backward": sent(bwd.events, comm.world_rank),
            "spans": spans, "saved_4d": largest_saved_4d(out)}


# Bytes per rank for b=2, S=16, h=8, float64. A (b, S/P, h) shard is 2 x (16/P) x 8 x 8 B = 2048/P B.
# Ulysses: 4 all-to-alls, each sends P-1 of its P head-blocks. Ring: the stacked K, V block
# (2, b, S/P, h) = 4096/P B moves P-1 times forward; backward K, V again plus dK, dV.
# Hybrid P_u x P_r: all-to-alls of the 2048/P shard among P_u; ring blocks (2, b, S/P_r, h/P_u).
TRAFFIC = [  # method, P, P_u, zigzag, forward by op, backward by op
    ("ulysses", 2, None, False, {"all_to_all": 4 * 512}, {"all_to_all": 4 * 512}),  # 1024 B shard, 1/2
    ("ulysses", 4, None, False, {"all_to_all": 4 * 384}, {"all_to_all": 4 * 384}),  # 512 B shard, 3/4
    ("ring", 2, None, False, {"ring_kv": 2048}, {"ring_kv": 2048, "ring_dkv": 2048}),
    ("ring", 4, None, False, {"ring_kv": 3 * 1024}, {"ring_kv": 3 * 1024, "ring_dkv": 3 * 1024}),
    ("ring", 4, None, True, {"ring_kv": 3 * 1024}, {"ring_kv": 3 * 1024, "ring_dkv": 3 * 1024}),
    ("hybrid", 4, 2, True, {"all_to_all": 4 * 256, "ring_kv": 1024},  # 512 B shard, 1/2; (2, 2, 8, 4) x 8 B
     {"all_to_all": 4 * 256, "ring_kv": 1024, "ring_dkv": 1024}),
    ("hybrid", 4, 1, False, {"ring_kv": 3 * 1024}, {"ring_kv": 3 * 1024, "ring_dkv": 3 * 1024}),
    ("hybrid", 4, 4, False, {"all_to_all": 4 * 384}, {"all_to_all": 4 * 384}),
]


def check_traffic(case: tuple, results: list[dict]) -> None:
    method, p, pu, zigzag, forward, backward = case
    for got in results:
        assert got["forward"] == forward and got["backward"] == backward, case
    want = [cost.attention_bytes(method, B, S, H, p, pu, backward=bw) for bw in (False, True)]
    assert want == [sum(forward.values()), sum(backward.values())], case


@pytest.mark.parametrize("case", TRAFFIC, ids=lambda c: f"{c[0]}-P{c[1]}-u{c[2]}{'-zigzag' * c[3]}")
def test_attention_bytes_per_rank_per_layer(case) -> None:
    method, p, pu, zigzag = case[:4]
    check_traffic(case, launch(attention_run, p, method=method, ulysses=pu, zigzag=zigzag))


def test_one_rank_sends_nothing() -> None:
    for method in ("ulysses", "ring"):
        assert launch(attention_run, 1, method=method)[0]["forward"] == {}
        assert cost.attention_bytes(method, B, S, H, 1) == cost.attention_bytes(method, B, S, H, 1, backward=True) == 0


# The whole step of a 2-layer SequenceParallelGPT (vocab 11) on 4 ranks: 2 layers of attention traffic
# plus sync_grads' ring all-reduce of every gradient. Parameters: embeddings 11 x 8 + 16 x 8; per block
# 2 layer norms 2 x 16, q k v proj 4 x (64 + 8), fc 8 x 12 + 12, proj 12 x 8 + 8 = 532; final layer
# norm 16; head 8 x 11: 1384 numbers, 346 per chunk, 2 x 3 chunks sent: 16608 B.
N_PARAMS, ALLREDUCE_4 = 88 + 128 + 2 * 532 + 16 + 88, 2 * 3 * 346 * 8


def gpt_step_run(comm, method: str, ulysses: int | None = None, zigzag: bool = False) -> dict:
    model = SequenceParallelGPT(11, S, H, HEADS, 2, comm, method, zigzag, ulysses, d_ff=FF, seed=1)
    tokens = np.random.default_rng(2).integers(0, 11, (2, B, S))
    with recording(comm.world_rank) as rec:
        model.loss(model.shard(tokens[0]), model.shard(tokens[1])).backward()
        model.sync_grads()
    return {"sent": sent(rec.events, comm.world_rank), "n_params": sum(p.data.size for p in model.parameters())}


GPT_STEPS = [("ring", None, True, {"ring_kv": 2 * 2 * 3072, "ring_dkv": 2 * 3072, "allreduce": ALLREDUCE_4}),
             ("ulysses", None, False, {"all_to_all": 2 * 2 * 1536, "allreduce": ALLREDUCE_4}),
             ("hybrid", 2, False, {"all_to_all": 2 * 2 * 1024, "ring_kv": 2 * 2 * 1024, "ring_dkv": 2 * 1024,
                                   "allreduce": ALLREDUCE_4})]


def check_gpt_step(case: tuple, results: list[dict]) -> None:
    method, pu, _, want = case
    step = 2 * sum(cost.attention_bytes(method, B, S, H, 4, pu, backward=bw) for bw in (False, True))
    for r, got in enumerate(results):
        assert got["n_params"] == N_PARAMS
        assert got["sent"] == want, case
        assert sum(want.values()) == step + cost.grad_sync_bytes(N_PARAMS, 4, rank=r)


@pytest.mark.parametrize("case", GPT_STEPS, ids=lambda c: c[0])
def test_gpt_step_bytes(case) -> None:
    method, pu, zigzag, _ = case
    check_gpt_step(case, launch(gpt_step_run, 4, method=method, ulysses=pu, zigzag=zigzag))


@pytest.mark.mpi
def test_traffic_under_mpiexec() -> None:
    """The same hand-worked bytes with one process per rank (4 ranks, one mpiexec job)."""
    cases = [c for c in TRAFFIC if c[1] == 4]
    configs = [{"method": c[0], "ulysses": c[2], "zigzag": c[3]} for c in cases]
    for case, results in zip(cases, run_each(attention_run, 4, configs, timeout=120), strict=True):
        check_traffic(case, results)
    configs = [{"method": c[0], "ulysses": c[1], "zigzag": c[2]} for c in GPT_STEPS]
    for case, results in zip(GPT_STEPS, run_each(gpt_step_run, 4, configs, timeout=120), strict=True):
        check_gpt_step(case, results)
