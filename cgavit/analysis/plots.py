"""Matplotlib figures of the analyses and the detection runs (Agg backend, written atomically as PNG).

This is the package's one place that imports matplotlib (:func:`matplotlib_api`; the bench's plot and
``cgavit quantize``'s curve take it from here too), and only when a figure is drawn or a label font looked up,
so the analyses, the explorer, detection and every command's parser import without it; matplotlib comes with the
``train``, ``detect`` and ``bench`` extras.
"""

from __future__ import annotations

import math
import textwrap
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import ModuleType

from ..io import atomic_write


def stage_label(stage: int) -> str:
    """How figures and printouts name a stage: from 1, as the paper counts stages 1-3 (``stage 1`` is the module
    ``stages.0``, the reports' ``stage`` 0)."""
    return f"stage {stage + 1}"


def block_label(stage: int, block: int) -> str:
    """How figures and printouts name a block: ``s1.b1`` for ``stages.0.blocks.0`` (stage and block from 1, as
    :func:`stage_label`)."""
    return f"s{stage + 1}.b{block + 1}"


def matplotlib_api() -> ModuleType:
    """``matplotlib`` on the Agg backend (no display needed), with ``pyplot``, ``patches``, ``ticker`` and
    ``font_manager`` loaded: the package's one matplotlib import."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.font_manager
    import matplotlib.patches
    import matplotlib.pyplot
    import matplotlib.ticker

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


def heatmap_grid(matrices: Sequence, titles: Sequence[str], path: Path, title: str = "", axis_label: str = "") -> Path:
    """One panel per matrix (values 0..1), a shared colour bar; ``axis_label`` names what rows and columns are."""
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
        ax.set_xlabel(axis_label, fontsize=7)
        if ax.get_subplotspec().is_first_col():  # beside a panel, not between two
            ax.set_ylabel(axis_label, fontsize=7)
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
    notes: Mapping[str, Sequence[str]] | None = None,
    marked: Sequence[bool] | None = None,
    marked_label: str = "",
    message: str = "",
) -> Path:
    """Grouped bars: one group per label, one bar per series (optional error bars).

    Args:
        notes: per series, a short text for each group ("" for none), written upright at the foot of
            the bar's slot, so that a value drawn as no bar (NaN, 0) still says what it is.
        marked: per group, whether its bars are drawn grey and hatched, as values that are not what
            the others are (``marked_label`` names them in the legend).
        message: a line written across the middle of the chart, e.g. why it has no bars.
    """
    plt = pyplot()
    k = max(len(series), 1)
    width = 0.8 / k
    fig, ax = plt.subplots(figsize=(max(4.0, 0.55 * len(labels) * k + 1.5), 3.4))
    for i, (name, vals) in enumerate(series.items()):
        xs = [j + (i - (k - 1) / 2) * width for j in range(len(labels))]
        err = errors.get(name) if errors else None
        bars = ax.bar(xs, vals, width, label=name, yerr=err, capsize=3 if err else 0)
        for bar, mark in zip(bars, marked or ()):
            if mark:
                bar.set(facecolor="0.85", edgecolor="0.45", hatch="//")
        for x, note in zip(xs, (notes or {}).get(name, ())):
            if note:
                ax.text(x, 0.01, note, transform=ax.get_xaxis_transform(), rotation=90, ha="center", va="bottom",
                        fontsize=7)
    wide = max(map(len, labels), default=0) > 6
    ax.set_xticks(range(len(labels)))
    ax.set_xticklabels(labels, rotation=30 if wide else 0, ha="right" if wide else "center", fontsize=8)
    ax.set_ylabel(ylabel)
    if ylim:
        ax.set_ylim(*ylim)
    if title:
        ax.set_title(title, fontsize=10)
    if message:
        ax.text(0.5, 0.5, textwrap.fill(message, 36), transform=ax.transAxes, ha="center", va="center", fontsize=9)
    _legend(ax, len(series) > 1, marked_label if any(marked or ()) else "")
    ax.grid(axis="y", alpha=0.3)
    return _save(fig, path)


def _legend(ax, series: bool, marked_label: str) -> None:
    """The legend of :func:`bar_chart`: the series when there are several, and the marked bars' meaning; beside
    the axes, where it covers no bar (inside, a chart whose bars all reach the top had one hidden under it)."""
    handles, names = ax.get_legend_handles_labels() if series else ([], [])
    if marked_label:
        patches = matplotlib_api().patches
        handles.append(patches.Patch(facecolor="0.85", edgecolor="0.45", hatch="//"))
        names.append(marked_label)
    if handles:
        ax.legend(handles, names, fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1), borderaxespad=0)


def box_panels(
    panels: Sequence[Mapping[str, Sequence[float]]], titles: Sequence[str], path: Path, ylabel: str = "", title: str = "", log_y: bool = True
) -> Path:
    """One panel per entry, each a box plot of several named value sets.

    On the log axis (``log_y``, when some value is positive) values of 0 or below cannot be drawn: a set
    that holds any is noted under its box ("all 0", or how many of its values are 0), so that a box that
    is not there reads as zero importance, not as no data.
    """
    plt = pyplot()
    n = len(panels)
    fig, axes = plt.subplots(1, n, figsize=(3.4 * n, 3.4), squeeze=False, sharey=True)
    log = log_y and any(v > 0 for data in panels for vals in data.values() for v in vals)
    for ax, data, t in zip(axes.flat, panels, titles):
        names = [k for k, v in data.items() if len(v)]
        ax.boxplot([list(data[k]) for k in names], showfliers=False)
        ax.set_xticks(range(1, len(names) + 1))
        ax.set_xticklabels(names, fontsize=8)
        ax.set_title(t, fontsize=9)
        if log:
            ax.set_yscale("log")
            plain_log_axis(ax.yaxis)
            _note_zeros(ax, [list(data[k]) for k in names])
        ax.grid(axis="y", alpha=0.3)
    axes.flat[0].set_ylabel(ylabel)
    if title:
        fig.suptitle(title, fontsize=10)
    return _save(fig, path)


def _note_zeros(ax, sets: Sequence[Sequence[float]]) -> None:
    """Under each box of a log axis, how many of its values (0 or below) the axis cannot show."""
    for pos, vals in enumerate(sets, 1):
        zeros = sum(1 for v in vals if v <= 0)
        if zeros:
            note = "all 0" if zeros == len(vals) else f"{zeros} of {len(vals)} at 0"
            ax.text(pos, 0.02, note, transform=ax.get_xaxis_transform(), rotation=90, ha="center", va="bottom",
                    fontsize=7, color="0.3")


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
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if title:
        ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    _label_points(ax, points)
    return _save(fig, path)


#: Where :func:`_label_points` tries a point's label, in order: above right, below right, above left, below left.
_CORNERS = ((5, 4, "left", "bottom"), (5, -4, "left", "top"), (-5, 4, "right", "bottom"), (-5, -4, "right", "top"))


def _label_points(ax, points: Sequence[tuple[float, float, str]]) -> None:
    """Label each point at the first corner (:data:`_CORNERS`) where its text, as drawn, stays inside the axes and
    covers no label placed before it and no point's marker; where every corner fails some, at the one failing fewest."""
    fig = ax.figure
    fig.canvas.draw()  # the axes' final limits and the renderer that measures the texts
    renderer = fig.canvas.get_renderer()
    marks = [ax.transData.transform((x, y)) for x, y, _ in points]
    frame = ax.get_window_extent(renderer)
    placed = []
    for x, y, lab in points:
        best = None
        for dx, dy, ha, va in _CORNERS:
            text = ax.annotate(lab, (x, y), textcoords="offset points", xytext=(dx, dy), ha=ha, va=va, fontsize=8)
            box = text.get_window_extent(renderer).expanded(1.05, 1.1)
            covered = sum(box.overlaps(b) for b in placed) + sum(box.contains(*m) for m in marks)
            covered += not (frame.contains(box.x0, box.y0) and frame.contains(box.x1, box.y1))
            if best is not None and covered >= best[0]:
                text.remove()
                continue
            if best is not None:
                best[1].remove()
            best = (covered, text, box)
            if not covered:
                break
        placed.append(best[2])


