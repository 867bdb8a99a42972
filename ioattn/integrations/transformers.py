"""Hugging Face transformers integration: `attn_implementation="ioattn"`.

    import ioattn.integrations.transformers
    ioattn.integrations.transformers.register()
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="ioattn")

Every attention layer of a model that goes through transformers' attention interface (Llama, Mistral, Qwen,
BERT, ... — most models in transformers 5) then calls `ioattn.sdpa`.

Which mask the attention function receives, and why: `register()` gives "ioattn" transformers' own
`sdpa_mask` as its mask builder, so each layer receives either
  - None, when the pattern is plain causal (no padding, or padding only past the query in a static cache at
    prefill) or plain bidirectional without padding: the kernel then runs with `is_causal` (top-left, as
    PyTorch) or no mask at all, skips every invisible tile and reads no mask bytes; or
  - a boolean (B, 1, Nq, Nk) mask, True = attend (padding, decoding with left padding, chunked prefill, sliding
    windows ...), broadcast over heads with stride 0: one byte per score streamed through the kernel, where
    eager's additive float mask would cost four.
A boolean mask is also exact: a masked key is excluded from the softmax rather than given `finfo.min`, so a
query that sees no key at all (the padding rows of a left-padded batch) returns 0 instead of an average over
padding. Those rows are padding, never read by real tokens, so outputs at real tokens are unchanged.
Without a registered mask builder, transformers would hand the layers no mask at all and padding would be
attended silently.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import create_position_bias_mask
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from ioattn.ops.attention import sdpa

NAME = "ioattn"


def register() -> None:
    """Make `attn_implementation="ioattn"` available to every transformers model (idempotent)."""
    AttentionInterface.register(NAME, ioattn_attention_forward)
    AttentionMaskInterface.register(NAME, sdpa_mask)


def ioattn_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    position_bias: torch.Tensor | None = None,
    softcap: float | None = None,
    s_aux: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature over `ioattn.sdpa`.

    query (B, Hq, Nq, D), key/value (B, Hkv, Nk, D) with Hq a multiple of Hkv (GQA runs natively, K/V are
    never repeated); attention_mask None or broadcastable to (B, Hq, Nq, Nk), bool or additive; scaling defaults
    to 1/sqrt(D). Returns (output (B, Nq, Hq, D) contiguous, None): attention weights are never materialised.
    Other keyword arguments (sliding_window, position_ids, ...) are already folded into the mask by `sdpa_mask`.
    """
    if dropout > 0.0:
        raise ValueError(
            f"dropout must be 0.0 for attn_implementation='ioattn' (ioattn has no attention dropout), got {dropout}; "
            "set the model's attention dropout probability to 0 to train, or call model.eval()"
        )
    if softcap is not None:
        raise ValueError(
            f"softcap must be None for attn_implementation='ioattn' (no logit soft-capping), got {softcap}"
        )
    if s_aux is not None:
        raise ValueError("s_aux must be None for attn_implementation='ioattn' (no learned attention-sink logits)")
    if kwargs.get("output_attentions", False):
        raise ValueError(
            "output_attentions must be False for attn_implementation='ioattn': the attention weights are never "
            "materialised; use attn_implementation='eager' to inspect them"
        )

    is_causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    # transformers leaves the mask out only when it is exactly causal (or exactly full); a single query token
    # sees every cached key, where top-left causal would show it only the first.
    is_causal = bool(is_causal) and attention_mask is None and query.shape[2] > 1
    if position_bias is not None:
        attention_mask = create_position_bias_mask(position_bias, attention_mask, is_causal, query, key)
        is_causal = False

    out = sdpa(
        query, key, value,
        attn_mask=attention_mask,
        is_causal=is_causal,
        scale=scaling,
        enable_gqa=key.shape[1] != query.shape[1],
    )
    return out.transpose(1, 2).contiguous(), None
