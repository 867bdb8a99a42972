"""`KVStats`: one snapshot of the manager's memory use and its counters since construction.

KV utilization counts what the paged scheme can waste: of the slots in used GPU blocks, how many hold a
token position some sequence owns. A block shared by several sequences counts once (sharing is the point),
so utilization stays a property of memory, not of how many sequences point at it; each sequence's only
partly-filled block is the internal fragmentation. Cached blocks nobody holds are reported apart: they are
reclaimable on demand, not waste.
"""

from __future__ import annotations

from dataclasses import dataclass

from ioattn.kv.ledger import ManagerState



@dataclass(frozen=True)
class KVStats:
    block_size: int
    num_blocks: int
    blocks_free: int
    blocks_used: int
    blocks_cached: int  # reference count 0, still findable by the prefix cache; evicted on demand (LRU)
    cpu_blocks_free: int
    cpu_blocks_used: int
    cpu_blocks_cached: int
    sequences_running: int
    sequences_swapped: int
    tokens_held: int  # distinct token positions stored in used GPU blocks
    slots_allocated: int  # blocks_used * block_size
    prefix_query_tokens: int  # prompt tokens looked up at first admission (resumed requests excluded)
    prefix_hit_tokens: int  # of those, found in the cache (prefill skipped)
    resume_hit_tokens: int  # tokens a re-admitted preempted request found cached (its own recompute saved)
    evictions: int  # cached GPU blocks evicted from the LRU to make room
    window_evicted_blocks: int  # block references released by evict_window
    cow_copies: int
    swap_out_blocks: int  # block copies GPU -> CPU
    swap_in_blocks: int  # block copies CPU -> GPU
    block_ops: int  # take / share / release on either pool

    @property
    def utilization(self) -> float:
        """tokens_held / slots_allocated: 1.0 when no block is used."""
        return self.tokens_held / self.slots_allocated if self.slots_allocated else 1.0

    @property
    def internal_fragmentation(self) -> int:
        """Slots in used blocks that hold no token (at most block_size - 1 per sequence)."""
        return self.slots_allocated - self.tokens_held

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hit_tokens / self.prefix_query_tokens if self.prefix_query_tokens else 0.0


def collect(manager: ManagerState) -> KVStats:
    """O(sequences): only a sequence's last block can be partial, every other used block is full."""
    bs = manager.block_size
    gpu, cpu = manager.gpu, manager.cpu
    partial_fill: dict[int, int] = {}
    running = 0
    for seq in manager.seqs.values():
        if not seq.on_gpu:
            continue
        running += 1
        fill = seq.num_tokens % bs
        if fill:
            partial_fill[seq.blocks[-1]] = fill
    slots = gpu.num_used * bs
    return KVStats(
        block_size=bs,
        num_blocks=gpu.num_blocks,
        blocks_free=len(gpu.free),
        blocks_used=gpu.num_used,
        blocks_cached=len(gpu.evictable),
        cpu_blocks_free=len(cpu.free),
        cpu_blocks_used=cpu.num_used,
        cpu_blocks_cached=len(cpu.evictable),
        sequences_running=running,
        sequences_swapped=len(manager.seqs) - running,
        tokens_held=slots - sum(bs - fill for fill in partial_fill.values()),
        slots_allocated=slots,
        prefix_query_tokens=manager.prefix_query_tokens,
        prefix_hit_tokens=manager.prefix_hit_tokens,
        resume_hit_tokens=manager.resume_hit_tokens,
        evictions=gpu.evictions,
        window_evicted_blocks=manager.window_evicted_blocks,
        cow_copies=manager.cow_copies,
        swap_out_blocks=manager.swap_out_blocks,
        swap_in_blocks=manager.swap_in_blocks,
        block_ops=gpu.ops + cpu.ops,
    )
