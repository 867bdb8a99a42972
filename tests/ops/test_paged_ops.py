"""The public paged ops: argument checks, the split heuristic, workspaces, output layouts, block copies and swaps.

Numerical coverage of the kernels lives in tests/kernels/test_paged.py; here the cases are minimal.
"""

from __future__ import annotations

import pytest
import torch

import ioattn
from ioattn.ops import cache, paged
from ioattn.ops.paged import (
    GATHER_MIN_GROUP_ROWS, MAX_SPLITS, PagedConfig, candidate_configs, choose_gather, choose_num_splits,
    paged_attention, paged_workspace, plan_paged_attention,
)
from ioattn.reference import TOLERANCE, attention_ref, lse_error, rel_error

PAGE, KV_HEADS, HEADS, HEAD_DIM = 4, 2, 4, 64


def small_case(device, seq_lens=(9, 4), dtype=torch.float32, num_blocks=8):
    """Decode inputs over a shuffled pool (num_blocks // len(seq_lens) blocks of PAGE tokens per sequence), plus
    the float64 reference (out, lse (B, Hq))."""
    k_cache = torch.randn(num_blocks, PAGE, KV_HEADS, HEAD_DIM, dtype=dtype, device=device)
    v_cache = torch.randn_like(k_cache)
    table = torch.randperm(num_blocks).reshape(len(seq_lens), -1).to(torch.int32).to(device)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    q = torch.randn(len(seq_lens), HEADS, HEAD_DIM, dtype=dtype, device=device)
    outs, lses = [], []
    for b, n in enumerate(seq_lens):
        rows = k_cache[table[b].long()].reshape(-1, KV_HEADS, HEAD_DIM)[:n], v_cache[table[b].long()].reshape(-1, KV_HEADS, HEAD_DIM)[:n]
        o, lse = attention_ref(q[b, None, None], rows[0][None], rows[1][None], causal=True)
        outs.append(o[0, 0])
        lses.append(lse[0, :, 0])
    return (q, k_cache, v_cache, table, lens), torch.stack(outs), torch.stack(lses)


def test_public_api_is_exported():
    for name, module in (("paged_attention", paged), ("reshape_and_cache", cache), ("merge_states", paged),
                         ("copy_blocks", cache), ("swap_blocks", cache)):
        assert getattr(ioattn, name) is getattr(module, name)


def test_decode_with_reused_poisoned_workspace_and_out(device):
    args, ref_out, ref_lse = small_case(device)
    workspace = paged_workspace(16, HEADS, HEAD_DIM, max_splits=8, device=device)
    workspace.partial_out.fill_(float("nan"))
    workspace.partial_lse.fill_(float("nan"))
    out = torch.full_like(args[0], float("nan"))
    for splits in (0, 3, 8):
        result, lse = paged_attention(*args, num_splits=splits, workspace=workspace, out=out, return_lse=True)
        assert result is out
        assert rel_error(out, ref_out) < TOLERANCE[torch.float32]
        assert lse_error(lse, ref_lse) < 1e-5


def test_packed_lse_layout_and_max_seqlen_default(device):
    args, _, ref_lse = small_case(device)
    q, k_cache, v_cache, table, lens = args
    cu = torch.arange(len(lens) + 1, dtype=torch.int32, device=device)
    out_a, lse_a = paged_attention(q, k_cache, v_cache, table, lens, cu_seqlens_q=cu, return_lse=True)
    out_b = paged_attention(q, k_cache, v_cache, table, lens, cu_seqlens_q=cu, max_seqlen_q=1)
    assert lse_a.shape == (HEADS, len(lens)) and lse_a.is_contiguous()
    assert lse_error(lse_a, ref_lse.t()) < 1e-5
    assert torch.equal(out_a, out_b)


def test_workspace_too_small_is_rejected(device):
    args, _, _ = small_case(device)
    workspace = paged_workspace(16, HEADS, HEAD_DIM, max_splits=2, device=device)
    with pytest.raises(ValueError, match="workspace"):
        paged_attention(*args, num_splits=4, workspace=workspace)
    paged_attention(*args, num_splits=0, workspace=workspace)  # the heuristic stays within the workspace
    one_token = paged_workspace(1, HEADS, HEAD_DIM, max_splits=8, device=device)
    paged_attention(*args, num_splits=0, workspace=one_token)  # a batch past the scratch runs unsplit
    with pytest.raises(ValueError, match="workspace"):
        paged_attention(*args, num_splits=2, workspace=one_token)


