"""Unit tests of KVCacheManager: exact accounting (hits, waste, utilization, copies), eviction order, swap,
sink+window eviction, and every bad input (a ValueError, state unchanged)."""

from __future__ import annotations

import subprocess
import sys
from array import array

import pytest
from kv_harness import snapshot

from ioattn.kv import EVICTED, PLACEHOLDER, InvariantError, KVCacheManager
from ioattn.kv.prefix_hash import ROOT, block_digest, block_key

BS = 4


def computed(manager, seq_id, tokens, extra_key=None, **kwargs):
    """Allocate and mark the whole prompt computed, as an engine does after the prefill step."""
    cached = manager.allocate(seq_id, tokens, extra_key, **kwargs)
    manager.mark_computed(seq_id, len(tokens))
    manager.check_invariants()
    return cached


def test_import_does_not_pull_in_torch():
    code = "import sys, ioattn.kv; assert 'torch' not in sys.modules, 'ioattn.kv imported torch'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_tables_and_slots():
    m = KVCacheManager(8, BS, watermark=0.0)
    assert m.allocate("a", range(10)) == 0
    assert m.block_table("a") == [0, 1, 2]
    assert m.slot_mapping("a", 0, 10) == list(range(10))
    assert m.append("a", [1, 2, 3]) == []
    assert m.block_table("a") == [0, 1, 2, 3]
    assert m.slot_mapping("a", 11, 13) == [11, 12]
    assert m.slot_mapping("a", 5, 5) == []
    m.check_invariants()


def test_block_tables_of_a_batch_are_int32_back_to_back():
    m = KVCacheManager(8, BS, num_cpu_blocks=2, watermark=0.0)
    m.allocate("a", range(6))
    m.allocate("b", range(3))
    tables, lengths = m.block_tables(["b", "a"])
    assert lengths == [1, 2] and array("i", tables).tolist() == m.block_table("b") + m.block_table("a")
    m.swap_out("b")
    with pytest.raises(ValueError, match="swapped out"):
        m.block_tables(["a", "b"])
    with pytest.raises(ValueError, match="unknown"):
        m.block_tables(["ghost"])


def test_prefix_hits_exact_accounting():
    m = KVCacheManager(16, BS, watermark=0.0)
    system = list(range(100, 108))  # two full blocks
    assert computed(m, "a", system + [1, 2, 3]) == 0
    assert computed(m, "b", system + [4, 5]) == 8
    assert m.block_table("b")[:2] == m.block_table("a")[:2]
    # The same full blocks after a different first block are a different prefix.
    assert computed(m, "c", [0] + system) == 0
    # A prompt that is entirely cached still computes its last block: at most the blocks before it hit.
    assert computed(m, "d", system) == 4
    stats = m.stats()
    assert stats.prefix_query_tokens == 11 + 10 + 9 + 8
    assert stats.prefix_hit_tokens == 8 + 4
    assert stats.prefix_hit_rate == pytest.approx(12 / 38)


def test_no_hit_before_mark_computed_nor_across_extra_keys():
    m = KVCacheManager(16, BS, watermark=0.0)
    prompt = list(range(9))
    m.allocate("a", prompt)
    assert m.allocate("b", prompt) == 0  # a's KV is not written yet
    m.mark_computed("a", 5)  # block 0 written, block 1 not
    assert m.allocate("c", prompt) == 4
    m.mark_computed("a", 9)
    assert m.allocate("d", prompt, extra_key="adapter-1") == 0
    assert m.allocate("e", prompt) == 8
    m.check_invariants()


def test_prefix_caching_disabled():
    m = KVCacheManager(16, BS, enable_prefix_caching=False, watermark=0.0)
    computed(m, "a", list(range(9)))
    assert computed(m, "b", list(range(9))) == 0
    stats = m.stats()
    assert (stats.prefix_query_tokens, stats.prefix_hit_tokens, stats.blocks_used) == (0, 0, 6)


