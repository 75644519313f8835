"""One (rung, seed) of a study: its data, its training (continued where it stopped) and its
measurements, written to ``runs/<rung>/seed<seed>/result.json``."""

from __future__ import annotations

import logging
import shutil
import signal
from pathlib import Path

import torch

from ...factory import load_model
from ...info import count_macs
from ...io import read_json_record, write_json
from ...train import TrainConfig, TrainResult, evaluate_checkpoint, train
from ...train import checkpoint as train_checkpoint
from ...train.data import check_folder, check_layout
from ...train.records import read_metrics
from ..data import balanced_subset, list_images
from ..heads import head_similarity, mean_similarity
from .config import AblationConfig
from .ladder import Variant

log = logging.getLogger(__name__)


class StudyStopped(Exception):
    """A training run was stopped by a signal (its checkpoint is saved; the study can continue).

    Attributes:
        signum: the signal's number (SIGINT when unknown): the command exits with ``128 + signum``.
    """

    def __init__(self, message: str, signum: int | None = None) -> None:
        super().__init__(message)
        self.signum = signum if signum is not None else signal.SIGINT


#: What a run's ``result.json`` holds that the study's summary reads.
RESULT_KEYS = ("rung", "seed", "dials", "params", "macs", "top1", "head_similarity", "head_similarity_blocks",
               "train_epoch_s")


def prepare_data(data: str | Path, out: Path, train_subset: int, val_subset: int, seed: int = 0) -> Path:
    """The dataset folder the trainer reads: ``data`` itself, or balanced, seeded subsets as symlinks.

    ``data`` needs ``train/`` and ``val/`` (or ``test/``) class folders. When a subset is asked for, or
    the held-out split is named ``test``, ``out/data/{train,val}/<class>/`` is filled with links to the
    chosen files, each at its path under its class folder (once; a later call with other sizes is refused). They are
    made in ``out/data.partial`` and renamed to ``out/data`` when all are there.

    Raises:
        DataError: a layout the trainer refuses (:func:`~cgavit.train.data.check_layout`: one class, splits that
            name other classes, ...), found before anything is written.
        ValueError: no ``train/`` or held-out split, or a subset smaller than the classes.
    """
    root = check_folder(data)
    held = next((s for s in ("val", "test") if (root / s).is_dir()), None)
    if not (root / "train").is_dir() or held is None:
        raise ValueError(f"{root} needs train/<class>/ and val/<class>/ (or test/<class>/) image folders")
    check_layout(root, "train", held)  # the trainer's refusals (one class, splits naming other classes), before any write
    if not train_subset and not val_subset and held == "val":
        return root
    dest = out / "data"
    spec = dict(source=str(root.resolve()), train_subset=train_subset, val_subset=val_subset, seed=seed)
    marker = dest / "subset.json"
    if marker.exists():
        if read_json_record(marker) != spec:
            raise ValueError(f"{dest} was made from other data or subset sizes ({marker.read_text().strip()}); use another --output")
        return dest
    if dest.exists():  # not made here (every folder made here has its marker): never filled in, never removed
        raise ValueError(f"{dest} exists and holds no subset.json, so it is no subset this command made; move it away "
                         "or use another --output")
    splits = (("train", "train", train_subset, "--train-subset"), ("val", held, val_subset, "--val-subset"))
    listed = [list_images([root / src]) for _, src, _, _ in splits]
    for (_, src, n, flag), (_, labels, classes) in zip(splits, listed):
        if labels is None:
            raise ValueError(f"{root / src} has no class folders")
        if 0 < n < len(classes):  # checked before anything is written: a refused run leaves no marker behind
            raise ValueError(f"{flag} {n} is below the number of classes ({len(classes)}): a balanced subset needs at "
                             f"least one image of each; give {flag} {len(classes)} or more (0: every image)")
    partial = out / "data.partial"  # filled, then renamed: a stopped run leaves no half-made subset at dest
    if partial.exists():
        shutil.rmtree(partial)
    for (split, src, n, _), (paths, labels, classes) in zip(splits, listed):
        for i in balanced_subset(labels, len(paths), n, seed):
            inside = paths[i].relative_to(root / src).parts[1:]  # under its class folder: a/0.png and b/0.png
            link = partial / split / classes[labels[i]] / Path(*inside)
            link.parent.mkdir(parents=True, exist_ok=True)
            link.symlink_to(paths[i].resolve())
    write_json(partial / "subset.json", spec)
    partial.rename(dest)
    return dest


