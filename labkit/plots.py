"""One figure style for every lab, and the plots more than one lab draws."""

from __future__ import annotations

from typing import Any

import matplotlib
import matplotlib.pyplot as plt
from matplotlib.ticker import FixedLocator, NullLocator

STYLE = {
    "figure.figsize": (7.0, 4.0),
    "figure.dpi": 110,
    "axes.grid": True,
    "grid.alpha": 0.3,
    "axes.spines.top": False,
    "axes.spines.right": False,
    "axes.titleweight": "bold",
    "legend.frameon": False,
    "font.size": 10,
}


def use_style() -> None:
    """Apply the course's matplotlib style (call once at the top of a notebook)."""
    matplotlib.rcParams.update(STYLE)


def size_axis(ax, sizes, label: str) -> None:
    """Log-2 x axis with one plain tick per measured size (32, 64, ..., 8192), not 3×10¹ labels."""
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_locator(FixedLocator(sorted(set(sizes))))
    ax.xaxis.set_minor_locator(NullLocator())
    ax.xaxis.set_major_formatter(lambda x, _: f"{x:g}")
    ax.set_xlabel(label)


def plot_matmul_sweep(results: list[dict[str, Any]], title: str = "Matmul throughput"):
    """Achieved TFLOP/s against matrix size, one line per dtype, dashed lines at the device peaks."""
    use_style()
    fig, ax = plt.subplots()
    for i, dtype in enumerate(dict.fromkeys(r["dtype"] for r in results)):
        rows = sorted((r for r in results if r["dtype"] == dtype), key=lambda r: r["size"])
        color = f"C{i}"
        ax.plot([r["size"] for r in rows], [r["flops_per_s"] / 1e12 for r in rows], "o-", color=color, label=dtype)
        peak = rows[0].get("peak_flops_per_s")
        if peak:
            ax.axhline(peak / 1e12, color=color, ls="--", lw=1, label=f"{dtype} peak (data sheet)")
    size_axis(ax, [r["size"] for r in results], "matrix size n (n×n @ n×n)")
    ax.set(yscale="log", ylabel="TFLOP/s", title=title)
    ax.legend()
    fig.tight_layout()
    return fig


def plot_training(
    runs: dict[str, list[dict[str, Any]]], keys: tuple[str, ...] = ("loss", "lr", "grad_norm"), title: str = "Training"
):
    """One panel per metric (fit()'s per-step records), one line per run, against the step."""
    use_style()
    fig, axes = plt.subplots(1, len(keys), figsize=(4.2 * len(keys), 3.6), squeeze=False)
    for ax, key in zip(axes[0], keys):
        for name, history in runs.items():
            ax.plot([r["step"] for r in history], [r[key] for r in history], label=name)
        ax.set(xlabel="step", title=key)
    axes[0][0].legend()
    fig.suptitle(title)
    fig.tight_layout()
    return fig
