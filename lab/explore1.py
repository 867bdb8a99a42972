"""Device exploration 1 (not part of the package): decode / chunked-prefill / forward / backward variants.

Run on the H200: PYTHONPATH=. python3 lab/explore1.py [sections...]; writes $OUT/explore1.json as it goes.
Results: bench/results/2026-12-01-explore1-h200.json. Its helpers (save_as, timed, kernel_times, decode_inputs)
and sections are what the later scripts run with their own shapes and configs. The paged variants that later
left the kernel (table prefetch, one masked loop, fused split combine, register-pipelined loads: the JSON rows
named pf*, *_fc, n*/rp* in explore1-3) were removed from these scripts with it; their recorded rows are the
evidence.
Every variant is checked against a float64 reference on fresh random inputs (NaN-poisoned outputs) before it
is timed; a variant that fails the check is recorded as wrong and not timed.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
import traceback

import torch

import ioattn
from ioattn.bench import harness
from ioattn.bench.decode import capture_graph, chunked_prefill_inputs, paged_pool
from ioattn.ops.attention import flash_attn_with_config
from ioattn.ops.backward import BwdConfig, attention_bwd
from ioattn.ops.forward import FwdConfig
from ioattn.ops.paged import PagedConfig, paged_attention, paged_workspace, plan_paged_attention
from ioattn.reference import attention_ref, rel_error

OUT = os.environ.get("OUT", "/tmp/out")
RESULTS: dict = {"started": time.time(), "decode": [], "prefill": [], "fwd": [], "bwd": [], "errors": []}
WITH_FLEX = False  # FlexAttention beside the forward variants (explore5)
TINY = not torch.cuda.is_available()  # a CPU dry run of the script's logic, at toy shapes
BF16 = torch.float16 if TINY else torch.bfloat16
DEV = "cpu" if TINY else "cuda"


def sync():
    if not TINY:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def save_as(name: str):
    """Make every section here write $OUT/<name>.json as it goes (the later scripts reuse these sections)."""
    def save_results():
        os.makedirs(OUT, exist_ok=True)
        with open(f"{OUT}/{name}.json", "w") as f:
            json.dump(RESULTS, f, indent=1, default=str)
    globals()["save"] = save_results
    return save_results


save = save_as("explore1")


def timed(fn, warmup=10, rep=40):
    graphed, how = capture_graph(fn, DEV)
    return harness.time_ms(graphed, DEV, warmup_ms=warmup, rep_ms=rep).ms, how


def kernel_times(fn, replays):
    """{kernel name: (calls, total µs)} of `replays` calls of fn under the torch profiler (CUDA only)."""
    if TINY:
        return {}
    fn()
    sync()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            fn()
        torch.cuda.synchronize()
    return {ev.key: (ev.count, ev.device_time_total) for ev in prof.key_averages() if ev.device_time_total > 0}


def record_error(section, what, exc):
    RESULTS["errors"].append({"section": section, "what": str(what), "error": f"{type(exc).__name__}: {exc}"[:600],
                              "trace": traceback.format_exc()[-1500:]})
    save()


# ---------------------------------------------------------------------------------------------------- decode
DECODE_SHAPES = [(1, 512), (3, 256)] if TINY else [
    (1, 32768), (1, 131072), (8, 32768), (8, 4096), (64, 1024), (256, 1024), (64, 4096)]


def decode_configs():
    C = PagedConfig
    return {
        "base": C(16, 64, 4, 2),
    }


SPLIT_SWEEP_CONFIGS = ("base",)
SPLIT_SWEEP = (3,) if TINY else (16, 24, 48, 66, 99, 132)
SPLIT_SWEEP_MAX_BATCH = 8  # split counts are swept for batches up to this (None: every batch, explore3)


def decode_inputs(batch, length, hq, hkv, d):
    """Fresh random decode inputs: q (B, Hq, D), contiguous k/v (B, L, Hkv, D), seq_lens, the float64 reference
    of sequence 0 and the K+V bytes a call reads."""
    k = torch.randn(batch, length, hkv, d, dtype=BF16, device=DEV)
    v = torch.randn_like(k)
    q = torch.randn(batch, hq, d, dtype=BF16, device=DEV)
    lens = torch.full((batch,), length, dtype=torch.int32, device=DEV)
    ref = attention_ref(q[:1, None], k[:1], v[:1])[0][0, 0]
    return q, k, v, lens, ref, 2 * k.numel() * k.element_size()


def decode_section():
    hq, hkv, d = 32, 8, 128
    configs = decode_configs()
    if TINY:
        configs = dict(list(configs.items())[:3])
    for batch, length in DECODE_SHAPES:
        torch.manual_seed(batch * 7 + length)
        q, k, v, lens, ref, kv_bytes = decode_inputs(batch, length, hq, hkv, d)
        # peers on a contiguous (B, H, L, D) copy
        try:
            from torch.nn.attention import SDPBackend, sdpa_kernel
            q4 = q.view(batch, hq, 1, d)
            kt, vt = k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous()
            for name, be in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION)):
                def peer(be=be):
                    with sdpa_kernel(be):
                        return torch.nn.functional.scaled_dot_product_attention(q4, kt, vt, enable_gqa=True)
                ms, how = timed(peer)
                RESULTS["decode"].append({"B": batch, "L": length, "variant": name, "us": ms * 1e3,
                                          "tbps": kv_bytes / ms / 1e9, "how": how})
            del kt, vt
        except Exception as exc:  # noqa: BLE001
            record_error("decode-peer", (batch, length), exc)
        for layout, block in (("paged", 16), ("contig", 256)):
            k_cache, v_cache, table = paged_pool(k, v, block, layout == "paged")
            trials = [(name, cfg, 0) for name, cfg in configs.items()]
            if SPLIT_SWEEP_MAX_BATCH is None or batch <= SPLIT_SWEEP_MAX_BATCH:
                trials += [(name, configs[name], s) for name in SPLIT_SWEEP_CONFIGS if name in configs
                           for s in SPLIT_SWEEP]
            for name, cfg, splits in trials:
                try:
                    plan = plan_paged_attention(q, k_cache, table, decode=True, max_seqlen_q=1, num_splits=splits,
                                                config=cfg)
                    ws = paged_workspace(batch, hq, d, max_splits=max(plan.num_splits, 1), device=DEV)
                    out = torch.full_like(q, float("nan"))

                    def fwd(plan=plan, ws=ws, out=out):
                        return paged_attention(q, k_cache, v_cache, table, lens, out=out, workspace=ws,
                                               num_splits=plan.num_splits, config=plan.config)
                    fwd()
                    sync()
                    err = rel_error(out[0], ref)
                    nan = bool(torch.isnan(out).any())
                    entry = {"B": batch, "L": length, "layout": layout, "variant": name, "splits": plan.num_splits,
                             "config": dataclasses.asdict(cfg), "error": err, "nan": nan}
                    if err < 1e-2 and not nan:
                        ms, how = timed(fwd)
                        fwd()
                        sync()
                        entry.update(us=ms * 1e3, tbps=kv_bytes / ms / 1e9, how=how,
                                     error_after=rel_error(out[0], ref))
                    RESULTS["decode"].append(entry)
                except Exception as exc:  # noqa: BLE001
                    record_error("decode", (batch, length, layout, name, splits), exc)
            save()
            del k_cache, v_cache
        del k, v
        sync()
        print("decode", batch, length, "done", flush=True)


# ---------------------------------------------------------------------------------------------------- prefill
def prefill_section(configs=None):
    hq, hkv, d, new, ctx, page = (4, 2, 64, 64, 64, 16) if TINY else (32, 8, 128, 4096, 4096, 16)
    total = new + ctx
    torch.manual_seed(5)
    inputs = chunked_prefill_inputs(hq, hkv, d, new, ctx, page, BF16, DEV)
    q, k, v, k_cache, v_cache, table = inputs.q, inputs.k, inputs.v, inputs.k_cache, inputs.v_cache, inputs.table
    cu, lens = inputs.cu_seqlens_q, inputs.seq_lens
    rows = min(new, 256)
    ref = attention_ref(q[:, -rows:], k, v, causal=True)[0]
    flops = harness.attention_flops(1, hq, new, total, d, causal=True)
    C = PagedConfig
    default_configs = {
        "base_m128n64w8s2": C(128, 64, 8, 2),
        "pf_m128n64w8s2": C(128, 64, 8, 2),
        "pf_m128n64w4s2": C(128, 64, 4, 2),
        "pf_m128n64w4s3": C(128, 64, 4, 3),
        "pf_m128n64w8s3": C(128, 64, 8, 3),
        "pf_m128n128w8s2": C(128, 128, 8, 2),
        "pf_m128n128w8s3": C(128, 128, 8, 3),
        "pf_m64n64w4s2": C(64, 64, 4, 2),
        "pf_m64n64w4s3": C(64, 64, 4, 3),
        "pf_m64n128w4s2": C(64, 128, 4, 2),
        "pf_m128n32w4s3": C(128, 32, 4, 3),
        "pf_m128n32w8s4": C(128, 32, 8, 4),
        "pf_m128n64w4s4": C(128, 64, 4, 4),
        "pf_m64n32w4s4": C(64, 32, 4, 4),
    }
    configs = configs or default_configs
    if TINY:
        configs = dict(list(configs.items())[:2])
    for name, cfg in configs.items():
        try:
            out = torch.full_like(q[0], float("nan"))

            def fwd(cfg=cfg, out=out):
                return paged_attention(q[0], k_cache, v_cache, table, lens, cu_seqlens_q=cu, max_seqlen_q=new,
                                       num_splits=1, config=cfg, out=out)
            fwd()
            sync()
            err = rel_error(out[None, -rows:], ref)
            entry = {"variant": name, "config": dataclasses.asdict(cfg), "error": err,
                     "nan": bool(torch.isnan(out).any())}
            if err < 1e-2 and not entry["nan"]:
                ms, how = timed(fwd, 10, 60)
                entry.update(ms=ms, tflops=harness.tflops(flops, ms))
            RESULTS["prefill"].append(entry)
            save()
        except Exception as exc:  # noqa: BLE001
            record_error("prefill", name, exc)
    for name, cfg in {"dense_tma": FwdConfig(128, 64, 4, 2), "dense_ptr": FwdConfig(128, 64, 4, 2, tma=False)}.items():
        try:
            def dense(cfg=cfg):
                return flash_attn_with_config(q, k, v, cfg, causal=True)[0]
            err = rel_error(dense()[:, -rows:], ref)
            ms, how = timed(dense, 10, 60)
            RESULTS["prefill"].append({"variant": name, "config": dataclasses.asdict(cfg), "error": err, "ms": ms,
                                       "tflops": harness.tflops(flops, ms)})
            save()
        except Exception as exc:  # noqa: BLE001
            record_error("prefill-dense", name, exc)
    print("prefill done", flush=True)


# ---------------------------------------------------------------------------------------------------- forward
def fwd_section(cases=None):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    F = FwdConfig
    default_cases = [
        (64, 2048, False, [F(128, 128, 4, 3), F(128, 128, 4, 3, tma=False), F(128, 64, 4, 2, tma=False),
                           F(128, 128, 4, 2, tma=False), F(64, 64, 4, 2, tma=False), F(128, 64, 4, 3, tma=False)]),
        (64, 2048, True, [F(64, 64, 4, 2), F(64, 64, 4, 2, tma=False), F(64, 128, 4, 2, tma=False),
                          F(128, 128, 4, 3, tma=False), F(128, 64, 4, 2, tma=False), F(64, 64, 4, 3, tma=False)]),
        (64, 16384, False, [F(128, 128, 4, 3), F(128, 128, 4, 3, tma=False)]),
        (128, 2048, False, [F(128, 64, 4, 2), F(128, 64, 4, 2, tma=False)]),
        (128, 16384, False, [F(128, 64, 4, 2), F(128, 64, 4, 2, tma=False), F(128, 64, 4, 3, tma=False)]),
        (128, 16384, True, [F(128, 64, 4, 2), F(128, 64, 4, 2, tma=False)]),
    ]
    cases = cases or default_cases
    if TINY:
        cases = [(64, 128, c, [F(32, 32, 4, 1), F(32, 32, 4, 1, tma=False)]) for c in (False, True)]
    for d, n, causal, configs in cases:
        batch, heads = (1, 2) if TINY else (16384 // n, 2048 // d)
        torch.manual_seed(n + d)
        q = torch.randn(batch, n, heads, d, dtype=BF16, device=DEV)
        k, v = torch.randn_like(q), torch.randn_like(q)
        rows = min(n, 512)
        ref = attention_ref(q[:1, -rows:], k[:1], v[:1], causal=causal)[0]
        flops = harness.attention_flops(batch, heads, n, n, d, causal=causal)
        try:
            qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))

            def flash():
                with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                    return torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
            ms, _ = timed(flash, 10, 60)
            RESULTS["fwd"].append({"D": d, "N": n, "causal": causal, "variant": "torch-flash", "ms": ms,
                                   "tflops": harness.tflops(flops, ms)})
            if WITH_FLEX:
                from torch.nn.attention.flex_attention import create_block_mask, flex_attention
                torch._dynamo.reset()
                compiled = torch.compile(flex_attention, dynamic=False)
                block_mask = create_block_mask(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, None, None, n, n) \
                    if causal else None
                qc, kc, vc = (t.contiguous() for t in (qt, kt, vt))  # Flex's preferred layout, as in the bench
                ms, _ = timed(lambda: compiled(qc, kc, vc, block_mask=block_mask), 10, 60)
                RESULTS["fwd"].append({"D": d, "N": n, "causal": causal, "variant": "flex", "ms": ms,
                                       "tflops": harness.tflops(flops, ms)})
        except Exception as exc:  # noqa: BLE001
            record_error("fwd-peer", (d, n, causal), exc)
        for cfg in configs:
            try:
                def run(cfg=cfg):
                    return flash_attn_with_config(q, k, v, cfg, causal=causal)[0]
                out = run()
                err = rel_error(out[:1, -rows:], ref)
                entry = {"D": d, "N": n, "causal": causal, "variant": str(cfg), "error": err,
                         "nan": bool(torch.isnan(out).any())}
                if err < 1e-2 and not entry["nan"]:
                    ms, _ = timed(run, 10, 60)
                    entry.update(ms=ms, tflops=harness.tflops(flops, ms))
                RESULTS["fwd"].append(entry)
                save()
            except Exception as exc:  # noqa: BLE001
                record_error("fwd", (d, n, causal, str(cfg)), exc)
        del q, k, v
        sync()
    print("fwd done", flush=True)


# ---------------------------------------------------------------------------------------------------- backward
def bwd_section(configs_by_dim=None, shapes=None):
    """Backward tiles: exactness at 1024 tokens (the float64 reference is quadratic in memory), timing at
    B·N = 16k. configs_by_dim: head dim -> BwdConfigs; shapes: (D, N, causal) cases."""
    B = BwdConfig
    configs_by_dim = configs_by_dim or {128: [B(128, 64, 128, 64, 8, 2, False), B(128, 64, 128, 64, 8, 3, False),
                                              B(128, 32, 128, 32, 8, 4, False), B(128, 64, 128, 64, 8, 4, False)]}
    shapes = shapes or [(128, 16384, False), (128, 16384, True), (128, 4096, False)]
    if TINY:
        configs_by_dim = {64: [B(16, 16, 16, 16, 4, 1, False)]}
        shapes = [(64, 128, False), (64, 128, True)]
    for d, n, causal in shapes:
        heads = 2 if TINY else 2048 // d
        batch = 1 if TINY else 16384 // n
        for cfg in configs_by_dim[d]:
            try:
                torch.manual_seed(d + n + causal)
                small = 256 if TINY else 1024
                q, k, v, do = (torch.randn(1, small, heads, d, dtype=BF16, device=DEV) for _ in range(4))
                o, lse = ioattn.flash_attn_func(q, k, v, causal=causal, return_lse=True)
                refs = [t.double().requires_grad_() for t in (q, k, v)]
                attention_ref(*refs, causal=causal, differentiable=True)[0].backward(do.double())
                dq, dk, dv, _ = attention_bwd(do, q, k, v, o, lse, scale=d ** -0.5, causal=causal, config=cfg)
                errs = [rel_error(g, r.grad) for g, r in zip((dq, dk, dv), refs)]
                entry = {"D": d, "N": n, "causal": causal, "variant": str(cfg), "errors": errs}
                if max(errs) < 1e-2:
                    q, k, v, do = (torch.randn(batch, n, heads, d, dtype=BF16, device=DEV) for _ in range(4))
                    o, lse = ioattn.flash_attn_func(q, k, v, causal=causal, return_lse=True)
                    flops = 2.5 * harness.attention_flops(batch, heads, n, n, d, causal=causal)

                    def run(cfg=cfg, q=q, k=k, v=v, do=do, o=o, lse=lse):
                        return attention_bwd(do, q, k, v, o, lse, scale=d ** -0.5, causal=causal, config=cfg)
                    ms = harness.time_ms(run, DEV, warmup_ms=10, rep_ms=60).ms
                    entry.update(ms=ms, tflops=harness.tflops(flops, ms))
                RESULTS["bwd"].append(entry)
                save()
            except Exception as exc:  # noqa: BLE001
                record_error("bwd", (d, n, causal, str(cfg)), exc)
            sync()
    print("bwd done", flush=True)


if __name__ == "__main__":
    sections = sys.argv[1:] or ["decode", "prefill", "fwd", "bwd"]
    RESULTS["disclosure"] = harness.collect_disclosure(DEV, "lab/explore1.py " + " ".join(sections))
    RESULTS["ceilings"] = harness.measure_ceilings(DEV, [BF16])
    save()
    for section in sections:
        t = time.time()
        try:
            globals()[f"{section}_section"]()
        except Exception as exc:  # noqa: BLE001
            record_error(section, "section", exc)
        RESULTS[f"{section}_seconds"] = time.time() - t
        save()
    print(json.dumps({k: v for k, v in RESULTS.items() if k.endswith("_seconds")}))
