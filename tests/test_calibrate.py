"""`minipar calibrate` and `minipar.rates`: the fits on exact synthetic data (alpha-beta, gamma, the
per-op overhead, the optimizer's), a 2-rank calibration (the relations between its fields, which hold
whatever the machine's speed or load: no rate or time is asserted), the cluster file round trip and
refusal, the CLI, and one run under mpiexec."""

from __future__ import annotations

import importlib
import json
import math
import os
import subprocess
import sys
from dataclasses import replace

import pytest

from minipar.calibrate import (
    Measurements,
    busy_cpu_seconds,
    calibrate,
    fit_alpha_beta,
    fit_gamma,
    measure,
    memtotal_bytes,
    quick_options,
    tiers_path,
)
from minipar.cli import main
from minipar.cost.cluster import Cluster, Link
from minipar.cost.presets import NETWORKS
from minipar.rates import (
    GPT,
    Rates,
    compute_rates,
    fit_optimizer,
    fit_overheads,
    gpt_matmul_shapes,
    matmul_flops,
    replay_cluster,
)
from minipar.testing import ROOT, run
from minipar.tiers import Bandwidth

QUICK = quick_options(True)


def _memtotal_by_hand() -> float:
    line = next(x for x in open("/proc/meminfo") if x.startswith("MemTotal:"))
    assert line.split()[2] == "kB"
    return int(line.split()[1]) * 1024.0


def test_fit_alpha_beta_recovers_exact_line():
    sizes = [8, 1024, 65536, 2**20, 2**23]
    seconds = [5e-6 + n * 1e-10 for n in sizes]  # alpha 5 us, 10 GB/s
    link = fit_alpha_beta(sizes, seconds)
    assert link.alpha == pytest.approx(5e-6, rel=1e-9) and link.beta == pytest.approx(1e-10, rel=1e-9)
    two = fit_alpha_beta([100, 300], [1e-3, 2e-3])  # two points: the line through them
    assert two.beta == pytest.approx(5e-6, rel=1e-12) and two.alpha == pytest.approx(5e-4, rel=1e-12)


def test_fit_alpha_beta_clamps_a_negative_intercept_and_slope():
    # t = 2n ns has alpha 0 exactly; shift the small message down so the free fit goes negative
    link = fit_alpha_beta([1000, 2000, 4000], [1.5e-6, 4e-6, 8e-6])
    assert link.alpha == 0.0
    # alpha = 0: beta minimises sum ((n beta - t)/t)^2, i.e. beta = sum(n/t) / sum(n^2/t^2)
    ratios = [1000 / 1.5e-6, 2000 / 4e-6, 4000 / 8e-6]
    assert link.beta == pytest.approx(sum(ratios) / sum(r * r for r in ratios), rel=1e-12)
    flat = fit_alpha_beta([10, 20], [2e-6, 1e-6])  # slower for fewer bytes: beta 0, alpha a weighted mean
    assert flat.beta == 0.0
    assert flat.alpha == pytest.approx((1 / 2e-6 + 1 / 1e-6) / (1 / 4e-12 + 1 / 1e-12), rel=1e-12)


def test_fit_alpha_beta_refuses_fewer_than_two_sizes():
    with pytest.raises(ValueError, match="at least 2 different message sizes"):
        fit_alpha_beta([1024], [1e-5])
    with pytest.raises(ValueError, match="at least 2 different message sizes"):
        fit_alpha_beta([1024, 1024], [1e-5, 2e-5])
    with pytest.raises(ValueError, match="equal length"):
        fit_alpha_beta([1, 2, 3], [1e-5, 2e-5])


def test_fit_gamma_recovers_the_ring_allreduce_residual():
    p, alpha, beta, gamma = 4, 2e-3, 2e-10, 1e-9
    sizes = [2**16, 2**18, 2**20, 2**22]
    # ring all-reduce by hand: 2(p-1) messages, 2(p-1)/p n bytes each way, (p-1)/p n bytes reduced
    seconds = [6 * alpha + 1.5 * n * beta + 0.75 * n * gamma for n in sizes]
    assert fit_gamma(sizes, seconds, p, Link(alpha, beta)) == pytest.approx(gamma, rel=1e-9)
    assert fit_gamma(sizes, seconds, p, Link(alpha, beta), floor=3e-9) == 3e-9


