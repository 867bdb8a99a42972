"""The README's main job: check every kernel path against the float64 reference, a quick benchmark, then the
serving engine on the `tiny` model.

On a CPU-only machine the Triton kernels run in Triton's interpreter (small shapes) and the torch backend runs
natively; on CUDA the same checks run compiled, bf16 included. Exit status 1 if any path misses its tolerance
or the engine leaves a KV block in use.

The engine demo (`engine_demo`) sends a batch of prompts sharing a long system prompt through continuous
batching with chunked prefill, into a KV pool deliberately too small for the whole batch: it shows prefix-cache
hits on the shared blocks, preemptions (by recompute) and the pool's utilization, and that every block is free
again at the end.
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


def main() -> int:
    device = "cuda" if torch.cuda.is_available() else "cpu"
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
    from ioattn.bench.prefill import main as bench_prefill

    bench_status = bench_prefill(["--quick"]) or 0
    print(flush=True)
    report = engine_demo(device=device, out=lambda line: print(line, flush=True))
    return bench_status or (0 if report["blocks_used_after"] == 0 else 1)


# -- the serving engine ----------------------------------------------------------------------------------------

SYSTEM_SENTENCES = (
    "You are the support assistant of a small observatory. ",
    "Answer in one or two sentences, plainly and exactly. ",
    "When a question needs a number, give the number first and its unit after it. ",
    "If you do not know the answer, say so rather than guess. ",
    "Never invent opening hours, prices or the names of staff. ",
)
QUESTIONS = (
    "When is the next full moon?", "Can children visit the dome?", "How large is the main telescope?",
    "Is there parking nearby?", "Do you run night tours in winter?", "What should I wear on the roof?",
    "Can I bring my own camera?", "How far away is Saturn tonight?", "Is the site wheelchair accessible?",
    "What is a light year?", "Why do stars twinkle?", "How cold does the dome get?",
)


def _system_prompt(tokenizer, min_tokens: int) -> str:
    """The shared system prompt: whole sentences, repeated until it is at least `min_tokens` long."""
    text, i = "", 0
    while len(tokenizer.encode(text)) < min_tokens:
        text += SYSTEM_SENTENCES[i % len(SYSTEM_SENTENCES)]
        i += 1
    return text


def engine_demo(
    num_prompts: int = 24,
    system_prompt_tokens: int = 224,
    max_tokens: int = 64,
    pool_fraction: float = 0.4,
    max_num_batched_tokens: int = 256,
    device: str | None = None,
    out: Callable[[str], None] = print,
) -> dict:
    """Run the batch on `tiny` and report (through `out`, and as the returned dict) output tokens/s, KV
    utilization, prefix hits, preemptions and one sample completion.

    The pool gets `pool_fraction` of the blocks the whole batch would hold if every request ran at once (the
    system prompt's full blocks counted once), so continuous batching must preempt; prompts longer than
    `max_num_batched_tokens` are prefilled in chunks.
    """
    from ioattn.engine import EngineConfig, LLMEngine, SamplingParams
    from ioattn.models.loader import load_model

    loaded = load_model("tiny", device=device)
    system = _system_prompt(loaded.tokenizer, system_prompt_tokens)
    prompts = [f"{system}Question {i + 1}: {QUESTIONS[i % len(QUESTIONS)]}" for i in range(num_prompts)]
    longest = max(len(loaded.tokenizer.encode(p)) for p in prompts) + max_tokens
    block_size = 16
    blocks_per_request = math.ceil(longest / block_size)
    shared_blocks = len(loaded.tokenizer.encode(system)) // block_size
    batch_need = shared_blocks + num_prompts * (blocks_per_request - shared_blocks)
    # The watermark (1% of the pool) is kept free at admission; one whole request must still fit besides it.
    num_blocks = max(math.ceil(pool_fraction * batch_need), blocks_per_request + 2)
    config = EngineConfig(block_size=block_size, num_blocks=num_blocks, max_model_len=longest,
                          max_num_seqs=num_prompts, max_num_batched_tokens=max_num_batched_tokens,
                          enable_chunked_prefill=True, enable_prefix_caching=True, preemption_mode="recompute")
    engine = LLMEngine(loaded, config)
    where = str(engine.runner.device)
    out(f"ioattn engine demo on {where}: {num_prompts} requests on `tiny` (random weights), a shared "
        f"{len(loaded.tokenizer.encode(system))}-token system prompt, {max_tokens} output tokens each\n"
        f"  KV pool {num_blocks} blocks x {block_size} tokens ({pool_fraction:.0%} of the {batch_need} blocks the "
        f"whole batch would hold at once, system prompt shared); chunked prefill at "
        f"{max_num_batched_tokens} tokens per step; prefix caching on; preemption by recompute")

    # One short request first, outside the timing, so that kernel compilation on CUDA is not counted as serving.
    engine.add_request("warm-up", "warm-up", SamplingParams(max_tokens=2))
    for _ in engine.stream():
        pass
    before = engine.stats()

    for i, prompt in enumerate(prompts):
        params = SamplingParams(temperature=0.8, top_p=0.95, seed=i, max_tokens=max_tokens, ignore_eos=True)
        engine.add_request(f"demo-{i}", prompt, params)
    occupancy, slot_use, finished = [], [], {}
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output
        kv = engine.kv.stats()
        occupancy.append(kv.blocks_used / kv.num_blocks)
        if kv.slots_allocated:
            slot_use.append(kv.utilization)
    elapsed = time.perf_counter() - start

    stats = engine.stats()
    kv = stats["kv"]
    # Counters since the warm-up.
    prefix_query_tokens = kv.prefix_query_tokens - before["kv"].prefix_query_tokens
    prefix_hit_tokens = kv.prefix_hit_tokens - before["kv"].prefix_hit_tokens
    output_tokens = sum(len(c.token_ids) for o in finished.values() for c in o.outputs)
    report = {
        "device": where,
        "requests": len(finished),
        "output_tokens": output_tokens,
        "elapsed_s": elapsed,
        "output_tokens_per_s": output_tokens / elapsed,
        "steps": stats["steps"] - before["steps"],
        "num_blocks": num_blocks,
        "peak_pool_occupancy": max(occupancy),
        "mean_pool_occupancy": sum(occupancy) / len(occupancy),
        "mean_slot_utilization": sum(slot_use) / len(slot_use) if slot_use else 1.0,
        "prefix_query_tokens": prefix_query_tokens,
        "prefix_hit_tokens": prefix_hit_tokens,
        "prefix_hit_rate": prefix_hit_tokens / prefix_query_tokens,
        "resume_hit_tokens": kv.resume_hit_tokens - before["kv"].resume_hit_tokens,
        "preemptions": stats["preemptions"] - before["preemptions"],
        "blocks_used_after": kv.blocks_used,
        "sample": finished["demo-0"].outputs[0].text,
    }
    out(f"  {report['requests']} requests, {output_tokens} output tokens in {elapsed:.1f} s over "
        f"{report['steps']} steps: {report['output_tokens_per_s']:.1f} output tok/s")
    out(f"  KV pool occupancy: peak {report['peak_pool_occupancy']:.0%}, mean {report['mean_pool_occupancy']:.0%} "
        f"of blocks; slot utilization in used blocks {report['mean_slot_utilization']:.1%} (mean over steps)")
    out(f"  prefix cache: {prefix_hit_tokens} of {prefix_query_tokens} prompt tokens hit "
        f"({report['prefix_hit_rate']:.0%}); preempted requests found {report['resume_hit_tokens']} tokens cached "
        "on resume")
    out(f"  preemptions: {report['preemptions']}; blocks still used after the run: {kv.blocks_used}")
    out(f"  sample completion of request 0 (tiny's weights are random, so it is noise): {report['sample'][:80]!r}")
    return report


if __name__ == "__main__":
    sys.exit(main())
