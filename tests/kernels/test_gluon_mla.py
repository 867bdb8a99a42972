"""The Gluon MLA decode (ioattn.kernels.gluon_mla, `MLAConfig(kernel="gluon")`).

On any machine: the kernels build for sm_90 ahead of time into cubins that are warp-specialized (setmaxnreg), load
by TMA and multiply with mma.sync (16 heads per program) or wgmma (64), spilling no more than measured; every
refusal, by name. On an H100/H200 (`gpu`): the
exactness matrix against the float64 reference over DeepSeek-V3's latent 512 + RoPE 64 (head counts that pad and
span head blocks, pages, splits, empty and one-token sequences, tile boundaries), O and LSE, outputs poisoned with
NaN, NaN in the stale slots past seq_len, CUDA-graph replay with new lengths and tables, the default plan's choice.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from sm90_builds import build_records
from test_gluon_paged import dependent_combine_matches_the_ordered_one, replay_with_new_lengths_and_tables
from test_mla import latent_pool, reference, run_case

from ioattn.ops.mla import GLUON_MLA_DEFAULTS, MLAConfig, explain_mla, mla_paged_attention, mla_workspace
from ioattn.reference import TOLERANCE, lse_error, rel_error

_AOT_SCRIPT = """
import json, sys
import aot
for block_n, stages, page, maxnreg, cache, wide, seesaw, staged in json.loads(sys.argv[1]):
    kernel = aot.gluon_mla_kernel(block_n, stages, page, maxnreg, cache, wide=wide, release=wide, seesaw=seesaw,
                                  stage_out=staged)
    ptx = kernel.asm["ptx"]
    print(json.dumps(dict(case=[block_n, stages, page, maxnreg, cache, wide, seesaw, staged],
                          cubin=kernel.asm["cubin"][:4].hex(),
                          resources=aot.resources(kernel), shared=kernel.metadata.shared,
                          release=ptx.count("griddepcontrol.launch_dependents"),
                          setmaxnreg=ptx.count("setmaxnreg"), tma=ptx.count("cp.async.bulk.tensor"),
                          vector_stores=ptx.count("st.global.v2") + ptx.count("st.global.v4"),
                          row_stores=ptx.count("st.global.v4"),
                          mma=ptx.count("wgmma.mma_async" if wide else "mma.sync"))))