def test_resumed_request_is_not_a_prefix_hit():
    m = KVCacheManager(16, BS, watermark=0.0)
    computed(m, "a", list(range(9)))
    m.append("a", [9, 10, 11, 12])
    m.mark_computed("a", 13)
    tokens = list(m.seqs["a"].token_ids)
    m.free("a")  # preempted by recompute
    assert computed(m, "a", tokens, is_resume=True) == 12
    stats = m.stats()
    assert (stats.prefix_query_tokens, stats.prefix_hit_tokens, stats.resume_hit_tokens) == (9, 0, 12)


def test_finished_blocks_stay_cached_and_lru_evicts_deepest_first():
    m = KVCacheManager(8, BS, watermark=0.0)
    computed(m, "old", list(range(12)) + [99])  # blocks 0, 1, 2 full + 3 partial
    computed(m, "new", list(range(50, 58)) + [99])  # blocks 4, 5 full + 6 partial
    m.free("old")
    m.free("new")
    stats = m.stats()
    assert (stats.blocks_free, stats.blocks_cached, stats.blocks_used) == (3, 5, 0)
    # Fresh blocks come from the free list first (a stack: the partial blocks 6 and 3 as freed, then 7),
    # then the LRU: the older sequence's deepest block (2), then its next (1).
    m.allocate("x", [7] * 4 * 5)
    assert m.block_table("x") == [6, 3, 7, 2, 1]
    assert m.stats().evictions == 2
    m.free("x")
    # old's first block and all of new's blocks survived.
    assert computed(m, "old2", list(range(12)) + [99]) == 4
    assert computed(m, "new2", list(range(50, 58)) + [99]) == 8


def test_hit_revives_a_cached_block():
    m = KVCacheManager(4, BS, watermark=0.0)
    computed(m, "a", list(range(5)))
    m.free("a")
    assert m.stats().blocks_cached == 1
    assert computed(m, "b", list(range(5))) == 4
    stats = m.stats()
    assert (stats.blocks_cached, stats.blocks_used, stats.blocks_free) == (0, 2, 2)


def test_out_of_blocks_returns_none_and_changes_nothing():
    m = KVCacheManager(4, BS, num_cpu_blocks=2, watermark=0.0)
    computed(m, "a", list(range(9)))  # 3 blocks
    before = snapshot(m)
    assert m.allocate("b", list(range(50, 59))) is None
    assert m.append("a", list(range(8))) is None
    assert m.swap_out("a") is None  # 3 blocks do not fit 2 CPU blocks
    assert snapshot(m) == before


def test_watermark_stops_admission_not_decoding():
    m = KVCacheManager(10, BS, watermark=0.2)  # 2 blocks kept in reserve
    assert m.watermark_blocks == 2
    m.allocate("z", range(4))
    assert m.allocate("a", range(4 * 8)) is None  # 8 more blocks would leave 1
    assert m.allocate("a", range(4 * 7)) == 0  # 7 leave 2
    assert m.append("a", [1]) == []  # decoding may use the reserve
    assert m.append("a", [1] * 4) == []
    assert m.stats().blocks_free == 0
    assert m.append("a", [1] * 4) is None
    m.check_invariants()


def test_copy_on_write_only_for_a_shared_partial_block():
    m = KVCacheManager(16, BS, watermark=0.0)
    computed(m, "p", list(range(6)))  # blocks 0 (full), 1 (2 tokens)
    m.fork("p", "c")
    assert m.block_table("c") == [0, 1]
    assert m.append("c", [7]) == [(1, 2)]  # the write would land in shared block 1
    assert m.block_table("c") == [0, 2]
    assert m.append("p", [8]) == []  # block 1 is p's alone now
    assert m.append("c", [9, 10, 11]) == []  # fills block 2, then a fresh block 3
    m.fork("c", "d")  # c holds 10 tokens: block 3 is partial and shared
    assert m.append("d", [1]) == [(3, 4)]
    m.append("p", [1])  # p: 8 tokens, block 1 full
    m.fork("p", "q")
    assert m.append("p", [5]) == []  # the write goes to a fresh block: nothing to copy
    assert m.stats().cow_copies == 2
    m.check_invariants()


