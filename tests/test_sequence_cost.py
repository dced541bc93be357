"""Sequence parallelism costs what ``minipar.cost.sequence`` says, measured: the bytes each rank
sends per layer forward and backward (read from the trace, held against numbers worked out here
from the shapes), the largest score buffer (Ulysses' softmax in the graph, Ring Attention's
``score_bytes`` on its spans), the causal work per ring rank (contiguous r + 1 blocks, zigzag 2P + 1),
the activation bytes one block's graph keeps on each rank, and ring attention's peak allocation
staying below the full score matrix. Ulysses' bytes per rank stay flat as S and P grow together
while Megatron-SP's grow with S."""

from __future__ import annotations

import tracemalloc
from collections import Counter

import numpy as np
import pytest
from hypothesis import given
from strategies import budget, sp_configs

from minipar import functional as F
from minipar import trace
from minipar.autograd import Tensor
from minipar.comm import launch
from minipar.cost import sequence as cost
from minipar.memory import held_buffers, seq_mark
from minipar.nn import Block
from minipar.parallel.sequence import (
    SequenceGroup,
    SequenceParallelAttention,
    SequenceParallelGPT,
    check_sequence_config,
)
from minipar.parallel.tensor import ParallelBlock
from minipar.testing import run_each

B, S, H, HEADS, FF = 2, 16, 8, 4, 12  # batch, sequence, hidden (4 heads of 2), MLP width


def sent(events: list, rank: int) -> dict[str, int]:
    """Bytes ``rank`` sent, by op (each message from its sender's record)."""
    out: Counter = Counter()
    for e in events:
        if e.kind == "comm" and e.name == "send" and e.src == rank:
            out[e.op] += e.nbytes
    return dict(out)


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


def group_of(comm, method: str, s: int, heads: int, ulysses: int | None, zigzag: bool, h: int = H) -> SequenceGroup:
    layout = check_sequence_config(comm, s, heads, h, method, ulysses, None, zigzag)
    return SequenceGroup(comm, layout, method)


