"""ioattn works whatever was imported first: building an `LLM` (whose meta-device construction makes torch import
triton through torch._dynamo) and then calling every op, in a fresh process without the suite's conftest."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]

SCRIPT = textwrap.dedent("""
    import sys
    {first}
    import torch
    import ioattn
    from ioattn.reference import attention_ref, rel_error

    llm = ioattn.LLM("tiny", num_blocks=32, max_model_len=128)
    assert "triton" in sys.modules
    tokens = llm.generate(["abc"], ioattn.SamplingParams(max_tokens=3, temperature=0), use_tqdm=False)
    assert len(tokens[0].outputs[0].token_ids) == 3

    q, k, v = (torch.randn(1, 5, 2, 16) for _ in range(3))
    ref, _ = attention_ref(q, k, v, causal=True)
    assert rel_error(ioattn.flash_attn_func(q, k, v, causal=True, backend="triton"), ref) < 1e-5
    cu = torch.tensor([0, 5], dtype=torch.int32)
    out = ioattn.flash_attn_varlen_func(q[0], k[0], v[0], cu, cu, 5, 5, causal=True, backend="triton")
    assert rel_error(out, ref[0]) < 1e-5
    out = ioattn.sdpa(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, backend="triton")
    assert rel_error(out.transpose(1, 2), ref) < 1e-5

    k_cache, v_cache = torch.zeros(2, 4, 2, 16), torch.zeros(2, 4, 2, 16)
    ioattn.reshape_and_cache(k[0], v[0], k_cache, v_cache, torch.tensor([4, 5, 6, 7, 0]))
    table, lens = torch.tensor([[1, 0]], dtype=torch.int32), torch.tensor([5], dtype=torch.int32)
    out = ioattn.paged_attention(q[0, -1:], k_cache, v_cache, table, lens)
    assert rel_error(out, ref[0, -1:]) < 1e-5
    merged, _ = ioattn.merge_states(q[0], torch.zeros(5, 2), k[0], torch.full((5, 2), float("-inf")))
    assert torch.equal(merged, q[0])
    ioattn.copy_blocks([k_cache], [v_cache], torch.tensor([[1, 0]]))
    assert torch.equal(k_cache[0], k_cache[1])
    cpu_pool = torch.zeros(1, 4, 2, 16)
    ioattn.swap_blocks(k_cache, cpu_pool, torch.tensor([[1, 0]]))
    assert torch.equal(cpu_pool[0], k_cache[1])
    print("ok")
""")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the trap is the CPU-only interpreter switch")
@pytest.mark.parametrize("first", ["", "import triton", "import torch._dynamo"])
def test_every_op_after_building_an_llm(first):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(REPO)
    result = subprocess.run([sys.executable, "-c", SCRIPT.format(first=first)], env=env, capture_output=True,
                            text=True, timeout=600, cwd=REPO)
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-3000:]
