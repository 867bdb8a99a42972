"""`ioattn bench kv`: the paged KV-cache manager against contiguous reservation, on simulated serving (CPU).

Three measurements, all pure Python, no GPU:

1. **KV utilization and resident requests.** Continuous batching at one memory budget (`--num-blocks` x
   `--block-size` token slots), FCFS admission, one decode token per running request per step. Policies:
   - `paged`: `KVCacheManager` (blocks on demand, watermark 1%, preemption by recompute of the newest request
     when a decode step finds no block);
   - `contiguous-max`: one contiguous slab of max-len slots per request (pre-vLLM systems, vLLM paper's
     "Orca (Max)"), run once per max-len of `--max-lens`;
   - `contiguous-pow2`: a slab of the next power of two >= the request's true final length ("Orca (Pow2)":
     at most 2x over-reservation, and it assumes the output length is known);
   - `contiguous-oracle`: a slab of exactly the final length ("Orca (Oracle)", unattainable: an upper bound).
   Slabs are placed first-fit in one address space, so external fragmentation is real, not assumed away.
   Reported over the *saturated* steps (requests waiting after admission): utilization = tokens stored /
   slots allocated (ratio of sums over steps), occupancy = tokens stored / budget, resident = mean running.
   Per workload and max-len, each policy's resident requests over contiguous-max's, next to the arithmetic
   bound max-len / (mean tokens a resident request holds, measured on the paged run): even with zero waste,
   an allocator holds budget / mean resident tokens requests and contiguous-max holds budget / max-len, so
   paged's ratio is its occupancy times this bound.
2. **Shared system prompt** (agentic use): a few preambles of 1k-4k tokens, each request one preamble plus
   its own message; prefix-cache hit rate, prefill tokens saved against the ideal (every full preamble block
   hit after its first request), and resident requests with and without prefix caching.
3. **Manager throughput**: block operations (take / share / release on a pool) per second, on a bulk
   workload (long prompts with a cached prefix, fork, free; hashing included), plus decode `append` calls
   per second; and, per paged simulation row, the milliseconds per engine step the manager and the
   simulator loop take together (`ms/step`: allocate, one append per running request, stats, frees).

Workloads. `sharegpt`: log-normal prompt and output lengths with the means the vLLM paper reports for
ShareGPT (Kwon et al., SOSP 2023, Fig. 11: 161.31 input and 337.99 output tokens on average); the paper
gives histograms, not parameters, so sigma (1.0 prompt, 0.8 output) is our assumption for a long right tail;
mu = ln(mean) - sigma^2 / 2 keeps the mean. `uniform`: prompt and output lengths uniform in [100, 1024]. Both
are clipped to prompt + output <= the smallest of `--max-lens` (default 2048, the vLLM paper's OPT setting;
4096 is Llama-2's context, 8192 Llama-3-8B's, the model of the serving benchmark), so every max-len serves
the same requests and only contiguous-max's slab changes. The realised means are reported. Paging's
utilization does not depend on the spread; max-length reservation's waste depends on the mean length against
max-len, which is why the resident-request ratio differs between the workloads and grows with max-len.
`contiguous-pow2` and `contiguous-oracle` size their slabs on the true final length (at most the smallest
max-len), so they do not depend on max-len: they run once per workload.
"""

from __future__ import annotations

import argparse
import bisect
import json
import math
import os
import random
import sys
import time
from collections import deque
from dataclasses import dataclass, field

from ioattn.kv import KVCacheManager

SHAREGPT_MEAN_PROMPT, SHAREGPT_MEAN_OUTPUT = 161.31, 337.99
SHAREGPT_SIGMA_PROMPT, SHAREGPT_SIGMA_OUTPUT = 1.0, 0.8
BARS = {"utilization": 0.96, "resident_vs_max": 3.0, "block_ops_per_s": 200_000}
# The vLLM paper's OPT setting, Llama-2's context, Llama-3-8B's (the serving benchmark's model).
DEFAULT_MAX_LENS = (2048, 4096, 8192)


@dataclass
class Request:
    rid: int
    prompt: list[int]
    output_len: int
    generated: list[int] = field(default_factory=list)
    preempted: bool = False

    @property
    def final_len(self) -> int:
        return len(self.prompt) + self.output_len


def _lognormal(rng: random.Random, mean: float, sigma: float) -> int:
    return max(1, round(rng.lognormvariate(math.log(mean) - sigma**2 / 2, sigma)))


