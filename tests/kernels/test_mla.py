"""The absorbed MLA kernel over a paged latent cache against the float64 reference, and against the expanded
computation (K/V from kv_b_proj, ordinary attention) it stands for.

The reference gathers each sequence's latent rows through its block table and runs `attention_ref` with one KV
head whose K is the whole row and V its first v_head_dim columns (bottom-right causal for multi-token queries).
Shapes stay tiny on the CPU (Triton interpreter); the gpu-marked tests run DeepSeek-V3's 512 + 64 at 16 and 128
heads on the device.
"""

from __future__ import annotations

import math

import pytest
import torch

from ioattn.models.config import MLAConfig
from ioattn.models.deepseek import MLAProjection, expanded_attention
from ioattn.ops.mla import MLAConfig as KernelConfig
from ioattn.ops.mla import explain_mla, mla_paged_attention, mla_workspace
from ioattn.reference import TOLERANCE, attention_ref, lse_error, rel_error

LSE_TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def latent_pool(seq_lens, *, page, dim, dtype, device, spare_blocks=2):
    """A shuffled pool of latent rows (num_blocks, page, 1, dim) and its block table (unused entries -1)."""
    per_seq = [math.ceil(n / page) for n in seq_lens]
    num_blocks = sum(per_seq) + spare_blocks
    cache = torch.randn(num_blocks, page, 1, dim, dtype=dtype, device=device)
    order = torch.randperm(num_blocks).tolist()
    table = torch.full((len(seq_lens), max(per_seq + [1]) + 1), -1, dtype=torch.int32)
    for b, count in enumerate(per_seq):
        for j in range(count):
            table[b, j] = order.pop()
    return cache, table.to(device)


def context_rows(cache, table_row, n):
    page = cache.shape[1]
    return cache[table_row[: math.ceil(n / page)].long()].reshape(-1, cache.shape[-1])[:n]


