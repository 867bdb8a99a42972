"""The Triton forward kernel through its launcher, with explicit small tiles so that every path runs:
unmasked and boundary tiles, GQA packing, dense masks, varlen with empty sequences, padded head dims."""

import json
import math
import os
import pathlib
import subprocess
import sys

import pytest
import torch
import triton
from hypothesis import given, settings
from hypothesis import strategies as st

from ioattn.ops.forward import FwdConfig, FwdProblem, launch_prefill_fwd
from ioattn.ops.capability import HOPPER_SHARED_MEMORY
from ioattn.ops.forward import candidate_configs, shared_memory_estimate
from ioattn.reference import TOLERANCE, attention_ref, lse_error, rel_error

SMALL = FwdConfig(block_m=16, block_n=16, num_warps=4, num_stages=1)
SMALL_POINTERS = FwdConfig(block_m=16, block_n=16, num_warps=4, num_stages=1, tma=False)  # pointer loads, no TMA
LOAD_MODES = st.sampled_from([SMALL, SMALL_POINTERS])


def folded_window(causal, window):
    left, right = window
    if causal:
        right = 0 if right < 0 else min(right, 0)
    return left, right


def run_dense(q, k, v, *, causal=False, window=(-1, -1), mask=None, pack_gqa=False, config=SMALL,
              bottom_right=True):
    """Launch on NaN-poisoned outputs; mask is broadcast to 4-D through stride-0 views as the ops layer does."""
    b, n_q, h_q, d = q.shape
    out = torch.full_like(q, float("nan"))
    lse = torch.full((b, h_q, n_q), float("nan"), device=q.device)
    left, right = folded_window(causal, window)
    problem = FwdProblem(1 / math.sqrt(d), left, right, bottom_right, "ieee", pack_gqa)
    mask4 = None if mask is None else mask[(None,) * (4 - mask.dim())].expand(b, h_q, n_q, k.shape[1])
    launch_prefill_fwd(q, k, v, out, lse, problem, config, attn_mask=mask4)
    return out, lse


def check(out, lse, ref_out, ref_lse, dtype):
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    assert rel_error(out, ref_out) < TOLERANCE[dtype]
    assert lse_error(lse, ref_lse) < (1e-4 if dtype == torch.float32 else 1e-3)


def qkv(b, n_q, n_k, h_q, h_kv, d, dtype, device="cpu"):
    return (torch.randn(b, n_q, h_q, d, dtype=dtype, device=device),
            torch.randn(b, n_k, h_kv, d, dtype=dtype, device=device),
            torch.randn(b, n_k, h_kv, d, dtype=dtype, device=device))


window_st = st.tuples(st.integers(-1, 40), st.integers(-1, 40))


@settings(max_examples=30, deadline=None)
@given(b=st.integers(1, 2), n_q=st.integers(1, 60), n_k=st.integers(1, 40), heads=st.sampled_from([(2, 1), (2, 2), (4, 2), (3, 1)]),
       d=st.sampled_from([8, 16, 24, 40]), causal=st.booleans(), window=window_st,
       dtype=st.sampled_from([torch.float32, torch.float16]),
       config=st.sampled_from([SMALL, FwdConfig(16, 32, 4, 1), SMALL_POINTERS, FwdConfig(16, 32, 4, 1, tma=False)]))
def test_dense_matches_reference(b, n_q, n_k, heads, d, causal, window, dtype, config):
    q, k, v = qkv(b, n_q, n_k, *heads, d, dtype)
    out, lse = run_dense(q, k, v, causal=causal, window=window, config=config)
    ref_out, ref_lse = attention_ref(q, k, v, causal=causal, window_size=window)
    check(out, lse, ref_out, ref_lse, dtype)


@settings(max_examples=12, deadline=None)
@given(n_q=st.integers(1, 12), n_k=st.integers(1, 50), group=st.sampled_from([2, 4]), causal=st.booleans(),
       window=window_st, config=LOAD_MODES)
