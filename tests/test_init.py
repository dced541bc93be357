"""Addressable initialisation: a shard generates only its part, bit-identical to the slice of the
whole, and building a sharded model never holds more than its shard plus one tile."""

from __future__ import annotations

import tracemalloc
from collections import Counter
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st
from strategies import budget

from minipar import nn
from minipar.nn import GPT, TILE, init_values
from minipar.parallel.pipeline.partition import build_stage, gpt
from minipar.parallel.tensor import TensorParallelGPT

TILE_BYTES = TILE * TILE * 8
SLACK = 4 * TILE_BYTES  # a tile being drawn and numpy's temporaries for it (uniform: scale, shift), module objects


@st.composite
def slices(draw: st.DrawFn) -> tuple[tuple[int, ...], tuple[slice, ...]]:
    shape = tuple(draw(st.lists(st.integers(1, 2 * TILE + 7), min_size=1, max_size=3)))
    index = []
    for n in shape:
        lo = draw(st.integers(0, n - 1))
        index.append(slice(lo, draw(st.integers(lo + 1, n))))
    return shape, tuple(index)


@budget(30)
@given(case=slices(), init=st.sampled_from([("normal", 0.02), ("uniform", 0.5), ("ones",)]),
       seed=st.integers(0, 2**31 - 1))
@example(case=((TILE * TILE + 3,), (slice(TILE * TILE - 1, TILE * TILE + 2),)), init=("normal", 1.0), seed=0)
@example(case=((2 * TILE + 1, 3 * TILE), (slice(1, 2 * TILE + 1), slice(TILE - 1, TILE + 1))),
         init=("uniform", 1.0), seed=3)
def test_a_slice_is_bit_identical_to_the_slice_of_the_whole(case: tuple, init: tuple, seed: int) -> None:
    shape, index = case
    whole = init_values(seed, "blocks.0.attn.q.weight", shape, init)
    part = init_values(seed, "blocks.0.attn.q.weight", shape, init, index)
    np.testing.assert_array_equal(part, whole[index])
    if init[0] == "normal" and whole.size > 100:  # the tiles together are one N(0, std) draw
        assert abs(whole.std() / init[1] - 1) < 0.35


def test_tiles_differ_and_names_differ() -> None:
    a = init_values(0, "w", (2 * TILE, 2 * TILE), ("normal", 1.0))
    assert not np.array_equal(a[:TILE, :TILE], a[:TILE, TILE:])  # every tile its own stream
    assert not np.array_equal(a, init_values(0, "v", (2 * TILE, 2 * TILE), ("normal", 1.0)))
    assert not np.array_equal(a, init_values(1, "w", (2 * TILE, 2 * TILE), ("normal", 1.0)))


def counting(monkeypatch: pytest.MonkeyPatch) -> Counter:
    calls: Counter = Counter()
    real = nn.init_values

    def spy(seed: int, name: str, *args: object, **kwargs: object) -> np.ndarray:
        calls[name] += 1
        return real(seed, name, *args, **kwargs)

    monkeypatch.setattr(nn, "init_values", spy)
    return calls


def tp_model(rank: int, t: int = 4, **kw: int) -> TensorParallelGPT:
    grid = SimpleNamespace(size=t, rank=rank)  # the constructor reads only size and rank: no messages
    return TensorParallelGPT(kw.get("vocab", 512), 32, kw.get("d", 128), 4, 2, grid, seed=7)


def test_every_parameter_is_initialised_once(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = counting(monkeypatch)
    GPT(16, 8, 8, 2, 2, seed=1)
    assert calls and set(calls.values()) == {1}, calls
    for build in (lambda: tp_model(1, d=16, vocab=32),
                  lambda: build_stage(gpt(16, 8, 8, 2, 4, seed=1), 1, 2)):
        calls.clear()
        model = build()
        assert calls == Counter(name for name, _ in model.named_parameters())


def test_a_tensor_parallel_shard_equals_the_slice_of_the_single_process_model() -> None:
    whole = dict(GPT(64, 32, 32, 4, 2, seed=7).named_parameters())
    for rank in range(4):
        for name, p in tp_model(rank, d=32, vocab=64).named_parameters():
            want = whole[name].data[p.shard] if p.shard is not None else whole[name].data
            np.testing.assert_array_equal(p.data, want, err_msg=name)


def peak_while(build: object) -> tuple[object, int]:
    build()  # once untraced: the first build in a process imports lazily (importlib, random)
    tracemalloc.start()
    tracemalloc.reset_peak()
    try:
        model = build()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return model, peak


@pytest.mark.parametrize("rank", [0, 3])
def test_building_a_tensor_parallel_rank_allocates_its_shard_plus_a_tile(rank: int) -> None:
    d, vocab, t = 128, 512, 4
    model, peak = peak_while(lambda: tp_model(rank, t, d=d, vocab=vocab))
    shard = sum(p.data.nbytes for p in model.parameters())
    biggest_whole = max(int(np.prod(p.full_shape)) * 8 for p in model.parameters())
    slack = SLACK
    assert biggest_whole > slack  # materialising any one whole weight would fail the bound below
    assert shard <= peak <= shard + slack, (peak, shard)
    assert shard < 0.4 * sum(int(np.prod(p.full_shape)) * 8 for p in model.parameters())


def test_building_a_pipeline_stage_allocates_only_its_layers() -> None:
    model = gpt(256, 32, 64, 4, 8, seed=3)  # describes the layers; builds none
    stage, peak = peak_while(lambda: build_stage(model, 2, 4))
    own = sum(p.data.nbytes for p in stage.parameters())
    whole = sum(p.data.nbytes for p in GPT(256, 32, 64, 4, 8).parameters())
    assert own <= peak <= own + SLACK, (peak, own)
    assert own < whole / 4


def test_a_wrapper_keeps_the_values_of_a_model_built_before() -> None:
    class Wrapper(nn.Module):
        def __init__(self, inner: nn.Module) -> None:
            self.inner = inner
            self.extra = nn.Linear(4, 4)

    inner = GPT(16, 8, 8, 2, 1, seed=1)
    before = {n: p.data.copy() for n, p in inner.named_parameters()}
    wrapped = Wrapper(inner)
    for name, p in inner.named_parameters():
        np.testing.assert_array_equal(p.data, before[name], err_msg=name)
    np.testing.assert_array_equal(wrapped.extra.weight.data,
                                  init_values(0, "extra.weight", (4, 4), wrapped.extra.weight.init))
