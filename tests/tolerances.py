"""How far two correct runs' parameters may drift apart after AdamW steps: a bound derived from the
update rule, for the tests that hold a parallel run's parameters against one process's.

Why a bound and not one tolerance. Both runs compute each gradient as the same sums in another order,
so their gradients differ by rounding, which the tests assert before the step: |g' - g| <= D,
``D = atol + rtol |g|`` (the test's gradient tolerance). Where |g| >> eps AdamW's step is about
``lr sign(g)`` and hardly notices D. Where the exact gradient is zero or cancels, the computed one *is*
rounding noise (far below eps = 1e-8), and AdamW divides it by its own root plus eps: a step of up to
``lr D / eps`` whose size and sign depend on how the CPU rounds (numpy picks other SIMD kernels for
exp, tanh and reductions on AVX-512, AVX2 and SSE machines). Such parameters in the tests' models:

- attention's key bias, always: softmax ignores a number added to every score of a row, and a key
  bias adds ``q . b`` to all of them (measured: |g| 1e-23 to 1e-16);
- with d_model = 2, everything below the final layer norm (embeddings, every block): a 2-wide layer
  norm outputs +-1 whatever its input's scale, so the gradient reaches its input only through the
  norm's eps: small, not zero (|g| 1e-9 to 1e-5), yet where AdamW's slope is still up to lr / eps
  (``strategies.sp_configs`` says why d_model = 1 is not drawn);
- query and key weights and biases on a one-token sequence: a softmax over one key is 1 (exactly zero
  in one process; a blockwise softmax may leave rounding).

The derivation (``minipar.optim.AdamW``, PyTorch's rule) at step t, with the bias corrections folded
into the weights::

    m = sum_i w_i g_i,  s = sqrt(sum_i u_i g_i^2),  p <- (1 - lr wd) p - lr m / (s + eps)
    w_i = (1 - b1) b1^(t-i) / (1 - b1^t),  u_i = (1 - b2) b2^(t-i) / (1 - b2^t)

Both weight sets are >= 0 and sum to 1. If every g_i moves by at most D:

1. |m' - m| <= D (a weighted mean) and |s' - s| <= D (a weighted 2-norm: the triangle inequality);
2. |m| <= r_t s by Cauchy-Schwarz, ``r_t = sqrt(sum_i w_i^2 / u_i)`` (``step_ratio``: r_1 = 1,
   r_3 = 1.004, r_t -> 7.3 for b1 = 0.9, b2 = 0.999), so an AdamW step is at most ``r_t lr`` whatever
   the gradients;
3. |m'/(s'+eps) - m/(s+eps)| <= |m'-m| / (s'+eps) + |m| |s-s'| / ((s+eps)(s'+eps))
   <= D (1 + r_t) / (s' + eps), and s' >= s - D;
4. weight decay multiplies an earlier difference by 1 - lr wd <= 1, so differences add up over steps.

Hence after T steps, per element, with s_t the reference run's ``sqrt(v_hat)`` and D_t the largest
allowed gradient difference of steps 1..t::

    |p' - p| <= sum_t lr D_t (1 + r_t) / (max(s_t - D_t, 0) + eps)   (``adamw_drift``)

plus the rounding of the update's own arithmetic (the test's parameter tolerance). Where |g| >> eps
this is ~ lr D / |g|, tight; where the gradient is noise it is ~ 2 lr D / eps per step (with D = 1e-12
and lr = 1e-2: 2e-6, far below the O(lr) that a wrong update, a lost shard or a stale moment gives).

The bound assumes the gradients agree within D at *every* step, while the tests assert it at step 0,
where both runs start from the same parameters. Later steps compute the same sums on parameters that
already differ, so their gradients also differ by the loss's curvature times that difference, which
nothing here bounds: an element whose exact gradient is zero changes nothing downstream, but in a
d_model = 2 model (above) the layer norms make the curvature large, and the thorough profile found a
step-1 gradient 3 D off (test_sequence_parallel: ring, P = 3, d 2), its final parameters 1e-5 of this
bound off.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence

import numpy as np

from minipar.optim import AdamW

_DEFAULTS = inspect.signature(AdamW).parameters  # lr, betas, eps as minipar.optim.AdamW has them
BETAS: tuple[float, float] = _DEFAULTS["betas"].default
EPS: float = _DEFAULTS["eps"].default


def step_ratio(t: int, betas: tuple[float, float] = BETAS) -> float:
    """``r_t``: the largest |m_hat| / sqrt(v_hat) at AdamW's step t (1-based) over all gradient
    histories, so one step moves an entry by at most ``r_t lr`` (plus weight decay). Cauchy-Schwarz
    on the moments' weights; equality when g_i is proportional to (b1 / b2)^(t-i)."""
    b1, b2 = betas
    ratio = b1 * b1 / b2
    weights = sum(ratio**k for k in range(t))  # sum_i w_i^2 / u_i without its constant factors
    return float((1 - b1) / (1 - b1**t) * np.sqrt((1 - b2**t) / (1 - b2) * weights))


