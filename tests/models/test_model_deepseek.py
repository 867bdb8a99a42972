"""DeepSeek-V2/V3 (multi-head latent attention) against transformers on tiny all-dense checkpoints (fp32, CPU), the
absorbed MLA form against the expanded one (fp64), and the config's refusals and round trip."""

import dataclasses

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("safetensors")
pytest.importorskip("tokenizers")

from hf_checkpoints import DEEPSEEK_FAMILIES, VOCAB, family_fields, hf_classes, hf_logits, save_hf_model
from ioattn.models import DeepseekForCausalLM, DenseCausalAttention, ModelConfig, build_model, load_model
from ioattn.models.checkpoint import checkpoint_files
from ioattn.models.config import MLAConfig
from ioattn.models.deepseek import MLAProjection, expanded_attention, rope_frequencies
from ioattn.reference import rel_error

LOGITS_TOL = 1e-5  # as for the Llama family (test_model_parity.py)
PACKED_LENS = [13, 1, 7]
FAMILIES = sorted(DEEPSEEK_FAMILIES)


def packed_logits(loaded, seqs, backend="torch"):
    ids = torch.tensor([t for s in seqs for t in s])
    positions = torch.cat([torch.arange(len(s)) for s in seqs])
    ctx = DenseCausalAttention.build([len(s) for s in seqs], loaded.config, ids.device, backend=backend)
    return loaded.model.compute_logits(loaded.model(ids, positions, ctx))


