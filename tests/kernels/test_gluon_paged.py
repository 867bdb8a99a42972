"""The Gluon paged decode (ioattn.kernels.gluon_paged, `PagedConfig(kernel="gluon")`).

On any machine: the kernel builds for sm_90 ahead of time into a cubin that is warp-specialized (setmaxnreg), loads
by TMA and multiplies with mma.sync, spilling nothing; the refusals that need no GPU. On an H100/H200 (`gpu`): the
exactness matrix against the float64 reference (fp8 caches: on the dequantized cache), O and LSE, outputs poisoned
with NaN, stale NaN codes past seq_len in the last block, CUDA graphs, the default plan's choice (NaN inside a
sequence reaching exactly its heads: tests/kernels/test_paged_fp8.py, for both kernels).
"""

from __future__ import annotations

import json

import pytest
import torch
from sm90_builds import build_records
from test_paged import make_paged_cache
from test_paged import reference as reference_16_bit
from test_paged import run_case as run_16_bit
from test_paged_fp8 import FORMATS, fp8_pool, reference
from test_paged_fp8 import run_case as run_fp8

from ioattn.ops.paged import PagedConfig, explain_paged, paged_attention, paged_workspace
from ioattn.reference import TOLERANCE, lse_error, rel_error

_AOT_SCRIPT = """
import json, sys
import aot
for cache, head_dim, block_n, stages, maxnreg, threshold, release in json.loads(sys.argv[1]):
    kernel = aot.gluon_paged_kernel(cache, head_dim, block_n, stages, maxnreg, threshold=threshold, release=release)
    ptx = kernel.asm["ptx"]
    print(json.dumps(dict(case=[cache, head_dim, block_n, stages, maxnreg, threshold, release],
                          release=ptx.count("griddepcontrol.launch_dependents"),
                          cubin=kernel.asm["cubin"][:4].hex(),
                          resources=aot.resources(kernel), shared=kernel.metadata.shared,
                          setmaxnreg=ptx.count("setmaxnreg"), tma=ptx.count("cp.async.bulk.tensor"),
                          mma=ptx.count("mma.sync"))))
"""

GLUON = dict(fp8=PagedConfig(block_m=16, block_n=32, num_stages=4, maxnreg=80, kernel="gluon"),
             wide=PagedConfig(block_m=16, block_n=64, num_stages=2, maxnreg=96, kernel="gluon"))


def test_aot_build_for_sm90_is_warp_specialized_tma_and_spills_nothing():
    # the last field: the build lets a dependent launch (the split combine) start early
    cases = [["e4m3", 128, 64, 2, 96, 0, False], ["bf16", 128, 64, 2, 96, 0, False],  # without conditional rescale
             ["e4m3", 128, 64, 2, 96, 8, True], ["bf16", 128, 64, 2, 96, 8, True],  # the defaults at head dim 128
             ["e4m3", 128, 32, 4, 80, 0, False], ["e5m2", 128, 32, 4, 80, 0, False], ["e4m3", 64, 64, 4, 80, 0, False],
             ["e4m3", 256, 32, 2, 128, 0, False], ["bf16", 256, 32, 2, 128, 0, False]]
    builds = build_records(_AOT_SCRIPT, json.dumps(cases))
    assert [b["case"] for b in builds] == cases
    for b in builds:
        assert b["cubin"] == "7f454c46", b  # an ELF image
        # no spills, but for the fp8 tile's 32 bytes without conditional rescale (96 registers: four programs per SM)
        stack = int(b["resources"].split("STACK:")[1].split()[0])
        assert stack <= (32 if b["case"] == cases[0] else 0) and "LOCAL:0 " in b["resources"], b
        assert b["setmaxnreg"] > 0 and b["tma"] > 0 and b["mma"] > 0, b
        assert b["shared"] <= 227 * 1024, b
        assert b["release"] == int(b["case"][-1]), b


