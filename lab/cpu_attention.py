"""On the CPU, how fast is `ioattn.flash_attn_func` against torch's own SDPA on the same problem, and which path runs?

Rows (B, Hq, Hkv, Nq, Nk, D, causal, window, dtype): the issue's 4096 x 32 x 128 bf16 problem non-causal and causal,
GQA 32/8, a chunk of 512 queries after 3584 cached keys (bottom-right causal), one decode query over 4096 keys,
float32, and a sliding window (which stays on the tiled forward). The peer is
`torch.nn.functional.scaled_dot_product_attention` computing the same thing: is_causal where top-left equals
bottom-right (Nq == Nk), else the bottom-right / window rule as a bool mask; GQA through enable_gqa. Both sides
are timed alternately in one process (ours, peer, ours, ...), `--repeats` times after a warm-up each, and every row
reports the median, the spread (min-max), the ratio ours / peer of each pair (median and spread), the path
`ioattn.explain` names, and the error of both against float64 on `--check-rows` query rows spread over the
sequence (‖out − ref‖_F / ‖ref‖_F over those rows).

    PYTHONPATH=. python3 lab/cpu_attention.py [--repeats 5] [--out bench/results/2026-12-02-cpu-attention]

writes OUT.json (disclosure, rows) and OUT.md. Runs on any machine; ~5 minutes on two cores.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import time
from pathlib import Path

# (label, B, Hq, Hkv, Nq, Nk, D, causal, window, dtype)
ROWS = [
    ("issue problem", 1, 32, 32, 4096, 4096, 128, False, (-1, -1), "bfloat16"),
    ("issue problem, causal", 1, 32, 32, 4096, 4096, 128, True, (-1, -1), "bfloat16"),
    ("GQA 32/8, causal", 1, 32, 8, 4096, 4096, 128, True, (-1, -1), "bfloat16"),
    ("chunk after context (bottom-right)", 1, 32, 8, 512, 4096, 128, True, (-1, -1), "bfloat16"),
    ("decode", 8, 32, 8, 1, 4096, 128, True, (-1, -1), "bfloat16"),
    ("float32, causal", 1, 16, 16, 2048, 2048, 64, True, (-1, -1), "float32"),
    ("sliding window 256 (tiled path)", 1, 32, 8, 4096, 4096, 128, True, (256, 0), "bfloat16"),
]


def visible(n_q: int, n_k: int, causal: bool, window: tuple[int, int], rows):
    """Bool (len(rows), Nk): flash-attn's bottom-right rule for the given query rows."""
    import torch

    pos = rows[:, None] + (n_k - n_q)
    keys = torch.arange(n_k)[None, :]
    right = 0 if causal else window[1]
    ok = torch.ones(len(rows), n_k, dtype=torch.bool)
    if right >= 0:
        ok &= keys <= pos + right
    if window[0] >= 0:
        ok &= keys >= pos - window[0]
    return ok


def measure(row, repeats: int, check_rows: int) -> dict:
    import torch
    import torch.nn.functional as F

    import ioattn
    from ioattn.reference import attention_ref, rel_error

    label, b, h_q, h_kv, n_q, n_k, d, causal, window, dtype_name = row
    dtype = getattr(torch, dtype_name)
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(b, n_q, h_q, d, generator=gen).to(dtype)
    k, v = (torch.randn(b, n_k, h_kv, d, generator=gen).to(dtype) for _ in range(2))
    q_t, k_t, v_t = (t.transpose(1, 2) for t in (q, k, v))  # the peer's (B, H, N, D) views of the same memory
    square_causal = causal and n_q == n_k and window == (-1, -1)
    mask = None
    if not square_causal and (causal or window != (-1, -1)):
        mask = visible(n_q, n_k, causal, window, torch.arange(n_q))
    if causal and n_q == 1:
        mask = None  # one query at the end sees every key
    plan = ioattn.explain(q, k, v, causal=causal, window_size=window)

    def ours():
        return ioattn.flash_attn_func(q, k, v, causal=causal, window_size=window)

    def peer():
        return F.scaled_dot_product_attention(q_t, k_t, v_t, attn_mask=mask, is_causal=square_causal,
                                              enable_gqa=h_q != h_kv).transpose(1, 2)

    rows = torch.linspace(0, n_q - 1, min(check_rows, n_q)).round().long().unique()
    ref, _ = attention_ref(q[:, rows], k, v, attn_mask=visible(n_q, n_k, causal, window, rows)
                           if causal or window != (-1, -1) else None)
    errors = {name: rel_error(fn()[:, rows], ref) for name, fn in (("ours", ours), ("peer", peer))}
    times = {"ours": [], "peer": []}
    for _ in range(repeats):
        for name, fn in (("ours", ours), ("peer", peer)):
            start = time.perf_counter()
            fn()
            times[name].append((time.perf_counter() - start) * 1e3)
    ratios = [a / p for a, p in zip(times["ours"], times["peer"])]
    return {
        "label": label, "shape": {"B": b, "Hq": h_q, "Hkv": h_kv, "Nq": n_q, "Nk": n_k, "D": d}, "causal": causal,
        "window": list(window), "dtype": dtype_name, "path": plan.kernel, "reason": plan.reason,
        "peer": "F.scaled_dot_product_attention " + ("is_causal" if square_causal else
                                                     "bool mask" if mask is not None else "no mask"),
        "ms": times, "ours_ms_median": statistics.median(times["ours"]),
        "peer_ms_median": statistics.median(times["peer"]), "ratio_median": statistics.median(ratios),
        "ratio_min": min(ratios), "ratio_max": max(ratios), "error_vs_float64": errors,
        "error_rows": len(rows),
    }


