"""Composable hypothesis strategies shared by the tests (in the style of minitorch's)."""

from __future__ import annotations

import os

import numpy as np
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

THOROUGH = os.environ.get("HYPOTHESIS_PROFILE") == "thorough"
SCALE = 10 if THOROUGH else 1


def budget(n: int) -> settings:
    """``@budget(n)``: this test runs ``n`` drawn examples by default and ``10 n`` under the thorough profile.

    For an ``mpiexec`` property, ``n`` counts jobs; each job runs a list of drawn configurations.
    """
    return settings(max_examples=n * SCALE)


def shapes(min_dims: int = 1, max_dims: int = 3, min_side: int = 1, max_side: int = 5) -> st.SearchStrategy:
    return hnp.array_shapes(min_dims=min_dims, max_dims=max_dims, min_side=min_side, max_side=max_side)


@st.composite
def broadcastable_pair(draw: st.DrawFn, max_dims: int = 3) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Two shapes that broadcast together (either side may have 1s or fewer leading dims)."""
    shapes_ = draw(hnp.mutually_broadcastable_shapes(num_shapes=2, max_dims=max_dims, min_side=1, max_side=4))
    return shapes_.input_shapes


def arrays(shape: tuple[int, ...], low: float = -2.0, high: float = 2.0, dtype: type = np.float64) -> st.SearchStrategy:
    """Arrays with well-scaled finite values (central differences stay accurate)."""
    def make(seed: int) -> np.ndarray:
        return np.random.default_rng(seed).uniform(low, high, size=shape).astype(dtype)

    return st.integers(0, 2**32 - 1).map(make)


def array(draw: st.DrawFn, shape: tuple[int, ...], **kw: float) -> np.ndarray:
    return draw(arrays(shape, **kw))


@st.composite
def matmul_shapes(draw: st.DrawFn) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(a, b) shapes for batched matmul with broadcasting over leading dims."""
    n, k, m = draw(st.integers(1, 4)), draw(st.integers(1, 4)), draw(st.integers(1, 4))
    batch = draw(st.sampled_from([(), (2,), (3, 1), (1, 2)]))
    other = draw(st.sampled_from([(), batch[-1:] if batch else ()]))
    return (*batch, n, k), (*other, k, m)
