"""Loading llama-architecture GGUF files (llama.cpp's format): configuration, tokenizer, chat template, weights.

The `gguf` package (llama.cpp's own Python reader) parses the file and dequantizes its tensors; this module maps
what it reads onto `LlamaForCausalLM`:

- the configuration from the `llama.*` metadata (no `output.weight` tensor: tied embeddings);
- every tensor dequantized to float32 at load (F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K..Q6_K), then
  cast to the model dtype; llama.cpp's converter stores each Q/K head's rows with the two RoPE halves
  interleaved (its rotary kernel rotates adjacent pairs), so those rows are put back in halves order;
- the tokenizer: a byte-level BPE (`tokenizer.ggml.model` "gpt2") from the file's tokens and merges, split
  before BPE as llama.cpp splits for the file's `tokenizer.ggml.pre`, its control tokens special (matched in
  text, skipped when decoding), BOS/EOS added as `tokenizer.ggml.add_bos_token` / `add_eos_token` say;
- the chat template (`tokenizer.chat_template`) with its BOS/EOS strings, and the stop ids (EOS, EOT, EOM).

Every problem (a missing or truncated file, a wrong magic, another architecture, an unsupported tensor type,
tokenizer or RoPE variant) raises `GGUFError` naming the file and what is supported.
"""

from __future__ import annotations

import os
from functools import cached_property

import numpy as np
import torch

from ioattn.models.config import ModelConfig
from ioattn.models.llama import LlamaForCausalLM, build_model
from ioattn.models.checkpoint import ChatTemplateSource, LoadedModel, resolve_dtype
from ioattn.models.tokenizer import HFTokenizer

GGUF_MAGIC = b"GGUF"
SUPPORTED_ARCHITECTURES = ("llama",)
SUPPORTED_TENSOR_TYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0",
                          "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
SUPPORTED_TOKENIZER_MODELS = ("gpt2",)

# How llama.cpp splits text before byte-level BPE, per `tokenizer.ggml.pre`: regexes applied in turn, each cutting
# every piece so far into its matches and the text between them. None is GPT-2's regex, which the byte-level
# pre-tokenizer applies itself.
_GPT2_SPLIT = None
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")
PRE_TOKENIZER_SPLITS = {
    "default": (_GPT2_SPLIT,),
    "gpt2": (_GPT2_SPLIT,),
    # Every digit on its own, then GPT-2's regex (SmolLM, StarCoder and kin).
    "smollm": (r"\p{N}", _GPT2_SPLIT),
    "starcoder": (r"\p{N}", _GPT2_SPLIT),
    "refact": (r"\p{N}", _GPT2_SPLIT),
    "llama-bpe": (_LLAMA3_SPLIT,),
}

# GGUF names -> Hugging Face checkpoint names (what `LlamaForCausalLM.checkpoint_layout` knows).
_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.bias": "self_attn.o_proj.bias",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "ffn_gate.bias": "mlp.gate_proj.bias",
    "ffn_up.bias": "mlp.up_proj.bias",
    "ffn_down.bias": "mlp.down_proj.bias",
}

# llama.cpp's token types: CONTROL tokens are special, USER_DEFINED ones are matched in text as they are.
_CONTROL, _USER_DEFINED = 3, 4
_REQUIRED = object()


class GGUFError(ValueError):
    """A GGUF file that cannot be loaded; the message names the file and the problem."""


class GGUFFile:
    """An opened GGUF file: its metadata values and tensors, read by `gguf.GGUFReader` (memory-mapped)."""

    def __init__(self, path: str | os.PathLike):
        import gguf

        self.path = os.fspath(path)
        if not os.path.isfile(self.path):
            raise FileNotFoundError(f"GGUF file {self.path} does not exist")
        with open(self.path, "rb") as f:
            magic = f.read(4)
        if magic != GGUF_MAGIC:
            raise GGUFError(f"{self.path} is not a GGUF file: it starts with {magic!r}, a GGUF file with "
                            f"{GGUF_MAGIC!r}")
        try:
            self._reader = gguf.GGUFReader(self.path)
        except Exception as error:  # the reader fails on short reads with whatever numpy raises
            raise GGUFError(f"{self.path} is truncated or corrupt ({os.path.getsize(self.path)} bytes; "
                            f"the GGUF reader stopped with {type(error).__name__}: {error})") from error
        self.tensors = {t.name: t for t in self._reader.tensors}
        self.architecture = self.value("general.architecture")
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise GGUFError(f"{self.path}: architecture {self.architecture!r} is not supported "
                            f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})")

    def value(self, key: str, default=_REQUIRED):
        """A metadata value (str, int, float, bool or list); `default` when absent, else an error naming it."""
        field = self._reader.fields.get(key)
        if field is None:
            if default is _REQUIRED:
                raise GGUFError(f"{self.path}: metadata key {key!r} is missing")
            return default
        return field.contents()

    def model_value(self, key: str, default=_REQUIRED):
        """An architecture-scoped value: `model_value("block_count")` reads `llama.block_count`."""
        return self.value(f"{self.architecture}.{key}", default)

    @cached_property
    def tokens(self) -> list[str]:
        return self.value("tokenizer.ggml.tokens")

    def token_id(self, key: str) -> int | None:
        """`tokenizer.ggml.<key>_token_id`, or None when the file does not name one."""
        return self.value(f"tokenizer.ggml.{key}_token_id", None)


