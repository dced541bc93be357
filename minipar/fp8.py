"""FP8 matmuls in the linear layers: e4m3 operands forward, e5m2 gradients backward, with scales.

Formats (Micikevicius et al. 2022, "FP8 Formats for Deep Learning"): e4m3 (4 exponent, 3 mantissa
bits, largest 448, no infinities: ``ml_dtypes.float8_e4m3fn``) for the forward operands, activations
and weights; e5m2 (5 and 2, largest 57344: ``float8_e5m2``) for the gradients, which need range more
than precision. A tensor is multiplied by a scale ``s`` before the cast so that its largest magnitude
lands near the format's largest value, and values that would overflow saturate (as Transformer
Engine casts). Scales here are powers of two (as the E8M0 scales of the MX formats), so dividing by
``s`` again is exact.

Two recipes (a scale without a recipe is refused, ``check_recipe``):

- ``DelayedScaling`` (NVIDIA Transformer Engine's default recipe): one scale per tensor, from the
  largest ``amax`` in the history of the last ``history`` steps' amaxes of that tensor; this step's
  amax joins the history after the cast (the first step, with no history, uses its own). With
  tensor parallelism the amax of a sharded tensor is all-reduced (max) over the tensor-parallel
  group, as Transformer Engine reduces it, so every rank casts with the single-process scale.
- ``BlockScaling`` (DeepSeek-V3 technical report, Sec. 3.3.1, "fine-grained quantization"): one
  scale per block from the block's own amax: ``1 x block`` tiles along the features of activations
  and gradients, ``block x block`` blocks of weights (``block = 128`` in the report). Every block
  lies in one rank's shard when ``block`` divides the shard, so no scale needs communication.
  The report re-tiles activations ``block x 1`` for the weight-gradient GEMM and casts gradients to
  e4m3; here both backward GEMMs reuse the forward's cast operands and gradients are e5m2.

Emulation: the operands are cast to FP8 values (ml_dtypes), the GEMM multiplies the dequantised
values. Products of two FP8 numbers are exact in fp32 (8 significant bits); the sums are taken in
float64, which holds them exactly here: per-tensor e4m3 operands are multiples of ``2^-9`` below
``2^8.8``, so a dot of ``K`` products is a multiple of ``2^-18`` below ``K 2^35.6``, exact in 53 bits
for ``K < 2^17``. The GEMM's output is then cast once to the model's dtype: an fp32 model gets the
exact product rounded once to fp32, an ideal fp32 accumulator (hardware rounds along the way, and
Hopper's FP8 accumulation keeps ~14 bits, DeepSeek-V3 Sec. 3.3.2; not modelled). Being exact, the
sums do not depend on their order, so a tensor-parallel layer equals the single-process layer
bit for bit (``parallel/tensor/fp8.py``). The backward's e5m2 x e4m3 sums and block-scaled sums are
exact while one dot's products span fewer than ``53 - 8 - log2 K`` binades; wider, they round and
two orders of summation differ by at most ``2 gamma_K sum |p|`` (``tests/test_fp8.py``), which the
rounding to fp32 hides but at ties.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import ml_dtypes
import numpy as np

from minipar import functional as F
from minipar.autograd import Context, Function, Tensor

E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)  # forward operands
E5M2 = np.dtype(ml_dtypes.float8_e5m2)  # gradients
ROLES = {"x": E4M3, "w": E4M3, "dy": E5M2}  # activation, weight, output gradient


@dataclasses.dataclass(frozen=True)
class DelayedScaling:
    """Per-tensor scales from the largest amax of the last ``history`` steps (Transformer Engine);
    ``margin``: the scale is divided by ``2**margin`` more (headroom for growing amaxes)."""

    history: int = 16
    margin: int = 0


@dataclasses.dataclass(frozen=True)
class BlockScaling:
    """Per-block scales from each block's own amax (DeepSeek-V3): ``1 x block`` tiles of
    activations and gradients, ``block x block`` blocks of weights."""

    block: int = 128


Recipe = DelayedScaling | BlockScaling
RECIPES = {"delayed": DelayedScaling, "block": BlockScaling}


def check_recipe(recipe: Any) -> Recipe:
    """The recipe, or ValueError in one line: none given, an unknown name or type, bad numbers.
    A name ('delayed', 'block') gives that recipe with its defaults."""
    if recipe is None:
        raise ValueError("FP8 matmuls need a scaling recipe: fp8.DelayedScaling() (per-tensor scales "
                         "from an amax history) or fp8.BlockScaling(128) (per-block scales)")
    if isinstance(recipe, str) and recipe in RECIPES:
        recipe = RECIPES[recipe]()
    if not isinstance(recipe, DelayedScaling | BlockScaling):
        raise ValueError(f"unknown FP8 recipe {recipe!r}; use 'delayed', 'block', "
                         "fp8.DelayedScaling(...) or fp8.BlockScaling(...)")
    if isinstance(recipe, DelayedScaling) and (recipe.history < 1 or recipe.margin < 0):
        raise ValueError(f"{recipe}: history must be >= 1 and margin >= 0")
    if isinstance(recipe, BlockScaling) and recipe.block < 1:
        raise ValueError(f"{recipe}: block must be >= 1")
    return recipe


def pow2_scale(amax: np.ndarray | float, fmt: np.dtype, margin: int = 0) -> np.ndarray:
    """The largest power of two ``s`` with ``amax s <= max(fmt) / 2**margin``; 1 where amax is 0."""
    amax = np.asarray(amax, dtype=np.float64)
    fmax = float(ml_dtypes.finfo(fmt).max)
    with np.errstate(divide="ignore"):
        e = np.floor(np.log2(fmax / amax)) - margin
    return np.where((amax > 0) & np.isfinite(e), np.exp2(np.where(np.isfinite(e), e, 0.0)), 1.0)


def expand(scale: np.ndarray | float, shape: tuple[int, ...]) -> np.ndarray | float:
    """A scale per tile (``(rows/th, cols/tw)``, as block scaling keeps it) repeated to ``shape``;
    a per-tensor scale as it is."""
    scale = np.asarray(scale)
    if scale.ndim < 2 or scale.shape == tuple(shape):
        return scale
    return np.repeat(np.repeat(scale, shape[0] // scale.shape[0], 0), shape[1] // scale.shape[1], 1)


def cast(a: np.ndarray, fmt: np.dtype, scale: np.ndarray | float) -> np.ndarray:
    """``a * scale`` saturated to ``fmt``'s range and rounded to ``fmt`` (nearest even); ``scale``
    per tensor or per tile (``expand``)."""
    fmax = float(ml_dtypes.finfo(fmt).max)
    return np.clip(np.asarray(a, dtype=np.float64) * expand(scale, a.shape), -fmax, fmax).astype(fmt)


def dequantise(q: np.ndarray, scale: np.ndarray | float) -> np.ndarray:
    """The float64 values an FP8 array ``q`` cast with ``scale`` stands for (exact: ``scale`` is a power of two)."""
    return q.astype(np.float64) / expand(scale, q.shape)


def _tiles(a: np.ndarray, tile: tuple[int, int]) -> np.ndarray:
    """``a`` (2-D) as ``(rows/th, th, cols/tw, tw)``: one tile per (axis 0, axis 2) index."""
    (n, m), (th, tw) = a.shape, tile
    return a.reshape(n // th, th, m // tw, tw)


def block_amax(a: np.ndarray, tile: tuple[int, int]) -> np.ndarray:
    """Largest magnitude of every tile: ``(rows/th, cols/tw)``."""
    return np.abs(_tiles(a, tile)).max(axis=(1, 3))


class Fp8Meta:
    """One linear layer's FP8 state: its recipe, the amax history of each role (``x``, ``w``,
    ``dy``) and the scales last used (the lesson shows them)."""

    def __init__(self, recipe: Recipe) -> None:
        self.recipe = check_recipe(recipe)
        self.history: dict[str, list[float]] = {role: [] for role in ROLES}
        self.scales: dict[str, np.ndarray] = {}
        self.saturated: dict[str, int] = dict.fromkeys(ROLES, 0)

    def tile(self, role: str) -> tuple[int, int]:
        b = self.recipe.block
        return (b, b) if role == "w" else (1, b)

    def quantise(self, role: str, a: np.ndarray, group: Any = None) -> tuple[np.ndarray, np.ndarray]:
        """``(q, scale)``: ``a`` (2-D) cast to its role's format, the scale one number or one per tile
        (kept compact: 1/b^2 or 1/b of ``a``'s numbers). ``group``: the communicator whose
        ranks hold the other shards of ``a`` (the amax is their max); None for a whole tensor."""
        fmt = ROLES[role]
        if isinstance(self.recipe, BlockScaling):
            scale = pow2_scale(block_amax(a, self.tile(role)), fmt)
        else:
            amax = float(np.abs(a).max()) if a.size else 0.0
            if group is not None:
                from minipar.parallel.tensor.comm_ops import ALGORITHM  # lazily: the engine loads alone

                amax = float(group.allreduce(np.array([amax]), op="max", algorithm=ALGORITHM)[0])
            past = self.history[role]
            scale = pow2_scale(max(past) if past else amax, fmt, self.recipe.margin)
            past.append(amax)
            del past[:-self.recipe.history]
        fmax = float(ml_dtypes.finfo(fmt).max)
        self.saturated[role] += int(np.count_nonzero(np.abs(a) * expand(scale, a.shape) > fmax))
        self.scales[role] = scale
        return cast(a, fmt, scale), scale


def _rows(a: np.ndarray) -> np.ndarray:
    return a.reshape(-1, a.shape[-1])


class Fp8Matmul(Function):
    """``x @ w`` with FP8 operands (module docstring): forward casts ``x`` and ``w`` to e4m3,
    backward casts the output gradient to e5m2 and runs ``dx = dy w^T``, ``dw = x^T dy`` on the cast
    operands kept from forward (one byte per number, and their scales). Sums exact in float64; the
    output is cast to ``out_dtype``, ``dx`` to ``x``'s dtype. ``groups``: the communicators over which
    ``x``, ``w`` and ``dy`` are sharded (None: whole on this rank).
    Call as ``apply(x, w, meta, groups, out_dtype)``."""

    @staticmethod
    def forward(ctx: Context, x: np.ndarray, w: np.ndarray, meta: Fp8Meta, groups: tuple[Any, Any, Any],
                out_dtype: Any) -> np.ndarray:
        qx, sx = meta.quantise("x", _rows(x), groups[0])
        qw, sw = meta.quantise("w", w, groups[1])
        ctx.save_for_backward(qx, sx, qw, sw)
        ctx.meta, ctx.dy_group, ctx.shape, ctx.dtype = meta, groups[2], x.shape, x.dtype
        y = dequantise(qx, sx) @ dequantise(qw, sw)
        return y.astype(out_dtype, copy=False).reshape(*x.shape[:-1], w.shape[1])

    @staticmethod
    def backward(ctx: Context, g: np.ndarray) -> tuple[np.ndarray | None, ...]:
        qx, sx, qw, sw = ctx.saved
        need_x, need_w = ctx.needs_input_grad[:2]
        if not hasattr(ctx, "dy"):  # once, also when a split backward asks for dx and dw apart
            ctx.dy = dequantise(*ctx.meta.quantise("dy", _rows(g), ctx.dy_group))
        dx = (ctx.dy @ dequantise(qw, sw).T).astype(ctx.dtype, copy=False).reshape(ctx.shape) if need_x else None
        dw = dequantise(qx, sx).T @ ctx.dy if need_w else None
        return dx, dw, None, None, None


class Cast(Function):
    """``x`` in ``dtype`` forward, the gradient back in ``x``'s dtype: where an exact float64 sum
    (a tensor-parallel partial GEMM) is rounded once, after its all-reduce."""

    @staticmethod
    def forward(ctx: Context, x: np.ndarray, dtype: Any) -> np.ndarray:
        ctx.dtype = x.dtype
        return x.astype(dtype)

    @staticmethod
    def backward(ctx: Context, g: np.ndarray) -> tuple[np.ndarray, None]:
        return g.astype(ctx.dtype), None


def check_shape(recipe: Recipe, name: str, shape: tuple[int, ...]) -> None:
    """ValueError in one line unless a block recipe's block divides both axes of weight ``shape``."""
    if isinstance(recipe, BlockScaling) and any(n % recipe.block for n in shape):
        raise ValueError(f"BlockScaling: block {recipe.block} does not divide {name} of shape "
                         f"{tuple(shape)} on this rank; choose a block that divides both")


def linear(x: Tensor, weight: Tensor, bias: Tensor | None, meta: Fp8Meta) -> Tensor:
    """``nn.Linear``'s product with FP8 operands (``Fp8Matmul``); the bias is added in ``x``'s dtype."""
    y = Fp8Matmul.apply(x, weight, meta, (None, None, None), x.dtype)
    return F._AddBias.apply(y, bias) if bias is not None else y


def enable(model: Any, recipe: Any, skip: tuple[str, ...] = ("head",)) -> Any:
    """Give every linear layer of ``model`` (``nn.Linear``, the tensor-parallel column and row
    linears) its own ``Fp8Meta(recipe)``; modules named in ``skip`` keep full precision (the output
    head, as Transformer Engine and DeepSeek-V3 keep it). Refused in one line, before any
    communication, without a recipe or when a block does not divide a weight. Returns ``model``."""
    recipe = check_recipe(recipe)
    found = []

    def visit(module: Any, name: str) -> None:
        if hasattr(type(module), "fp8"):
            found.append((name, module))
        for child_name, child in module.children():
            if child_name not in skip:
                visit(child, f"{name}{child_name}.")

    visit(model, "")
    for name, module in found:
        check_shape(recipe, f"{name}weight", module.weight.shape)
    for _, module in found:
        module.fp8 = Fp8Meta(recipe)
    return model
