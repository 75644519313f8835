"""Matplotlib figures of the analyses and the detection runs (Agg backend, written atomically as PNG).

This is the one place that imports matplotlib (:func:`matplotlib_api`), and only when a figure is
drawn or a label font looked up, so the analyses, the explorer and detection import without it;
matplotlib comes with the ``train`` and ``detect`` extras.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import ModuleType

from ..io import atomic_write


def matplotlib_api() -> ModuleType:
    """``matplotlib`` on the Agg backend (no display needed), with ``pyplot`` and ``font_manager``
    loaded: the package's one matplotlib import."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.font_manager
    import matplotlib.pyplot

    return matplotlib


def pyplot() -> ModuleType:
    """``matplotlib.pyplot`` on the Agg backend."""
    return matplotlib_api().pyplot


def label_font() -> str | None:
    """Path of a TrueType font for drawn labels (matplotlib's DejaVu Sans), or None when matplotlib or
    its font cache is unavailable (callers then use PIL's built-in bitmap font)."""
    try:
        return matplotlib_api().font_manager.findfont("DejaVu Sans", fallback_to_default=True)
    except Exception:  # matplotlib missing or no font cache
        return None


def _save(fig, path: Path) -> Path:
    plt = pyplot()
    atomic_write(path, lambda tmp: fig.savefig(tmp, format="png", dpi=110, bbox_inches="tight"))
    plt.close(fig)
    return Path(path)


def heatmap_grid(matrices: Sequence, titles: Sequence[str], path: Path, title: str = "") -> Path:
    """One panel per matrix (values 0..1), a shared colour bar."""
    plt = pyplot()
    n = len(matrices)
    cols = min(n, 6)
    rows = math.ceil(n / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(2.3 * cols + 0.8, 2.3 * rows + 0.6), squeeze=False)
    im = None
    for ax, mat, t in zip(axes.flat, matrices, titles):
        im = ax.imshow(mat, vmin=0, vmax=1, cmap="viridis")
        h = len(mat)
        ax.set_xticks(range(h))
        ax.set_yticks(range(h))
        ax.set_xticklabels([str(i + 1) for i in range(h)], fontsize=7)
        ax.set_yticklabels([str(i + 1) for i in range(h)], fontsize=7)
        ax.set_title(t, fontsize=8)
        if h <= 6:
            for i in range(h):
                for j in range(h):
                    ax.text(j, i, f"{mat[i][j]:.2f}", ha="center", va="center", fontsize=6, color="w" if mat[i][j] < 0.6 else "k")
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    if im is not None:
        fig.colorbar(im, ax=axes, shrink=0.8, label="cosine similarity")
    if title:
        fig.suptitle(title, fontsize=10)
    return _save(fig, path)


def bar_chart(
    series: Mapping[str, Sequence[float]],
    labels: Sequence[str],
    path: Path,
    ylabel: str = "",
    title: str = "",
    ylim: tuple[float, float] | None = None,
    errors: Mapping[str, Sequence[float]] | None = None,
) -> Path:
    """Grouped bars: one group per label, one bar per series (optional error bars)."""
    plt = pyplot()
    k = max(len(series), 1)
    width = 0.8 / k
    fig, ax = plt.subplots(figsize=(max(4.0, 0.55 * len(labels) * k + 1.5), 3.4))
    for i, (name, vals) in enumerate(series.items()):
        xs = [j + (i - (k - 1) / 2) * width for j in range(len(labels))]
        err = errors.get(name) if errors else None
        ax.bar(xs, vals, width, label=name, yerr=err, capsize=3 if err else 0)
    ax.set_xticks(range(len(labels)))
    ax.set_xticklabels(labels, rotation=30 if max(map(len, labels), default=0) > 6 else 0, ha="right" if max(map(len, labels), default=0) > 6 else "center", fontsize=8)
    ax.set_ylabel(ylabel)
    if ylim:
        ax.set_ylim(*ylim)
    if title:
        ax.set_title(title, fontsize=10)
    if len(series) > 1:
        ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    return _save(fig, path)


def box_panels(
    panels: Sequence[Mapping[str, Sequence[float]]], titles: Sequence[str], path: Path, ylabel: str = "", title: str = "", log_y: bool = True
) -> Path:
    """One panel per entry, each a box plot of several named value sets."""
    plt = pyplot()
    n = len(panels)
    fig, axes = plt.subplots(1, n, figsize=(3.4 * n, 3.4), squeeze=False, sharey=True)
    for ax, data, t in zip(axes.flat, panels, titles):
        names = [k for k, v in data.items() if len(v)]
        ax.boxplot([list(data[k]) for k in names], showfliers=False)
        ax.set_xticks(range(1, len(names) + 1))
        ax.set_xticklabels(names, fontsize=8)
        ax.set_title(t, fontsize=9)
        if log_y and any(v > 0 for k in names for v in data[k]):
            ax.set_yscale("log")
        ax.grid(axis="y", alpha=0.3)
    axes.flat[0].set_ylabel(ylabel)
    if title:
        fig.suptitle(title, fontsize=10)
    return _save(fig, path)


def scatter(
    points: Sequence[tuple[float, float, str]], path: Path, xlabel: str, ylabel: str, title: str = "",
    xerr: Sequence[float] | None = None, yerr: Sequence[float] | None = None,
) -> Path:
    """Labelled points joined in order (a ladder), optional error bars."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(5.2, 3.8))
    xs = [p[0] for p in points]
    ys = [p[1] for p in points]
    ax.plot(xs, ys, "-", color="0.7", zorder=1)
    ax.errorbar(xs, ys, xerr=xerr, yerr=yerr, fmt="o", capsize=3, zorder=2)
    corners = ((6, 6, "left"), (6, -13, "left"), (-6, 6, "right"), (-6, -13, "right"))
    for i, (x, y, lab) in enumerate(points):  # rotate label corners so neighbours do not overlap
        dx, dy, ha = corners[i % 4]
        ax.annotate(lab, (x, y), textcoords="offset points", xytext=(dx, dy), ha=ha, fontsize=8)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if title:
        ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    return _save(fig, path)


def training_curves(
    steps: Sequence[Mapping[str, float]], path: Path, x: str = "iter", rate: str = "lr", skip: Sequence[str] = ()
) -> Path:
    """Losses over training (log scale, top) and the learning rate (bottom), from step records.

    Args:
        steps: one mapping per logged step, holding ``x``, ``rate`` and the loss values; every other
            key of the last record (except ``skip``) is drawn, ``"loss"`` with a thicker line.
        path: PNG to write.
        x: key of the horizontal axis. rate: key of the learning rate. skip: keys not to draw.
    """
    plt = pyplot()
    fig, (ax, ax_lr) = plt.subplots(2, 1, figsize=(7, 5), sharex=True, height_ratios=(3, 1))
    xs = [r[x] for r in steps]
    keys = [k for k in steps[-1] if k not in (x, rate, *skip)]
    for k in keys:
        ax.plot(xs, [r.get(k, float("nan")) for r in steps], label=k, lw=1.5 if k == "loss" else 1)
    ax.set_ylabel("training loss")
    ax.set_yscale("log")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    ax_lr.plot(xs, [r[rate] for r in steps], color="k")
    ax_lr.set_ylabel("lr")
    ax_lr.set_xlabel("iteration")
    ax_lr.grid(alpha=0.3)
    fig.tight_layout()
    atomic_write(path, lambda tmp: fig.savefig(tmp, dpi=110, format="png"))
    plt.close(fig)
    return Path(path)
