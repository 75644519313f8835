"""What a run leaves behind besides checkpoints: ``metrics.jsonl`` (one line per epoch), the
training-curve PNG, the metadata of its weights files, and progress reporting (a tqdm bar on a
terminal, log lines otherwise).

The curves are drawn with matplotlib through :func:`cgavit.analysis.plots.pyplot`, the package's one
matplotlib import, on first use.
"""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path

from torch import nn
from tqdm.auto import tqdm

from ..analysis.plots import pyplot
from ..io import DataError, append_jsonl, atomic_write, read_jsonl, write_jsonl
from ..schema import WeightsMeta
from .config import TrainConfig

log = logging.getLogger(__name__)


def append_metrics(path: Path, row: dict) -> None:
    """Append one JSON line (the file is rewritten atomically, so a crash never leaves half a line)."""
    append_jsonl(path, row)


#: The figures every epoch's row holds (numbers): what the curves plot and a resumed run reads back.
METRIC_FIELDS = ("train_loss", "lr", "val_loss", "val_top1", "val_top5")


def read_metrics(path: Path) -> list[dict]:
    """The rows of a ``metrics.jsonl`` ([] when there is none), each checked to be an epoch's row.

    Raises:
        DataError: a line that is not a JSON object, or a row without a whole ``epoch`` >= 0 or with a
            figure of :data:`METRIC_FIELDS` (or ``ema_top1``) that is not a number; file and row named.
    """
    rows = read_jsonl(path)
    for n, row in enumerate(rows, 1):
        epoch = row.get("epoch")
        bad = [k for k in METRIC_FIELDS if not _is_number(row.get(k))] + [k for k in ("ema_top1",) if k in row and not _is_number(row[k])]
        if not (isinstance(epoch, int) and not isinstance(epoch, bool) and epoch >= 0) or bad:
            what = ", ".join(bad) if bad else f"'epoch' {epoch!r}"
            raise DataError(f"{path}: record {n} is not an epoch's row ({what} missing or not a number); fix or delete that line")
    return rows


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def truncate_metrics(path: Path, next_epoch: int) -> None:
    """Drop rows of epochs >= ``next_epoch`` (written after the checkpoint a run resumes from)."""
    if path.is_file():
        write_jsonl(path, [r for r in read_metrics(path) if r["epoch"] < next_epoch])


def weights_meta(cfg: TrainConfig, model: nn.Module, classes: list[str], extra: dict[str, str]) -> WeightsMeta:
    """What a weights file of this run records: the variant and its full config, class names, the
    evaluation preprocessing, and ``extra`` notes (e.g. the epoch)."""
    return WeightsMeta(
        model=cfg.model,
        config=model.cfg,
        num_classes=len(classes),
        img_size=cfg.img_size,
        crop_pct=cfg.crop_pct,
        interpolation=cfg.interpolation,
        mean=cfg.normalisation[0],
        std=cfg.normalisation[1],
        class_names=tuple(classes),
        distillation=cfg.distillation_type != "none",
        extra=extra,
    )


def plot_curves(rows: list[dict], path: Path, title: str = "", top5: bool = True) -> Path | None:
    """Loss, top-1 (and top-5 where ``top5``: not for five classes or fewer, where it is always 100 %) and learning
    rate per epoch, as a PNG (matplotlib, Agg backend)."""
    if not rows:
        return None
    plt = pyplot()
    ep = [r["epoch"] + 1 for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    ax = axes[0]
    ax.plot(ep, [r["train_loss"] for r in rows], "o-", ms=3, label="train (augmented)")
    ax.plot(ep, [r["val_loss"] for r in rows], "o-", ms=3, label="validation")
    ax.set(xlabel="epoch", ylabel="loss", title="loss")
    ax.legend()
    ax = axes[1]
    ax.plot(ep, [r["val_top1"] for r in rows], "o-", ms=3, label="top-1")
    if top5:
        ax.plot(ep, [r["val_top5"] for r in rows], "o-", ms=3, label="top-5")
    if any("ema_top1" in r for r in rows):
        ax.plot([r["epoch"] + 1 for r in rows if "ema_top1" in r], [r["ema_top1"] for r in rows if "ema_top1" in r], "o--", ms=3, label="EMA top-1")
    ax.set(xlabel="epoch", ylabel="%", title="validation accuracy")
    ax.legend()
    ax = axes[2]
    ax.plot(ep, [r["lr"] for r in rows], "o-", ms=3)
    ax.set(xlabel="epoch", ylabel="learning rate", title="learning rate (last update of the epoch)")
    ax.ticklabel_format(axis="y", style="sci", scilimits=(-2, 2))
    for ax in axes:  # whole epochs only (a one-epoch run's axis read 0.96, 0.98, 1.00, ...)
        ax.xaxis.get_major_locator().set_params(integer=True, min_n_ticks=1)
    if title:
        fig.suptitle(title)
    fig.tight_layout()

    def write(tmp: str) -> None:
        fig.savefig(tmp, dpi=110, format="png")

    atomic_write(path, write)
    plt.close(fig)
    return path


class Progress:
    """Per-epoch progress: a tqdm bar (loss, lr, images/s, ETA) when ``bar``, else a log line every
    ``interval`` updates. Silent on ranks other than 0."""

    def __init__(self, total: int, epoch: int, epochs: int, enabled: bool, bar: bool | None, interval: int) -> None:
        self.total, self.epoch, self.epochs, self.enabled, self.interval = total, epoch, epochs, enabled, max(1, interval)
        self.bar = None
        self.start = time.perf_counter()
        self.images = 0
        if enabled and (sys.stderr.isatty() if bar is None else bar):
            self.bar = tqdm(total=total, desc=f"epoch {epoch + 1}/{epochs}", unit="it", dynamic_ncols=True, leave=True)

    def update(self, step: int, images: int, loss: float | None, lr: float) -> None:
        """Report update ``step`` (0-based) done; ``loss`` may be None between log points."""
        self.images += images
        if not self.enabled:
            return
        rate = self.images / max(time.perf_counter() - self.start, 1e-9)
        if self.bar is not None:
            self.bar.update(1)
            if loss is not None:
                self.bar.set_postfix(loss=f"{loss:.4f}", lr=f"{lr:.2e}", img_s=f"{rate:.0f}", refresh=False)
        elif loss is not None and ((step + 1) % self.interval == 0 or step + 1 == self.total):
            eta = (self.total - step - 1) * (time.perf_counter() - self.start) / max(step + 1, 1)
            log.info(
                "epoch %d/%d [%d/%d] loss %.4f lr %.2e %.0f img/s eta %.0fs",
                self.epoch + 1, self.epochs, step + 1, self.total, loss, lr, rate, eta,
            )

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
