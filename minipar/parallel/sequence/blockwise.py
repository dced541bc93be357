"""Attention one score block at a time: the online softmax (Milakov & Gimelshein 2018, "Online
normalizer calculation for softmax"; FlashAttention, Dao et al. 2022, Alg. 1) and its backward from
the saved log-sum-exp (FlashAttention-2, Dao 2023, Alg. 2).

Arrays are per head: queries ``q`` (b, H, n_q, d), keys and values ``k``, ``v`` (b, H, n_k, d);
positions say where each row sits in the sequence, for the causal mask.

Forward, for each query row, over the key blocks j in any order::

    s_j = q k_j^T / sqrt(d)                  (masked entries -inf)
    m'  = max(m, rowmax s_j)                 running max
    l   = e^(m - m') l + rowsum e^(s_j - m')  running sum, rescaled
    acc = e^(m - m') acc + e^(s_j - m') v_j   unnormalised output, rescaled
    out = acc / l,  lse = m + log l           (after the last block)

Backward, with D = rowsum(dout * out) and p_j = e^(s_j - lse) recomputed per block::

    dv_j += p_j^T dout;  ds_j = p_j * (dout v_j^T - D);  dq += ds_j k_j / sqrt(d);  dk_j += ds_j^T q / sqrt(d)

Only one block of scores, (b, H, n_q, n_k), exists at a time.
"""

from __future__ import annotations

import numpy as np

from minipar.checks import whole, wholes

VISIBLE, PARTIAL, HIDDEN = "visible", "partial", "hidden"


def visibility(q_piece: tuple[int, int], k_piece: tuple[int, int], causal: bool) -> str:
    """How much of the score block (queries at positions ``q_piece``, keys at ``k_piece``, both
    ``[start, stop)``) a causal mask leaves: all of it, part of it, or nothing (skip the block)."""
    for name, piece in (("q_piece", q_piece), ("k_piece", k_piece)):
        if len(piece) != 2 or not 0 <= piece[0] <= piece[1]:
            raise ValueError(f"visibility: {name}={piece!r} must be positions (start, stop) with 0 <= start <= stop")
    if not causal or k_piece[1] - 1 <= q_piece[0]:
        return VISIBLE
    return HIDDEN if k_piece[0] > q_piece[1] - 1 else PARTIAL


def scores(q: np.ndarray, k: np.ndarray, scale: float, q_piece: tuple[int, int], k_piece: tuple[int, int],
           causal: bool) -> np.ndarray:
    """``q k^T * scale`` with -inf where a key comes after its query (causal): a new (b, H, n_q, n_k)
    array, the only score buffer a block allocates. A hidden block comes back all -inf (callers
    that can, skip it)."""
    s = q @ k.transpose(0, 1, 3, 2)
    s *= scale
    if visibility(q_piece, k_piece, causal) != VISIBLE:  # Ring Attention skips HIDDEN blocks; masked anyway
        qpos, kpos = np.arange(*q_piece), np.arange(*k_piece)
        s[..., kpos[None, :] > qpos[:, None]] = -np.inf
    return s


class OnlineSoftmax:
    """Running max ``m``, running sum ``l`` and unnormalised output ``acc`` of every query row.

    ``update(rows, s, v)`` folds in one block of scores ``s`` (b, H, len(rows), n_k), overwritten
    with its exponentials, and its values ``v``. Exact for any order of blocks, for rows whose
    scores in a block are all masked (-inf: the block adds nothing) and for very large logits (every
    exponent is <= 0)."""

    def __init__(self, b: int, heads: int, n: int, d: int, dtype: np.dtype) -> None:
        wholes("OnlineSoftmax", b=b, heads=heads, d=d)
        whole("OnlineSoftmax", "n", n, least=0)
        self.m = np.full((b, heads, n), -np.inf, dtype=dtype)
        self.l = np.zeros((b, heads, n), dtype=dtype)
        self.acc = np.zeros((b, heads, n, d), dtype=dtype)

    def update(self, rows: slice, s: np.ndarray, v: np.ndarray) -> None:
        m_old = self.m[..., rows]
        m_new = np.maximum(m_old, s.max(axis=-1))
        shift = np.where(np.isfinite(m_new), m_new, 0.0)  # a row with nothing seen yet stays at 0
        alpha = np.exp(m_old - shift)  # e^(m - m'): 0 when m = -inf
        s -= shift[..., None]
        np.exp(s, out=s)
        self.l[..., rows] = alpha * self.l[..., rows] + s.sum(axis=-1)
        self.acc[..., rows, :] = alpha[..., None] * self.acc[..., rows, :] + s @ v
        self.m[..., rows] = m_new

    def result(self, out: np.ndarray) -> np.ndarray:
        """Write ``acc / l`` into ``out`` (b, H, n, d; 0 for a row that saw no key); return the
        log-sum-exp ``m + log l`` (b, H, n; -inf for such a row), all backward needs."""
        seen = self.l > 0
        np.divide(self.acc, self.l[..., None], out=out, where=seen[..., None])
        out[~seen] = 0.0
        with np.errstate(divide="ignore"):
            return self.m + np.log(self.l)


def block_backward(q: np.ndarray, k: np.ndarray, v: np.ndarray, dout: np.ndarray, lse: np.ndarray,
                   delta: np.ndarray, scale: float, q_piece: tuple[int, int], k_piece: tuple[int, int],
                   causal: bool, dq: np.ndarray, dk: np.ndarray, dv: np.ndarray) -> None:
    """Add one score block's share to ``dq``, ``dk``, ``dv`` (views of the accumulators);
    ``delta`` = rowsum(dout * out). Recomputes the block's probabilities from ``lse``."""
    p = scores(q, k, scale, q_piece, k_piece, causal)
    p -= np.where(np.isfinite(lse), lse, 0.0)[..., None]
    np.exp(p, out=p)
    dv += p.transpose(0, 1, 3, 2) @ dout
    ds = dout @ v.transpose(0, 1, 3, 2)
    ds -= delta[..., None]
    ds *= p
    ds *= scale
    dq += ds @ k
    dk += ds.transpose(0, 1, 3, 2) @ q