def test_packed_gqa_matches_reference(n_q, n_k, group, causal, window, config):
    """One program per GQA group: the rows of 2 or 4 query heads share each K/V tile."""
    q, k, v = qkv(2, n_q, n_k, 2 * group, 2, 16, torch.float32)
    out, lse = run_dense(q, k, v, causal=causal, window=window, pack_gqa=True, config=config)
    ref_out, ref_lse = attention_ref(q, k, v, causal=causal, window_size=window)
    check(out, lse, ref_out, ref_lse, torch.float32)


@settings(max_examples=12, deadline=None)
@given(n_q=st.integers(1, 30), n_k=st.integers(1, 30), kind=st.sampled_from(["bool", "additive"]),
       shape=st.sampled_from(["full", "rows", "keys", "2d"]), pack=st.booleans(), config=LOAD_MODES)
def test_dense_mask_streamed(n_q, n_k, kind, shape, pack, config):
    q, k, v = qkv(2, n_q, n_k, 4, 2, 16, torch.float32)
    mask_shape = {"full": (2, 4, n_q, n_k), "rows": (2, 1, n_q, 1), "keys": (1, 1, 1, n_k), "2d": (n_q, n_k)}[shape]
    mask = torch.rand(mask_shape) > 0.3 if kind == "bool" else torch.randn(mask_shape)
    out, lse = run_dense(q, k, v, mask=mask, pack_gqa=pack, bottom_right=False, config=config)
    ref_out, ref_lse = attention_ref(q, k, v, attn_mask=mask)
    check(out, lse, ref_out, ref_lse, torch.float32)


@pytest.mark.parametrize("config", [SMALL, SMALL_POINTERS])
@pytest.mark.parametrize("d", [8, 72, 256])
def test_head_dims_padded_to_power_of_two(d, config):
    q, k, v = qkv(1, 20, 24, 2, 1, d, torch.float32)
    out, lse = run_dense(q, k, v, causal=True, config=config)
    check(out, lse, *attention_ref(q, k, v, causal=True), torch.float32)


@pytest.mark.parametrize("config", [SMALL, SMALL_POINTERS])
def test_fully_masked_rows_give_zero_and_neg_inf(config):
    """Causal with Nq > Nk (bottom-right): the first Nq - Nk rows see no key; a window can empty rows too."""
    q, k, v = qkv(1, 40, 8, 2, 2, 16, torch.float16)
    out, lse = run_dense(q, k, v, causal=True, config=config)
    assert torch.equal(out[:, :32], torch.zeros_like(out[:, :32]))
    assert torch.isneginf(lse[..., :32]).all()
    check(out, lse, *attention_ref(q, k, v, causal=True), torch.float16)
    mask = torch.ones(40, 8, dtype=torch.bool)
    mask[5] = False
    out, lse = run_dense(q, k, v, mask=mask, config=config)
    assert torch.equal(out[:, 5], torch.zeros_like(out[:, 5])) and torch.isneginf(lse[..., 5]).all()


@settings(max_examples=10, deadline=None)
@given(lens=st.lists(st.tuples(st.integers(0, 30), st.integers(0, 30)), min_size=1, max_size=4),
       causal=st.booleans(), window=window_st, pack=st.booleans(), config=LOAD_MODES)
