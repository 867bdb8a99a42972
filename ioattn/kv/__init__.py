"""Paged KV-cache memory management, pure Python (no torch): the engine's allocator and planner.

`KVCacheManager` (manager.py) keeps per-sequence block tables over a `BlockPool` (block_pool.py) with
reference-counted sharing, copy-on-write, hash-chained prefix caching (prefix_hash.py) with LRU eviction,
swap to a CPU pool and StreamingLLM sink+window eviction; `KVStats` (stats.py) reports memory use and
counters; `check_invariants` (invariants.py) verifies the whole state.
"""

from ioattn.kv.block_pool import EVICTED
from ioattn.kv.invariants import InvariantError
from ioattn.kv.manager import PLACEHOLDER, KVCacheManager
from ioattn.kv.stats import KVStats

__all__ = ["EVICTED", "PLACEHOLDER", "InvariantError", "KVCacheManager", "KVStats"]