"""

DEFAULT = GLUON_MLA_DEFAULTS[(16, 512)]  # 64-key tiles on mma.sync
GLUON = dict(default=DEFAULT,
             n32=MLAConfig(block_h=16, block_m=16, block_n=32, num_stages=2, maxnreg=128, programs_per_sm=2,
                           kernel="gluon"),
             deep=MLAConfig(block_h=16, block_m=16, block_n=32, num_stages=3, maxnreg=128, kernel="gluon"),
             wgmma=GLUON_MLA_DEFAULTS[(128, 512)],
             wgmma_deep=MLAConfig(block_h=64, block_m=64, block_n=32, num_warps=8, num_stages=3, kernel="gluon"),
             seesaw=MLAConfig(block_h=64, block_m=64, block_n=64, num_warps=8, num_stages=2, kernel="gluon",
                              seesaw=True),
             # O through the ring's stages (the 64-head default) or stored straight from the accumulator
             staged=dataclasses.replace(DEFAULT, stage_out=True),
             wgmma_direct=dataclasses.replace(GLUON_MLA_DEFAULTS[(128, 512)], stage_out=False),
             seesaw_staged=MLAConfig(block_h=64, block_m=64, block_n=64, num_warps=8, num_stages=2, kernel="gluon",
                                     seesaw=True, stage_out=True))


def test_aot_build_for_sm90_is_warp_specialized_by_tma_and_spills_what_was_measured():
    # each build with the spill bytes it was measured with: the defaults (64-key tiles, registers uncapped) spill a
    # little and were still the fastest (bench/results/2026-12-06-gluon-mla-h100); the 32-key tiles spill nothing
    # the seesaw kernel spills loop-invariant chunk descriptors of warpgroup 0 (the default partition: it also holds
    # the kernel's arguments), reloaded from L1 once per chunk
    cases = {(64, 2, 64, None, "bf16", False, False, False): 8, (64, 2, 16, None, "fp16", False, False, False): 8,
             (32, 2, 64, 128, "bf16", False, False, False): 0, (32, 3, 128, 128, "bf16", False, False, False): 0,
             (64, 2, 64, None, "bf16", True, False, False): 96, (32, 3, 64, None, "bf16", True, False, False): 8,
             (64, 2, 64, None, "bf16", True, True, False): 344, (64, 2, 16, None, "fp16", True, True, False): 360,
             (64, 2, 64, None, "bf16", True, False, True): 96, (64, 2, 64, None, "bf16", True, True, True): 336,
             (64, 2, 64, None, "bf16", False, False, True): 8}
    builds = build_records(_AOT_SCRIPT, json.dumps([list(c) for c in cases]))
    assert [tuple(b["case"]) for b in builds] == list(cases)
    for b in builds:
        assert b["cubin"] == "7f454c46", b  # an ELF image
        stack = int(b["resources"].split("STACK:")[1].split()[0])
        assert stack <= cases[tuple(b["case"])] and "LOCAL:0 " in b["resources"], b
        assert b["setmaxnreg"] > 0 and b["tma"] > 0 and b["mma"] > 0, b
        assert b["shared"] <= 227 * 1024, b
        assert b["release"] == int(b["case"][5]), b  # the wide builds let the split combine start early
        assert b["vector_stores"] > 0, b  # O two values per store: its base offsets are specialised as aligned
        assert (b["row_stores"] > 0) == b["case"][7], b  # staged: 16 bytes per thread, whole rows per warp
    from ioattn.kernels.gluon_mla import gluon_mla_decode_kernel

    assert "stride_os" not in gluon_mla_decode_kernel.do_not_specialize


def test_kernel_field_is_checked():
    with pytest.raises(ValueError, match="MLAConfig.kernel must be 'triton' or 'gluon'"):
        MLAConfig(kernel="cuda")
    for name in ("seesaw", "stage_out"):
        with pytest.raises(ValueError, match=f"MLAConfig.{name} is an option of kernel='gluon'"):
            MLAConfig(**{name: True})
        with pytest.raises(ValueError, match=f"MLAConfig.{name} must be a bool"):
            MLAConfig(kernel="gluon", **{name: 1})


def _decode_call(**change):
    """A decode call's q and latent cache (16 heads, latent 512 + RoPE 64, pages of 64, bf16), `change` applied."""
    heads, latent, rope, page = (change.pop(k, d) for k, d in (("heads", 16), ("latent", 512), ("rope", 64),
                                                                ("page", 64)))
    q = torch.zeros(1, heads, latent + rope, dtype=change.pop("dtype", torch.bfloat16)).expand(
        change.pop("batch", 2), -1, -1)  # shapes only: the refusals read no data
    cache = torch.zeros(6, page, 1, latent + rope, dtype=torch.bfloat16)
    return q, change.pop("latent_cache", cache), latent


@pytest.mark.parametrize("change, why", [
    (dict(decode=False), "decode only"),
    (dict(dtype=torch.float32), "float16 or bfloat16 q"),
    (dict(latent=448 + 32), "v_head_dim a multiple of 64 up to 512"),
    (dict(latent=1024), "v_head_dim a multiple of 64 up to 512"),
    (dict(rope=32), "RoPE part of 64 values"),
    (dict(page=8), "blocks of 16 or more tokens"),
    (dict(batch=65536), "at most 65535 sequences"),
    (dict(latent_cache=torch.zeros(6, 65, 1, 576, dtype=torch.bfloat16)[:, :64]), "rows of slots"),
    (dict(latent_cache=torch.zeros(6, 64, 1, 580, dtype=torch.bfloat16)[..., :576]), "rows of slots"),
    (dict(), "needs an sm_90 GPU"),
])
def test_every_refusal_names_what_the_kernel_takes(change, why):
    from ioattn.ops.gluon_mla import gluon_mla_unsupported

    decode = change.pop("decode", True)
    q, cache, latent = _decode_call(**change)
    reason = gluon_mla_unsupported(q, cache, latent, decode=decode)
    if why == "needs an sm_90 GPU" and torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0):
        pytest.skip("this machine has an sm_90 GPU")
    assert reason is not None and why in reason, reason


