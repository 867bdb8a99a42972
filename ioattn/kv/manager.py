"""`KVCacheManager`: paged KV-cache bookkeeping for the engine (vLLM's PagedAttention idea, nano-vllm's style).

The manager owns no tensors. It maps every sequence's logical token positions onto physical blocks of
`block_size` slots (slot = block * block_size + offset) and hands the runner plans: block tables, slot
mappings, copy-on-write (src, dst) pairs and swap (from, to) lists. Running out of blocks is not an error:
a call returns None with the state unchanged, and the engine decides (wait, preempt, swap). Bad input
(unknown, unhashable or duplicate sequence ids, a sequence in the wrong place, impossible positions, token ids
that are not plain ints in [0, 2**63)) raises ValueError naming the argument, with the state unchanged: every
verb checks its input before it changes anything, and nothing after those checks can raise.

Decisions, and why:

- **On-demand, ≤ 1 partly-filled block per sequence.** A sequence holds ceil(num_tokens / block_size)
  blocks; only the last one can be partial, so internal waste is < one block per sequence and there is no
  external fragmentation (every free block fits every request).
- **Sharing by reference count; copy-on-write.** `fork` shares every block. Full blocks are never written
  again, so only a shared, partly-filled last block needs a copy: `append` then takes a fresh block, moves
  the sequence onto it and returns (src, dst) for the runner to copy before writing. No write ever lands in
  a block with reference count > 1.
- **Prefix caching (see prefix_hash.py for the hash).** Only full blocks are cached, and only once their KV
  is written: the engine calls `mark_computed(seq_id, n)` after a step has written the first n tokens
  (vLLM v1's order). Registering at reservation instead would let a second request skip prefill over blocks
  whose KV a chunked prefill has not written yet. An engine that never calls it still runs correctly, only
  without cache hits. `allocate` hits at most the full blocks before the prompt's last token, because the
  last token must be computed to produce logits and its block is written then.
- **Finished sequences' blocks stay cached.** `free` releases blocks; registered ones with no holder stay
  findable in an LRU and are evicted only when a fresh block is needed and no free block is left. A
  sequence releases its deepest block first, so within one sequence the tails go before the shared prefix.
- **Hits of a preempted request are not prefix-cache hits.** A request preempted by recompute is `free`d
  and later re-admitted with `allocate(..., is_resume=True)`; its hits (mostly its own blocks, still cached)
  are counted as `resume_hit_tokens`, and neither its queries nor its hits enter the prefix-cache hit rate —
  each request's prompt is counted once, at its first admission.
- **Watermark.** `allocate` and `swap_in` (admission) refuse when fewer than `int(watermark * num_blocks)`
  available blocks would remain; `append` may use that reserve, so running sequences can keep decoding for
  a while after admission stops (fewer preemptions).
- **Swap.** `swap_out` moves all of a sequence's blocks to the CPU pool, `swap_in` back. With prefix
  caching on, a full block registered on one side (its KV written, see mark_computed) is looked up on the
  other: such a block shared by two sequences (a common prefix, a fork) is copied once and reference-counted
  in the CPU pool too, and one still cached on the GPU is revived by `swap_in` without a copy. Other blocks
  (partly filled, not yet computed, or with prefix caching off) are copied per sequence, a shared one once
  for each sharer: partly-filled blocks are mutable, and a simple correct rule beats an optimisation for
  the one such block per sequence it would save.
- **StreamingLLM eviction.** `evict_window` releases the blocks wholly between the first `sink_tokens`
  tokens and the last `window_tokens`, and marks their table entries `EVICTED` (-1): logical positions stay
  (RoPE positions and the table's indexing do not move), `slot_mapping` over them raises, and the paged
  kernel, given the same sinks and window, never reads them.
- **Placeholder tokens (asynchronous scheduling).** An engine that schedules step t+1 before step t's sampled
  tokens reach the host reserves each such token's slot with `append(seq_id, [PLACEHOLDER])` and hands the
  value over with `fill` once it has arrived. Only the value is unknown: slots, copy-on-write and block counts
  are exact. Everything keyed on token values refuses a placeholder loudly: `mark_computed` over a block
  holding one, and `allocate` of a prompt holding one, raise ValueError.
- **Export and import of computed prefixes (disaggregated prefill/decode).** `export_prefix` names the cached
  blocks a prompt would hit, with their digests; another manager's `import_prefix` checks each digest against
  the prompt's tokens, registers fresh blocks under those keys and returns the (shipped index, block) writes
  for the caller to copy into. Imported blocks end cached and unheld, exactly like a finished sequence's:
  the next `allocate` of that prompt hits them, and until then the LRU may evict them (deepest first). An
  import therefore leaves the number of available blocks unchanged, so the admission watermark does not apply.
  Like every other verb it is all or nothing (None); a caller that wants part of a chain passes fewer digests.
"""

