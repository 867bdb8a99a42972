"""Fused RMSNorm (+ residual), RoPE and SiLU-and-mul against the torch code of ioattn.models.llama.

References run that torch code on the CPU (on CUDA it would take the fused path itself), except the bf16 RoPE and
SiLU GPU tests, which run the plain torch functions on CUDA. fp32 must agree to rounding noise. fp16/bf16 results
may differ in rare elements (at most 1%) by up to two units in the last place: an intermediate the kernel rounds
(RMSNorm's y = x * rstd, whose sum of squares is reduced in another order; exp/cos from numpy in the interpreter
against torch's own on the CPU, one bit apart) can land one ulp off, and the next rounded op (w * y, silu(g) * u)
can widen that to two. Seen: ~3% of CPU runs of a 4100-wide RMSNorm, some rows of 64-token bf16 calls on the H200.
"""

import copy

import pytest
import torch
import torch.nn.functional as F

from ioattn.models.config import Llama3RopeScaling, ModelConfig
from ioattn.models.llama import (
    DenseCausalAttention, RMSNorm, apply_rotary, build_model, rope_inv_freq, rotary_cos_sin,
)
from ioattn.models.presets import PRESETS, randomize_weights
from ioattn.ops.fused import rms_norm, rotary_embedding_, silu_and_mul

EPS = 1e-5


def _ordered_bits(t: torch.Tensor) -> torch.Tensor:
    """16-bit floats as integers that are adjacent exactly when the floats are adjacent."""
    bits = t.view(torch.int16).int()
    return torch.where(bits < 0, -(bits & 0x7FFF), bits)


def assert_matches(out: torch.Tensor, ref: torch.Tensor, max_ulp_fraction: float = 0.01, max_ulp: int = 2) -> None:
    out = out.cpu()
    assert out.shape == ref.shape and out.dtype == ref.dtype
    if ref.numel() == 0:
        return
    if ref.dtype == torch.float32:
        scale = ref.abs().max().clamp_min(1e-30)
        assert ((out - ref).abs().max() / scale).item() < 1e-6
        return
    ulps = (_ordered_bits(out) - _ordered_bits(ref)).abs()
    assert ulps.max().item() <= max_ulp, f"{ulps.max().item()} ulp apart"
    assert (ulps > 0).float().mean().item() <= max_ulp_fraction


