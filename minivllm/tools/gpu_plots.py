"""The figures of `make gpu-check`'s results (chapter 8 draws them from the newest results in bench/gpu/).

Plain module, split from tools/gpu_check.py: drawing, not measuring.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

def results_stem(results: dict) -> str:
    return f"{results['date']}_{re.sub(r'[^A-Za-z0-9]+', '-', results['device']).strip('-')}"


def _peak_lines(ax, results: dict, unit: str) -> None:
    if unit == "GB/s":
        if results.get("peak_bandwidth_gbs"):
            ax.axhline(results["peak_bandwidth_gbs"], color="black", linestyle="--", linewidth=1,
                       label=f"spec peak {results['peak_bandwidth_gbs']:,.0f} GB/s")
        ax.axhline(results["copy_bandwidth_gbs"], color="grey", linestyle=":", linewidth=1,
                   label=f"copy {results['copy_bandwidth_gbs']:,.0f} GB/s")
    elif results.get("peak_tflops"):
        ax.axhline(results["peak_tflops"], color="black", linestyle="--", linewidth=1,
                   label=f"spec peak {results['peak_tflops']:,.0f} TFLOP/s")


def plot_decode(results: dict):
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.5), facecolor="white")
    colors = plt.cm.viridis
    batches = sorted({r["batch"] for r in results["decode"]})
    for i, batch in enumerate(batches):
        rows = [r for r in results["decode"] if r["batch"] == batch]
        color = colors(i / max(1, len(batches) - 1))
        ax.plot([r["context"] for r in rows], [r["kernel_gbs"] for r in rows], marker="o", color=color,
                label=f"triton paged, batch {batch}")
        ax.plot([r["context"] for r in rows], [r["sdpa_gbs"] or float("nan") for r in rows], marker="x", linestyle="--",
                color=color, alpha=0.6, label=f"SDPA contiguous, batch {batch}")
    _peak_lines(ax, results, "GB/s")
    if results.get("peak_bandwidth_gbs"):
        peak = results["peak_bandwidth_gbs"]
        ax.secondary_yaxis("right", functions=(lambda y: 100 * y / peak, lambda p: p * peak / 100)).set_ylabel(
            "% of spec peak")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context length (tokens per sequence)")
    ax.set_ylabel("achieved bandwidth (GB/s)")
    ax.set_title(f"decode attention, {results['dtype']}, {results['device']}")
    ax.legend(fontsize=7, ncol=2)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def plot_block_size_and_splits(results: dict):
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4), facecolor="white")
    rows = results["block_size"]
    left.plot([r["block_size"] for r in rows], [r["kernel_gbs"] for r in rows], marker="o")
    _peak_lines(left, results, "GB/s")
    left.set_xscale("log", base=2)
    left.set_xlabel("KV block size (tokens)")
    left.set_ylabel("achieved bandwidth (GB/s)")
    left.set_title("decode: KV block size")
    left.legend(fontsize=7)
    for batch, context in sorted({(r["batch"], r["context"]) for r in results["splits"]}):
        rows = [r for r in results["splits"] if (r["batch"], r["context"]) == (batch, context)]
        right.plot([r["num_splits"] for r in rows], [r["kernel_gbs"] for r in rows], marker="o",
                   label=f"batch {batch}, context {context}")
    _peak_lines(right, results, "GB/s")
    right.set_xscale("log", base=2)
    right.set_xlabel("splits per sequence (split-K)")
    right.set_title("decode: split-K")
    right.legend(fontsize=7)
    for ax in (left, right):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def plot_prefill(results: dict):
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4), facecolor="white")
    rows = results["prefill"]
    labels = [f"{r['batch']}x{r['new']}" + (f"\nover {r['context']}" if r["context"] else "") for r in rows]
    x = range(len(rows))
    ax.bar([i - 0.2 for i in x], [r["kernel_tflops"] for r in rows], width=0.4, label="triton paged")
    ax.bar([i + 0.2 for i in x], [r["sdpa_tflops"] or 0 for r in rows], width=0.4, label="SDPA contiguous (causal)")
    _peak_lines(ax, results, "TFLOP/s")
    ax.set_xticks(list(x), labels, fontsize=8)
    ax.set_xlabel("batch x new tokens (over a cached context)")
    ax.set_ylabel("TFLOP/s")
    ax.set_title(f"prefill attention, {results['dtype']}, {results['device']}")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    return fig


FIGURES = {"decode": plot_decode, "block_size_splits": plot_block_size_and_splits, "prefill": plot_prefill}


def write(results: dict, folder: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder.mkdir(parents=True, exist_ok=True)
    stem = results_stem(results)
    written = [folder / f"{stem}.json"]
    written[0].write_text(json.dumps(results, indent=1) + "\n")
    for name, plot in FIGURES.items():
        fig = plot(results)
        written.append(folder / f"{stem}_{name}.png")
        fig.savefig(written[-1], dpi=120, facecolor="white")
        plt.close(fig)
    return written
