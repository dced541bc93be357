"""ZeRO-Infinity (``minipar.parallel.offload.ZeroInfinity``): model states on NVMe, one unit at a time on
the budgeted device of ``minipar.tiers``.

- float64: every move is a copy, so training gives bit for bit the parameters of
  ``FullyShardedDataParallel`` (same units, same reduce-scatter, same AdamW rule) and those of one
  process's ``nn.GPT`` + ``AdamW`` on the global batch within ``test_zero``'s tolerances plus the drift
  AdamW makes of gradients that differ by rounding (``tests/tolerances.py`` derives it: large only where
  the exact gradient is zero, as the key bias's). Mixed precision: bit-equal to FSDP in mixed precision.
- device: one unit at a time, its gathered parameters and its flat gradient buffer during its
  backward: ``2 x 8 x max L_u`` bytes in float64 (L_u the unit's size padded to a multiple of N);
  on a budget of exactly that (plus slack) the peak is exactly that; one byte less is refused on every
  rank before anything is sent or written.
- bytes per step per rank, by hand (below), against the trace's "transfer" events.

Bytes by hand. A rank's shard of unit u has s_u = L_u / N elements; s = sum s_u. Float64 (8 bytes):
before each unit's forward and again before its backward the shard is read from NVMe and copied to
the device: 2 x 8 s each way; the reduce-scattered gradient partition comes down: 8 s; the step reads
the parameter shard and the two moments (3 x 8 s) and writes them back (3 x 8 s). So per step
nvme->cpu 40 s, cpu->nvme 24 s, cpu->device 16 s, device->cpu 8 s; and the step's commit, one write of
the manifest (slot, steps, loss scale, clean steps and the last two before: 6 x 8 = 48 bytes, cpu->nvme), which
``zero_infinity_bytes`` (model states only) leaves out. GPT(vocab 5, seq 3, d 4, 2 heads,
2 layers) has units tok_emb 20, pos_emb 12, two blocks of 244, ln_f 8, head 20 (``unit_sizes``):
548 elements, all even, so on N = 2 s = 274 (40 x 274 = 10960 bytes read per step).
"""

from __future__ import annotations

import errno
import os
from collections import Counter

import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st
from strategies import budget, zero_configs
from test_zero_offload import assert_close_to, assert_equal, poisoned, reference
from zero_helpers import LR, WEIGHT_DECAY, batch, build, config, padded, rows, unit_sizes

from minipar import launch, nn, trace
from minipar.autograd import Tensor
from minipar.cost.offload import zero_infinity_bytes, zero_infinity_device_need
from minipar.parallel.offload import ZeroInfinity
from minipar.parallel.zero import FullyShardedDataParallel
from minipar.testing import run_each
from minipar.tiers import DeviceOutOfMemory, Tiers, nvme


def model_of(c: dict, precision: str) -> nn.GPT:
    """Built under ``nn.deferred()`` (no rank holds the model whole: each draws its shards) unless
    ``c["deferred"]`` is False (built whole, then cut)."""
    if c.get("deferred", True):
        with nn.deferred():
            return model_of({**c, "deferred": False}, precision)
    if precision == "mixed":
        return nn.GPT(c["vocab"], c["seq"], c["d"], c["heads"], c["layers"], seed=c["seed"], dtype=np.float16)
    return build(c)


MANIFEST = 6 * 8  # a step's commit: slot, steps, loss scale, clean steps and the last two before, float64


def hand_need(c: dict, precision: str = "fp64") -> int:
    """The largest unit gathered beside its gradient buffer: 2 x item x max padded unit."""
    item = 8 if precision == "fp64" else 2
    return 2 * item * max(padded(n, c["world"]) for n in unit_sizes(c))


def hand_bytes(c: dict, precision: str = "fp64") -> dict[str, int]:
    """Per step per rank (module docstring); mixed: float16 shard 2 bytes up and down twice and its
    gradient 2; the step reads the fp32 master and moments (12) and writes them and the fp16 shard (14)."""
    s = sum(padded(n, c["world"]) for n in unit_sizes(c)) // c["world"]
    if precision == "fp64":
        return {"nvme->cpu": (8 + 8 + 24) * s, "cpu->nvme": 24 * s + MANIFEST, "cpu->device": 16 * s,
                "device->cpu": 8 * s}
    return {"nvme->cpu": (2 + 2 + 12) * s, "cpu->nvme": 14 * s + MANIFEST, "cpu->device": 4 * s, "device->cpu": 2 * s}


