"""PNG plots drawn with matplotlib (optional: the ``ui`` extra)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = ["benchmark_figure", "plot_benchmark", "plot_training"]


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")  # files only: never needs a display
    import matplotlib.pyplot as plt

    return plt


def plot_training(
    history: Sequence[Mapping[str, Any]],
    path: Path,
    *,
    title: str,
    max_norm: float | None = None,
) -> Path:
    """Loss, loss scale and gradient norm against step; skipped steps marked in red.

    ``history`` holds one dict per step with ``step``, ``loss``, ``scale``,
    ``grad_norm`` (``None`` when non-finite) and ``skipped``. ``max_norm``
    draws the clipping threshold on the grad-norm panel.
    """
    plt = _pyplot()
    steps = [int(h["step"]) for h in history]
    skipped = [int(h["step"]) for h in history if h["skipped"]]
    fig, axes = plt.subplots(3, 1, figsize=(9, 8), sharex=True, constrained_layout=True)
    loss_ax, scale_ax, norm_ax = axes
    loss_ax.plot(steps, [h["loss"] for h in history], color="tab:blue", lw=1.2)
    loss_ax.set_ylabel("loss (nats/char)")
    scale_ax.plot(
        steps, [h["scale"] for h in history], color="tab:green", lw=1.2, drawstyle="steps-post"
    )
    scale_ax.set_yscale("log", base=2)
    scale_ax.set_ylabel("loss scale")
    finite = [(int(h["step"]), h["grad_norm"]) for h in history if h["grad_norm"] is not None]
    if finite:
        norm_ax.plot(*zip(*finite, strict=True), color="tab:purple", lw=1.0)
    if max_norm is not None:
        norm_ax.axhline(max_norm, color="black", lw=0.8, ls="--", label=f"max_norm = {max_norm:g}")
        norm_ax.legend(loc="upper right")
    norm_ax.set_yscale("log")
    norm_ax.set_ylabel("grad norm (before clip)")
    norm_ax.set_xlabel("optimizer step")
    for ax in axes:
        ax.grid(alpha=0.3)
        for i, s in enumerate(skipped):
            ax.axvline(
                s,
                color="tab:red",
                alpha=0.35,
                lw=1.0,
                label="skipped step (overflow)" if i == 0 else None,
            )
    if skipped:
        loss_ax.legend(loc="upper right")
    fig.suptitle(title)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def benchmark_figure(
    labels: Sequence[str],
    panels: Mapping[str, Mapping[str, Sequence[float]]],
    *,
    title: str,
    intervals: Mapping[str, tuple[Mapping[str, Sequence[float]], Mapping[str, Sequence[float]]]]
    | None = None,
) -> Any:
    """The benchmark's figure (matplotlib ``Figure``): grouped bars, one panel per entry of ``panels``.

    Each panel maps a series name to one value per label (its key is the y label). A
    dashed line marks 1.0 on panels whose label says they are ratios. ``intervals`` maps
    a panel to (low, high) series drawn as error bars on its bars (nan: none). Panels
    that are not ratios hold counts: their axis has whole-number ticks only.
    """
    plt = _pyplot()
    from matplotlib.ticker import MaxNLocator

    fig, axes = plt.subplots(
        len(panels), 1, figsize=(max(7, 1.6 * len(labels) + 3), 3.2 * len(panels)),
        constrained_layout=True, squeeze=False,
    )  # fmt: skip
    for k, (ax, (ylabel, series)) in enumerate(zip(axes[:, 0], panels.items(), strict=True)):
        ratio = "/" in ylabel
        n = max(1, len(series))
        width = 0.8 / n
        bounds = (intervals or {}).get(ylabel)
        for i, (name, values) in enumerate(series.items()):
            xs = [j + (i - (n - 1) / 2) * width for j in range(len(labels))]
            yerr = None
            if bounds is not None:
                low, high = bounds[0][name], bounds[1][name]
                # Bars without an interval (the reference) get none: nan draws nothing.
                yerr = [[v - lo for v, lo in zip(values, low, strict=True)],
                        [hi - v for v, hi in zip(values, high, strict=True)]]  # fmt: skip
            bars = ax.bar(xs, values, width=width, label=name, yerr=yerr, capsize=3 if yerr else 0,
                          error_kw={"elinewidth": 1.0, "ecolor": "black"})  # fmt: skip
            if ratio:
                # Upright at the bar's left edge, clear of the error bar down its middle.
                for bar, value in zip(bars, values, strict=True):
                    if math.isfinite(value):
                        ax.text(bar.get_x() + 0.06 * bar.get_width(), 0.04 * max(value, 0.0),
                                f"{value:.2f}", rotation=90, fontsize=7, ha="left",
                                va="bottom")  # fmt: skip
            else:
                ax.bar_label(bars, fmt="%d", fontsize=7, padding=2)
        if ratio:
            ax.axhline(1.0, color="black", lw=0.8, ls="--")
        else:
            ax.yaxis.set_major_locator(MaxNLocator(integer=True))
            ax.margins(y=0.12)
        ax.set_xticks(range(len(labels)), labels)
        ax.set_ylabel(ylabel)
        ax.grid(axis="y", alpha=0.3)
        if k == 0:
            ax.legend(fontsize=8)
    fig.suptitle(title)
    return fig


def plot_benchmark(
    labels: Sequence[str],
    panels: Mapping[str, Mapping[str, Sequence[float]]],
    path: Path,
    *,
    title: str,
    intervals: Mapping[str, tuple[Mapping[str, Sequence[float]], Mapping[str, Sequence[float]]]]
    | None = None,
) -> Path:
    """Draw :func:`benchmark_figure` into the PNG at ``path``."""
    plt = _pyplot()
    fig = benchmark_figure(labels, panels, title=title, intervals=intervals)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
