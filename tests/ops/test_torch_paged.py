"""The torch paged backend's reads (`ioattn.ops.torch_paged.CacheReads`): every path it picks (batched decode groups,
cache views, SDPA's causal rule, gathered keys under a mask, the LSE path) against the float64 reference, and the
path itself asserted, so that a change of routing cannot silently leave a case untested."""

from __future__ import annotations

import pytest
import torch

from ioattn.ops import torch_paged
from ioattn.ops.paged import paged_attention
from ioattn.reference import TOLERANCE, attention_ref, rel_error

PAGE, KV_HEADS, GROUP, HEAD_DIM = 4, 2, 3, 32


def pool(lens, dtype, contiguous=False, seed=0, spare=3):
    """Caches holding each sequence's blocks (one run each when `contiguous`, else shuffled) and its table."""
    gen = torch.Generator().manual_seed(seed)
    width = max(1, max(-(-n // PAGE) for n in lens))
    num_blocks = len(lens) * width + spare
    k_cache = torch.randn(num_blocks, PAGE, KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, PAGE, KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
    order = torch.arange(num_blocks) if contiguous else torch.randperm(num_blocks, generator=gen)
    table = order[: len(lens) * width].reshape(len(lens), width).to(torch.int32)
    return k_cache, v_cache, table, gen


def reference(q, k_cache, v_cache, table, lens, q_lens, window=(-1, -1), sinks=0):
    """Float64 attention of each sequence's queries (the last q_len positions) over its gathered keys."""
    outs, start = [], 0
    for row, (n, m) in enumerate(zip(lens, q_lens)):
        if n == 0 or m == 0:
            outs.append(torch.zeros(m, q.shape[1], HEAD_DIM, dtype=torch.float64))
            start += m
            continue
        positions = torch.arange(n)
        slots = table[row].long().clamp(min=0)[positions // PAGE] * PAGE + positions % PAGE
        keys = k_cache.reshape(-1, KV_HEADS, HEAD_DIM)[slots]
        values = v_cache.reshape(-1, KV_HEADS, HEAD_DIM)[slots]
        out, _ = attention_ref(q[start:start + m][None], keys[None], values[None], causal=True, window_size=window,
                               sink_tokens=sinks)
        outs.append(out[0])
        start += m
    return torch.cat(outs)


def group_rows(group) -> list[int]:
    rows = group.rows
    return list(range(rows.start, rows.stop)) if isinstance(rows, slice) else sorted(rows.tolist())


def run(q, k_cache, v_cache, table, lens, cu, window=(-1, 0), sinks=0, decode_rows=None):
    reads = torch_paged.CacheReads.build(table, torch.tensor(lens, dtype=torch.int32), cu, window, sinks, k_cache,
                                         decode_rows=decode_rows)
    return reads, torch_paged.attend(q, k_cache, v_cache, reads, HEAD_DIM ** -0.5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_decode_rows_share_one_padded_call(dtype):
    lens = [9, 30, 1, 17, 30]
    k_cache, v_cache, table, gen = pool(lens, dtype)
    q = torch.randn(len(lens), KV_HEADS * GROUP, HEAD_DIM, generator=gen).to(dtype)
    reads, out = run(q, k_cache, v_cache, table, lens, None)
    assert len(reads.decode_groups) == 1 and reads.decode_groups[0].rows == slice(0, len(lens))
    assert reads.decode_groups[0].bias is not None and not reads.sequences
    assert rel_error(out, reference(q, k_cache, v_cache, table, lens, [1] * len(lens))) < TOLERANCE[dtype]


def test_decode_groups_by_padded_width_and_buffer_size(monkeypatch):
    lens = [64, 3, 60, 0, 5, 2]  # row 3 sees nothing: 0, never NaN
    k_cache, v_cache, table, gen = pool(lens, torch.float32)
    q = torch.randn(len(lens), KV_HEADS * GROUP, HEAD_DIM, generator=gen)
    ref = reference(q, k_cache, v_cache, table, lens, [1] * len(lens))
    monkeypatch.setattr(torch_paged, "WIDTH_STEP", 8)
    reads, out = run(q, k_cache, v_cache, table, lens, None)
    assert [(group.width, group_rows(group)) for group in reads.decode_groups] == [(64, [0, 2]), (8, [1, 4, 5])]
    assert not reads.complete and out[3].abs().max() == 0
    assert rel_error(out, ref) < TOLERANCE[torch.float32]
    monkeypatch.setattr(torch_paged, "GATHER_BYTES", 64 * k_cache[0, 0].nbytes)  # one 64-wide row per group
    reads, out = run(q, k_cache, v_cache, table, lens, None)
    assert [group_rows(group) for group in reads.decode_groups] == [[0], [2], [1, 4, 5]]
    assert rel_error(out, ref) < TOLERANCE[torch.float32]


@pytest.fixture
def torch_threads():
    threads = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(threads)


def test_a_one_query_row_computes_the_same_bits_in_any_batch(torch_threads):
    # Alone, beside rows of other lengths, and as a one-token chunk after a prompt chunk: bit for bit the same
    # (the synchronous and the overlapping engine batch the same token differently). On one torch thread: with
    # more, torch's CPU SDPA shares a small batch's work out differently, and rows move by an ulp or two
    # (2 threads: up to 6e-8), checked apart below.
    torch_threads(1)
    assert_batch_invariant(torch.equal)
    torch_threads(2)
    assert_batch_invariant(lambda a, b: rel_error(a, b) < 1e-6)


def assert_batch_invariant(same) -> None:
    lens = [37, 90, 5, 128, 30]
    k_cache, v_cache, table, gen = pool(lens, torch.float32)
    q = torch.randn(len(lens), KV_HEADS * GROUP, HEAD_DIM, generator=gen)
    _, batched = run(q, k_cache, v_cache, table, lens, None)
    for row in range(len(lens)):
        _, alone = run(q[row:row + 1], k_cache, v_cache, table[row:row + 1], lens[row:row + 1], None)
        assert same(alone[0], batched[row])
    chunk = torch.randn(4, KV_HEADS * GROUP, HEAD_DIM, generator=gen)
    cu = torch.tensor([0, 4, 5], dtype=torch.int32)
    _, mixed = run(torch.cat([chunk, q[:1]]), k_cache, v_cache, table[[1, 0]], [lens[1], lens[0]], cu)
    assert same(mixed[4], batched[0])


def test_a_prompt_computes_the_same_bits_fresh_or_after_a_prefix_hit():
    # A prefix-cache hit leaves only the prompt's tail to compute: those rows must round as in the whole prompt.
    lens = [45]
    k_cache, v_cache, table, gen = pool(lens, torch.float64, contiguous=True, spare=40)
    q = torch.randn(45, KV_HEADS * GROUP, HEAD_DIM, generator=gen, dtype=torch.float64)
    _, whole = run(q, k_cache, v_cache, table, lens, torch.tensor([0, 45], dtype=torch.int32))
    _, tail = run(q[32:], k_cache, v_cache, table, lens, torch.tensor([0, 13], dtype=torch.int32))
    assert torch.equal(tail, whole[32:])


def test_decode_window_sinks_and_an_evicted_block():
    lens = [40, 23]
    k_cache, v_cache, table, gen = pool(lens, torch.float32)
    table[0, 2] = -1  # positions 8..11 of row 0: outside its window (query 39, left 8) and past its 2 sinks
    q = torch.randn(len(lens), KV_HEADS * GROUP, HEAD_DIM, generator=gen)
    _, out = run(q, k_cache, v_cache, table, lens, None, window=(8, 0), sinks=2)
    ref = reference(q, k_cache, v_cache, table, lens, [1, 1], window=(8, 0), sinks=2)
    assert rel_error(out, ref) < TOLERANCE[torch.float32]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_multi_token_paths(dtype):
    # A fresh prompt and a chunk after cached context (cache views under masks), a one-token chunk and an empty
    # chunk, on contiguous tables; then the same on shuffled tables (gathered keys).
    lens, q_lens = [13, 20, 7, 5], [13, 6, 1, 0]
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    for contiguous in (True, False):
        k_cache, v_cache, table, gen = pool(lens, dtype, contiguous=contiguous, spare=40)
        q = torch.randn(sum(q_lens), KV_HEADS * GROUP, HEAD_DIM, generator=gen).to(dtype)
        reads, out = run(q, k_cache, v_cache, table, lens, cu)
        fresh, chunk = reads.sequences  # the one-token chunk is a one-query row: it joins the decode groups
        assert fresh.bias is not None and chunk.bias is not None
        assert len(reads.decode_groups) == 1 and group_rows(reads.decode_groups[0]) == [19]
        assert all(isinstance(s.keys, slice) == contiguous for s in reads.sequences)
        assert rel_error(out, reference(q, k_cache, v_cache, table, lens, q_lens)) < TOLERANCE[dtype]


def test_a_step_of_decodes_then_chunks_and_rows_that_see_nothing():
    lens, q_lens = [9, 30, 12, 6], [1, 1, 5, 6]
    k_cache, v_cache, table, gen = pool(lens, torch.float32)
    cu = torch.tensor([0, 5, 11], dtype=torch.int32)  # the chunk rows, rebased past the 2 decode rows
    q = torch.randn(sum(q_lens), KV_HEADS * GROUP, HEAD_DIM, generator=gen)
    window = (1, 0)  # with sinks 0 and left 1 every query sees 2 keys; the first key of a chunk only itself
    reads, out = run(q, k_cache, v_cache, table, lens, cu, window=window, decode_rows=2)
    assert len(reads.decode_groups) == 1 and len(reads.sequences) == 2
    assert rel_error(out, reference(q, k_cache, v_cache, table, lens, q_lens, window=window)) < 1e-5
    table[3, 0] = -1  # row 3's first block evicted: its first 4 queries see only evicted keys -> 0
    reads, out = run(q, k_cache, v_cache, table, lens, cu, window=(0, 0), decode_rows=2)
    assert reads.sequences[1].seen is not None and not reads.complete
    assert out[7:11].abs().max() == 0 and torch.isfinite(out).all()


def test_public_paged_attention_matches_the_reads_path_and_keeps_lse():
    lens = [9, 4]
    k_cache, v_cache, table, gen = pool(lens, torch.float32)
    q = torch.randn(2, KV_HEADS * GROUP, HEAD_DIM, generator=gen)
    _, direct = run(q, k_cache, v_cache, table, lens, None)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    public = paged_attention(q, k_cache, v_cache, table, seq_lens, backend="torch")
    out, lse = paged_attention(q, k_cache, v_cache, table, seq_lens, backend="torch", return_lse=True)
    assert torch.equal(public, direct)
    assert rel_error(out, direct) < 1e-5 and lse.shape == (2, KV_HEADS * GROUP)
