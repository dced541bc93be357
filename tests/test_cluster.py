"""Cluster files: loaded whole, or refused with every problem named (missing, unknown, wrong type,
not finite, out of range), never a traceback and never a silently truncated value."""

from __future__ import annotations

import json
import re

import pytest

from minipar.cost.cluster import Cluster, Link

GOOD = {"name": "x", "gpus_per_node": 8, "peak_flops": 1e12, "efficiency": 0.5, "memory_bytes": 1e9,
        "intra": {"alpha": 1e-6, "beta": 1e-9}, "inter": {"alpha": 5e-6, "beta": 4e-9}, "gamma": 1e-10}


def test_round_trip(tmp_path) -> None:
    c = Cluster.from_dict(GOOD)
    assert c.intra == Link(1e-6, 1e-9) and c.inter == Link(5e-6, 4e-9) and c.flops == 5e11
    path = str(tmp_path / "c.json")
    c.save(path)
    assert Cluster.load(path) == c and json.load(open(path))["gpus_per_node"] == 8


def test_cpu_overheads_round_trip_and_default_to_zero(tmp_path) -> None:
    """A file written before the overheads existed (GOOD has none) loads with them 0; written with
    them, it loads them back."""
    old = Cluster.from_dict(GOOD)
    names = ("op_seconds", "call_seconds", "message_seconds", "tensor_seconds", "optimizer_gamma")
    assert [getattr(old, k) for k in names] == [0.0] * 5
    overheads = {"op_seconds": 6e-5, "call_seconds": 1.5e-4, "message_seconds": 5e-5, "tensor_seconds": 6e-6,
                 "optimizer_gamma": 2e-10}
    c = Cluster.from_dict({**GOOD, **overheads})
    path = str(tmp_path / "c.json")
    c.save(path)
    assert Cluster.load(path) == c and {k: json.load(open(path))[k] for k in overheads} == overheads


@pytest.mark.parametrize(("key", "value", "needle"), [
    ("gpus_per_node", 0.5, "gpus_per_node must be a whole number >= 1, got 0.5"),
    ("gpus_per_node", True, "gpus_per_node must be a whole number"),
    ("efficiency", True, "efficiency must be a finite number > 0, got True"),
    ("efficiency", 1.5, "0 < efficiency <= 1"),
    ("peak_flops", float("inf"), "peak_flops must be a finite number > 0, got inf"),
    ("memory_bytes", 0, "memory_bytes must be a finite number > 0"),
    ("gamma", -1.0, "gamma must be a finite number >= 0"),
    ("intra", {"alpha": None, "beta": 1e-9}, "intra.alpha must be a finite number >= 0, got None"),
    ("inter", {"alpha": "1e-6", "beta": 1e-9}, "inter.alpha must be a finite number >= 0, got '1e-6'"),
    ("inter", {"alpha": 1e-6}, "inter must be"),
    ("name", 3, "name must be a string"),
    ("op_seconds", -1e-6, "op_seconds must be a finite number >= 0, got -1e-06"),
    ("optimizer_gamma", float("nan"), "optimizer_gamma must be a finite number >= 0, got nan"),
])
def test_bad_values_refused(key: str, value: object, needle: str) -> None:
    with pytest.raises(ValueError, match="cluster: .*" + re.escape(needle)):
        Cluster.from_dict({**GOOD, key: value})


def test_missing_and_unknown_fields_named_together(tmp_path) -> None:
    data = {k: v for k, v in GOOD.items() if k not in ("gamma", "inter")}
    data["bandwidth"] = 1
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError) as err:
        Cluster.load(str(path))
    assert "missing fields ['gamma', 'inter']" in str(err.value) and "unknown fields ['bandwidth']" in str(err.value)
    path.write_text("[1, 2]")
    with pytest.raises(ValueError, match="expected a JSON object"):
        Cluster.load(str(path))
    path.write_text("{not json")
    with pytest.raises(ValueError, match="not JSON"):
        Cluster.load(str(path))
