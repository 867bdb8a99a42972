"""Device exploration 9: where a serving run's time goes. The `bench serve` workload (256 requests, prompts
100-1024, outputs 256, all at t=0, seed 0) through our continuous engine on llama3-8b-shape, with every step's
composition (rows, decode rows, prefill tokens, graph or eager) and its GPU time (CUDA events around
`ModelRunner.execute`, stream-ordered, so host stalls between steps do not count), and a torch-profiler kernel
table over a few mixed (prefill + decode) steps and a few decode-only steps.

PYTHONPATH=. python3 lab/explore9.py [--cold] [max_num_batched_tokens ...]; writes $OUT/explore9.json.
Every Triton kernel-cache miss is recorded with the step it happened in (`compiles_in_run`: after the warm-up,
each one a stall); --cold starts from an empty Triton cache. On a
CPU it runs the `tiny` model with a short workload (a dry run of the script's logic). Results:
bench/results/2026-12-01-s5-explore9-before-h200.json (the code before this session), -alignment-stall- (decode
rows split from the packed chunks, long chunks gathered; one step still compiled a kernel specialisation for a
misaligned seq_lens slice), -h200.json (the specialisations fixed). The profiled steps' processing (~1 s each
window) lands in the run's duration.
"""
import os
import sys
import tempfile
import time

# --cold: an empty Triton cache (set before triton loads), so every compile costs what it costs on a fresh machine
if __name__ == "__main__" and "--cold" in sys.argv:
    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="triton-cold-")
    sys.argv.remove("--cold")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import explore1 as e1  # noqa: E402

import torch  # noqa: E402

import ioattn  # noqa: E402
from ioattn.bench.workload import WARMUP_REQUESTS, make_workload  # noqa: E402
from ioattn.bench.serve_offline import Pacing, release_device, run_engine  # noqa: E402

MODEL = "tiny" if e1.TINY else "llama3-8b-shape"
NUM_REQUESTS = 8 if e1.TINY else 256
OUTPUT_LEN = 8 if e1.TINY else 256
PROFILE_STEPS = 3


COMPILES: list[dict] = []  # every in-memory kernel-cache miss (a compile, or a load from the disk cache)
PHASE = {"name": "start", "step": 0}


def _record_compile(*, key, repr, fn, compile, is_manual_warmup, already_compiled):
    COMPILES.append({"phase": PHASE["name"], "step": PHASE["step"], "t": time.monotonic(), "kernel": fn.name,
                     "repr": repr[:600], "constants": str(compile.get("constants"))[:600]})
    return False  # compile as usual


def _watch_compiles() -> None:
    try:
        from triton import knobs
        knobs.runtime.jit_cache_hook = _record_compile
    except (ImportError, AttributeError):  # the interpreter has no compile step
        pass


class StepTrace:
    """Wraps runner.execute: per call the batch's shape, host time, and CUDA events for its GPU span."""

    def __init__(self, runner):
        self.runner, self.inner, self.steps = runner, runner.execute, []
        runner.execute = self
        self.profile_windows: dict[str, tuple[int, int]] = {}
        self.profiler = None
        self.tables: dict[str, list] = {}

    def __call__(self, batch, feed=None):
        rows, tokens = len(batch), len(batch.token_ids)
        decode_rows = sum(1 for n in batch.num_tokens if n == 1)
        index = len(self.steps)
        PHASE["step"] = index
        self._profile(index, mixed=rows > decode_rows, rows=rows)
        cuda = self.runner.device.type == "cuda"
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        host = time.perf_counter()
        out = self.inner(batch, feed)
        host = time.perf_counter() - host
        if cuda:
            end.record()
        self.steps.append({"rows": rows, "tokens": tokens, "decode_rows": decode_rows,
                           "max_q": max(batch.num_tokens), "host_ms": host * 1e3,
                           "events": (start, end) if cuda else None, "wall": time.monotonic()})
        return out

    def _profile(self, index: int, mixed: bool, rows: int) -> None:
        """Profile the first PROFILE_STEPS mixed steps after the tenth step, and PROFILE_STEPS decode-only steps
        with at least 200 rows (or, on a CPU, any)."""
        if self.profiler is not None:
            name, first = self.active
            if index - first >= PROFILE_STEPS:
                if self.runner.device.type == "cuda":
                    torch.cuda.synchronize()
                self.profiler.stop()
                averages = self.profiler.key_averages()
                attr = "device_time_total" if hasattr(averages[0], "device_time_total") else "cuda_time_total"
                rows_ = sorted(averages, key=lambda a: getattr(a, attr), reverse=True)[:40]
                self.tables[name] = [{"name": a.key[:120], "count": a.count, "device_us": getattr(a, attr)}
                                     for a in rows_]
                # Host calls that may block (synchronisations, pageable copies): by self CPU time.
                by_cpu = sorted(averages, key=lambda a: a.self_cpu_time_total, reverse=True)[:30]
                self.tables[name + "_cpu"] = [{"name": a.key[:120], "count": a.count,
                                               "self_cpu_us": a.self_cpu_time_total} for a in by_cpu]
                self.profiler = None
            return
        want = None
        if mixed and index >= 10 and "mixed" not in self.tables:
            want = "mixed"
        elif not mixed and (rows >= 200 or e1.TINY) and "decode" not in self.tables:
            want = "decode"
        if want:
            acts = [torch.profiler.ProfilerActivity.CPU]
            if self.runner.device.type == "cuda":
                acts.append(torch.profiler.ProfilerActivity.CUDA)
            self.profiler = torch.profiler.profile(activities=acts)
            self.profiler.start()
            self.active = (want, index)

    def rows(self) -> list[dict]:
        if self.runner.device.type == "cuda":
            torch.cuda.synchronize()
        out = []
        for s in self.steps:
            events = s.pop("events")
            s["gpu_ms"] = events[0].elapsed_time(events[1]) if events else None
            out.append(s)
        return out


