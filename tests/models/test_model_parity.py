"""Logits of ioattn's models against Hugging Face transformers on the same checkpoint (fp32, CPU)."""

import importlib.util
import os

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("safetensors")
pytest.importorskip("tokenizers")

from hf_checkpoints import FAMILIES, VOCAB, hf_logits, save_hf_model
from ioattn.models import DenseCausalAttention, load_model
from ioattn.reference import rel_error

# Whole-model logits in fp32: matmul blocking and the fused q/k/v and gate/up projections reorder sums, so a few
# ulps per layer accumulate; HF against itself with another attention backend differs by the same order.
LOGITS_TOL = 1e-5

# Longer than every family's sliding window (<= 5), so windows cut into attention; a length-1 sequence too.
PACKED_LENS = [13, 1, 7]

HAS_IOATTN_VARLEN = importlib.util.find_spec("ioattn.ops.attention") is not None


def packed_logits(loaded, seqs, backend="torch"):
    ids = torch.tensor([t for s in seqs for t in s])
    positions = torch.cat([torch.arange(len(s)) for s in seqs])
    ctx = DenseCausalAttention.build([len(s) for s in seqs], loaded.config, ids.device, backend=backend)
    return loaded.model.compute_logits(loaded.model(ids, positions, ctx))


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def checkpoint(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    hf_model = save_hf_model(request.param, path)
    return request.param, hf_model, load_model(path, dtype=torch.float32, device="cpu"), path


@pytest.mark.parametrize("lens", [[11], PACKED_LENS], ids=["single", "packed"])
def test_logits_match_hf(checkpoint, lens):
    family, hf_model, loaded, _ = checkpoint
    seqs = [torch.randint(0, VOCAB, (n,)).tolist() for n in lens]
    ours = packed_logits(loaded, seqs)
    ref = torch.cat([hf_logits(hf_model, s) for s in seqs])
    assert ours.dtype == torch.float32 and ours.shape == ref.shape
    assert rel_error(ours, ref) < LOGITS_TOL, family


def test_greedy_tokens_match_hf_generate(checkpoint):
    """Greedy continuation recomputed from scratch each step (no cache) equals HF's cached `generate`."""
    family, hf_model, loaded, _ = checkpoint
    prompt = torch.randint(3, VOCAB, (6,)).tolist()
    steps = 8  # runs past every sliding window
    expected = hf_model.generate(
        torch.tensor([prompt]), max_new_tokens=steps, do_sample=False, eos_token_id=None, pad_token_id=0
    )[0, len(prompt):].tolist()
    tokens = list(prompt)
    for _ in range(steps):
        tokens.append(int(packed_logits(loaded, [tokens])[-1].argmax()))
    assert tokens[len(prompt):] == expected, family


def test_sharded_checkpoint_loads_the_same_model(tmp_path):
    hf_model = save_hf_model("llama", tmp_path, max_shard_size="20KB")
    shards = [f for f in os.listdir(tmp_path) if f.endswith(".safetensors")]
    assert len(shards) > 3 and "model.safetensors.index.json" in os.listdir(tmp_path)
    loaded = load_model(tmp_path, dtype=torch.float32, device="cpu")
    seqs = [torch.randint(0, VOCAB, (n,)).tolist() for n in PACKED_LENS]
    ref = torch.cat([hf_logits(hf_model, s) for s in seqs])
    assert rel_error(packed_logits(loaded, seqs), ref) < LOGITS_TOL


def test_checkpoint_dtype_is_converted(tmp_path):
    hf_model = save_hf_model("qwen3", tmp_path)
    loaded = load_model(tmp_path, dtype="float16", device="cpu")
    assert all(p.dtype == torch.float16 for p in loaded.model.parameters())
    assert loaded.model.inv_freq.dtype == torch.float32
    seq = torch.randint(0, VOCAB, (9,)).tolist()
    # fp16 weights and activations against the fp32 HF model: the fp16 tolerance band, never NaN.
    assert rel_error(packed_logits(loaded, [seq]), hf_logits(hf_model, seq)) < 1e-2


@pytest.mark.skipif(not HAS_IOATTN_VARLEN, reason="ioattn.ops.attention not built yet")
def test_ioattn_varlen_backend_matches_hf(tmp_path):
    """The default context on ioattn's own varlen kernel (Triton interpreter on CPU), sliding window included."""
    hf_model = save_hf_model("mistral", tmp_path)
    loaded = load_model(tmp_path, dtype=torch.float32, device="cpu")
    seqs = [torch.randint(0, VOCAB, (n,)).tolist() for n in (9, 4)]
    ref = torch.cat([hf_logits(hf_model, s) for s in seqs])
    assert rel_error(packed_logits(loaded, seqs, backend="ioattn"), ref) < LOGITS_TOL


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, tol", [(torch.float32, LOGITS_TOL), (torch.bfloat16, 3e-2)], ids=["fp32", "bf16"])
def test_gpu_ioattn_backend_matches_hf(checkpoint, dtype, tol):
    """On CUDA through ioattn's varlen kernel; bf16 against HF's fp32 run (HF's own bf16 run is ~1.3e-2 off it)."""
    family, hf_model, _, path = checkpoint
    loaded = load_model(path, dtype=dtype, device="cuda")
    seqs = [torch.randint(0, VOCAB, (n,)).tolist() for n in (40, *PACKED_LENS)]
    ids = torch.tensor([t for s in seqs for t in s], device="cuda")
    positions = torch.cat([torch.arange(len(s)) for s in seqs]).cuda()
    ctx = DenseCausalAttention.build([len(s) for s in seqs], loaded.config, "cuda", backend="ioattn")
    ours = loaded.model.compute_logits(loaded.model(ids, positions, ctx))
    ref = torch.cat([hf_logits(hf_model, s) for s in seqs])
    assert rel_error(ours.cpu(), ref) < tol, family