def torch_norm(x, weight, residual=None):
    """RMSNorm.forward's torch path (CPU) -> (normed, x + residual or None)."""
    norm = RMSNorm(x.shape[-1], EPS).to(x.dtype)
    norm.weight.data.copy_(weight.cpu())
    x = x.cpu()
    if residual is None:
        return norm(x), None
    h = x + residual.cpu()
    return norm(h), h


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("hidden", [40, 96, 4100])
@pytest.mark.parametrize("tokens", [1, 3])
def test_rms_norm_with_and_without_residual(device, dtype, hidden, tokens):
    x = torch.randn(tokens, hidden, dtype=dtype, device=device)
    residual = torch.randn(tokens, hidden, dtype=dtype, device=device)
    weight = (1 + 0.5 * torch.randn(hidden)).to(dtype).to(device)
    ref, _ = torch_norm(x, weight)
    assert_matches(rms_norm(x, weight, EPS), ref)
    ref, ref_sum = torch_norm(x, weight, residual)
    out, new_residual = rms_norm(x, weight, EPS, residual)
    assert new_residual is residual
    assert torch.equal(new_residual.cpu(), ref_sum)  # the add is exact in the dtype's rounding
    assert_matches(out, ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_rms_norm_per_head_on_a_strided_view(device, dtype):
    """Qwen3's q/k norm: (T, H, D) heads inside a wider qkv row."""
    qkv = torch.randn(5, 7, 32, dtype=dtype, device=device)
    q = qkv[:, 1:5]
    weight = torch.randn(32).to(dtype).to(device)
    ref, _ = torch_norm(q, weight)
    assert_matches(rms_norm(q, weight, EPS), ref)


def test_no_tokens(device):
    weight = torch.ones(64, device=device)
    x, residual = torch.empty(0, 64, device=device), torch.empty(0, 64, device=device)
    assert rms_norm(x, weight, EPS).shape == (0, 64)
    assert rms_norm(x, weight, EPS, residual)[0].shape == (0, 64)
    assert silu_and_mul(torch.empty(0, 128, device=device)).shape == (0, 64)
    q, k = torch.empty(0, 4, 64, device=device), torch.empty(0, 2, 64, device=device)
    rotary_embedding_(q, k, torch.empty(0, dtype=torch.int64, device=device), torch.ones(32, device=device))


def _llama3_inv_freq(head_dim: int) -> torch.Tensor:
    config = ModelConfig(
        model_type="llama", vocab_size=16, hidden_size=4 * head_dim, intermediate_size=64, num_layers=1,
        num_heads=4, num_kv_heads=2, head_dim=head_dim, rms_norm_eps=EPS, rope_theta=500000.0,
        max_position_embeddings=8192, rope_scaling=Llama3RopeScaling(8.0, 1.0, 4.0, 64),
    )
    return rope_inv_freq(config)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("tokens", [1, 6])
def test_rotary_in_place_on_qkv_views(device, dtype, tokens, num_q_heads=12, num_kv_heads=2, head_dim=64):
    """q and k are slices of one (T, Hq + 2 Hkv, D) buffer; v (the rest) is left alone."""
    qkv = torch.randn(tokens, num_q_heads + 2 * num_kv_heads, head_dim, dtype=dtype, device=device)
    q, k, v = qkv.split([num_q_heads, num_kv_heads, num_kv_heads], dim=1)
    v_before = v.clone()
    positions = torch.randint(0, 8192, (tokens,), device=device)
    inv_freq = _llama3_inv_freq(head_dim)
    cos, sin = rotary_cos_sin(inv_freq, positions.cpu(), dtype)
    ref_q, ref_k = apply_rotary(q.cpu(), cos, sin), apply_rotary(k.cpu(), cos, sin)
    assert rotary_embedding_(q, k, positions, inv_freq.to(device)) is None
    assert_matches(q, ref_q)
    assert_matches(k, ref_k)
    assert torch.equal(v, v_before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("tokens", [1, 3])
def test_silu_and_mul(device, dtype, tokens, inter=1100):
    gate_up = (2 * torch.randn(tokens, 2 * inter)).to(dtype).to(device)
    gate, up = gate_up.cpu().chunk(2, dim=-1)
    assert_matches(silu_and_mul(gate_up), F.silu(gate) * up)


def test_bad_arguments():
    x, weight = torch.randn(2, 8), torch.ones(8)
    with pytest.raises(ValueError, match="x dtype"):
        rms_norm(x.int(), weight, EPS)
    with pytest.raises(ValueError, match="x must be contiguous in its last dimension"):
        rms_norm(torch.randn(8, 2).t(), weight, EPS)
    with pytest.raises(ValueError, match="weight must be a contiguous"):
        rms_norm(x, torch.ones(9), EPS)
    with pytest.raises(ValueError, match="wider than rms_norm supports"):
        rms_norm(torch.randn(1, 16385), torch.ones(16385), EPS)
    with pytest.raises(ValueError, match="weight dtype"):
        rms_norm(x, weight.half(), EPS)
    with pytest.raises(ValueError, match="weight is on meta"):
        rms_norm(x, torch.ones(8, device="meta"), EPS)
    with pytest.raises(ValueError, match="residual shape"):
        rms_norm(x, weight, EPS, torch.randn(3, 8))
    with pytest.raises(ValueError, match="residual must not share"):
        rms_norm(x, weight, EPS, x)
    q, k, positions, inv_freq = torch.randn(2, 4, 16), torch.randn(2, 2, 16), torch.arange(2), torch.ones(8)
    with pytest.raises(ValueError, match="k dtype"):
        rotary_embedding_(q, k.half(), positions, inv_freq)
    with pytest.raises(ValueError, match=r"k \(2, 2, 8\) must match q"):
        rotary_embedding_(q, torch.randn(2, 2, 8), positions, inv_freq)
    with pytest.raises(ValueError, match="q and k must be"):
        rotary_embedding_(q[0], k, positions, inv_freq)
    with pytest.raises(ValueError, match="positions must be"):
        rotary_embedding_(q, k, positions.float(), inv_freq)
    with pytest.raises(ValueError, match="inv_freq must be"):
        rotary_embedding_(q, k, positions, torch.ones(16))
    with pytest.raises(ValueError, match="gate_up must be"):
        silu_and_mul(torch.randn(2, 7))
    with pytest.raises(ValueError, match="gate_up must be a torch.Tensor"):
        silu_and_mul([1.0, 2.0])


@pytest.mark.gpu
@pytest.mark.parametrize("hidden", [128, 4096, 5120, 8192])
def test_bf16_rms_norm_on_gpu(hidden, tokens=64):
    x = torch.randn(tokens, hidden, dtype=torch.bfloat16, device="cuda")
    residual = torch.randn(tokens, hidden, dtype=torch.bfloat16, device="cuda")
    weight = (1 + 0.5 * torch.randn(hidden)).to(torch.bfloat16).cuda()
    ref, ref_sum = torch_norm(x, weight, residual)
    out, new_residual = rms_norm(x, weight, EPS, residual)
    assert torch.equal(new_residual.cpu(), ref_sum)
    assert_matches(out, ref)


@pytest.mark.gpu
def test_bf16_rotary_on_gpu(tokens=64, head_dim=128):
    """Against the torch code run on CUDA: the CPU's cos/sin differ from CUDA's in the last bit, and near-cancelling
    outputs magnify that."""
    qkv = torch.randn(tokens, 48, head_dim, dtype=torch.bfloat16, device="cuda")
    q, k = qkv[:, :32], qkv[:, 32:40]
    positions = torch.randint(0, 100_000, (tokens,), device="cuda")
    inv_freq = _llama3_inv_freq(head_dim).cuda()
    cos, sin = rotary_cos_sin(inv_freq, positions, torch.bfloat16)
    ref_q, ref_k = apply_rotary(q, cos, sin).cpu(), apply_rotary(k, cos, sin).cpu()
    rotary_embedding_(q, k, positions, inv_freq)
    assert_matches(q, ref_q)
    assert_matches(k, ref_k)


@pytest.mark.gpu
def test_bf16_silu_and_mul_on_gpu(tokens=64, inter=14336):
    gate_up = (2 * torch.randn(tokens, 2 * inter)).to(torch.bfloat16).cuda()
    gate, up = gate_up.chunk(2, dim=-1)
    assert_matches(silu_and_mul(gate_up), (F.silu(gate) * up).cpu())

def _greedy_logits(model, ids: list[int], steps: int):
    """Full-recompute greedy decoding -> (first step's last-row logits, generated tokens)."""
    device = model.inv_freq.device
    ids, first = list(ids), None
    for _ in range(steps):
        ctx = DenseCausalAttention.build([len(ids)], model.config, device, backend="torch")
        hidden = model(torch.tensor(ids, device=device), torch.arange(len(ids), device=device), ctx)
        logits = model.compute_logits(hidden[-1:])[0].cpu()
        first = logits if first is None else first
        ids.append(int(logits.argmax()))
    return first, ids[-steps:]


@pytest.mark.gpu
@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
@torch.inference_mode()
def test_model_fused_path_matches_torch_path(model_type):
    """The tiny preset (Qwen3: with per-head q/k norms) in bf16: CUDA runs the fused kernels, the CPU the torch
    code, on the same weights."""
    config = PRESETS["tiny"].config.replace(model_type=model_type, qk_norm=model_type == "qwen3")
    on_cpu = build_model(config, torch.bfloat16, "cpu")
    randomize_weights(on_cpu, seed=0, draw_device="cpu")
    on_gpu = copy.deepcopy(on_cpu).to("cuda")
    prompt = [(7 * i + 3) % 250 + 1 for i in range(24)]
    cpu_logits, cpu_tokens = _greedy_logits(on_cpu, prompt, steps=6)
    gpu_logits, gpu_tokens = _greedy_logits(on_gpu, prompt, steps=6)
    assert (gpu_logits - cpu_logits).abs().max() <= 0.05 * cpu_logits.abs().max()
    assert gpu_tokens == cpu_tokens
