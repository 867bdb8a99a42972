"""The seeds' tiled online softmax, written to be read: the algorithm every kernel in ioattn implements.

State per query row: running max m, running sum l = Σ exp(s − m), and an *unnormalised* numerator
o = Σ exp(s − m)·v. A new tile with scores s' rescales the old state by exp(m − m_new) and adds its own terms.
Starting from (−inf, 0, 0), empty or fully-masked tiles leave the state unchanged, and a row that never saw a
key ends with l = 0 and returns 0 (its log-sum-exp is −inf).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class OnlineSoftmaxState:
    m: np.ndarray  # (rows,) running max of the scores seen so far
    l: np.ndarray  # (rows,) running Σ exp(s − m)
    o: np.ndarray  # (rows, d_v) running Σ exp(s − m) · v

    @classmethod
    def empty(cls, rows: int, d_v: int) -> "OnlineSoftmaxState":
        return cls(np.full(rows, -np.inf), np.zeros(rows), np.zeros((rows, d_v)))

    def update(self, scores: np.ndarray, values: np.ndarray) -> "OnlineSoftmaxState":
        """Fold in one tile: scores (rows, cols) with −inf for masked entries, values (cols, d_v)."""
        if scores.shape[1] == 0:
            return self
        m_new = np.maximum(self.m, scores.max(axis=1))
        # Rows still at −inf have seen nothing: subtract 0 instead so exp(−inf − (−inf)) never makes a NaN.
        m_safe = np.where(np.isneginf(m_new), 0.0, m_new)
        correction = np.exp(self.m - m_safe)
        p = np.exp(scores - m_safe[:, None])
        return OnlineSoftmaxState(
            m=m_new,
            l=correction * self.l + p.sum(axis=1),
            o=correction[:, None] * self.o + p @ values,
        )

    def output(self) -> np.ndarray:
        """The normalised attention output O / l, exactly 0 for rows that saw no key."""
        safe_l = np.where(self.l > 0, self.l, 1.0)
        return np.where(self.l[:, None] > 0, self.o / safe_l[:, None], 0.0)

    def lse(self) -> np.ndarray:
        """Natural-log log-sum-exp of every row's scores, −inf for rows that saw no key."""
        with np.errstate(divide="ignore"):
            return np.where(self.l > 0, self.m + np.log(self.l), -np.inf)


def online_softmax_trace(scores, tiles: list[tuple[int, int]], values=None) -> list[OnlineSoftmaxState]:
    """Run the online softmax over one row of `scores` tile by tile; returns the state after every tile."""
    scores = np.asarray(scores, dtype=np.float64)[None, :]
    values = np.zeros((scores.shape[1], 1)) if values is None else np.asarray(values, dtype=np.float64)
    state = OnlineSoftmaxState.empty(1, values.shape[1])
    trace = []
    for start, end in tiles:
        state = state.update(scores[:, start:end], values[start:end])
        trace.append(state)
    return trace


def tiled_attention(q, k, v, *, block_q: int = 64, block_k: int = 64, causal: bool = False, scale=None):
    """FlashAttention's forward loop in NumPy for one head: q (Nq, D), k (Nk, D), v (Nk, Dv); bottom-right causal.

    Returns (out, lse). Only (block_q, block_k) score tiles ever exist, never the (Nq, Nk) matrix.
    """
    q, k, v = (np.asarray(t, dtype=np.float64) for t in (q, k, v))
    n_q, n_k = q.shape[0], k.shape[0]
    scale = 1.0 / np.sqrt(q.shape[1]) if scale is None else scale
    out = np.zeros((n_q, v.shape[1]))
    lse = np.full(n_q, -np.inf)
    for qs in range(0, n_q, block_q):
        rows = np.arange(qs, min(qs + block_q, n_q))
        state = OnlineSoftmaxState.empty(len(rows), v.shape[1])
        for ks in range(0, n_k, block_k):
            cols = np.arange(ks, min(ks + block_k, n_k))
            s = (q[rows] @ k[cols].T) * scale
            if causal:
                s = np.where(cols[None, :] <= rows[:, None] + (n_k - n_q), s, -np.inf)
            state = state.update(s, v[cols])
        out[rows] = state.output()
        lse[rows] = state.lse()
    return out, lse