def test_kernel_and_threshold_fields_are_checked():
    with pytest.raises(ValueError, match="PagedConfig.kernel must be 'triton' or 'gluon'"):
        PagedConfig(kernel="cuda")
    for bad in (-1.0, float("inf"), float("nan"), "8", True):
        with pytest.raises(ValueError, match="PagedConfig.rescale_threshold must be a finite number >= 0"):
            PagedConfig(kernel="gluon", rescale_threshold=bad)
    with pytest.raises(ValueError, match="rescale_threshold is the Gluon kernel's"):
        PagedConfig(rescale_threshold=8.0)
    assert PagedConfig(kernel="gluon", rescale_threshold=8).rescale_threshold == 8


def _decode_call(**change):
    """A decode call's q and caches (32/8 heads, D 128, pages of 16, bf16), with `change` applied."""
    heads, kv_heads, head_dim, page = (change.pop(k, d) for k, d in (("heads", 32), ("kv_heads", 8),
                                                                      ("head_dim", 128), ("page", 16)))
    q = torch.zeros(2, heads, head_dim, dtype=change.pop("dtype", torch.bfloat16))
    k = torch.zeros(6, page, kv_heads, head_dim, dtype=torch.bfloat16)
    return q, change.pop("k_cache", k), change.pop("v_cache", k)


@pytest.mark.parametrize("change, why", [
    (dict(decode=False), "decode only"),
    (dict(window_left=128), "no left window or sinks"),
    (dict(sink_tokens=4), "no left window or sinks"),
    (dict(dtype=torch.float32), "float16 or bfloat16 q"),
    (dict(head_dim=96), "head_dim in (64, 128, 256)"),
    (dict(page=8), "blocks of 16 or more tokens"),
    (dict(heads=64, kv_heads=2), "at most 16 query heads per KV head"),
    (dict(k_cache=torch.zeros(6, 8, 16, 128, dtype=torch.bfloat16).transpose(1, 2)), "k_cache as rows of slots"),
    (dict(v_cache=torch.zeros(6, 16, 8, 130, dtype=torch.bfloat16)[..., :128]), "v_cache as rows of slots"),
    (dict(), "needs an sm_90 GPU"),
])
def test_every_refusal_names_what_the_kernel_takes(change, why):
    from ioattn.ops.gluon_paged import gluon_decode_unsupported

    rules = dict(decode=change.pop("decode", True), window_left=change.pop("window_left", -1),
                 sink_tokens=change.pop("sink_tokens", 0))
    q, k_cache, v_cache = _decode_call(**change)
    reason = gluon_decode_unsupported(q, k_cache, v_cache, **rules)
    if why == "needs an sm_90 GPU" and torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0):
        pytest.skip("this machine has an sm_90 GPU")
    assert reason is not None and why in reason, reason


def test_descriptor_views_an_interleaved_cache_as_rows_of_slots():
    # K and V interleaved in one pool (as tests/kernels/test_paged.py builds them): each slot's row is two heads'
    # worth of K and V, the TMA view steps over it
    from ioattn.ops.gluon_paged import cache_descriptor

    pool = torch.zeros(5, 16, 2, 8, 128, dtype=torch.float8_e4m3fn)
    desc = cache_descriptor(pool[:, :, 0], 16)
    assert desc.shape == [80, 1024] and desc.strides == [2048, 1] and desc.block_shape == [16, 128]
    assert desc.base.data_ptr() == pool.data_ptr()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal of a machine without an sm_90 GPU")
def test_refused_without_an_sm90_gpu_naming_the_config():
    q = torch.randn(2, 4, 64, dtype=torch.bfloat16)
    k = torch.randn(4, 16, 2, 64, dtype=torch.bfloat16)
    table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    lens = torch.tensor([20, 30], dtype=torch.int32)
    for run in (paged_attention, explain_paged):  # refused by the plan, before the interpreter's float32 upcast
        with pytest.raises(ValueError, match="config.kernel='gluon': the Gluon paged kernel needs an sm_90 GPU"):
            run(q, k, k, table, lens, backend="triton", config=PagedConfig(block_m=16, kernel="gluon"))
    with pytest.raises(ValueError, match="config.kernel='gluon': the Gluon paged kernel takes no left window"):
        paged_attention(q, k, k, table, lens, backend="triton", window_size=(8, 0),
                        config=PagedConfig(block_m=16, kernel="gluon"))
    for bad, match in ((dict(block_n=16), "config.block_n must be in 32..128"),
                       (dict(block_n=32, num_warps=8), "at least 8 x num_warps"),
                       (dict(paired_tiles=True), "config.paired_tiles is the Triton kernel's"),
                       (dict(rescale_threshold=16.0), "rescale_threshold must be at most 15")):
        with pytest.raises(ValueError, match=match):
            paged_attention(q, k, k, table, lens, backend="triton", config=PagedConfig(block_m=16, kernel="gluon",
                                                                                        **bad))