def _trained_epochs(last: Path) -> int:
    return int(train_checkpoint.load(last)["next_epoch"]) if last.exists() else 0


def train_options(cfg: AblationConfig, variant: Variant, seed: int, data_dir: Path, run_dir: Path) -> dict:
    """The :class:`~cgavit.train.TrainConfig` fields of one (variant, seed) run: the study's budget, the variant's
    dials (``--train-args``' dials are in them: :func:`~.ladder.build_ladder`), then ``cfg.train_args``' other fields."""
    extra = {k: v for k, v in cfg.train_args.items() if k != "dials"}
    return dict(
        data=str(data_dir), model=cfg.model, epochs=cfg.epochs, batch_size=cfg.batch_size, img_size=cfg.img_size,
        lr=cfg.lr, seed=seed, output=str(run_dir), dials=dict(variant.dials), **extra,
    )


def _train_variant(cfg: AblationConfig, variant: Variant, seed: int, options: dict, last: Path) -> TrainResult | None:
    """Train (or continue) one run; None when it had finished before."""
    if _trained_epochs(last) >= cfg.epochs:
        log.info("%s seed %d: training finished before, measuring", variant.rung, seed)
        return None
    if last.exists():
        log.info("%s seed %d: resuming %s", variant.rung, seed, last)
        run_cfg = TrainConfig.resume_from(last, **options)
    else:
        run_cfg = TrainConfig(**options)
        log.info("%s seed %d: training  cgavit train %s", variant.rung, seed, " ".join(run_cfg.to_argv()))
    summary = train(run_cfg)
    if summary.interrupted or summary.signal is not None:  # a signal after its last epoch stops the study too
        raise StudyStopped(f"training of {variant.rung} seed {seed} was stopped; run the same command again to continue",
                           summary.signal)
    return summary


def run_variant(variant: Variant, seed: int, cfg: AblationConfig, data_dir: Path, out: Path, heads_batch: torch.Tensor) -> dict:
    """Train (or continue) one (variant, seed) and measure it; returns and writes its ``result.json``."""
    run_dir = out / "runs" / variant.rung / f"seed{seed}"
    result_file = run_dir / "result.json"
    if result_file.exists():
        log.info("%s seed %d: done before, reading %s", variant.rung, seed, result_file)
        return read_json_record(result_file, RESULT_KEYS)
    options = train_options(cfg, variant, seed, data_dir, run_dir)
    last = run_dir / "last.pt"
    summary = _train_variant(cfg, variant, seed, options, last)
    ev = evaluate_checkpoint(data_dir, last, batch_size=cfg.batch_size, workers=0, device="cpu")
    model, _ = load_model(last, device="cpu")
    blocks = head_similarity(model, heads_batch)
    res = dict(
        rung=variant.rung,
        title=variant.title,
        seed=seed,
        dials={k: list(v) if isinstance(v, tuple) else v for k, v in variant.dials.items()},
        params=sum(p.numel() for p in model.parameters()),
        macs=count_macs(model, (cfg.img_size, cfg.img_size)),
        top1=ev["top1"],
        top5=ev["top5"],
        val_loss=ev["loss"],
        val_images=ev["n"],
        best_top1=summary.best_top1 if summary is not None else None,
        head_similarity=mean_similarity(blocks),
        head_similarity_images=heads_batch.shape[0],  # --heads-images, or the fewer the validation split gave
        head_similarity_blocks=[b.to_dict() for b in blocks],
        train_epoch_s=round(sum(r.get("epoch_s", 0.0) for r in read_metrics(run_dir / "metrics.jsonl")), 1),
        train_argv=TrainConfig(**options).to_argv(),
    )
    write_json(result_file, res)
    return res