def test_utilization_and_fragmentation_exact():
    m = KVCacheManager(16, BS, watermark=0.0)
    m.allocate("a", range(5))  # 2 blocks, 5 tokens
    m.allocate("b", range(8))  # 2 full blocks
    m.fork("a", "c")  # shares both blocks: no new memory, no new tokens held
    stats = m.stats()
    assert (stats.blocks_used, stats.slots_allocated, stats.tokens_held) == (4, 16, 13)
    assert stats.internal_fragmentation == 3
    assert stats.utilization == pytest.approx(13 / 16)
    m.append("c", [1])  # copy-on-write: c's own partial block now holds 2 tokens
    stats = m.stats()
    assert (stats.blocks_used, stats.tokens_held) == (5, 15)


def test_swap_out_and_in_share_blocks_once():
    m = KVCacheManager(16, BS, num_cpu_blocks=8, watermark=0.0)
    system = list(range(8))
    computed(m, "a", system + [1])
    computed(m, "b", system + [2, 3])  # shares blocks 0, 1 with a
    out_a = m.swap_out("a")
    assert [gpu for gpu, _ in out_a] == [0, 1, 2]
    with pytest.raises(ValueError, match="swapped out"):
        m.block_table("a")
    out_b = m.swap_out("b")
    assert len(out_b) == 1  # the shared prefix is on the CPU already: only b's partial block is copied
    stats = m.stats()
    assert (stats.cpu_blocks_used, stats.swap_out_blocks, stats.sequences_swapped) == (4, 4, 2)
    # The GPU copies of the prefix stay cached: swap_in revives them instead of copying.
    back_a = m.swap_in("a")
    assert len(back_a) == 1 and m.block_table("a")[:2] == [0, 1]
    m.check_invariants()
    m.free("b")
    m.free("a")
    stats = m.stats()
    assert (stats.blocks_used, stats.cpu_blocks_used) == (0, 0)


def test_swap_copies_every_block_without_prefix_caching():
    m = KVCacheManager(16, BS, num_cpu_blocks=8, enable_prefix_caching=False, watermark=0.0)
    computed(m, "a", list(range(9)))
    m.fork("a", "b")
    assert len(m.swap_out("a")) == 3
    assert len(m.swap_out("b")) == 3
    assert m.stats().cpu_blocks_used == 6
    m.check_invariants()


def test_swap_in_respects_watermark():
    m = KVCacheManager(10, BS, num_cpu_blocks=10, watermark=0.2)
    m.allocate("a", range(4 * 8))
    assert len(m.swap_out("a")) == 8
    m.allocate("b", range(100, 101))
    before = snapshot(m)
    assert m.swap_in("a") is None  # 8 more would leave 1 < 2
    assert snapshot(m) == before


def test_evict_window_keeps_positions():
    m = KVCacheManager(16, BS, watermark=0.0)
    computed(m, "a", list(range(30)))  # blocks 0..7, the last holds 2 tokens
    # Sinks: the first 2 tokens (block 0 kept). Window: the last 9 tokens, positions 21..29 (blocks 5..7).
    freed = m.evict_window("a", sink_tokens=2, window_tokens=9)
    assert freed == [4, 3, 2, 1]  # deepest first
    assert m.block_table("a") == [0, EVICTED, EVICTED, EVICTED, EVICTED, 5, 6, 7]
    assert m.slot_mapping("a", 0, 2) == [0, 1]
    assert m.slot_mapping("a", 20, 22) == [20, 21]
    with pytest.raises(ValueError, match="evicted"):
        m.slot_mapping("a", 4, 5)
    assert m.evict_window("a", 2, 9) == []
    m.append("a", [1] * 7)  # 37 tokens: blocks 5, 6 leave the window of 9
    assert m.evict_window("a", 2, 9) == [6, 5]
    stats = m.stats()
    assert (stats.window_evicted_blocks, stats.blocks_used) == (6, 4)
    # Evicted cached blocks stay findable for other requests.
    assert computed(m, "b", list(range(30))) == 28
    m.fork("a", "c")
    m.free("a")
    m.free("c")
    m.free("b")
    assert m.stats().blocks_used == 0


