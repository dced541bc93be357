"""SGD and AdamW steps against their update formulas, written out independently here."""

from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from minipar import Tensor
from minipar.optim import SGD, AdamW


def _params(seed: int) -> tuple[list[Tensor], list[list[np.ndarray]]]:
    rng = np.random.default_rng(seed)
    ps = [Tensor(rng.normal(size=(3, 2)), requires_grad=True), Tensor(rng.normal(size=4), requires_grad=True)]
    grads = [[rng.normal(size=p.shape) for p in ps] for _ in range(4)]
    return ps, grads


@given(st.integers(0, 1000), st.sampled_from([0.0, 0.9]), st.sampled_from([0.0, 0.1]))
def test_sgd_momentum(seed, momentum, wd):
    ps, grads = _params(seed)
    ref = [p.data.copy() for p in ps]
    bufs = [None, None]
    opt = SGD(ps, lr=0.1, momentum=momentum, weight_decay=wd)
    for step_grads in grads:
        for i, (p, g) in enumerate(zip(ps, step_grads)):
            p.grad = g
            d = g + wd * ref[i]
            if momentum:
                bufs[i] = d if bufs[i] is None else momentum * bufs[i] + d
                d = bufs[i]
            ref[i] = ref[i] - 0.1 * d
        opt.step()
        for p, r in zip(ps, ref):
            np.testing.assert_allclose(p.data, r, rtol=1e-13, atol=1e-14)


@given(st.integers(0, 1000), st.sampled_from([0.0, 0.01, 0.1]))
def test_adamw_matches_the_pytorch_rule(seed, wd):
    ps, grads = _params(seed)
    lr, b1, b2, eps = 1e-2, 0.9, 0.999, 1e-8
    ref = [p.data.copy() for p in ps]
    m = [np.zeros_like(r) for r in ref]
    v = [np.zeros_like(r) for r in ref]
    opt = AdamW(ps, lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd)
    for t, step_grads in enumerate(grads, start=1):
        for i, (p, g) in enumerate(zip(ps, step_grads)):
            p.grad = g
            ref[i] = ref[i] * (1 - lr * wd)
            m[i] = b1 * m[i] + (1 - b1) * g
            v[i] = b2 * v[i] + (1 - b2) * g**2
            m_hat, v_hat = m[i] / (1 - b1**t), v[i] / (1 - b2**t)
            ref[i] = ref[i] - lr * m_hat / (np.sqrt(v_hat) + eps)
        opt.step()
        for p, r in zip(ps, ref):
            np.testing.assert_allclose(p.data, r, rtol=1e-12, atol=1e-14)
    assert opt.state_bytes() == 2 * sum(p.data.nbytes for p in ps)


def test_parameters_without_gradient_are_left_alone():
    p = Tensor(np.ones(3), requires_grad=True)
    AdamW([p], lr=0.1).step()
    np.testing.assert_array_equal(p.data, np.ones(3))
