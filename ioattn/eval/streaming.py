"""The StreamingLLM experiment (Xiao et al., "Efficient Streaming Language Models with Attention Sinks"), on the
engine's paged path: perplexity by position for three runs over one text —

- (a) `window`: the last W tokens only (sinks 0): once the first tokens are evicted, the paper expects a blow-up;
- (b) `window+sinks`: the same window and the first S tokens (attention sinks): the paper expects (b) near (c);
- (c) `full`: every earlier token, on the first min(text, context) tokens (full attention cannot go further).

(a) and (b) run the whole text, past the model's context when it is longer. Positions stay the text's (see
`ioattn.eval.perplexity`), so past the context (b) is also a test of RoPE distances the model never saw.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ioattn.eval.perplexity import Perplexity, Streaming, bucket_means, kv_cache_format, perplexity

RUNS = {"window": "(a)", "window+sinks": "(b)", "full": "(c)"}  # name: the letter above


@dataclass
class StreamingResult:
    runs: dict[str, Perplexity]  # by RUNS name
    context: int
    window: int
    sinks: int

    def label(self, name: str) -> str:
        """"(b) window 1024 + 4 sinks": the run's letter and what it attends to."""
        return f"{RUNS[name]} {self.runs[name].streaming.describe()}"

    def table(self, bucket: int) -> tuple[list[str], list[list]]:
        """Header and rows: perplexity of each run per `bucket` positions, then over the context and past it."""
        header = ["positions"] + [self.label(name) for name in self.runs]
        columns = [bucket_means(run.nll, bucket) for run in self.runs.values()]
        rows = []
        for i, first in enumerate(columns[0]):
            cells = [f"{first['start']}–{min(first['end'], self.runs['window'].num_tokens)}"]
            cells += [column[i]["perplexity"] if i < len(column) else None for column in columns]
            rows.append(cells)
        for label, lo, hi in ((f"all < {self.context}", 1, self.context), (f"all ≥ {self.context}", self.context,
                                                                           math.inf)):
            cells = [label] + [_span_perplexity(run, lo, hi) for run in self.runs.values()]
            if any(cell is not None for cell in cells[1:]):
                rows.append(cells)
        return header, rows


def _span_perplexity(run: Perplexity, lo: int, hi: float) -> float | None:
    """Perplexity of the predicted positions in [lo, hi) (nll[i] is position i + 1's); None when none is scored."""
    values = run.nll[lo - 1 : None if hi == math.inf else int(hi) - 1]
    return math.exp(math.fsum(values.tolist()) / len(values)) if len(values) else None


def streaming_experiment(loaded, token_ids, *, window: int, sinks: int, chunk: int, backend: str = "auto",
                         progress=None, kv_cache_dtype: str = "auto", kv_cache_scales=None) -> StreamingResult:
    """The three runs; progress(run name, tokens done, tokens of the run) after each step. kv_cache_dtype /
    kv_cache_scales: the KV cache of all three (an fp8 cache's scales resolved once, shared by the runs)."""
    if not (isinstance(sinks, int) and sinks >= 1):
        raise ValueError(f"sinks must be an int >= 1 (run (a) is the window without sinks), got {sinks!r}")
    context = loaded.max_model_len
    settings = {"window": (Streaming(window, 0), token_ids), "window+sinks": (Streaming(window, sinks), token_ids),
                "full": (Streaming(), token_ids[:context])}
    kv_scales = kv_cache_format(loaded, kv_cache_dtype, kv_cache_scales)[1]
    runs = {}
    for name, (streaming, ids) in settings.items():
        report = None if progress is None else (lambda done, name=name, total=len(ids): progress(name, done, total))
        runs[name] = perplexity(loaded, ids, chunk=chunk, streaming=streaming, backend=backend, progress=report,
                                kv_cache_dtype=kv_cache_dtype, kv_cache_scales=kv_scales)
    return StreamingResult(runs, context, window, sinks)


def plot_curves(curves: dict[str, list[dict]], path: str, *, title: str, marks: dict[str, int],
                reference: str | None = None) -> None:
    """A PNG of perplexity (log axis) against position, one line per curve of `bucket_means` rows; `marks` draws a
    labelled vertical line at each position (the window, the context). With `reference` (a curve's label), a
    lower panel shows every other curve's perplexity divided by the reference's, where both scored the bucket."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = 2 if reference is not None else 1
    fig, axes = plt.subplots(panels, 1, figsize=(11, 4.2 + 2.4 * (panels - 1)), sharex=True, squeeze=False,
                             gridspec_kw={"height_ratios": [2, 1][:panels]})
    top = axes[0, 0]
    by_start = {label: {b["start"]: b for b in buckets} for label, buckets in curves.items()}
    for color, (label, buckets) in enumerate(curves.items()):
        xs = [b["start"] + b["tokens"] / 2 for b in buckets]
        top.plot(xs, [b["perplexity"] for b in buckets], marker=".", label=label, color=f"C{color % 10}")
        if reference is None or label == reference:
            continue
        shared = [b for b in buckets if b["start"] in by_start[reference]]
        axes[1, 0].plot([b["start"] + b["tokens"] / 2 for b in shared],
                        [b["perplexity"] / by_start[reference][b["start"]]["perplexity"] for b in shared],
                        marker=".", color=f"C{color % 10}")
    for ax in axes[:, 0]:
        for style, (label, position) in enumerate(marks.items()):
            ax.axvline(position, color="0.5", linestyle=("--", ":", "-.")[style % 3], linewidth=1,
                       label=label if ax is top else None)
        ax.grid(True, which="both", alpha=0.3)
    top.set_yscale("log")
    top.set_ylabel("perplexity (bucket mean NLL, exp)")
    top.set_title(title, fontsize=10)
    top.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    if reference is not None:
        axes[1, 0].axhline(1.0, color=f"C{list(curves).index(reference) % 10}", linewidth=1)
        axes[1, 0].set_ylabel(f"ratio to {reference.split(' ')[0]}")
    axes[-1, 0].set_xlabel("token position")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