@pytest.fixture(scope="module", params=FAMILIES)
def checkpoint(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    hf_model = save_hf_model(request.param, path)
    return request.param, hf_model, load_model(path, dtype=torch.float32, device="cpu"), path


@pytest.mark.parametrize("lens", [[11], PACKED_LENS], ids=["single", "packed"])
def test_logits_match_hf(checkpoint, lens):
    family, hf_model, loaded, _ = checkpoint
    assert isinstance(loaded.model, DeepseekForCausalLM)
    seqs = [torch.randint(0, VOCAB, (n,)).tolist() for n in lens]
    ours = packed_logits(loaded, seqs)
    ref = torch.cat([hf_logits(hf_model, s) for s in seqs])
    assert ours.dtype == torch.float32 and ours.shape == ref.shape
    assert rel_error(ours, ref) < LOGITS_TOL, family


def test_ioattn_varlen_backend_matches_hf(checkpoint):
    """Through ioattn's flash_attn_varlen_func (its torch backend on the CPU), V zero-padded to Q/K's head dim."""
    family, hf_model, loaded, _ = checkpoint
    seqs = [torch.randint(0, VOCAB, (n,)).tolist() for n in PACKED_LENS]
    ref = torch.cat([hf_logits(hf_model, s) for s in seqs])
    assert rel_error(packed_logits(loaded, seqs, backend="ioattn"), ref) < LOGITS_TOL, family


def test_greedy_tokens_match_hf_generate(checkpoint):
    """Greedy continuation recomputed from scratch each step (no cache) equals HF's cached `generate`."""
    family, hf_model, loaded, _ = checkpoint
    prompt = torch.randint(3, VOCAB, (6,)).tolist()
    steps = 8
    expected = hf_model.generate(
        torch.tensor([prompt]), max_new_tokens=steps, do_sample=False, eos_token_id=None, pad_token_id=0
    )[0, len(prompt):].tolist()
    tokens = list(prompt)
    for _ in range(steps):
        tokens.append(int(packed_logits(loaded, [tokens])[-1].argmax()))
    assert tokens[len(prompt):] == expected, family


def test_v3_rope_in_halves_matches_hf(tmp_path):
    """rope_interleave=False: V3's rotary dims already in halves, rotated as Llama's."""
    hf_model = save_hf_model("deepseek_v3", tmp_path, rope_interleave=False)
    loaded = load_model(tmp_path, dtype=torch.float32, device="cpu")
    assert not loaded.config.mla.rope_interleave
    seqs = [torch.randint(0, VOCAB, (n,)).tolist() for n in PACKED_LENS]
    ref = torch.cat([hf_logits(hf_model, s) for s in seqs])
    assert rel_error(packed_logits(loaded, seqs), ref) < LOGITS_TOL


@pytest.mark.parametrize("changes", [{}, {"truncate": False}, {"attention_factor": 0.9}, {"mscale": None}],
                         ids=["v3", "untruncated", "attention_factor", "no_mscale"])
def test_yarn_frequencies_and_scales_match_transformers(changes):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config_cls, model_cls = hf_classes("deepseek_v3")
    fields = family_fields("deepseek_v3")
    rope = {k: v for k, v in {**fields["rope_parameters"], **changes}.items() if v is not None}
    hf_config = config_cls(**{**fields, "rope_parameters": rope})
    ours = ModelConfig.from_hf(hf_config.to_dict())
    expected_freq, expected_factor = ROPE_INIT_FUNCTIONS["yarn"](hf_config, "cpu")
    inv_freq, factor = rope_frequencies(ours)
    assert torch.equal(inv_freq, expected_freq) and factor == expected_factor
    with torch.device("meta"):
        hf_attention = model_cls(hf_config).model.layers[0].self_attn
    assert ours.softmax_scale == hf_attention.scaling != ours.mla.qk_head_dim ** -0.5


def random_packed_mla(lens_q, lens_k, heads=3, dn=16, dr=8, dl=24, dv=8, dtype=torch.float64):
    """Random MLA inputs for packed sequences of lens_q queries over lens_k keys, and a projection."""
    generator = torch.Generator().manual_seed(0)

    def draw(*shape):
        return torch.randn(*shape, generator=generator, dtype=dtype)

    total_q, total_k = sum(lens_q), sum(lens_k)
    mla = MLAConfig(kv_lora_rank=dl, qk_nope_head_dim=dn, qk_rope_head_dim=dr, v_head_dim=dv)
    projection = MLAProjection(heads, mla).to(dtype).requires_grad_(False)
    projection.weight.copy_(draw(*projection.weight.shape) / dl ** 0.5)
    cu_q, cu_k = (torch.tensor([0, *lens]).cumsum(0).to(torch.int32) for lens in (lens_q, lens_k))
    inputs = dict(q_nope=draw(total_q, heads, dn), q_rope=draw(total_q, heads, dr), latent=draw(total_k, dl),
                  k_rope=draw(total_k, dr))
    return projection, inputs, cu_q, cu_k


def absorbed_attention(projection, q_nope, q_rope, latent, k_rope, cu_q, cu_k):
    """The decode form in plain float64: [q_latent ‖ q_rope] over [latent ‖ k_rope], V = latent, then W_UV."""
    q = torch.cat((projection.absorb(q_nope), q_rope), dim=-1)  # (T, H, dl + dr)
    k = torch.cat((latent, k_rope), dim=-1)  # (N, dl + dr): one head shared by all
    o_latent = torch.empty(q.shape[0], q.shape[1], latent.shape[1], dtype=q.dtype)
    for b in range(len(cu_q) - 1):
        qs, qe, ks, ke = int(cu_q[b]), int(cu_q[b + 1]), int(cu_k[b]), int(cu_k[b + 1])
        scores = torch.einsum("thd,nd->htn", q[qs:qe], k[ks:ke]) * projection.softmax_scale
        query_pos = torch.arange(qe - qs)[:, None] + (ke - ks) - (qe - qs)
        scores = scores.masked_fill(torch.arange(ke - ks)[None, :] > query_pos, float("-inf"))
        o_latent[qs:qe] = torch.einsum("htn,nl->thl", scores.softmax(-1), latent[ks:ke])
    return projection.output(o_latent)


# Full prefills, then chunks and single decode tokens over longer caches (bottom-right causal).
LENS = [([5, 1, 9], [5, 1, 9]), ([2, 1, 4], [7, 6, 4])]


@pytest.mark.parametrize("lens_q, lens_k", LENS, ids=["prefill", "chunk_and_decode"])
def test_absorbed_form_equals_expanded(lens_q, lens_k):
    projection, inputs, cu_q, cu_k = random_packed_mla(lens_q, lens_k)
    k_nope, v = projection.expand(inputs["latent"])
    expanded = expanded_attention(inputs["q_nope"], inputs["q_rope"], k_nope, inputs["k_rope"], v, cu_q, cu_k,
                                  max(lens_q), max(lens_k), projection.softmax_scale, backend="torch")
    absorbed = absorbed_attention(projection, **inputs, cu_q=cu_q, cu_k=cu_k)
    assert expanded.shape == (sum(lens_q), 3, 8)
    torch.testing.assert_close(expanded, absorbed, rtol=1e-12, atol=1e-12)
    # ioattn's varlen kernel entry point in float32 (it takes no float64), V padded from 8 to 24.
    as32 = {name: t.float() for name, t in inputs.items()}
    projection32 = projection.float()
    k_nope, v = projection32.expand(as32["latent"])
    varlen = expanded_attention(as32["q_nope"], as32["q_rope"], k_nope, as32["k_rope"], v, cu_q, cu_k,
                                max(lens_q), max(lens_k), projection.softmax_scale, backend="ioattn")
    torch.testing.assert_close(varlen.double(), absorbed, rtol=1e-5, atol=1e-5)


def test_projection_views_share_kv_b_proj_storage(checkpoint):
    _, hf_model, loaded, _ = checkpoint
    mla = loaded.config.mla
    projection = loaded.model.model.layers[1].self_attn.projection
    weight = projection.weight
    assert projection.w_uk.shape == (loaded.config.num_heads, mla.qk_nope_head_dim, mla.kv_lora_rank)
    assert projection.w_uv.shape == (loaded.config.num_heads, mla.v_head_dim, mla.kv_lora_rank)
    assert projection.w_uk.data_ptr() == weight.data_ptr()
    assert projection.w_uv.untyped_storage().data_ptr() == weight.untyped_storage().data_ptr()
    assert torch.equal(weight, hf_model.model.layers[1].self_attn.kv_b_proj.weight)


def test_checkpoint_names_are_all_consumed(checkpoint):
    from safetensors import safe_open

    _, _, loaded, path = checkpoint
    names = set()
    for file in checkpoint_files(path):
        with safe_open(file, framework="pt") as f:
            names.update(f.keys())
    if loaded.config.tie_word_embeddings:
        names.discard("lm_head.weight")
    assert set(loaded.model.checkpoint_layout()) == names


def test_build_model_dispatches_on_the_config(checkpoint):
    _, _, loaded, _ = checkpoint
    model = build_model(loaded.config, torch.bfloat16, "meta")
    assert isinstance(model, DeepseekForCausalLM)
    assert model.model.layers[0].mlp.gate_up_proj.weight.dtype == torch.bfloat16
    assert sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in loaded.model.parameters())


