"""Device exploration 10: chunked prefill by gathering the paged context into a packed buffer and running the
dense varlen forward, against the paged kernel and the dense forward (4k new tokens on a 4k context, 32/8
heads, D=128, page 16); and split counts for 32/32-head decode at B=8 (per-layer time over 32 cache copies).

PYTHONPATH=. python3 lab/explore10.py; writes $OUT/explore10.json (results:
bench/results/2026-12-01-s5-explore10-h200.json; its "gather" row is the torch index_select the script used,
the library's path uses `gather_cache`). On a CPU: toy shapes.
"""
import itertools
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import explore1 as e1  # noqa: E402

import torch  # noqa: E402

import ioattn  # noqa: E402
from ioattn.bench.decode import capture_graph, chunked_prefill_inputs, paged_pool  # noqa: E402
from ioattn.ops.paged import paged_attention, paged_workspace  # noqa: E402
from ioattn.reference import attention_ref, rel_error  # noqa: E402

DEV, BF16, TINY = e1.DEV, e1.BF16, e1.TINY


def timed_layers(fn, layers):
    ms, how = e1.timed(fn)
    return ms / layers, how


def prefill_section():
    hq, hkv, d = (4, 2, 64) if TINY else (32, 8, 128)
    new = 64 if TINY else 4096
    inputs = chunked_prefill_inputs(hq, hkv, d, new, new, 16, BF16, DEV)
    q, k, v = inputs.q, inputs.k, inputs.v
    table, cu, lens = inputs.table, inputs.cu_seqlens_q, inputs.seq_lens
    total = 2 * new
    rows_ref = min(new, 256)
    ref, _ = attention_ref(q[:, -rows_ref:], k, v, causal=True)
    flops = 4 * hq * new * total * d * 0.75
    cu_k = torch.tensor([0, total], dtype=torch.int32, device=DEV)
    flat_k = inputs.k_cache.view(-1, hkv, d)
    flat_v = inputs.v_cache.view(-1, hkv, d)
    slots = (table[0].long()[:, None] * 16 + torch.arange(16, device=DEV)[None, :]).reshape(-1)

    def gather():
        return flat_k.index_select(0, slots), flat_v.index_select(0, slots)

    def gather_dense():
        kk, vv = gather()
        return ioattn.flash_attn_varlen_func(q[0], kk, vv, cu, cu_k, new, total, causal=True)

    variants = {
        "dense": (lambda: ioattn.flash_attn_func(q, k, v, causal=True), lambda o: o[:, -rows_ref:]),
        "paged": (lambda: paged_attention(q[0], inputs.k_cache, inputs.v_cache, table, lens, cu_seqlens_q=cu,
                                          max_seqlen_q=new), lambda o: o[None, -rows_ref:]),
        "gather+dense": (gather_dense, lambda o: o[None, -rows_ref:]),
        "gather": (gather, None),
    }
    for name, (fn, pick) in variants.items():
        try:
            err = rel_error(pick(fn()), ref) if pick else None
            ms, how = e1.timed(fn)
            e1.RESULTS["prefill"].append({"variant": name, "ms": ms, "tflops": flops / ms / 1e9, "error": err,
                                          "how": how})
            print("prefill", name, round(ms * 1e3, 1), "us", round(flops / ms / 1e9, 1), "TFLOP/s", err, flush=True)
        except Exception as exc:  # noqa: BLE001
            e1.record_error("prefill", name, exc)
        e1.save()


def decode_section(heads=None, shapes=None, split_counts=(1, 2, 3, 4), layers=None, layouts=(("paged", 16),),
                   configs=(None,), dependent_options=(None,), check_graph=False, profile=False):
    """Per-layer µs of paged_attention over `layers` cache copies in one graph, per (B, L), layout, split count,
    decode config and combine launch. layouts: (name, block size) pairs, "paged" shuffled through the pool,
    anything else in order; configs: `PagedConfig`s (None = the default); dependent_options: values of
    paged_attention's `dependent_combine` (None: its default, by programmatic dependent launch on sm_90+; False:
    in stream order). check_graph replays the timed graph once more on a NaN-poisoned output and checks that
    output; profile adds the torch-profiler kernel list of 5 replays."""
    hq, hkv = heads or ((4, 4) if TINY else (32, 32))
    d = 64 if TINY else 128
    layers = layers or (2 if TINY else 32)
    for (batch, length), (layout, page) in ((shape, lay) for shape in (shapes or ([(2, 256)] if TINY else
                                                                                 [(8, 16384), (8, 32768)]))
                                            for lay in layouts):
        q, k, v, lens, ref, kv_bytes = e1.decode_inputs(batch, length, hq, hkv, d)
        k_cache, v_cache, table = paged_pool(k, v, page, layout == "paged")
        del k, v
        copies = [(k_cache, v_cache)] + [(k_cache.clone(), v_cache.clone()) for _ in range(layers - 1)]
        for splits, config, dependent in itertools.product(split_counts, configs, dependent_options):
            ws = paged_workspace(batch, hq, d, max_splits=splits, device=DEV)
            out = torch.full_like(q, float("nan"))

            def fwd(splits=splits, ws=ws, out=out, config=config, dependent=dependent):
                for kc, vc in copies:
                    paged_attention(q, kc, vc, table, lens, out=out, workspace=ws, num_splits=splits, config=config,
                                    dependent_combine=dependent)
                return out
            what = (batch, length, layout, splits, config_name(config), dependent)
            try:
                err = rel_error(fwd()[0], ref)
                ms, how = timed_layers(fwd, layers)
                row = {"B": batch, "L": length, "heads": f"{hq}/{hkv}", "layout": layout, "page": page,
                       "layers": layers, "splits": splits, "config": config_name(config), "us": ms * 1e3,
                       "tbps": kv_bytes / ms / 1e9, "error": err, "how": how}
                if dependent is not None:
                    row["dependent_combine"] = dependent
                if check_graph or profile:
                    graphed, _ = capture_graph(fwd, DEV)
                if check_graph:
                    out.fill_(float("nan"))
                    graphed()
                    e1.sync()
                    row["graph_error"] = rel_error(out[0], ref)
                if profile:
                    row["kernels"] = {key: {"calls": n, "us_per_call": t / n}
                                      for key, (n, t) in e1.kernel_times(graphed, 5).items()}
                e1.RESULTS["decode"].append(row)
                print("decode", *what, layers, round(ms * 1e3, 1), "us", round(kv_bytes / ms / 1e9, 2), "TB/s", err,
                      row.get("graph_error", ""), row.get("kernels", ""), flush=True)
            except Exception as exc:  # noqa: BLE001
                e1.record_error("decode", what, exc)
            e1.save()
        del copies
        e1.sync()


def config_name(config):
    return "default" if config is None else (f"n{config.block_n} w{config.num_warps} s{config.num_stages} "
                                             f"r{config.maxnreg}")


if __name__ == "__main__":
    e1.save_as("explore10")
    e1.RESULTS["disclosure"] = e1.harness.collect_disclosure(DEV, "lab/explore10.py")
    e1.RESULTS["ceilings"] = e1.harness.measure_ceilings(DEV, [BF16])
    prefill_section()
    decode_section()
    e1.save()
    print(e1.RESULTS["errors"])