@pytest.mark.parametrize("change, why", [
    (dict(block_h=32, block_m=32), "block_h and num_warps must be 16 and 4 (mma.sync) or 64 and 8"),
    (dict(num_warps=8), "block_h and num_warps must be 16 and 4 (mma.sync) or 64 and 8"),
    (dict(block_h=64, block_m=64), "block_h and num_warps must be 16 and 4 (mma.sync) or 64 and 8"),
    (dict(block_h=64, block_m=64, num_warps=8, block_n=64, num_stages=3), "bytes of shared memory"),
    (dict(block_n=16), "block_n must be 32 or 64"),
    (dict(block_n=128, block_m=16), "block_n must be 32 or 64"),
    (dict(block_n=64, num_stages=3), "bytes of shared memory"),
    (dict(block_h=64, block_m=64, num_warps=8, maxnreg=200), "at most 168, or None"),
    (dict(block_h=64, block_m=64, num_warps=8, block_n=32, seesaw=True), "config.seesaw takes block_h=64"),
    (dict(block_h=64, block_m=64, num_warps=8, block_n=64, maxnreg=160, seesaw=True), "and maxnreg=None"),
])
def test_configs_it_cannot_build_are_named(change, why):
    from ioattn.ops.gluon_mla import gluon_mla_config_unsupported

    config = MLAConfig(**{**dict(block_h=16, block_m=16, block_n=32, num_stages=2, kernel="gluon"), **change})
    reason = gluon_mla_config_unsupported(config, 512)
    assert reason is not None and why in reason, reason
    for config in GLUON.values():
        assert gluon_mla_config_unsupported(config, 512) is None, config


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal of a machine without an sm_90 GPU")
def test_refused_without_an_sm90_gpu_naming_the_config():
    cache, table = latent_pool([20, 70], page=16, dim=576, dtype=torch.bfloat16, device="cpu")
    q = torch.randn(2, 16, 576, dtype=torch.bfloat16)
    lens = torch.tensor([20, 70], dtype=torch.int32)
    for run in (mla_paged_attention, explain_mla):  # refused by the plan, before the interpreter's float32 upcast
        with pytest.raises(ValueError, match="config.kernel='gluon': the Gluon MLA kernel needs an sm_90 GPU"):
            run(q, cache, table, lens, v_head_dim=512, backend="triton", config=DEFAULT)
    with pytest.raises(ValueError, match="config.kernel='gluon': config.block_n must be 32 or 64"):
        mla_paged_attention(q, cache, table, lens, v_head_dim=512, backend="triton",
                            config=MLAConfig(block_h=16, block_m=16, block_n=16, kernel="gluon"))
    with pytest.raises(ValueError, match="config.kernel='gluon': the Gluon MLA kernel is decode only"):
        mla_paged_attention(q, cache, table, lens, v_head_dim=512, backend="triton", config=DEFAULT,
                            cu_seqlens_q=torch.tensor([0, 1, 2], dtype=torch.int32), max_seqlen_q=1)
    # the default plan stays on the Triton kernel here, and says why
    plan = explain_mla(q, cache, table, lens, v_head_dim=512, backend="triton")
    assert "mla_attention_kernel" in str(plan) and "gluon" not in str(plan).split("(")[0], str(plan)


# -- on the GPU --------------------------------------------------------------------------------------------------

LENGTHS = [1000, 17, 0, 4096, 513, 1, 32, 33, 64]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, heads, page, config", [
    # every value of each axis at least once; each case one build (the kernel specialises on page and tiles)
    (torch.bfloat16, 16, 64, "default"),
    (torch.float16, 16, 16, "default"),
    (torch.bfloat16, 16, 128, "deep"),
    (torch.bfloat16, 16, 32, "n32"),
    (torch.bfloat16, 5, 64, "default"),  # rows 5..15 padding
    (torch.bfloat16, 40, 64, "default"),  # three head blocks, the last partly padding
    (torch.float16, 128, 256, "default"),
    (torch.bfloat16, 128, 64, "wgmma"),  # two programs of 64 heads
    (torch.float16, 40, 16, "wgmma"),  # one program, rows 40..63 padding
    (torch.bfloat16, 200, 32, "wgmma_deep"),  # four programs, the last partly padding
    (torch.bfloat16, 128, 64, "seesaw"),
    (torch.float16, 40, 16, "seesaw"),
    (torch.bfloat16, 72, 128, "seesaw"),  # two programs, the second 8 heads and 56 rows of padding
    (torch.bfloat16, 16, 64, "staged"),
    (torch.float16, 40, 16, "staged"),
    (torch.bfloat16, 128, 64, "wgmma_direct"),
    (torch.float16, 40, 16, "wgmma_direct"),
    (torch.bfloat16, 128, 64, "seesaw_staged"),
    (torch.float16, 72, 16, "seesaw_staged"),
])
def test_deepseek_v3_shapes_on_gpu(dtype, heads, page, config):
    for splits in (1, 3, 0):
        run_case("cuda", seq_lens=LENGTHS, heads=heads, latent=512, rope=64, page=page, dtype=dtype,
                 num_splits=splits, config=GLUON[config])


@pytest.mark.gpu
def test_smaller_latent_on_gpu():
    run_case("cuda", seq_lens=[300, 45, 0], heads=16, latent=256, rope=64, page=16, dtype=torch.bfloat16,
             num_splits=2, config=DEFAULT)