def _bad_calls(device):
    (q, k_cache, v_cache, table, lens), _, _ = small_case(device)
    cu = torch.arange(3, dtype=torch.int32, device=device)
    yield "block_table", dict(block_table=table.long())
    yield "seq_lens", dict(seq_lens=lens.long())
    yield "seq_lens", dict(seq_lens=lens[:1])
    yield "block_size", dict(k_cache=k_cache[:, :3], v_cache=v_cache[:, :3])
    yield "head dim", dict(q=q[..., :60], k_cache=k_cache[..., :60], v_cache=v_cache[..., :60])
    yield "query heads", dict(q=q[:, :3])
    yield "dtype", dict(q=q.half())
    yield "dtype", dict(q=q.double())
    yield "window_size", dict(window_size=(-2, 0))
    yield "sink_tokens", dict(sink_tokens=-1)
    yield "num_splits", dict(num_splits=-1)
    yield "cu_seqlens_q", dict(cu_seqlens_q=cu.long())
    yield "max_seqlen_q", dict(cu_seqlens_q=cu, max_seqlen_q=-1)


def test_bad_arguments_raise_value_error_naming_them(device):
    for name, change in _bad_calls(device):
        (q, k_cache, v_cache, table, lens), _, _ = small_case(device)
        kwargs = dict(q=q, k_cache=k_cache, v_cache=v_cache, block_table=table, seq_lens=lens) | change
        with pytest.raises(ValueError, match=name):
            paged_attention(**kwargs)


def test_split_heuristic():
    h200_sms = 132
    # Enough (sequence, KV head) programs to fill four slots per SM: no split.
    assert choose_num_splits(programs=64 * 8, max_context=8192, sm_count=h200_sms) == 1
    assert choose_num_splits(programs=256 * 8, max_context=8192, sm_count=h200_sms) == 1
    # B = 8, 32 KV heads: 256 programs fill half the 528 slots, so two splits (more than one per SM).
    assert choose_num_splits(programs=8 * 32, max_context=16384, sm_count=h200_sms) == 2
    # B = 1, 8 KV heads, 32k context: split towards four programs per SM (66), capped at MAX_SPLITS.
    assert choose_num_splits(programs=8, max_context=32768, sm_count=h200_sms) == MAX_SPLITS
    # B = 8, 8 KV heads, 32k context: at most four programs per SM, one wave (8 splits of 4k keys).
    assert choose_num_splits(programs=64, max_context=32768, sm_count=h200_sms) == 8
    # Short context: at least MIN_KEYS_PER_SPLIT (64) keys per split.
    assert choose_num_splits(programs=8, max_context=1024, sm_count=h200_sms) == 16
    assert choose_num_splits(programs=32, max_context=1024, sm_count=h200_sms) == 16
    assert choose_num_splits(programs=8, max_context=100, sm_count=h200_sms) == 1
    assert choose_num_splits(programs=1, max_context=1 << 20, sm_count=h200_sms) == MAX_SPLITS
    assert choose_num_splits(programs=1, max_context=16, sm_count=h200_sms) == 1


def test_gather_heuristic_and_plan_text(device):
    # 4k new tokens of one sequence, group 4: gathered; a decode-sized chunk or a window: the paged kernel.
    assert choose_gather(4096, 1, 4, -1, 0)[0]
    assert not choose_gather(64, 1, 4, -1, 0)[0]
    assert choose_gather(GATHER_MIN_GROUP_ROWS, 1, 1, -1, 0)[0]
    assert not choose_gather(GATHER_MIN_GROUP_ROWS - 1, 1, 1, -1, 0)[0]
    assert not choose_gather(4096, 1, 4, 1024, 0)[0] and not choose_gather(4096, 1, 4, -1, 4)[0]
    k_cache = torch.zeros(64, PAGE, KV_HEADS, HEAD_DIM, device=device)
    table = torch.zeros(1, 64, dtype=torch.int32, device=device)
    q = torch.zeros(256, HEADS, HEAD_DIM, device=device)
    long_chunk = plan_paged_attention(q.repeat(4, 1, 1), k_cache, table, decode=False, max_seqlen_q=1024)
    assert long_chunk.gather and "gather" in str(long_chunk)
    short = plan_paged_attention(q[:8], k_cache, table, decode=False, max_seqlen_q=8)
    assert not short.gather and "paged_attention_kernel" in str(short)
    tuned = plan_paged_attention(q.repeat(4, 1, 1), k_cache, table, decode=False, max_seqlen_q=1024,
                                 config=PagedConfig())
    assert not tuned.gather  # an explicit config tunes the paged kernel
    decode = plan_paged_attention(q[:1], k_cache, table, decode=True, max_seqlen_q=1)
    assert "splits + combine" in str(decode) or "no split" in str(decode)
    lens = torch.tensor([256], dtype=torch.int32, device=device)
    cu = torch.tensor([0, 1024], dtype=torch.int32, device=device)
    explained = ioattn.explain(q.repeat(4, 1, 1), k_cache, k_cache, block_table=table, seq_lens=lens,
                               cu_seqlens_q=cu)
    assert explained.gather and "gather + dense" in str(explained)
    windowed = ioattn.explain(q.repeat(4, 1, 1), k_cache, k_cache, block_table=table, seq_lens=lens,
                              cu_seqlens_q=cu, window_size=(64, -1))
    assert not windowed.gather and "window" in str(windowed)