def make_workload(kind: str, n: int, max_len: int, rng: random.Random) -> list[Request]:
    """Requests with distinct random token ids (no accidental sharing)."""
    requests = []
    for rid in range(n):
        if kind == "sharegpt":
            prompt_len = _lognormal(rng, SHAREGPT_MEAN_PROMPT, SHAREGPT_SIGMA_PROMPT)
            output_len = _lognormal(rng, SHAREGPT_MEAN_OUTPUT, SHAREGPT_SIGMA_OUTPUT)
        elif kind == "uniform":
            prompt_len, output_len = rng.randint(100, 1024), rng.randint(100, 1024)
        else:
            raise ValueError(f"workload must be 'sharegpt' or 'uniform', got {kind!r}")
        prompt_len = min(prompt_len, max_len - 1)
        output_len = min(output_len, max_len - prompt_len)
        requests.append(Request(rid, [rng.randrange(32000) for _ in range(prompt_len)], output_len))
    return requests


def make_shared_prefix_workload(
    n: int, num_preambles: int, max_len: int, rng: random.Random
) -> tuple[list[Request], list[int]]:
    """Each request: one of `num_preambles` preambles (1k-4k tokens) + its own ShareGPT-like message.

    Also returns, per request, how many of its prompt tokens an ideal prefix cache could skip: the full
    preamble blocks before its last token, for every request after the first one of its preamble.
    """
    preambles = [[rng.randrange(32000) for _ in range(rng.randint(1024, 4096))] for _ in range(num_preambles)]
    requests, ideal_hits, seen = [], [], set()
    for rid in range(n):
        which = rng.randrange(num_preambles)
        message = [rng.randrange(32000) for _ in range(_lognormal(rng, SHAREGPT_MEAN_PROMPT, SHAREGPT_SIGMA_PROMPT))]
        prompt = (preambles[which] + message)[: max_len - 1]
        output_len = min(_lognormal(rng, SHAREGPT_MEAN_OUTPUT, SHAREGPT_SIGMA_OUTPUT), max_len - len(prompt))
        requests.append(Request(rid, prompt, output_len))
        ideal_hits.append(min(len(preambles[which]), len(prompt) - 1) if which in seen else 0)
        seen.add(which)
    return requests, ideal_hits


@dataclass
class Tally:
    """Sums over saturated steps."""

    steps: int = 0
    tokens: int = 0
    allocated: int = 0
    running: int = 0

    def add(self, tokens: int, allocated: int, running: int) -> None:
        self.steps += 1
        self.tokens += tokens
        self.allocated += allocated
        self.running += running

    def summary(self, budget: int) -> dict:
        steps = max(self.steps, 1)
        return {
            "utilization": self.tokens / self.allocated if self.allocated else None,
            "occupancy": self.tokens / (budget * steps),
            "resident": self.running / steps,
            "mean_resident_tokens": self.tokens / self.running if self.running else None,
            "saturated_steps": self.steps,
        }


def simulate_paged(requests: list[Request], num_blocks: int, block_size: int, prefix_caching: bool) -> dict:
    """Continuous batching over KVCacheManager; returns the tally, preemptions and the manager's stats."""
    manager = KVCacheManager(num_blocks, block_size, enable_prefix_caching=prefix_caching)
    queue = deque(Request(r.rid, r.prompt, r.output_len) for r in requests)  # fresh progress per run
    running, tally = [], Tally()
    preemptions = prefill_tokens = steps = 0
    start = time.perf_counter()
    while queue or running:
        steps += 1
        while queue:
            request = queue[0]
            tokens = request.prompt + request.generated
            cached = manager.allocate(request.rid, tokens, is_resume=request.preempted)
            if cached is None:
                break
            queue.popleft()
            running.append(request)
            prefill_tokens += len(tokens) - cached
        preempted_now = set()
        for request in list(running):
            if request.rid in preempted_now:
                continue
            while manager.append(request.rid, [len(request.generated)]) is None:
                victim = running.pop()
                manager.free(victim.rid)
                victim.preempted = True
                queue.appendleft(victim)
                preempted_now.add(victim.rid)
                preemptions += 1
                if victim is request:
                    break
            else:
                request.generated.append(len(request.generated))
        if queue:
            stats = manager.stats()
            if not prefix_caching:  # nothing is shared: the manager's count must be the simulator's
                assert stats.tokens_held == sum(len(r.prompt) + len(r.generated) for r in running)
            tally.add(stats.tokens_held, stats.slots_allocated, len(running))
        for request in list(running):
            if prefix_caching:  # the step wrote every reserved token's KV
                manager.mark_computed(request.rid, len(request.prompt) + len(request.generated))
            if len(request.generated) == request.output_len:
                running.remove(request)
                manager.free(request.rid)
    seconds = time.perf_counter() - start
    stats = manager.stats()
    assert stats.blocks_used == 0
    return {
        **tally.summary(num_blocks * block_size),
        "preemptions": preemptions,
        "prefill_tokens": prefill_tokens,
        # What the manager (and this loop) costs an engine per step, next to a GPU decode step of ~10-50 ms.
        "ms_per_step": 1e3 * seconds / steps,
        "stats": stats,
    }


