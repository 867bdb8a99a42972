"""Triton backward kernels against float64 autograd (CPU: Triton interpreter, fp16/fp32; GPU: bf16 too)."""

import math
import os
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attention_grad_ref import gradient_error, make_problem, problem_gradient_magnitudes, reference_grads
from ioattn.ops.backward import (
    BwdConfig,
    attention_bwd,
    candidate_configs,
    default_config,
    deterministic_default,
)
from ioattn.reference import TOLERANCE, rel_error

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # hypothesis tests cannot take fixtures
CPU_CONFIG = BwdConfig(16, 16, 16, 16, 4, 1, atomic_dq=False)
CPU_ATOMIC = BwdConfig(16, 16, 16, 16, 4, 1, atomic_dq=True)


@pytest.fixture
def poisoned(monkeypatch):
    """Every buffer the launcher allocates uninitialised starts as NaN, so an unwritten element fails."""
    empty_like = torch.empty_like
    monkeypatch.setattr(torch, "empty_like", lambda t, **kw: empty_like(t, **kw).fill_(math.nan))


def check(problem, dtype, *, mask_grad=False, config=None, deterministic=False):
    dq, dk, dv, dmask = attention_bwd(problem.do, problem.q, problem.k, problem.v, problem.o, problem.lse,
                                      **problem.kwargs, mask_grad=mask_grad, config=config,
                                      deterministic=deterministic)
    ref = reference_grads(problem, mask_grad)
    magnitudes = problem_gradient_magnitudes(problem)
    for name, got, want, magnitude in zip(("dq", "dk", "dv", "dmask"), (dq, dk, dv, dmask), ref, magnitudes):
        if want is None:
            assert got is None
            continue
        expected_dtype = problem.kwargs["attn_mask"].dtype if name == "dmask" else problem.q.dtype
        assert got.shape == want.shape and got.dtype == expected_dtype, name
        error = gradient_error(name, got, want, magnitude, dtype)
        assert error is None, error
    return dq, dk, dv, dmask


CASES = {
    "plain": dict(n_q=24, n_k=40),
    "causal_bottom_right_gqa": dict(n_q=20, n_k=37, hq=4, hkv=2, causal=True, head_dim=24),
    "causal_top_left": dict(n_q=37, n_k=20, causal=True, bottom_right=False),
    "causal_more_queries_than_keys": dict(n_q=37, n_k=20, causal=True),  # first rows see nothing
    "window": dict(n_q=45, n_k=45, window_size=(5, 9)),
    "causal_window_mqa": dict(n_q=33, n_k=50, hq=3, hkv=1, causal=True, window_size=(6, -1)),
    "bool_mask": dict(batch=2, n_q=19, n_k=23, mask="bool", causal=True, bottom_right=False),
    "varlen_zero_lengths": dict(seqlens=[(5, 9), (0, 7), (17, 3), (6, 0), (0, 0), (20, 20)], hq=2, hkv=2,
                                causal=True),
}


@pytest.mark.parametrize("config", [CPU_CONFIG, CPU_ATOMIC], ids=["separate_dq", "atomic_dq"])
@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_matches_float64_autograd_fp32(case, config, device, poisoned):
    check(make_problem(**CASES[case], device=device), torch.float32, config=config)


@pytest.mark.parametrize("case", ["causal_bottom_right_gqa", "window", "varlen_zero_lengths"])
def test_matches_float64_autograd_fp16(case, device, poisoned):
    check(make_problem(**CASES[case], dtype=torch.float16, device=device), torch.float16, config=CPU_ATOMIC)


def test_strided_inputs(device, poisoned):
    """SDPA's (B, H, N, D) storage viewed as (B, N, H, D), with a dO of other strides (copied)."""
    problem = make_problem(batch=2, n_q=20, n_k=30, hq=4, hkv=2, causal=True, device=device)
    for name in ("q", "k", "v", "o"):
        setattr(problem, name, getattr(problem, name).transpose(1, 2).contiguous().transpose(1, 2))
    check(problem, torch.float32, config=CPU_ATOMIC)


@pytest.mark.parametrize("head_dim", [8, 72, 256])
def test_head_dims_padded(head_dim, device, poisoned):
    check(make_problem(n_q=17, n_k=18, head_dim=head_dim, causal=True, device=device), torch.float32, config=CPU_CONFIG)


