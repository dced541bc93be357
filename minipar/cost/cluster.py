"""A cluster as the cost model sees it: compute per GPU, memory per GPU, and the alpha-beta-gamma
costs of links inside a node and across nodes (Thakur, Rabenseifner and Gropp 2005; Hockney 1994).

A message of ``n`` bytes over a link costs ``alpha + n beta`` seconds; reducing ``n`` bytes costs
``n gamma``. A matmul of ``F`` floating-point operations costs ``F / (peak_flops x efficiency)``.
``efficiency`` is the achievable fraction of the peak for a model's large matmuls (a measurement:
``minipar calibrate`` times matmuls on this machine; for published clusters it is a number a paper
reports, named in ``source``).

Five more fields describe what a step costs a CPU beyond its FLOPs and bytes: ``op_seconds`` per
autograd op (Python, the autograd's bookkeeping, numpy's per-call cost), ``call_seconds`` per
collective call or transfer and ``message_seconds`` per message step of a rank's CPU on top of the
link's ``alpha``, and the optimizer's ``tensor_seconds`` per parameter tensor and
``optimizer_gamma`` per byte of state it streams (``minipar.cost.overhead``, docs/formulas.md
section 8). They are 0 for the published GPU clusters: there kernels run on the device and such
costs hide behind them.

A cluster file is JSON with every field of ``Cluster``; ``source``, the five overheads and the GEMM
shape model (``gemm_sms``, ``gemm_curve``: ``minipar.cost.gemm``) may be left out (a file written
before they existed loads with them 0 and empty); a missing or unknown
field is refused with the list of what to add or remove.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, fields
from typing import Any

OVERHEADS = ("op_seconds", "call_seconds", "message_seconds", "tensor_seconds", "optimizer_gamma")  # default 0
GEMM = ("gemm_sms", "gemm_curve")  # default 0 and (): every matmul at ``efficiency``

def _gemm_curve(points: Any, problems: list[str]) -> tuple[tuple[float, float], ...]:
    """A cluster file's ``gemm_curve``: ``[[side, rate], ...]``, sides increasing, every number finite
    and > 0; a problem appended otherwise (and ``()`` returned)."""
    ok = isinstance(points, list) and all(
        isinstance(p, list) and len(p) == 2 and all(isinstance(v, int | float) and not isinstance(v, bool)
                                                    and math.isfinite(v) and v > 0 for v in p) for p in points)
    if ok and all(a[0] < b[0] for a, b in zip(points, points[1:])):
        return tuple((float(a), float(b)) for a, b in points)
    problems.append(f"gemm_curve must be [[side, relative rate], ...] with sides increasing and every number "
                    f"finite and > 0, got {points!r}")
    return ()


@dataclass(frozen=True)
class Link:
    """One kind of link: ``alpha`` seconds per message, ``beta`` seconds per byte."""

    alpha: float
    beta: float

    def seconds(self, nbytes: float, messages: int = 1) -> float:
        return messages * self.alpha + nbytes * self.beta


@dataclass(frozen=True)
class Cluster:
    """GPUs (or ranks) grouped in nodes. ``intra``: the link between two GPUs of a node; ``inter``:
    between nodes (per GPU: the node's network bandwidth shared by its GPUs). ``gamma``: seconds per
    byte reduced. ``memory_bytes``: what one GPU can hold. The overheads (module docstring): seconds
    per autograd op, per collective call or transfer and per message step beyond ``alpha``, per
    parameter tensor the optimizer updates, and per byte of optimizer state it streams."""

    name: str
    gpus_per_node: int
    peak_flops: float
    efficiency: float
    memory_bytes: float
    intra: Link
    inter: Link
    gamma: float
    source: str = ""
    op_seconds: float = 0.0
    call_seconds: float = 0.0
    message_seconds: float = 0.0
    tensor_seconds: float = 0.0
    optimizer_gamma: float = 0.0
    gemm_sms: int = 0  # > 0: GEMMs run in waves of 256 x 128 tiles on this many SMs (``cost.gemm``)
    gemm_curve: tuple[tuple[float, float], ...] = ()  # measured (square side, relative rate) (``cost.gemm``)

    @property
    def flops(self) -> float:
        """Achievable FLOP/s per GPU."""
        return self.peak_flops * self.efficiency

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True)

    def save(self, path: str) -> None:
        """Write the cluster file whole or not at all (a temporary file renamed over ``path``)."""
        tmp = f"{path}.tmp{os.getpid()}"
        with open(tmp, "w") as fh:
            fh.write(self.to_json() + "\n")
        os.replace(tmp, path)

    @classmethod
    def from_dict(cls, data: dict[str, Any], where: str = "cluster") -> Cluster:
        """A ``Cluster`` from a dict like ``to_json``'s; ``ValueError`` naming every problem (a missing
        or unknown field, a value of the wrong type, not finite, or out of range)."""
        problems = []
        names = {f.name for f in fields(cls)}
        missing = sorted(names - {"source", *OVERHEADS, *GEMM} - data.keys())
        unknown = sorted(data.keys() - names)
        if missing:
            problems.append(f"missing fields {missing}")
        if unknown:
            problems.append(f"unknown fields {unknown}")

        def number(key: str, value: Any, low: float, strict: bool) -> bool:
            ok = (isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
                  and (value > low if strict else value >= low))
            if not ok:
                problems.append(f"{key} must be a finite number {'>' if strict else '>='} {low:g}, got {value!r}")
            return ok

        links = {}
        for key in ("intra", "inter"):
            if key not in data:
                continue
            link = data[key]
            if not isinstance(link, dict) or set(link) != {"alpha", "beta"}:
                problems.append(f"{key} must be {{\"alpha\": seconds, \"beta\": seconds per byte}}, got {link!r}")
            elif number(f"{key}.alpha", link["alpha"], 0, False) & number(f"{key}.beta", link["beta"], 0, False):
                links[key] = Link(float(link["alpha"]), float(link["beta"]))
        gpus = data.get("gpus_per_node")
        if "gpus_per_node" in data and (not isinstance(gpus, int) or isinstance(gpus, bool) or gpus < 1):
            problems.append(f"gpus_per_node must be a whole number >= 1, got {gpus!r}")
        for key in ("peak_flops", "efficiency", "memory_bytes"):
            if key in data and number(key, data[key], 0, True) and key == "efficiency" and data[key] > 1:
                problems.append(f"efficiency is a fraction of the peak (0 < efficiency <= 1), got {data[key]}")
        for key in ("gamma", *OVERHEADS):
            if key in data:
                number(key, data[key], 0, False)
        sms = data.get("gemm_sms", 0)
        if not isinstance(sms, int) or isinstance(sms, bool) or sms < 0:
            problems.append(f"gemm_sms must be a whole number >= 0, got {sms!r}")
        curve = _gemm_curve(data.get("gemm_curve", []), problems)
        if "name" in data and not isinstance(data["name"], str):
            problems.append(f"name must be a string, got {data['name']!r}")
        if problems:
            raise ValueError(f"{where}: " + "; ".join(problems))
        return cls(name=data["name"], gpus_per_node=gpus, peak_flops=float(data["peak_flops"]),
                   efficiency=float(data["efficiency"]), memory_bytes=float(data["memory_bytes"]),
                   intra=links["intra"], inter=links["inter"], gamma=float(data["gamma"]),
                   source=str(data.get("source", "")), **{k: float(data.get(k, 0.0)) for k in OVERHEADS},
                   gemm_sms=sms, gemm_curve=curve)

    @classmethod
    def load(cls, path: str) -> Cluster:
        with open(path) as fh:
            try:
                data = json.load(fh)
            except json.JSONDecodeError as exc:
                raise ValueError(f"cluster file {path}: not JSON ({exc})") from None
        if not isinstance(data, dict):
            raise ValueError(f"cluster file {path}: expected a JSON object, got {type(data).__name__}")
        return cls.from_dict(data, f"cluster file {path}")
