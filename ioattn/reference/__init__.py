"""Exact references: float64 attention with every kernel option, and the seeds' online softmax."""

from ioattn.reference.attention import TOLERANCE, attention_ref, lse_error, rel_error, sdpa_ref, visible
from ioattn.reference.online_softmax import OnlineSoftmaxState, online_softmax_trace, tiled_attention

__all__ = [
    "TOLERANCE", "attention_ref", "lse_error", "rel_error", "sdpa_ref", "visible",
    "OnlineSoftmaxState", "online_softmax_trace", "tiled_attention",
]
