"""The runner's host staging: a step's inputs land in reused host buffers, and stale contents from a larger
earlier batch never leak into what the model sees."""

import torch

from engine_helpers import tiny
from ioattn.engine.runner import BatchEntry, HostStaging, ModelRunner


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


def _entry(start, num_tokens, table, sample=True, salt=0):
    slots = [table[p // 4] * 4 + p % 4 for p in range(start, start + num_tokens)]
    return BatchEntry([salt + i for i in range(num_tokens)], start, table, slots, sample)


def test_a_smaller_mixed_batch_after_a_larger_one_sees_only_its_own_inputs():
    runner = ModelRunner(tiny().model, num_blocks=64, block_size=4, max_model_len=64, attention_backend="torch")
    runner.model = model = RecordingModel(runner.model)
    big = [_entry(0, 9, [7, 8, 9], salt=100), _entry(5, 1, [10, 11], salt=200), _entry(0, 12, [1, 2, 3], salt=300)]
    runner.execute(big)
    small = [_entry(4, 3, [5, 6], sample=False, salt=7), _entry(2, 1, [4], salt=9)]
    logits = runner.execute(small)
    input_ids, positions, ctx = model.calls[-1]
    assert input_ids.tolist() == [7, 8, 9, 9] and positions.tolist() == [4, 5, 6, 2]
    assert ctx.slot_mapping.tolist() == [24, 25, 26, 18]
    assert ctx.block_table.shape == (2, 2) and ctx.block_table[0].tolist() == [5, 6] and ctx.block_table[1, 0] == 4
    assert ctx.seq_lens.tolist() == [7, 3] and ctx.cu_seqlens_q.tolist() == [0, 3, 4] and ctx.max_seqlen_q == 3
    assert logits[:, 0].tolist() == [2.0]  # only the sampling entry's last token


def test_staging_reuses_its_buffers_and_grows_when_outgrown():
    staging = HostStaging(torch.device("cpu"))
    first = staging.array("ids", 8, torch.int64)
    first[:] = range(8)
    again = staging.host("ids", 5, torch.int64)
    assert again.data_ptr() == staging.host("ids", 8, torch.int64).data_ptr() and again.tolist() == [0, 1, 2, 3, 4]
    grown = staging.host("ids", 20, torch.int64)
    assert grown.numel() == 20 and staging.upload("ids", 20, torch.int64).shape == (20,)