@pytest.mark.parametrize("deterministic", [True, False])
@pytest.mark.parametrize("mask", ["additive", "additive_broadcast"])
def test_additive_mask_gradient(mask, deterministic, device, poisoned):
    problem = make_problem(batch=2, hq=2, hkv=1, n_q=19, n_k=23, mask=mask, causal=True, device=device)
    _, _, _, dmask = check(problem, torch.float32, mask_grad=True, config=CPU_ATOMIC, deterministic=deterministic)
    assert dmask.shape == problem.kwargs["attn_mask"].shape


@pytest.mark.parametrize("n_q, n_k", [(0, 5), (5, 0)])
def test_no_queries_or_no_keys(n_q, n_k, device, poisoned):
    grads = check(make_problem(n_q=n_q, n_k=n_k, device=device), torch.float32, config=CPU_CONFIG)
    assert all(not g.any() for g in grads[:3])


def test_fully_masked_rows_get_zero_gradient(device, poisoned):
    mask = torch.rand(1, 1, 20, 20) > 0.3
    mask[..., 3:7, :] = False
    dq, dk, dv, _ = check(make_problem(n_q=20, n_k=20, mask=mask, device=device), torch.float32, config=CPU_CONFIG)
    assert torch.equal(dq[:, 3:7], torch.zeros_like(dq[:, 3:7]))


@settings(max_examples=20, deadline=None)
@given(
    batch=st.integers(1, 2), n_q=st.integers(1, 40), n_k=st.integers(1, 40),
    heads=st.sampled_from([(1, 1), (2, 1), (4, 2), (3, 3)]), head_dim=st.sampled_from([8, 16, 40, 64]),
    causal=st.booleans(), bottom_right=st.booleans(),
    window=st.sampled_from([(-1, -1), (4, -1), (-1, 3), (7, 2), (0, 0)]),
    mask=st.sampled_from([None, None, "bool", "additive"]), dtype=st.sampled_from([torch.float32, torch.float16]),
    atomic=st.booleans(),
)
def test_shape_space(batch, n_q, n_k, heads, head_dim, causal, bottom_right, window, mask, dtype, atomic):
    problem = make_problem(batch=batch, n_q=n_q, n_k=n_k, hq=heads[0], hkv=heads[1], head_dim=head_dim,
                           causal=causal, bottom_right=bottom_right, window_size=window, mask=mask, dtype=dtype,
                           device=DEVICE)
    check(problem, dtype, mask_grad=mask == "additive", config=CPU_ATOMIC if atomic else CPU_CONFIG)


@settings(max_examples=8, deadline=None)
@given(lengths=st.lists(st.tuples(st.integers(0, 30), st.integers(0, 30)), min_size=1, max_size=4),
       causal=st.booleans(), window=st.sampled_from([(-1, -1), (5, 0)]), atomic=st.booleans())
def test_varlen_space(lengths, causal, window, atomic):
    problem = make_problem(seqlens=lengths, hq=2, hkv=1, causal=causal, window_size=window, device=DEVICE)
    check(problem, torch.float32, config=CPU_ATOMIC if atomic else CPU_CONFIG)


def test_deterministic_runs_are_bitwise_equal(device):
    problem = make_problem(batch=2, n_q=40, n_k=40, hq=4, hkv=1, causal=True, mask="additive_broadcast",
                           device=device)
    config = CPU_ATOMIC if device == "cpu" else default_config(16, torch.float32)

    def run():
        return attention_bwd(problem.do, problem.q, problem.k, problem.v, problem.o, problem.lse,
                             **problem.kwargs, mask_grad=True, deterministic=True, config=config)

    first, second = run(), run()
    for a, b in zip(first, second):
        assert torch.equal(a, b)


def test_deterministic_default_reads_env(monkeypatch):
    monkeypatch.setenv("IOATTN_DETERMINISTIC", "1")
    assert deterministic_default()
    monkeypatch.delenv("IOATTN_DETERMINISTIC")
    assert not deterministic_default()


def _args(**overrides):
    problem = make_problem(n_q=8, n_k=8)  # rejected before any kernel runs: CPU tensors are fine everywhere
    args = dict(do=problem.do, q=problem.q, k=problem.k, v=problem.v, o=problem.o, lse=problem.lse)
    args.update(overrides)
    return args, problem.kwargs


