"""The Gluon warp-specialized forward (ioattn.kernels.gluon_fwd, launched by ioattn.ops.gluon_forward).

On any machine: the kernel builds for sm_90 ahead of time (Triton's wheel carries ptxas) into a cubin that is
really warp-specialized (setmaxnreg, async wgmma) and spills nothing; the launcher's argument checks that need
no GPU. On an H200 (`gpu`): the exactness matrix against the float64 reference, O and LSE, with `out` poisoned
with NaN before every call.
"""

from __future__ import annotations

import dataclasses
import re
import itertools
import json
import math

import pytest
import torch
from sm90_builds import build_records

from ioattn.ops.gluon_forward import fp8_gluon_config, gluon_config, gluon_forward, gluon_forward_packed, separate_o
from ioattn.reference import TOLERANCE, attention_ref, lse_error, rel_error

_AOT_SCRIPT = """
import json, sys
import aot
for head_dim, causal, dtype, override in json.loads(sys.argv[1]):
    kernel = aot.gluon_forward_kernel(head_dim, causal, "fp8" if dtype.startswith("fp8") else "bf16",
                                      window=dtype == "window", varlen=dtype == "varlen", **override)
    print(json.dumps(dict(case=[head_dim, causal, dtype], cubin=kernel.asm["cubin"][:4].hex(),
                          resources=aot.resources(kernel), shared=kernel.metadata.shared,
                          setmaxnreg=kernel.asm["ptx"].count("setmaxnreg"),
                          wgmma=kernel.asm["ptx"].count("wgmma.mma_async"), loops=aot.matmul_loops(kernel),
                          atomics=kernel.asm["ptx"].count("atom.global"))))
"""
PINGPONG = {"consumers": 2, "maxnreg": 168, "consumer_regs": 240, "pingpong": True, "overlap": True}
OVERRIDES = {"fp8-pingpong": {**PINGPONG, "fp8_p_shared": True},
             "fp8-pingpong-registers": {**PINGPONG, "fp8_p_shared": False},
             "dynamic": {"dynamic": True, "snake": False}}

@pytest.mark.parametrize("change, why", [
    (dict(band=0), "GluonConfig.band must be an int >= 1"),
    (dict(band=2.0), "GluonConfig.band must be an int >= 1"),
    (dict(band=True), "GluonConfig.band must be an int >= 1"),
    (dict(block_n=96), "GluonConfig.block_n must be a power of two in 16..256"),
    (dict(num_warps=3), "GluonConfig.num_warps must be 1, 2, 4, 8 or 16"),
    (dict(maxnreg=300), "GluonConfig.maxnreg must be an int in 32..255"),
    (dict(persistent=1), "GluonConfig.persistent must be a bool"),
    (dict(stages=1), "GluonConfig.stages must be an int in 2..8"),
    (dict(consumer_regs=250), "GluonConfig.consumer_regs must be a multiple of 8 in 24..256"),
    (dict(producer_regs=16), "GluonConfig.producer_regs must be a multiple of 8 in 24..256"),
    (dict(consumers=4), "GluonConfig.consumers must be 2 or 3"),
    (dict(consumers=True), "GluonConfig.consumers must be 2 or 3"),
    (dict(snake=1), "GluonConfig.snake must be a bool"),
    (dict(overlap=False), "GluonConfig.overlap=False needs pingpong=False"),
    (dict(dynamic=True, snake=True), "GluonConfig.dynamic takes the work tiles in order on a persistent grid"),
    (dict(dynamic=True, persistent=False), "GluonConfig.dynamic takes the work tiles in order on a persistent grid"),
    (dict(dynamic=1), "GluonConfig.dynamic must be a bool"),
])
def test_config_fields_are_checked_when_built(change, why):
    with pytest.raises(ValueError, match=re.escape(why)):
        dataclasses.replace(gluon_config(128), **change)



