"""``minipar.parallel.offload.compare`` trains each offload method with a "step" mark per step and a
"flush" mark after the last, so every step's bytes can be read back from the trace. Checked by hand on
PatrickStar's chunks and a model that uses its first layer again at the end (layers 0 1 2 0, one chunk
of 32 x 32 + 32 float64 = 8,448 bytes each, 2 of the 3 fitting beside the activations): evicting by
recency misses 5 chunks per step, by the order the warm-up recorded 4 (the warm-up itself evicts by
recency: 5), and both reach the same parameters."""

from __future__ import annotations

import numpy as np

from minipar import nn, trace
from minipar.comm import launch
from minipar.parallel.offload.compare import Reuse, short_budget_error, spread, train_chunk_policies, train_chunks
from minipar.tiers import Bandwidth
from viz.tiers import per_step_moves

D, CHUNK = 32, 32 * 32 + 32


def batches() -> list[tuple[np.ndarray, np.ndarray]]:
    return [(np.random.default_rng(i).normal(size=(2, D)), np.random.default_rng(10 + i).normal(size=(2, D)))
            for i in range(4)]


def chunks_run(comm, policy: str, path: str) -> dict:
    return train_chunks(comm, lambda: Reuse(D), batches(), path, CHUNK, 2, policy, 1e-3, Bandwidth())


def test_chunks_miss_what_each_policy_should(tmp_path) -> None:
    got = {}
    for policy, misses in (("lru", [5, 5, 5, 5]), ("warmup", [5, 4, 4, 4])):
        path = str(tmp_path / f"{policy}.json")
        got[policy] = launch(chunks_run, 1, policy=policy, path=path)[0]
        setup, *steps, flush = per_step_moves(trace.load(path), 0)
        assert [s["cpu->device"] for s in steps] == [m * 8 * CHUNK for m in misses], policy
        assert got[policy]["chunks"] == 3 and got[policy]["chunk_bytes"] == 8 * CHUNK
        assert got[policy]["budget"] == got[policy]["acts"] + 2 * 8 * CHUNK >= got[policy]["peak"]
    for name, value in got["lru"]["params"].items():
        assert np.array_equal(got["warmup"]["params"][name], value), name


def test_spread_includes_both_ends() -> None:
    assert spread(100, 300) == [100, 200, 300] and spread(7, 7) == [7] and spread(0, 10, 6) == [0, 2, 4, 6, 8, 10]


def test_chunk_policies_run_each_model_under_both_policies_on_one_budget(tmp_path) -> None:
    def body(comm):
        return train_chunk_policies(comm, {"loop": (lambda: Reuse(D), CHUNK, 2, batches())}, tmp_path, 1e-3,
                                    Bandwidth())

    got = launch(body, 1)[0]
    assert list(got) == [("loop", "lru"), ("loop", "warmup")]
    for (_, policy), misses in zip(got, ([5, 5, 5, 5], [5, 4, 4, 4]), strict=True):
        assert got[("loop", policy)]["trace"] == tmp_path / f"chunks_loop_{policy}.json"
        setup, *steps, flush = per_step_moves(trace.load(tmp_path / f"chunks_loop_{policy}.json"), 0)
        assert [s["cpu->device"] for s in steps] == [m * 8 * CHUNK for m in misses], policy
    assert got[("loop", "lru")]["budget"] == got[("loop", "warmup")]["budget"]


def test_a_device_one_byte_short_is_refused_alike_on_every_rank_before_any_byte_is_placed() -> None:
    def body(comm):
        return short_budget_error(lambda: nn.GPT(16, 8, 16, 2, 1, seed=0), comm, 4096, 1e-3)

    first, second = launch(body, 2)
    assert first == second and first.startswith("DeviceOutOfMemory: ") and not first.endswith("placed!)")
