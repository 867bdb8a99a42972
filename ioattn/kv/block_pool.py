"""A pool of fixed-size KV blocks: reference counts, a free list, and an LRU of cached blocks nobody holds.

Every block is in exactly one of three states:

- **used**: reference count > 0 (held by one or more block tables);
- **cached**: reference count 0 but registered under a `BlockKey`, so a later prefix lookup can revive it;
  kept in an `OrderedDict` in least-recently-released order — it is the eviction queue;
- **free**: reference count 0 and unregistered; kept on a stack.

`take()` prefers a free block and evicts the least-recently-released cached block only when none is left,
so cached content survives as long as memory allows. Every operation is O(1). Whoever releases several
blocks at once chooses the eviction order by the release order (the manager releases a sequence's deepest
block first, so it is evicted first and a shared prefix outlives its tails).

The same class serves the GPU pool and the CPU swap pool (where registration lets sequences that share a
block swap it once).
"""

from __future__ import annotations

from collections import OrderedDict

from ioattn.kv.prefix_hash import BlockKey, block_digest

# A block-table entry whose block was released by sink+window eviction: the position exists, its KV does not.
EVICTED = -1


class BlockPool:
    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.ref_count = [0] * num_blocks
        self.key_of: list[BlockKey | None] = [None] * num_blocks
        self.digest_of: list[bytes | None] = [None] * num_blocks
        self.cached: dict[BlockKey, int] = {}
        self.evictable: OrderedDict[int, None] = OrderedDict()
        # Popped from the end: block 0 first, which keeps small tests readable.
        self.free = list(range(num_blocks - 1, -1, -1))
        # Counters for stats(): block operations, and cached blocks evicted to make room.
        self.ops = 0
        self.evictions = 0

    @property
    def num_available(self) -> int:
        """Blocks that take() can hand out: free ones plus cached ones nobody holds."""
        return len(self.free) + len(self.evictable)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_available

    def take(self) -> int:
        """A block for new content, reference count 1; evicts the LRU cached block when nothing is free."""
        if self.free:
            block = self.free.pop()
        else:
            block, _ = self.evictable.popitem(last=False)
            del self.cached[self.key_of[block]]
            self.key_of[block] = None
            self.digest_of[block] = None
            self.evictions += 1
        self.ref_count[block] = 1
        self.ops += 1
        return block

    def share(self, block: int) -> None:
        """One more holder of a used or cached block (a fork, or a prefix-cache hit reviving it)."""
        if self.ref_count[block] == 0:
            del self.evictable[block]
        self.ref_count[block] += 1
        self.ops += 1

    def release(self, block: int) -> None:
        """One holder fewer; the last release parks a registered block in the LRU, else frees it."""
        count = self.ref_count[block] - 1
        if count < 0:
            raise ValueError(f"block {block} released more often than taken")
        self.ref_count[block] = count
        if count == 0:
            if self.key_of[block] is None:
                self.free.append(block)
            else:
                self.evictable[block] = None
        self.ops += 1

    def lookup(self, key: BlockKey) -> int | None:
        """The block registered under key (used or cached), or None."""
        return self.cached.get(key)

    def register(self, block: int, key: BlockKey, digest: bytes | None = None) -> None:
        """Make a used block findable under key; no-op when it or the key is registered already.

        A second block with the same content (two sequences computed it concurrently) stays unregistered:
        the first one keeps serving hits and the duplicate goes back to the free list when released.
        """
        if self.key_of[block] is not None or key in self.cached:
            return
        self.cached[key] = block
        self.key_of[block] = key
        self.digest_of[block] = block_digest(key) if digest is None else digest