def run(max_batched: int) -> dict:
    work = make_workload(NUM_REQUESTS, (100, 1024), (OUTPUT_LEN, OUTPUT_LEN), 0)
    warm = make_workload(WARMUP_REQUESTS, (100, 1024), (4, 4), 1)
    llm = ioattn.LLM(MODEL, max_num_seqs=256, max_num_batched_tokens=max_batched, device=e1.DEV)
    try:
        engine = llm.engine
        PHASE["name"] = "warm-up"
        run_engine(engine, warm, 0.0, Pacing.all_at_once(warm))
        PHASE["name"] = "run"
        trace = StepTrace(engine.runner)
        result = run_engine(engine, work, 0.0, Pacing.all_at_once(work))
        result.pop("first_tokens")
        steps = trace.rows()
        result["steps_trace"] = steps
        result["profiles"] = trace.tables
        result["compiles_in_run"] = [c for c in COMPILES if c["phase"] == "run"]
        result["compiles_before_run"] = len([c for c in COMPILES if c["phase"] != "run"])
        gpu = [s["gpu_ms"] or 0.0 for s in steps]
        mixed = [s for s in steps if s["decode_rows"] < s["rows"]]
        result["summary"] = {
            "gpu_ms_total": sum(gpu), "mixed_steps": len(mixed),
            "mixed_gpu_ms": sum(s["gpu_ms"] or 0.0 for s in mixed),
            "decode_gpu_ms": sum(s["gpu_ms"] or 0.0 for s in steps if s["decode_rows"] == s["rows"]),
            "host_ms_total": sum(s["host_ms"] for s in steps),
        }
        return result
    finally:
        llm.shutdown()
        del llm
        release_device()


if __name__ == "__main__":
    e1.save_as("explore9")
    e1.RESULTS["disclosure"] = e1.harness.collect_disclosure(e1.DEV, "lab/explore9.py")
    e1.RESULTS["serve"] = []
    _watch_compiles()
    for budget in [int(a) for a in sys.argv[1:]] or [2048]:
        try:
            r = run(budget)
            e1.RESULTS["serve"].append({"max_num_batched_tokens": budget, **r})
            print(budget, round(r["duration_s"], 2), "s", round(r["output_tokens_per_s"]), "tok/s", r["summary"],
                  flush=True)
            for c in r["compiles_in_run"]:
                print("compiled in run: step", c["step"], c["kernel"], c["repr"][:300], c["constants"][:200],
                      flush=True)
            for name, table in r["profiles"].items():
                key = "self_cpu_us" if name.endswith("_cpu") else "device_us"
                print(name, [(t["name"][:50], t["count"], round(t[key])) for t in table[:12]], flush=True)
        except Exception as exc:  # noqa: BLE001
            e1.RESULTS["errors"].append({"budget": budget, "error": repr(exc)})
            print("error", budget, repr(exc), flush=True)
        e1.save()
