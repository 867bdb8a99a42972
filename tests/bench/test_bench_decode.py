"""`ioattn bench decode` on the CPU: per-layer timing over distinct cache copies, and its layer count."""

import json
from types import SimpleNamespace

import pytest

from ioattn.bench import decode


def test_layer_count_fits_the_copies_in_the_budget():
    case = decode.Case("bfloat16", 64, 32, 8, 1024, 128)  # 256 MiB of K+V
    assert decode.layer_count(case, SimpleNamespace(layers=32, layers_gib=8.0)) == 32
    assert decode.layer_count(case, SimpleNamespace(layers=32, layers_gib=1.0)) == 4
    assert decode.layer_count(case, SimpleNamespace(layers=32, layers_gib=0.1)) == 1  # at least the cache itself
    assert decode.layer_count(case, SimpleNamespace(layers=1, layers_gib=8.0)) == 1


def test_rows_are_per_layer_and_say_so(tmp_path):
    assert decode.main(["--quick", "--layers", "3", "--batches", "1", "--seqlens", "64", "--backends",
                        "ioattn-paged,ioattn-contiguous", "--no-prefill", "--warmup-ms", "1", "--rep-ms", "1",
                        "--out", str(tmp_path)]) == 0
    result = json.loads(next(tmp_path.glob("*-decode-cpu.json")).read_text())
    rows = [r for r in result["rows"] if r["status"] == "ok"]
    assert {r["backend"] for r in rows} == {"ioattn-paged", "ioattn-contiguous"}
    for row in rows:
        assert row["extra"]["layers"] == 3 and "of 3 layers" in row["used"]
        assert row["error"] < 1e-5


def test_layers_must_be_positive():
    with pytest.raises(SystemExit):
        decode.parse_args(["--layers", "0"])


def test_paged_pool_holds_each_sequence_through_its_table_row():
    import torch

    k, v = torch.randn(2, 32, 3, 8), torch.randn(2, 32, 3, 8)
    for shuffled in (True, False):
        k_cache, v_cache, table = decode.paged_pool(k, v, 4, shuffled)
        assert table.dtype == torch.int32 and table.shape == (2, 8) and k_cache.shape == (16, 4, 3, 8)
        assert sorted(table.view(-1).tolist()) == list(range(16))
        if not shuffled:
            assert table.view(-1).tolist() == list(range(16))
        for b in range(2):
            assert torch.equal(k_cache[table[b].long()].reshape(32, 3, 8), k[b])
            assert torch.equal(v_cache[table[b].long()].reshape(32, 3, 8), v[b])


def test_chunked_prefill_pool_holds_the_dense_keys_through_its_table():
    import torch

    inputs = decode.chunked_prefill_inputs(4, 2, 16, 24, 40, 16, torch.float32, "cpu")
    assert inputs.q.shape == (1, 24, 4, 16) and inputs.k.shape == (1, 64, 2, 16)
    for cache, dense in ((inputs.k_cache, inputs.k), (inputs.v_cache, inputs.v)):
        gathered = cache[inputs.table[0].long()].reshape(1, 64, 2, 16)
        assert torch.equal(gathered, dense)
    assert inputs.cu_seqlens_q.tolist() == [0, 24] and inputs.seq_lens.tolist() == [64]