def test_candidate_configs_are_correct(device):
    args, ref_out, _ = small_case(device)
    decode_configs = candidate_configs(decode=True, head_dim=HEAD_DIM)
    assert decode_configs and candidate_configs(decode=False, head_dim=HEAD_DIM)
    for block_n in sorted({c.block_n for c in decode_configs}):  # stages/warps mean nothing to the interpreter
        out = paged_attention(*args, num_splits=2, config=PagedConfig(block_n=block_n))
        assert rel_error(out, ref_out) < TOLERANCE[torch.float32]


def test_copy_blocks_reads_every_source_before_writing(device):
    layers = [torch.randn(5, PAGE, KV_HEADS, HEAD_DIM, device=device) for _ in range(4)]
    before = [t.clone() for t in layers]
    mapping = torch.tensor([[0, 1], [1, 0], [2, 4]], device=device)  # 0 and 1 swap; 2 copied to 4
    ioattn.copy_blocks(layers[:2], layers[2:], mapping)
    for old, new in zip(before, layers):
        assert torch.equal(new[1], old[0]) and torch.equal(new[0], old[1]) and torch.equal(new[4], old[2])
        assert torch.equal(new[2], old[2]) and torch.equal(new[3], old[3])
    with pytest.raises(ValueError, match="block_mapping"):
        ioattn.copy_blocks(layers[:2], layers[2:], mapping.int())


def test_swap_blocks_between_pools(device):
    gpu_pool = torch.randn(6, PAGE, KV_HEADS, HEAD_DIM, device=device)
    cpu_pool = torch.zeros(3, PAGE, KV_HEADS, HEAD_DIM, pin_memory=device == "cuda")
    ioattn.swap_blocks(gpu_pool, cpu_pool, torch.tensor([[5, 0], [2, 2]]))
    if device == "cuda":
        torch.cuda.current_stream().synchronize()
    assert torch.equal(cpu_pool[0], gpu_pool[5].cpu()) and torch.equal(cpu_pool[2], gpu_pool[2].cpu())
    assert not cpu_pool[1].any()
    back = torch.zeros_like(gpu_pool)
    ioattn.swap_blocks(cpu_pool, back, torch.tensor([[0, 3]]))
    assert torch.equal(back[3], gpu_pool[5])
    with pytest.raises(ValueError, match="block_mapping"):
        ioattn.swap_blocks(gpu_pool, cpu_pool, torch.tensor([[5, 0]], device=device).float())


def test_reshape_and_cache_checks(device):
    cache = torch.zeros(4, PAGE, KV_HEADS, HEAD_DIM, device=device)
    key = torch.randn(3, KV_HEADS, HEAD_DIM, device=device)
    with pytest.raises(ValueError, match="slot_mapping"):
        ioattn.reshape_and_cache(key, key, cache, cache.clone(), torch.zeros(3, device=device))
    with pytest.raises(ValueError, match="key"):
        ioattn.reshape_and_cache(key[:, :1], key[:, :1], cache, cache.clone(), torch.zeros(3, dtype=torch.int32))


@pytest.mark.gpu
def test_decode_captures_in_a_cuda_graph():
    args, _, _ = small_case("cuda", seq_lens=(9, 4))
    q, k_cache, v_cache, table, lens = args
    workspace = paged_workspace(2, HEADS, HEAD_DIM, max_splits=8, device="cuda")
    out = torch.empty_like(q)
    paged_attention(q, k_cache, v_cache, table, lens, num_splits=8, workspace=workspace, out=out)  # compile first
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        paged_attention(q, k_cache, v_cache, table, lens, num_splits=8, workspace=workspace, out=out)
    q.copy_(torch.randn_like(q))
    lens.copy_(torch.tensor([16, 1], dtype=torch.int32))
    graph.replay()
    expected = paged_attention(q, k_cache, v_cache, table, lens, num_splits=1)
    assert rel_error(out, expected) < TOLERANCE[torch.float32]


def test_split_combine_launch_is_explained(device):
    (q, k_cache, _, table, _), _, _ = small_case(device)
    plan = paged.plan_paged_attention(q, k_cache, table, decode=True, max_seqlen_q=1, num_splits=4)
    hopper = device == "cuda" and torch.cuda.get_device_capability()[0] >= 9
    assert plan.dependent_combine == hopper
    assert ("programmatic dependent launch" in str(plan)) == hopper
    unsplit = paged.plan_paged_attention(q, k_cache, table, decode=True, max_seqlen_q=1, num_splits=1)
    assert not unsplit.dependent_combine and "no split" in str(unsplit)


