"""Tensor-parallel Llama-family models: each rank builds and loads only its shard, from the same checkpoint.

Rank r of `world_size` holds (Megatron's split, one all-reduce per attention block and one per MLP):

- query heads [r * Hq/tp, (r + 1) * Hq/tp) in `qkv_proj` and the matching input columns of `o_proj`;
- KV heads [r * Hkv/tp, ...) when tp divides Hkv; when Hkv divides tp instead, KV head r // (tp / Hkv), replicated
  on the tp / Hkv ranks whose query heads read it (GQA: those query heads all belong to that KV head);
- intermediate rows [r * I/tp, ...) of `gate_up_proj` (gate and up alike) and the matching columns of `down_proj`;
- vocabulary rows [r * ceil(V/tp), ...) of the embedding and LM head (the last shard zero-padded).

Norms (including Qwen3's per-head q/k norms) and the row-parallel biases are replicated. The rank's paged KV cache
holds only its KV heads, so every kernel runs unchanged on the rank's smaller head counts. Checkpoint folders are
read with safetensors slices (a rank reads its rows, not the whole tensor); presets, whose weights are drawn from
a seed, are built whole on each rank and then cut.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ioattn.intmath import cdiv
from ioattn.distributed.layers import RowParallelLinear, VocabParallelEmbedding, gather_vocab_logits
from ioattn.models.config import ModelConfig, eos_token_ids
from ioattn.models.llama import LlamaForCausalLM
from ioattn.models.loader import LoadedModel, checkpoint_files, load_generation_config, resolve_dtype
from ioattn.models.presets import PRESETS, load_preset
from ioattn.models.tokenizer import HFTokenizer



@dataclass(frozen=True)
class ShardPlan:
    """Which rows of each checkpoint tensor rank `rank` of `world_size` holds."""

    config: ModelConfig  # the whole model's
    rank: int
    world_size: int

    def __post_init__(self):
        c, tp = self.config, self.world_size
        if not isinstance(tp, int) or tp < 1:
            raise ValueError(f"tensor_parallel_size must be an int >= 1, got {tp!r}")
        # The shards split Llama's projections; an MLA model's latent and kv_b_proj have no split here yet.
        if c.mla is not None:
            raise ValueError(f"tensor parallelism (tensor_parallel_size={tp}) is not supported for MLA models "
                             f"({c.model_type}) yet: serve them with LLM(..., tensor_parallel_size=1), one process")
        if c.num_heads % tp:
            raise ValueError(f"tensor_parallel_size ({tp}) must divide num_attention_heads ({c.num_heads})")
        if c.num_kv_heads % tp and tp % c.num_kv_heads:
            raise ValueError(f"tensor_parallel_size ({tp}) must divide num_key_value_heads ({c.num_kv_heads}) "
                             "or be a multiple of it")
        if c.intermediate_size % tp:
            raise ValueError(f"tensor_parallel_size ({tp}) must divide intermediate_size ({c.intermediate_size})")

    @property
    def num_heads(self) -> int:
        return self.config.num_heads // self.world_size

    @property
    def num_kv_heads(self) -> int:
        return max(self.config.num_kv_heads // self.world_size, 1)

    @property
    def first_kv_head(self) -> int:
        c, tp = self.config, self.world_size
        if c.num_kv_heads >= tp:
            return self.rank * self.num_kv_heads
        return self.rank // (tp // c.num_kv_heads)

    @property
    def intermediate_size(self) -> int:
        return self.config.intermediate_size // self.world_size

    @property
    def vocab_rows(self) -> int:
        return cdiv(self.config.vocab_size, self.world_size)

    @property
    def vocab_start(self) -> int:
        return self.rank * self.vocab_rows

    def local_config(self) -> ModelConfig:
        """The rank's model: its head and intermediate counts; vocab_size stays the whole vocabulary's."""
        return self.config.replace(num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
                                   intermediate_size=self.intermediate_size)

    def checkpoint_slice(self, name: str) -> tuple[int, int, int] | None:
        """(dim, start, end) of the checkpoint tensor `name` this rank reads; None when it is replicated."""
        d = self.config.head_dim
        q = (0, self.rank * self.num_heads * d, (self.rank + 1) * self.num_heads * d)
        kv = (0, self.first_kv_head * d, (self.first_kv_head + self.num_kv_heads) * d)
        mlp = (0, self.rank * self.intermediate_size, (self.rank + 1) * self.intermediate_size)
        vocab = (0, self.vocab_start, min(self.vocab_start + self.vocab_rows, self.config.vocab_size))
        module, _, kind = name.rpartition(".")
        leaf = module.rpartition(".")[2]
        if leaf == "q_proj":
            return q
        if leaf in ("k_proj", "v_proj"):
            return kv
        if leaf in ("gate_proj", "up_proj"):
            return mlp
        if leaf in ("o_proj", "down_proj"):
            # Row-parallel: the weight's input columns are split, the bias is added once after the all-reduce.
            return None if kind == "bias" else (1, *(q if leaf == "o_proj" else mlp)[1:])
        if leaf in ("embed_tokens", "lm_head"):
            return vocab
        return None


class TensorParallelLlama(LlamaForCausalLM):
    """A rank's shard; `forward` is the base class's (the parallel layers communicate), logits are gathered."""

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return gather_vocab_logits(super().compute_logits(hidden), self.config.vocab_size)


def build_shard(plan: ShardPlan, dtype: torch.dtype, device) -> TensorParallelLlama:
    """The rank's model, allocated on `device` in `dtype`, not initialised (load_shard fills it)."""
    local = plan.local_config()
    with torch.device("meta"):
        # Built with the shard's vocabulary rows so that the untied LM head gets its local shape.
        model = TensorParallelLlama(local.replace(vocab_size=plan.vocab_rows))
        model.config = local
        c = local
        for layer in model.model.layers:
            layer.self_attn.o_proj = RowParallelLinear(c.num_heads * c.head_dim, c.hidden_size, bias=c.o_bias)
            layer.mlp.down_proj = RowParallelLinear(c.intermediate_size, c.hidden_size, bias=c.mlp_bias)
        model.model.embed_tokens = VocabParallelEmbedding(plan.vocab_rows, c.hidden_size, plan.vocab_start)
    model = model.to(dtype).to_empty(device=device)
    model.reset_rope()
    return model.eval().requires_grad_(False)


