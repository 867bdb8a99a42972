"""Built-in presets: `tiny` is deterministic and usable on the CPU; `llama3-8b-shape` has Llama-3-8B's shapes."""

import pytest
import torch

from ioattn.models import DenseCausalAttention, build_model, load_model
from ioattn.models.presets import PRESETS
from ioattn.reference import rel_error


def tiny_logits(loaded, text):
    ids = torch.tensor(loaded.tokenizer.encode(text), device=loaded.model.inv_freq.device)
    ctx = DenseCausalAttention.build([len(ids)], loaded.config, ids.device, backend="torch")
    return loaded.model.compute_logits(loaded.model(ids, torch.arange(len(ids), device=ids.device), ctx))


def test_tiny_is_deterministic_and_dtype_independent():
    first, second = load_model("tiny", device="cpu"), load_model("tiny", device="cpu")
    for (name, a), b in zip(first.model.named_parameters(), second.model.parameters(), strict=True):
        assert torch.equal(a, b), name
    half = load_model("tiny", dtype="float16", device="cpu")
    for a, b in zip(first.model.parameters(), half.model.parameters(), strict=True):
        assert torch.equal(a.half(), b)
    logits = tiny_logits(first, "Hello, wörld")
    assert torch.equal(logits, tiny_logits(second, "Hello, wörld"))
    assert torch.isfinite(logits).all() and logits.std() > 0.5  # spread out, not near-ties


def test_tiny_fits_its_byte_tokenizer():
    loaded = load_model("tiny", device="cpu")
    assert loaded.tokenizer.vocab_size <= loaded.config.vocab_size
    assert loaded.eos_token_ids == loaded.tokenizer.eos_token_ids
    assert loaded.model.config.num_kv_heads == 2 and loaded.max_model_len == 4096


def test_llama3_8b_shape_has_the_real_parameter_count():
    config = PRESETS["llama3-8b-shape"].config
    model = build_model(config, torch.bfloat16, "meta")
    assert sum(p.numel() for p in model.parameters()) == 8_030_261_248  # Meta-Llama-3-8B
    assert (config.num_heads, config.num_kv_heads, config.head_dim, config.vocab_size) == (32, 8, 128, 128256)


def test_unknown_preset():
    from ioattn.models.presets import load_preset

    with pytest.raises(ValueError, match="preset"):
        load_preset("huge")


@pytest.mark.gpu
def test_presets_on_gpu_ioattn_backend_matches_torch():
    tiny = load_model("tiny", dtype="bfloat16", device="cuda")
    ids = torch.tensor(tiny.tokenizer.encode("The quick brown fox " * 20), device="cuda")
    lens = [len(ids) - 37, 37]
    positions = torch.cat([torch.arange(n, device="cuda") for n in lens])
    outs = []
    for backend in ("ioattn", "torch"):
        ctx = DenseCausalAttention.build(lens, tiny.config, "cuda", backend=backend)
        outs.append(tiny.model.compute_logits(tiny.model(ids, positions, ctx)))
    assert rel_error(outs[0], outs[1]) < 1e-2
    tiny_cpu = load_model("tiny", dtype="bfloat16", device="cpu")
    for a, b in zip(tiny.model.parameters(), tiny_cpu.model.parameters(), strict=True):
        assert torch.equal(a.cpu(), b)  # same weights on every device

    big = load_model("llama3-8b-shape", device="cuda")
    assert all(p.dtype == torch.bfloat16 and p.is_cuda for p in big.model.parameters())
    assert torch.isfinite(tiny_logits(big, "Hello")).all()
    del big
    torch.cuda.empty_cache()