def read_config(file: GGUFFile) -> ModelConfig:
    hidden = file.model_value("embedding_length")
    num_heads = file.model_value("attention.head_count")
    head_dim = file.model_value("attention.key_length", hidden // num_heads)
    value_dim = file.model_value("attention.value_length", head_dim)
    rope_dim = file.model_value("rope.dimension_count", head_dim)
    if value_dim != head_dim or rope_dim != head_dim:
        raise GGUFError(f"{file.path}: key length {head_dim}, value length {value_dim} and RoPE dimension count "
                        f"{rope_dim} must be equal (RoPE over the whole head)")
    scaling = file.model_value("rope.scaling.type", "none")
    if scaling != "none" or "rope_freqs.weight" in file.tensors:
        what = f"rope.scaling.type {scaling!r}" if scaling != "none" else "per-frequency factors (rope_freqs.weight)"
        raise GGUFError(f"{file.path}: RoPE scaling by {what} is not supported (plain RoPE only)")
    embedding = file.tensors.get("token_embd.weight")
    if embedding is None:
        raise GGUFError(f"{file.path}: tensor 'token_embd.weight' is missing")
    eos = tuple(dict.fromkeys(i for i in (file.token_id("eos"), file.token_id("eot"), file.token_id("eom"))
                              if i is not None))
    return ModelConfig(
        model_type="llama",
        vocab_size=int(embedding.shape[1]),  # ggml order: (row length, rows)
        hidden_size=hidden,
        intermediate_size=file.model_value("feed_forward_length"),
        num_layers=file.model_value("block_count"),
        num_heads=num_heads,
        num_kv_heads=file.model_value("attention.head_count_kv", num_heads),
        head_dim=head_dim,
        rms_norm_eps=file.model_value("attention.layer_norm_rms_epsilon", 1e-5),
        rope_theta=float(file.model_value("rope.freq_base", 10000.0)),
        max_position_embeddings=file.model_value("context_length"),
        qkv_bias="blk.0.attn_q.bias" in file.tensors,
        o_bias="blk.0.attn_output.bias" in file.tensors,
        mlp_bias="blk.0.ffn_up.bias" in file.tensors,
        tie_word_embeddings="output.weight" not in file.tensors,
        bos_token_id=file.token_id("bos"),
        eos_token_ids=eos,
    )


def read_tokenizer(file: GGUFFile, config: ModelConfig) -> HFTokenizer:
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

    kind = file.value("tokenizer.ggml.model")
    if kind not in SUPPORTED_TOKENIZER_MODELS:
        raise GGUFError(f"{file.path}: tokenizer.ggml.model {kind!r} is not supported "
                        f"(supported: {', '.join(SUPPORTED_TOKENIZER_MODELS)}, byte-level BPE)")
    pre = file.value("tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZER_SPLITS:
        raise GGUFError(f"{file.path}: tokenizer.ggml.pre {pre!r} is not supported "
                        f"(supported: {', '.join(PRE_TOKENIZER_SPLITS)})")
    tokens = file.tokens
    merges = []
    for merge in file.value("tokenizer.ggml.merges"):
        left, space, right = merge.partition(" ")
        if not space or " " in right:
            raise GGUFError(f"{file.path}: merge {merge!r} is not two tokens separated by one space")
        merges.append((left, right))
    unk = file.token_id("unknown")
    bpe = models.BPE({token: i for i, token in enumerate(tokens)}, merges,
                     unk_token=tokens[unk] if unk is not None else None)
    tokenizer = Tokenizer(bpe)
    splits = [pre_tokenizers.Split(Regex(pattern), behavior="isolated")
              for pattern in PRE_TOKENIZER_SPLITS[pre] if pattern is not None]
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=PRE_TOKENIZER_SPLITS[pre][-1] is None)
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([*splits, byte_level])
    tokenizer.decoder = decoders.ByteLevel()
    types = file.value("tokenizer.ggml.token_type", [])
    tokenizer.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)
                                  for i, t in enumerate(types) if t == _CONTROL])
    tokenizer.add_tokens([AddedToken(tokens[i], special=False, normalized=False)
                          for i, t in enumerate(types) if t == _USER_DEFINED])
    single, specials = ["$A"], []
    for key in ("bos", "eos"):
        token_id = file.token_id(key)
        if token_id is not None and file.value(f"tokenizer.ggml.add_{key}_token", False):
            single.insert(0 if key == "bos" else len(single), tokens[token_id])
            specials.append((tokens[token_id], token_id))
    tokenizer.post_processor = processors.TemplateProcessing(single=single, special_tokens=specials)
    return HFTokenizer(tokenizer, bos_token_id=config.bos_token_id, eos_token_ids=config.eos_token_ids)


