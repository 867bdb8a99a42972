"""Backend choice, the tuned table, explain() and IOATTN_LOG logging."""

import logging

import pytest
import torch

import ioattn
from ioattn.ops import checks, dispatch, forward
from ioattn.ops.capability import HOPPER
from ioattn.ops.forward import FwdConfig


def qkv(n_q=8, n_k=8, h_q=2, h_kv=2, d=16, dtype=torch.float32):
    return (torch.randn(1, n_q, h_q, d, dtype=dtype), torch.randn(1, n_k, h_kv, d, dtype=dtype),
            torch.randn(1, n_k, h_kv, d, dtype=dtype))


def test_auto_on_cpu_is_the_torch_backend():
    plan = ioattn.explain(*qkv(), causal=True)  # causal: torch's own CPU SDPA kernel
    assert plan.backend == "torch" and plan.kernel == dispatch.TORCH_SDPA_KERNEL and plan.config is None
    text = str(plan)
    for words in ("backend: torch", "_scaled_dot_product_flash_attention_for_cpu", "chosen by torch's CPU SDPA",
                  "auto: cpu tensors", "is_causal", "align=bottom-right", "window=(-1, 0)", "no copy"):
        assert words in text, text
    plan = ioattn.explain(*qkv(), window_size=(3, 0))  # a sliding window: the tiled forward, and why
    assert plan.kernel == dispatch.TORCH_KERNEL
    for words in ("attention_forward", "BLOCK_M=256", "not torch's SDPA: sliding window (3, 0)"):
        assert words in str(plan), str(plan)


@pytest.mark.parametrize("scale", [-0.25, 0.0])
def test_causal_with_a_scale_at_or_below_zero_takes_the_tiled_forward(scale):
    """torch's CPU SDPA kernel masks causal scores to -inf before scaling them: with a scale <= 0 every row would be
    NaN (found by the op fuzzer: sdpa, Nq 1, Nk 2, is_causal, scale -0.25)."""
    from ioattn.reference import attention_ref

    q, k, v = qkv(n_q=3, n_k=5, dtype=torch.float16)
    plan = ioattn.explain(q, k, v, causal=True, softmax_scale=scale)
    assert plan.kernel == dispatch.TORCH_KERNEL and "softmax_scale" in str(plan) and "NaN" in str(plan), str(plan)
    for out, align in ((ioattn.flash_attn_func(q, k, v, causal=True, softmax_scale=scale), "bottom_right"),
                       (ioattn.sdpa(*(t.transpose(1, 2) for t in (q, k, v)), is_causal=True,
                                    scale=scale).transpose(1, 2), "top_left")):
        ref, _ = attention_ref(q, k, v, causal=True, causal_align=align, softmax_scale=scale)
        assert torch.isfinite(out).all() and ((out.double() - ref).norm() / ref.norm()) < 2e-3


def test_triton_on_cpu_runs_the_interpreter():
    plan = ioattn.explain(*qkv(), backend="triton")
    assert plan.backend == "triton" and plan.kernel.endswith("prefill_fwd_kernel")
    assert "interpreter" in plan.reason and "BLOCK_M=32" in str(plan)


def test_triton_on_cpu_without_interpreter_raises(monkeypatch):
    monkeypatch.setattr(dispatch, "interpreted", lambda: False)
    with pytest.raises(ValueError, match="backend='triton' needs CUDA tensors"):
        ioattn.flash_attn_func(*qkv(), backend="triton")


def test_explain_infers_the_api():
    q, k, v = (t.transpose(1, 2) for t in qkv(h_q=4, h_kv=2))
    plan = ioattn.explain(q, k, v, is_causal=True, enable_gqa=True)
    assert "align=top-left" in str(plan) and plan.problem.window_right == 0
    packed = torch.randn(10, 2, 16)
    cu = torch.tensor([0, 4, 10], dtype=torch.int32)
    plan = ioattn.explain(packed, packed, packed, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=6,
                          max_seqlen_k=6, backend="triton")
    assert plan.backend == "triton"
    with pytest.raises(ValueError, match="api must be one of"):
        ioattn.explain(*qkv(), api="blocks")
    with pytest.raises(ValueError, match="block_table and seq_lens"):
        ioattn.explain(*qkv(), api="paged")
    with pytest.raises(ValueError, match="unexpected keyword arguments"):
        ioattn.explain(*qkv(), dropout_p=0.1)


def test_explain_names_copied_inputs():
    q, k, v = qkv()
    odd = torch.randn(1, 8, 2, 17)[..., :16]
    plan = ioattn.explain(odd, k, v, backend="triton")
    assert plan.copies and plan.copies[0][0] == "q" and "q copied to contiguous" in str(plan)


def test_fp32_precision_follows_allow_tf32():
    """IEEE fp32 dots unless the user opted into TF32 as for PyTorch matmuls (16-bit dots ignore the flag)."""
    saved = torch.backends.cuda.matmul.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = False
        assert ioattn.explain(*qkv(), backend="triton").problem.input_precision == "ieee"
        torch.backends.cuda.matmul.allow_tf32 = True
        assert ioattn.explain(*qkv(), backend="triton").problem.input_precision == "tf32"
        assert ioattn.explain(*qkv(dtype=torch.float16), backend="triton").problem.input_precision == "ieee"
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved


