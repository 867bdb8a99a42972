"""PNG plots of benchmark rows: a rate (TFLOP/s, TB/s) against a size, one line per backend, one panel per case
family (e.g. head dim × causal). matplotlib is imported here only, with the Agg backend (no display needed).

A benchmark's JSON keeps its plot settings under "plot", so a machine without matplotlib can write the JSON and
another can draw it later: `python -m ioattn.bench.plot RESULT.json [OUT.png]`.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Sequence

from ioattn.bench.harness import Row, fmt, read_json


def plot_rates(
    rows: Sequence[Row],
    path: str | Path,
    *,
    x_key: str,
    facet_keys: Sequence[str],
    ylabel: str,
    title: str,
) -> None:
    """Write a PNG: `rate` against `row.case[x_key]` (log2 axis), one line per backend, one panel per distinct
    value of `facet_keys`. Rows that did not run are left out (their status is in the tables)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    measured = [r for r in rows if r.status == "ok" and r.rate is not None]
    facets = list(dict.fromkeys(tuple(r.case.get(k) for k in facet_keys) for r in measured)) or [()]
    backends = list(dict.fromkeys(r.backend for r in measured))
    cols = min(len(facets), 3)
    nrows = math.ceil(len(facets) / cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(5 * cols, 3.6 * nrows), squeeze=False)
    for ax, facet in zip(axes.flat, facets):
        in_facet = [r for r in measured if tuple(r.case.get(k) for k in facet_keys) == facet]
        for color, backend in enumerate(backends):
            points = sorted((r.case[x_key], r.rate) for r in in_facet if r.backend == backend)
            if points:
                xs, ys = zip(*points)
                ax.plot(xs, ys, marker="o", label=backend, color=f"C{color % 10}")
        ticks = sorted({r.case[x_key] for r in in_facet})
        ax.set_xscale("log", base=2)
        ax.set_xticks(ticks, [str(t) for t in ticks], fontsize=7)
        ax.minorticks_off()
        ax.set_ylim(bottom=0)
        ax.set_title(", ".join(f"{k}={fmt(v)}" for k, v in zip(facet_keys, facet)), fontsize=9)
        ax.set_xlabel(x_key)
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
    for ax in list(axes.flat)[len(facets):]:
        ax.set_visible(False)
    legend = {}
    for ax in axes.flat:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            legend.setdefault(label, handle)
    if legend:
        fig.legend(legend.values(), legend.keys(), loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) not in (1, 2):
        print("usage: python -m ioattn.bench.plot RESULT.json [OUT.png]", file=sys.stderr)
        return 2
    meta, rows = read_json(argv[0])
    out = argv[1] if len(argv) == 2 else str(Path(argv[0]).with_suffix(".png"))
    plot_rates(rows, out, **meta["plot"])
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
