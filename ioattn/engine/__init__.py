"""The serving engine: sequence state, scheduler, model runner, sampling, `LLMEngine` and the `LLM` API.

Data flows one way: `LLM` -> `LLMEngine` -> `Scheduler` -> `ioattn.kv.KVCacheManager` for memory plans, and
`LLMEngine` -> `ModelRunner` -> `ioattn.models` -> `ioattn.ops` to execute them. Names are imported lazily so that
importing one module (e.g. the sampler in a test) does not load the others.
"""

_PUBLIC = {
    "LLMEngine": "ioattn.engine.llm_engine",
    "EngineConfig": "ioattn.engine.config",
    "RequestOutput": "ioattn.engine.sequence",
    "CompletionOutput": "ioattn.engine.sequence",
    "RequestMetrics": "ioattn.engine.sequence",
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
