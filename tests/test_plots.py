"""The shared figures: the course style, the size axis, the matmul sweep and the training panels."""

import matplotlib
import pytest

from labkit import plots


def test_use_style_sets_the_course_rcparams():
    matplotlib.rcdefaults()
    plots.use_style()
    assert matplotlib.rcParams["axes.spines.top"] is False and matplotlib.rcParams["figure.dpi"] == 110


def test_size_axis_puts_one_plain_tick_on_each_measured_size():
    fig = plots.plot_training({"run": [{"step": 1, "loss": 1.0}]}, keys=("loss",))
    ax = fig.axes[0]
    plots.size_axis(ax, [4096, 32, 256, 32], "n")
    fig.canvas.draw()
    assert list(ax.get_xticks()) == [32, 256, 4096]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["32", "256", "4096"]
    assert ax.get_xscale() == "log" and ax.get_xlabel() == "n"


def test_matmul_sweep_draws_a_line_per_dtype_in_tflops_and_a_dashed_peak_where_known():
    rows = [
        {"dtype": "bf16", "size": 64, "flops_per_s": 2e12, "peak_flops_per_s": 10e12},
        {"dtype": "bf16", "size": 32, "flops_per_s": 1e12, "peak_flops_per_s": 10e12},
        {"dtype": "fp32", "size": 32, "flops_per_s": 5e11},
    ]
    ax = plots.plot_matmul_sweep(rows).axes[0]
    solid = [line for line in ax.lines if line.get_linestyle() == "-"]
    dashed = [line for line in ax.lines if line.get_linestyle() == "--"]
    assert [list(line.get_xdata()) for line in solid] == [[32, 64], [32]]  # sorted by size
    assert list(solid[0].get_ydata()) == pytest.approx([1.0, 2.0])
    assert [list(line.get_ydata()) for line in dashed] == [[10.0, 10.0]]  # only bf16 has a data-sheet peak


def test_plot_training_draws_one_panel_per_metric():
    history = [{"step": i + 1, "loss": 5 - i, "lr": 0.1, "grad_norm": 1.0} for i in range(3)]
    fig = plots.plot_training({"a": history, "b": history}, keys=("loss", "lr"))
    assert len(fig.axes) == 2 and len(fig.axes[0].lines) == 2
    assert list(fig.axes[0].lines[0].get_ydata()) == [5, 4, 3]