def test_aot_build_for_sm90_spills_nothing_in_its_key_loop():
    cases = [[64, False, "bf16"], [64, True, "bf16"], [128, False, "bf16"], [128, True, "bf16"],
             [256, True, "bf16"], [128, False, "fp8"], [128, True, "fp8"], [128, False, "fp8-pingpong"],
             [128, True, "fp8-pingpong"], [128, False, "fp8-pingpong-registers"], [128, False, "window"],
             [128, True, "varlen"], [64, True, "window"], [64, True, "dynamic"], [128, True, "dynamic"],
             [256, False, "fp8"], [256, True, "fp8"]]
    builds = build_records(_AOT_SCRIPT, json.dumps([[*case, OVERRIDES.get(case[2], {})] for case in cases]))
    assert [b["case"] for b in builds] == cases
    for b in builds:
        head_dim, _, dtype = b["case"]
        cfg = fp8_gluon_config(head_dim) if dtype.startswith("fp8") else gluon_config(
            head_dim, b["case"][1] or dtype == "window")
        cfg = dataclasses.replace(cfg, **OVERRIDES.get(dtype, {}))
        k_step = 32 if dtype.startswith("fp8") else 16  # the K extent of one wgmma instruction
        assert b["cubin"] == "7f454c46", b  # an ELF image
        assert b["setmaxnreg"] > 0 and b["wgmma"] > 0, b  # partitions re-balance registers; tensor-core matmuls
        assert b["shared"] <= 227 * 1024, b
        assert (b["atomics"] > 0) == cfg.dynamic, b  # the dynamic schedule's tile counter only
        # the K/V loop issues S = Q·Kᵀ (head_dim / k_step wgmmas) and P·V (block_n / k_step): copies without a
        # score mask and with one in each consumer. The per-work-tile state of the persistent loop may spill a
        # little (measured up to 152 bytes, fp8 causal), paid once per work tile
        # (fp8 at D 256, two serial warpgroups: P·V as four wgmma chains of 64 columns)
        fp8_quarters = dtype == "fp8" and head_dim > 128
        pv_chains = 4 if fp8_quarters else 1
        # (innermost: no other loop's back branch inside; the SASS may place an outer loop's head inside an inner one)
        innermost = [loop for loop in b["loops"]
                     if not any(loop["start"] <= other["end"] < loop["end"] for other in b["loops"])]
        kv_loops = [loop for loop in innermost if loop["wgmma"] == (head_dim + pv_chains * cfg.block_n) // k_step]
        assert len(kv_loops) >= 2 * cfg.consumers, b
        # each consumer's unmasked copy (the shortest loops) spills nothing; fp8 with P from registers reloads a
        # row scale once a tile (160 registers of three warpgroups, or two ping-pong warpgroups' S, P·V and O)
        # (fp8 D 256 on two serial warpgroups, O 128 registers of 240: 4-7 values, against 144 for the overlapped
        # loop's whole fresh accumulator)
        allowed = 8 if fp8_quarters else {"fp8": 2, "fp8-pingpong-registers": 2}.get(dtype, 0)
        assert all(loop["spills"] <= allowed for loop in kv_loops[:cfg.consumers]), b
        # the masked copies run on a work tile's diagonal tiles only: the fp8 causal ones of the three serial
        # warpgroups (160 registers) on the dynamic schedule reload 9 values a tile (1 on the static one; 15 before
        # O was held in V-scale units)
        assert all(loop["spills"] <= 10 for loop in kv_loops), b
        assert "LOCAL:0 " in b["resources"] and int(b["resources"].split("STACK:")[1].split()[0]) <= 160, b


def test_configs_fit_shared_memory():
    for d, masked in itertools.product((64, 128, 256), (False, True)):
        cfg = gluon_config(d, masked)
        q_tiles = cfg.consumers * 64 * d
        o_tiles = q_tiles if separate_o(d, cfg) else 0  # else O is staged in Q's buffer
        tiles = q_tiles + o_tiles + cfg.stages * 2 * cfg.block_n * d
        assert tiles * 2 <= 227 * 1024 - 1024, (d, cfg)
        assert cfg.stages >= 2 and cfg.block_n >= 64
        # registers: every warpgroup's setmaxnreg within the 64 K of an SM (the producer's padded to a warpgroup)
        consumer_regs = cfg.maxnreg * (cfg.consumers + 1) - cfg.producer_regs - (cfg.consumers - 1) * cfg.consumer_regs
        assert cfg.maxnreg * (cfg.consumers + 1) * 128 <= 65536 and consumer_regs >= 160, (d, cfg)
    assert separate_o(128, gluon_config(128)) and not separate_o(256, gluon_config(256))
    assert gluon_config(64).consumers == 3 and gluon_config(64, masked=True).consumers == 3
    assert not gluon_config(64, masked=True).overlap and gluon_config(64).overlap
    assert all(gluon_config(d, masked=True).snake and not gluon_config(d).snake for d in (128, 256))
    assert gluon_config(64, masked=True).dynamic and not any(gluon_config(d).dynamic for d in (64, 128, 256))


@pytest.mark.parametrize("bad, match", [
    (dict(dtype=torch.float32), "q.dtype"),
    (dict(), "q must be a CUDA tensor"),
    *((dict(window_size=w), "window_size must be two ints") for w in ((-2, 0), (0,), (1.5, 0), "full", (True, 0))),
])
def test_rejects_without_a_gpu(bad, match):
    options = dict(bad)
    q = torch.zeros(1, 8, 2, 64, dtype=options.pop("dtype", torch.bfloat16))
    with pytest.raises(ValueError, match=match):
        gluon_forward(q, q, q, causal=False, **options)


def test_rejects_non_4d():
    q = torch.zeros(8, 2, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="q must be a 4-D tensor"):
        gluon_forward(q, q, q)


# ---------------------------------------------------------------------------------------------------------- GPU

def _hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


needs_hopper = pytest.mark.skipif(not _hopper(), reason="the Gluon forward is sm_90 only")


def _inputs(batch, n_q, n_k, hq, hkv, d, dtype, seed, scale=1.0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(batch, n_q, hq, d, device="cuda", dtype=dtype, generator=g) * scale
    k = torch.randn(batch, n_k, hkv, d, device="cuda", dtype=dtype, generator=g)
    v = torch.randn(batch, n_k, hkv, d, device="cuda", dtype=dtype, generator=g)
    return q, k, v


def _check(q, k, v, causal, softmax_scale=None, config=None, poison=True, window_size=(-1, -1)):
    out = torch.full_like(q, float("nan")) if poison else None
    got, lse = gluon_forward(q, k, v, causal=causal, window_size=window_size, softmax_scale=softmax_scale, out=out,
                             config=config)
    torch.cuda.synchronize()
    if poison:
        assert got.data_ptr() == out.data_ptr()
    ref, ref_lse = attention_ref(q, k, v, causal=causal, window_size=window_size, softmax_scale=softmax_scale)
    err, lerr = rel_error(got, ref), lse_error(lse, ref_lse)
    assert lse.shape == (q.shape[0], q.shape[2], q.shape[1]) and lse.dtype == torch.float32
    assert err < TOLERANCE[q.dtype], f"out error {err}"
    assert lerr < 1e-3, f"LSE error {lerr}"


MATRIX = [(b, n, d, causal, heads, dtype)
          for b in (1, 2) for n in (1, 17, 128, 1000, 4096) for d in (64, 128) for causal in (False, True)
          for heads in ((2, 2), (8, 2)) for dtype in (torch.bfloat16, torch.float16)]


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("b, n, d, causal, heads, dtype", MATRIX,
                         ids=[f"B{b}-N{n}-D{d}-{'causal' if c else 'full'}-H{h[0]}.{h[1]}-{str(t)[6:]}"
                              for b, n, d, c, h, t in MATRIX])
def test_matches_reference(b, n, d, causal, heads, dtype):
    _check(*_inputs(b, n, n, *heads, d, dtype, seed=hash((b, n, d, causal, heads)) % 2**31), causal)


# Nq != Nk, causal bottom-right: Nq > Nk leaves the first Nq - Nk rows without keys (O = 0, LSE = -inf).
RAGGED = [(1, 4096), (17, 1000), (128, 17), (1000, 128), (4096, 1000), (300, 5000), (64, 65), (129, 1)]


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("n_q, n_k", RAGGED)
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_ragged_lengths(n_q, n_k, d, causal, dtype):
    _check(*_inputs(2, n_q, n_k, 8, 2, d, dtype, seed=n_q * 7919 + n_k), causal)


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("pingpong, threshold", [(False, 8.0), (True, 8.0), (False, 0.0)])
@pytest.mark.parametrize("causal", [False, True])
def test_variants(pingpong, threshold, causal):
    for d in (64, 128):
        config = dataclasses.replace(gluon_config(d), pingpong=pingpong, rescale_threshold=threshold)
        for n_q, n_k in ((1000, 1000), (200, 3000), (3000, 200)):
            _check(*_inputs(1, n_q, n_k, 8, 2, d, torch.bfloat16, seed=n_q + n_k), causal, config=config)


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_persistent_grid_walks_many_work_tiles_per_program(d, causal):
    """Several work tiles per program (B 2 x 16 heads x 16 query blocks on ~132 SMs), of mixed lengths under
    causal, the last block's second Q tile wholly past Nq = 1950: every ring lap, Q-buffer hand-over and
    ping-pong turn carries across tiles; the kernel on one program per tile, without ping-pong, or with the work
    tiles in other orders (every head's first query block first, bands of 3 query blocks, whose last band is short,
    or every other round taken from its far end) agrees."""
    q, k, v = _inputs(2, 1950, 3000 if causal else 1950, 16, 4, d, torch.bfloat16, seed=d + causal)
    _check(q, k, v, causal)
    for change in (dict(persistent=False), dict(pingpong=False), dict(band=1), dict(band=3, persistent=False),
                   dict(snake=True), dict(snake=True, band=3)):
        _check(q, k, v, causal, config=dataclasses.replace(gluon_config(d), **change))


@pytest.mark.gpu
@needs_hopper
def test_repeated_calls_launch_the_compiled_kernel_of_their_own_specialization():
    """After its first call a specialization is launched directly (`CompiledLaunches`): calls alternating between an
    LSE buffer 16-byte aligned and one that is not (Triton specializes pointers on it), between shapes, masks and
    head dims, each poisoned, each exact."""
    for d, causal, n in ((128, True, 300), (64, True, 300), (128, False, 77), (128, True, 300), (64, True, 1000)):
        q, k, v = _inputs(2, n, n, 4, 2, d, torch.bfloat16, seed=d + n)
        ref, ref_lse = attention_ref(q, k, v, causal=causal)
        for offset in (0, 1, 0, 1):
            storage = torch.full((2 * 4 * n + 1,), float("nan"), device="cuda")
            lse = storage[offset:offset + 2 * 4 * n].view(2, 4, n)
            out, _ = gluon_forward(q, k, v, causal=causal, out=torch.full_like(q, float("nan")), lse=lse)
            torch.cuda.synchronize()
            assert rel_error(out, ref) < TOLERANCE[torch.bfloat16] and lse_error(lse, ref_lse) < 1e-3, (d, offset)


THREE_CONSUMERS = dict(consumers=3, maxnreg=128, consumer_regs=160, block_n=64, stages=4)


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_dynamic_schedule_computes_every_tile_once_and_matches_the_static_one_bitwise(d, causal):
    """GluonConfig(dynamic=True): the programs take work tiles from a launch-wide counter and hand them to their
    consumers through shared memory. Each tile is computed whole by one program whichever it is, so the output
    equals the static schedule's bit for bit; ~3 tiles per SM of mixed causal lengths, fewer tiles than SMs, two
    and three consumer warpgroups, bands, a window, packed sequences (whose empty query blocks the producer skips
    without handing them over), repeated calls and a CUDA graph replayed on new inputs (the counter is zeroed by
    each launch's own memset)."""
    static = dataclasses.replace(gluon_config(d, masked=causal), snake=False, dynamic=False)
    configs = [dataclasses.replace(static, dynamic=True), dataclasses.replace(static, dynamic=True, band=3)]
    if d == 64:
        configs.append(dataclasses.replace(static, dynamic=True, pingpong=False, overlap=False, **THREE_CONSUMERS))
    for n_q, n_k, heads in ((1950, 3000 if causal else 1950, (16, 4)), (100, 700, (2, 2))):
        q, k, v = _inputs(2, n_q, n_k, *heads, d, torch.bfloat16, seed=d + n_q + causal)
        for config in configs:
            expected = gluon_forward(q, k, v, causal=causal, config=dataclasses.replace(config, dynamic=False))
            for _ in range(2):
                got = gluon_forward(q, k, v, causal=causal, out=torch.full_like(q, float("nan")), config=config)
                assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1]), config
        _check(q, k, v, causal, config=configs[0])
    q, k, v = _inputs(1, 700, 900, 4, 2, d, torch.bfloat16, seed=12)
    _check(q, k, v, False, window_size=(100, 37), config=configs[0])

    lens_q, lens_k = [200, 1, 0, 383, 0, 1000], [300, 64, 50, 383, 10, 1000]
    cu_q, cu_k = (torch.tensor([0, *itertools.accumulate(lens)], device="cuda", dtype=torch.int32)
                  for lens in (lens_q, lens_k))
    q, k, v = (torch.randn(sum(lens), 4, d, device="cuda", dtype=torch.bfloat16) for lens in (lens_q, lens_k, lens_k))
    out = torch.full_like(q, float("nan"))
    lse = torch.empty(4, q.shape[0], device="cuda", dtype=torch.float32)
    gluon_forward_packed(q, k, v, cu_q, cu_k, max(lens_q), window_left=-1, window_right=0 if causal else -1,
                         softmax_scale=d ** -0.5, out=out, lse=lse, config=configs[0])
    ref, ref_lse = attention_ref(q, k, v, causal=causal, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    assert rel_error(out, ref) < TOLERANCE[torch.bfloat16] and lse_error(lse, ref_lse) < 1e-3

    q, k, v = _inputs(2, 1000, 1000, 8, 8, d, torch.bfloat16, seed=5)
    out = torch.empty_like(q)
    graph = torch.cuda.CUDAGraph()
    gluon_forward(q, k, v, causal=causal, out=out, config=configs[0])  # compiled outside the capture
    with torch.cuda.graph(graph):
        gluon_forward(q, k, v, causal=causal, out=out, config=configs[0])
    for seed in (6, 7):
        for t, fresh in zip((q, k, v), _inputs(2, 1000, 1000, 8, 8, d, torch.bfloat16, seed=seed)):
            t.copy_(fresh)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        ref, _ = attention_ref(q, k, v, causal=causal)
        assert rel_error(out, ref) < TOLERANCE[torch.bfloat16]


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("pingpong, overlap", [(True, True), (False, True), (False, False)])
def test_three_consumer_warpgroups(causal, pingpong, overlap):
    """Work tiles of 3 x 64 query rows (FA3's shape at D 64): the ping-pong turn passes round three warpgroups,
    every K/V stage waits for three releases, with the intra-warpgroup overlap or each tile in turn; lengths that
    leave the last work tile's second or third Q tile wholly past Nq, Nq != Nk both ways, GQA, fp16, a sliding
    window, varlen through the same kernel."""
    config = dataclasses.replace(gluon_config(64), pingpong=pingpong, overlap=overlap, **THREE_CONSUMERS)
    for n_q, n_k in ((1, 1), (100, 100), (130, 1000), (1950, 1950), (2000, 300), (193, 4096)):
        _check(*_inputs(2, n_q, n_k, 8, 2, 64, torch.bfloat16, seed=n_q * 7 + n_k), causal, config=config)
    _check(*_inputs(1, 777, 777, 4, 4, 64, torch.float16, seed=11), causal, config=config)
    _check(*_inputs(1, 700, 900, 4, 2, 64, torch.bfloat16, seed=12), False, window_size=(100, 37), config=config)
    many = _inputs(2, 1950, 3000 if causal else 1950, 16, 4, 64, torch.bfloat16, seed=13)  # ~3 work tiles per SM
    _check(*many, causal, config=config)
    _check(*many, causal, config=dataclasses.replace(config, band=3, persistent=False))
    _check(*many, causal, config=dataclasses.replace(config, snake=True))
    lens_q, lens_k = [200, 1, 0, 383], [300, 64, 50, 383]  # packed: no tile may write into the next sequence
    cu_q, cu_k = (torch.tensor([0, *itertools.accumulate(lens)], device="cuda", dtype=torch.int32)
                  for lens in (lens_q, lens_k))
    q, k, v = (torch.randn(sum(lens), 4, 64, device="cuda", dtype=torch.bfloat16) for lens in (lens_q, lens_k, lens_k))
    out = torch.full_like(q, float("nan"))
    lse = torch.empty(4, q.shape[0], device="cuda", dtype=torch.float32)
    gluon_forward_packed(q, k, v, cu_q, cu_k, max(lens_q), window_left=-1, window_right=0 if causal else -1,
                         softmax_scale=0.125, out=out, lse=lse, config=config)
    ref, ref_lse = attention_ref(q, k, v, causal=causal, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    assert rel_error(out, ref) < TOLERANCE[torch.bfloat16] and lse_error(lse, ref_lse) < 1e-3


WINDOWS = [(0, 0), (1, 0), (63, 0), (64, 0), (100, 37), (256, -1), (-1, 200), (500, 500), (3000, 0), (5, 300)]


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("window", WINDOWS, ids=[f"w{left}.{right}" for left, right in WINDOWS])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_sliding_windows(window, d):
    """Windows narrower than a tile, at tile boundaries, wider than the sequence, one side unbounded; Nq < Nk,
    Nq = Nk and Nq > Nk (rows whose window holds no key give 0 and -inf); under ping-pong and without."""
    for n_q, n_k in ((700, 700), (300, 1500), (1500, 300)):
        q, k, v = _inputs(2, n_q, n_k, 8, 2, d, torch.bfloat16, seed=hash((window, d, n_q)) % 2**31)
        _check(q, k, v, False, window_size=window)
    config = dataclasses.replace(gluon_config(d), pingpong=False)
    _check(*_inputs(1, 700, 900, 4, 4, d, torch.float16, seed=d), False, window_size=window, config=config)


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("causal", [False, True])
def test_growing_scores_exercise_the_rescale(causal):
    """Scores that grow along K, far past the threshold, tile after tile: the stale-max path and the rescale
    both run; large scales push P to its 2**threshold bound."""
    q, k, v = _inputs(1, 1024, 4096, 4, 4, 128, torch.float16, seed=3)
    ramp = torch.linspace(0.1, 4.0, k.shape[1], device="cuda", dtype=torch.float16)
    k = (k * ramp[None, :, None, None]).contiguous()
    q = (q.abs() * 2).to(torch.float16)
    _check(q, k, v, causal, softmax_scale=0.5)


@pytest.mark.gpu
@needs_hopper
def test_strided_views_and_head_dim_256():
    qkv = torch.randn(2, 777, 3, 8, 128, device="cuda", dtype=torch.bfloat16)
    q, k, v = qkv.unbind(2)  # (B, N, H, D) views: token stride 3 * H * D
    _check(q, k, v, causal=True)
    _check(q, k, v, causal=False, poison=False)
    for causal in (False, True):
        _check(*_inputs(1, 1000, 1000, 4, 2, 256, torch.bfloat16, seed=5), causal)


@pytest.mark.gpu
@needs_hopper
def test_empty_and_rejected_inputs():
    q, k, v = _inputs(1, 16, 0, 2, 2, 64, torch.bfloat16, seed=0)
    out, lse = gluon_forward(q, k, v)
    assert (out == 0).all() and torch.isneginf(lse).all()
    q, k, v = _inputs(1, 16, 16, 2, 2, 64, torch.bfloat16, seed=0)
    with pytest.raises(ValueError, match="head dim"):
        gluon_forward(q[..., :32].contiguous(), k[..., :32].contiguous(), v[..., :32].contiguous())
    with pytest.raises(ValueError, match="multiple of k/v's heads"):
        three = torch.randn(1, 16, 3, 64, device="cuda", dtype=torch.bfloat16)
        gluon_forward(q, three, three)
    with pytest.raises(ValueError, match="share a dtype"):
        gluon_forward(q, k.half(), v)
    with pytest.raises(ValueError, match="16-byte aligned"):
        gluon_forward(torch.randn(1, 16, 2, 72, device="cuda", dtype=torch.bfloat16)[..., 4:68], k, v)
    with pytest.raises(ValueError, match="softmax_scale"):
        gluon_forward(q, k, v, softmax_scale=-1.0)
    for bad in ((-2, 0), (0,), (1.5, 0), "full"):
        with pytest.raises(ValueError, match="window_size must be two ints"):
            gluon_forward(q, k, v, window_size=bad)
    with pytest.raises(ValueError, match="lse must be a contiguous float32"):
        gluon_forward(q, k, v, lse=torch.empty(1, 2, 16, device="cuda", dtype=torch.bfloat16))
    assert math.isfinite(gluon_forward(q, k, v, causal=True)[1].max().item())


def test_dispatch_takes_gluon_only_where_it_can_and_was_measured_faster(monkeypatch):
    """The decision on any machine: plan() on CPU tensors with the capability and table lookups it combines."""
    import ioattn
    from ioattn.ops import checks, dispatch, gluon_forward
    from ioattn.ops.gluon_forward import gluon_faster

    with monkeypatch.context() as patched:  # an H100 as dispatch sees one: the head dim's tiles, masked or not
        patched.setattr(dispatch, "device_capability", lambda device: (9, 0))
        patched.setattr(dispatch, "gluon_unsupported", lambda inputs, capability: None)
        for d, causal in ((64, True), (64, False), (128, True), (256, False)):
            x = torch.zeros(1, 2048, 2, d, dtype=torch.bfloat16)
            plan = dispatch.plan(checks.validate_dense(x, x, x, causal, (-1, -1), None), "gluon")
            assert plan.backend == "gluon" and plan.config == gluon_forward.gluon_config(d, causal), plan
    table = gluon_forward.GLUON_FASTER  # the committed H100 runs': every head dim from 2k tokens, causal or not
    assert gluon_faster(128, True, 2048, 2048) and gluon_faster(256, False, 8192, 16384)
    assert gluon_faster(64, True, 16384, 16384) and gluon_faster(64, False, 8192, 8192)
    assert all(gluon_faster(d, c, n, 4 * n) is None for (d, c), n in table.items() for n in [n - 1])
    monkeypatch.setattr(gluon_forward, "GLUON_FASTER", {})
    assert gluon_faster(128, True, 16384, 16384) is None
    q = torch.zeros(1, 4, 2, 128, dtype=torch.bfloat16)
    dense = checks.validate_dense(q, q, q, True, (-1, -1), None)
    assert "sm_90 only" in dispatch.gluon_unsupported(dense, None)
    assert "sm_90 only" in dispatch.gluon_unsupported(dense, (8, 0))
    negative = checks.validate_dense(q, q, q, True, (-1, -1), -0.5)
    assert "softmax_scale" in dispatch.gluon_unsupported(negative, (9, 0))
    windowed = checks.validate_dense(q, q, q, False, (3, 0), None)
    assert "CUDA tensor" in dispatch.gluon_unsupported(windowed, (9, 0))  # windows pass; CPU tensors do not
    masked = checks.validate_sdpa(q.transpose(1, 2), q.transpose(1, 2), q.transpose(1, 2),
                                  torch.ones(4, 4, dtype=torch.bool), False, None, False)
    assert "attn_mask" in dispatch.gluon_unsupported(masked, (9, 0))
    top_left = checks.validate_sdpa(q[:, :3].transpose(1, 2), q.transpose(1, 2), q.transpose(1, 2), None, True,
                                    None, False)
    assert "top-left" in dispatch.gluon_unsupported(top_left, (9, 0))
    flat = q.reshape(4, 2, 128)
    cu = torch.tensor([0, 4], dtype=torch.int32)
    varlen = checks.validate_varlen(flat, flat, flat, cu, cu, 4, 4, True, (-1, -1), None, True)
    assert "CUDA tensor" in dispatch.gluon_unsupported(varlen, (9, 0))  # packed batches pass; CPU tensors do not
    with pytest.raises(ValueError, match="backend='gluon' cannot take this call: it is sm_90 only"):
        ioattn.explain(q, q, q, causal=True, backend="gluon")
    with pytest.raises(ValueError, match="'gluon'"):
        ioattn.flash_attn_func(q, q, q, backend="cudnn")


def _forward_and_backward_match(q, k, v, **options):
    """flash_attn_func(q, k, v, **options): O and LSE against float64, then its gradients (the Triton backward
    on the forward's O and LSE) against float64 autograd. Returns the reference O."""
    import ioattn
    from attention_grad_ref import attention_grads_ref

    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = ioattn.flash_attn_func(*leaves, return_lse=True, **options)
    ref_options = {name: options[name] for name in ("causal", "window_size") if name in options}
    ref, ref_lse = attention_ref(q, k, v, **ref_options)
    assert rel_error(out, ref) < TOLERANCE[q.dtype] and lse_error(lse, ref_lse) < 1e-3
    do = torch.randn_like(out)
    out.backward(do)
    want = attention_grads_ref(q, k, v, do, scale=q.shape[-1] ** -0.5, saved_o=out.detach(), **ref_options)
    for name, leaf, grad in zip("qkv", leaves, want):
        assert rel_error(leaf.grad, grad) < TOLERANCE[q.dtype], name
    return ref


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("causal, n", [(True, 2048), (False, 8192)])
def test_auto_dispatch_runs_gluon_forward_and_triton_backward(causal, n, monkeypatch):
    """Where GLUON_FASTER says so, flash_attn_func and sdpa run the Gluon forward (explain names it); the result
    and the LSE match the float64 reference and the gradients (Triton backward on the Gluon O and LSE) match
    float64 autograd. With the table empty, auto keeps the Triton forward and says why."""
    import ioattn
    from ioattn.ops import gluon_forward

    q, k, v = _inputs(1, n, n, 4, 2, 128, torch.bfloat16, seed=n)
    with monkeypatch.context() as patch:
        patch.setattr(gluon_forward, "GLUON_FASTER", {})
        unmeasured = ioattn.explain(q, k, v, causal=causal)
    assert unmeasured.backend == "triton" and "GLUON_FASTER is empty" in unmeasured.reason, str(unmeasured)
    plan = ioattn.explain(q, k, v, causal=causal)
    assert plan.backend == "gluon" and "gluon_fwd_kernel" in plan.kernel, str(plan)
    ref = _forward_and_backward_match(q, k, v, causal=causal)
    sdpa_out = ioattn.sdpa(*(t.transpose(1, 2) for t in (q, k, v)), is_causal=causal, enable_gqa=True)
    assert rel_error(sdpa_out.transpose(1, 2), ref) < TOLERANCE[torch.bfloat16]
    assert ioattn.explain(q, k, v, causal=causal, backend="triton").backend == "triton"
    small = ioattn.explain(q[:, :64], k[:, :64], v[:, :64], causal=causal)
    assert small.backend == "triton" and "not the Gluon forward" in small.reason
    negative = ioattn.flash_attn_func(q, k, v, causal=causal, softmax_scale=-0.05)  # auto: the Triton forward
    ref, _ = attention_ref(q, k, v, causal=causal, softmax_scale=-0.05)
    assert rel_error(negative, ref) < TOLERANCE[torch.bfloat16]
    with pytest.raises(ValueError, match="config is a Triton forward configuration"):
        from ioattn.ops import dispatch
        dispatch.plan(dispatch.checks.validate_dense(q, k, v, causal, (-1, -1), None), "gluon",
                      config=ioattn.explain(q, k, v, causal=causal, backend="triton").config)


@pytest.mark.gpu
@needs_hopper
def test_windowed_calls_run_gluon_when_asked_and_its_backward_follows_the_window():
    """backend="gluon" with a sliding window runs the Gluon forward (auto keeps Triton: windows are not in
    GLUON_FASTER, and explain says so); O, LSE and the Triton backward's gradients follow the window."""
    import ioattn

    q, k, v = _inputs(1, 2048, 2048, 4, 2, 128, torch.bfloat16, seed=11)
    window = (300, 0)
    auto = ioattn.explain(q, k, v, window_size=window)
    assert auto.backend == "triton" and "sliding windows not measured" in auto.reason, str(auto)
    assert ioattn.explain(q, k, v, window_size=window, backend="gluon").backend == "gluon"
    _forward_and_backward_match(q, k, v, window_size=window, backend="gluon")


VARLEN_CASES = [  # (query lengths, key lengths, causal, window, heads, d)
    ([1000, 0, 37, 300, 129], [1000, 5, 37, 900, 64], False, (-1, -1), (8, 2), 128),
    ([1000, 0, 37, 300, 129], [1000, 5, 37, 900, 64], True, (-1, -1), (8, 2), 128),
    ([64, 65, 1, 2000], [64, 65, 1, 2000], True, (-1, -1), (4, 4), 64),
    ([700, 128, 3], [1500, 100, 300], False, (200, 0), (8, 2), 256),
    ([513, 90], [513, 2000], False, (64, 64), (4, 1), 64),
    ([10, 200, 70], [0, 300, 0], True, (-1, -1), (2, 2), 128),  # sequences with queries and no key: 0 and -inf
]


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("case", range(len(VARLEN_CASES)))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_varlen_packed_sequences(case, dtype):
    """flash_attn_varlen_func(backend="gluon"): sequences packed back to back (empty ones, one row, shorter than
    a Q tile, Nq != Nk per sequence), causal and windowed; a sequence's last query tile must not write into the
    next one's rows (each is compared), and LSE is (Hq, total_q). Auto keeps Triton for varlen (not measured)."""
    import ioattn

    lens_q, lens_k, causal, window, (hq, hkv), d = VARLEN_CASES[case]
    cu_q = torch.tensor([0] + list(itertools.accumulate(lens_q)), device="cuda", dtype=torch.int32)
    cu_k = torch.tensor([0] + list(itertools.accumulate(lens_k)), device="cuda", dtype=torch.int32)
    g = torch.Generator(device="cuda").manual_seed(case)
    q = torch.randn(sum(lens_q), hq, d, device="cuda", dtype=dtype, generator=g)
    k = torch.randn(sum(lens_k), hkv, d, device="cuda", dtype=dtype, generator=g)
    v = torch.randn(sum(lens_k), hkv, d, device="cuda", dtype=dtype, generator=g)
    args = (q, k, v, cu_q, cu_k, max(lens_q), max(lens_k))
    plan = ioattn.explain(*args[:3], api="varlen", cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max(lens_q),
                          max_seqlen_k=max(lens_k), causal=causal, window_size=window, backend="gluon")
    assert plan.backend == "gluon", str(plan)
    out, lse = ioattn.flash_attn_varlen_func(*args, causal=causal, window_size=window, return_lse=True,
                                             backend="gluon")
    torch.cuda.synchronize()
    ref, ref_lse = attention_ref(q, k, v, causal=causal, window_size=window, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    assert lse.shape == (hq, q.shape[0])
    assert rel_error(out, ref) < TOLERANCE[dtype] and lse_error(lse, ref_lse) < 1e-3
    auto = ioattn.explain(*args[:3], api="varlen", cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max(lens_q),
                          max_seqlen_k=max(lens_k), causal=causal, window_size=window)
    assert auto.backend == "triton" and "not measured on it" in auto.reason, str(auto)
