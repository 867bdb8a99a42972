"""The README's main job: check every kernel path against the float64 reference, then serve a handful of chat
requests with a real model (`smollm2`, SmolLM2-135M-Instruct) through the engine.

On a CPU-only machine the Triton kernels run in Triton's interpreter (small shapes) and the torch backend runs
natively; on CUDA the same checks run compiled, bf16 included. Exit status 1 if any path misses its tolerance
or the engine leaves a KV block in use. (Speed is `ioattn bench ...`'s job: a CPU timing says nothing here.)

The chat part (`chat_demo`) renders each question with a shared system prompt through the model's own chat
template and sends them all at once: continuous batching with chunked prefill, so the first request's system
prompt blocks are in the prefix cache by the time the later ones are admitted. It prints each answer (greedy),
the output throughput, the KV pool's occupancy, prefix-cache hits and preemptions, and checks that every block
is free again at the end; `pool_fraction` < 1 gives the pool too few blocks for the whole batch, to show
preemption.
"""

from __future__ import annotations

import math
import platform
import sys
import time
from dataclasses import dataclass
from typing import Callable

import torch

import ioattn
import ioattn.kernels
from ioattn.reference import TOLERANCE, attention_ref, lse_error, rel_error, sdpa_ref


@dataclass
class Check:
    name: str
    run: Callable[[str, torch.dtype], float]  # returns the relative error against the reference


def _qkv(batch, n_q, n_k, h_q, h_kv, d, dtype, device):
    q = torch.randn(batch, n_q, h_q, d, dtype=dtype, device=device)
    k = torch.randn(batch, n_k, h_kv, d, dtype=dtype, device=device)
    v = torch.randn(batch, n_k, h_kv, d, dtype=dtype, device=device)
    return q, k, v


def _dense(backend: str, **options) -> Callable[[str, torch.dtype], float]:
    def run(device, dtype):
        q, k, v = _qkv(2, 67, 93, 4, 2, 72, dtype, device)
        out, lse = ioattn.flash_attn_func(q, k, v, return_lse=True, backend=backend, **options)
        ref, ref_lse = attention_ref(q, k, v, **options)
        assert lse_error(lse, ref_lse) < 1e-3, "log-sum-exp differs from the reference"
        return rel_error(out, ref)

    return run


def _varlen(backend: str) -> Callable[[str, torch.dtype], float]:
    def run(device, dtype):
        lens_q, lens_k = [5, 0, 40, 17], [9, 3, 40, 60]
        cu_q = torch.tensor([0] + lens_q, device=device).cumsum(0).to(torch.int32)
        cu_k = torch.tensor([0] + lens_k, device=device).cumsum(0).to(torch.int32)
        q = torch.randn(sum(lens_q), 4, 64, dtype=dtype, device=device)
        k = torch.randn(sum(lens_k), 1, 64, dtype=dtype, device=device)
        v = torch.randn(sum(lens_k), 1, 64, dtype=dtype, device=device)
        out = ioattn.flash_attn_varlen_func(
            q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=True, backend=backend
        )
        ref, _ = attention_ref(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, causal=True)
        return rel_error(out, ref)

    return run


def _sdpa_masked(device, dtype):
    q = torch.randn(2, 4, 33, 64, dtype=dtype, device=device)
    k = torch.randn(2, 4, 47, 64, dtype=dtype, device=device)
    v = torch.randn(2, 4, 47, 64, dtype=dtype, device=device)
    mask = torch.rand(2, 1, 33, 47, device=device) > 0.3
    out = ioattn.sdpa(q, k, v, attn_mask=mask)
    ref, _ = sdpa_ref(q, k, v, attn_mask=mask)
    return rel_error(out, ref)


def _backward(backend: str) -> Callable[[str, torch.dtype], float]:
    """dq, dk, dv of a causal GQA call against float64 autograd; the worst of the three relative errors."""
    def run(device, dtype):
        q, k, v = (t.requires_grad_() for t in _qkv(2, 37, 53, 4, 2, 64, dtype, device))
        grad = torch.randn(2, 37, 4, 64, dtype=dtype, device=device)
        ioattn.flash_attn_func(q, k, v, causal=True, backend=backend).backward(grad)
        leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
        ref, _ = attention_ref(*leaves, causal=True, differentiable=True)
        ref.backward(grad.double())
        return max(rel_error(t.grad, leaf.grad) for t, leaf in zip((q, k, v), leaves))

    return run


