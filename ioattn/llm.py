"""`ioattn.LLM`: offline batched generation over `LLMEngine` (vLLM's `LLM(model=...).generate(...)`).

    llm = LLM("tiny")                      # or a local Hugging Face checkpoint folder
    outputs = llm.generate(["Hello", "The sky"], SamplingParams(temperature=0, max_tokens=32))
    outputs[0].outputs[0].text

Every prompt goes into the engine at once and continuous batching runs them to completion; outputs come back
in input order. A prompt the engine refuses (empty, too long, one UTF-8 cannot encode, an unknown token id, or
sampling values the model cannot serve) does not stop the others: its `RequestOutput` is finished with no
completions and `error` saying why. Arguments that are not prompts or parameters at all raise ValueError.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
from collections.abc import Sequence as Seq

import torch

from ioattn.distributed.worker import TensorParallelEngine
from ioattn.engine.config import EngineConfig
from ioattn.engine.kv_scales import KVScales
from ioattn.engine.llm_engine import LLMEngine
from ioattn.engine.sampling import BeamSearchParams, SamplingParams
from ioattn.engine.outputs import RequestMetrics, RequestOutput
from ioattn.models.loader import LoadedModel


class LLM:
    def __init__(
        self,
        model: str | os.PathLike | LoadedModel = "tiny",
        *,
        dtype: str | torch.dtype = "auto",
        max_model_len: int | None = None,
        block_size: int = 16,
        num_blocks: int | None = None,
        gpu_memory_utilization: float = 0.9,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int | None = None,
        enable_prefix_caching: bool = True,
        preemption_mode: str = "recompute",
        device: str | torch.device | None = None,
        tensor_parallel_size: int = 1,
        async_scheduling: bool | None = None,
        kv_cache_dtype: str = "auto",
        kv_cache_scales: str | float | KVScales | None = None,
        **engine_kwargs,
    ):
        """engine_kwargs: the other `EngineConfig` fields (enable_chunked_prefill, scheduling, policy,
        swap_space, watermark, enforce_eager). tensor_parallel_size > 1 runs the model on that many processes
        (one GPU each on CUDA; `model` must then be a checkpoint folder or preset name); `shutdown()` stops them.
        async_scheduling: schedule and prepare step t+1 while the device runs step t (the same outputs; see
        `ioattn.engine.llm_engine`); None: on, except with tensor parallelism (where True raises ValueError).
        kv_cache_dtype: "auto" (the model's dtype), "fp8_e4m3" or "fp8_e5m2" (one byte per cached element: the
        pool holds twice the tokens of a 16-bit cache); kv_cache_scales: for fp8, None (the checkpoint's, else
        calibrated at start-up, with K and V stored rotated), "checkpoint", "calibrate", a number, a JSON file or
        resolved `KVScales` (`ioattn.engine.kv_scales`)."""
        config = EngineConfig(
            dtype=dtype, max_model_len=max_model_len, block_size=block_size, num_blocks=num_blocks,
            gpu_memory_utilization=gpu_memory_utilization, max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens, enable_prefix_caching=enable_prefix_caching,
            preemption_mode=preemption_mode, device=device, async_scheduling=async_scheduling,
            kv_cache_dtype=kv_cache_dtype, kv_cache_scales=kv_cache_scales, **engine_kwargs,
        )
        if tensor_parallel_size == 1:
            self.engine = LLMEngine(model, config)
        else:
            self.engine = TensorParallelEngine(model, config, tensor_parallel_size=tensor_parallel_size)
        self.tokenizer = self.engine.tokenizer
        self._request_counter = itertools.count()

    def shutdown(self) -> None:
        """Stop the engine's worker processes, if it has any (they are also stopped at interpreter exit)."""
        shutdown = getattr(self.engine, "shutdown", None)
        if shutdown is not None:
            shutdown()

    def generate(
        self,
        prompts: str | Seq[str] | None = None,
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        prompt_token_ids: Seq[int] | Seq[Seq[int]] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate for every prompt (strings, or token id lists); one `RequestOutput` each, in input order."""
        inputs = _inputs(prompts, prompt_token_ids)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(inputs)
        elif not isinstance(sampling_params, (list, tuple)):
            raise ValueError(f"sampling_params must be a SamplingParams or a list of them (beam search: "
                             f"LLM.beam_search), got {type(sampling_params).__name__}")
        else:
            params = list(sampling_params)
            if len(params) != len(inputs):
                raise ValueError(f"sampling_params has {len(params)} entries for {len(inputs)} prompts")
        return self._run(inputs, params, use_tqdm)

    def beam_search(
        self,
        prompts: str | Seq[str] | None = None,
        params: BeamSearchParams | None = None,
        prompt_token_ids: Seq[int] | Seq[Seq[int]] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Beam search for every prompt (vLLM's `LLM.beam_search`, transformers' algorithm): each output holds
        the `params.n` best beams, best first, `cumulative_logprob` being the length-penalised score."""
        if not isinstance(params, BeamSearchParams):
            raise ValueError(f"params must be a BeamSearchParams, got {type(params).__name__}")
        inputs = _inputs(prompts, prompt_token_ids)
        return self._run(inputs, [params] * len(inputs), use_tqdm)

    def _run(self, inputs: list[dict], params: list, use_tqdm: bool) -> list[RequestOutput]:
        engine = self.engine
        final_only: dict[int, SamplingParams | BeamSearchParams] = {}
        results: dict[str, RequestOutput] = {}
        order = [f"llm-{next(self._request_counter)}" for _ in inputs]
        pending = set(order)
        for request_id, request_input, request_params in zip(order, inputs, params):
            try:
                if isinstance(request_params, (SamplingParams, BeamSearchParams)):
                    # Only finished outputs are returned: the engine need not build the others (as in vLLM).
                    if id(request_params) not in final_only:
                        final_only[id(request_params)] = dataclasses.replace(request_params, output_kind="final_only")
                    request_params = final_only[id(request_params)]
                engine.add_request(request_id, params=request_params, **request_input)
            except ValueError as error:
                ids = request_input.get("prompt_token_ids")
                pending.discard(request_id)
                results[request_id] = RequestOutput(
                    request_id, request_input.get("prompt"), list(ids) if isinstance(ids, (list, tuple)) else [], [],
                    finished=True, metrics=RequestMetrics(arrival_time=0.0), error=str(error),
                )
        from tqdm.auto import tqdm

        with tqdm(total=len(pending), desc="generate", unit="req", disable=not use_tqdm) as bar:
            while engine.has_unfinished_requests():
                for output in engine.step():
                    if output.finished and output.request_id in pending:
                        results[output.request_id] = output
                        bar.update(1)
        return [results[request_id] for request_id in order]


def _inputs(prompts, prompt_token_ids) -> list[dict]:
    """add_request keyword arguments for each prompt: one string or a list, one id list or a list of them."""
    if (prompts is None) == (prompt_token_ids is None):
        raise ValueError("give exactly one of prompts and prompt_token_ids")
    if prompts is not None:
        if not isinstance(prompts, (str, list, tuple)):
            raise ValueError(f"prompts must be a string or a list of strings, got {type(prompts).__name__}")
        return [dict(prompt=p) for p in ([prompts] if isinstance(prompts, str) else prompts)]
    if not isinstance(prompt_token_ids, (list, tuple)):
        raise ValueError(f"prompt_token_ids must be a list of ints or a list of such lists, "
                         f"got {type(prompt_token_ids).__name__}")
    single = len(prompt_token_ids) > 0 and isinstance(prompt_token_ids[0], int)
    return [dict(prompt_token_ids=ids) for ids in ([prompt_token_ids] if single else prompt_token_ids)]
