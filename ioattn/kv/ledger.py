"""What the KV manager records per sequence (`BlockLedger`), and the state its reports read (`ManagerState`): the
views `ioattn.kv.stats` and `ioattn.kv.invariants` take, without importing the manager itself.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field
from typing import Hashable, Protocol

from ioattn.kv.block_pool import BlockPool


@dataclass(eq=False)
class BlockLedger:
    """The manager's block bookkeeping for one sequence (the engine's request state is
    `ioattn.engine.sequence.Sequence`): the token ids its blocks hold, those blocks (GPU ids, or CPU ids while
    swapped out) and how far its KV is computed and hashed."""

    seq_id: Hashable
    token_ids: list[int]
    blocks: array  # of TABLE_TYPECODE
    extra_key: Hashable
    num_computed: int
    # Chained digests of the first len(digests) full blocks whose KV is written (the prefix-cache chain).
    digests: list[bytes] = field(default_factory=list)
    on_gpu: bool = True

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


class ManagerState(Protocol):
    """The attributes of a `KVCacheManager` that its statistics and invariant checks read."""

    block_size: int
    gpu: BlockPool
    cpu: BlockPool
    seqs: dict[Hashable, BlockLedger]
    cow_copies: int
    prefix_query_tokens: int
    prefix_hit_tokens: int
    resume_hit_tokens: int
    swap_out_blocks: int
    swap_in_blocks: int
    window_evicted_blocks: int
