"""`check(manager)`: every invariant of the paged KV cache, each broken one reported with a precise message.

O(blocks + tokens): for tests and debugging, never on the engine's hot path. The content check models each
block's KV by the token ids its holders say it stores; two holders disagreeing means a write landed in a
shared block (a missing copy-on-write) or a prefix hit served the wrong block.
"""

from __future__ import annotations

from collections import Counter

from ioattn.kv.block_pool import EVICTED, BlockPool
from ioattn.kv.ledger import ManagerState
from ioattn.kv.prefix_hash import ROOT, block_digest, block_key



class InvariantError(AssertionError):
    """The manager's state is inconsistent: a bug in the manager, never a caller's error."""


def _fail(message: str) -> None:
    raise InvariantError(message)


def _check_pool(name: str, pool: BlockPool, holders: Counter) -> None:
    free, evictable = set(pool.free), set(pool.evictable)
    if len(free) != len(pool.free):
        _fail(f"{name}: a block is on the free list twice")
    if free & evictable:
        _fail(f"{name}: blocks {sorted(free & evictable)} are both free and cached-evictable")
    for block in range(pool.num_blocks):
        count = pool.ref_count[block]
        if count != holders[block]:
            _fail(f"{name}: block {block} has reference count {count} but {holders[block]} table references")
        parked = block in free or block in evictable
        if (count == 0) != parked:
            _fail(f"{name}: block {block} with reference count {count} is {'' if parked else 'not '}free/cached")
        key = pool.key_of[block]
        if key is None:
            if block in evictable or pool.digest_of[block] is not None:
                _fail(f"{name}: unregistered block {block} is in the LRU or has a digest")
        else:
            if block in free:
                _fail(f"{name}: registered block {block} is on the free list")
            if pool.cached.get(key) != block:
                _fail(f"{name}: block {block} is registered but the cache maps its key to {pool.cached.get(key)}")
            if pool.digest_of[block] != block_digest(key):
                _fail(f"{name}: block {block}'s digest does not match its key")
    if len(pool.cached) != sum(key is not None for key in pool.key_of):
        _fail(f"{name}: the cache holds {len(pool.cached)} keys but other blocks are registered")
    used = sum(count > 0 for count in pool.ref_count)
    if len(free) + len(evictable) + used != pool.num_blocks:
        _fail(f"{name}: free {len(free)} + cached {len(evictable)} + used {used} != {pool.num_blocks} blocks")


def check(manager: ManagerState) -> None:
    bs = manager.block_size
    holders = {True: Counter(), False: Counter()}  # on_gpu -> block -> table references
    contents: dict[tuple[bool, int], tuple[tuple[int, ...], object]] = {}
    for seq in manager.seqs.values():
        sid = seq.seq_id
        pool = manager.gpu if seq.on_gpu else manager.cpu
        if len(seq.blocks) != -(-seq.num_tokens // bs) or seq.num_tokens == 0:
            _fail(f"seq {sid!r}: {len(seq.blocks)} blocks for {seq.num_tokens} tokens (block_size {bs})")
        if not 0 <= seq.num_computed <= seq.num_tokens:
            _fail(f"seq {sid!r}: num_computed {seq.num_computed} outside [0, {seq.num_tokens}]")
        if len(seq.digests) > seq.num_computed // bs:
            _fail(f"seq {sid!r}: {len(seq.digests)} digests for {seq.num_computed} computed tokens")
        if seq.blocks[-1] == EVICTED:
            _fail(f"seq {sid!r}: its last (writable) block was evicted")
        parent = ROOT
        for i, digest in enumerate(seq.digests):
            key = block_key(parent, seq.token_ids[i * bs : (i + 1) * bs], seq.extra_key)
            if digest != block_digest(key):
                _fail(f"seq {sid!r}: digest of block {i} does not match its tokens")
            parent = digest
        for i, block in enumerate(seq.blocks):
            if block == EVICTED:
                continue
            if not 0 <= block < pool.num_blocks:
                _fail(f"seq {sid!r}: block id {block} outside the pool")
            holders[seq.on_gpu][block] += 1
            tokens = tuple(seq.token_ids[i * bs : (i + 1) * bs])
            content = (tokens, seq.extra_key)
            seen = contents.setdefault((seq.on_gpu, block), content)
            if seen != content:
                _fail(f"seq {sid!r}: block {block} (logical {i}) holds other tokens for another holder")
            key = pool.key_of[block]
            if key is not None and (key[1] != tokens or key[2] != seq.extra_key):
                _fail(f"seq {sid!r}: block {block} is cached under tokens it does not hold")
            if key is not None and i < len(seq.digests) and pool.digest_of[block] != seq.digests[i]:
                _fail(f"seq {sid!r}: block {block} is cached under another prefix chain")
    _check_pool("gpu", manager.gpu, holders[True])
    _check_pool("cpu", manager.cpu, holders[False])