def adamw_drift(grads: Sequence[np.ndarray], lr: float, grad_tol: Mapping[str, float],
                betas: tuple[float, float] = BETAS, eps: float = EPS) -> np.ndarray:
    """Per element, how far a run whose gradients stay within ``grad_tol`` (``rtol``, ``atol``) of
    ``grads`` (the reference run's gradient at each AdamW step, in order) may end up from the
    reference's parameters after those steps: ``sum_t lr D_t (1 + r_t) / (max(s_t - D_t, 0) + eps)``
    (the module docstring derives it)."""
    b1, b2 = betas
    v = np.zeros_like(grads[0], dtype=np.float64)
    d = np.zeros_like(v)
    drift = np.zeros_like(v)
    for t, g in enumerate(grads, start=1):
        g = np.asarray(g, dtype=np.float64)
        v = b2 * v + (1 - b2) * g * g
        s = np.sqrt(v / (1 - b2**t))
        d = np.maximum(d, grad_tol["atol"] + grad_tol["rtol"] * np.abs(g))
        drift += lr * d * (1 + step_ratio(t, betas)) / (np.maximum(s - d, 0.0) + eps)
    return drift


def assert_close_after_adamw(got: np.ndarray, want: np.ndarray, grads: Sequence[np.ndarray], lr: float,
                             grad_tol: Mapping[str, float], tol: Mapping[str, float],
                             betas: tuple[float, float] = BETAS, eps: float = EPS, err_msg: str = "") -> None:
    """``got`` equals the reference's parameters ``want`` after ``len(grads)`` AdamW steps within
    ``tol`` (``rtol``, ``atol``: the update's own rounding) plus ``adamw_drift``, element by element.
    ``grads``: the reference's gradient at each step (shaped like ``want``); ``grad_tol``: what the
    test asserts of the gradients before the step."""
    got, want = np.asarray(got, dtype=np.float64), np.asarray(want, dtype=np.float64)
    assert got.shape == want.shape, (err_msg, got.shape, want.shape)
    drift = adamw_drift(grads, lr, grad_tol, betas, eps)
    allowed = tol["atol"] + tol["rtol"] * np.abs(want) + drift
    diff = np.abs(got - want)
    if not (diff <= allowed).all():  # also fails on nan
        i = np.unravel_index(np.argmax(np.where(np.isnan(diff), np.inf, diff - allowed)), diff.shape)
        largest = max(float(np.abs(g[i])) for g in grads)
        raise AssertionError(
            f"{err_msg}: {int((~(diff <= allowed)).sum())} of {diff.size} elements differ by more than AdamW's "
            f"drift bound; at {tuple(int(k) for k in i)}: got {got[i]!r}, want {want[i]!r}, |difference| "
            f"{diff[i]:.3g} > {allowed[i]:.3g} (tolerance {allowed[i] - drift[i]:.3g} + drift {drift[i]:.3g}, "
            f"largest |reference gradient| there {largest:.3g})")