def test_fit_overheads_separates_the_per_op_cost_from_gamma():
    """Two sizes of one GPT run the same 70 ops: a tiny one (1,000 bytes counted) and a larger one
    (2 MB); their times less the matmuls' are 70 c + B gamma / 3."""
    ops, c, gamma = 70, 6e-5, 1.2e-9
    traffic = [1_000.0, 2_000_000.0]
    seconds = [ops * c + b * gamma / 3 for b in traffic]
    got_c, got_gamma = fit_overheads(ops, traffic, seconds)
    assert got_c == pytest.approx(c, rel=1e-9) and got_gamma == pytest.approx(gamma, rel=1e-9)
    # nothing size-dependent (the larger size no slower than its ops): gamma 0, the ops' weighted mean
    flat_c, flat_gamma = fit_overheads(ops, traffic, [ops * c, ops * c * 0.9])
    assert flat_gamma == 0.0 and ops * c * 0.9 < ops * flat_c < ops * c


def test_fit_optimizer_separates_per_tensor_from_per_byte():
    """AdamW over 64 tensors of 8 float64 numbers and over 4 of 32768: each tensor costs ts plus 32
    bytes (parameter, gradient, two moments) a number at og seconds a byte."""
    ts, og = 6e-6, 2e-10
    tensors, numbers = [64, 4], [8, 32768]
    seconds = [k * (ts + 32 * n * og) for k, n in zip(tensors, numbers)]
    got_ts, got_og = fit_optimizer(tensors, numbers, seconds)
    assert got_ts == pytest.approx(ts, rel=1e-9) and got_og == pytest.approx(og, rel=1e-9)


def test_compute_rates_on_two_thread_ranks():
    gpt = {"batch": 1, "seq": 4, "d_model": 8, "heads": 2, "layers": 1, "vocab": 8, "d_ff": 16}
    r0, r1 = run(compute_rates, 2, backend="threads", comm_timeout=60, gpt=gpt, repeats=2)
    assert r0 == r1  # medians over both ranks, on both
    for v in (r0.flops, r0.gamma, r0.op_seconds, r0.tensor_seconds, r0.optimizer_gamma, *r0.step_seconds,
              *r0.optimizer_seconds):
        assert math.isfinite(v) and v >= 0
    assert r0.flops > 0 and r0.gamma > 0  # gamma: at least np.add's


def test_replay_cluster_keeps_the_network_and_adds_this_core(tmp_path):
    shard = {"batch": 1, "seq": 4, "d_model": 4, "heads": 1, "layers": 1, "vocab": 4, "d_ff": 8}
    network = NETWORKS["nvlink"]
    c0, c1 = run(replay_cluster, 2, backend="threads", comm_timeout=60, network=network, shard=shard,
                 path=str(tmp_path / "messages.json"), repeats=2)
    assert c0 == c1  # medians over both ranks, on both
    assert (c0.intra, c0.inter, c0.name) == (network.intra, network.inter, f"{network.name} + this core")
    assert c0.peak_flops > 0 and c0.efficiency == 1.0 and c0.call_seconds == 0.0  # 2 ranks: all of it per step
    assert network.gemm_sms == 108 and (c0.gemm_sms, c0.gemm_curve) == (0, ())  # this core: no A100 waves
    assert c0.message_seconds >= 0 and c0.op_seconds >= 0


def test_gpt_matmul_shapes_and_flops_by_hand():
    shapes = gpt_matmul_shapes(tokens=2, d_model=1, vocab=3)
    # forward: q, k, v, proj (2,1,1); fc (2,1,4); proj (2,4,1); head (2,1,3); each with 2 gradient matmuls
    assert len(shapes) == 21
    assert shapes[:3] == [(2, 1, 1), (2, 1, 1), (1, 2, 1)]
    assert shapes[12:15] == [(2, 1, 4), (2, 4, 1), (1, 2, 4)]
    assert matmul_flops(shapes) == 3 * 2 * (4 * 2 + 2 * 4 + 2 * 4 + 2 * 3)
    assert gpt_matmul_shapes(tokens=2, d_model=1, vocab=3, d_ff=6)[12:14] == [(2, 1, 6), (2, 6, 1)]