def plain_log_labels():
    """A log axis's minor tick labels as plain numbers (%g): the ticks matplotlib's LogFormatter labels (those of a
    narrow axis, none of one spanning decades), not in its e- or x10^ notation."""

    class Plain(pyplot().LogFormatter):
        def __call__(self, x, pos=None):
            return f"{x:g}" if super().__call__(x, pos) else ""

    return Plain(labelOnlyBase=False, minor_thresholds=(1, 0.4))


def plain_log_axis(axis) -> None:
    """Label a log ``axis`` (``ax.yaxis``, after ``set_yscale("log")``) in plain numbers: major ticks 0.1, 1 (not
    10^-1, 10^0), minor ticks 2, 0.5 where matplotlib labels them (not 2x10^0, 5e-01)."""
    axis.set_major_formatter(pyplot().FuncFormatter(lambda v, _: f"{v:g}"))
    axis.set_minor_formatter(plain_log_labels())


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
        total = k == "loss"
        ax.plot(xs, [r.get(k, float("nan")) for r in steps], label="total" if total else k, lw=1.5 if total else 1)
    ax.set_ylabel("training loss (log scale)")
    ax.set_yscale("log")
    plain_log_axis(ax.yaxis)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    ax_lr.plot(xs, [r[rate] for r in steps], color="k")
    ax_lr.set_ylabel("learning rate")
    ax_lr.set_xlabel("iteration")
    ax_lr.grid(alpha=0.3)
    fig.tight_layout()
    atomic_write(path, lambda tmp: fig.savefig(tmp, dpi=110, format="png"))
    plt.close(fig)
    return Path(path)
