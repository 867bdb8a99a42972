"""Megatron-style layers for tensor parallelism over the whole torch.distributed world.

Column-parallel layers need no module of their own: a rank's share of `qkv_proj` / `gate_up_proj` is a plain
`nn.Linear` over its heads / intermediate rows (see tp.py), and its output stays local. The layers here are the
ones whose output must be combined across ranks: one all-reduce after attention's `o_proj` and one after the
MLP's `down_proj` (row-parallel), one after the embedding lookup (vocab-parallel), and an all-gather of the
logits (vocab-parallel LM head).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ioattn.distributed.parallel_state import all_gather_last_dim, all_reduce_sum


class RowParallelLinear(nn.Linear):
    """`in_features` is this rank's slice of the input; partial products are summed across ranks, and the
    (replicated) bias is added once, after the sum."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = all_reduce_sum(F.linear(x, self.weight))
        return out if self.bias is None else out + self.bias


class VocabParallelEmbedding(nn.Module):
    """This rank's rows [vocab_start, vocab_start + rows) of the embedding (the last rank's tail zero-padded):
    ids outside them contribute zeros, and the all-reduce assembles every token's row."""

    def __init__(self, rows_per_rank: int, hidden_size: int, vocab_start: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(rows_per_rank, hidden_size))
        self.vocab_start = vocab_start

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.vocab_start
        mine = (local >= 0) & (local < self.weight.shape[0])
        out = F.embedding(torch.where(mine, local, 0), self.weight)
        return all_reduce_sum(out * mine.unsqueeze(-1).to(out.dtype))


def gather_vocab_logits(local_logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """(N, rows per rank) logits of this rank's vocabulary shard -> (N, vocab_size), padding rows dropped."""
    return all_gather_last_dim(local_logits)[..., :vocab_size]
