"""ioattn: hardware-aware attention — exact IO-aware kernels, a paged KV-cache manager and a serving engine.

The public API is imported lazily so that `import ioattn.kv` (pure Python) never pulls in torch.
"""

__version__ = "0.1.0"

_PUBLIC = {
    "flash_attn_func": "ioattn.ops.attention",
    "flash_attn_varlen_func": "ioattn.ops.attention",
    "flash_attn_fp8_func": "ioattn.ops.fp8_attention",
    "sdpa": "ioattn.ops.attention",
    "explain": "ioattn.ops.explain",
    "paged_attention": "ioattn.ops.paged",
    "reshape_and_cache": "ioattn.ops.cache",
    "merge_states": "ioattn.ops.paged",
    "mla_paged_attention": "ioattn.ops.mla",
    "mla_workspace": "ioattn.ops.mla",
    "copy_blocks": "ioattn.ops.cache",
    "swap_blocks": "ioattn.ops.cache",
    "LLM": "ioattn.llm",
    "LLMEngine": "ioattn.engine.llm_engine",
    "SamplingParams": "ioattn.engine.sampling",
    "BeamSearchParams": "ioattn.engine.sampling",
}

__all__ = sorted(_PUBLIC)


def __getattr__(name):
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'ioattn' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