def test_varlen_with_empty_sequences(lens, causal, window, pack, config):
    cu_q = torch.tensor([0] + [sum(a for a, _ in lens[: i + 1]) for i in range(len(lens))], dtype=torch.int32)
    cu_k = torch.tensor([0] + [sum(b for _, b in lens[: i + 1]) for i in range(len(lens))], dtype=torch.int32)
    total_q, total_k = int(cu_q[-1]), int(cu_k[-1])
    q = torch.randn(total_q, 4, 16)
    k, v = torch.randn(total_k, 2, 16), torch.randn(total_k, 2, 16)
    out = torch.full_like(q, float("nan"))
    lse = torch.full((4, total_q), float("nan"))
    left, right = folded_window(causal, window)
    problem = FwdProblem(0.25, left, right, True, "ieee", pack)
    if total_k > 0:
        launch_prefill_fwd(q, k, v, out, lse, problem, config, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                           max_seqlen_q=max(a for a, _ in lens))
    else:  # the ops layer answers "no keys at all" without a launch
        out.zero_()
        lse.fill_(float("-inf"))
    ref_out, ref_lse = attention_ref(q, k, v, causal=causal, window_size=window, cu_seqlens_q=cu_q,
                                     cu_seqlens_k=cu_k, softmax_scale=0.25)
    check(out, lse, ref_out, ref_lse, torch.float32)


@pytest.mark.parametrize("config", [SMALL, SMALL_POINTERS])
def test_strided_inputs_through_strides(config):
    """q/k/v as (B, H, N, D) storage viewed as (B, N, H, D): the descriptors take the strides as they are."""
    q, k, v = (torch.randn(2, 2, n, 32).transpose(1, 2) for n in (20, 30, 30))
    out, lse = run_dense(q, k, v, causal=True, config=config)
    check(out, lse, *attention_ref(q, k, v, causal=True), torch.float32)


@pytest.mark.parametrize("d,dtype", [(64, torch.bfloat16), (128, torch.float16), (128, torch.float32), (256, torch.bfloat16)])
def test_candidate_configs_fit_shared_memory(d, dtype):
    configs = candidate_configs(d, dtype)
    assert configs and len(set(configs)) == len(configs)
    assert all(shared_memory_estimate(c, d, dtype) <= HOPPER_SHARED_MEMORY for c in configs)


def test_shared_memory_estimate_matches_sm90_builds():
    """Measured with triton.compile for sm90 (Triton 3.6): metadata.shared of three builds."""
    assert abs(shared_memory_estimate(FwdConfig(128, 128, 8, 3), 128, torch.bfloat16) - 230400) <= 1024
    assert abs(shared_memory_estimate(FwdConfig(64, 64, 4, 2), 256, torch.bfloat16) - 164864) <= 1024
    assert abs(shared_memory_estimate(FwdConfig(128, 128, 8, 2), 128, torch.bfloat16, torch.float32) - 230400) <= 1024


@pytest.mark.gpu
@pytest.mark.parametrize("config", [FwdConfig(128, 128, 8, 3), FwdConfig(128, 64, 4, 2), FwdConfig(64, 64, 4, 2, 2),
                                    FwdConfig(64, 128, 4, 2), FwdConfig(128, 128, 4, 3),
                                    FwdConfig(128, 64, 4, 3, tma=False), FwdConfig(64, 64, 4, 3, tma=False)])
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_explicit_configs(config, causal):
    q, k, v = qkv(2, 1000, 1100, 8, 2, 128, torch.bfloat16, "cuda")
    out, lse = run_dense(q, k, v, causal=causal, config=config)
    check(out, lse, *attention_ref(q, k, v, causal=causal), torch.bfloat16)


