"""The runner's host staging: a step's inputs land in reused host buffers, and stale contents from a larger
earlier batch never leak into what the model sees; slots come from the block tables."""

from array import array

import numpy as np
import pytest
import torch

from engine_helpers import tiny
from ioattn.engine.attention import PagedAttention
from ioattn.engine.runner import Batch, HostStaging, ModelRunner, lay_out
from ioattn.ops.torch_paged import context_slots


class RecordingModel:
    """Stands in for the model: records what one forward receives; hidden row i is the position of token i."""

    def __init__(self, model):
        self.config, self.inv_freq, self.model = model.config, model.inv_freq, model.model
        self.attention = None
        self.calls = []

    def __call__(self, input_ids, positions, ctx):
        self.calls.append((input_ids.clone(), positions.clone(), ctx))
        return positions.float()[:, None]

    def compute_logits(self, hidden):
        return hidden


def _runner():
    model = tiny().model
    attention = PagedAttention(model.config, num_blocks=64, block_size=4, dtype=torch.float32, device="cpu",
                               backend="torch")
    return ModelRunner(model, attention, max_model_len=64)


def _batch(*chunks):
    """Chunks (start, num_tokens, table, sample, salt): token i of a chunk is salt + i."""
    return Batch([salt + i for _, n, _, _, salt in chunks for i in range(n)], [c[0] for c in chunks],
                 [c[1] for c in chunks], [c[3] for c in chunks], b"".join(array("i", c[2]) for c in chunks),
                 [len(c[2]) for c in chunks])


def test_a_smaller_mixed_batch_after_a_larger_one_sees_only_its_own_inputs():
    runner = _runner()
    runner.model = model = RecordingModel(runner.model)
    runner.execute(_batch((0, 9, [7, 8, 9], True, 100), (5, 1, [10, 11], True, 200), (0, 12, [1, 2, 3], True, 300)))
    logits = runner.execute(_batch((4, 3, [5, 6], False, 7), (2, 1, [4], True, 9)))
    input_ids, positions, ctx = model.calls[-1]
    assert input_ids.tolist() == [7, 8, 9, 9] and positions.tolist() == [4, 5, 6, 2]
    assert ctx.slot_mapping.tolist() == [24, 25, 26, 18]
    assert ctx.block_table.shape == (2, 2) and ctx.block_table[0].tolist() == [5, 6] and ctx.block_table[1, 0] == 4
    assert ctx.seq_lens.tolist() == [7, 3] and ctx.cu_seqlens_q.tolist() == [0, 3, 4] and ctx.max_seqlen_q == 3
    assert logits[:, 0].tolist() == [2.0]  # only the sampling chunk's last token
    assert [context_slots(ctx.block_table[row], int(ctx.seq_lens[row]), 4)[0].tolist() for row in range(2)] == \
        [[20, 21, 22, 23, 24, 25, 26], [16, 17, 18]]


def test_leading_decodes_are_split_from_the_packed_chunks():
    # Decodes first (the scheduler's order), then a prefill chunk and a one-token chunk: the decodes attend as a
    # decode batch, the rest as packed queries whose cu_seqlens start at their first row.
    runner = _runner()
    runner.model = model = RecordingModel(runner.model)
    runner.execute(_batch((5, 1, [10, 11], True, 1), (2, 1, [4], True, 2), (0, 9, [7, 8, 12], True, 3),
                          (3, 1, [9], True, 4)))
    _, _, ctx = model.calls[-1]
    assert ctx.decode_rows == 2 and ctx.table_widths == (2, 3)  # each part's widest table
    assert ctx.cu_seqlens_q.tolist() == [0, 9, 10] and ctx.max_seqlen_q == 9
    assert ctx.seq_lens.tolist() == [6, 3, 9, 4]
    runner.execute(_batch((5, 1, [10, 11], True, 1), (2, 1, [4], True, 2)))
    assert model.calls[-1][2].cu_seqlens_q is None and model.calls[-1][2].decode_rows == 2


def test_layout_places_every_token_by_its_block_table():
    batch = _batch((6, 3, [9, 2, 5], True, 0), (0, 1, [4], True, 0), (13, 1, [0, 7, 3, 8], True, 0))
    tables = np.full((3, 6), 99, dtype=np.int32)
    layout = lay_out(batch, tables, block_size=4)
    assert layout.positions.tolist() == [6, 7, 8, 0, 13]
    assert layout.slots.tolist() == [2 * 4 + 2, 2 * 4 + 3, 5 * 4 + 0, 4 * 4 + 0, 8 * 4 + 1]
    assert layout.seq_lens.tolist() == [9, 1, 14]
    assert tables[:, :4].tolist() == [[9, 2, 5, 99], [4, 99, 99, 99], [0, 7, 3, 8]]  # no padding written
    with pytest.raises(ValueError, match="evicted"):
        lay_out(_batch((4, 1, [1, -1], True, 0)), np.zeros((1, 2), dtype=np.int32), block_size=4)


def test_staging_reuses_its_buffers_and_grows_when_outgrown():
    staging = HostStaging(torch.device("cpu"))
    first = staging.array("ids", 8, torch.int64)
    first[:] = range(8)
    again = staging.host("ids", 5, torch.int64)
    assert again.data_ptr() == staging.host("ids", 8, torch.int64).data_ptr() and again.tolist() == [0, 1, 2, 3, 4]
    grown = staging.host("ids", 20, torch.int64)
    assert grown.numel() == 20 and staging.upload("ids", 20, torch.int64).shape == (20,)