def moved(events: list) -> dict[str, int]:
    out: Counter[str] = Counter()
    for e in events:
        if e.kind == "transfer":
            out[f"{e.args['src']}->{e.args['dst']}"] += e.nbytes
    return dict(out)


def infinity_run(comm, c: dict, base: str, depth: int = 1, budget: int = 1 << 30, precision: str = "fp64",
                 poison_at: int | None = None) -> dict:
    """Train on this rank's rows; the final parameters, bytes moved per step, the device's peak and
    largest sample, the files before and after ``close``, and the prefetch log of the first step.
    ``poison_at``: rank N-1's loss is infinite at that step (float16 gradients overflow)."""
    directory = os.path.join(base, f"rank{comm.rank}")
    tiers = Tiers(budget, directory, workers=2)  # two I/O threads: reads of one rank overlap
    inf = ZeroInfinity(model_of(c, precision), comm, tiers, prefetch_depth=depth, lr=LR,
                       weight_decay=WEIGHT_DECAY, precision=precision)
    per_step, logs, mine = [], [], rows(c, comm.rank)
    with trace.recording(comm.rank) as rec:
        for i in range(c["steps"]):
            start, (x, y) = len(rec.events), batch(c, i)
            inf.backward(poisoned(comm, inf.loss(x[mine], y[mine]), i, poison_at))
            inf.step()
            per_step.append(moved(rec.events[start:]))
            logs.append(list(inf.log))
    samples = [e.nbytes for e in rec.events if e.kind == "memory" and e.name == "device"]
    cpu = [e.nbytes for e in rec.events if e.kind == "memory" and e.name == "cpu"]
    final = inf.full_state_dict()
    files = (len(os.listdir(directory)), sum(tiers.resident("nvme").values()))
    inf.close()
    after_close = (os.listdir(directory), tiers.resident("nvme"))
    tiers.close()
    return {"final": final, "per_step": per_step, "peak": tiers.peak_device_bytes, "max_sample": max(samples),
            "files": files, "after_close": after_close, "dir_left": os.path.exists(directory), "log": logs[0],
            "cpu": (max(cpu), cpu[-1]),
            "skipped": inf.skipped, "need": inf.device_need()}


def fsdp_run(comm, c: dict, precision: str = "fp64", poison_at: int | None = None) -> dict[str, np.ndarray]:
    """The same training with ``FullyShardedDataParallel``, nothing offloaded."""
    model = model_of(c, precision)
    fsdp = FullyShardedDataParallel(model, comm, lr=LR, weight_decay=WEIGHT_DECAY, precision=precision)
    for i in range(c["steps"]):
        x, y = batch(c, i)
        fsdp.backward(poisoned(comm, model.loss(x[rows(c, comm.rank)], y[rows(c, comm.rank)]), i, poison_at))
        fsdp.step()
    return fsdp.full_state_dict()


def check(c: dict, got: list[dict], fsdp: list[dict] | None, precision: str = "fp64") -> None:
    ref = reference(c) if precision == "fp64" else None
    need, by_hand = hand_need(c, precision), hand_bytes(c, precision)
    formula = zero_infinity_bytes(unit_sizes(c), c["world"], precision)
    assert by_hand == {**formula, "cpu->nvme": formula["cpu->nvme"] + MANIFEST}
    assert need == zero_infinity_device_need(unit_sizes(c), c["world"], 8 if precision == "fp64" else 2)["total"]
    units = len(unit_sizes(c))
    for r, g in enumerate(got):
        if ref is not None:
            assert_close_to(ref, g["final"])  # one process on the global batch
        if fsdp is not None:
            assert_equal(g["final"], fsdp[r])  # moves are copies: bit for bit
        assert g["need"]["total"] == need and g["peak"] == g["max_sample"] == need
        assert g["per_step"] == [by_hand] * c["steps"]
        assert g["cpu"] == (by_hand["device->cpu"], 0)  # every gradient partition waits on the CPU for the step
        # on disk: param, m, v (+ the fp32 master) per unit in two slots, and the manifest; then
        # nothing left, the directory gone
        kinds = 3 if precision == "fp64" else 4
        shard_bytes = sum(padded(n, c["world"]) for n in unit_sizes(c)) // c["world"]
        assert g["files"] == (2 * kinds * units + 1, 2 * shard_bytes * (24 if precision == "fp64" else 2 + 12) + 48)
        assert g["after_close"] == ([], {}) and not g["dir_left"]