class FirstFitArena:
    """Contiguous slabs in one address space of `size` slots, first fit, neighbours merged on release."""

    def __init__(self, size: int):
        self.starts, self.lengths = [0], [size]  # free segments, sorted by start

    def reserve(self, n: int) -> int | None:
        for i, length in enumerate(self.lengths):
            if length >= n:
                start = self.starts[i]
                if length == n:
                    del self.starts[i], self.lengths[i]
                else:
                    self.starts[i], self.lengths[i] = start + n, length - n
                return start
        return None

    def release(self, start: int, n: int) -> None:
        i = bisect.bisect(self.starts, start)
        self.starts.insert(i, start)
        self.lengths.insert(i, n)
        if i + 1 < len(self.starts) and start + n == self.starts[i + 1]:
            self.lengths[i] += self.lengths.pop(i + 1)
            self.starts.pop(i + 1)
        if i > 0 and self.starts[i - 1] + self.lengths[i - 1] == start:
            self.lengths[i - 1] += self.lengths.pop(i)
            self.starts.pop(i)


def simulate_contiguous(requests: list[Request], budget: int, slab_size) -> dict:
    """The same continuous batching with one contiguous slab per request for its whole life."""
    arena, queue, running, tally = FirstFitArena(budget), deque(requests), [], Tally()
    tokens = reserved = 0
    while queue or running:
        while queue:
            size = slab_size(queue[0])
            start = arena.reserve(size)
            if start is None:
                break
            request = queue.popleft()
            running.append([request, start, size, len(request.prompt)])
            tokens += len(request.prompt)
            reserved += size
        for slab in running:
            slab[3] += 1
        tokens += len(running)
        if queue:
            tally.add(tokens, reserved, len(running))
        for slab in [s for s in running if s[3] == s[0].final_len]:
            running.remove(slab)
            arena.release(slab[1], slab[2])
            tokens -= slab[3]
            reserved -= slab[2]
    return tally.summary(budget)


def utilization_rows(args, rng: random.Random) -> list[dict]:
    """One row per (workload, policy), contiguous-max once per max-len (its `max_len`; None elsewhere)."""
    budget = args.num_blocks * args.block_size
    fixed_policies = {
        "contiguous-pow2": lambda r: 1 << (r.final_len - 1).bit_length(),
        "contiguous-oracle": lambda r: r.final_len,
    }
    rows = []
    for workload in ("sharegpt", "uniform"):
        requests = make_workload(workload, args.requests, min(args.max_lens), rng)
        shape = {
            "workload": workload,
            "mean_prompt": sum(len(r.prompt) for r in requests) / len(requests),
            "mean_output": sum(r.output_len for r in requests) / len(requests),
        }
        paged = simulate_paged(requests, args.num_blocks, args.block_size, prefix_caching=False)
        paged.pop("stats")
        rows.append({**shape, "policy": "paged", "max_len": None, **paged})
        for max_len in args.max_lens:
            result = simulate_contiguous(requests, budget, lambda r, slab=max_len: slab)
            rows.append({**shape, "policy": "contiguous-max", "max_len": max_len, **result})
        for policy, slab_size in fixed_policies.items():
            result = simulate_contiguous(requests, budget, slab_size)
            rows.append({**shape, "policy": policy, "max_len": None, **result})
    return rows


def max_len_rows(rows: list[dict], budget: int) -> list[dict]:
    """Per workload and max-len: each policy's resident requests over contiguous-max's, and the bound.

    The bound is the requests a zero-waste allocator would hold, budget / (paged's mean tokens per resident
    request), over contiguous-max's budget // max-len: max-len / mean tokens when max-len divides the budget.
    Paged's ratio is its occupancy times the bound.
    """
    table = []
    for reference in (r for r in rows if r["policy"] == "contiguous-max"):
        same = {r["policy"]: r for r in rows if r["workload"] == reference["workload"] and r["max_len"] is None}
        table.append({
            "workload": reference["workload"],
            "max_len": reference["max_len"],
            "max_utilization": reference["utilization"],
            "max_resident": reference["resident"],
            **{f"{policy}_vs_max": row["resident"] / reference["resident"] for policy, row in same.items()},
            "bound_vs_max": budget / same["paged"]["mean_resident_tokens"] / reference["resident"],
        })
    return table


