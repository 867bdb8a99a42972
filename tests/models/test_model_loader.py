"""Checkpoint loading: names checked before reading, tokenizer.json, generation_config.json, presets by name."""

import os

import pytest
import torch

pytest.importorskip("transformers")  # the checkpoints are written with save_pretrained
from safetensors.torch import load_file, save_file

from hf_checkpoints import VOCAB, save_hf_model, write_generation_config
from ioattn.models import load_model
from ioattn.models.loader import resolve_dtype
from ioattn.models.presets import PRESETS


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    save_hf_model("llama", path)
    return path


def rewrite_weights(src, dst, edit):
    """Copy checkpoint `src` to `dst` with its single safetensors file's tensors passed through `edit`."""
    os.makedirs(dst, exist_ok=True)
    for name in os.listdir(src):
        if name != "model.safetensors":
            with open(os.path.join(src, name), "rb") as f_in, open(os.path.join(dst, name), "wb") as f_out:
                f_out.write(f_in.read())
    tensors = edit(load_file(os.path.join(src, "model.safetensors")))
    save_file(tensors, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    return dst


def test_missing_tensor_is_named(llama_dir, tmp_path):
    def drop(tensors):
        del tensors["model.layers.1.self_attn.k_proj.weight"]
        return tensors

    with pytest.raises(ValueError, match=r"missing tensors model\.layers\.1\.self_attn\.k_proj\.weight"):
        load_model(rewrite_weights(llama_dir, tmp_path, drop), device="cpu")


def test_unexpected_tensor_is_named_and_rope_tables_are_ignored(llama_dir, tmp_path):
    def add(extra):
        def edit(tensors):
            tensors[extra] = torch.zeros(4)
            return tensors
        return edit

    with pytest.raises(ValueError, match=r"unexpected tensors model\.layers\.0\.self_attn\.extra"):
        load_model(rewrite_weights(llama_dir, tmp_path / "a", add("model.layers.0.self_attn.extra")), device="cpu")
    # Older exports carry RoPE tables; they are recomputed, not an error.
    load_model(rewrite_weights(llama_dir, tmp_path / "b", add("model.layers.0.self_attn.rotary_emb.inv_freq")))


def test_wrong_shape_is_named(llama_dir, tmp_path):
    def shrink(tensors):
        tensors["model.layers.0.mlp.up_proj.weight"] = tensors["model.layers.0.mlp.up_proj.weight"][:-1]
        return tensors

    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.up_proj\.weight has shape"):
        load_model(rewrite_weights(llama_dir, tmp_path, shrink), device="cpu")


def test_tied_checkpoint_may_also_store_lm_head(tmp_path):
    save_hf_model("qwen2", tmp_path / "tied")  # tie_word_embeddings=True: save_pretrained omits lm_head

    def duplicate(tensors):
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
        return tensors

    loaded = load_model(rewrite_weights(tmp_path / "tied", tmp_path / "dup", duplicate), device="cpu")
    assert loaded.model.lm_head is None


def test_tokenizer_json_round_trip_and_config_eos(llama_dir):
    loaded = load_model(llama_dir, device="cpu")
    tokenizer = loaded.tokenizer
    text = "w5 w17 w3 w90"
    ids = tokenizer.encode(text)
    assert ids == [1, 5, 17, 3, 90]  # BOS from tokenizer.json's post-processor
    assert tokenizer.decode(ids) == text
    assert tokenizer.encode(text, add_special_tokens=False) == ids[1:]
    assert tokenizer.vocab_size == VOCAB
    # save_pretrained's generation_config.json repeats config.json's eos_token_id (2).
    assert loaded.eos_token_ids == tokenizer.eos_token_ids == (2,)
    assert tokenizer.bos_token_id == 1
    assert loaded.max_model_len == 256


def test_generation_config_eos_list_wins_over_config(llama_dir, tmp_path):
    path = rewrite_weights(llama_dir, tmp_path, lambda tensors: tensors)
    write_generation_config(path, bos_token_id=1, eos_token_id=[2, 7], temperature=0.6)
    loaded = load_model(path, device="cpu")
    assert loaded.eos_token_ids == loaded.tokenizer.eos_token_ids == (2, 7)
    assert loaded.generation_config["temperature"] == 0.6
    os.remove(os.path.join(path, "generation_config.json"))
    assert load_model(path, device="cpu").eos_token_ids == (2,)  # falls back to config.json


def test_missing_files_and_bad_arguments(llama_dir, tmp_path):
    with pytest.raises(FileNotFoundError, match="neither a preset, a GGUF file nor a checkpoint folder"):
        load_model(tmp_path / "nowhere")
    incomplete = rewrite_weights(llama_dir, tmp_path / "incomplete", lambda tensors: tensors)
    os.remove(incomplete / "model.safetensors")
    with pytest.raises(FileNotFoundError, match="safetensors"):
        load_model(incomplete, device="cpu")
    os.remove(incomplete / "tokenizer.json")
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        load_model(incomplete, device="cpu")
    with pytest.raises(ValueError, match="dtype"):
        load_model(llama_dir, dtype="float64", device="cpu")


def test_dtype_auto_follows_the_checkpoint_then_the_device():
    config = PRESETS["tiny"].config
    assert resolve_dtype("auto", config, torch.device("cpu")) == torch.float32
    assert resolve_dtype("auto", config, torch.device("cuda")) == torch.bfloat16
    assert resolve_dtype("auto", config.replace(dtype=torch.float16), torch.device("cpu")) == torch.float16
    assert resolve_dtype(torch.bfloat16, config, torch.device("cpu")) == torch.bfloat16