def reference(q, cache, table, seq_lens, q_lens, v_head_dim, scale):
    rows = torch.cat([context_rows(cache, table[b], n) for b, n in enumerate(seq_lens)])[:, None]
    cu_q = torch.tensor([0] + list(q_lens)).cumsum(0).to(torch.int32)
    cu_k = torch.tensor([0] + list(seq_lens)).cumsum(0).to(torch.int32)
    out, lse = attention_ref(q.cpu(), rows.cpu(), rows[..., :v_head_dim].cpu(), causal=True, softmax_scale=scale,
                             cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    return out, lse


def run_case(device, *, seq_lens, q_lens=None, heads=16, latent=64, rope=16, page=4, dtype=torch.float32,
             num_splits=1, config=None, backend="triton"):
    decode = q_lens is None
    q_lens = [1 if n else 0 for n in seq_lens] if decode else q_lens
    cache, table = latent_pool(seq_lens, page=page, dim=latent + rope, dtype=dtype, device=device)
    tokens = len(seq_lens) if decode else sum(q_lens)
    q = torch.randn(tokens, heads, latent + rope, dtype=dtype, device=device)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    cu = None if decode else torch.tensor([0] + q_lens, device=device).cumsum(0).to(torch.int32)
    out = torch.full((tokens, heads, latent), float("nan"), dtype=dtype, device=device)  # poisoned
    scale = 0.3 / math.sqrt(latent + rope)
    result, lse = mla_paged_attention(q, cache, table, lens, v_head_dim=latent, softmax_scale=scale, cu_seqlens_q=cu,
                                      num_splits=num_splits, out=out, return_lse=True, config=config, backend=backend)
    assert result.data_ptr() == out.data_ptr() and result.shape == (tokens, heads, latent)
    if decode:  # the reference's rows: only sequences with a query token
        keep = [b for b, n in enumerate(seq_lens) if n]
        ref_out = torch.zeros(tokens, heads, latent, dtype=torch.float64)
        ref_lse = torch.full((tokens, heads), float("-inf"), dtype=torch.float64)
        if keep:
            sub_out, sub_lse = reference(q[keep], cache, table[keep], [seq_lens[b] for b in keep], [1] * len(keep),
                                         latent, scale)
            ref_out[keep], ref_lse[keep] = sub_out, sub_lse.t()
        got_lse = lse
    else:
        ref_out, ref_lse = reference(q, cache, table, seq_lens, q_lens, latent, scale)
        got_lse = lse
    err = rel_error(result, ref_out)
    assert err < TOLERANCE[dtype], f"{dtype} error {err:.2e}"
    assert lse_error(got_lse, ref_lse) < LSE_TOLERANCE[dtype] * 10
    return result, lse


@pytest.mark.parametrize("num_splits", [0, 1, 2, 3])
@pytest.mark.parametrize("page", [1, 4, 16])
def test_decode_splits_and_pages(device, num_splits, page):
    run_case(device, seq_lens=[7, 33, 1, 20], page=page, num_splits=num_splits)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_decode_16_bit(device, dtype):
    run_case(device, seq_lens=[19, 40, 5], dtype=dtype, num_splits=2)


@pytest.mark.parametrize("heads", [1, 5, 20, 40])
def test_head_counts_pad_and_span_head_blocks(device, heads):
    """Heads not a power of two pad the tile; more than 16 (config block_h 16) take several head blocks."""
    run_case(device, seq_lens=[9, 26], heads=heads, num_splits=2, config=KernelConfig(block_h=16, block_m=16))


def test_empty_sequences_and_batch(device):
    """seq_len 0 (padding rows): output 0 and LSE -inf, never NaN, in every split; an empty batch returns."""
    result, lse = run_case(device, seq_lens=[0, 12, 0], num_splits=3)
    assert torch.equal(result[0], torch.zeros_like(result[0])) and torch.isneginf(lse[0]).all()
    q = torch.randn(0, 4, 80, device=device)
    cache = torch.randn(2, 4, 1, 80, device=device)
    out = mla_paged_attention(q, cache, torch.zeros(0, 1, dtype=torch.int32, device=device),
                              torch.zeros(0, dtype=torch.int32, device=device), v_head_dim=64, backend="triton")
    assert out.shape == (0, 4, 64)


@pytest.mark.parametrize("num_splits", [1, 2])
def test_multi_token_causal_bottom_right(device, num_splits):
    """Speculative verify / chunks over a cache: q_len queries at the end of each sequence, incl. q_len 0 and a
    whole sequence (q_len = seq_len), across query tiles of 4 tokens x 16 heads."""
    run_case(device, seq_lens=[11, 6, 30, 3], q_lens=[5, 0, 9, 3], num_splits=num_splits, page=4)


def test_multi_token_bf16(device):
    run_case(device, seq_lens=[14, 21], q_lens=[3, 6], dtype=torch.bfloat16, heads=8)


def test_torch_backend_matches_reference(device):
    run_case(device, seq_lens=[5, 0, 18], backend="torch")
    run_case(device, seq_lens=[12, 9], q_lens=[4, 9], backend="torch", dtype=torch.bfloat16)


def test_workspace_reuse_and_explain(device):
    """A workspace sized once serves smaller calls (CUDA-graph style); explain says what runs."""
    seq_lens = [30, 17]
    cache, table = latent_pool(seq_lens, page=8, dim=80, dtype=torch.float32, device=device)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    q = torch.randn(2, 16, 80, device=device)
    ws = mla_workspace(8, 16, 64, max_splits=4, device=device)
    a = mla_paged_attention(q, cache, table, lens, v_head_dim=64, num_splits=4, workspace=ws, backend="triton")
    b = mla_paged_attention(q, cache, table, lens, v_head_dim=64, num_splits=1, backend="triton")
    assert rel_error(a, b.double()) < 1e-5
    plan = explain_mla(q, cache, table, lens, v_head_dim=64, num_splits=4, workspace=ws, backend="triton")
    assert plan.num_splits == 4 and "mla_attention_kernel" in str(plan) and "4 splits" in str(plan)
    assert "torch" in str(explain_mla(q, cache, table, lens, v_head_dim=64, backend="torch"))


def test_absorbed_equals_expanded(device):
    """W_UK folded into the query and W_UV after attention == expanding K/V from the latent (float64 reference
    on both sides, then the kernel), on a DeepSeek-shaped projection."""
    torch.manual_seed(0)
    mla = MLAConfig(kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=24)
    heads, seq_lens, q_lens = 4, [10, 23], [1, 4]
    projection = MLAProjection(heads, mla).double()
    torch.nn.init.normal_(projection.weight, std=0.2)
    cache, table = latent_pool(seq_lens, page=4, dim=80, dtype=torch.float64, device="cpu")
    tokens = sum(q_lens)
    q_nope, q_rope = torch.randn(tokens, heads, 32, dtype=torch.float64), torch.randn(tokens, heads, 16,
                                                                                       dtype=torch.float64)
    rows = torch.cat([context_rows(cache, table[b], n) for b, n in enumerate(seq_lens)])
    k_nope, v = projection.expand(rows[:, :64])
    cu_q = torch.tensor([0] + q_lens).cumsum(0).to(torch.int32)
    cu_k = torch.tensor([0] + seq_lens).cumsum(0).to(torch.int32)
    expanded = expanded_attention(q_nope, q_rope, k_nope, rows[:, 64:], v, cu_q, cu_k, max(q_lens), max(seq_lens),
                                  mla.softmax_scale, backend="torch")
    query = torch.cat((projection.absorb(q_nope), q_rope), dim=-1)
    absorbed_ref, _ = attention_ref(query, rows[:, None], rows[:, None, :64], causal=True,
                                    softmax_scale=mla.softmax_scale, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    assert rel_error(projection.output(absorbed_ref), expanded) < 1e-10
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    latent_out = mla_paged_attention(query.float().to(device), cache.float().to(device), table.to(device), lens,
                                     v_head_dim=64, softmax_scale=mla.softmax_scale, cu_seqlens_q=cu_q.to(device),
                                     num_splits=2, backend="triton")
    assert rel_error(projection.output(latent_out.double().cpu()), expanded) < 1e-5


def _inputs(device="cpu"):
    cache, table = latent_pool([6, 9], page=4, dim=80, dtype=torch.float32, device=device)
    return (torch.randn(2, 4, 80, device=device), cache, table,
            torch.tensor([6, 9], dtype=torch.int32, device=device))


@pytest.mark.parametrize("change, match", [
    (lambda a: a.update(v_head_dim=80), "latent_cache's last dim"),
    (lambda a: a.update(v_head_dim=7), "v_head_dim"),
    (lambda a: a.update(q=a["q"][..., :72]), "q's last dim"),
    (lambda a: a.update(q=a["q"].half()), "share a dtype"),
    (lambda a: a.update(latent_cache=a["latent_cache"].expand(-1, -1, 2, -1)), r"\(num_blocks, block_size, 1"),
    (lambda a: a.update(latent_cache=a["latent_cache"][:, :3]), "power of two"),
    (lambda a: a.update(seq_lens=torch.tensor([6, 99], dtype=torch.int32)), r"seq_lens\[1\]"),
    (lambda a: a.update(block_table=a["block_table"].clone().fill_(1000)), "not a block id"),
    (lambda a: a.update(num_splits=65), "num_splits"),
    (lambda a: a.update(softmax_scale=float("nan")), "softmax_scale"),
    (lambda a: a.update(out=torch.empty(2, 4, 80)), "out must be"),
    (lambda a: a.update(q=torch.randn(3, 4, 80)), "decode q has 3 rows"),
    (lambda a: a.update(config="fast"), "config"),
    (lambda a: a.update(backend="cuda"), "backend"),
])
def test_hostile_input_names_the_argument(change, match):
    q, cache, table, lens = _inputs()
    args = dict(q=q, latent_cache=cache, block_table=table, seq_lens=lens, v_head_dim=64)
    change(args)
    with pytest.raises(ValueError, match=match):
        mla_paged_attention(args.pop("q"), args.pop("latent_cache"), args.pop("block_table"), args.pop("seq_lens"),
                            **args)


def test_multi_token_more_queries_than_keys_refused():
    q, cache, table, lens = _inputs()
    with pytest.raises(ValueError, match="query tokens but seq_lens"):
        mla_paged_attention(torch.randn(8, 4, 80), cache, table, lens, v_head_dim=64,
                            cu_seqlens_q=torch.tensor([0, 7, 8], dtype=torch.int32))


# --- DeepSeek-V3's shapes on the device ----------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads", [16, 128])
@pytest.mark.parametrize("num_splits", [0, 1, 3])
@pytest.mark.parametrize("page", [1, 16, 64])
def test_deepseek_v3_shapes_on_gpu(heads, dtype, num_splits, page):
    run_case("cuda", seq_lens=[1, 300, 1025, 0, 77], heads=heads, latent=512, rope=64, page=page, dtype=dtype,
             num_splits=num_splits, backend="auto")


@pytest.mark.gpu
@pytest.mark.parametrize("heads", [16, 128])
def test_deepseek_v3_multi_token_on_gpu(heads):
    run_case("cuda", seq_lens=[40, 500, 7], q_lens=[4, 33, 7], heads=heads, latent=512, rope=64, page=16,
             dtype=torch.bfloat16, backend="auto")


@pytest.mark.gpu
def test_fp32_on_gpu():
    run_case("cuda", seq_lens=[100, 3], heads=16, latent=512, rope=64, page=16, dtype=torch.float32, num_splits=2)


def test_explain_routes_mla(device):
    import ioattn

    q, cache, table, lens = _inputs(device)
    plan = ioattn.explain(q, cache, block_table=table, seq_lens=lens, v_head_dim=64, backend="triton")
    assert "absorbed MLA" in str(plan)
    with pytest.raises(ValueError, match="v_head_dim"):
        ioattn.explain(q, cache, api="mla", block_table=table, seq_lens=lens)
    with pytest.raises(ValueError, match="v=None"):
        ioattn.explain(q, cache, cache, api="mla", block_table=table, seq_lens=lens, v_head_dim=64)


def test_compile_variants_cover_every_split_count_and_query_tile_count(monkeypatch):
    """What the engine's warm-up launches (the kernels not run here): decode and multi-token queries of 1, 2 and 16
    query tiles at every power-of-two split count, each within its block table, decode through the workspace."""
    from ioattn.ops import mla
    from ioattn.ops.paged import MAX_SPLITS

    calls = []

    def record(q, latent_cache, block_table, seq_lens, *, num_splits, workspace=None, max_seqlen_q=None, **_):
        capacity = block_table.shape[1] * latent_cache.shape[1]
        assert int(seq_lens.max()) <= capacity and q.shape[0] == int(seq_lens.sum())
        calls.append((max_seqlen_q, num_splits, workspace is not None))

    monkeypatch.setattr(mla, "mla_paged_attention", record)
    cache, workspace = torch.zeros(4, 4, 1, 64 + 16), mla_workspace(2, 4, 64)
    mla.compile_mla_variants(4, cache, 64, workspace=workspace, max_seqlen_q=170)
    tile = mla.plan_mla(torch.zeros(1, 4, 80), cache, torch.zeros(1, 1, dtype=torch.int32), decode=False,
                        max_seqlen_q=1, v_head_dim=64, backend="triton").tokens_per_tile
    splits = [1 << i for i in range(MAX_SPLITS.bit_length())]
    assert sorted(calls, key=str) == sorted([(None, s, True) for s in splits]
                                            + [(n, s, False) for s in splits for n in (1, 2 * tile, 16 * tile)],
                                            key=str)
    # a workspace for 8 sequences also warms decode at 8: the batch from which 128 heads take the Gluon kernel
    calls.clear()
    mla.compile_mla_variants(4, cache, 64, workspace=mla_workspace(8, 4, 64))
    assert sorted(c for c in calls if c[0] is None) == sorted([(None, s, True) for s in splits] * 2)


def test_default_config_and_split_heuristic_follow_the_tuning_run(monkeypatch):
    """Decode defaults of the 2026-12-05 H100 tuning run: 3 stages; the split heuristic fills the programs an SM
    holds (2 at 16 heads, 1 at 64 heads per program), rounding down, on a 132-SM part."""
    from ioattn.ops import mla

    monkeypatch.setattr(mla, "_sm_count", lambda device: 132)
    narrow = mla.default_config(16, 512, torch.bfloat16, decode=True)
    wide = mla.default_config(128, 512, torch.bfloat16, decode=True)
    assert (narrow.block_h, narrow.num_stages, narrow.programs_per_sm) == (16, 3, 2)
    assert (wide.block_h, wide.num_stages, wide.programs_per_sm) == (64, 3, 1)
    cache = torch.zeros(1, 64, 1, 576)

    def splits(heads, batch, seqlen):
        table = torch.zeros(batch, seqlen // 64, dtype=torch.int32)
        q = torch.zeros(batch, heads, 576, dtype=torch.bfloat16)
        return mla.plan_mla(q, cache, table, decode=True, max_seqlen_q=1, v_head_dim=512,
                            backend="triton").num_splits

    assert [splits(16, b, 1024) for b in (32, 64, 128)] == [8, 4, 2]
    assert [splits(128, b, 8192) for b in (64, 128)] == [1, 1]
    assert splits(16, 1, 128) == 2  # at most one split per 64 keys

    def gluon_splits(batch, seqlen, sms_per_program):  # the 16-head Gluon default's tiles, on 132 SMs
        table = torch.zeros(batch, seqlen // 64, dtype=torch.int32)
        config = KernelConfig(block_h=16, block_m=16, block_n=64, sms_per_program=sms_per_program)
        return mla.plan_mla(torch.zeros(batch, 16, 576, dtype=torch.bfloat16), cache, table, decode=True,
                            max_seqlen_q=1, v_head_dim=512, config=config).num_splits

    assert [gluon_splits(64, 1024, n) for n in (1, 2, 4)] == [2, 1, 1]
    assert [gluon_splits(8, 8192, n) for n in (1, 2, 4)] == [16, 8, 4]
    with pytest.raises(ValueError, match="sms_per_program"):
        KernelConfig(sms_per_program=0)
    with pytest.raises(ValueError, match=r"sms_per_program must be an int in \[1, 32\]"):
        mla_paged_attention(torch.zeros(1, 16, 576), cache, torch.zeros(1, 1, dtype=torch.int32),
                            torch.ones(1, dtype=torch.int32), v_head_dim=512,
                            config=KernelConfig(block_h=16, block_m=16, sms_per_program=33))
    with pytest.raises(ValueError, match="programs_per_sm"):
        table = torch.zeros(1, 1, dtype=torch.int32)
        mla_paged_attention(torch.zeros(1, 16, 576), cache, table, torch.ones(1, dtype=torch.int32),
                            v_head_dim=512, config=KernelConfig(block_h=16, block_m=16, programs_per_sm=0))


_AOT_SCRIPT = """
import json, aot
from ioattn.ops.mla import default_config
for heads in (16, 128):
    cfg = default_config(heads, 512, __import__("torch").bfloat16, decode=True)
    kernel = aot.mla_kernel(cfg.block_h, 1, cfg.block_n, cfg.num_warps, cfg.num_stages, 64, True)
    print(json.dumps(dict(heads=heads, per_sm=cfg.programs_per_sm, warps=cfg.num_warps,
                          shared=kernel.metadata.shared, resources=aot.resources(kernel))))
"""


def test_default_decode_configs_fit_the_programs_per_sm_they_claim():
    """The sm_90 builds (no GPU needed) of the default decode configs: no spills, and programs_per_sm of them fit
    an SM's 228 KB of shared memory and 64K registers."""
    from sm90_builds import build_records

    builds = build_records(_AOT_SCRIPT)
    assert [b["heads"] for b in builds] == [16, 128]
    for b in builds:
        assert "STACK:0 " in b["resources"], b
        b["regs"] = int(b["resources"].split("REG:")[1].split()[0])
        assert b["per_sm"] * (b["shared"] + 1024) <= 228 * 1024, b
        assert b["per_sm"] * b["regs"] * 32 * b["warps"] <= 65536, b
        assert (b["per_sm"] + 1) * (b["shared"] + 1024) > 228 * 1024 or \
            (b["per_sm"] + 1) * b["regs"] * 32 * b["warps"] > 65536, b  # and no more: the claim is the most
