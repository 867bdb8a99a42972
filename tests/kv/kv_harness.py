"""Random operations on a KVCacheManager, each followed by its postconditions; shared by the hypothesis state
machine (which hands in a hypothesis-controlled `random.Random`, so failures shrink) and the plain soak run.

Every operation that may refuse (None) or reject bad input (ValueError) is checked to leave the state exactly
as it was, by comparing full snapshots.
"""

from __future__ import annotations

import random
from collections import Counter

from ioattn.kv import EVICTED, PLACEHOLDER, KVCacheManager
from ioattn.kv.prefix_hash import ROOT, block_digest, block_key

# Shared prompt prefixes: different lengths, one a continuation of another, so hits stop at various depths.
PREFIXES = ([], [7, 7, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [7, 7, 1, 2, 3, 4, 5, 6, 50, 51], [9] * 9)
EXTRA_KEYS = (None, None, None, "adapter-a")
# allocate's default: draw the extra_key at random.
RANDOM_EXTRA_KEY = object()
# Not a token id: wrong types, bool, out of int64, negative (PLACEHOLDER only where a verb allows it).
BAD_TOKEN_IDS = ("a", 1.5, None, 2**70, 2**63, True, False, -2, float("nan"), (1,), object())
BAD_COUNTS = (True, 1.5, "3", None, 2**70)


def chain_keys(tokens: list[int], block_size: int, extra_key) -> list[tuple]:
    """(key, digest) of every full block of tokens, chained from ROOT: the reference for export and import."""
    keys, parent = [], ROOT
    for i in range(len(tokens) // block_size):
        key = block_key(parent, tokens[i * block_size : (i + 1) * block_size], extra_key)
        parent = block_digest(key)
        keys.append((key, parent))
    return keys


def snapshot(manager: KVCacheManager):
    """Everything the manager's behaviour depends on, as comparable values."""
    seqs = {
        sid: (tuple(s.token_ids), tuple(s.blocks), s.on_gpu, s.num_computed, tuple(s.digests), s.extra_key)
        for sid, s in manager.seqs.items()
    }
    pools = [
        (tuple(p.ref_count), tuple(p.free), tuple(p.evictable), dict(p.cached), p.ops, p.evictions)
        for p in (manager.gpu, manager.cpu)
    ]
    return seqs, pools, manager.stats()


def random_manager(rng: random.Random) -> KVCacheManager:
    return KVCacheManager(
        rng.choice([6, 12, 24]),
        rng.choice([1, 2, 4]),
        num_cpu_blocks=rng.choice([0, 8, 16]),
        enable_prefix_caching=rng.random() < 0.8,
        watermark=rng.choice([0.0, 0.1]),
    )


class KVHarness:
    # free appears twice so that memory pressure comes and goes instead of pinning the pool full.
    OPS = ("allocate", "resume", "append", "compute", "fork", "free", "free", "swap_out", "swap_in",
           "evict_window", "read", "export_prefix", "import_prefix", "bad_input", "bad_token_ids")

    def __init__(self, manager: KVCacheManager):
        self.m = manager
        self.next_id = 0
        self.outcomes: Counter = Counter()

    # -- helpers -------------------------------------------------------------------------------------------

    def _pick(self, rng: random.Random, on_gpu: bool | None = None):
        ids = [sid for sid, s in self.m.seqs.items() if on_gpu is None or s.on_gpu == on_gpu]
        return rng.choice(ids) if ids else None

    def _new_id(self) -> int:
        self.next_id += 1
        return self.next_id

    def _prompt(self, rng: random.Random) -> list[int]:
        limit = (self.m.num_blocks - self.m.watermark_blocks) * self.m.block_size
        prefix = rng.choice(PREFIXES)[: rng.randint(0, 12)]
        tail = [rng.randrange(4) for _ in range(rng.randint(1, 10))]
        return (prefix + tail)[:limit]

    def _expect_unchanged(self, before, op: str, result=None) -> None:
        after = snapshot(self.m)
        assert after == before, f"{op} returned {result!r} but changed the state"

    def _refused(self, op: str, before) -> None:
        self._expect_unchanged(before, op)
        self.outcomes[f"{op}:none"] += 1

    def _check_writable(self, seq_id, start: int, end: int) -> None:
        """The blocks that receive positions [start, end) are held by this sequence alone."""
        for slot in self.m.slot_mapping(seq_id, start, end):
            count = self.m.gpu.ref_count[slot // self.m.block_size]
            assert count == 1, f"a write of seq {seq_id} lands in block {slot // self.m.block_size} shared {count}x"

    # -- operations ----------------------------------------------------------------------------------------

    def allocate(self, rng: random.Random, is_resume: bool = False, seq_id=None, tokens=None,
                 extra_key=RANDOM_EXTRA_KEY) -> int | None:
        """The number of cached tokens allocate returned (None: refused)."""
        seq_id = self._new_id() if seq_id is None else seq_id
        tokens = self._prompt(rng) if tokens is None else tokens
        extra_key = rng.choice(EXTRA_KEYS) if extra_key is RANDOM_EXTRA_KEY else extra_key
        before = snapshot(self.m)
        cached = self.m.allocate(seq_id, tokens, extra_key, is_resume=is_resume)
        if cached is None:
            return self._refused("allocate", before)
        assert cached % self.m.block_size == 0 and 0 <= cached < len(tokens), cached
        assert self.m.gpu.num_available >= self.m.watermark_blocks, "allocate cut into the watermark"
        stats, old = self.m.stats(), before[2]
        if is_resume:
            assert stats.prefix_query_tokens == old.prefix_query_tokens
            assert stats.resume_hit_tokens == old.resume_hit_tokens + cached
        elif self.m.enable_prefix_caching:
            assert stats.prefix_query_tokens == old.prefix_query_tokens + len(tokens)
            assert stats.prefix_hit_tokens == old.prefix_hit_tokens + cached
        self._check_writable(seq_id, cached, len(tokens))
        self.outcomes["allocate:hit" if cached else "allocate:ok"] += 1
        return cached

    def resume(self, rng: random.Random) -> None:
        """Preempt by recompute: free a running sequence, re-admit it with everything it has so far."""
        seq_id = self._pick(rng, on_gpu=True)
        if seq_id is None:
            return
        tokens = list(self.m.seqs[seq_id].token_ids)
        self.m.free(seq_id)
        if len(tokens) > (self.m.num_blocks - self.m.watermark_blocks) * self.m.block_size:
            return
        self.allocate(rng, is_resume=True, seq_id=seq_id, tokens=tokens)

    def append(self, rng: random.Random) -> None:
        seq_id = self._pick(rng, on_gpu=True)
        if seq_id is None:
            return
        old_len = self.m.seqs[seq_id].num_tokens
        new = [rng.randrange(4) for _ in range(rng.choice([0, 1, 1, 1, 2, 5]))]
        before = snapshot(self.m)
        copies = self.m.append(seq_id, new)
        if copies is None:
            return self._refused("append", before)
        gpu_ref_counts_before = before[1][0][0]
        for src, dst in copies:
            assert gpu_ref_counts_before[src] > 1 and self.m.gpu.ref_count[dst] == 1, (src, dst)
        self._check_writable(seq_id, old_len, old_len + len(new))
        self.outcomes["append:cow" if copies else "append:ok"] += 1

    def compute(self, rng: random.Random) -> None:
        seq_id = self._pick(rng, on_gpu=True)
        if seq_id is not None:
            seq = self.m.seqs[seq_id]
            self.m.mark_computed(seq_id, rng.randint(seq.num_computed, seq.num_tokens))

    def fork(self, rng: random.Random) -> None:
        parent = self._pick(rng, on_gpu=True)
        if parent is not None:
            child = self._new_id()
            self.m.fork(parent, child)
            assert self.m.block_table(child) == self.m.block_table(parent)

    def free(self, rng: random.Random) -> None:
        seq_id = self._pick(rng)
        if seq_id is not None:
            self.m.free(seq_id)

    def swap_out(self, rng: random.Random) -> None:
        seq_id = self._pick(rng, on_gpu=True)
        if seq_id is None or self.m.cpu.num_blocks == 0:
            return
        before = snapshot(self.m)
        moves = self.m.swap_out(seq_id)
        if moves is None:
            return self._refused("swap_out", before)
        self.outcomes["swap_out:ok"] += 1

    def swap_in(self, rng: random.Random) -> None:
        seq_id = self._pick(rng, on_gpu=False)
        if seq_id is None:
            return
        before = snapshot(self.m)
        moves = self.m.swap_in(seq_id)
        if moves is None:
            return self._refused("swap_in", before)
        assert self.m.gpu.num_available >= self.m.watermark_blocks, "swap_in cut into the watermark"
        self.outcomes["swap_in:ok"] += 1

    def evict_window(self, rng: random.Random) -> None:
        seq_id = self._pick(rng, on_gpu=True)
        if seq_id is None:
            return
        bs, n = self.m.block_size, self.m.seqs[seq_id].num_tokens
        sink, window = rng.randint(0, 2 * bs), rng.randint(1, 3 * bs)
        self.m.evict_window(seq_id, sink, window)
        for i, block in enumerate(self.m.block_table(seq_id)):
            if block != EVICTED and i * bs >= sink and (i + 1) * bs <= n - window:
                raise AssertionError(f"block {i} of seq {seq_id} lies between sinks and window but was kept")
        self.outcomes["evict_window:ok"] += 1

    def read(self, rng: random.Random) -> None:
        """block_table and slot_mapping agree, and skip nothing but evicted blocks."""
        seq_id = self._pick(rng, on_gpu=True)
        if seq_id is None:
            return
        bs, table, n = self.m.block_size, self.m.block_table(seq_id), self.m.seqs[seq_id].num_tokens
        for i, block in enumerate(table):
            end = min((i + 1) * bs, n)
            if block != EVICTED:
                assert self.m.slot_mapping(seq_id, i * bs, end) == list(range(block * bs, block * bs + end - i * bs))

    def export_prefix(self, rng: random.Random) -> None:
        """The exported blocks are the longest cached chain allocate would hit; importing them back is a no-op."""
        tokens, extra_key, bs = self._prompt(rng), rng.choice(EXTRA_KEYS), self.m.block_size
        before = snapshot(self.m)
        exported = self.m.export_prefix(tokens, extra_key)
        self._expect_unchanged(before, "export_prefix", exported)
        hittable = chain_keys(tokens[: len(tokens) - 1], bs, extra_key)
        assert len(exported) <= len(hittable)
        for (block, digest), (key, ref_digest) in zip(exported, hittable):
            assert digest == ref_digest and self.m.gpu.key_of[block] == key, (block, key)
        if len(exported) < len(hittable):
            assert self.m.gpu.lookup(hittable[len(exported)][0]) is None, "export stopped before a cached block"
        if exported:
            assert self.m.import_prefix(tokens, [digest for _, digest in exported], extra_key) == []
            self.outcomes["export_prefix:hit"] += 1

    def import_prefix(self, rng: random.Random) -> None:
        """Import a prompt's first blocks with reference digests (now and then a corrupted one), then allocate
        the prompt: it hits every imported block before its last token's block."""
        tokens, extra_key, bs = self._prompt(rng), rng.choice(EXTRA_KEYS), self.m.block_size
        keys = chain_keys(tokens, bs, extra_key)[: rng.randint(0, len(tokens) // bs)]
        digests = [digest for _, digest in keys]
        corrupt = bool(digests) and rng.random() < 0.2
        if corrupt:
            i = rng.randrange(len(digests))
            digests[i] = bytes([digests[i][0] ^ 1]) + digests[i][1:]
        before = snapshot(self.m)
        if corrupt or not self.m.enable_prefix_caching:
            try:
                self.m.import_prefix(tokens, digests, extra_key)
            except ValueError:
                self._expect_unchanged(before, "import_prefix")
                self.outcomes["bad_input:import_prefix"] += 1
                return
            raise AssertionError("import_prefix took a wrong digest, or imported with prefix caching off")
        available = self.m.gpu.num_available
        writes = self.m.import_prefix(tokens, digests, extra_key)
        if writes is None:
            return self._refused("import_prefix", before)
        cached_before = before[1][0][3]
        written = dict(writes)
        assert sorted(written) == [i for i, (key, _) in enumerate(keys) if key not in cached_before], writes
        for i, (key, _) in enumerate(keys):
            block = self.m.gpu.lookup(key)
            assert block == written.get(i, cached_before.get(key)), (i, block)
            assert i not in written or self.m.gpu.ref_count[block] == 0, f"imported block {block} is held"
        assert self.m.gpu.num_available == available, "an import changed the number of available blocks"
        self.outcomes["import_prefix:write" if writes else "import_prefix:ok"] += 1
        cached = self.allocate(rng, tokens=tokens, extra_key=extra_key)
        if cached is not None:
            assert cached >= min(len(keys), (len(tokens) - 1) // bs) * bs, (cached, len(keys))
            if cached and writes:
                self.outcomes["import_prefix:allocate_hit"] += 1

    def bad_input(self, rng: random.Random) -> None:
        """A call that must raise ValueError and change nothing."""
        running, swapped, anyone = self._pick(rng, True), self._pick(rng, False), self._pick(rng)
        calls = [("free", lambda: self.m.free("no-such-seq")), ("allocate", lambda: self.m.allocate(1, [])),
                 ("import_prefix", lambda: self.m.import_prefix([1], [bytes(32)])),
                 ("export_prefix", lambda: self.m.export_prefix([1, 2], extra_key=[1]))]
        if anyone is not None:
            calls += [("allocate", lambda: self.m.allocate(anyone, [1])),
                      ("extra_key", lambda: self.m.allocate(self._new_id(), [1], extra_key=[1]))]
        if running is not None:
            n = self.m.seqs[running].num_tokens
            calls += [("fork", lambda: self.m.fork(running, anyone)),
                      ("slot_mapping", lambda: self.m.slot_mapping(running, 0, n + 1)),
                      ("mark_computed", lambda: self.m.mark_computed(running, n + 1)),
                      ("swap_in", lambda: self.m.swap_in(running)),
                      ("evict_window", lambda: self.m.evict_window(running, 0, 0))]
            evicted = [i for i, b in enumerate(self.m.seqs[running].blocks) if b == EVICTED]
            if evicted:
                i = rng.choice(evicted) * self.m.block_size
                calls.append(("slot_mapping", lambda: self.m.slot_mapping(running, i, i + 1)))
        if swapped is not None:
            calls += [("append", lambda: self.m.append(swapped, [1])),
                      ("fork", lambda: self.m.fork(swapped, self._new_id())),
                      ("block_table", lambda: self.m.block_table(swapped)),
                      ("swap_out", lambda: self.m.swap_out(swapped))]
        name, call = rng.choice(calls)
        before = snapshot(self.m)
        try:
            call()
        except ValueError:
            self._expect_unchanged(before, name)
            self.outcomes[f"bad_input:{name}"] += 1
        else:
            raise AssertionError(f"bad input to {name} did not raise")

    def bad_token_ids(self, rng: random.Random) -> None:
        """A token id that is not one, at a random place of an otherwise valid call (or a bad count): ValueError
        naming the argument, nothing changed, and the sequence's later verbs all still work (a bad id used to be
        stored and to break mark_computed's hashing after it had changed the state)."""
        bad = rng.choice(BAD_TOKEN_IDS)
        tokens = self._prompt(rng)
        tokens.insert(rng.randint(0, len(tokens)), bad)
        running = self._pick(rng, on_gpu=True)
        calls = [("allocate", "token_ids", lambda: self.m.allocate(self._new_id(), tokens)),
                 ("export_prefix", "token_ids", lambda: self.m.export_prefix(tokens))]
        if self.m.enable_prefix_caching:
            calls.append(("import_prefix", "token_ids", lambda: self.m.import_prefix(tokens, [])))
        if running is not None:
            seq = self.m.seqs[running]
            calls += [("append", "token_ids", lambda: self.m.append(running, tokens[-rng.randint(1, 2):] + [bad])),
                      ("mark_computed", "num_tokens", lambda: self.m.mark_computed(running, rng.choice(BAD_COUNTS)))]
            placeholders = [i for i, t in enumerate(seq.token_ids) if t == PLACEHOLDER]
            if placeholders or self.m.append(running, [PLACEHOLDER]) is not None:
                position = (placeholders or [seq.num_tokens - 1])[0]
                calls += [("fill", "token_id", lambda: self.m.fill(running, position, bad)),
                          ("fill", "position", lambda: self.m.fill(running, rng.choice(BAD_COUNTS[:2]), 1))]
        name, argument, call = rng.choice(calls)
        before = snapshot(self.m)
        try:
            call()
        except ValueError as error:
            assert argument in str(error), (name, str(error))
            self._expect_unchanged(before, name)
            self.outcomes[f"bad_token_ids:{name}"] += 1
        else:
            raise AssertionError(f"{name} took {argument} {bad!r}")
        if running is not None:
            seq = self.m.seqs[running]
            for i, token in enumerate(seq.token_ids):
                if token == PLACEHOLDER:
                    self.m.fill(running, i, rng.randrange(4))
            self.m.mark_computed(running, seq.num_tokens)

    # -- whole runs ----------------------------------------------------------------------------------------

    def step(self, rng: random.Random) -> None:
        getattr(self, rng.choice(self.OPS))(rng)
        self.m.check_invariants()

    def drain(self) -> None:
        """Free everything: no block may stay used on either pool (no leak)."""
        for seq_id in list(self.m.seqs):
            self.m.free(seq_id)
        self.m.check_invariants()
        stats = self.m.stats()
        assert stats.blocks_used == 0 and stats.cpu_blocks_used == 0, stats
        for counter in ("evictions", "cow_copies", "resume_hit_tokens", "window_evicted_blocks"):
            self.outcomes[counter] += getattr(stats, counter)


def soak(steps: int, seed: int, episode: int = 2000) -> Counter:
    """steps random operations over fresh random managers of `episode` steps each, drained at the end."""
    rng = random.Random(seed)
    outcomes: Counter = Counter()
    done = 0
    while done < steps:
        harness = KVHarness(random_manager(rng))
        for _ in range(min(episode, steps - done)):
            harness.step(rng)
        harness.drain()
        done += min(episode, steps - done)
        outcomes.update(harness.outcomes)
    return outcomes