def test_placeholder_reserves_a_slot_and_is_hashed_only_once_filled():
    """Asynchronous scheduling: a sampled token's slot is reserved before its value is known."""
    m = KVCacheManager(8, BS, num_cpu_blocks=4, watermark=0.0)
    computed(m, "a", list(range(7)))
    assert m.append("a", [PLACEHOLDER]) == []
    assert m.slot_mapping("a", 7, 8) == [7] and m.block_table("a") == [0, 1]
    with pytest.raises(ValueError, match="PLACEHOLDER"):
        m.mark_computed("a", 8)  # block 1 would be hashed with an unknown token
    m.fill("a", 7, 42)
    m.mark_computed("a", 8)
    m.check_invariants()
    assert computed(m, "b", list(range(7)) + [42, 1]) == 8  # both full blocks hit, the filled one included
    m.append("b", [PLACEHOLDER])
    m.swap_out("b")
    m.fill("b", 9, 3)  # also while swapped out
    m.check_invariants()


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda m: m.allocate("new", [1, PLACEHOLDER]), "PLACEHOLDER"),
        (lambda m: m.fill("a", 5, 1), "does not hold a PLACEHOLDER"),
        (lambda m: m.fill("p", 6, -3), "token_id"),
        (lambda m: m.fill("p", 7, 1), "does not hold a PLACEHOLDER"),
        (lambda m: m.fork("p", "z"), "PLACEHOLDER"),
        (lambda m: m.mark_computed("q", 8), "PLACEHOLDER"),
        (lambda m: m.fill("p", 6, 2**70), "token_id"),
        (lambda m: m.fill("p", 6, True), "token_id"),
        (lambda m: m.fill("p", 6, 1.0), "token_id"),
        (lambda m: m.fill("p", True, 1), "position"),
        (lambda m: m.allocate("new", [1, "a"]), r"token_ids must be ints in \[0, 2\*\*63\), got \['a'\]"),
        (lambda m: m.allocate("new", [1.5]), "token_ids"),
        (lambda m: m.allocate("new", [None]), "token_ids"),
        (lambda m: m.allocate("new", [2**70]), "token_ids"),
        (lambda m: m.allocate("new", [2**63]), "token_ids"),
        (lambda m: m.allocate("new", [True]), "token_ids"),
        (lambda m: m.allocate("new", [-2]), "token_ids"),
        (lambda m: m.allocate(["unhashable"], [1]), "seq_id must be hashable"),
        (lambda m: m.append("a", ["a"]), r"token_ids must be ints in \[0, 2\*\*63\) or PLACEHOLDER"),
        (lambda m: m.append("a", [1, 2**70]), "token_ids"),
        (lambda m: m.append("a", [True]), "token_ids"),
        (lambda m: m.append("a", [-2]), "token_ids"),
        (lambda m: m.append({}, [1]), "seq_id must be hashable"),
        (lambda m: m.mark_computed("a", True), "num_tokens"),
        (lambda m: m.mark_computed("a", 6.0), "num_tokens"),
        (lambda m: m.export_prefix([1, None]), "token_ids"),
        (lambda m: m.import_prefix([1, 2, 3, "x"], []), "token_ids"),
        (lambda m: m.fork("a", ["x"]), "child_id must be hashable"),
        (lambda m: m.free("ghost"), "unknown sequence"),
        (lambda m: m.allocate("a", [1]), "already exists"),
        (lambda m: m.allocate("new", []), "at least one token"),
        (lambda m: m.allocate("new", range(4 * 16 + 1)), "can ever admit"),
        (lambda m: m.allocate("new", [1], extra_key={"x": 1}), "extra_key"),
        (lambda m: m.fork("a", "s"), "already exists"),
        (lambda m: m.fork("ghost", "z"), "unknown sequence"),
        (lambda m: m.append("s", [1]), "swapped out"),
        (lambda m: m.fork("s", "z"), "swapped out"),
        (lambda m: m.block_table("s"), "swapped out"),
        (lambda m: m.slot_mapping("s", 0, 1), "swapped out"),
        (lambda m: m.evict_window("s", 0, 4), "swapped out"),
        (lambda m: m.mark_computed("s", 1), "swapped out"),
        (lambda m: m.swap_out("s"), "swapped out"),
        (lambda m: m.swap_in("a"), "not swapped out"),
        (lambda m: m.slot_mapping("a", 0, 99), "start, end"),
        (lambda m: m.slot_mapping("a", 3, 2), "start, end"),
        (lambda m: m.mark_computed("a", 99), "num_tokens"),
        (lambda m: m.mark_computed("a", 0), "num_tokens"),  # already computed 6
        (lambda m: m.evict_window("a", -1, 4), "sink_tokens"),
        (lambda m: m.evict_window("a", 0, 0), "window_tokens"),
        (lambda m: m.export_prefix(range(6), extra_key=[1]), "extra_key"),
        (lambda m: m.import_prefix(range(4), [bytes(32)], extra_key=[1]), "extra_key"),
        (lambda m: m.import_prefix(range(7), [bytes(32)] * 2), "cannot fill"),
        # A right first digest and a wrong second: nothing of the first is imported either.
        (lambda m: m.import_prefix(range(8), [m.export_prefix(range(6))[0][1], bytes(32)]), r"digests\[1\]"),
        # The right tokens under another extra_key are another block.
        (lambda m: m.import_prefix(range(4), [m.export_prefix(range(6))[0][1]], extra_key="x"), r"digests\[0\]"),
    ],
)
def test_bad_input_raises_and_changes_nothing(call, match):
    m = KVCacheManager(16, BS, num_cpu_blocks=4, watermark=0.0)
    computed(m, "a", list(range(6)))
    computed(m, "s", list(range(6)))
    m.swap_out("s")
    computed(m, "p", list(range(6)))
    m.append("p", [PLACEHOLDER])
    computed(m, "q", list(range(7)))
    m.append("q", [PLACEHOLDER])
    before = snapshot(m)
    with pytest.raises(ValueError, match=match):
        call(m)
    assert snapshot(m) == before