@pytest.mark.parametrize("override, message", [
    (dict(q=torch.zeros(1, 8, 2, 16, dtype=torch.float64)), "q.dtype"),
    (dict(lse=torch.zeros(1, 2, 8, dtype=torch.float16)), "lse.dtype"),
    (dict(q=torch.zeros(1, 8, 2, 12), o=torch.zeros(1, 8, 2, 12), do=torch.zeros(1, 8, 2, 12)), "multiples of 8"),
    (dict(k=torch.zeros(1, 8, 3, 16), v=torch.zeros(1, 8, 3, 16)), "multiple of key/value heads"),
    (dict(lse=torch.zeros(1, 8, 2)), "lse must have shape"),
])
def test_bad_input_raises(override, message):
    args, kwargs = _args(**override)
    with pytest.raises(ValueError, match=message):
        attention_bwd(**args, **kwargs)


def test_mask_grad_needs_additive_mask():
    args, kwargs = _args()
    with pytest.raises(ValueError, match="mask_grad"):
        attention_bwd(**args, **kwargs, attn_mask=torch.ones(8, 8, dtype=torch.bool), mask_grad=True)


def test_varlen_rejects_mask():
    problem = make_problem(seqlens=[(4, 4)])  # rejected before any kernel runs
    with pytest.raises(ValueError, match="attn_mask"):
        attention_bwd(problem.do, problem.q, problem.k, problem.v, problem.o, problem.lse, **problem.kwargs,
                      attn_mask=torch.zeros(4, 4))


def test_grid_walk_covers_partial_head_groups(device, poisoned):
    """More (batch, head) pairs than one walk group holds, the last group partial (3 x 5 = 15 pairs, groups of
    8): every tile of every pair is computed once, in the walk's longest-first order."""
    problem = make_problem(batch=3, n_q=40, n_k=40, hq=5, hkv=5, causal=True, device=device)
    check(problem, torch.float32, config=CPU_CONFIG)
    gqa = make_problem(seqlens=[(9, 30), (33, 33), (0, 5), (17, 17), (40, 12)], hq=6, hkv=2, causal=True,
                       device=device)
    check(gqa, torch.float32, config=CPU_CONFIG)


def test_config_text_names_the_dq_launch():
    split = BwdConfig(64, 64, 128, 64, 4, 2, False, 8, 3)
    assert split.dq_launch == (8, 3) and str(split).endswith("dq_num_warps=8 dq_num_stages=3")
    same = BwdConfig(64, 64, 64, 64, 4, 3, False)
    assert same.dq_launch == (4, 3) and "dq_num_warps" not in str(same)


def test_candidate_configs_cover_both_dq_modes():
    for head_dim in (64, 128, 256):
        configs = candidate_configs(head_dim, torch.bfloat16)
        assert {c.atomic_dq for c in configs} == {True, False}
        assert configs[0] == default_config(head_dim, torch.bfloat16)


HOPPER_COMPILE = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from ioattn.kernels import prefill_bwd as bwd

common = dict(HEAD_DIM=72, HEAD_DIM_PAD=128, BOTTOM_RIGHT=True, LEFT_BOUNDED=True, RIGHT_BOUNDED=True,
              INPUT_PRECISION="tf32", LOOP_STAGES=2, HEAD_GROUP=8)
variants = [
    (bwd.attention_bwd_dkdv_kernel, dict(common, VARLEN=True, GROUP=2, MASK_KIND=0, BLOCK_M=32, BLOCK_N=128,
                                         ATOMIC_DQ=True, DMASK_MODE=0)),
    (bwd.attention_bwd_dkdv_kernel, dict(common, VARLEN=False, GROUP=1, MASK_KIND=2, BLOCK_M=32, BLOCK_N=64,
                                         ATOMIC_DQ=False, DMASK_MODE=2, seqlen_q=1)),
    (bwd.attention_bwd_dq_kernel, dict(common, VARLEN=True, GROUP=4, MASK_KIND=1, BLOCK_M=128, BLOCK_N=32)),
    (bwd.attention_bwd_preprocess_kernel, dict(HEAD_DIM=72, HEAD_DIM_PAD=128, BLOCK_M=32, VARLEN=True)),
]
pointer_types = dict(LSE="*fp32", STATS="*fp32", DQ_ACCUM="*fp32", DMASK="*fp32", CU_Q="*i32", CU_K="*i32",
                     **{name: "*bf16" for name in ("Q", "K", "V", "O", "DO", "DQ", "DK", "DV", "MASK")})
for fn, constants in variants:
    def kind(name):
        if name in constants:
            return "constexpr"
        return pointer_types.get(name, "fp32" if name == "softmax_scale" else "i32")
    signature = {name: kind(name) for name in fn.arg_names}
    triton.compile(ASTSource(fn, signature, constants), target=GPUTarget("cuda", 90, 32),
                   options={"num_warps": 4, "num_stages": 2})
