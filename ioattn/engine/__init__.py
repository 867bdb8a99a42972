"""The serving engine: sequence and request state, scheduler, the attention seam, model runner, sampling, `LLMEngine`.

Data flows one way: `LLMEngine` -> `Scheduler` -> `ioattn.kv.KVCacheManager` for memory plans, and
`LLMEngine` -> `ModelRunner` -> `ioattn.models` (whose layers call the `PagedAttention` seam) -> `ioattn.ops` to
execute them; `EngineConfig` is resolved once into `EngineSettings` (`ioattn.engine.config`). `ioattn.LLM` sits
above the engine and `ioattn.distributed`. Names are imported lazily so that
importing one module (e.g. the sampler in a test) does not load the others.
"""

_PUBLIC = {
    "LLMEngine": "ioattn.engine.llm_engine",
    "EngineConfig": "ioattn.engine.config",
    "RequestOutput": "ioattn.engine.outputs",
    "CompletionOutput": "ioattn.engine.outputs",
    "RequestMetrics": "ioattn.engine.outputs",
    "SamplingParams": "ioattn.engine.sampling",
    "BeamSearchParams": "ioattn.engine.sampling",
    "Scheduler": "ioattn.engine.scheduler",
    "SchedulerConfig": "ioattn.engine.scheduler",
    "ModelRunner": "ioattn.engine.runner",
}

__all__ = sorted(_PUBLIC)


def __getattr__(name):
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'ioattn.engine' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