def test_mark_computed_hashes_before_it_changes_anything():
    """Even a token that slipped past the checks (here written in by hand) fails the hashing before num_computed,
    the digests or the prefix cache move: no half-registered chain."""
    m = KVCacheManager(8, BS, watermark=0.0)
    m.allocate("a", list(range(12)))
    m.mark_computed("a", 4)
    m.seqs["a"].token_ids[9] = 2**70
    before = snapshot(m)
    with pytest.raises(OverflowError):
        m.mark_computed("a", 12)
    assert snapshot(m) == before


def test_export_then_import_into_another_manager_hits():
    prefill, decode = KVCacheManager(8, BS, watermark=0.0), KVCacheManager(8, BS, watermark=0.0)
    prompt = list(range(100, 111))  # full blocks 0 and 1 before the block of the last token
    computed(prefill, "p", prompt)
    prefill.free("p")
    before = snapshot(prefill)
    exported = prefill.export_prefix(prompt)
    assert snapshot(prefill) == before
    assert exported == [(0, block_digest(block_key(ROOT, prompt[:4], None))), (1, exported[1][1])]
    digests = [digest for _, digest in exported]
    # The decode side has the first block already (a shared prefix, held by a running sequence).
    computed(decode, "other", prompt[:4] + [7])
    assert decode.import_prefix(prompt, digests) == [(1, 2)]
    decode.check_invariants()
    stats = decode.stats()
    assert (stats.blocks_used, stats.blocks_cached) == (2, 1)
    assert decode.import_prefix(prompt, digests) == []  # all cached now: nothing to write
    assert computed(decode, "d", prompt) == 8
    assert decode.block_table("d")[:2] == [0, 2]
    assert decode.export_prefix(prompt) == exported[:1] + [(2, digests[1])]


