"""tests/tolerances.py's AdamW drift bound holds for ``minipar.optim.AdamW`` itself: two runs whose
gradients differ by at most D at every step end within the bound, wherever the gradients sit (zero up
to rounding, about eps, O(1)); the step ratio r_t is reached; where gradients are O(1) the bound stays
tight."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st
from strategies import budget
from tolerances import BETAS, adamw_drift, step_ratio

from minipar.autograd import Tensor
from minipar.optim import AdamW


def adamw_run(start: np.ndarray, grads: list[np.ndarray], lr: float, wd: float) -> np.ndarray:
    p = Tensor(start.copy())
    opt = AdamW([p], lr=lr, weight_decay=wd)
    for g in grads:
        p.grad = g
        opt.step()
    return p.data


@budget(20)
@given(seed=st.integers(0, 2**32 - 1), steps=st.integers(1, 6), lr=st.sampled_from([1e-3, 1e-2, 0.05]),
       wd=st.sampled_from([0.0, 0.01, 0.1]), atol=st.sampled_from([1e-14, 1e-12]), rtol=st.sampled_from([0.0, 1e-10]))
@example(seed=0, steps=2, lr=1e-2, wd=0.1, atol=1e-12, rtol=1e-10)
def test_two_runs_within_the_gradient_tolerance_stay_within_the_drift(seed, steps, lr, wd, atol, rtol) -> None:
    """Gradients at every scale from rounding noise to O(1), each perturbed at every step by up to the
    tolerance (both signs, at the limit for most elements): the parameters after the steps differ by
    at most the bound, plus the update's own rounding (a few ulps of the parameter per step)."""
    rng = np.random.default_rng(seed)
    n = 4000
    scale = 10.0 ** rng.uniform(-17, 0, n)  # noise below eps up to O(1) gradients
    sign_flips = rng.random(n) < 0.3  # some entries change sign from step to step
    start = rng.normal(size=n)
    want_grads, got_grads = [], []
    for _ in range(steps):
        g = scale * rng.normal(size=n) * np.where(sign_flips, rng.choice([-1.0, 1.0], n), 1.0)
        limit = atol + rtol * np.abs(g)
        got_grads.append(g + limit * rng.choice([-1.0, 1.0, rng.uniform(-1, 1)], n))
        want_grads.append(g)
    want = adamw_run(start, want_grads, lr, wd)
    got = adamw_run(start, got_grads, lr, wd)
    drift = adamw_drift(want_grads, lr, {"rtol": rtol, "atol": atol})
    assert (np.abs(got - want) <= drift + 4 * steps * np.spacing(np.abs(want) + lr)).all()


def moment_ratio(grads: np.ndarray) -> float:
    """|m_hat| / sqrt(v_hat) after the gradients ``grads`` (oldest first), from the moments' sums."""
    b1, b2 = BETAS
    t = len(grads)
    age = np.arange(t - 1, -1, -1)
    m = np.sum((1 - b1) * b1**age * grads) / (1 - b1**t)
    v = np.sum((1 - b2) * b2**age * grads * grads) / (1 - b2**t)
    return float(abs(m) / np.sqrt(v))


def test_the_step_ratio_is_reached_and_bounds_every_step() -> None:
    """r_1 = 1; gradients proportional to (b1 / b2)^(t-i) give m_hat / sqrt(v_hat) = r_t (the
    Cauchy-Schwarz equality: sqrt(u_i) g_i proportional to w_i / sqrt(u_i)), and random histories stay
    below it."""
    b1, b2 = BETAS
    assert step_ratio(1) == 1.0
    assert [round(step_ratio(t), 4) for t in (2, 3)] == [1.0014, 1.0036]
    rng = np.random.default_rng(1)
    for t in range(1, 12):
        extreme = (b1 / b2) ** np.arange(t - 1, -1, -1.0)
        assert moment_ratio(extreme) == pytest.approx(step_ratio(t), rel=1e-13)
        assert all(moment_ratio(g) <= step_ratio(t) * (1 + 1e-13) for g in rng.normal(size=(50, t)))


def test_the_drift_is_tight_where_gradients_are_large_and_lr_d_over_eps_where_they_are_noise() -> None:
    """lr 1e-2, D = 1e-12, three steps: gradients of 0.2-1 drift by about lr D (1 + r_t) / |g| per step,
    < 2e-13 in all; gradients of pure rounding noise (1e-17) by about 3 x 2 lr D / eps = 6e-6, far
    below a wrong update's O(lr)."""
    grads = [np.array([1.0, -0.5, 1e-17]), np.array([0.8, 0.7, -3e-17]), np.array([1.1, -0.2, 2e-17])]
    drift = adamw_drift(grads, 1e-2, {"rtol": 0.0, "atol": 1e-12})
    assert (drift[:2] < 2e-13).all()
    assert 5e-6 < drift[2] < 7e-6