def attention_run(comm, method: str, s: int = S, ulysses: int | None = None, zigzag: bool = False,
                  causal: bool = True, b: int = B, heads: int = HEADS, h: int = H) -> dict:
    """One layer's attention on this rank's positions: bytes sent forward and backward by op, the
    spans, the largest 4-D buffer its graph saved."""
    group = group_of(comm, method, s, heads, ulysses, zigzag, h)
    rng = np.random.default_rng(0)
    q, k, v = (Tensor(group.layout.shard(rng.normal(size=(b, s, h)), comm.rank), requires_grad=True)
               for _ in range(3))
    with trace.recording(comm.world_rank) as fwd:
        out = group.attention(q, k, v, heads, causal)
    with trace.recording(comm.world_rank) as bwd:
        out.backward(np.ones_like(out.data))
    spans = [(e.name, e.args["score_bytes"] if e.name == "attention F" else 0)
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
    with trace.recording(comm.world_rank) as rec:
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
    assert cost.step_bytes_by_op(method, B, S, H, 2, 4, N_PARAMS, pu) == want  # rank 0's, by op


@pytest.mark.parametrize("case", GPT_STEPS, ids=lambda c: c[0])
def test_gpt_step_bytes(case) -> None:
    method, pu, zigzag, _ = case
    check_gpt_step(case, launch(gpt_step_run, 4, method=method, ulysses=pu, zigzag=zigzag))


def either_run(comm, fn, kw: dict):
    """``fn(comm, **kw)``: attention_run's and gpt_step_run's configurations in one ``run_each`` job."""
    return fn(comm, **kw)


@pytest.mark.mpi
def test_traffic_under_mpiexec() -> None:
    """The same hand-worked bytes with one process per rank (4 ranks, one mpiexec job)."""
    cases = [c for c in TRAFFIC if c[1] == 4]
    configs = [{"fn": attention_run, "kw": {"method": c[0], "ulysses": c[2], "zigzag": c[3]}} for c in cases]
    configs += [{"fn": gpt_step_run, "kw": {"method": c[0], "ulysses": c[1], "zigzag": c[2]}} for c in GPT_STEPS]
    results = run_each(either_run, 4, configs, timeout=120)
    for case, res in zip(cases, results[:len(cases)], strict=True):
        check_traffic(case, res)
    for case, res in zip(GPT_STEPS, results[len(cases):], strict=True):
        check_gpt_step(case, res)


def megatron_sp_run(comm, s: int) -> dict[str, int]:
    """Bytes sent in one Megatron-SP block's forward: input (S/t, b, h), this rank's sequence shard."""
    block = ParallelBlock(H, HEADS, comm, FF, sequence_parallel=True)
    n = s // comm.size
    x = Tensor(np.random.default_rng(0).normal(size=(s, B, H))[comm.rank * n:(comm.rank + 1) * n], requires_grad=True)
    with trace.recording(comm.world_rank) as rec:
        block(x)
    return sent(rec.events, comm.world_rank)


def test_ulysses_bytes_stay_flat_while_megatron_sp_grows_with_s() -> None:
    """Jacobs et al. 2023, Sec. 3.2: with S and P doubling together Ulysses sends 4 (P-1)/P of a
    fixed (b, S/P, h) shard (8 positions: 2 x 8 x 8 x 8 B = 1024 B), always below 4 x 1024 B;
    Megatron-SP all-gathers and reduce-scatters the whole (b, S, h) activation: 4 (t-1)/t b S h e."""
    measured = {p: launch(attention_run, p, method="ulysses", s=8 * p)[0]["forward"]["all_to_all"] for p in (2, 4)}
    assert measured == {2: 4 * 512, 4: 4 * 768}  # 1/2 and 3/4 of the 1024 B shard, 4 times
    megatron = {t: launch(megatron_sp_run, t, s=8 * t)[0] for t in (2, 4)}
    assert megatron == {2: {"allgather": 2 * 1024, "reduce_scatter": 2 * 1024},  # 1/2 of 2 x 16 x 8 x 8 B
                        4: {"allgather": 2 * 3072, "reduce_scatter": 2 * 3072}}  # 3/4 of 2 x 32 x 8 x 8 B
    for p in (2, 4):
        assert cost.ulysses_bytes(B, 8 * p, H, p) == measured[p]
        assert cost.megatron_sp_bytes(B, 8 * p, H, p) == sum(megatron[p].values())
    ps = [2, 4, 8, 16, 32, 64]
    heads = 64 * 2  # whole heads for P = 64
    ulysses = [cost.ulysses_bytes(1, 1024 * p, heads, p) for p in ps]
    megatron = [cost.megatron_sp_bytes(1, 1024 * p, heads, p) for p in ps]
    shard = 1024 * heads * 8
    assert ulysses == [4 * shard * (p - 1) // p for p in ps]
    assert all(a < b < 4 * shard for a, b in zip(ulysses, ulysses[1:]))  # rising towards 4 x shard
    assert [b / a for a, b in zip(megatron, megatron[1:])] == [(2 * p - 1) / (p - 1) for p in ps[:-1]]  # >= 2
    assert megatron[-1] / ulysses[-1] == 64  # Megatron-SP moves P times more per rank
    assert cost.megatron_sp_bytes(B, 16, H, 4, backward=True) == 6 * 3 * 2 * 16 * H * 8 // 4  # 4 gathers + 2 scatters


FULL = B * HEADS * S * S * 8  # one process's softmax: b H S^2 e = 16 KiB
SCORES = [  # method, P, P_u, zigzag, largest score buffer per rank (b = 2, H = 4 heads, S = 16, 8 B), FULL / it
    ("ulysses", 2, None, False, 2 * 2 * 16 * 16 * 8, 2),  # softmax of H/P = 2 heads over the whole sequence
    ("ulysses", 4, None, False, 2 * 1 * 16 * 16 * 8, 4),
    ("ring", 4, None, False, 2 * 4 * 4 * 4 * 8, 16),  # one (S/P)^2 block of every head
    ("ring", 4, None, True, 2 * 4 * 2 * 2 * 8, 64),  # zigzag pieces of S/(2P)
    ("hybrid", 4, 2, False, 2 * 2 * 8 * 8 * 8, 8),  # H/P_u heads, blocks of S/P_r
    ("hybrid", 4, 2, True, 2 * 2 * 4 * 4 * 8, 32),
]


@pytest.mark.parametrize("case", SCORES, ids=lambda c: f"{c[0]}-P{c[1]}-u{c[2]}{'-zigzag' * c[3]}")
def test_largest_score_buffer(case) -> None:
    """Ulysses keeps the softmax in its graph (the 4-D array attention saves): P times smaller than
    one process's. Ring Attention keeps no score matrix (only 3-D q, k, v, output, log-sum-exp); its
    largest block, the largest ``score_bytes`` of its "attention F" spans, is P_u P_r^2 times smaller
    (4 P_u P_r^2 zigzag)."""
    method, p, pu, zigzag, want, ratio = case
    for got in launch(attention_run, p, method=method, ulysses=pu, zigzag=zigzag):
        blocks = [n for name, n in got["spans"] if name == "attention F"]
        if method == "ulysses":
            assert got["saved_4d"] == want and not blocks
        else:
            assert got["saved_4d"] == 0 and max(blocks) == want
    assert cost.score_bytes(method, B, S, HEADS, p, pu, zigzag) == want == FULL // ratio


@pytest.mark.parametrize("zigzag", [False, True])
def test_causal_blocks_per_ring_rank(zigzag: bool) -> None:
    """Causal Ring Attention on P = 4: contiguous rank r computes r + 1 blocks of (S/P)^2 (1, 2, 3, 4:
    rank 3 works 4 times as long as rank 0); zigzag every rank 2P + 1 = 9 pieces of (S/(2P))^2.
    Backward computes the same blocks."""
    results = launch(attention_run, 4, method="ring", zigzag=zigzag)
    forward = [[n for name, n in got["spans"] if name == "attention F"] for got in results]
    backward = [sum(name == "attention B" for name, _ in got["spans"]) for got in results]
    want = [9, 9, 9, 9] if zigzag else [1, 2, 3, 4]
    assert [len(f) for f in forward] == backward == want == cost.causal_blocks(4, zigzag)
    piece = 2 if zigzag else 4  # S/(2P) or S/P positions
    elements = [sum(f) // (B * HEADS * 8) for f in forward]
    assert elements == [n * piece * piece for n in want] == cost.causal_score_elements(S, 4, zigzag)
    assert sum(elements) == (9 * 4 * 4 if zigzag else 10 * 16)  # zigzag: 144 of 256; contiguous: 160
    not_causal = launch(attention_run, 4, method="ring", zigzag=zigzag, causal=False)
    assert [sum(name == "attention F" for name, _ in got["spans"]) for got in not_causal] == [16 if zigzag else 4] * 4


def block_memory_run(comm, method: str | None, ulysses: int | None = None, b: int = B, s: int = S, h: int = H,
                     heads: int = HEADS, ff: int = FF, zigzag: bool = False) -> list[int]:
    """Sizes of the buffers one pre-norm block's graph keeps on this rank (``method`` None: the
    one-process ``nn.Block``)."""
    block = Block(h, heads, ff)
    positions = np.arange(s)
    if method is not None:
        group = group_of(comm, method, s, heads, ulysses, zigzag, h)
        block.attn, positions = SequenceParallelAttention(block.attn, group), group.positions
    x = Tensor(np.ascontiguousarray(np.random.default_rng(0).normal(size=(b, s, h))[:, positions]),
               requires_grad=True)  # C order, as the embeddings make it (a linear copies other layouts)
    since = seq_mark()
    return sorted(n for _, n in held_buffers(block(x), since).values())


# One process, b = 2, S = 16, h = 8, d_ff = 12, 4 heads, 8 B: an activation (b, S, h) is 2048 B, the
# MLP's hidden (b, S, d_ff) 3072 B, the softmax (b, H, S, S) 16384 B, the log-sum-exp (b, H, S) 1024 B.
# nn.Block keeps ln1 output, q, k, v, attention output, proj output, residual 1, ln2 output, MLP output,
# residual 2 (10 activations), fc output and GELU output (2 hidden), the softmax. Ulysses keeps q, k, v
# once, after the all-to-all (projected and sent in one op), and the attention output twice (before
# and after its all-to-all back): 11 activations; ring keeps the log-sum-exp instead of the softmax.
ONE_PROCESS = {None: [2048] * 10 + [3072] * 2 + [16384], "ulysses": [2048] * 11 + [3072] * 2 + [16384],
               "ring": [2048] * 10 + [3072] * 2 + [1024], "hybrid": [2048] * 11 + [3072] * 2 + [1024]}
GRIDS = [("ulysses", 1, None), ("ulysses", 2, None), ("ulysses", 4, None), ("ring", 1, None), ("ring", 2, None),
         ("ring", 4, None), ("hybrid", 1, 1), ("hybrid", 2, 2), ("hybrid", 2, 1), ("hybrid", 4, 2)]


def test_block_activation_bytes_fall_by_p() -> None:
    """Measured from the graph (``memory.held_buffers``, each buffer once) on every rank: every
    buffer of one block is 1/P of the method's one-process size (the softmax too: H/P heads), and the
    total equals ``activation_bytes``. Against ``nn.Block`` on one process: the ring keeps 1/P of
    everything but the softmax, which the log-sum-exp replaces; Ulysses one activation more."""
    (plain,) = launch(block_memory_run, 1, method=None)
    assert plain == sorted(ONE_PROCESS[None])
    for method, p, pu in GRIDS:
        want = sorted(n // p for n in ONE_PROCESS[method])
        for got in launch(block_memory_run, p, method=method, ulysses=pu):
            assert got == want, (method, p, pu)
        assert sum(want) == cost.activation_bytes(method, B, S, H, HEADS, FF, p, pu)
        assert sum(want) * p == cost.activation_bytes(method, B, S, H, HEADS, FF, 1, 1 if pu else None)
    ring, ulysses = (cost.activation_bytes(m, B, S, H, HEADS, FF, 4) for m in ("ring", "ulysses"))
    assert 4 * ring - 1024 == sum(plain) - 16384  # all but the score term falls by P
    assert 4 * ulysses == sum(plain) + 2048


def ring_peak_run(comm, s: int, heads: int, zigzag: bool) -> None:
    group = group_of(comm, "ring", s, heads, None, zigzag)
    rng = np.random.default_rng(comm.rank)
    q, k, v = (Tensor(rng.normal(size=(1, s // comm.size, H)), requires_grad=True) for _ in range(3))
    group.attention(q, k, v, heads, True).backward(np.ones((1, s // comm.size, H)))


def traced_peak(fn, *args, **kwargs) -> int:
    """Peak bytes numpy and Python allocated in this process (every rank's thread) while ``fn`` ran."""
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        fn(*args, **kwargs)
        return tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("zigzag", [False, True])
def test_ring_attention_never_allocates_the_full_score_matrix(zigzag: bool) -> None:
    """S = 512, 4 heads, b = 1: the full score matrix is b H S^2 e = 8 MiB, and one process's
    attention (softmax plus its gradient) allocates twice that. Ring Attention on P = 4 threads
    allocates less than the full matrix in total over the four ranks, forward and backward: each
    rank holds at most a block of scores and its gradient, 2 b H (S/P)^2 e."""
    s, heads = 512, 4
    full = 1 * heads * s * s * 8
    launch(ring_peak_run, 4, s=16, heads=heads, zigzag=zigzag)  # warm up the launcher outside the count
    ring = traced_peak(launch, ring_peak_run, 4, s=s, heads=heads, zigzag=zigzag)
    q = Tensor(np.random.default_rng(0).normal(size=(1, s, H)), requires_grad=True)
    one = traced_peak(lambda: F.attention(q, q, q, heads).backward(np.ones((1, s, H))))
    assert ring < full <= one / 2


@budget(10)
@given(c=sp_configs())
def test_drawn_configurations_cost_what_the_formulas_say(c: dict) -> None:
    """Any grid, heads, head size, sequence, zigzag or not, causal or not: bytes per rank per layer
    forward and backward, the largest score buffer, one block's activation bytes and, causal, the
    score blocks and elements of every ring rank, all equal to the formulas."""
    p, method, pu, pr = c["p"], c["method"], c["pu"], c["pr"]
    u = pu if method == "hybrid" else None
    dims = {"b": c["batch"], "s": c["seq"], "h": c["d"], "heads": c["heads"]}
    results = launch(attention_run, p, method=method, ulysses=u, zigzag=c["zigzag"], causal=c["causal"], **dims)
    score = cost.score_bytes(method, c["batch"], c["seq"], c["heads"], p, u, c["zigzag"])
    for r, got in enumerate(results):
        for backward, phase in ((False, "forward"), (True, "backward")):
            want = cost.attention_bytes(method, c["batch"], c["seq"], c["d"], p, u, backward=backward)
            assert sum(got[phase].values()) == want
        blocks = [n for name, n in got["spans"] if name == "attention F"]
        assert (got["saved_4d"] if method == "ulysses" else max(blocks)) == score
        if c["causal"] and method != "ulysses":
            ring_rank = r // pu
            assert len(blocks) == cost.causal_blocks(pr, c["zigzag"])[ring_rank]
            per_element = c["batch"] * c["heads"] // pu * 8
            assert sum(blocks) // per_element == cost.causal_score_elements(c["seq"], pr, c["zigzag"])[ring_rank]
    ff = c["ff"] or 4 * c["d"]
    held = launch(block_memory_run, p, method=method, ulysses=u, ff=ff, zigzag=c["zigzag"], **dims)
    want = cost.activation_bytes(method, c["batch"], c["seq"], c["d"], c["heads"], ff, p, u)
    assert [sum(sizes) for sizes in held] == [want] * p


def test_longest_sequence_by_hand() -> None:
    # s^2 bytes: 96^2 = 9,216 fits 10,000, 104^2 = 10,816 does not; steps of 8
    assert cost.longest_sequence(lambda s: s * s, 10_000, 8) == 96
    assert cost.longest_sequence(lambda s: s * s, 64, 8) == 8  # even the shortest does not fit: the multiple
    assert cost.longest_sequence(lambda s: 3 * s, 3 * 1000, 10) == 1000
