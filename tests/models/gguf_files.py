"""Tiny random llama GGUF files written with `gguf.GGUFWriter`, for tests: every supported tensor type, a byte-level
BPE vocabulary with a few merges and ChatML control tokens, and llama.cpp's Q/K row permutation applied."""

from __future__ import annotations

import os

import numpy as np

HIDDEN, INTERMEDIATE, LAYERS, HEADS, KV_HEADS, HEAD_DIM = 256, 512, 2, 4, 2, 64  # K-quants need rows of 256
CONTEXT = 512
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n"), ("Ġ", "Ġ")]
CHAT_TEMPLATE = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
                 "'<|im_end|>\n' }}{% endfor %}"
                 "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")

# Where each K-quant block keeps its float16 scales (d, then dmin where it has one), as ggml lays blocks out.
K_QUANT_SCALE_OFFSETS = {"Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def vocabulary() -> list[str]:
    from tokenizers import pre_tokenizers

    return SPECIALS + sorted(pre_tokenizers.ByteLevel.alphabet()) + ["".join(m) for m in MERGES]


def llama_cpp_permute(rows: np.ndarray, num_heads: int) -> np.ndarray:
    """What llama.cpp's converter does to HF Q/K rows: within each head, the two RoPE halves interleaved."""
    out = np.empty_like(rows)
    per_half = rows.shape[0] // num_heads // 2
    for head in range(num_heads):
        for i in range(per_half):
            for half in range(2):
                out[head * 2 * per_half + 2 * i + half] = rows[head * 2 * per_half + half * per_half + i]
    return out


def encoded(values: np.ndarray, type_name: str, rng: np.random.Generator):
    """(data, raw_dtype) for `GGUFWriter.add_tensor`: `values` quantized, or random blocks for the types gguf
    cannot quantize (the K-quants: with small finite float16 scales; others, such as IQ4_NL, just bytes)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import quantize

    qtype = GGMLQuantizationType[type_name]
    if type_name == "F32":
        return values.astype(np.float32), None
    if type_name == "F16":
        return values.astype(np.float16), None
    try:
        return quantize(values.astype(np.float32), qtype), qtype
    except NotImplementedError:
        pass
    block_elems, block_bytes = GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, size=(values.size // block_elems, block_bytes), dtype=np.uint8)
    for offset in K_QUANT_SCALE_OFFSETS.get(type_name, ()):
        scale = rng.uniform(0.002, 0.01, size=blocks.shape[0]).astype(np.float16)
        blocks[:, offset:offset + 2] = scale.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(values.shape[0], -1), qtype


def write_tiny_llama(path: str | os.PathLike, tensor_types: str | list[str] = "F32", seed: int = 0,
                     tied: bool = False, architecture: str = "llama", pre: str = "smollm", add_bos: bool = False,
                     extra_tensors: dict[str, tuple[np.ndarray, object]] | None = None) -> str:
    """A 2-layer llama GGUF; `tensor_types` is one type for every matrix, or a list cycled over the matrices in
    file order (norms stay F32, as llama.cpp keeps them). Returns the path."""
    from gguf import GGUFWriter

    rng = np.random.default_rng(seed)
    types = [tensor_types] if isinstance(tensor_types, str) else list(tensor_types)
    tokens = vocabulary()
    writer = GGUFWriter(os.fspath(path), architecture)
    writer.add_block_count(LAYERS)
    writer.add_context_length(CONTEXT)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(INTERMEDIATE)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_dimension_count(HEAD_DIM)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types([3] * len(SPECIALS) + [1] * (len(tokens) - len(SPECIALS)))
    writer.add_token_merges([f"{a} {b}" for a, b in MERGES])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_add_bos_token(add_bos)
    writer.add_chat_template(CHAT_TEMPLATE)

    matrices = [("token_embd.weight", (len(tokens), HIDDEN), 1.0, None)]
    for layer in range(LAYERS):
        blk = f"blk.{layer}."
        matrices += [
            (blk + "attn_q.weight", (HEADS * HEAD_DIM, HIDDEN), HIDDEN ** -0.5, HEADS),
            (blk + "attn_k.weight", (KV_HEADS * HEAD_DIM, HIDDEN), HIDDEN ** -0.5, KV_HEADS),
            (blk + "attn_v.weight", (KV_HEADS * HEAD_DIM, HIDDEN), HIDDEN ** -0.5, None),
            (blk + "attn_output.weight", (HIDDEN, HEADS * HEAD_DIM), HIDDEN ** -0.5, None),
            (blk + "ffn_gate.weight", (INTERMEDIATE, HIDDEN), HIDDEN ** -0.5, None),
            (blk + "ffn_up.weight", (INTERMEDIATE, HIDDEN), HIDDEN ** -0.5, None),
            (blk + "ffn_down.weight", (HIDDEN, INTERMEDIATE), INTERMEDIATE ** -0.5, None),
        ]
    if not tied:
        matrices.append(("output.weight", (len(tokens), HIDDEN), HIDDEN ** -0.5, None))
    for index, (name, shape, std, permuted_heads) in enumerate(matrices):
        values = rng.normal(0.0, std, size=shape).astype(np.float32)
        if permuted_heads is not None:
            values = llama_cpp_permute(values, permuted_heads)
        data, raw_dtype = encoded(values, types[index % len(types)], rng)
        writer.add_tensor(name, data, raw_dtype=raw_dtype)
    # Norms away from 1, so a norm loaded into the wrong place shows.
    for name in ["output_norm.weight"] + [f"blk.{i}.{n}_norm.weight" for i in range(LAYERS) for n in ("attn", "ffn")]:
        writer.add_tensor(name, (1.0 + 0.2 * rng.standard_normal(HIDDEN)).astype(np.float32))
    for name, (data, raw_dtype) in (extra_tensors or {}).items():
        writer.add_tensor(name, data, raw_dtype=raw_dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return os.fspath(path)