def shared_prefix_result(args, rng: random.Random) -> dict:
    requests, ideal_hits = make_shared_prefix_workload(args.requests, args.preambles, args.shared_max_len, rng)
    bs = args.block_size
    ideal = sum(hits // bs * bs for hits in ideal_hits)
    cached = simulate_paged(requests, args.num_blocks, bs, prefix_caching=True)
    stats = cached.pop("stats")
    plain = simulate_paged(requests, args.num_blocks, bs, prefix_caching=False)
    plain.pop("stats")
    return {
        "requests": len(requests),
        "preambles": args.preambles,
        "prompt_tokens": sum(len(r.prompt) for r in requests),
        "hit_rate": stats.prefix_hit_rate,
        "prefill_tokens_saved": stats.prefix_hit_tokens,
        "ideal_tokens_saved": ideal,
        "saved_vs_ideal": stats.prefix_hit_tokens / ideal if ideal else None,
        "resume_hit_tokens": stats.resume_hit_tokens,
        "evictions": stats.evictions,
        "resident_cached": cached["resident"],
        "resident_uncached": plain["resident"],
        "utilization_cached": cached["utilization"],
        "preemptions_cached": cached["preemptions"],
        "preemptions_uncached": plain["preemptions"],
    }


def bulk_block_op_rate(block_size: int, seconds: float) -> dict:
    """Long prompts (half a cached prefix), decode growth, a fork, frees: block ops per second, hashing included."""
    manager = KVCacheManager(4096, block_size)
    prefix = list(range(512))
    manager.allocate("warm", prefix + [0])
    manager.mark_computed("warm", 513)
    ops0, calls, i = manager.stats().block_ops, 0, 0
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        for _ in range(20):
            i += 1
            prompt = prefix + [i] * 512
            manager.allocate(i, prompt)
            manager.mark_computed(i, len(prompt))
            manager.append(i, [1] * 4 * block_size)
            manager.fork(i, -i)
            manager.free(-i)
            manager.free(i)
            calls += 6
    elapsed = time.perf_counter() - start
    ops = manager.stats().block_ops - ops0
    return {"bulk_block_ops": ops, "bulk_seconds": elapsed, "block_ops_per_s": ops / elapsed,
            "bulk_calls_per_s": calls / elapsed}


def append_call_rate(block_size: int, seconds: float) -> dict:
    """Decode: one-token appends round-robin over 256 sequences of 100 to 1124 tokens, each restarted (free,
    allocate) when it reaches 1124, so the pool never runs dry however long the measurement."""
    batch, prompt_len, restart_len = 256, 100, 1124
    manager = KVCacheManager(batch * -(-restart_len // block_size) + 1, block_size, enable_prefix_caching=False,
                             watermark=0.0)
    for sid in range(batch):
        manager.allocate(sid, [1] * prompt_len)
    calls, length = 0, prompt_len
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        if length == restart_len:
            for sid in range(batch):
                manager.free(sid)
                manager.allocate(sid, [1] * prompt_len)
            length = prompt_len
        for sid in range(batch):
            if manager.append(sid, [1]) is None:
                raise RuntimeError("append_call_rate: the pool ran dry; its size is wrong")
        calls += batch
        length += 1
    elapsed = time.perf_counter() - start
    return {"append_calls_per_s": calls / elapsed}


def run(args) -> dict:
    rng = random.Random(args.seed)
    rows = utilization_rows(args, rng)
    by_max_len = max_len_rows(rows, args.num_blocks * args.block_size)
    shared = shared_prefix_result(args, rng)
    throughput = {
        **bulk_block_op_rate(args.block_size, args.seconds),
        **append_call_rate(args.block_size, args.seconds),
    }
    paged = [r for r in rows if r["policy"] == "paged"]
    bars = {
        "utilization >= 96% (both workloads)": min(r["utilization"] for r in paged) >= BARS["utilization"],
        **{
            f"resident >= 3x contiguous-max ({r['workload']}, max-len {r['max_len']})":
                r["paged_vs_max"] >= BARS["resident_vs_max"]
            for r in by_max_len
        },
        ">= 200k block ops/s": throughput["block_ops_per_s"] >= BARS["block_ops_per_s"],
    }
    settings = {k: v for k, v in vars(args).items() if k not in ("json", "out")}
    # Rates are wall-clock on a shared machine: record how busy it was.
    settings["load_average_1m_at_end"] = round(os.getloadavg()[0], 2)
    return {"settings": settings, "utilization": rows, "by_max_len": by_max_len, "shared_prefix": shared,
            "throughput": throughput, "bars": bars}


def to_markdown(result: dict) -> str:
    from ioattn.bench.harness import markdown_table

    util = markdown_table(
        ["workload", "mean prompt", "mean output", "policy", "max-len", "utilization", "occupancy", "resident",
         "tokens / resident", "preemptions", "ms/step"],
        [[r["workload"], r["mean_prompt"], r["mean_output"], r["policy"], r["max_len"], r["utilization"],
          r["occupancy"], r["resident"], r["mean_resident_tokens"], r.get("preemptions", 0), r.get("ms_per_step")]
         for r in result["utilization"]],
    )
    per_workload = []
    for workload in dict.fromkeys(r["workload"] for r in result["by_max_len"]):
        paged = next(r for r in result["utilization"] if r["workload"] == workload and r["policy"] == "paged")
        per_workload += [
            f"`{workload}`: resident requests over contiguous-max at each max-len; bound = max-len / "
            f"{paged['mean_resident_tokens']:.0f} mean tokens per resident request (paged run)",
            markdown_table(
                ["max-len", "contiguous-max utilization", "contiguous-max resident", "paged ÷ max", "pow2 ÷ max",
                 "oracle ÷ max", "bound ÷ max"],
                [[r["max_len"], r["max_utilization"], r["max_resident"], r["paged_vs_max"],
                  r["contiguous-pow2_vs_max"], r["contiguous-oracle_vs_max"], r["bound_vs_max"]]
                 for r in result["by_max_len"] if r["workload"] == workload],
            ),
        ]
    shared = result["shared_prefix"]
    prefix = markdown_table(["metric", "value"], list(shared.items()))
    speed = markdown_table(["metric", "value"], list(result["throughput"].items()))
    bars = markdown_table(["bar", "met"], list(result["bars"].items()))
    return "\n\n".join([
        "KV utilization and resident requests at one budget (saturated steps)", util, *per_workload,
        "Shared system prompt", prefix, "Manager throughput (pure Python, this CPU)", speed, "Bars", bars,
    ])


def _max_lens(text: str) -> tuple[int, ...]:
    try:
        lengths = sorted({int(part) for part in text.split(",")})
    except ValueError:
        raise argparse.ArgumentTypeError(f"--max-lens must be comma-separated integers, got {text!r}") from None
    if lengths[0] < 2:
        raise argparse.ArgumentTypeError(f"--max-lens must all be >= 2 (a prompt token and an output), got {text!r}")
    return tuple(lengths)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ioattn bench kv", description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=1500, help="requests per workload")
    parser.add_argument("--num-blocks", type=int, default=4096, help="GPU blocks: the memory budget")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-lens", type=_max_lens, default=DEFAULT_MAX_LENS,
                        help="comma-separated model contexts: contiguous-max's slab, one run each; the workloads "
                             "are clipped to the smallest (default 2048,4096,8192)")
    parser.add_argument("--preambles", type=int, default=8, help="distinct system prompts (shared-prefix run)")
    parser.add_argument("--shared-max-len", type=int, default=8192, help="context in the shared-prefix run")
    parser.add_argument("--seconds", type=float, default=2.0, help="per throughput measurement")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="write the results as JSON here")
    parser.add_argument("--out", help="directory for commit-ready <date>-kv-cpu.{json,md} with the disclosure")
    args = parser.parse_args(argv)
    longest = max(*args.max_lens, args.shared_max_len)
    if (args.num_blocks - int(0.01 * args.num_blocks)) * args.block_size < longest:
        parser.error(f"--num-blocks x --block-size must hold the longest request ({longest} tokens)")

    result = run(args)
    text = to_markdown(result)
    print(text)
    if args.json or args.out:
        from ioattn.bench.harness import collect_disclosure, dated_paths, disclosure_markdown, write_text

        disclosure = collect_disclosure("cpu", "ioattn bench kv " + " ".join(argv or sys.argv[1:]))
        disclosure["timing"] = "wall clock (time.perf_counter); the simulations are deterministic for a --seed"
        result = {"disclosure": disclosure, **result}
        payload = json.dumps(result, indent=1, default=str) + "\n"
        if args.json:
            write_text(args.json, payload)
        if args.out:
            paths = dated_paths(args.out, "kv", "cpu")
            write_text(paths["json"], payload)
            write_text(paths["md"], f"# ioattn bench kv (CPU)\n\n{disclosure_markdown(result)}\n\n{text}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