# -- on the GPU --------------------------------------------------------------------------------------------------

LENGTHS = [1000, 17, 0, 4096, 513, 1, 32, 33]


WIDE_256 = PagedConfig(block_m=16, block_n=32, num_stages=2, maxnreg=128, kernel="gluon")


@pytest.mark.gpu
@pytest.mark.parametrize("fp8, dtype, heads, kv_heads, head_dim, page, config", [
    # every value of each axis at least once; each case one build (the kernel specialises on all of them)
    (torch.float8_e4m3fn, torch.bfloat16, 32, 8, 128, 16, "wide"),
    (torch.float8_e4m3fn, torch.bfloat16, 32, 8, 128, 16, "fp8"),
    (torch.float8_e5m2, torch.bfloat16, 32, 8, 128, 64, "wide"),
    (torch.float8_e4m3fn, torch.float16, 8, 8, 128, 256, "wide"),
    (torch.float8_e5m2, torch.float16, 16, 1, 64, 16, "fp8"),
    (torch.float8_e4m3fn, torch.bfloat16, 24, 3, 256, 32, "256"),
    (torch.float8_e4m3fn, torch.bfloat16, 40, 4, 128, 128, "wide"),  # group 10: rows 10..15 padding
])
def test_fp8_caches_on_gpu(fp8, dtype, heads, kv_heads, head_dim, page, config):
    cfg = WIDE_256 if config == "256" else GLUON[config]
    for splits in (1, 3, 0):
        run_fp8("cuda", seq_lens=LENGTHS, page=page, group=heads // kv_heads, kv_heads=kv_heads, head_dim=head_dim,
                fp8=fp8, dtype=dtype, num_splits=splits, config=cfg)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, heads, kv_heads, head_dim, page", [
    (torch.bfloat16, 32, 8, 128, 16), (torch.float16, 32, 32, 128, 32), (torch.bfloat16, 16, 1, 64, 256),
    (torch.float16, 24, 3, 256, 16),
])
def test_16_bit_caches_on_gpu(dtype, heads, kv_heads, head_dim, page):
    # make_paged_cache interleaves K and V in one pool: the TMA rows have twice the stride of a plain cache
    cfg = WIDE_256 if head_dim == 256 else GLUON["wide"]
    for splits in (1, 5):
        run_16_bit("cuda", seq_lens=LENGTHS, page=page, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                   dtype=dtype, num_splits=splits, config=cfg)