# ---- float64: the parameters of FSDP and of one process, peak, bytes (drawn) --------------------
@st.composite
def infinity_configs(draw: st.DrawFn, world: int | None = None) -> dict:
    """``zero_configs`` (N 1-4 unless given, tiny GPTs with padding, 2-3 steps) run with ZeRO-Infinity
    at prefetch depth 0-2 on a budget of the need by hand plus 0-64 bytes."""
    c = {**draw(zero_configs(world)), "mode": "infinity"}
    return {**c, "depth": draw(st.integers(0, 2)), "slack": draw(st.integers(0, 64))}


@budget(8)
@given(c=infinity_configs())
@example(c={**config("infinity", 1), "depth": 0, "slack": 0})
@example(c={**config("infinity", 2), "depth": 1, "slack": 0})
@example(c={**config("infinity", 3), "depth": 2, "slack": 7})
@example(c={**config("infinity", 4, d=3, heads=1), "depth": 2, "slack": 0})
def test_fp64_property_threads(c: dict, tmp_path_factory: pytest.TempPathFactory) -> None:
    base = str(tmp_path_factory.mktemp("nvme"))
    got = launch(infinity_run, c["world"], c=c, base=base, depth=c["depth"], budget=hand_need(c) + c["slack"])
    check(c, got, launch(fsdp_run, c["world"], c=c))


def test_bytes_per_step_by_hand(tmp_path) -> None:
    c = config("infinity", 2)
    assert unit_sizes(c) == [20, 12, 244, 244, 8, 20]
    for g in launch(infinity_run, 2, c=c, base=str(tmp_path)):
        assert g["per_step"][0] == {"nvme->cpu": 40 * 274, "cpu->nvme": 24 * 274 + 48, "cpu->device": 16 * 274,
                                    "device->cpu": 8 * 274} == {"nvme->cpu": 10960, "cpu->nvme": 6624,
                                                                "cpu->device": 4384, "device->cpu": 2192}
        assert g["peak"] == 2 * 8 * 244 == 3904  # a block gathered beside its gradients


def test_prefetch_depth_reads_ahead(tmp_path) -> None:
    """The schedule: forward tok_emb .. head, then backward head .. tok_emb (12 uses). With depth d,
    before the k-th use the reads of uses 0 .. k + d have been started (no more: nothing is wasted)."""
    c = config("infinity", 1, steps=1)
    for depth in (0, 1, 2):
        log = launch(infinity_run, 1, c=c, base=str(tmp_path / str(depth)), depth=depth)[0]["log"]
        uses = [i for i, e in enumerate(log) if e[0] == "use"]
        schedule = [("F", u) for u in range(6)] + [("B", u) for u in range(5, -1, -1)]
        assert [e[1:] for e in log if e[0] == "use"] == schedule
        assert [sum(e[0] == "read" for e in log[:at]) for at in uses] == [min(k + 1 + depth, 12) for k in range(12)]
        assert [e[1:] for e in log if e[0] == "read"] == [e[1:] for e in log if e[0] == "use"]


class Twice(nn.Module):
    """A unit used twice in one forward: ``head(lin(lin(x)))`` (units ``lin``, 3 x 3 + 3 = 12
    parameters, and ``head``, 3 x 2 + 2 = 8)."""

    def __init__(self, seed: int = 3) -> None:
        self.seed = seed
        self.lin, self.head = nn.Linear(3, 3), nn.Linear(3, 2)

    def forward(self, x: np.ndarray) -> Tensor:
        return self.head(self.lin(self.lin(x)))


