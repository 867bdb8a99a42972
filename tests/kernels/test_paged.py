"""Paged attention, split combine, merge_states and the cache write kernel against the float64 reference.

The reference gathers each sequence's K/V through its block table (torch indexing) and runs
`attention_ref(causal=True)`: its bottom-right alignment puts query i of a sequence with q_len queries and
seq_len keys at position seq_len - q_len + i, exactly the paged convention. Shapes stay tiny (interpreter).
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ioattn.ops.cache import gather_cache, reshape_and_cache
from ioattn.ops.paged import PagedConfig, merge_states, paged_attention
from ioattn.reference import TOLERANCE, attention_ref, lse_error, rel_error

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # hypothesis tests cannot take function-scoped fixtures
LSE_TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def make_paged_cache(seq_lens, *, page, kv_heads, head_dim, dtype, device, shared_prefix_blocks=0, spare_blocks=3):
    """A shuffled pool with non-contiguous K/V views (K and V interleaved in one buffer) and a block table.

    Blocks are handed out in random order; with `shared_prefix_blocks` every sequence reuses sequence 0's first
    blocks (a shared prompt). Unused table entries are -1, so reading past a sequence would fault.
    """
    per_seq = [math.ceil(n / page) for n in seq_lens]
    num_blocks = sum(per_seq) + spare_blocks
    pool = torch.randn(num_blocks, page, 2, kv_heads, head_dim, dtype=dtype, device=device)
    k_cache, v_cache = pool[:, :, 0], pool[:, :, 1]
    order = torch.randperm(num_blocks).tolist()
    width = max(per_seq + [1]) + 1
    table = torch.full((len(seq_lens), width), -1, dtype=torch.int32)
    for b, count in enumerate(per_seq):
        for j in range(count):
            table[b, j] = table[0, j] if (b and j < min(shared_prefix_blocks, per_seq[0])) else order.pop()
    return k_cache, v_cache, table.to(device)


def gather(cache, table_row, n):
    """(n, kv_heads, D): the first n logical positions of one sequence, through its block table."""
    page = cache.shape[1]
    blocks = table_row[: math.ceil(n / page)].long()
    return cache[blocks].reshape(-1, *cache.shape[2:])[:n]


def reference(q, k_cache, v_cache, table, seq_lens, q_lens, **rules):
    keys = torch.cat([gather(k_cache, table[b], n) for b, n in enumerate(seq_lens)])
    values = torch.cat([gather(v_cache, table[b], n) for b, n in enumerate(seq_lens)])
    cu_q = torch.tensor([0] + q_lens).cumsum(0).to(torch.int32)
    cu_k = torch.tensor([0] + list(seq_lens)).cumsum(0).to(torch.int32)
    return attention_ref(q, keys, values, causal=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, **rules)


def run_case(device, *, seq_lens, q_lens=None, page=4, heads=4, kv_heads=2, head_dim=64, dtype=torch.float32,
             num_splits=1, window_size=(-1, -1), sink_tokens=0, shared_prefix_blocks=0, gather=None, config=None):
    """Build a case, run the kernel on a NaN-poisoned output, check output and LSE; returns (out, lse)."""
    k_cache, v_cache, table = make_paged_cache(seq_lens, page=page, kv_heads=kv_heads, head_dim=head_dim,
                                               dtype=dtype, device=device, shared_prefix_blocks=shared_prefix_blocks)
    decode = q_lens is None
    lens = [1] * len(seq_lens) if decode else list(q_lens)
    q = torch.randn(sum(lens), heads, head_dim, dtype=dtype, device=device)
    extra = {} if decode else dict(cu_seqlens_q=torch.tensor([0] + lens, device=device).cumsum(0).to(torch.int32),
                                   max_seqlen_q=max(lens))
    out = torch.full_like(q, float("nan"))
    rules = dict(window_size=window_size, sink_tokens=sink_tokens)
    _, lse = paged_attention(q, k_cache, v_cache, table, torch.tensor(seq_lens, dtype=torch.int32, device=device),
                             num_splits=num_splits, return_lse=True, out=out, gather=gather, config=config, **rules,
                             **extra)
    ref_out, ref_lse = reference(q, k_cache, v_cache, table, seq_lens, lens, **rules)
    assert lse.dtype == torch.float32
    assert lse.shape == ((len(seq_lens), heads) if decode else (heads, len(q)))
    if decode:
        ref_lse = ref_lse.t()
    err = rel_error(out, ref_out)
    assert err < TOLERANCE[dtype], f"output error {err:.3g}"
    assert lse_error(lse, ref_lse) < LSE_TOLERANCE[dtype]
    return out, lse


@pytest.mark.parametrize("num_splits", [1, 3])
def test_paired_whole_tiles(device, num_splits):
    # paired_tiles: whole tiles two per loop step, an odd last one alone; even and odd counts of whole tiles per
    # split, empty and one-token sequences, windows and sinks (boundary tiles around the pairs), multi-token tiles.
    config = PagedConfig(block_m=16, block_n=16, num_warps=4, num_stages=2, paired_tiles=True)
    run_case(device, seq_lens=[16 * 6, 16 * 7 + 3, 0, 1, 16 * 2, 16 * 11], page=4, num_splits=num_splits,
             config=config)
    run_case(device, seq_lens=[200, 57], page=32, window_size=(80, -1), sink_tokens=4, num_splits=num_splits,
             config=config)
    run_case(device, seq_lens=[180, 33], q_lens=[20, 1], page=4, heads=4, kv_heads=2, num_splits=num_splits,
             config=config)


@pytest.mark.parametrize("page", [1, 2, 8, 16, 64, 128, 256])
def test_decode_block_sizes_and_boundaries(device, page):
    # Lengths exactly on a block boundary, one past, one short, a single token, and empty.
    lengths = [page, page + 1, 2 * page - 1 if page > 1 else 3, 1, 0]
    run_case(device, seq_lens=lengths, page=page, num_splits=2 if page < 64 else 1)


@settings(max_examples=12, deadline=None)
@given(group=st.integers(1, 8), kv_heads=st.sampled_from([1, 2]), head_dim=st.sampled_from([40, 64, 72, 128, 256]),
       page=st.sampled_from([1, 4, 16, 32]), lengths=st.lists(st.integers(0, 80), min_size=1, max_size=3),
       dtype=st.sampled_from([torch.float16, torch.float32]))
def test_decode_gqa_head_dims(group, kv_heads, head_dim, page, lengths, dtype):
    run_case(DEVICE, seq_lens=lengths, page=page, heads=group * kv_heads, kv_heads=kv_heads, head_dim=head_dim,
             dtype=dtype, num_splits=0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_split_counts_agree(device, dtype):
    outs = []
    for splits in (1, 3, 16):
        torch.manual_seed(1234)  # the same case for every split count, so their outputs can be compared
        out, lse = run_case(device, seq_lens=[150, 33, 0], page=8, heads=3, kv_heads=1, dtype=dtype,
                            num_splits=splits)
        outs.append((out.float(), lse))
    for out, lse in outs[1:]:
        assert rel_error(out, outs[0][0]) < TOLERANCE[dtype]
        assert lse_error(lse, outs[0][1]) < LSE_TOLERANCE[dtype]


def test_shared_prefix_blocks(device):
    run_case(device, seq_lens=[40, 33, 48], page=8, shared_prefix_blocks=3, num_splits=3)
    run_case(device, seq_lens=[40, 33, 48], q_lens=[5, 1, 16], page=8, shared_prefix_blocks=3, num_splits=2)


@pytest.mark.parametrize("window_size, sink_tokens, num_splits",
                         [((7, -1), 0, 1), ((7, -1), 3, 3), ((0, -1), 1, 2), ((20, 0), 9, 3), ((-1, -1), 5, 2)])
def test_window_and_sinks(device, window_size, sink_tokens, num_splits):
    lengths = [150, 13, 0]
    rules = dict(window_size=window_size, sink_tokens=sink_tokens, num_splits=num_splits)
    run_case(device, seq_lens=lengths, page=4, heads=2, kv_heads=1, **rules)
    run_case(device, seq_lens=lengths, q_lens=[9, 13, 0], page=16, heads=3, kv_heads=1, **rules)


@settings(max_examples=6, deadline=None)
@given(data=st.data(), group=st.sampled_from([1, 3, 4, 8]), page=st.sampled_from([1, 8, 64]),
       dtype=st.sampled_from([torch.float16, torch.float32]), num_splits=st.sampled_from([0, 1, 4]))
def test_multi_token_queries(data, group, page, dtype, num_splits):
    # Chunked prefill / append / speculative verify: q_len ranges from 0 to the whole sequence.
    seq_lens = data.draw(st.lists(st.integers(0, 70), min_size=1, max_size=2))
    q_lens = [data.draw(st.integers(0, n)) for n in seq_lens]
    run_case(DEVICE, seq_lens=seq_lens, q_lens=q_lens, page=page, heads=group, kv_heads=1, dtype=dtype,
             num_splits=num_splits)



@settings(max_examples=6, deadline=None)
@given(data=st.data(), group=st.sampled_from([1, 4, 8]), page=st.sampled_from([1, 4, 16]),
       head_dim=st.sampled_from([64, 72]), dtype=st.sampled_from([torch.float16, torch.float32]))
def test_gathered_context_path_matches_reference(data, group, page, head_dim, dtype):
    # gather=True: the context is packed through the block table and the dense varlen forward runs over it (the
    # default for long chunks); zero-length sequences, zero-length chunks and whole-sequence chunks included.
    seq_lens = data.draw(st.lists(st.integers(0, 70), min_size=1, max_size=3))
    q_lens = [data.draw(st.sampled_from([0, 1, n // 2, n])) if n else 0 for n in seq_lens]
    run_case(DEVICE, seq_lens=seq_lens, q_lens=q_lens, page=page, heads=2 * group, kv_heads=2, head_dim=head_dim,
             dtype=dtype, gather=True)


def test_gathered_path_refuses_windows_and_sinks(device):
    for rules in (dict(window_size=(8, -1)), dict(sink_tokens=2)):
        with pytest.raises(ValueError, match="gather=True"):
            run_case(device, seq_lens=[20], q_lens=[5], gather=True, **rules)


@pytest.mark.parametrize("page", [1, 4, 16])
def test_gather_cache_packs_each_sequence_and_zeroes_evicted_blocks(device, page):
    seq_lens = [37, 0, 5, 16]
    k_cache, v_cache, table = make_paged_cache(seq_lens, page=page, kv_heads=3, head_dim=40, dtype=torch.float16,
                                               device=device)
    evicted = table[0, 1].item()
    table[0, 1] = -1
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    cu = torch.tensor([0] + seq_lens, device=device).cumsum(0).to(torch.int32)
    capacity = sum(seq_lens) + 7
    keys, values = gather_cache(k_cache, v_cache, table, lens, cu, capacity)
    assert keys.shape == (capacity, 3, 40) and keys.dtype == torch.float16
    table[0, 1] = evicted
    for b, n in enumerate(seq_lens):
        start = cu[b].item()
        want_k, want_v = gather(k_cache, table[b], n).clone(), gather(v_cache, table[b], n).clone()
        if b == 0:  # positions of the evicted block read as zeros
            want_k[page : 2 * page] = 0
            want_v[page : 2 * page] = 0
        assert torch.equal(keys[start : start + n], want_k)
        assert torch.equal(values[start : start + n], want_v)


@pytest.mark.parametrize("page, q_lens", [(4, None), (16, None), (4, [6, 1]), (16, [6, 1])])
def test_evicted_blocks_are_never_read(device, page, q_lens):
    # A sink + window eviction policy frees the blocks between the sinks and the window and marks them -1 in the
    # table (ioattn.kv's evict_window); tiles straddling them must not load through block -1 (which would read
    # before the pool, or NaN) and must give exactly the sink + window attention.
    seq_lens, window, sinks = [150, 97], (24, -1), 4
    k_cache, v_cache, table = make_paged_cache(seq_lens, page=page, kv_heads=1, head_dim=32, dtype=torch.float32,
                                               device=device)
    lens = [1] * len(seq_lens) if q_lens is None else q_lens
    q = torch.randn(sum(lens), 2, 32, device=device)
    reference_out = reference(q, k_cache, v_cache, table, seq_lens, lens, window_size=window, sink_tokens=sinks)[0]
    for b, n in enumerate(seq_lens):
        first_needed = n - max(lens[b], 1) - window[0]  # the earliest position any query of b sees in its window
        for j in range(table.shape[1]):
            if sinks <= j * page and (j + 1) * page <= first_needed:  # wholly between the sinks and the window
                k_cache[table[b, j]] = float("nan")
                v_cache[table[b, j]] = float("nan")
                table[b, j] = -1
    extra = {} if q_lens is None else dict(
        cu_seqlens_q=torch.tensor([0] + lens, device=device).cumsum(0).to(torch.int32), max_seqlen_q=max(lens))
    for splits in (1, 3):
        out = paged_attention(q, k_cache, v_cache, table, torch.tensor(seq_lens, dtype=torch.int32, device=device),
                              window_size=window, sink_tokens=sinks, num_splits=splits, **extra)
        assert not torch.isnan(out).any()
        assert rel_error(out, reference_out) < TOLERANCE[torch.float32]

def test_empty_sequences_give_zero_and_neg_inf(device):
    out, lse = run_case(device, seq_lens=[0, 0], num_splits=4)
    assert torch.equal(out, torch.zeros_like(out))
    assert torch.isneginf(lse).all()


def test_merge_states_matches_reference_over_the_union(device):
    # Two disjoint key sets of one decode step: their merge equals attention over both (cascade attention).
    heads, head_dim = 4, 64
    q = torch.randn(3, heads, head_dim, device=device)
    k_a, v_a, k_b, v_b = (torch.randn(3, 20, heads, head_dim, device=device) for _ in range(4))
    parts = []
    for k, v in ((k_a, v_a), (k_b, v_b)):
        o, lse = attention_ref(q[:, None], k, v)
        parts += [o[:, 0].float(), lse[:, :, 0].float()]
    ref_out, ref_lse = attention_ref(q[:, None], torch.cat([k_a, k_b], 1), torch.cat([v_a, v_b], 1))
    out, lse = merge_states(*parts)
    assert rel_error(out, ref_out[:, 0]) < TOLERANCE[torch.float32]
    assert lse_error(lse, ref_lse[:, :, 0]) < 1e-5


@pytest.mark.parametrize("splits, head_dim", [(64, 512), (3, 136), (5, 40)])
def test_split_combine_over_column_blocks(device, splits, head_dim):
    # Heads wider than COMBINE_COLUMNS go out in column blocks (512: four; 136: 128 + 8 masked); each block merges
    # the same splits, the first stores LSE. Empty splits (lse -inf, output NaN) weigh nothing; a row whose splits
    # are all empty gives 0 and -inf.
    from ioattn.ops.paged import combine_splits

    tokens, heads = 2, 3
    part_out = torch.randn(splits, tokens, heads, head_dim, device=device)
    part_lse = torch.randn(splits, tokens, heads, device=device) * 4
    part_lse[1::2, 0] = float("-inf")
    part_out[1::2, 0] = float("nan")
    part_lse[:, 1, 2] = float("-inf")
    out = torch.full((tokens, heads, head_dim), float("nan"), dtype=torch.bfloat16, device=device)
    lse = torch.full((tokens, heads), float("nan"), device=device)
    combine_splits(part_out, part_lse, out, lse, dependent=False)
    weight = torch.softmax(part_lse.double(), 0).nan_to_num(0.0)
    expected = (torch.where(weight[..., None] > 0, part_out.double(), 0.0) * weight[..., None]).sum(0)
    expected_lse = torch.logsumexp(part_lse.double(), 0)
    assert rel_error(out, expected) < TOLERANCE[torch.bfloat16]
    assert lse_error(lse, expected_lse) < 1e-5 and torch.isneginf(lse[1, 2])
    assert torch.equal(out[1, 2], torch.zeros_like(out[1, 2]))


def test_merge_states_empty_sides_never_nan(device):
    o_a = torch.randn(2, 3, 40, device=device)
    o_b = torch.full_like(o_a, float("nan"))  # an empty side's output is garbage and must be ignored
    lse_a = torch.randn(2, 3, device=device)
    lse_b = torch.full_like(lse_a, float("-inf"))
    out, lse = merge_states(o_a, lse_a, o_b, lse_b)
    assert torch.equal(out, o_a) and torch.allclose(lse, lse_a)
    out, lse = merge_states(o_b, lse_b, o_a, lse_a)
    assert torch.equal(out, o_a) and torch.allclose(lse, lse_a)
    out, lse = merge_states(o_b, lse_b, o_b.clone(), lse_b.clone())
    assert torch.equal(out, torch.zeros_like(out)) and torch.isneginf(lse).all()


@pytest.mark.parametrize("page, kv_heads, head_dim, cache_dtype",
                         [(1, 1, 64, torch.float32), (16, 3, 40, torch.float16), (256, 2, 128, torch.float32)])
def test_reshape_and_cache_writes_slots_and_skips_padding(device, page, kv_heads, head_dim, cache_dtype):
    num_blocks, tokens = 8, 7
    key = torch.randn(tokens, kv_heads, head_dim, device=device)
    value = torch.randn(tokens, kv_heads, head_dim, device=device)
    k_cache = torch.full((num_blocks, page, kv_heads, head_dim), float("nan"), dtype=cache_dtype, device=device)
    v_cache = torch.full_like(k_cache, float("nan"))
    slots = torch.randperm(num_blocks * page)[:tokens]
    slots[torch.tensor([1, 4])] = -1
    reshape_and_cache(key, value, k_cache, v_cache, slots.to(device))
    written = slots >= 0
    flat_k, flat_v = k_cache.reshape(-1, kv_heads, head_dim), v_cache.reshape(-1, kv_heads, head_dim)
    assert torch.equal(flat_k[slots[written]], key[written].to(cache_dtype))
    assert torch.equal(flat_v[slots[written]], value[written].to(cache_dtype))
    untouched = torch.ones(num_blocks * page, dtype=torch.bool)
    untouched[slots[written]] = False
    assert torch.isnan(flat_k[untouched]).all() and torch.isnan(flat_v[untouched]).all()


@pytest.mark.gpu
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(32, 8, 128), (8, 8, 64), (28, 4, 256), (12, 4, 72)])
@pytest.mark.parametrize("page", [16, 128])
@pytest.mark.parametrize("num_splits", [0, 1, 7])
def test_bf16_on_gpu(heads, kv_heads, head_dim, page, num_splits):
    seq_lens = [1000, 17, 0, 4096, 513]
    run_case("cuda", seq_lens=seq_lens, page=page, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
             dtype=torch.bfloat16, num_splits=num_splits)
    run_case("cuda", seq_lens=seq_lens, q_lens=[300, 17, 0, 1, 513], page=page, heads=heads, kv_heads=kv_heads,
             head_dim=head_dim, dtype=torch.bfloat16, num_splits=num_splits, window_size=(256, -1), sink_tokens=4)


@pytest.mark.gpu
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(32, 8, 128), (8, 8, 64), (28, 4, 256), (12, 4, 72)])
@pytest.mark.parametrize("page", [1, 16, 128])
@pytest.mark.parametrize("gather", [None, True, False])
def test_bf16_chunked_prefill_on_gpu(heads, kv_heads, head_dim, page, gather):
    # Long chunks on long contexts (the gathered path by default), a one-token chunk and an empty sequence.
    seq_lens = [4096, 17, 0, 2048, 1500]
    run_case("cuda", seq_lens=seq_lens, q_lens=[2048, 17, 0, 1, 1500], page=page, heads=heads, kv_heads=kv_heads,
             head_dim=head_dim, dtype=torch.bfloat16, num_splits=1 if gather is not False else 0, gather=gather)


@pytest.mark.gpu
def test_row_slices_and_token_counts_reuse_one_compiled_kernel():
    # An engine passes each step's rows as slices of one batch (seq_lens[n:], block_table[n:]) and its token count
    # changes every step: neither may compile a new specialisation mid-serving (it stalls for seconds).
    from ioattn.kernels.paged_attention import paged_attention_kernel

    seq_lens = [300, 40, 200, 96, 64, 513]
    k_cache, v_cache, table = make_paged_cache(seq_lens, page=16, kv_heads=2, head_dim=64, dtype=torch.bfloat16,
                                               device="cuda")
    lens = torch.tensor(seq_lens, dtype=torch.int32, device="cuda")
    kernel_cache = paged_attention_kernel.device_caches[torch.cuda.current_device()][0]
    sizes = []
    for first, q_lens in ((0, [16, 40, 200, 96, 64, 512]), (1, [33, 7, 96, 1, 2]), (3, [5, 3, 9])):
        q = torch.randn(sum(q_lens), 4, 64, dtype=torch.bfloat16, device="cuda")
        cu = torch.tensor([0] + q_lens, device="cuda").cumsum(0).to(torch.int32)
        paged_attention(q, k_cache, v_cache, table[first:], lens[first:], cu_seqlens_q=cu, max_seqlen_q=max(q_lens),
                        gather=False, num_splits=1)
        sizes.append(len(kernel_cache))
    assert sizes[1:] == sizes[:1] * 2, sizes
