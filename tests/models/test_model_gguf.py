"""GGUF loading on tiny random llama files: every supported tensor type, the Q/K row order, config, tokenizer and
chat template from the metadata, and a clear error for each kind of bad file."""

import numpy as np
import pytest
import torch

from gguf_files import (CHAT_TEMPLATE, HEAD_DIM, HEADS, KV_HEADS, LAYERS, MERGES, SPECIALS, vocabulary,
                        write_tiny_llama)
from ioattn.models import DenseCausalAttention, load_model
from ioattn.models.gguf import SUPPORTED_TENSOR_TYPES, GGUFError
from ioattn.reference import rel_error


def logits(loaded, ids):
    ctx = DenseCausalAttention.build([len(ids)], loaded.config, "cpu", backend="torch")
    return loaded.model.compute_logits(loaded.model(torch.tensor(ids), torch.arange(len(ids)), ctx))


def reference_weight(reader_tensor, num_heads=None):
    """A GGUF tensor as the HF layout holds it, built independently of the loader: gguf's dequantization, then
    each head's rows gathered back from llama.cpp's interleaved order by index."""
    from gguf.quants import dequantize

    values = dequantize(reader_tensor.data, reader_tensor.tensor_type).reshape(tuple(reversed(reader_tensor.shape)))
    if num_heads is None:
        return torch.from_numpy(np.array(values))
    per_half = values.shape[0] // num_heads // 2
    order = [head * 2 * per_half + 2 * i + half
             for head in range(num_heads) for half in range(2) for i in range(per_half)]
    return torch.from_numpy(np.array(values[order]))


@pytest.mark.parametrize("tensor_type", SUPPORTED_TENSOR_TYPES)
def test_each_tensor_type_loads_the_dequantized_values(tensor_type, tmp_path):
    import gguf

    path = write_tiny_llama(tmp_path / f"{tensor_type}.gguf", tensor_type)
    loaded = load_model(path, device="cpu")
    params = dict(loaded.model.named_parameters())
    layout = loaded.model.checkpoint_layout()
    reader = gguf.GGUFReader(path)
    heads = {"attn_q": HEADS, "attn_k": KV_HEADS}
    from ioattn.models.gguf import checkpoint_name

    for tensor in reader.tensors:
        assert tensor.tensor_type.name == (tensor_type if "norm" not in tensor.name else "F32")
        param, start, end = layout[checkpoint_name(tensor.name)]
        expected = reference_weight(tensor, heads.get(tensor.name.split(".")[2] if "blk" in tensor.name else None))
        assert torch.equal(params[param].data[start:end], expected), tensor.name
    assert torch.isfinite(logits(loaded, [5, 70, 200, 3, 9])).all()


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_every_type_in_one_file_matches_transformers(tied, tmp_path):
    """transformers loads the same file (its own dequantization and un-permutation): the same weights bit for
    bit, hence the same logits."""
    from transformers import AutoModelForCausalLM

    write_tiny_llama(tmp_path / "mixed.gguf", list(SUPPORTED_TENSOR_TYPES), tied=tied)
    ours = load_model(tmp_path / "mixed.gguf", dtype="float32", device="cpu")
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="mixed.gguf", dtype=torch.float32).eval()
    assert (ours.model.lm_head is None) == tied == hf.config.tie_word_embeddings
    params, hf_state = dict(ours.model.named_parameters()), hf.state_dict()
    for name, (param, start, end) in ours.model.checkpoint_layout().items():
        assert torch.equal(params[param].data[start:end], hf_state[name]), name
    ids = torch.randint(0, ours.config.vocab_size, (19,)).tolist()
    with torch.no_grad():
        reference = hf(input_ids=torch.tensor([ids])).logits[0]
    assert rel_error(logits(ours, ids), reference) < 1e-5


def test_config_tokenizer_and_chat_template_come_from_the_metadata(tmp_path):
    loaded = load_model(write_tiny_llama(tmp_path / "m.gguf"), device="cpu")
    config = loaded.config
    assert (config.num_layers, config.num_heads, config.num_kv_heads, config.head_dim) == (LAYERS, HEADS, KV_HEADS,
                                                                                             HEAD_DIM)
    assert config.vocab_size == len(vocabulary()) and config.max_position_embeddings == 512
    assert config.bos_token_id == 1 and loaded.eos_token_ids == loaded.tokenizer.eos_token_ids == (2,)
    assert loaded.chat_template.template == CHAT_TEMPLATE
    assert (loaded.chat_template.bos_token, loaded.chat_template.eos_token) == ("<|im_start|>", "<|im_end|>")
    tokenizer = loaded.tokenizer
    vocab = {token: i for i, token in enumerate(vocabulary())}
    # Merges apply (" the" is one token), control tokens are matched in text and skipped when decoding.
    ids = tokenizer.encode("<|im_start|>in the")
    assert ids == [1, vocab["in"], vocab["".join(MERGES[2])]]
    assert tokenizer.decode(ids) == "in the"
    assert tokenizer.decode(ids, skip_special_tokens=False) == "<|im_start|>in the"
    text = "naïve 😀 digits 12\t\tand   spaces"
    assert tokenizer.decode(tokenizer.encode(text)) == text
    assert tokenizer.vocab_size == len(vocabulary()) and SPECIALS[2] == "<|im_end|>"