VOCAB_TENSORS = ("embed_tokens.weight", "lm_head.weight")

# name -> (dim, start, end) -> the rows/columns of that checkpoint tensor (None: all of it).
TensorReader = Callable[[str, tuple[int, int, int] | None], torch.Tensor]


@torch.no_grad()
def load_shard(model: TensorParallelLlama, plan: ShardPlan, names: set[str], read: TensorReader) -> None:
    """Fill every parameter of the rank's model from the checkpoint tensors `names`, each read in its slice."""
    layout = model.checkpoint_layout()
    missing = sorted(layout.keys() - names)
    if missing:
        raise ValueError(f"checkpoint lacks tensors the {plan.config.model_type} model needs: {missing[:6]}")
    params = dict(model.named_parameters())
    for name, (param_name, start, end) in layout.items():
        spec = plan.checkpoint_slice(name)
        tensor = read(name, spec)
        target = params[param_name].data[start:end]
        if name.endswith(VOCAB_TENSORS):
            target.zero_()  # the last vocabulary shard's padding rows stay zero
            target = target[: tensor.shape[0]]
        if tensor.shape != target.shape:
            raise ValueError(f"checkpoint tensor {name} slice {spec} has shape {tuple(tensor.shape)}, "
                             f"the rank's parameter expects {tuple(target.shape)}")
        target.copy_(tensor)


def _cut(tensor: torch.Tensor, spec: tuple[int, int, int] | None) -> torch.Tensor:
    if spec is None:
        return tensor
    dim, start, end = spec
    return tensor.narrow(dim, start, end - start)


def load_tensor_parallel(path_or_preset: str | os.PathLike, rank: int, world_size: int, dtype="auto",
                         device=None) -> LoadedModel:
    """Rank `rank`'s shard of a checkpoint folder or preset, as a `LoadedModel` whose config is the shard's
    (its head counts; the whole vocabulary)."""
    device = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
    name = os.fspath(path_or_preset)
    if name in PRESETS and not os.path.isdir(name):
        whole = load_preset(name, dtype=dtype, device=device)
        plan = ShardPlan(whole.config, rank, world_size)
        model = build_shard(plan, whole.model.model.norm.weight.dtype, device)
        sources = {hf: (param, start, end) for hf, (param, start, end) in whole.model.checkpoint_layout().items()}
        params = dict(whole.model.named_parameters())

        def read(hf_name, spec):
            param, start, end = sources[hf_name]
            return _cut(params[param].data[start:end], spec)

        load_shard(model, plan, set(sources), read)
        return LoadedModel(model, whole.tokenizer, model.config, whole.eos_token_ids, whole.generation_config)
    if not os.path.isdir(name):
        raise FileNotFoundError(f"model {name!r} is neither a checkpoint folder nor a preset "
                                f"(presets: {', '.join(sorted(PRESETS))})")
    config = ModelConfig.from_json(name)
    generation_config = load_generation_config(name)
    stop_ids = eos_token_ids(generation_config.get("eos_token_id")) or config.eos_token_ids
    tokenizer = HFTokenizer(name, bos_token_id=generation_config.get("bos_token_id", config.bos_token_id),
                            eos_token_ids=stop_ids)
    plan = ShardPlan(config, rank, world_size)
    model = build_shard(plan, resolve_dtype(dtype, config, device), device)
    load_shard_from_files(model, plan, checkpoint_files(name))
    return LoadedModel(model, tokenizer, model.config, stop_ids, generation_config)


def load_shard_from_files(model: TensorParallelLlama, plan: ShardPlan, files: list[str]) -> None:
    """Read only the rank's rows / columns of each tensor (safetensors slices), across the shard files."""
    from contextlib import ExitStack

    from safetensors import safe_open

    with ExitStack() as stack:
        handles = [stack.enter_context(safe_open(file, framework="pt")) for file in files]
        where = {key: handle for handle in handles for key in handle.keys()}

        def read(hf_name, spec):
            tensor_slice = where[hf_name].get_slice(hf_name)
            if spec is None:
                return tensor_slice[:]
            dim, start, end = spec
            return tensor_slice[start:end] if dim == 0 else tensor_slice[:, start:end]

        load_shard(model, plan, set(where), read)