from __future__ import annotations

from array import array
from typing import Hashable, Iterable

from ioattn.intmath import cdiv
from ioattn.kv.block_pool import EVICTED, BlockPool
from ioattn.kv.ledger import BlockLedger
from ioattn.kv.invariants import check
from ioattn.kv.prefix_hash import ROOT, block_digest, block_key, check_extra_key
from ioattn.kv.stats import KVStats, collect

# A reserved token whose value is not known yet (see `append` and `fill`); never a real token id.
PLACEHOLDER = -1
# Token ids are hashed as int64 (prefix_hash.block_digest): a real id is a plain int (not bool) below this.
TOKEN_ID_LIMIT = 2**63
# Block tables are int32 arrays: the runner's (and the kernels') layout, copied to it without conversion.
TABLE_TYPECODE = "i"
assert array(TABLE_TYPECODE).itemsize == 4


def watermark_blocks(num_blocks: int, watermark: float) -> int:
    """The blocks admission (`allocate`, `swap_in`) leaves free: a fraction of the pool, rounded down."""
    return int(watermark * num_blocks)


def _check_count(name: str, value: object, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")


def all_token_ids(tokens: list, lowest: int = 0, limit: int = TOKEN_ID_LIMIT) -> bool:
    """Every token a plain int (not bool, no subclass) in [lowest, limit): one pass, ~40 ns a token."""
    for token in tokens:
        if type(token) is not int or not lowest <= token < limit:
            return False
    return True


def _check_token_ids(name: str, tokens: list, lowest: int = 0) -> None:
    if not all_token_ids(tokens, lowest):
        bad = [t for t in tokens if type(t) is not int or not lowest <= t < TOKEN_ID_LIMIT]
        allowed = "ints in [0, 2**63)" + (" or PLACEHOLDER (-1)" if lowest == PLACEHOLDER else "")
        raise ValueError(f"{name} must be {allowed}, got {bad[:5]!r}")


class KVCacheManager:
    """Block tables over a GPU pool of `num_blocks` blocks of `block_size` token slots, and an optional CPU
    swap pool of `num_cpu_blocks`; see the module docstring for the policies."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        num_cpu_blocks: int = 0,
        enable_prefix_caching: bool = True,
        watermark: float = 0.01,
    ):
        _check_count("num_blocks", num_blocks, 1)
        _check_count("block_size", block_size, 1)
        _check_count("num_cpu_blocks", num_cpu_blocks, 0)
        if not isinstance(watermark, (int, float)) or isinstance(watermark, bool) or not 0.0 <= watermark < 1.0:
            raise ValueError(f"watermark must be in [0, 1), got {watermark!r}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.watermark_blocks = watermark_blocks(num_blocks, watermark)
        self.gpu = BlockPool(num_blocks)
        self.cpu = BlockPool(num_cpu_blocks)
        self.seqs: dict[Hashable, BlockLedger] = {}
        # Counters reported by stats().
        self.prefix_query_tokens = 0
        self.prefix_hit_tokens = 0
        self.resume_hit_tokens = 0
        self.cow_copies = 0
        self.swap_out_blocks = 0
        self.swap_in_blocks = 0
        self.window_evicted_blocks = 0

    @property
    def num_blocks(self) -> int:
        return self.gpu.num_blocks

    # -- lookups -----------------------------------------------------------------------------------------

    def _find(self, seq_id: Hashable, name: str = "seq_id") -> BlockLedger | None:
        try:
            return self.seqs.get(seq_id)
        except TypeError:
            raise ValueError(f"{name} must be hashable, got {type(seq_id).__name__}") from None

    def _get(self, seq_id: Hashable) -> BlockLedger:
        seq = self._find(seq_id)
        if seq is None:
            raise ValueError(f"seq_id {seq_id!r}: unknown sequence (never allocated, or already freed)")
        return seq

    def _on_gpu(self, seq_id: Hashable, action: str) -> BlockLedger:
        try:  # _find inline: append calls this once per decode
            seq = self.seqs.get(seq_id)
        except TypeError:
            seq = self._find(seq_id)
        if seq is None or not seq.on_gpu:
            self._get(seq_id)
            raise ValueError(f"seq_id {seq_id!r} is swapped out; swap_in before {action}")
        return seq

    def _hits(self, token_ids: list[int], extra_key: Hashable) -> tuple[list[int], list[bytes]]:
        """Cached blocks of the longest matching prefix, stopping before the block of the last token."""
        bs = self.block_size
        hits, digests, parent = [], [], ROOT
        for i in range((len(token_ids) - 1) // bs):
            block = self.gpu.lookup(block_key(parent, token_ids[i * bs : (i + 1) * bs], extra_key))
            if block is None:
                break
            parent = self.gpu.digest_of[block]
            hits.append(block)
            digests.append(parent)
        return hits, digests

    # -- the engine's verbs ----------------------------------------------------------------------------

    def allocate(
        self, seq_id: Hashable, token_ids: Iterable[int], extra_key: Hashable = None, *, is_resume: bool = False
    ) -> int | None:
        """Reserve blocks for a new sequence's prompt; the number of prompt tokens already cached, or None.

        Slots for every prompt token are reserved; the first (returned) tokens' KV is already in the cache,
        so their prefill is skipped. None when the blocks would cut into the watermark; state unchanged.
        """
        if self._find(seq_id) is not None:
            raise ValueError(f"seq_id {seq_id!r} already exists")
        check_extra_key(extra_key)
        tokens = list(token_ids)
        if not tokens:
            raise ValueError("token_ids must hold at least one token")
        if not all_token_ids(tokens):
            if PLACEHOLDER in tokens:
                raise ValueError("token_ids holds a PLACEHOLDER: a prompt's prefix hits need every token's value")
            _check_token_ids("token_ids", tokens)
        needed = cdiv(len(tokens), self.block_size)
        if needed > self.num_blocks - self.watermark_blocks:
            raise ValueError(
                f"token_ids: {len(tokens)} tokens need {needed} blocks, more than the "
                f"{self.num_blocks - self.watermark_blocks} the pool can ever admit (num_blocks minus watermark)"
            )
        hits, digests = self._hits(tokens, extra_key) if self.enable_prefix_caching else ([], [])
        revived = sum(1 for block in hits if self.gpu.ref_count[block] == 0)
        if self.gpu.num_available - revived - (needed - len(hits)) < self.watermark_blocks:
            return None
        for block in hits:
            self.gpu.share(block)
        blocks = array(TABLE_TYPECODE, hits + [self.gpu.take() for _ in range(needed - len(hits))])
        cached_tokens = len(hits) * self.block_size
        self.seqs[seq_id] = BlockLedger(seq_id, tokens, blocks, extra_key, cached_tokens, digests)
        if is_resume:
            self.resume_hit_tokens += cached_tokens
        elif self.enable_prefix_caching:
            self.prefix_query_tokens += len(tokens)
            self.prefix_hit_tokens += cached_tokens
        return cached_tokens

    def append(self, seq_id: Hashable, token_ids: Iterable[int]) -> list[tuple[int, int]] | None:
        """Reserve slots for new tokens; the copy-on-write (src, dst) pairs to copy first, or None.

        The runner copies each src block to dst before the step writes the new tokens' KV; the engine then
        calls mark_computed. A token may be PLACEHOLDER (its value arrives later through `fill`). None when the
        pool (watermark reserve included) has too few blocks; state unchanged.
        """
        seq = self._on_gpu(seq_id, "append")
        new_tokens = token_ids if isinstance(token_ids, list) else list(token_ids)
        for token in new_tokens:  # inline: one or two tokens a decode, on every step's hot path
            if type(token) is not int or not PLACEHOLDER <= token < TOKEN_ID_LIMIT:
                _check_token_ids("token_ids", new_tokens, lowest=PLACEHOLDER)
        bs = self.block_size
        old_len = len(seq.token_ids)
        fresh = cdiv(old_len + len(new_tokens), bs) - len(seq.blocks)
        last = seq.blocks[-1]
        copy_on_write = old_len % bs != 0 and bool(new_tokens) and self.gpu.ref_count[last] > 1
        copies = []
        if fresh or copy_on_write:  # else (most decodes) the last block has room: nothing to take
            if fresh + copy_on_write > self.gpu.num_available:
                return None
            if copy_on_write:
                copy = self.gpu.take()
                self.gpu.release(last)
                seq.blocks[-1] = copy
                copies.append((last, copy))
                self.cow_copies += 1
            seq.blocks.extend(self.gpu.take() for _ in range(fresh))
        seq.token_ids.extend(new_tokens)
        return copies

    def fill(self, seq_id: Hashable, position: int, token_id: int) -> None:
        """The value of the PLACEHOLDER reserved at `position` has arrived (on the GPU or swapped out)."""
        seq = self._get(seq_id)
        if not (type(position) is int and 0 <= position < len(seq.token_ids)
                and seq.token_ids[position] == PLACEHOLDER):
            raise ValueError(f"position {position!r} of seq_id {seq_id!r} does not hold a PLACEHOLDER")
        if not (type(token_id) is int and 0 <= token_id < TOKEN_ID_LIMIT):
            raise ValueError(f"token_id must be an int in [0, 2**63), got {token_id!r}")
        seq.token_ids[position] = token_id

    def mark_computed(self, seq_id: Hashable, num_tokens: int) -> None:
        """The KV of the sequence's first num_tokens tokens is written: its full blocks become cacheable."""
        seq = self._on_gpu(seq_id, "mark_computed")
        if type(num_tokens) is not int or not seq.num_computed <= num_tokens <= len(seq.token_ids):
            raise ValueError(
                f"num_tokens must be an int in [{seq.num_computed}, {seq.num_tokens}] (already computed .. "
                f"reserved) for seq_id {seq_id!r}, got {num_tokens!r}"
            )
        bs = self.block_size
        hashed = range(len(seq.digests), num_tokens // bs) if self.enable_prefix_caching else range(0)
        if hashed and PLACEHOLDER in seq.token_ids[hashed.start * bs : hashed.stop * bs]:
            raise ValueError(f"tokens [{hashed.start * bs}, {hashed.stop * bs}) of seq_id {seq_id!r} hold a "
                             "PLACEHOLDER: fill it before mark_computed hashes their blocks")
        # Hash first, then change state: nothing below the hashing can raise.
        chain, parent = [], seq.digests[-1] if seq.digests else ROOT
        for i in hashed:
            key = block_key(parent, seq.token_ids[i * bs : (i + 1) * bs], seq.extra_key)
            parent = block_digest(key)
            chain.append((key, parent))
        seq.num_computed = num_tokens
        for i, (key, digest) in zip(hashed, chain):
            seq.digests.append(digest)
            if seq.blocks[i] != EVICTED:
                self.gpu.register(seq.blocks[i], key, digest)

    def fork(self, parent_id: Hashable, child_id: Hashable) -> None:
        """The child shares every block of the parent (n > 1 sampling, beam search)."""
        parent = self._on_gpu(parent_id, "fork")
        if self._find(child_id, "child_id") is not None:
            raise ValueError(f"child_id {child_id!r} already exists")
        if PLACEHOLDER in parent.token_ids:
            # Each sharer would fill its own value into the one shared block.
            raise ValueError(f"parent_id {parent_id!r} holds a PLACEHOLDER: fill it before fork")
        for block in parent.blocks:
            if block != EVICTED:
                self.gpu.share(block)
        self.seqs[child_id] = BlockLedger(
            child_id, list(parent.token_ids), parent.blocks[:], parent.extra_key, parent.num_computed,
            list(parent.digests),
        )

    def free(self, seq_id: Hashable) -> None:
        """Drop a sequence (finished, aborted or preempted); its registered blocks stay cached."""
        seq = self._get(seq_id)
        del self.seqs[seq_id]
        pool = self.gpu if seq.on_gpu else self.cpu
        for block in reversed(seq.blocks):
            if block != EVICTED:
                pool.release(block)

    def swap_out(self, seq_id: Hashable) -> list[tuple[int, int]] | None:
        """Move a sequence to the CPU pool: the (gpu, cpu) copies to run, or None if the CPU pool is full."""
        seq = self._on_gpu(seq_id, "swap_out")
        if self.cpu.num_blocks == 0:
            raise ValueError("swap_out needs a CPU pool: construct the manager with num_cpu_blocks > 0")
        moves = self._move(seq, self.gpu, self.cpu, reserve=0)
        if moves is not None:
            self.swap_out_blocks += len(moves)
        return moves

    def swap_in(self, seq_id: Hashable) -> list[tuple[int, int]] | None:
        """Bring a swapped-out sequence back: the (cpu, gpu) copies, or None under the watermark.

        The copies must run before the next forward pass: a copied-in full block is findable by the prefix
        cache at once.
        """
        seq = self._get(seq_id)
        if seq.on_gpu:
            raise ValueError(f"seq_id {seq_id!r} is not swapped out")
        moves = self._move(seq, self.cpu, self.gpu, reserve=self.watermark_blocks)
        if moves is not None:
            self.swap_in_blocks += len(moves)
        return moves

    def _move(self, seq: BlockLedger, src: BlockPool, dst: BlockPool, reserve: int) -> list[tuple[int, int]] | None:
        """Re-home a sequence's blocks from src to dst, reusing blocks dst holds under the same key."""
        targets = [
            dst.lookup(src.key_of[block]) if block != EVICTED and src.key_of[block] is not None else None
            for block in seq.blocks
        ]
        to_copy = sum(1 for block, target in zip(seq.blocks, targets) if block != EVICTED and target is None)
        revived = sum(1 for target in targets if target is not None and dst.ref_count[target] == 0)
        if dst.num_available - revived - to_copy < reserve:
            return None
        # Share the reused blocks before taking fresh ones, so take() cannot evict them.
        for target in targets:
            if target is not None:
                dst.share(target)
        moves = []
        for i, (block, target) in enumerate(zip(seq.blocks, targets)):
            if block != EVICTED and target is None:
                target = dst.take()
                moves.append((block, target))
                if src.key_of[block] is not None:
                    dst.register(target, src.key_of[block], src.digest_of[block])
            targets[i] = EVICTED if block == EVICTED else target
        for block in reversed(seq.blocks):
            if block != EVICTED:
                src.release(block)
        seq.blocks = array(TABLE_TYPECODE, targets)
        seq.on_gpu = not seq.on_gpu
        return moves

    def evict_window(self, seq_id: Hashable, sink_tokens: int, window_tokens: int) -> list[int]:
        """StreamingLLM: release the blocks wholly between the first sink_tokens tokens and the last
        window_tokens; returns the released block ids, deepest first (a shared block stays with its other holders).
        """
        seq = self._on_gpu(seq_id, "evict_window")
        _check_count("sink_tokens", sink_tokens, 0)
        _check_count("window_tokens", window_tokens, 1)
        bs = self.block_size
        first = cdiv(sink_tokens, bs)
        end = (seq.num_tokens - window_tokens) // bs
        freed = []
        for i in range(end - 1, first - 1, -1):
            block = seq.blocks[i]
            if block != EVICTED:
                self.gpu.release(block)
                seq.blocks[i] = EVICTED
                freed.append(block)
        self.window_evicted_blocks += len(freed)
        return freed

    # -- prefix transfer between managers ----------------------------------------------------------------

    def export_prefix(self, token_ids: Iterable[int], extra_key: Hashable = None) -> list[tuple[int, bytes]]:
        """(block, digest) of each cached block that `allocate(token_ids, extra_key)` would hit, in order.

        Changes nothing; the caller reads the blocks' KV before the next call that may take a block (and
        evict one of them). The digests are what another manager's `import_prefix` checks.
        """
        check_extra_key(extra_key)
        tokens = list(token_ids)
        _check_token_ids("token_ids", tokens)
        hits, digests = self._hits(tokens, extra_key)
        return list(zip(hits, digests))

    def import_prefix(
        self, token_ids: Iterable[int], digests: Iterable[bytes], extra_key: Hashable = None
    ) -> list[tuple[int, int]] | None:
        """Take in the first len(digests) full blocks of token_ids, computed elsewhere; the (i, block) writes
        to run, or None.

        digests[i] is block i's chained digest (another manager's `export_prefix`), checked against the
        tokens. Blocks already cached here are kept; each other block i gets a fresh block registered under
        its key, into which the caller copies the shipped block i's KV before the next forward pass. All end
        cached and unheld (see the module docstring). None when the pool cannot hold them all at once (too
        many blocks held by sequences); a digest that does not match raises ValueError; state unchanged.
        """
        if not self.enable_prefix_caching:
            raise ValueError("import_prefix needs enable_prefix_caching=True: imported blocks enter the prefix cache")
        check_extra_key(extra_key)
        tokens, digests = list(token_ids), list(digests)
        _check_token_ids("token_ids", tokens)
        bs = self.block_size
        if len(digests) * bs > len(tokens):
            raise ValueError(f"token_ids: {len(tokens)} tokens cannot fill {len(digests)} blocks of {bs} (digests)")
        keys, parent = [], ROOT
        for i, digest in enumerate(digests):
            key = block_key(parent, tokens[i * bs : (i + 1) * bs], extra_key)
            parent = block_digest(key)
            if digest != parent:
                raise ValueError(
                    f"digests[{i}] is not the chained digest of block {i} of token_ids with extra_key {extra_key!r}"
                )
            keys.append(key)
        blocks = [self.gpu.lookup(key) for key in keys]
        unheld = sum(1 for block in blocks if block is None or self.gpu.ref_count[block] == 0)
        if unheld > self.gpu.num_available:
            return None
        # Hold the blocks cached already before taking fresh ones, so take() cannot evict them.
        for block in blocks:
            if block is not None:
                self.gpu.share(block)
        writes = []
        for i, key in enumerate(keys):
            if blocks[i] is None:
                blocks[i] = self.gpu.take()
                self.gpu.register(blocks[i], key, digests[i])
                writes.append((i, blocks[i]))
        for block in reversed(blocks):
            self.gpu.release(block)
        return writes

    # -- plans for the runner ------------------------------------------------------------------------------

    def reserved_tokens(self, seq_id: Hashable) -> int:
        """How many tokens the sequence holds slots for (`allocate`, then `append`); 0 when the manager does not
        hold it (never allocated, freed, or preempted by recompute). The engine reads this, keeping no copy."""
        seq = self.seqs.get(seq_id)
        return 0 if seq is None else len(seq.token_ids)

    def block_table(self, seq_id: Hashable) -> list[int]:
        """Physical block of each logical block; EVICTED (-1) where evict_window released it."""
        return list(self._on_gpu(seq_id, "block_table").blocks)

    def block_tables(self, seq_ids: Iterable[Hashable]) -> tuple[bytes, list[int]]:
        """A batch's block tables for the runner: every sequence's int32 table back to back, and their lengths."""
        tables, lengths = [], []
        for seq_id in seq_ids:
            seq = self.seqs.get(seq_id)
            if seq is None or not seq.on_gpu:
                self._on_gpu(seq_id, "block_tables")  # raises, naming the sequence
            tables.append(seq.blocks)
            lengths.append(len(seq.blocks))
        return b"".join(tables), lengths

    def slot_mapping(self, seq_id: Hashable, start: int, end: int) -> list[int]:
        """Cache slot of each token position in [start, end)."""
        seq = self._on_gpu(seq_id, "slot_mapping")
        if not (isinstance(start, int) and isinstance(end, int) and 0 <= start <= end <= seq.num_tokens):
            raise ValueError(
                f"start, end must satisfy 0 <= start <= end <= {seq.num_tokens} (tokens of seq_id {seq_id!r}), "
                f"got start={start!r}, end={end!r}"
            )
        bs = self.block_size
        slots = []
        for i in range(start // bs, cdiv(end, bs)):
            block = seq.blocks[i]
            if block == EVICTED:
                raise ValueError(f"positions [{i * bs}, {(i + 1) * bs}) of seq_id {seq_id!r} were evicted")
            base = block * bs
            slots.extend(range(base + max(start - i * bs, 0), base + min(end - i * bs, bs)))
        return slots

    # -- introspection ---------------------------------------------------------------------------------

    def stats(self) -> KVStats:
        return collect(self)

    def check_invariants(self) -> None:
        """Raise InvariantError, naming the broken invariant, unless the whole state is consistent."""
        check(self)