def read_chat_template(file: GGUFFile) -> ChatTemplateSource | None:
    template = file.value("tokenizer.chat_template", None)
    if not template:
        return None
    tokens = file.tokens

    def text(key: str) -> str:
        token_id = file.token_id(key)
        return tokens[token_id] if token_id is not None and 0 <= token_id < len(tokens) else ""

    return ChatTemplateSource(template, bos_token=text("bos"), eos_token=text("eos"))


def checkpoint_name(gguf_name: str) -> str | None:
    """The Hugging Face name of a GGUF tensor (`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`),
    None for names this loader does not know."""
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    prefix, _, rest = gguf_name.partition(".")
    layer, _, leaf = rest.partition(".")
    if prefix != "blk" or not layer.isdigit() or leaf not in _LAYER_TENSORS:
        return None
    return f"model.layers.{int(layer)}.{_LAYER_TENSORS[leaf]}"


def unpermute_rows(tensor: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row order: within each head, row 2i + j holds what the HF layout keeps at row
    j * head_dim / 2 + i (j = 0, 1: the two RoPE halves)."""
    rows = tensor.shape[0]
    per_half = rows // num_heads // 2
    return tensor.reshape(num_heads, per_half, 2, *tensor.shape[1:]).transpose(1, 2).reshape(tensor.shape)


def dequantized(file: GGUFFile, name: str) -> torch.Tensor:
    """A tensor of the file as float32, in PyTorch's (rows, row length) order."""
    from gguf.quants import dequantize

    tensor = file.tensors[name]
    values = dequantize(tensor.data, tensor.tensor_type)
    values = values.reshape(tuple(int(n) for n in reversed(tensor.shape)))
    # F32 tensors come back as read-only views of the memory map.
    return torch.from_numpy(values if values.flags.writeable else np.array(values))


@torch.no_grad()
def load_weights(model: LlamaForCausalLM, file: GGUFFile) -> None:
    """Fill every parameter of `model` from the file; names and tensor types are checked before any is read."""
    layout = model.checkpoint_layout()
    names = {gguf_name: checkpoint_name(gguf_name) for gguf_name in file.tensors}
    unexpected = sorted(n for n, hf in names.items() if hf is None or hf not in layout)
    missing = sorted(set(layout) - set(names.values()))
    if unexpected or missing:
        raise GGUFError(f"{file.path} does not match the llama model its metadata describes: missing tensors "
                        f"{_preview(missing)}, unexpected tensors {_preview(unexpected)}")
    for gguf_name, tensor in file.tensors.items():
        if tensor.tensor_type.name not in SUPPORTED_TENSOR_TYPES:
            raise GGUFError(f"{file.path}: tensor {gguf_name} has type {tensor.tensor_type.name}, which is not "
                            f"supported (supported: {', '.join(SUPPORTED_TENSOR_TYPES)})")
    params = dict(model.named_parameters())
    for gguf_name, hf_name in names.items():
        param_name, start, end = layout[hf_name]
        target = params[param_name].data[start:end]
        values = dequantized(file, gguf_name)
        if values.shape != target.shape:
            raise GGUFError(f"{file.path}: tensor {gguf_name} has shape {tuple(values.shape)}, the model expects "
                            f"{tuple(target.shape)}")
        heads = _permuted_heads(gguf_name, model.config)
        target.copy_(values if heads is None else unpermute_rows(values, heads))


def _permuted_heads(gguf_name: str, config: ModelConfig) -> int | None:
    """The head count llama.cpp permuted this tensor's rows by (Q and K weights and biases), else None."""
    leaf = gguf_name.split(".")[2] if gguf_name.startswith("blk.") else None
    return {"attn_q": config.num_heads, "attn_k": config.num_kv_heads}.get(leaf)


def load_gguf(path: str | os.PathLike, dtype="auto", device=None):
    """A llama-architecture GGUF file -> `LoadedModel` (eval mode, no grad), weights dequantized to `dtype`."""
    device = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
    file = GGUFFile(path)
    config = read_config(file)
    tokenizer = read_tokenizer(file, config)
    model = build_model(config, resolve_dtype(dtype, config, device), device)
    load_weights(model, file)
    return LoadedModel(model, tokenizer, config, config.eos_token_ids, chat_template=read_chat_template(file))


def _preview(names: list[str], limit: int = 6) -> str:
    if not names:
        return "none"
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more