def _paged(decode: bool) -> Callable[[str, torch.dtype], float]:
    """reshape_and_cache into shuffled blocks of 16, then paged attention (split-KV) against the reference."""
    def run(device, dtype):
        lens, new = [45, 16, 70], ([1, 1, 1] if decode else [9, 16, 30])
        blocks = sum(-(-n // 16) for n in lens)
        k_cache = torch.zeros(blocks, 16, 2, 64, dtype=dtype, device=device)
        v_cache = torch.zeros_like(k_cache)
        order = torch.randperm(blocks, device=device).to(torch.int32)
        table = torch.full((3, 5), -1, dtype=torch.int32, device=device)
        keys, values, used = [], [], 0
        for b, n in enumerate(lens):
            count = -(-n // 16)
            table[b, :count] = order[used:used + count]
            used += count
            k, v = torch.randn(n, 2, 64, dtype=dtype, device=device), torch.randn(n, 2, 64, dtype=dtype, device=device)
            slots = (table[b, torch.arange(n, device=device) // 16].long() * 16 + torch.arange(n, device=device) % 16)
            ioattn.reshape_and_cache(k, v, k_cache, v_cache, slots)
            keys.append(k)
            values.append(v)
        seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
        q = torch.randn(sum(new), 8, 64, dtype=dtype, device=device)
        cu_q = torch.tensor([0] + new, device=device).cumsum(0).to(torch.int32)
        if decode:
            out = ioattn.paged_attention(q, k_cache, v_cache, table, seq_lens, num_splits=3)
        else:
            out = ioattn.paged_attention(q, k_cache, v_cache, table, seq_lens, cu_seqlens_q=cu_q,
                                         max_seqlen_q=max(new), num_splits=2)
        cu_k = torch.tensor([0] + lens, device=device).cumsum(0).to(torch.int32)
        ref, _ = attention_ref(q, torch.cat(keys), torch.cat(values), causal=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
        return rel_error(out, ref)

    return run


def checks() -> list[Check]:
    backends = ["triton", "torch"]
    found = [Check(f"flash_attn_func[{b}] GQA 4:2 D=72 Nq!=Nk", _dense(b)) for b in backends]
    found += [Check(f"flash_attn_func[{b}] causal bottom-right", _dense(b, causal=True)) for b in backends]
    found += [Check(f"flash_attn_func[{b}] window (16, 0)", _dense(b, window_size=(16, 0))) for b in backends]
    found += [Check(f"flash_attn_varlen_func[{b}] causal, empty seq", _varlen(b)) for b in backends]
    found.append(Check("sdpa dense bool mask", _sdpa_masked))
    found += [Check(f"backward (dq, dk, dv)[{b}] causal GQA", _backward(b)) for b in backends]
    found.append(Check("paged decode, split-KV, blocks of 16", _paged(decode=True)))
    found.append(Check("paged chunked prefill over cached context", _paged(decode=False)))
    return found


def _describe_machine(device: str) -> str:
    where = torch.cuda.get_device_name() if device == "cuda" else f"CPU ({platform.processor() or platform.machine()})"
    mode = "Triton interpreter" if ioattn.kernels.interpreted() else "Triton compiled"
    import triton

    return f"{where}; torch {torch.__version__}, triton {triton.__version__}, {mode}"


def main(model: str = "smollm2") -> int:
    from ioattn.models.loader import load_model

    device = "cuda" if torch.cuda.is_available() else "cpu"
    # The model first: a missing one is reported at once, not after the checks.
    start = time.perf_counter()
    try:
        loaded = load_model(model, device=device)
    except (ValueError, OSError) as error:
        print(f"ioattn demo: error: {error}", file=sys.stderr)
        return 2
    load_s = time.perf_counter() - start
    dtypes = [torch.float32, torch.float16] + ([torch.bfloat16] if device == "cuda" else [])
    print(f"ioattn {ioattn.__version__} exactness check on {_describe_machine(device)}", flush=True)
    print(f"{'path':52s} {'dtype':9s} {'rel err':>9s} {'tol':>7s}  ok", flush=True)
    failures = 0
    for check in checks():
        for dtype in dtypes:
            start = time.perf_counter()
            try:
                err = check.run(device, dtype)
                ok = err < TOLERANCE[dtype]
                line = f"{err:9.2e} {TOLERANCE[dtype]:7.0e}  {'yes' if ok else 'NO'}"
            except Exception as exc:  # a failing path is reported, then the demo exits non-zero
                ok, line = False, f"error: {type(exc).__name__}: {exc}"
            failures += not ok
            took = time.perf_counter() - start
            print(f"{check.name:52s} {str(dtype)[6:]:9s} {line}  ({took:.1f}s)", flush=True)
    if failures:
        print(f"{failures} path(s) failed their tolerance", flush=True)
        return 1
    print("every path matches the float64 reference\n", flush=True)
    print(f"loaded {model} in {load_s:.1f} s", flush=True)
    report = chat_demo(loaded, name=model, out=lambda line: print(line, flush=True))
    return 0 if report["blocks_used_after"] == 0 else 1


# -- the serving engine on a real model ------------------------------------------------------------------------

SYSTEM_PROMPT = (
    "You are a helpful assistant for a school quiz. Answer every question in one short, plain sentence. "
    "Give the fact that was asked for first, without any introduction, and do not add details that were not "
    "asked for. If a number is asked for, write it with digits. Never ask a question back."
)
QUESTIONS = (
    "What is the capital of France?",
    "How many legs does a spider have?",
    "What is the largest ocean on Earth?",
    "Who wrote Romeo and Juliet?",
    "What is the boiling point of water in degrees Celsius?",
    "Which planet is known as the Red Planet?",
    "How many days are there in a week?",
    "What gas do plants take in from the air?",
)


def chat_demo(
    model="smollm2",
    questions: tuple[str, ...] = QUESTIONS,
    system_prompt: str = SYSTEM_PROMPT,
    max_tokens: int = 48,
    max_num_batched_tokens: int = 128,
    pool_fraction: float = 1.0,
    device: str | None = None,
    out: Callable[[str], None] = print,
    progress: bool = True,
    name: str | None = None,
) -> dict:
    """Serve one chat request per question (system prompt shared) on `model` (a name `load_model` takes, or a
    `LoadedModel`, shown as `name`); report through `out`, and as the returned dict, each answer, output tokens/s,
    KV occupancy, prefix hits and preemptions.

    The pool gets `pool_fraction` of the blocks the whole batch would hold if every request ran at once (the
    system prompt's full blocks counted once); below 1, continuous batching must preempt. Prompts longer than
    `max_num_batched_tokens` are prefilled in chunks.
    """
    from tqdm.auto import tqdm

    from ioattn.engine import EngineConfig, LLMEngine, SamplingParams
    from ioattn.models.loader import LoadedModel, load_model
    from ioattn.server.chat_template import ChatTemplate

    loaded = model if isinstance(model, LoadedModel) else load_model(model, device=device)
    chat = ChatTemplate.for_model(loaded)
    tokenizer = loaded.tokenizer
    prompts = [chat.token_ids(tokenizer, [{"role": "system", "content": system_prompt},
                                          {"role": "user", "content": question}]) for question in questions]
    shared = _common_prefix_len(prompts)
    block_size = 16
    longest = max(len(p) for p in prompts) + max_tokens
    blocks_per_request = math.ceil(longest / block_size)
    batch_need = shared // block_size + len(prompts) * (blocks_per_request - shared // block_size)
    # The watermark (1% of the pool) is kept free at admission; one whole request must still fit besides it.
    num_blocks = max(math.ceil(pool_fraction * batch_need), blocks_per_request + 2)
    config = EngineConfig(block_size=block_size, num_blocks=num_blocks, max_model_len=longest,
                          max_num_seqs=len(prompts), max_num_batched_tokens=max_num_batched_tokens,
                          enable_chunked_prefill=True, enable_prefix_caching=True, preemption_mode="recompute")
    engine = LLMEngine(loaded, config)
    where = str(engine.runner.device)
    name = name or (model if isinstance(model, str) else "the model")
    dtype = str(loaded.model.model.embed_tokens.weight.dtype).removeprefix("torch.")
    out(f"ioattn chat demo: {name} ({loaded.config.num_layers} layers, hidden {loaded.config.hidden_size}, "
        f"{dtype}) on {where}\n"
        f"  {len(prompts)} chat requests sharing a {shared}-token system prompt, greedy, up to {max_tokens} tokens "
        f"each, all sent at once\n"
        f"  continuous batching, chunked prefill at {max_num_batched_tokens} tokens per step, prefix caching on; "
        f"KV pool {num_blocks} blocks x {block_size} tokens ({pool_fraction:.0%} of the {batch_need} blocks the "
        f"batch would hold at once)")

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    for i, ids in enumerate(prompts):
        engine.add_request(f"chat-{i}", prompt_token_ids=ids, params=params)
    occupancy, slot_use, finished = [], [], {}
    start = time.perf_counter()
    with tqdm(total=len(prompts), desc="chat requests", unit="req", disable=not progress, leave=False) as bar:
        while engine.has_unfinished_requests():
            for output in engine.step():
                if output.finished:
                    finished[output.request_id] = output
                    bar.update(1)
            kv = engine.kv.stats()
            occupancy.append(kv.blocks_used / kv.num_blocks)
            if kv.slots_allocated:
                slot_use.append(kv.utilization)
    elapsed = time.perf_counter() - start

    stats = engine.stats()
    kv = stats["kv"]
    answers = [finished[f"chat-{i}"].outputs[0] for i in range(len(prompts))]
    output_tokens = sum(len(a.token_ids) for a in answers)
    report = {
        "device": where,
        "requests": len(finished),
        "answers": [a.text for a in answers],
        "output_tokens": output_tokens,
        "prompt_tokens": sum(len(p) for p in prompts),
        "elapsed_s": elapsed,
        "output_tokens_per_s": output_tokens / elapsed,
        "steps": stats["steps"],
        "num_blocks": num_blocks,
        "peak_pool_occupancy": max(occupancy),
        "mean_pool_occupancy": sum(occupancy) / len(occupancy),
        "mean_slot_utilization": sum(slot_use) / len(slot_use) if slot_use else 1.0,
        "prefix_query_tokens": kv.prefix_query_tokens,
        "prefix_hit_tokens": kv.prefix_hit_tokens,
        "prefix_hit_rate": kv.prefix_hit_tokens / max(kv.prefix_query_tokens, 1),
        "preemptions": stats["preemptions"],
        "blocks_used_after": kv.blocks_used,
    }
    for question, answer in zip(questions, answers):
        out(f"  Q: {question}\n  A: {_one_line(answer.text)}")
    out(f"  {len(finished)} requests, {report['prompt_tokens']} prompt + {output_tokens} output tokens in "
        f"{elapsed:.1f} s over {report['steps']} steps: {report['output_tokens_per_s']:.1f} output tok/s")
    out(f"  KV pool occupancy: peak {report['peak_pool_occupancy']:.0%}, mean {report['mean_pool_occupancy']:.0%} "
        f"of blocks; slot utilization in used blocks {report['mean_slot_utilization']:.1%} (mean over steps)")
    out(f"  prefix cache: {kv.prefix_hit_tokens} of {kv.prefix_query_tokens} prompt tokens hit "
        f"({report['prefix_hit_rate']:.0%}); preemptions: {report['preemptions']}; blocks still used after the "
        f"run: {kv.blocks_used}")
    return report


def _common_prefix_len(prompts: list[list[int]]) -> int:
    shortest = min(len(p) for p in prompts)
    return next((i for i in range(shortest) if any(p[i] != prompts[0][i] for p in prompts)), shortest)


def _one_line(text: str) -> str:
    """An answer on one line, control characters escaped (a model's bytes must not drive the terminal)."""
    text = " ".join(text.split())
    return "".join(ch if ch.isprintable() else ch.encode("unicode_escape").decode() for ch in text)


if __name__ == "__main__":
    sys.exit(main())
