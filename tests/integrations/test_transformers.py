"""attn_implementation="ioattn" in HF transformers against the eager implementation, on small random models."""

import copy
import math

import pytest
import torch

transformers = pytest.importorskip("transformers")

import ioattn.integrations.transformers as ioattn_hf  # noqa: E402
from ioattn.reference import rel_error, sdpa_ref  # noqa: E402

ioattn_hf.register()

VOCAB = 128


def llama_config(config_class=transformers.LlamaConfig, **overrides):
    fields = dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=VOCAB, max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )
    return config_class(**(fields | overrides))


def bert_config(**overrides):
    fields = dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, vocab_size=VOCAB,
        max_position_embeddings=64, pad_token_id=0,
    )
    return transformers.BertConfig(**(fields | overrides))


def build(model_class, config, attn_implementation, dtype=torch.float32, device="cpu"):
    """The same random weights (fixed seed, without fixing the inputs' randomness) for every implementation."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        # A model keeps (and sets the implementation on) the config it is given: one copy per model.
        model = model_class._from_config(copy.deepcopy(config), attn_implementation=attn_implementation)
    assert model.config._attn_implementation == attn_implementation
    return model.to(device=device, dtype=dtype).eval()


def padded_batch(lengths, seq_len, side, device="cpu"):
    """Random token ids and the 0/1 attention mask of sequences of `lengths`, padded on `side` to `seq_len`."""
    input_ids = torch.randint(3, VOCAB, (len(lengths), seq_len), device=device)
    attention_mask = torch.zeros(len(lengths), seq_len, dtype=torch.long, device=device)
    for row, length in enumerate(lengths):
        real = slice(seq_len - length, seq_len) if side == "left" else slice(0, length)
        attention_mask[row, real] = 1
    return input_ids.masked_fill(attention_mask == 0, 0), attention_mask


def real_token_logits_error(model_class, config, input_ids, attention_mask, device):
    """Relative error of the ioattn model's logits against eager's (same weights), on real tokens only:
    left-padding query rows see no key, where ioattn returns 0 and eager an average over padding; both are
    padding that no real token reads."""
    # Eager in float64 is no reference here: it takes its softmax in float32, where float64's finfo.min mask
    # becomes -inf and a fully masked (left-padding) row turns NaN, which later layers spread to every token.
    logits = {}
    for implementation in ("ioattn", "eager"):
        model = build(model_class, config, implementation, device=device)
        with torch.no_grad():
            logits[implementation] = model(input_ids, attention_mask=attention_mask).logits
    real = attention_mask.bool()
    return rel_error(logits["ioattn"][real], logits["eager"][real])


@pytest.fixture(params=["auto", "triton"], ids=lambda backend: f"backend={backend}")
def sdpa_calls(request, monkeypatch):
    """Runs the integration's `ioattn.sdpa` calls on one backend (on CPU: auto = the exact torch path, triton =
    the kernel under the interpreter) and records how each call reached it: (is_causal, mask dtype, enable_gqa)."""
    calls = []
    real_sdpa = ioattn_hf.sdpa

    def recording_sdpa(query, key, value, attn_mask=None, is_causal=False, scale=None, enable_gqa=False):
        calls.append((is_causal, None if attn_mask is None else attn_mask.dtype, enable_gqa))
        return real_sdpa(query, key, value, attn_mask=attn_mask, is_causal=is_causal, scale=scale,
                         enable_gqa=enable_gqa, backend=request.param)

    monkeypatch.setattr(ioattn_hf, "sdpa", recording_sdpa)
    return calls


def test_register_adds_attention_and_mask_functions():
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    assert transformers.AttentionInterface()["ioattn"] is ioattn_hf.ioattn_attention_forward
    assert AttentionMaskInterface()["ioattn"] is sdpa_mask


@pytest.mark.parametrize("lengths", [(12, 12), (12, 7, 1)], ids=["full", "left_padded"])
def test_llama_logits_match_eager(lengths, sdpa_calls, device):
    config = llama_config()
    input_ids, attention_mask = padded_batch(lengths, 12, "left", device)
    assert real_token_logits_error(transformers.LlamaForCausalLM, config, input_ids, attention_mask, device) < 1e-5
    padded = min(lengths) < 12
    assert sdpa_calls == [(not padded, torch.bool if padded else None, True)] * config.num_hidden_layers


@pytest.mark.parametrize("lengths", [(5, 5), (5, 3)], ids=["full", "left_padded"])
def test_llama_greedy_generate_matches_eager(lengths, sdpa_calls, device):
    config = llama_config()
    input_ids, attention_mask = padded_batch(lengths, 5, "left", device)
    # min_new_tokens: an early end-of-sequence would cut the decode steps checked below.
    generate = dict(attention_mask=attention_mask, min_new_tokens=6, max_new_tokens=6, do_sample=False,
                    pad_token_id=0)
    with torch.no_grad():
        tokens, ref = (
            build(transformers.LlamaForCausalLM, config, name, device=device).generate(input_ids, **generate)
            for name in ("ioattn", "eager")
        )
    assert torch.equal(tokens, ref)
    prefill, decode = sdpa_calls[: config.num_hidden_layers], sdpa_calls[config.num_hidden_layers:]
    assert len(decode) == 5 * config.num_hidden_layers
    if min(lengths) == 5:
        # No padding: causal prefill through is_causal, and a decode query sees the whole cache (no mask at all).
        assert set(prefill) == {(True, None, True)} and set(decode) == {(False, None, True)}
    else:
        assert set(prefill) == set(decode) == {(False, torch.bool, True)}


def test_llama_several_tokens_after_a_cache_match_eager(sdpa_calls, device):
    """Queries that sit after cached keys (chunked prefill, speculative decoding) need a mask: top-left
    is_causal would hide the cache from them."""
    config = llama_config()
    input_ids = torch.randint(3, VOCAB, (2, 8), device=device)
    logits = {}
    for implementation in ("ioattn", "eager"):
        model = build(transformers.LlamaForCausalLM, config, implementation, device=device)
        with torch.no_grad():
            cache = model(input_ids[:, :5], use_cache=True).past_key_values
            logits[implementation] = model(input_ids[:, 5:], past_key_values=cache).logits
    assert rel_error(logits["ioattn"], logits["eager"]) < 1e-5
    chunk = sdpa_calls[config.num_hidden_layers:]
    assert chunk == [(False, torch.bool, True)] * config.num_hidden_layers


def test_mistral_sliding_window_matches_eager(sdpa_calls, device):
    """A sliding window reaches the kernel as a dense bool mask built by transformers."""
    config = llama_config(transformers.MistralConfig, sliding_window=4)
    input_ids, attention_mask = padded_batch((10, 6), 10, "left", device)
    assert real_token_logits_error(transformers.MistralForCausalLM, config, input_ids, attention_mask, device) < 1e-5
    assert sdpa_calls == [(False, torch.bool, True)] * config.num_hidden_layers


@pytest.mark.parametrize("lengths", [(10, 10), (10, 6, 1)], ids=["full", "right_padded"])
def test_bert_hidden_states_match_eager(lengths, sdpa_calls, device):
    config = bert_config()
    input_ids, attention_mask = padded_batch(lengths, 10, "right", device)
    model = build(transformers.BertModel, config, "ioattn", device=device)
    eager64 = build(transformers.BertModel, config, "eager", dtype=torch.float64, device=device)
    with torch.no_grad():
        hidden = model(input_ids, attention_mask=attention_mask).last_hidden_state
        ref = eager64(input_ids, attention_mask=attention_mask).last_hidden_state
    # Every query row of a right-padded encoder batch sees its real keys, so padding rows match too.
    assert rel_error(hidden, ref) < 1e-5
    padded = min(lengths) < 10
    assert sdpa_calls == [(False, torch.bool if padded else None, False)] * config.num_hidden_layers


def test_training_with_dropout_raises(device):
    config = bert_config(attention_probs_dropout_prob=0.1)
    model = build(transformers.BertModel, config, "ioattn", device=device).train()
    with pytest.raises(ValueError, match="dropout"):
        model(torch.randint(3, VOCAB, (1, 4), device=device))


def attention_inputs(device, batch=2, heads=4, kv_heads=2, n_q=5, n_k=7, head_dim=8):
    return (
        torch.randn(batch, heads, n_q, head_dim, device=device),
        torch.randn(batch, kv_heads, n_k, head_dim, device=device),
        torch.randn(batch, kv_heads, n_k, head_dim, device=device),
    )


def test_forward_maps_gqa_scaling_and_layout(sdpa_calls, device):
    q, k, v = attention_inputs(device)
    mask = torch.rand(2, 1, 5, 7, device=device) > 0.3
    mask[..., 0] = True
    out, weights = ioattn_hf.ioattn_attention_forward(torch.nn.Module(), q, k, v, mask, scaling=0.3)
    ref, _ = sdpa_ref(q, k, v, attn_mask=mask, scale=0.3, enable_gqa=True)
    assert weights is None and out.shape == (2, 5, 4, 8) and out.is_contiguous()
    assert rel_error(out, ref.transpose(1, 2)) < 1e-5
    assert sdpa_calls == [(False, torch.bool, True)]


def test_dense_causal_mask_is_never_rewritten_into_is_causal(sdpa_calls, device):
    q, k, v = attention_inputs(device, kv_heads=4, n_k=5)
    causal_mask = torch.ones(5, 5, dtype=torch.bool, device=device).tril()[None, None]
    module = torch.nn.Module()
    module.is_causal = True
    ioattn_hf.ioattn_attention_forward(module, q, k, v, causal_mask)
    ioattn_hf.ioattn_attention_forward(module, q, k, v, None, is_causal=False)
    assert sdpa_calls == [(False, torch.bool, False), (False, None, False)]


def test_position_bias_becomes_an_additive_mask(sdpa_calls, device):
    q, k, v = attention_inputs(device, kv_heads=4, n_q=6, n_k=6)
    bias = torch.randn(1, 4, 6, 6, device=device)
    module = torch.nn.Module()
    module.is_causal = True
    out, _ = ioattn_hf.ioattn_attention_forward(module, q, k, v, None, position_bias=bias, scaling=1.0)
    causal_bias = bias.masked_fill(~torch.ones(6, 6, dtype=torch.bool, device=device).tril(), -math.inf)
    ref, _ = sdpa_ref(q, k, v, attn_mask=causal_bias, scale=1.0)
    assert rel_error(out, ref.transpose(1, 2)) < 1e-5


@pytest.mark.parametrize(
    "option, message",
    [
        (dict(dropout=0.1), "dropout must be 0.0"),
        (dict(softcap=30.0), "softcap must be None"),
        (dict(s_aux=torch.zeros(4)), "s_aux must be None"),
        (dict(output_attentions=True), "output_attentions must be False"),
    ],
)
def test_unsupported_options_raise(option, message, device):
    q, k, v = attention_inputs(device)
    with pytest.raises(ValueError, match=message):
        ioattn_hf.ioattn_attention_forward(torch.nn.Module(), q, k, v, None, **option)


@pytest.mark.gpu
@pytest.mark.parametrize("model_class, config, side", [
    (transformers.LlamaForCausalLM, llama_config(), "left"),
    (transformers.BertModel, bert_config(), "right"),
], ids=["llama", "bert"])
def test_bf16_on_cuda_matches_eager_fp32(model_class, config, side):
    input_ids, attention_mask = padded_batch((16, 9, 3), 16, side, device="cuda")
    model = build(model_class, config, "ioattn", dtype=torch.bfloat16, device="cuda")
    # The reference holds the same bf16-rounded weights, so the error measured is that of bf16 arithmetic
    # (eager itself in bf16 is ~5e-3 off on these models), not of rounding the weights.
    eager = build(model_class, config, "eager", dtype=torch.bfloat16, device="cuda").float()
    with torch.no_grad():
        out = model(input_ids, attention_mask=attention_mask)[0]
        ref = eager(input_ids, attention_mask=attention_mask)[0]
    real = attention_mask.bool()
    assert rel_error(out[real], ref[real]) < 1e-2