@pytest.mark.gpu
def test_dependent_combine_equals_the_ordered_launch_in_and_out_of_graphs():
    # The combine waits on the split kernel through griddepcontrol instead of stream order: same bits, eagerly
    # and replayed from a CUDA graph, with the partial scratch reused (poisoned) between calls.
    args, ref_out, ref_lse = small_case("cuda", seq_lens=(250, 4), num_blocks=128)
    workspace = paged_workspace(2, HEADS, HEAD_DIM, max_splits=16, device="cuda")
    results = []
    for dependent in (True, False):
        workspace.partial_out.fill_(float("nan"))
        out = torch.full_like(args[0], float("nan"))
        eager = paged_attention(*args, num_splits=16, workspace=workspace, return_lse=True, dependent_combine=dependent)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            paged_attention(*args, num_splits=16, workspace=workspace, out=out, dependent_combine=dependent)
        workspace.partial_out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert rel_error(eager[0], ref_out) < TOLERANCE[torch.float32] and lse_error(eager[1], ref_lse) < 1e-5
        results.append((eager[0], out.clone()))
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][0])
    assert torch.equal(results[1][1], results[1][0])


def test_heuristic_splits_run_exactly_within_the_workspace(device, monkeypatch):
    # Pretend to be a big GPU and allow tiny splits, so num_splits=0 really splits these small cases.
    monkeypatch.setattr(paged, "_sm_count", lambda _device: 64)
    monkeypatch.setattr(paged, "MIN_KEYS_PER_SPLIT", 4)
    args, ref_out, ref_lse = small_case(device)
    q, k_cache, _, table, _ = args
    assert paged.plan_paged_attention(q, k_cache, table, decode=True, max_seqlen_q=1).num_splits == 4
    workspace = paged_workspace(2, HEADS, HEAD_DIM, max_splits=3, device=device)
    assert paged.plan_paged_attention(q, k_cache, table, decode=True, max_seqlen_q=1,
                                      workspace=workspace).num_splits == 3
    for scratch in (None, workspace):
        out, lse = paged_attention(*args, workspace=scratch, return_lse=True)
        assert rel_error(out, ref_out) < TOLERANCE[torch.float32]
        assert lse_error(lse, ref_lse) < 1e-5


TORCH_BACKEND_CASES = [  # decode / multi-token, windows, sinks and an evicted block, GQA, page sizes, empty rows
    dict(seq_lens=[9, 0, 30], q_lens=None, page=4, group=2, window=[-1, -1], sinks=0, table="ok"),
    dict(seq_lens=[9, 30], q_lens=[3, 30], page=1, group=4, window=[-1, -1], sinks=0, table="ok"),
    dict(seq_lens=[40, 17], q_lens=[5, 0], page=16, group=1, window=[5, -1], sinks=2, table="ok"),
    dict(seq_lens=[40], q_lens=None, page=4, group=2, window=[8, -1], sinks=0, table="evicted"),
]


@pytest.mark.parametrize("index", range(len(TORCH_BACKEND_CASES)))
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_torch_backend_equals_the_reference(index, dtype):
    """The exact CPU backend (keys gathered per sequence, SDPA or the tiled forward for LSE) against float64."""
    from op_fuzz_worker import run

    case = dict(op="paged_attention", seed=index, dtype=dtype, batch=len(TORCH_BACKEND_CASES[index]["seq_lens"]),
                Hkv=2, D=32, splits=0, gather=None, lens="ok", cu_q="ok", backend="torch", device="cpu",
                **TORCH_BACKEND_CASES[index])
    result = run(case)
    assert result["outcome"] == "ok", result["detail"]
    args, ref_out, ref_lse = small_case("cpu", seq_lens=(9, 4), dtype=torch.float32)
    out, lse = paged_attention(*args, backend="torch", return_lse=True)
    assert rel_error(out, ref_out) < TOLERANCE[torch.float32] and lse_error(lse, ref_lse) < 1e-5
    assert "torch" in str(ioattn.explain(*args[:3], block_table=args[3], seq_lens=args[4], backend="torch"))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_torch_backend_decodes_16_bit_inputs_in_float32(dtype):
    """One-query rows of 16-bit inputs attend in float32 and round once: nearly every output element is the
    float64 result rounded to the dtype (a 16-bit softmax would round P before P @ V and miss far more often)."""
    args, ref_out, _ = small_case("cpu", seq_lens=(31, 17), dtype=dtype, num_blocks=16)
    out = torch.full_like(args[0], float("nan"))
    paged_attention(*args, backend="torch", out=out)
    assert rel_error(out, ref_out) < TOLERANCE[dtype]
    assert (out == ref_out.to(dtype)).float().mean() > 0.97