def test_import_is_all_or_nothing_ignores_the_watermark_and_evicts_deepest_first():
    m = KVCacheManager(4, BS, watermark=0.25)  # 1 block of admission reserve
    m.allocate("held", range(50, 58))  # blocks 0 and 1
    prompt = list(range(12))
    digests = [block_digest(block_key(ROOT, prompt[:4], None))]
    for i in (1, 2):
        digests.append(block_digest(block_key(digests[-1], prompt[4 * i : 4 * i + 4], None)))
    before = snapshot(m)
    assert m.import_prefix(prompt, digests) is None  # 3 blocks, 2 available
    assert snapshot(m) == before
    # Imported blocks end cached and unheld, so an import takes nothing from the reserve (allocate would refuse).
    assert m.import_prefix(prompt, digests[:2]) == [(0, 2), (1, 3)]
    assert m.stats().blocks_cached == 2 and m.gpu.num_available == 2
    m.free("held")
    m.allocate("x", [9] * 9)  # 3 blocks: the two free ones, then the LRU's oldest: the import's deepest block
    assert m.block_table("x") == [0, 1, 3]
    m.free("x")
    assert m.allocate("y", prompt) == 4
    m.check_invariants()


def test_import_needs_prefix_caching():
    m = KVCacheManager(4, BS, enable_prefix_caching=False)
    with pytest.raises(ValueError, match="enable_prefix_caching"):
        m.import_prefix(range(4), [block_digest(block_key(ROOT, range(4), None))])
    assert m.export_prefix(range(9)) == []


def test_double_free_raises():
    m = KVCacheManager(4, BS)
    m.allocate("a", [1])
    m.free("a")
    with pytest.raises(ValueError, match="unknown sequence"):
        m.free("a")


def test_swap_without_cpu_pool_raises():
    m = KVCacheManager(4, BS)
    m.allocate("a", [1])
    with pytest.raises(ValueError, match="num_cpu_blocks"):
        m.swap_out("a")


@pytest.mark.parametrize(
    "kwargs", [dict(num_blocks=0, block_size=4), dict(num_blocks=4, block_size=0), dict(num_blocks=4, block_size=4,
               num_cpu_blocks=-1), dict(num_blocks=4, block_size=4, watermark=1.0)]
)
def test_bad_construction(kwargs):
    with pytest.raises(ValueError):
        KVCacheManager(**kwargs)


def _corruptions():
    def shared_write(m):  # a token written into a shared block without copy-on-write
        m.seqs["c"].token_ids.append(42)

    def leak(m):
        m.gpu.ref_count[m.gpu.free[-1]] = 1

    def double_free_list(m):
        m.gpu.free.append(m.gpu.free[-1])

    def wrong_registration(m):
        block = m.block_table("a")[2]  # partly filled, so not registered
        m.gpu.register(block, block_key(ROOT, [9, 9, 9, 9], None))

    def lost_evicted(m):
        m.gpu.evictable.popitem()

    return [shared_write, leak, double_free_list, wrong_registration, lost_evicted]


@pytest.mark.parametrize("corrupt", _corruptions(), ids=lambda f: f.__name__)
def test_check_invariants_catches_corruption(corrupt):
    m = KVCacheManager(16, BS, watermark=0.0)
    computed(m, "a", list(range(10)))
    m.fork("a", "c")
    computed(m, "gone", list(range(50, 59)))
    m.free("gone")
    corrupt(m)
    with pytest.raises(InvariantError):
        m.check_invariants()


def test_digest_is_stable_and_chained():
    key = block_key(ROOT, [1, 2, 3, 4], None)
    # Fixed value: a change of the encoding changes every persisted or shared cache key.
    assert block_digest(key).hex()[:16] == "173df53b1e21ddea"
    assert block_digest(block_key(ROOT, [1, 2, 3, 4], "x")) != block_digest(key)
    assert block_digest(block_key(block_digest(key), [1, 2, 3, 4], None)) != block_digest(key)
    assert block_digest(block_key(ROOT, [1, 2, 3], None)) != block_digest(block_key(ROOT, [1, 2, 3, 0], None))