def test_memtotal_reads_kilobytes(tmp_path):
    f = tmp_path / "meminfo"
    f.write_text("MemFree:  10 kB\nMemTotal:     1000 kB\n")
    assert memtotal_bytes(str(f)) == 1024000.0
    (tmp_path / "empty").write_text("MemFree: 1 kB\n")
    with pytest.raises(ValueError, match="MemTotal"):
        memtotal_bytes(str(tmp_path / "empty"))


def test_busy_cpu_seconds_leaves_out_idle_and_iowait(tmp_path):
    f = tmp_path / "stat"
    # user nice system idle iowait irq softirq steal guest guest_nice
    f.write_text("cpu  100 20 30 400 50 5 6 7 0 0\ncpu0 1 2 3 4 5 6 7 8 0 0\n")
    assert busy_cpu_seconds(str(f)) == (100 + 20 + 30 + 5 + 6 + 7) / os.sysconf("SC_CLK_TCK")
    assert math.isnan(busy_cpu_seconds(str(tmp_path / "missing")))


def test_table_warns_when_other_programs_ran():
    link = Link(2e-3, 2.5e-10)
    c = Cluster("x", 4, 5e10, 0.4, 6e9, link, link, 2e-9, op_seconds=6.5e-5, tensor_seconds=6e-6, optimizer_gamma=2e-10)
    rates = Rates(2e10, 2e-9, 6.5e-5, 6e-6, 2e-10, (0.004, 0.02), (4e-4, 7e-4))
    m = Measurements(4, "mpi", ((8, 3e-5), (8192, 2e-3)), ((65536, 0.013),), 2.5e-11, 3e-10, rates, 5e10, c)
    assert "warning" not in m.table()
    assert " 20.00 " in m.table()  # GFLOP/s per rank: 5e10 x 0.4
    assert "alpha" in m.table() and "2000.0 us" in m.table() and "4.00 GB/s" in m.table()  # 1 / 2.5e-10
    assert "65.0 us" in m.table() and "6.0 us" in m.table() and "5.00 GB/s" in m.table()  # per op; AdamW
    busy = Measurements(*[getattr(m, f) for f in ("ranks", "backend", "exchange", "allreduce", "add_gamma",
                                                  "reduce_gamma", "rates", "matmul_solo", "cluster")],
                        others_cores=0.8)
    assert "warning: other programs kept 0.80 cores busy" in busy.table()
    disk = replace(m, tiers=Bandwidth(pcie=2e10, nvme_read=2e9, nvme_write=1.5e9, pcie_latency=3e-6,
                                      nvme_read_latency=9e-5, nvme_write_latency=1.2e-4, nvme_sync=2e-3))
    assert "tiers" not in m.table()
    assert "disk write      1.50 GB/s +   120.0 us" in disk.table() and "synced write + 2.00 ms" in disk.table()
    assert "memory copy    20.00 GB/s +     3.0 us" in disk.table()
    assert tiers_path("out/cluster.json") == "out/cluster.tiers.json" and tiers_path("c") == "c.tiers.json"


def _check_cluster(c: Cluster, ranks: int, backend: str) -> None:
    assert c.name.endswith(f"{ranks} ranks, {backend}")
    assert c.gpus_per_node == ranks and c.intra == c.inter
    assert c.memory_bytes == _memtotal_by_hand() / ranks
    # alpha and beta come from a fit that fit_alpha_beta clamps at 0 (a loaded machine can tilt the line:
    # seen alpha 0.0 with two other test runs beside), gamma has the np.add floor, FLOP/s a timed matmul
    for v in (c.intra.alpha, c.intra.beta):
        assert math.isfinite(v) and v >= 0
    for v in (c.gamma, c.peak_flops):
        assert math.isfinite(v) and v > 0
    assert 0 < c.efficiency <= 1


