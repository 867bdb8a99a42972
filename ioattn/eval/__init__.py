"""Evaluation through the engine's own paged path: a text's perplexity (`ioattn eval perplexity`) and the
StreamingLLM experiment (`ioattn eval streaming`)."""

from ioattn.eval.perplexity import ChunkLogits, Perplexity, Streaming, bucket_means, paged_logits, perplexity
from ioattn.eval.streaming import StreamingResult, streaming_experiment

__all__ = ["ChunkLogits", "Perplexity", "Streaming", "StreamingResult", "bucket_means", "paged_logits", "perplexity",
           "streaming_experiment"]