@pytest.mark.parametrize("n_q,h_q,h_kv,packed", [(1, 8, 2, True), (16, 32, 8, True), (17, 8, 2, False),
                                                 (4, 6, 2, False), (4, 4, 4, False)])
def test_gqa_packing_only_for_short_queries_and_power_of_two_groups(n_q, h_q, h_kv, packed):
    plan = ioattn.explain(*qkv(n_q=n_q, h_q=h_q, h_kv=h_kv), backend="triton")
    assert plan.problem.pack_gqa == packed


@pytest.mark.parametrize("d", [8, 64, 72, 128, 256])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("causal", [False, True])
def test_table_covers_every_head_dim(d, dtype, causal):
    config, source = forward.tuned_config(d, dtype, causal, HOPPER)
    assert isinstance(config, FwdConfig)
    assert ("tuned table sm90" in source) == (dtype != torch.float32)
    config, source = forward.tuned_config(d, dtype, causal, (8, 0))
    assert "default rule" in source


def test_explicit_config_for_tuning():
    from ioattn.ops.attention import flash_attn_with_config

    q, k, v = qkv(n_q=20, n_k=20)
    config = FwdConfig(16, 16, 4, 1)
    out, lse = flash_attn_with_config(q, k, v, config, causal=True)
    ref = ioattn.flash_attn_func(q, k, v, causal=True, backend="torch")
    assert (out - ref).abs().max() < 1e-5 and lse.shape == (1, 2, 20)
    plan = dispatch.plan(checks.validate_dense(q, k, v, True, (-1, -1), None), "triton", config)
    assert plan.config == config and "explicit config" in plan.reason


def test_log_once_per_signature(monkeypatch, caplog):
    monkeypatch.setenv("IOATTN_LOG", "1")
    monkeypatch.setattr(dispatch, "_LOGGED", set())
    with caplog.at_level(logging.INFO, logger="ioattn"):
        for _ in range(3):
            ioattn.flash_attn_func(*qkv(), causal=True)
        ioattn.flash_attn_func(*qkv(d=32), causal=True)
    records = [r for r in caplog.records if r.name == "ioattn"]
    assert len(records) == 2 and "backend: torch" in records[0].getMessage()


def test_no_log_without_env(monkeypatch, caplog):
    monkeypatch.delenv("IOATTN_LOG", raising=False)
    monkeypatch.setattr(dispatch, "_LOGGED", set())
    with caplog.at_level(logging.INFO, logger="ioattn"):
        ioattn.flash_attn_func(*qkv())
    assert not [r for r in caplog.records if r.name == "ioattn"]


@pytest.mark.gpu
def test_gpu_auto_is_triton_with_the_table():
    q, k, v = (t.cuda().bfloat16() for t in qkv(n_q=512, n_k=512, d=128))
    plan = ioattn.explain(q, k, v, causal=True)
    assert plan.backend == "triton" and "tuned table sm90" in plan.reason


def test_dense_mask_drops_stages_to_fit_shared_memory():
    q, k, v = (torch.randn(1, 4, 8, 64) for _ in range(3))
    inputs = checks.validate_sdpa(q, k, v, torch.zeros(8, 8), False, None, False)
    fitted, note = forward.fit_shared_memory(FwdConfig(128, 128, 4, 3), inputs)
    assert fitted == FwdConfig(128, 128, 4, 2) and "num_stages 3 -> 2" in note
    assert forward.shared_memory_estimate(fitted, 64, torch.float32, torch.float32) > 0
    unmasked = checks.validate_sdpa(q, k, v, None, False, None, False)
    assert forward.fit_shared_memory(FwdConfig(128, 128, 4, 3), unmasked) == (FwdConfig(128, 128, 4, 3), "")


def test_short_causal_queries_get_their_own_tiles():
    long_config, _ = forward.tuned_config(64, torch.bfloat16, True, HOPPER, 16384)
    short_config, source = forward.tuned_config(64, torch.bfloat16, True, HOPPER, forward.SHORT_SEQLEN)
    assert short_config != long_config and f"Nq <= {forward.SHORT_SEQLEN}" in source
    assert forward.tuned_config(128, torch.bfloat16, True, HOPPER, 512)[0] == \
        forward.tuned_config(128, torch.bfloat16, True, HOPPER, 16384)[0]


def test_short_queries_at_d64_get_their_own_loads_and_register_caps():
    """At D=64 and Nq <= 2048 the H200 table caps registers (one more resident program per SM) and causal tiles
    use pointer loads; explain() shows both."""
    short, _ = forward.tuned_config(64, torch.bfloat16, False, HOPPER, forward.SHORT_SEQLEN)
    short_causal, _ = forward.tuned_config(64, torch.bfloat16, True, HOPPER, forward.SHORT_SEQLEN)
    long, _ = forward.tuned_config(64, torch.bfloat16, True, HOPPER, 4 * forward.SHORT_SEQLEN)
    assert short.tma and not short_causal.tma and long.tma
    assert "maxnreg=168" in str(short) and "loads=pointers maxnreg=128" in str(short_causal)
    assert "loads=pointers" not in str(long) and "maxnreg" not in str(long)