# Build the kernel for sm90 on the CPU (Triton ships ptxas): catches Hopper compile failures and shared-memory
# overruns without a GPU. Runs in a subprocess because the interpreter replaces @triton.jit in this one.
SM90_BUILD = r"""
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from ioattn.kernels.prefill_fwd import prefill_fwd_kernel as kernel
from ioattn.ops.forward import head_dim_padded

def build(dtype, d, block_m, block_n, num_warps, num_stages, right_bounded, mask_kind, pack_gqa, group, varlen, tma,
          descale):
    names = kernel.arg_names
    sig = {n: "i32" for n in names}
    sig.update({n: f"*{dtype}" for n in ("Q", "K", "V", "O")}, LSE="*fp32", qk_scale="fp32",
               MASK={0: f"*{dtype}", 1: "*u8", 2: "*fp32"}[mask_kind], cu_seqlens_q="*i32", cu_seqlens_k="*i32",
               K_descale="*fp32", V_descale="*fp32", Q_scale="*fp32")
    sig.update({n: "i64" for n in ("stride_qb", "stride_kb", "stride_vb", "stride_ob", "stride_lb", "stride_mb")})
    const = dict(HEAD_DIM=d, HEAD_DIM_PAD=head_dim_padded(d), BLOCK_M=block_m, BLOCK_N=block_n, GROUP=group,
                 PACK_GQA=pack_gqa, VARLEN=varlen, BOTTOM_RIGHT=True, LEFT_BOUNDED=False, RIGHT_BOUNDED=right_bounded,
                 MASK_KIND=mask_kind, INPUT_PRECISION="ieee", LOOP_STAGES=None, SCALE_POSITIVE=True, TMA=tma,
                 DESCALE=descale, FP8=False, ROUND_P=False)
    sig.update({n: "constexpr" for n in const})
    aligned = ("Q", "K", "V", "O", "LSE", "stride_qn", "stride_qh", "stride_kn", "stride_kh", "stride_vn",
               "stride_vh", "stride_on", "stride_oh")
    src = ASTSource(fn=kernel, signature=sig, constexprs={(names.index(n),): v for n, v in const.items()},
                    attrs={(names.index(n),): [["tt.divisibility", 16]] for n in aligned})
    built = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=num_warps, num_stages=num_stages))
    return built.metadata.shared

print(json.dumps([build(*case) for case in json.loads(sys.argv[1])]))
"""


def test_builds_for_hopper_within_shared_memory():
    if not (pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists():
        pytest.skip("this Triton install has no ptxas")
    cases = [  # (dtype, D, BM, BN, warps, stages, causal, mask kind, pack_gqa, group, varlen, tma, descale)
        ("bf16", 128, 128, 64, 4, 2, True, 0, False, 1, False, True, False),  # the sm90 table's D=128 entry
        ("bf16", 128, 128, 128, 8, 3, True, 0, False, 1, True, True, False),  # varlen, largest candidate tiles
        ("fp16", 72, 128, 128, 8, 2, False, 2, True, 4, False, True, False),  # fp32 additive mask, packed GQA
        ("bf16", 64, 128, 64, 4, 3, False, 0, False, 1, False, False, False),  # the short-query D=64 entry: pointers
        ("bf16", 128, 128, 64, 4, 2, True, 0, False, 4, True, True, True),  # fp8 codes: the paged gather path
    ]
    result = subprocess.run([sys.executable, "-c", SM90_BUILD, json.dumps(cases)], capture_output=True, text=True,
                            env={**os.environ, "TRITON_INTERPRET": "0"}, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16}
    for case, shared in zip(cases, json.loads(result.stdout.splitlines()[-1])):
        dtype, d, bm, bn, warps, stages, _, mask_kind, _, _, _, tma, _ = case
        config = FwdConfig(bm, bn, warps, stages, tma=tma)
        estimate = shared_memory_estimate(config, d, dtypes[dtype], torch.float32 if mask_kind == 2 else None)
        assert shared <= estimate <= HOPPER_SHARED_MEMORY, (case, shared, estimate)


@pytest.mark.parametrize("scale", [-0.4, 0.0, 0.7])
def test_any_softmax_scale_sign(scale):
    """Unmasked tiles fold the scale into exp2's FMA only when it is positive; zero and negative take the plain path."""
    q, k, v = qkv(1, 40, 70, 2, 2, 16, torch.float32)
    out = torch.full_like(q, float("nan"))
    lse = torch.full((1, 2, 40), float("nan"))
    launch_prefill_fwd(q, k, v, out, lse, FwdProblem(scale, -1, 0, True, "ieee", False), SMALL)
    check(out, lse, *attention_ref(q, k, v, causal=True, softmax_scale=scale), torch.float32)