def twice_run(comm, mode: str, base: str) -> dict[str, np.ndarray]:
    with nn.deferred():
        model = Twice()
    x = np.random.default_rng(0).normal(size=(4, 3))[comm.rank * 4 // comm.size:(comm.rank + 1) * 4 // comm.size]
    if mode == "fsdp":
        wrapper = FullyShardedDataParallel(model, comm)
    else:  # the budget: lin gathered beside its gradients, 2 x 8 x 12 bytes
        wrapper = ZeroInfinity(model, comm, Tiers(2 * 8 * 12, os.path.join(base, f"rank{comm.rank}"), workers=1))
    for _ in range(2):
        out = model(x)
        wrapper.backward((out * out).sum() * (1.0 / comm.size))
        wrapper.step()
    return wrapper.full_state_dict()


@pytest.mark.parametrize("world", [1, 2])
def test_unit_used_twice_equals_fsdp(world: int, tmp_path) -> None:
    """Backward reaches ``lin`` twice; it stays gathered until its gradients are complete (both uses)."""
    got, want = launch(twice_run, world, mode="infinity", base=str(tmp_path)), launch(twice_run, world, mode="fsdp",
                                                                                       base=str(tmp_path))
    for g, w in zip(got, want, strict=True):
        assert_equal(g, w)


def full_disk_run(comm, c: dict, base: str) -> tuple[str, bool, list[str]]:
    """One step, then a disk that refuses every write: the second step's error, whether the files
    still hold the first step's state, and the directory's entries (no temporaries left)."""
    directory = os.path.join(base, f"rank{comm.rank}")
    tiers = Tiers(1 << 30, directory, workers=1)
    inf = ZeroInfinity(model_of(c, "fp64"), comm, tiers, lr=LR, weight_decay=WEIGHT_DECAY)
    for i in range(2):
        x, y = batch(c, i)
        inf.backward(inf.loss(x, y))
        if i == 0:
            inf.step()
            before = inf.full_state_dict()
            continue
        real = nvme._write_file

        def full(path: str, head: bytes, raw: np.ndarray) -> None:
            with open(path, "wb") as fh:  # a partial temporary, as a full disk leaves it
                fh.write(b"\x93NUMPY")
            raise OSError(errno.ENOSPC, "No space left on device")

        nvme._write_file = full
        try:
            inf.step()
            msg = "stepped"
        except OSError as exc:
            msg = str(exc)
        finally:
            nvme._write_file = real
    after = inf.full_state_dict()
    same = all(np.array_equal(after[k], before[k]) for k in before)
    entries = sorted(os.listdir(directory))
    tiers.close(delete=True)
    return msg, same, entries


def test_full_disk_in_the_step_keeps_the_previous_state(tmp_path) -> None:
    c = config("infinity", 1)
    msg, same, entries = launch(full_disk_run, 1, c=c, base=str(tmp_path))[0]
    # step 1 wrote slot 1, so step 2 writes slot 0, in place into its preallocated files: the only new file
    # is the manifest's (a page of header, its 48 bytes padded to a page), and the commit fails there
    assert "disk full" in msg and "'manifest'" in msg and "asked for 8192 bytes" in msg
    assert same  # the manifest still names slot 1: step 1's values
    assert len(entries) == 2 * 3 * 6 + 1 and not any(e.startswith(".") for e in entries)


def test_cost_formulas_by_hand_and_refused_settings(tmp_path) -> None:
    # units of 10 and 7 parameters on 4 ranks pad to 12 and 8: shards of 3 + 2 = 5 elements
    assert zero_infinity_bytes([10, 7], dp=4) == {"nvme->cpu": 200, "cpu->nvme": 120, "cpu->device": 80,
                                                  "device->cpu": 40}
    assert zero_infinity_bytes([10, 7], dp=4, precision="mixed") == {"nvme->cpu": 80, "cpu->nvme": 70,
                                                                     "cpu->device": 20, "device->cpu": 10}
    assert zero_infinity_device_need([10, 7], dp=4, itemsize=2) == {"gathered unit": 24, "gradient buffer": 24,
                                                                      "total": 48}
    for bad in ({"dp": 0}, {"precision": "fp32"}):
        with pytest.raises(ValueError):
            zero_infinity_bytes([10], **bad)

    def settings(comm) -> list[str]:
        out = []
        for tiers, depth in ((Tiers(1 << 20), 1), (Tiers(1 << 20, str(tmp_path / "d")), -1)):
            try:
                ZeroInfinity(model_of(config("infinity", 1), "fp64"), comm, tiers, prefetch_depth=depth)
            except ValueError as exc:
                out.append(str(exc))
            tiers.close()
        return out

    no_disk, negative = launch(settings, 1)[0]
    assert "give the Tiers an nvme_dir" in no_disk and "prefetch_depth=-1 must be >= 0" in negative


# ---- the budget ---------------------------------------------------------------------------------
def refused(comm, c: dict, base: str, budget: int) -> tuple[str, int, list[str]]:
    """The message (or "accepted"), the messages sent, the files written."""
    directory = os.path.join(base, f"rank{comm.rank}")
    tiers = Tiers(budget, directory)
    with trace.recording(comm.rank) as rec:
        try:
            ZeroInfinity(model_of(c, "fp64"), comm, tiers)
            msg = "accepted"
        except DeviceOutOfMemory as exc:
            msg = str(exc)
    files = sorted(os.listdir(directory))
    tiers.close()
    return msg, sum(e.kind == "comm" for e in rec.events), files


def test_too_small_budget_refused_on_every_rank(tmp_path) -> None:
    c = config("infinity", 2)
    results = launch(refused, 2, c=c, base=str(tmp_path / "a"), budget=3903)
    assert results[0] == results[1]
    msg, sent, files = results[0]
    assert sent == 0 and files == []  # nothing sent, nothing written
    assert "budget 3903 bytes" in msg and "gathered unit 1952, gradient buffer 1952" in msg
    assert "the smallest budget that would have worked is 3904 bytes" in msg
    msg, sent, files = launch(refused, 2, c=c, base=str(tmp_path / "b"), budget=3904)[0]
    assert msg == "accepted" and sent == 0 and len(files) == 3 * 6 + 1  # slot 0 and the manifest


def test_model_states_eight_times_the_device_budget_train_alike(tmp_path) -> None:
    """Six blocks: 20 + 12 + 6 x 244 + 8 + 20 = 1524 parameters, model states 32 bytes each in float64
    (parameter, gradient, two moments: 48768 bytes) against a device of one block and its gradients,
    2 x 8 x 244 = 3904 bytes: 12.5x. N = 2: a block's 244 elements split evenly."""
    c = config("infinity", 2, layers=6, steps=2)
    assert sum(unit_sizes(c)) == 1524 and 32 * 1524 / 3904 > 12
    got = launch(infinity_run, 2, c=c, base=str(tmp_path), depth=2, budget=3904)
    check(c, got, launch(fsdp_run, 2, c=c))


def test_mixed_equals_fsdp_mixed(tmp_path) -> None:
    c = config("infinity", 2)
    assert hand_bytes(c, "mixed")["nvme->cpu"] == 16 * 274
    got = launch(infinity_run, 2, c=c, base=str(tmp_path), precision="mixed", budget=hand_need(c, "mixed"))
    assert all(g["skipped"] == 0 and g["final"]["head.weight"].dtype == np.float16 for g in got)
    check(c, got, launch(fsdp_run, 2, c=c, precision="mixed"), "mixed")


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")
def test_mixed_overflow_on_one_rank_skips_the_step_everywhere(tmp_path) -> None:
    """Rank 1's loss is infinite at step 1: both ranks skip that step as FSDP does (same parameters
    after), and it moves only the forward's and backward's shards (2 x 2 s each way), no state."""
    c = config("infinity", 2)
    got = launch(infinity_run, 2, c=c, base=str(tmp_path), precision="mixed", poison_at=1)
    want = launch(fsdp_run, 2, c=c, precision="mixed", poison_at=1)
    for g, w in zip(got, want, strict=True):
        assert g["skipped"] == 1
        assert_equal(g["final"], w)
        assert g["per_step"][1] == {"nvme->cpu": 4 * 274, "cpu->device": 4 * 274, "device->cpu": 2 * 274}
        assert g["per_step"][0] == g["per_step"][2] == hand_bytes(c, "mixed")


# ---- mpiexec ------------------------------------------------------------------------------------
@pytest.mark.mpi
@budget(1)
@given(drawn=infinity_configs(world=2))
def test_mpiexec(drawn: dict, tmp_path_factory: pytest.TempPathFactory) -> None:
    """Under ``mpiexec`` (N = 2, one job): float64 at depths 0 and 2 and an odd d (padding), mixed,
    and a configuration hypothesis draws (depth, sizes, slack)."""
    tmp_path = tmp_path_factory.mktemp("nvme")
    cs = [({**config("infinity", 2), "depth": 0}, "fp64"), ({**config("infinity", 2, d=3, heads=1)}, "fp64"),
          ({**config("infinity", 2), "depth": 2}, "mixed"), (drawn, "fp64")]
    args = [{"c": c, "base": str(tmp_path / str(i)), "depth": c.get("depth", 1), "precision": p,
             "budget": hand_need(c, p) + (c.get("slack", 0) if p == "fp64" else 0)} for i, (c, p) in enumerate(cs)]
    for (c, p), got in zip(cs, run_each(infinity_run, 2, args, timeout=90, comm_timeout=30), strict=True):
        check(c, got, launch(fsdp_run, 2, c=c, precision=p), p)