def test_calibrate_two_thread_ranks(tmp_path):
    m0, m1 = run(measure, 2, backend="threads", comm_timeout=30, **QUICK)
    assert m1 is None
    c = m0.cluster
    _check_cluster(c, 2, "threads")
    assert c.flops == pytest.approx(c.peak_flops * c.efficiency, rel=1e-12)
    assert c.peak_flops == max(m0.matmul_solo, m0.rates.flops)
    # the curve: square sides up to the solo peak's, rates relative to it; the GPT's matmuls priced at
    # peak x efficiency x the curve at their side (m k n)^(1/3) take what they measured, the shared rate
    sides = [n for n, _ in c.gemm_curve]
    assert sides == [16.0, 32.0, 64.0, 128.0, 256.0, 384.0] and c.gemm_curve[-1][1] == 1.0
    shapes = gpt_matmul_shapes(GPT["batch"] * GPT["seq"], GPT["d_model"], GPT["vocab"])
    logs = [math.log(n) for n in sides]

    def share(m: int, k: int, n: int) -> float:
        x = min(max(math.log(m * k * n) / 3, logs[0]), logs[-1])
        i = max(j for j in range(len(logs) - 1) if logs[j] <= x)
        (a, ea), (b, eb) = (logs[i], c.gemm_curve[i][1]), (logs[i + 1], c.gemm_curve[i + 1][1])
        return ea + (eb - ea) * (x - a) / (b - a)

    priced = sum(matmul_flops([s]) / (c.flops * share(*s)) for s in shapes)
    if c.efficiency < 1:
        assert priced == pytest.approx(matmul_flops(shapes) / m0.rates.flops, rel=1e-9)
    assert [n for n, _ in m0.exchange] == list(QUICK["sizes"])
    assert c.gamma == max(m0.rates.gamma, m0.add_gamma)
    assert (c.op_seconds, c.tensor_seconds, c.optimizer_gamma) == (m0.rates.op_seconds, m0.rates.tensor_seconds,
                                                                   m0.rates.optimizer_gamma)
    assert c.call_seconds == c.message_seconds == 0.0  # alpha, fitted to wall-clock exchanges, holds them
    assert m0.reduce_gamma >= m0.add_gamma > 0
    assert m0.others_cores >= 0
    path = tmp_path / "cluster.json"
    c.save(str(path))
    assert Cluster.load(str(path)) == c
    assert run(calibrate, 2, backend="threads", comm_timeout=30, **QUICK)[1] is None


def test_cluster_file_missing_field_is_refused_by_name(tmp_path):
    data = json.loads(Cluster("x", 2, 1e10, 0.5, 1e9, Link(1e-5, 1e-10), Link(1e-5, 1e-10), 1e-9).to_json())
    del data["gamma"]
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"missing fields \['gamma'\]"):
        Cluster.load(str(path))


def test_cli_quick_writes_a_loadable_file(tmp_path, capsys):
    out = tmp_path / "c.json"
    assert main(["calibrate", "-n", "2", "--backend", "threads", "-o", str(out), "--quick"]) == 0
    c = Cluster.load(str(out))
    _check_cluster(c, 2, "threads")
    text = capsys.readouterr().out
    assert f"{c.intra.alpha * 1e6:.1f} us" in text and f"{c.flops / 1e9:.2f}" in text
    # the tiers' rates beside it, measured on the output's disk; lesson 07 reads them for --cluster c.json
    tiers = Bandwidth.load(tiers_path(str(out)))
    assert tiers.nvme_write > 0 and tiers.nvme_read > 0
    lesson = importlib.import_module("lessons.07_offload.lesson")
    assert lesson.measured_bandwidth(_Alone(), calibrated=tiers_path(str(out))) == tiers


def test_cli_refuses_one_rank(tmp_path, capsys):
    assert main(["calibrate", "-n", "1", "-o", str(tmp_path / "c.json")]) == 2
    assert "at least 2 ranks" in capsys.readouterr().err
    assert not (tmp_path / "c.json").exists()


@pytest.mark.mpi
def test_cli_under_mpiexec_two_ranks(tmp_path):
    out = tmp_path / "c.json"
    proc = subprocess.run([sys.executable, "-m", "minipar.cli", "calibrate", "-n", "2", "-o", str(out), "--quick"],
                          capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    c = Cluster.load(str(out))
    _check_cluster(c, 2, "mpi")
    # the printed fit is the file's: alpha in microseconds, 1/beta in GB/s ("inf" when the fit's beta is 0,
    # which a loaded machine can give: the fit is non-negative least squares)
    bandwidth = f"{1 / c.intra.beta / 1e9:.2f} GB/s" if c.intra.beta else "inf"
    assert f"{c.intra.alpha * 1e6:.1f} us" in proc.stdout and bandwidth in proc.stdout


class _Alone:
    """A world of one rank, enough for ``measured_bandwidth``."""

    rank = 0

    def allgather_object(self, x):
        return [x]