def disclosure(command: str) -> dict:
    import torch

    from ioattn.bench.harness import collect_disclosure

    info = collect_disclosure("cpu", command)
    info["threads"] = torch.get_num_threads()
    info["commit"] = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    info["dirty_files"] = subprocess.run(["git", "status", "--short", "--untracked-files=no"], capture_output=True,
                                         text=True).stdout.split("\n")[:-1]
    info["load_average_1m_start"] = round(os.getloadavg()[0], 2)
    info["timing"] = ("time.perf_counter around one call, after one untimed call of each side; ours and the peer "
                      "alternate")
    return info


def to_markdown(result: dict) -> str:
    info = result["disclosure"]
    lines = [
        "# flash_attn_func (CPU) against torch SDPA", "",
        f"{info['cpu']}, {info['cpu_count']} cores, {info['threads']} threads, torch {info['torch']}, commit "
        f"{info['commit'][:12]}, {info['date_utc']} UTC; load average (1 min) {info['load_average_1m_start']} at "
        f"the start, {result['load_average_1m_end']} at the end. {result['repeats']} alternating repeats per row "
        f"after one warm-up call each; error: relative Frobenius against float64 on {result['rows'][0]['error_rows']}"
        " query rows spread over the sequence.", "",
        "| row | B | Hq/Hkv | Nq | Nk | D | dtype | ours ms (median, min-max) | SDPA ms (median, min-max) | "
        "ours / SDPA (median, min-max) | err ours | err SDPA | path |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in result["rows"]:
        s, t = row["shape"], row["ms"]
        path = "torch SDPA kernel" if "flash_attention_for_cpu" in row["path"] else "tiled torch forward"
        lines.append(
            f"| {row['label']} | {s['B']} | {s['Hq']}/{s['Hkv']} | {s['Nq']} | {s['Nk']} | {s['D']} | {row['dtype']} "
            f"| {row['ours_ms_median']:.1f} ({min(t['ours']):.1f}-{max(t['ours']):.1f}) "
            f"| {row['peer_ms_median']:.1f} ({min(t['peer']):.1f}-{max(t['peer']):.1f}) "
            f"| {row['ratio_median']:.2f} ({row['ratio_min']:.2f}-{row['ratio_max']:.2f}) "
            f"| {row['error_vs_float64']['ours']:.1e} | {row['error_vs_float64']['peer']:.1e} | {path} |")
    lines += ["", "Paths (`ioattn.explain(...).reason`):", ""]
    lines += [f"- {row['label']}: {row['reason']}" for row in result["rows"]]
    return "\n".join(lines) + "\n"


def main() -> None:
    import sys

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--check-rows", type=int, default=128)
    parser.add_argument("--out", default=os.path.join(os.environ.get("OUT", "/tmp/out"), "cpu_attention"))
    args = parser.parse_args()
    result = {"disclosure": disclosure("python3 lab/cpu_attention.py " + " ".join(sys.argv[1:])),
              "repeats": args.repeats, "rows": []}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    for row in ROWS:
        result["rows"].append(measure(row, args.repeats, args.check_rows))
        result["load_average_1m_end"] = round(os.getloadavg()[0], 2)
        Path(args.out + ".json").write_text(json.dumps(result, indent=1) + "\n")
        done = result["rows"][-1]
        print(f"{done['label']}: ours {done['ours_ms_median']:.1f} ms, SDPA {done['peer_ms_median']:.1f} ms, "
              f"ratio {done['ratio_median']:.2f}", flush=True)
    Path(args.out + ".md").write_text(to_markdown(result))
    print(to_markdown(result))


if __name__ == "__main__":
    main()