print("compiled")
"""


@pytest.mark.slow
def test_kernels_compile_for_hopper_without_a_gpu():
    """Catches what the interpreter cannot (compiled-mode typing, descriptors, layouts) on a CPU-only machine:
    the kernels are compiled for sm_90 down to a cubin; nothing runs."""
    env = dict(os.environ, TRITON_INTERPRET="0")
    done = subprocess.run([sys.executable, "-c", HOPPER_COMPILE], env=env, capture_output=True, text=True)
    assert done.returncode == 0 and "compiled" in done.stdout, done.stderr[-3000:]


# ---- device (H200): bf16 and the real configurations, skipped on CPU-only machines ----

GPU_CASES = [
    dict(batch=2, n_q=300, n_k=300, hq=4, hkv=4, head_dim=128, causal=True),
    dict(batch=1, n_q=257, n_k=513, hq=8, hkv=2, head_dim=64, causal=True),
    dict(batch=2, n_q=200, n_k=200, hq=2, hkv=1, head_dim=72, window_size=(33, 17)),
    dict(batch=1, n_q=128, n_k=190, hq=2, hkv=2, head_dim=256, causal=True, bottom_right=False),
    dict(batch=2, n_q=130, n_k=150, hq=2, hkv=2, head_dim=64, mask="additive_broadcast"),
    dict(seqlens=[(100, 300), (0, 40), (257, 257), (31, 0)], hq=4, hkv=1, head_dim=128, causal=True),
]


GPU_RUNS = ([(case, torch.bfloat16) for case in range(len(GPU_CASES))]
            + [(case, dtype) for case in (0, 5) for dtype in (torch.float16, torch.float32)])


@pytest.mark.gpu
@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("case, dtype", GPU_RUNS)
def test_gpu_matches_reference(case, dtype, deterministic, poisoned):
    kwargs = GPU_CASES[case]
    check(make_problem(**kwargs, dtype=dtype, device="cuda"), dtype, deterministic=deterministic,
          mask_grad=kwargs.get("mask") == "additive_broadcast")


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 128])
def test_gpu_every_candidate_config(head_dim, poisoned):
    problem = make_problem(batch=1, n_q=300, n_k=333, hq=4, hkv=2, head_dim=head_dim, causal=True,
                           dtype=torch.bfloat16, device="cuda")
    for config in candidate_configs(head_dim, torch.bfloat16):
        check(problem, torch.bfloat16, config=config)


@pytest.mark.gpu
def test_gpu_backward_in_a_cuda_graph(poisoned):
    """The default D=128 backward (dQ kernel first, writing the row statistics the dK/dV kernel reads) eager
    and replayed from a CUDA graph matches the reference, and work queued after it sees both kernels' outputs
    (17 x 3 pairs: several grid-walk groups, the last partial)."""
    config = default_config(128, torch.bfloat16)
    problem = make_problem(batch=17, n_q=700, n_k=700, hq=3, hkv=3, head_dim=128, causal=True,
                           dtype=torch.bfloat16, device="cuda")
    ref = reference_grads(problem, False)

    def run():
        grads = attention_bwd(problem.do, problem.q, problem.k, problem.v, problem.o, problem.lse,
                              **problem.kwargs, config=config)
        return [g * 2 for g in grads[:3]]  # work queued behind the dQ kernel

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        eager = run()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = run()
    for t in captured:
        t.fill_(math.nan)
    graph.replay()
    torch.cuda.synchronize()
    for outputs in (eager, captured):
        for name, got, want in zip(("dq", "dk", "dv"), outputs, ref):
            assert rel_error(got / 2, want) < TOLERANCE[torch.bfloat16], name


@pytest.mark.gpu
def test_gpu_deterministic_bf16_bitwise():
    problem = make_problem(batch=2, n_q=1024, n_k=1024, hq=8, hkv=2, head_dim=128, causal=True,
                           dtype=torch.bfloat16, device="cuda")
    config = default_config(128, torch.bfloat16)
    runs = [attention_bwd(problem.do, problem.q, problem.k, problem.v, problem.o, problem.lse, **problem.kwargs,
                          deterministic=True, config=config) for _ in range(2)]
    for a, b in zip(runs[0][:3], runs[1][:3]):
        assert torch.equal(a, b)