@pytest.mark.gpu
def test_default_plan_takes_gluon_at_16_and_128_heads_on_sm90():
    seq_lens = [300, 40, 1, 77, 128, 5, 64, 900]
    cache, table = latent_pool(seq_lens, page=64, dim=576, dtype=torch.bfloat16, device="cuda")
    lens = torch.tensor(seq_lens, dtype=torch.int32, device="cuda")
    sm90 = torch.cuda.get_device_capability() == (9, 0)
    # 128 heads take the wgmma kernel from 8 sequences (GLUON_MLA_MIN_BATCH), 16 heads and fewer from one
    for heads, batch, gluon in ((16, 1, sm90), (8, 8, sm90), (128, 8, sm90), (128, 7, False), (64, 8, False)):
        q = torch.randn(batch, heads, 576, dtype=torch.bfloat16, device="cuda")
        plan = str(explain_mla(q, cache, table[:batch], lens[:batch], v_head_dim=512))
        assert ("gluon_mla_decode_kernel" in plan) == gluon, plan
        assert ("producer warp, wgmma" in plan) == (gluon and heads == 128), plan
        assert "seesaw" not in plan, plan  # a table of 15 pages: 960 keys, fewer than SEESAW_MIN_KEYS
    # the seesaw schedule where each program walks SEESAW_MIN_KEYS keys or more (the table's capacity per split)
    q = torch.randn(8, 128, 576, dtype=torch.bfloat16, device="cuda")
    wide = torch.zeros(8, 64, dtype=torch.int32, device="cuda")
    wide[:, :table.shape[1]] = table[:8]
    # 4096 keys: the heuristic splits 8 sequences x 2 head blocks 8 ways on 132 SMs (512 keys per program)
    for splits, seesaw in ((0, False), (1, sm90), (2, sm90), (3, False)):
        plan = explain_mla(q, cache, wide, lens[:8], v_head_dim=512, num_splits=splits)
        assert ("wgmma, seesaw" in str(plan)) == seesaw and plan.config.seesaw == seesaw, (splits, str(plan))
    explicit = explain_mla(q, cache, wide, lens[:8], v_head_dim=512, config=GLUON["wgmma"])
    assert "seesaw" not in str(explicit), str(explicit)  # an explicit config is taken as given
    # 16 heads split for one program per two SMs where each then walks <= HALF_GRID_MAX_KEYS keys (960 here)
    q = torch.randn(8, 16, 576, dtype=torch.bfloat16, device="cuda")
    plan = explain_mla(q, cache, table[:8], lens[:8], v_head_dim=512)
    half = max(1, min(torch.cuda.get_device_properties(0).multi_processor_count // 2 // 8, table.shape[1]))
    assert (plan.num_splits == half and "one program per two SMs" in str(plan)) == sm90, str(plan)
    if sm90:  # an explicit config is taken as given: one program per SM
        assert explain_mla(q, cache, table[:8], lens[:8], v_head_dim=512, config=GLUON["default"]).num_splits > half
    q = torch.randn(2, 16, 576, dtype=torch.bfloat16, device="cuda")
    multi = str(explain_mla(q, cache, table[:2], lens[:2], v_head_dim=512, cu_seqlens_q=torch.tensor(
        [0, 1, 2], dtype=torch.int32, device="cuda"), max_seqlen_q=1))
    assert "mla_attention_kernel" in multi, multi


@pytest.mark.gpu
def test_stale_nan_rows_past_seq_len_are_never_read_on_gpu():
    # The last block's slots past seq_len hold NaN: TMA brings the whole page in, and neither the scores nor
    # P·V (V is the same rows) may see them.
    seq_lens = [300, 40, 17, 64]
    cache, table = latent_pool(seq_lens, page=64, dim=576, dtype=torch.bfloat16, device="cuda")
    for b, n in enumerate(seq_lens):
        if n % 64:
            cache[int(table[b, (n - 1) // 64]), n % 64:] = float("nan")
    q = torch.randn(len(seq_lens), 16, 576, dtype=torch.bfloat16, device="cuda")
    lens = torch.tensor(seq_lens, dtype=torch.int32, device="cuda")
    ref, _ = reference(q, cache, table, seq_lens, [1] * len(seq_lens), 512, 0.1)
    for cfg in GLUON.values():
        for splits in (1, 3):
            out = mla_paged_attention(q, cache, table, lens, v_head_dim=512, softmax_scale=0.1, num_splits=splits,
                                      config=cfg)
            assert rel_error(out, ref) < TOLERANCE[torch.bfloat16], (cfg, splits)


@pytest.mark.gpu
def test_rising_scores_take_the_conditional_rescale_on_gpu():
    # channel 0 of the latent rises along each sequence, so scores grow by far more than 2**8 per tile: every
    # tile moves the running max (the path random inputs rarely take after the first tile)
    seq_lens = [2000, 333]
    cache, table = latent_pool(seq_lens, page=64, dim=576, dtype=torch.bfloat16, device="cuda")
    for b, n in enumerate(seq_lens):
        positions = torch.arange(n, device="cuda")
        slots = table[b, positions // 64].long() * 64 + positions % 64
        cache.view(-1, 576)[slots, 0] = (positions.float() / 16).to(torch.bfloat16)
    q = torch.randn(2, 16, 576, dtype=torch.bfloat16, device="cuda")
    q[..., 0] = 8.0
    lens = torch.tensor(seq_lens, dtype=torch.int32, device="cuda")
    ref, ref_lse = reference(q, cache, table, seq_lens, [1, 1], 512, 1.0)
    for splits in (1, 4):
        out, lse = mla_paged_attention(q, cache, table, lens, v_head_dim=512, softmax_scale=1.0, num_splits=splits,
                                       config=DEFAULT, return_lse=True)
        assert rel_error(out, ref) < TOLERANCE[torch.bfloat16], splits
        assert lse_error(lse, ref_lse.t()) < 1e-2, splits


@pytest.mark.gpu
@pytest.mark.parametrize("config", ["default", "staged", "wgmma", "seesaw", "seesaw_staged"])
def test_dependent_combine_after_the_gluon_kernel_on_gpu(config):
    seq_lens = [900, 40, 0, 333]
    cache, table = latent_pool(seq_lens, page=64, dim=576, dtype=torch.bfloat16, device="cuda")
    lens = torch.tensor(seq_lens, dtype=torch.int32, device="cuda")
    heads = 16 if config == "default" else 128
    q = torch.randn(len(seq_lens), heads, 576, dtype=torch.bfloat16, device="cuda")
    workspace = mla_workspace(len(seq_lens), heads, 512, max_splits=8, device="cuda")

    def call(dependent, out):
        return mla_paged_attention(q, cache, table, lens, v_head_dim=512, softmax_scale=0.07, out=out, num_splits=5,
                                   workspace=workspace, config=GLUON[config], dependent_combine=dependent,
                                   validate=False)

    dependent_combine_matches_the_ordered_one(call)
    ref, _ = reference(q, cache, table, seq_lens, [1] * len(seq_lens), 512, 0.07)
    assert rel_error(call(True, None), ref) < TOLERANCE[torch.bfloat16]


@pytest.mark.gpu
def test_cuda_graph_replays_with_new_lengths_and_tables():
    seq_lens = [700, 33, 128]
    cache, table = latent_pool(seq_lens, page=64, dim=576, dtype=torch.bfloat16, device="cuda", spare_blocks=20)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device="cuda")
    q = torch.randn(3, 16, 576, dtype=torch.bfloat16, device="cuda")
    out = torch.empty(3, 16, 512, dtype=torch.bfloat16, device="cuda")

    def step():
        mla_paged_attention(q, cache, table, lens, v_head_dim=512, softmax_scale=0.05, out=out, num_splits=1,
                            config=DEFAULT, validate=False)

    new_lens = replay_with_new_lengths_and_tables(step, lens, table, q, out)
    ref, _ = reference(q, cache, table, new_lens, [1] * 3, 512, 0.05)
    assert rel_error(out, ref) < TOLERANCE[torch.bfloat16]


def test_tuning_candidates_include_the_gluon_decode():
    """`bench decode --mla --tune` times the Gluon decode's configurations beside the Triton ones (decode only):
    every one builds (gluon_mla_config_unsupported), 64 heads per program only where there are 64 heads."""
    from ioattn.ops.gluon_mla import gluon_mla_config_unsupported
    from ioattn.ops.mla import candidate_configs

    for heads in (16, 128):
        gluon = [c for c in candidate_configs(heads, decode=True) if c.kernel == "gluon"]
        assert gluon and all(gluon_mla_config_unsupported(c, 512) is None for c in gluon)
        assert {c.block_h for c in gluon} == ({16} if heads == 16 else {16, 64})
        assert {c.block_n for c in gluon} == {32, 64}
        assert any(c.seesaw for c in gluon) == (heads == 128) and len(set(gluon)) == len(gluon)
    assert all(c.kernel == "triton" for c in candidate_configs(128, decode=False))
