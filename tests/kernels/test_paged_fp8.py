"""FP8 KV caches: quantization in `reshape_and_cache`, and every attention path over fp8 blocks, against float64.

The reference is computed on the *dequantized* cache (q_fp8 * scale per KV head, in float64): a kernel may add
no error beyond the quantization itself, so the tolerances are those of the query dtype over a 16-bit cache.
Quantization is checked bit for bit against `ioattn.ops.fp8.quantize` (torch's own round-to-nearest-even
conversion after saturation), on the Triton interpreter here and on the GPU (`-m gpu`). Shapes stay tiny.
"""

from __future__ import annotations

import math

import pytest
import torch
import triton
import triton.language as tl
from hypothesis import given, settings
from hypothesis import strategies as st

from ioattn.kernels.paged_attention import to_fp16_by_rows, upcast_fp8_fp16
from ioattn.ops import fp8 as fp8_ops
from ioattn.ops.cache import copy_blocks, gather_cache, reshape_and_cache, swap_blocks
from ioattn.ops.fp8 import dequantize, fp8_max, quantize
from ioattn.ops.paged import PagedConfig, compile_variants, explain_paged, paged_attention
from ioattn.reference import TOLERANCE, attention_ref, lse_error, rel_error

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FORMATS = [torch.float8_e4m3fn, torch.float8_e5m2]
LSE_TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}
# The Triton kernel's fp8 decode, named (on sm_90 the default plan takes the Gluon kernel: tests/kernels/
# test_gluon_paged.py), and the Gluon kernel's.
TRITON_DECODE = PagedConfig(block_m=16, block_n=64, num_warps=4, num_stages=2, maxnreg=128, paired_tiles=True)
GLUON_DECODE = PagedConfig(block_m=16, block_n=64, num_warps=4, num_stages=2, maxnreg=96, kernel="gluon")


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def fp8_pool(seq_lens, *, page, kv_heads, head_dim, fp8, device, query_dtype=torch.float32, spare_blocks=2):
    """Random K/V written through `reshape_and_cache` into a shuffled fp8 pool with per-head scales of different
    magnitudes (so a scale applied to the wrong head shows); returns (k_cache, v_cache, table, k_scale, v_scale)."""
    per_seq = [math.ceil(n / page) for n in seq_lens]
    num_blocks = sum(per_seq) + spare_blocks
    k_cache = torch.zeros(num_blocks, page, kv_heads, head_dim, dtype=fp8, device=device)
    v_cache = torch.zeros_like(k_cache)
    # Four magnitudes, repeating: 32 heads of 4**h would put keys past 1e18 and scores past float32's reach.
    k_scale = (0.0093 * 4.0 ** (torch.arange(kv_heads) % 4).float()).to(device)
    v_scale = (0.011 * 3.0 ** (torch.arange(kv_heads) % 4).float()).to(device)
    order = torch.randperm(num_blocks).tolist()
    table = torch.full((len(seq_lens), max(per_seq + [1]) + 1), -1, dtype=torch.int32)
    slots = []
    for b, (n, count) in enumerate(zip(seq_lens, per_seq)):
        for j in range(count):
            table[b, j] = order.pop()
        positions = torch.arange(n)
        slots.append(table[b, positions // page].long() * page + positions % page)
    slots = torch.cat(slots).to(device)
    # Codes spread over the format's range (e4m3: some saturate), values of the scale's per-head magnitude.
    tokens = slots.numel()
    key = torch.randn(tokens, kv_heads, head_dim, device=device) * k_scale[:, None] * 60
    value = torch.randn(tokens, kv_heads, head_dim, device=device) * v_scale[:, None] * 60
    # The torch write on the CPU: the same bits as the kernel's (checked below), without one interpreted program
    # per token.
    reshape_and_cache(key.to(query_dtype), value.to(query_dtype), k_cache, v_cache, slots, k_scale=k_scale,
                      v_scale=v_scale, backend="auto" if device == "cuda" else "torch")
    return k_cache, v_cache, table.to(device), k_scale, v_scale


def reference(q, k_cache, v_cache, table, seq_lens, q_lens, k_scale, v_scale, **rules):
    """float64 attention over each sequence's dequantized keys and values."""
    page, heads, dim = k_cache.shape[1:]
    flat_k = dequantize(k_cache, k_scale, torch.float64).reshape(-1, heads, dim)
    flat_v = dequantize(v_cache, v_scale, torch.float64).reshape(-1, heads, dim)
    keys, values = [], []
    for b, n in enumerate(seq_lens):
        positions = torch.arange(n, device=q.device)
        slots = table[b, positions // page].long() * page + positions % page
        keys.append(flat_k[slots])
        values.append(flat_v[slots])
    cu_q = torch.tensor([0] + list(q_lens)).cumsum(0).to(torch.int32)
    cu_k = torch.tensor([0] + list(seq_lens)).cumsum(0).to(torch.int32)
    return attention_ref(q, torch.cat(keys), torch.cat(values), causal=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                         **rules)


def run_case(device, *, seq_lens, q_lens=None, page=4, group=2, kv_heads=2, head_dim=32, fp8=torch.float8_e4m3fn,
             dtype=torch.float32, num_splits=1, window_size=(-1, -1), sink_tokens=0, gather=None, backend="auto",
             config=None):
    k_cache, v_cache, table, k_scale, v_scale = fp8_pool(seq_lens, page=page, kv_heads=kv_heads, head_dim=head_dim,
                                                         fp8=fp8, device=device, query_dtype=dtype)
    decode = q_lens is None
    lens = [1] * len(seq_lens) if decode else list(q_lens)
    q = torch.randn(sum(lens), group * kv_heads, head_dim, dtype=dtype, device=device)
    extra = {} if decode else dict(cu_seqlens_q=torch.tensor([0] + lens, device=device).cumsum(0).to(torch.int32),
                                   max_seqlen_q=max(lens))
    out = torch.full_like(q, float("nan"))  # poisoned: every row must be written
    rules = dict(window_size=window_size, sink_tokens=sink_tokens)
    _, lse = paged_attention(q, k_cache, v_cache, table, torch.tensor(seq_lens, dtype=torch.int32, device=device),
                             num_splits=num_splits, return_lse=True, out=out, gather=gather, backend=backend,
                             config=config, k_scale=k_scale, v_scale=v_scale, **rules, **extra)
    ref_out, ref_lse = reference(q, k_cache, v_cache, table, seq_lens, lens, k_scale, v_scale, **rules)
    if decode:
        ref_lse = ref_lse.t()
    err = rel_error(out, ref_out)
    assert err < TOLERANCE[dtype], f"output error {err:.3g}"
    assert lse_error(lse, ref_lse) < LSE_TOLERANCE[dtype]
    return out


# -- quantization ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fp8", FORMATS)
@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_fp8_quantization_is_saturating_round_to_nearest_even(device, fp8, backend):
    # Every finite fp8 value, every midpoint between neighbours (ties go to the even code), values far past ±max,
    # ±inf (saturate) and signed zeros, bit for bit against torch's conversion after saturation.
    codes = torch.arange(256, dtype=torch.uint8).view(fp8).float()
    grid = codes[codes.isfinite()].unique().sort().values
    mids = (grid[1:] + grid[:-1]) / 2
    limit = fp8_max(fp8)
    extremes = torch.tensor([limit * 1.01, -limit * 1.01, 1e30, -1e30, float("inf"), float("-inf"), 0.0, -0.0, 1e-30])
    values = torch.cat([grid, mids, extremes, torch.randn(400) * limit / 8])
    heads, dim = 2, 8
    rows = math.ceil(values.numel() / dim)
    flat = torch.zeros(rows * dim)
    flat[: values.numel()] = values
    key = torch.stack([flat.view(rows, dim), flat.view(rows, dim) * 4], dim=1).to(device)  # head 1: 4x the values
    scale = torch.tensor([1.0, 4.0], device=device)  # ... and 4x the scale: both heads quantize alike
    k_cache = torch.zeros(rows, 1, heads, dim, dtype=fp8, device=device)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.arange(rows, device=device)
    reshape_and_cache(key, -key, k_cache, v_cache, slots, k_scale=scale, v_scale=scale, backend=backend)
    expected = quantize(key, scale, fp8)
    assert torch.equal(bits(k_cache[:, 0]), bits(expected))
    assert torch.equal(bits(v_cache[:, 0]), bits(quantize(-key, scale, fp8)))
    assert torch.equal(bits(k_cache[:, 0, 0]), bits(k_cache[:, 0, 1]))  # the scale applied per head
    stored = k_cache.float()
    assert not stored.isnan().any() and stored.abs().max() == limit  # saturated, never NaN or inf
    assert torch.equal(stored[:, 0, 0].reshape(-1)[: grid.numel()], grid.to(device))  # the grid round-trips exactly


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_fp8_quantization_from_16_bit_keys_and_nan_kept(device, backend, dtype):
    key = (torch.randn(5, 3, 16) * 40).to(dtype).to(device)
    key[2, 1, 3] = float("nan")  # a poisoned key must stay visible as NaN, not become a plausible number
    k_cache = torch.zeros(4, 4, 3, 16, dtype=torch.float8_e4m3fn, device=device)
    v_cache = torch.zeros_like(k_cache)
    scale = torch.tensor([0.1, 1.0, 7.0], device=device)
    slots = torch.tensor([3, 0, 9, -1, 15], device=device)
    reshape_and_cache(key, key, k_cache, v_cache, slots, k_scale=scale, v_scale=scale, backend=backend)
    written = bits(k_cache).view(-1, 3, 16)[slots[slots >= 0]].view(torch.float8_e4m3fn)  # fp8 indexed as bytes
    expected = quantize(key[slots >= 0], scale, torch.float8_e4m3fn)
    assert torch.equal(bits(written), bits(expected))
    assert written.float().isnan().sum() == 1
    assert torch.equal(bits(k_cache.view(-1, 3, 16)[1]), torch.zeros(3, 16, dtype=torch.uint8, device=device))


# -- attention over fp8 blocks ------------------------------------------------------------------------------------


@pytest.mark.parametrize("page", [1, 2, 16, 256])
@pytest.mark.parametrize("fp8", FORMATS)
def test_fp8_decode_block_sizes_and_splits(device, page, fp8):
    # Lengths one past a block boundary, one short of the next, a single token, and empty.
    lengths = [page + 1, 1, 0] if page > 16 else [page + 1, 1, 0, 2 * page - 1 if page > 1 else 3]
    for splits in (1, 3):
        run_case(device, seq_lens=lengths, page=page, fp8=fp8, num_splits=splits, kv_heads=1, head_dim=16)


@settings(max_examples=6, deadline=None)
@given(group=st.sampled_from([1, 2, 4, 8]), kv_heads=st.sampled_from([1, 2]), head_dim=st.sampled_from([24, 64]),
       page=st.sampled_from([1, 4, 16]), lengths=st.lists(st.integers(0, 40), min_size=1, max_size=3),
       dtype=st.sampled_from([torch.float16, torch.float32, torch.bfloat16]), fp8=st.sampled_from(FORMATS),
       num_splits=st.sampled_from([0, 1, 4]))
def test_fp8_decode_gqa_and_query_dtypes(group, kv_heads, head_dim, page, lengths, dtype, fp8, num_splits):
    run_case(DEVICE, seq_lens=lengths, page=page, group=group, kv_heads=kv_heads, head_dim=head_dim, dtype=dtype,
             fp8=fp8, num_splits=num_splits)


@settings(max_examples=6, deadline=None)
@given(data=st.data(), group=st.sampled_from([1, 3, 4]), page=st.sampled_from([1, 8, 64]),
       gather=st.sampled_from([False, True]), fp8=st.sampled_from(FORMATS),
       dtype=st.sampled_from([torch.float16, torch.float32]))
def test_fp8_multi_token_paged_and_gathered(data, group, page, gather, fp8, dtype):
    seq_lens = data.draw(st.lists(st.integers(0, 40), min_size=1, max_size=2))
    q_lens = [data.draw(st.sampled_from([0, 1, n // 2, n])) if n else 0 for n in seq_lens]
    run_case(DEVICE, seq_lens=seq_lens, q_lens=q_lens, page=page, group=group, kv_heads=2, fp8=fp8, dtype=dtype,
             gather=gather)


@pytest.mark.parametrize("window_size, sink_tokens, num_splits", [((7, -1), 0, 1), ((7, -1), 3, 3), ((20, 0), 9, 2)])
def test_fp8_windows_and_sinks(device, window_size, sink_tokens, num_splits):
    rules = dict(window_size=window_size, sink_tokens=sink_tokens, num_splits=num_splits)
    run_case(device, seq_lens=[50, 13, 0], page=4, group=2, kv_heads=1, head_dim=16, **rules)
    run_case(device, seq_lens=[50, 13], q_lens=[9, 13], page=16, group=3, kv_heads=1, head_dim=16, **rules)


@pytest.mark.parametrize("q_lens", [None, [7, 1, 0]])
def test_fp8_torch_backend(q_lens):
    # The CPU path dequantizes as it gathers; float64 queries too (the torch backend computes in any float type).
    run_case("cpu", seq_lens=[40, 3, 0], q_lens=q_lens, page=8, backend="torch")
    k_cache, v_cache, table, k_scale, v_scale = fp8_pool([20], page=4, kv_heads=2, head_dim=16,
                                                         fp8=torch.float8_e5m2, device="cpu")
    q = torch.randn(1, 4, 16, dtype=torch.float64)
    out = paged_attention(q, k_cache, v_cache, table, torch.tensor([20], dtype=torch.int32), backend="torch",
                          k_scale=k_scale, v_scale=v_scale)
    ref, _ = reference(q, k_cache, v_cache, table, [20], [1], k_scale, v_scale)
    assert rel_error(out, ref) < 1e-12


def test_fp8_gather_dequantizes_per_head(device):
    seq_lens = [21, 0, 6]
    k_cache, v_cache, table, k_scale, v_scale = fp8_pool(seq_lens, page=4, kv_heads=3, head_dim=16,
                                                         fp8=torch.float8_e4m3fn, device=device)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    cu = torch.tensor([0] + seq_lens, device=device).cumsum(0).to(torch.int32)
    keys, values = gather_cache(k_cache, v_cache, table, lens, cu, sum(seq_lens), k_scale=k_scale, v_scale=v_scale,
                                dtype=torch.float32)
    flat_k = dequantize(k_cache, k_scale, torch.float32).reshape(-1, 3, 16)
    flat_v = dequantize(v_cache, v_scale, torch.float32).reshape(-1, 3, 16)
    for b, n in enumerate(seq_lens):
        positions = torch.arange(n, device=device)
        slots = table[b, positions // 4].long() * 4 + positions % 4
        assert torch.equal(keys[cu[b]:cu[b] + n], flat_k[slots]) and torch.equal(values[cu[b]:cu[b] + n], flat_v[slots])
    with pytest.raises(ValueError, match="dtype"):
        gather_cache(k_cache, v_cache, table, lens, cu, 30, k_scale=k_scale, v_scale=v_scale)
    with pytest.raises(ValueError, match="k_scale and v_scale are required"):
        gather_cache(k_cache, v_cache, table, lens, cu, 30, dtype=torch.float32)
    # The gathered paged path takes the codes, unscaled and exact in a 16-bit dtype, and folds the scales in later.
    codes, _ = gather_cache(k_cache, v_cache, table, lens, cu, sum(seq_lens), dtype=torch.bfloat16, dequantize=False)
    positions = torch.arange(seq_lens[0], device=device)
    slots = table[0, positions // 4].long() * 4 + positions % 4
    assert torch.equal(codes[: seq_lens[0]].float(), k_cache.reshape(-1, 3, 16)[slots].float())


def test_fp8_block_copies_and_swaps_move_bytes(device):
    k_cache, v_cache, *_ = fp8_pool([12, 7], page=4, kv_heads=2, head_dim=16, fp8=torch.float8_e4m3fn, device=device)
    before_k, before_v = bits(k_cache).clone(), bits(v_cache).clone()
    copy_blocks([k_cache], [v_cache], torch.tensor([[0, 5], [2, 1]], device=device))
    assert torch.equal(bits(k_cache)[5], before_k[0]) and torch.equal(bits(v_cache)[1], before_v[2])
    cpu = torch.zeros(3, *k_cache.shape[1:], dtype=k_cache.dtype)
    swap_blocks(k_cache, cpu, torch.tensor([[5, 2]]))
    if device == "cuda":
        torch.cuda.synchronize()
    assert torch.equal(bits(cpu)[2], before_k[0].cpu())
    with pytest.raises(ValueError, match="dtype"):
        swap_blocks(k_cache, torch.zeros(3, *k_cache.shape[1:]), torch.tensor([[0, 0]]))


def test_fp8_explain_names_the_cache_and_compile_variants_run(device):
    k_cache, v_cache, table, k_scale, v_scale = fp8_pool([30], page=16, kv_heads=2, head_dim=32,
                                                         fp8=torch.float8_e5m2, device=device)
    q = torch.zeros(1, 4, 32, device=device)
    lens = torch.tensor([30], dtype=torch.int32, device=device)
    plan = explain_paged(q, k_cache, v_cache, table, lens, k_scale=k_scale, v_scale=v_scale)
    assert "fp8_e5m2 KV cache" in str(plan) and "softmax scale" in str(plan)
    cu = torch.tensor([0, 30], dtype=torch.int32, device=device)
    gathered = explain_paged(torch.zeros(30, 4, 32, device=device), k_cache, v_cache, table, lens, cu_seqlens_q=cu,
                             gather=True, k_scale=k_scale, v_scale=v_scale)
    assert "exact fp8 codes" in str(gathered) and "forward folds K scale" in str(gathered)
    assert "bfloat16 KV cache" in str(explain_paged(q.bfloat16(), k_cache.bfloat16(), v_cache.bfloat16(), table, lens))
    if device == "cuda":
        compile_variants(4, k_cache, v_cache, dtype=torch.bfloat16, k_scale=k_scale, v_scale=v_scale, max_tokens=64)


# -- bad input ----------------------------------------------------------------------------------------------------


def test_fp8_bad_scales_are_refused_naming_the_argument(device):
    k_cache, v_cache, table, k_scale, v_scale = fp8_pool([8], page=4, kv_heads=2, head_dim=16,
                                                         fp8=torch.float8_e4m3fn, device=device)
    q = torch.randn(1, 4, 16, device=device)
    lens = torch.tensor([8], dtype=torch.int32, device=device)
    cases = [
        (dict(k_scale=None, v_scale=v_scale), "k_scale is required"),
        (dict(k_scale=k_scale, v_scale=None), "v_scale is required"),
        (dict(k_scale=k_scale[:1], v_scale=v_scale), r"k_scale must be a float32 tensor of shape \(num_kv_heads,\)"),
        (dict(k_scale=k_scale.double(), v_scale=v_scale), "k_scale must be a float32"),
        (dict(k_scale=k_scale, v_scale=1.0), "v_scale must be a float32"),
        (dict(k_scale=torch.tensor([1.0, 0.0], device=device), v_scale=v_scale), r"k_scale\[1\] = 0.0"),
        (dict(k_scale=k_scale, v_scale=torch.tensor([float("nan"), 1.0], device=device)), r"v_scale\[0\] = nan"),
    ]
    for scales, message in cases:
        with pytest.raises(ValueError, match=message):
            paged_attention(q, k_cache, v_cache, table, lens, validate=True, **scales)
        with pytest.raises(ValueError, match=message):
            reshape_and_cache(q[:, :2], q[:, :2], k_cache, v_cache, torch.tensor([9], device=device), validate=True,
                              **scales)
    with pytest.raises(ValueError, match="fp8 caches only"):
        paged_attention(q, k_cache.float(), v_cache.float(), table, lens, k_scale=k_scale, v_scale=v_scale)
    with pytest.raises(ValueError, match="must share a dtype"):
        paged_attention(q, k_cache.half(), v_cache.half(), table, lens)


def test_fp8_refused_on_gpus_without_fp8_conversions(monkeypatch):
    device = torch.device("cuda", 7)  # never asked about before: the answer is cached per device
    try:
        monkeypatch.setattr(fp8_ops, "device_capability", lambda device: (8, 0))
        with pytest.raises(ValueError, match=r"kv_cache_dtype: .*compute capability 8\.9\+.*has 8\.0"):
            fp8_ops.check_fp8_supported(device, "kv_cache_dtype")
        fp8_ops.fp8_problem.cache_clear()
        monkeypatch.setattr(fp8_ops, "device_capability", lambda device: (9, 0))
        fp8_ops.check_fp8_supported(device)
    finally:
        fp8_ops.fp8_problem.cache_clear()


@triton.jit
def _rows_to_fp16_kernel(Q, Out, Down, ROWS: tl.constexpr, D: tl.constexpr):
    offs = tl.arange(0, ROWS)[:, None] * D + tl.arange(0, D)[None, :]
    q16, down = to_fp16_by_rows(tl.load(Q + offs))
    tl.store(Out + offs, q16)
    tl.store(Down + tl.arange(0, ROWS), down)


def test_queries_scaled_per_row_into_float16_exactly(device):
    # The "fp16" route's bf16 queries: each row times a power of two with its largest |q| in [2^14, 2^15], where
    # bf16's 8 significant bits fit float16's 11, so q16 * down gives the row back exactly (down a power of two
    # too); rows of any magnitude in one tile, zero rows kept, non-finite rows passed through unscaled.
    exps = [-110, -60, -24, -14, -1, 0, 3, 15, 16, 40, 100, 120]
    q = torch.randn(16, 32, dtype=torch.float64)
    q[: len(exps)] *= torch.tensor([2.0 ** e for e in exps], dtype=torch.float64)[:, None]
    q[12] = 0.0
    q[13, 5] = float("inf")
    q[14, 7] = float("nan")
    q = q.to(torch.bfloat16).to(device)
    out = torch.full(q.shape, float("nan"), dtype=torch.float16, device=device)
    down = torch.full((16,), float("nan"), device=device)
    _rows_to_fp16_kernel[(1,)](q, out, down, ROWS=16, D=32)
    down = down.double().cpu()
    assert (down.log2() == down.log2().round()).all(), "the row scales must be powers of two"
    rows_ok = list(range(12))
    assert torch.equal(out.double().cpu()[rows_ok] * down[rows_ok, None], q.double().cpu()[rows_ok])
    amax = out.double().cpu()[rows_ok].abs().amax(1)
    assert ((amax >= 2.0 ** 14) & (amax <= 2.0 ** 15)).all()
    assert (out[12] == 0).all() and down[12] == 1.0
    assert out[13].isinf().any() and out[14].isnan().any()


# -- on the GPU: the hardware conversions, real shapes, graph capture ---------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", FORMATS)
def test_fp8_quantization_bit_exact_on_gpu(fp8):
    test_fp8_quantization_is_saturating_round_to_nearest_even("cuda", fp8, "triton")
    test_fp8_quantization_from_16_bit_keys_and_nan_kept("cuda", "triton", torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("fp8, heads, kv_heads, head_dim, page", [
    *[(fp8, h, hkv, d, 16) for fp8 in FORMATS for h, hkv, d in ((32, 8, 128), (9, 3, 64))],
    (torch.float8_e4m3fn, 28, 4, 256, 256), (torch.float8_e4m3fn, 32, 32, 128, 1),
])
def test_fp8_bf16_queries_on_gpu(fp8, heads, kv_heads, head_dim, page):
    seq_lens = [1000, 17, 0, 4096, 513]
    common = dict(page=page, group=heads // kv_heads, kv_heads=kv_heads, head_dim=head_dim, fp8=fp8,
                  dtype=torch.bfloat16)
    for splits in (0, 1, 7):
        run_case("cuda", seq_lens=seq_lens, num_splits=splits, **common)
        run_case("cuda", seq_lens=seq_lens, num_splits=splits, config=TRITON_DECODE, **common)
    run_case("cuda", seq_lens=seq_lens, q_lens=[300, 17, 0, 1, 513], window_size=(256, -1), sink_tokens=4, **common)
    for gather in (True, False):
        run_case("cuda", seq_lens=[4096, 17, 0, 2048], q_lens=[2048, 17, 0, 1], gather=gather, **common)


@pytest.mark.gpu
def test_fp8_decode_in_a_cuda_graph_reads_updated_scales():
    # The scales are read from device memory by the kernels: a captured graph follows an in-place update.
    k_cache, v_cache, table, k_scale, v_scale = fp8_pool([700, 33], page=16, kv_heads=8, head_dim=128,
                                                         fp8=torch.float8_e4m3fn, device="cuda")
    lens = torch.tensor([700, 33], dtype=torch.int32, device="cuda")
    q = torch.randn(2, 32, 128, dtype=torch.bfloat16, device="cuda")
    out = torch.empty_like(q)

    def step():
        paged_attention(q, k_cache, v_cache, table, lens, out=out, k_scale=k_scale, v_scale=v_scale, validate=False)

    step()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    v_scale.mul_(2.0)
    graph.replay()
    ref, _ = reference(q, k_cache, v_cache, table, [700, 33], [1, 1], k_scale, v_scale)
    assert rel_error(out, ref[:, :, :]) < TOLERANCE[torch.bfloat16]


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", FORMATS)
@pytest.mark.parametrize("config", [TRITON_DECODE, GLUON_DECODE], ids=["triton", "gluon"])
def test_fp8_nan_code_in_the_cache_poisons_its_rows_on_gpu(fp8, config):
    # A NaN key or value (kept by the write, see quantization above) must reach the output of the heads that read
    # it, never be turned into a finite number by the bf16 decode's conversion.
    k_cache, v_cache, table, k_scale, v_scale = fp8_pool([300, 40], page=16, kv_heads=4, head_dim=128, fp8=fp8,
                                                         device="cuda")
    slot = int(table[0, 5]) * 16 + 3  # sequence 0, position 83
    k_cache.view(-1, 4, 128).view(torch.uint8)[slot, 1, 17] = 0x7F  # KV head 1's key
    v_cache.view(-1, 4, 128).view(torch.uint8)[slot, 2, 90] = 0xFF  # KV head 2's value
    q = torch.randn(2, 16, 128, dtype=torch.bfloat16, device="cuda")
    lens = torch.tensor([300, 40], dtype=torch.int32, device="cuda")
    if config.kernel == "gluon" and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Gluon kernel is sm_90 only")
    for splits in (1, 3):
        out = paged_attention(q, k_cache, v_cache, table, lens, k_scale=k_scale, v_scale=v_scale, num_splits=splits,
                              config=config)
        heads = out.isnan().any(dim=-1)
        assert heads[0].tolist() == [False] * 4 + [True] * 8 + [False] * 4
        assert not heads[1].any()


@triton.jit
def _upcast_fp16_codes_kernel(Codes, Out, N: tl.constexpr):
    offs = tl.arange(0, N)
    tl.store(Out + offs, upcast_fp8_fp16(tl.load(Codes + offs), True))


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", FORMATS)
def test_fp8_fp16_upcast_is_exact_for_every_code_on_gpu(fp8):
    # The "fp16" route's conversion (two codes per cvt) against torch's, all 256 codes in each lane of a register:
    # bit for bit, NaN for NaN (e5m2's infinities stay infinite).
    codes = torch.arange(256, dtype=torch.uint8, device="cuda")
    codes = torch.cat([codes.view(-1, 4).roll(shift, 1).reshape(-1) for shift in range(4)])
    out = torch.full(codes.shape, float("nan"), dtype=torch.float16, device="cuda")
    _upcast_fp16_codes_kernel[(1,)](codes.view(fp8), out, N=codes.numel())
    expected = codes.view(fp8).to(torch.float16)
    nan = expected.isnan()
    assert torch.equal(out[~nan].view(torch.int16), expected[~nan].view(torch.int16))
    assert out[nan].isnan().all()


@pytest.mark.gpu
@pytest.mark.parametrize("magnitude", [2.0 ** -20, 2.0 ** 20, None])
def test_fp8_bf16_queries_of_any_magnitude_on_gpu(magnitude):
    # bf16 queries far outside float16's range (the "fp16" route scales each row by a power of two): scores of
    # order one through the softmax scale, or (None) rows of magnitudes 2^-20 ... 2^20 sharing one program.
    k_cache, v_cache, table, k_scale, v_scale = fp8_pool([700, 33], page=16, kv_heads=2, head_dim=128,
                                                         fp8=torch.float8_e4m3fn, device="cuda")
    q = torch.randn(2, 8, 128, dtype=torch.float64, device="cuda")
    if magnitude is None:
        q *= torch.tensor([2.0 ** e for e in (-20, -8, 0, 20)] * 2, dtype=torch.float64, device="cuda")[:, None]
        scale = 1 / math.sqrt(128)
    else:
        q *= magnitude
        scale = 1 / (magnitude * math.sqrt(128))
    q = q.to(torch.bfloat16)
    lens = torch.tensor([700, 33], dtype=torch.int32, device="cuda")
    for splits in (1, 4):
        out = paged_attention(q, k_cache, v_cache, table, lens, softmax_scale=scale, num_splits=splits,
                              k_scale=k_scale, v_scale=v_scale)
        ref, _ = reference(q, k_cache, v_cache, table, [700, 33], [1, 1], k_scale, v_scale, softmax_scale=scale)
        assert out.isfinite().all()
        assert rel_error(out, ref) < TOLERANCE[torch.bfloat16]
