"""A launched step whose sampled tokens have not been read on the host yet, and how the next step reads them on
the device instead (asynchronous scheduling: see `ioattn.engine.llm_engine`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ioattn.engine.request import Request
from ioattn.engine.runner import TokenFeed
from ioattn.engine.sampling import SamplerOutput
from ioattn.engine.scheduler import ScheduledChunk
from ioattn.engine.sequence import Sequence
from ioattn.engine.transfer import HostCopy, to_device


@dataclass(eq=False)
class LaunchedStep:
    chunks: list[ScheduledChunk]
    # One per sampled token, in its row of `tokens`: the request, the sequence and its placeholder's position.
    samples: list[tuple[Request, Sequence, int]]
    tokens: torch.Tensor | None  # (len(samples),) int64 on the device
    readback: HostCopy | None  # SamplerOutput.packed() on its way to the host
    # seq_id -> (row in tokens, position in the sequence) of each placeholder this step sampled.
    placeholders: dict[int, tuple[int, int]]

    def feed(self, chunks: list[ScheduledChunk]) -> TokenFeed | None:
        """The next batch's input tokens that are this step's samples, by packed row."""
        rows, source_rows = [], []
        offset = 0
        for c in chunks:
            held = self.placeholders.get(c.seq.seq_id)
            if held is not None and c.start <= held[1] < c.end:
                rows.append(offset + held[1] - c.start)
                source_rows.append(held[0])
            offset += c.num_tokens
        return TokenFeed(rows, source_rows, self.tokens) if rows else None

    def pending(self, seqs: list[Sequence]) -> torch.Tensor | None:
        """Per sampling row of the next step, this step's token of the row's sequence: the unread last token of
        its history, if it has one (the sampler ignores the other rows' values)."""
        if self.tokens is None:
            return None
        source_rows = [self.placeholders.get(seq.seq_id, (0,))[0] for seq in seqs]
        return self.tokens[to_device(source_rows, torch.int64, self.tokens.device)]

    def read(self) -> tuple[list[int], list[float], list[list[int]] | None, list[list[float]] | None]:
        """The sampled ids, logprobs and top logprobs on the host, waiting for them if need be."""
        return SamplerOutput.unpack(self.readback.result())