# DeepSeek-V2-Lite's config.json as released: rope_theta top level, rope_scaling with "type"; MoE from layer 1.
V2_LITE = dict(
    model_type="deepseek_v2", architectures=["DeepseekV2ForCausalLM"], vocab_size=102400, hidden_size=2048,
    intermediate_size=10944, moe_intermediate_size=1408, num_hidden_layers=27, num_attention_heads=16,
    num_key_value_heads=16, n_shared_experts=2, n_routed_experts=64, first_k_dense_replace=1, kv_lora_rank=512,
    q_lora_rank=None, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, rope_theta=10000,
    rope_scaling={"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 0.707, "mscale_all_dim": 0.707,
                  "original_max_position_embeddings": 4096, "type": "yarn"},
    max_position_embeddings=163840, rms_norm_eps=1e-6, hidden_act="silu", torch_dtype="bfloat16",
)


def test_moe_layers_are_refused_naming_the_field():
    expected = r"first_k_dense_replace \(1\) < num_hidden_layers \(27\).*MoE layers, which are not supported yet"
    with pytest.raises(ValueError, match=expected):
        ModelConfig.from_hf(V2_LITE)


def test_all_dense_v2_lite_shape_caches_one_576_wide_head():
    config = ModelConfig.from_hf({**V2_LITE, "first_k_dense_replace": 27})
    assert (config.num_heads, config.num_kv_heads, config.head_dim) == (16, 1, 576)
    assert config.mla.q_lora_rank is None and config.mla.yarn.factor == 40 and config.dtype == torch.bfloat16
    mscale = 0.1 * 0.707 * torch.tensor(40.0).log().item() + 1
    assert config.softmax_scale == pytest.approx(192 ** -0.5 * mscale ** 2, rel=1e-6)


@pytest.mark.parametrize(
    "fields, named",
    [
        (dict(rope_scaling={"type": "llama3", "factor": 8.0}), "rope_type"),
        (dict(rope_scaling={"type": "yarn"}), "factor"),
        (dict(hidden_act="gelu"), "hidden_act"),
        (dict(qk_rope_head_dim=63), "qk_rope_head_dim"),
    ],
)
def test_unsupported_deepseek_config_raises_naming_the_field(fields, named):
    with pytest.raises(ValueError, match=named):
        ModelConfig.from_hf({**V2_LITE, "first_k_dense_replace": 27, **fields})


def test_mla_config_must_cache_one_latent_head():
    config = ModelConfig.from_hf({**V2_LITE, "first_k_dense_replace": 27})
    with pytest.raises(ValueError, match="num_kv_heads must be 1"):
        dataclasses.replace(config, num_kv_heads=16)


@pytest.mark.parametrize("family", FAMILIES)
def test_to_hf_round_trips_through_transformers(family, tmp_path):
    config_cls, _ = hf_classes(family)
    config_cls(**family_fields(family)).save_pretrained(tmp_path)
    ours = ModelConfig.from_json(tmp_path)
    assert ModelConfig.from_hf(ours.to_hf()) == ours
    config_cls(**ours.to_hf()).save_pretrained(tmp_path / "again")
    assert ModelConfig.from_json(tmp_path / "again") == ours