@pytest.mark.gpu
def test_default_plan_takes_gluon_for_fp8_at_head_dim_128_on_sm90():
    k_cache, v_cache, table, k_scale, v_scale = fp8_pool([300, 40], page=16, kv_heads=8, head_dim=128,
                                                         fp8=torch.float8_e4m3fn, device="cuda")
    q = torch.randn(2, 32, 128, dtype=torch.bfloat16, device="cuda")
    lens = torch.tensor([300, 40], dtype=torch.int32, device="cuda")
    plan = explain_paged(q, k_cache, v_cache, table, lens, k_scale=k_scale, v_scale=v_scale)
    sm90 = torch.cuda.get_device_capability() == (9, 0)
    assert ("gluon_paged_decode_kernel" in str(plan)) == sm90, str(plan)
    q64 = torch.randn(2, 32, 64, dtype=torch.bfloat16, device="cuda")
    k64 = k_cache[..., :64].contiguous()
    assert "paged_attention_kernel" in str(explain_paged(q64, k64, k64, table, lens, k_scale=k_scale,
                                                         v_scale=v_scale))
    windowed = explain_paged(q, k_cache, v_cache, table, lens, window_size=(128, 0), k_scale=k_scale,
                             v_scale=v_scale)
    assert "paged_attention_kernel" in str(windowed) and "no left window" in str(windowed)


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", FORMATS)
def test_stale_nan_codes_past_seq_len_are_never_read_on_gpu(fp8):
    # The last block's slots past seq_len (stale or never written) hold NaN codes: TMA brings the whole block in,
    # and neither the scores nor P·V may see them.
    seq_lens = [300, 40, 17]
    k_cache, v_cache, table, k_scale, v_scale = fp8_pool(seq_lens, page=16, kv_heads=4, head_dim=128, fp8=fp8,
                                                         device="cuda")
    for b, n in enumerate(seq_lens):
        block = int(table[b, (n - 1) // 16])
        k_cache.view(torch.uint8)[block, n % 16:] = 0x7F
        v_cache.view(torch.uint8)[block, n % 16:] = 0xFF
    q = torch.randn(3, 16, 128, dtype=torch.bfloat16, device="cuda")
    lens = torch.tensor(seq_lens, dtype=torch.int32, device="cuda")
    ref, _ = reference(q, k_cache, v_cache, table, seq_lens, [1] * 3, k_scale, v_scale)
    for cfg in GLUON.values():
        for splits in (1, 3):
            out = paged_attention(q, k_cache, v_cache, table, lens, k_scale=k_scale, v_scale=v_scale,
                                  num_splits=splits, config=cfg)
            assert rel_error(out, ref) < TOLERANCE[torch.bfloat16]


def _ramp_first_channel(cache, table, seq_lens, top):
    """Channel 0 of every KV head's key at logical position p set to top * p / 4096 (in the cache's own units),
    so that scores grow along each sequence."""
    flat = cache.view(-1, *cache.shape[2:])
    page = cache.shape[1]
    for b, n in enumerate(seq_lens):
        positions = torch.arange(n, device=cache.device)
        slots = table[b, positions // page].long() * page + positions % page
        flat[slots, :, 0] = (positions.float() * (top / 4096))[:, None].to(cache.dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, None], ids=["e4m3", "bf16"])
def test_conditional_rescale_is_exact_on_gpu(fp8):
    # rescale_threshold > 0: the running max moves only when some P would pass 2**threshold. Random keys (after
    # the first tile, the path without a row max) and keys whose scores rise by more than 2**8 per 64-key tile
    # (every tile takes the rescale), split and not, against float64, O and LSE.
    config = PagedConfig(block_m=16, block_n=64, num_stages=2, maxnreg=96, kernel="gluon", rescale_threshold=8.0)
    lens = torch.tensor(LENGTHS, dtype=torch.int32, device="cuda")
    for growing in (False, True):
        if fp8 is None:
            k_cache, v_cache, table = make_paged_cache(LENGTHS, page=16, kv_heads=8, head_dim=128,
                                                       dtype=torch.bfloat16, device="cuda")
            k_scale = v_scale = None
        else:
            k_cache, v_cache, table, k_scale, v_scale = fp8_pool(LENGTHS, page=16, kv_heads=8, head_dim=128, fp8=fp8,
                                                                 device="cuda")
        q = torch.randn(len(LENGTHS), 32, 128, dtype=torch.bfloat16, device="cuda")
        if growing:
            # channel 0: keys up to 64 (fp8: codes up to 400) and queries large enough that the score rises by
            # about 16 (log2 units) per tile
            _ramp_first_channel(k_cache, table, LENGTHS, 64.0 if fp8 is None else 400.0)
            if fp8 is None:
                q[..., 0] = 128.0
            else:
                q[..., 0] = (20.0 / k_scale).repeat_interleave(4).to(q.dtype)
        if fp8 is None:
            ref, ref_lse = reference_16_bit(q, k_cache, v_cache, table, LENGTHS, [1] * len(LENGTHS))
        else:
            ref, ref_lse = reference(q, k_cache, v_cache, table, LENGTHS, [1] * len(LENGTHS), k_scale, v_scale)
        for splits in (1, 3):
            out = torch.full_like(q, float("nan"))
            _, lse = paged_attention(q, k_cache, v_cache, table, lens, k_scale=k_scale, v_scale=v_scale, out=out,
                                     num_splits=splits, config=config, return_lse=True)
            assert rel_error(out, ref) < TOLERANCE[torch.bfloat16], (growing, splits)
            assert lse_error(lse, ref_lse.t()) < 1e-2, (growing, splits)


def replay_with_new_lengths_and_tables(step, lens, table, q, out) -> list[int]:
    """Capture `step` (sequences of 700, 33 and 128 tokens) in a CUDA graph, then replay it with new lengths, the
    table's rows flipped, new queries and a poisoned output; returns the new lengths."""
    step()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    new_lens = [100, 30, 640]  # within the flipped rows: 128, 33 and 700 tokens of blocks
    lens.copy_(torch.tensor(new_lens, dtype=torch.int32))
    table.copy_(table.flip(0))
    q.normal_()
    out.fill_(float("nan"))
    graph.replay()
    return new_lens


def dependent_combine_matches_the_ordered_one(call) -> None:
    """call(dependent_combine, out) runs a split decode into out: the combine launched by programmatic dependent
    launch after the Gluon kernel gives the same bits as one launched in stream order, eagerly and from a graph."""
    results = []
    for dependent in (True, False):
        eager = torch.full_like(call(dependent, None), float("nan"))
        call(dependent, eager)
        replayed = torch.full_like(eager, float("nan"))
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            call(dependent, replayed)
        graph.replay()
        torch.cuda.synchronize()
        results += [eager, replayed]
    assert all(torch.equal(results[0], r) for r in results[1:])


@pytest.mark.gpu
def test_dependent_combine_after_the_gluon_decode_on_gpu():
    seq_lens = [900, 40, 0, 333]
    k_cache, v_cache, table, k_scale, v_scale = fp8_pool(seq_lens, page=16, kv_heads=8, head_dim=128,
                                                         fp8=torch.float8_e4m3fn, device="cuda")
    lens = torch.tensor(seq_lens, dtype=torch.int32, device="cuda")
    q = torch.randn(len(seq_lens), 32, 128, dtype=torch.bfloat16, device="cuda")
    workspace = paged_workspace(len(seq_lens), 32, 128, max_splits=8, device="cuda")

    def call(dependent, out):
        return paged_attention(q, k_cache, v_cache, table, lens, out=out, k_scale=k_scale, v_scale=v_scale,
                               num_splits=5, workspace=workspace, config=GLUON["wide"], dependent_combine=dependent,
                               validate=False)

    dependent_combine_matches_the_ordered_one(call)
    ref, _ = reference(q, k_cache, v_cache, table, seq_lens, [1] * len(seq_lens), k_scale, v_scale)
    assert rel_error(call(True, None), ref) < TOLERANCE[torch.bfloat16]


@pytest.mark.gpu
def test_cuda_graph_replays_with_new_lengths_and_tables():
    seq_lens = [700, 33, 128]
    k_cache, v_cache, table, k_scale, v_scale = fp8_pool(seq_lens, page=16, kv_heads=8, head_dim=128,
                                                         fp8=torch.float8_e4m3fn, device="cuda", spare_blocks=40)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device="cuda")
    q = torch.randn(3, 32, 128, dtype=torch.bfloat16, device="cuda")
    out = torch.empty_like(q)

    def step():
        paged_attention(q, k_cache, v_cache, table, lens, out=out, k_scale=k_scale, v_scale=v_scale, num_splits=1,
                        config=GLUON["fp8"], validate=False)

    new_lens = replay_with_new_lengths_and_tables(step, lens, table, q, out)
    ref, _ = reference(q, k_cache, v_cache, table, new_lens, [1] * 3, k_scale, v_scale)
    assert rel_error(out, ref) < TOLERANCE[torch.bfloat16]