def test_add_bos_token_is_followed(tmp_path):
    with_bos = load_model(write_tiny_llama(tmp_path / "bos.gguf", add_bos=True), device="cpu").tokenizer
    assert with_bos.encode("in") == [1, vocabulary().index("in")]
    assert with_bos.encode("in", add_special_tokens=False) == [vocabulary().index("in")]


def test_pre_tokenizer_follows_llama_cpp_per_type(tmp_path):
    """What each `tokenizer.ggml.pre` splits, against the regexes of llama.cpp run by the `regex` module."""
    import regex

    from ioattn.models.gguf import PRE_TOKENIZER_SPLITS

    gpt2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
    text = "It's  12 apples,\t\t3.5 kg —  naïve 😀\n\n  x    1234567 done  "
    for pre, patterns in PRE_TOKENIZER_SPLITS.items():
        pieces = [text]
        for pattern in patterns:
            # Each regex splits every piece so far into its matches and the text between them.
            pieces = [part for piece in pieces for part in _isolate(regex, pattern or gpt2, piece)]
        tokenizer = load_model(write_tiny_llama(tmp_path / f"{pre}.gguf", pre=pre), device="cpu").tokenizer
        split = tokenizer._tokenizer.pre_tokenizer.pre_tokenize_str(text)
        byte_level = _byte_table()
        assert [piece for piece, _ in split] == ["".join(byte_level[b] for b in p.encode()) for p in pieces], pre


def _isolate(regex, pattern, text):
    """`text` cut into the matches of `pattern` and the runs between them, in order."""
    out, last = [], 0
    for match in regex.finditer(pattern, text):
        if match.start() > last:
            out.append(text[last:match.start()])
        if match.end() > match.start():
            out.append(match.group())
        last = match.end()
    if last < len(text):
        out.append(text[last:])
    return out


def _byte_table() -> dict[int, str]:
    """Byte -> its stand-in in byte-level BPE vocabularies (GPT-2's table): printable Latin-1 bytes stand for
    themselves, the others map past U+0100 in byte order."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)}
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


# -- bad files ---------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def good_bytes(tmp_path_factory):
    path = write_tiny_llama(tmp_path_factory.mktemp("good") / "good.gguf")
    with open(path, "rb") as f:
        return f.read()


@pytest.mark.parametrize("keep", [0.0001, 0.01, 0.5, 0.9999], ids=["header", "metadata", "tensors", "last-byte"])
def test_truncated_file_is_named(good_bytes, tmp_path, keep):
    path = tmp_path / "cut.gguf"
    path.write_bytes(good_bytes[: max(4, int(keep * len(good_bytes)))])
    with pytest.raises(GGUFError, match=rf"{path}.*truncated or corrupt"):
        load_model(path, device="cpu")


def test_wrong_magic_is_named(good_bytes, tmp_path):
    path = tmp_path / "model.bin"
    path.write_bytes(b"PK\x03\x04" + good_bytes[4:])
    with pytest.raises(GGUFError, match=rf"{path} is not a GGUF file: it starts with b'PK"):
        load_model(path, device="cpu")


def test_other_architecture_is_named(tmp_path):
    path = write_tiny_llama(tmp_path / "qwen.gguf", architecture="qwen2")
    with pytest.raises(GGUFError, match=r"qwen\.gguf: architecture 'qwen2' is not supported \(supported: llama\)"):
        load_model(path, device="cpu")


def test_unsupported_tensor_type_is_named(tmp_path):
    path = write_tiny_llama(tmp_path / "iq.gguf", ["F32", "IQ4_NL"])
    with pytest.raises(GGUFError, match=r"iq\.gguf: tensor blk\.0\.attn_q\.weight has type IQ4_NL, which is not "
                                        r"supported \(supported: F32, F16, BF16, Q4_0"):
        load_model(path, device="cpu")


def test_missing_or_unknown_tensors_and_metadata_are_named(tmp_path):
    extra = {"blk.0.attn_sinks.weight": (np.zeros(4, dtype=np.float32), None)}
    with pytest.raises(GGUFError, match=r"unexpected tensors blk\.0\.attn_sinks\.weight"):
        load_model(write_tiny_llama(tmp_path / "extra.gguf", extra_tensors=extra), device="cpu")
    rope = {"rope_freqs.weight": (np.ones(HEAD_DIM // 2, dtype=np.float32), None)}
    with pytest.raises(GGUFError, match=r"RoPE scaling by per-frequency factors \(rope_freqs\.weight\)"):
        load_model(write_tiny_llama(tmp_path / "rope.gguf", extra_tensors=rope), device="cpu")
    with pytest.raises(GGUFError, match=r"tokenizer\.ggml\.pre 'tekken' is not supported \(supported: default"):
        load_model(write_tiny_llama(tmp_path / "pre.gguf", pre="tekken"), device="cpu")
    with pytest.raises(FileNotFoundError, match="neither a preset, a GGUF file nor a checkpoint folder"):
        load_model(tmp_path / "absent.gguf", device="cpu")
