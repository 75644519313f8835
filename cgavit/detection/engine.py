"""Training, COCO evaluation and checkpoints for the detectors, single process or under ``torchrun``.

The recipe is the paper's 1x schedule (mmdetection): AdamW, learning rate 1e-4, weight decay 0.05
(none on attention-bias tables), 12 epochs with the rate divided by 10 after epochs 8 and 11, and a
linear warm-up over the first 500 iterations from 0.001 x the rate. Evaluation is pycocotools'
COCOeval (bbox, and segm for Mask R-CNN).

The same code runs alone or under ``torchrun`` (``RANK``/``WORLD_SIZE``/``LOCAL_RANK`` in the
environment): DistributedDataParallel with NCCL on GPUs or gloo on CPUs; only rank 0 writes files.
Checkpoints and ``metrics.jsonl`` are written atomically (:mod:`cgavit.io`) and read back with
``weights_only=True``.

Randomness is keyed, not streamed, as in ``cgavit train``: each image's flip depends on ``(seed, epoch, rank,
its position in the epoch)`` and each update's RPN / RoI sampling on ``(seed, epoch, rank, update)``. A run
stopped by a signal at any update (SIGINT, SIGTERM, SIGHUP: :class:`~cgavit.train.engine.Stopper`) saves
``checkpoint.pth`` there and resumes by skipping the images already trained on, ending with the weights of an
uninterrupted run.
"""

from __future__ import annotations

import logging
import math
import os
import signal
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from tqdm import tqdm

from ..analysis.plots import training_curves
from ..bounds import IMG_SIZE_RANGE
from ..factory import resolve_name
from ..fields import option
from ..images import BadImageError
from ..io import CheckpointError, DataError, append_jsonl, read_jsonl, remove_stale_temporaries, save_torch, write_jsonl
from ..train.data import split_fingerprint, until_unreadable
from ..train.data.loaders import StopSafeLoader, ignore_stop_signals
from ..train.data.samplers import SeededSampler, epoch_seed, seed_all
from ..train.distributed import (
    DistEnv, RunLock, any_each, any_true, broadcast_object, first_message, gather_objects, joined, on_main, reduce_sum,
)
from ..train.engine import Stopper
from .annotations import CocoCheck, check_coco
from .backbone import BACKBONE_LAYERS
from .checkpoint import CHECKPOINT_FORMAT, check_against_tensors, check_model_kwargs, load_detector, read_checkpoint
from .coco import STAT_NAMES, coco_metrics, encode_masks
from .data import CocoDetection, Guarded, batches, collate, train_transform
from .models import KINDS, Resize, build_detector, check_settings, coarsest_map_size, detector_resize, foreground
from ..schema import shown
from .schema import is_int, is_number

log = logging.getLogger(__name__)

__all__ = [
    "CHECKPOINT_FORMAT", "DetectionTrainConfig", "STAT_NAMES", "coco_metrics", "evaluate", "evaluate_checkpoint",
    "load_detector", "lr_factor", "model_config", "param_groups", "plot_losses", "read_checkpoint",
    "to_coco_results", "train",
]


# ----------------------------------------------------------------------------------------- recipe
@dataclass
class DetectionTrainConfig:
    """A detection training run. Defaults are the paper's 1x COCO recipe (per process batch 2:
    the paper trained with 8 GPUs x 2 images = 16).

    Each field is documented by its ``help`` text, the line ``cgavit detect train --help`` shows for
    its flag (the field name with dashes, except ``freeze_bn``: ``--train-bn`` turns it off).
    """

    train_json: str = option("", "training instances JSON")
    train_images: str = option("", "folder of the training images")
    val_json: str | None = option(None, "validation instances JSON (evaluated with COCOeval)")
    val_images: str | None = option(None, "folder of the validation images")
    output: str = option("runs/detect", "folder for checkpoints and metrics")
    model: str = option("retinanet", "detector", choices=KINDS)
    backbone: str = option("efficientvit_m4", "EfficientViT variant m0..m5 (paper: efficientvit_m4)")
    dials: dict = field(default_factory=dict)  # design dials of the backbone, e.g. {"cascade": False}
    pretrained_backbone: str | None = option(
        None, "ImageNet checkpoint for the backbone (official, timm or cgavit file), or 'imagenet' to download the "
        "official release", metavar="PATH",
    )
    trust_checkpoint: bool = option(False, "allow pickled objects in --pretrained-backbone (only for files you trust)")
    freeze_bn: bool = option(
        True, "train the backbone's BatchNorm instead of freezing it (paper: frozen, with ImageNet weights); needed "
        "without --pretrained-backbone, since frozen zero-initialised BN scales keep a random backbone's attention "
        "and FFN branches at zero", flags=("--train-bn",), action="store_false",
    )
    trainable_backbone_layers: int = option(
        BACKBONE_LAYERS, f"how many of the backbone's {BACKBONE_LAYERS} parts train, from the last (stage 3, stage 2, stage 1, "
        "the patch embedding; torchvision's option of that name, which counts ResNet's 5); the others are frozen, their "
        "BatchNorm too (default: all, as the paper; 0 trains only the FPN and the heads)", metavar="N",
    )
    model_kwargs: dict = field(default_factory=dict)  # torchvision detector settings, e.g. {"box_detections_per_img": 300}
    min_size: int = option(800, "resize so the shorter side is this")
    max_size: int = option(1333, "... unless the longer side would exceed this")
    epochs: int = option(12, "training epochs (paper: 12, the 1x schedule)")
    lr_steps: tuple[int, ...] = option((8, 11), "divide the lr by 10 after these epochs", nargs="*", metavar="EPOCH")
    warmup_iters: int = option(500, "linear warm-up iterations")
    warmup_ratio: float = option(0.001, "warm-up starts at this fraction of --lr")
    lr: float = option(1e-4, "AdamW learning rate (the paper's, for 16 images per step; used as given at any batch)")
    weight_decay: float = option(0.05, "AdamW weight decay")
    hflip: float = option(0.5, "horizontal-flip probability (0 turns augmentation off)")
    batch_size: int = option(2, "images per process and step (paper: 8 GPUs x 2)")
    workers: int = option(4, "data-loading processes per process")
    seed: int = option(0, "random seed")
    eval_every: int = option(1, "evaluate every N epochs (0: after the last only)")
    resume: str | None = option(
        None, "continue from a checkpoint.pth; 'auto' = --output's checkpoint.pth if present", metavar="CKPT"
    )
    strict: bool = option(
        False, "refuse degenerate boxes (width or height <= 0, or outside the image), masks (covering no pixel, "
        "polygons under 3 points) and images too thin for the resize instead of skipping them with a warning",
    )
    device: str = option("auto", "auto (GPU of this process if any), cpu or cuda")
    log_every: int = option(20, "iterations between metrics.jsonl lines, and between progress lines in the log when "
                                "stderr is not a terminal (a terminal shows a bar)")

    def validate(self) -> None:
        """Raise ``ValueError`` naming the option (its command-line flag) that is missing or out of bounds."""
        for name, lo, hi in _INT_BOUNDS:
            value = getattr(self, name)
            if not (is_int(value) and lo <= value <= hi):
                raise ValueError(f"--{name.replace('_', '-')} must be a whole number in {lo}..{hi}, got {value!r}")
        for name, lo, hi in _FLOAT_BOUNDS:
            value = getattr(self, name)
            if not (is_number(value) and lo <= value <= hi) or (name == "lr" and value == 0):
                raise ValueError(f"--{name.replace('_', '-')} must be a number in {'(' if name == 'lr' else '['}{lo}, {hi}], got {value!r}")
        if not all(is_int(e) and 0 <= e <= 10_000 for e in self.lr_steps):
            raise ValueError(f"--lr-steps must be epoch numbers in 0..10000, got {list(self.lr_steps)}")
        if self.model not in KINDS:
            raise ValueError(f"unknown --model {self.model!r}; choose one of {', '.join(KINDS)}")
        check_settings(self.model, check_model_kwargs(self.model_kwargs))
        if not self.train_json or not self.train_images:
            raise ValueError("give the training data: --train-json FILE --train-images DIR (or --data COCO_ROOT)")
        if bool(self.val_json) != bool(self.val_images):
            raise ValueError("--val-json needs --val-images" if self.val_json else "--val-images needs --val-json (the "
                             "instances file of those images); give both to evaluate, or neither")
        if os.path.lexists(self.output) and not os.path.isdir(self.output):
            raise ValueError(f"--output {self.output} is not a folder; give a folder for the run's files")


#: (DetectionTrainConfig field, lowest, highest) of its whole-number options; the flag is the field's name.
_INT_BOUNDS = (
    ("epochs", 1, 10_000), ("batch_size", 1, 1024), ("workers", 0, 256), ("min_size", *IMG_SIZE_RANGE),
    ("max_size", *IMG_SIZE_RANGE), ("warmup_iters", 0, 10**7), ("eval_every", 0, 10_000), ("log_every", 0, 10**7),
    ("seed", 0, 2**32 - 1), ("trainable_backbone_layers", 0, BACKBONE_LAYERS),
)
#: (DetectionTrainConfig field, lowest, highest) of its real-valued options (the learning rate must also be > 0).
_FLOAT_BOUNDS = (("lr", 0.0, 10.0), ("weight_decay", 0.0, 10.0), ("warmup_ratio", 0.0, 1.0), ("hflip", 0.0, 1.0))


def lr_factor(it: int, warmup_iters: int, warmup_ratio: float, milestones: Sequence[int]) -> float:
    """Learning-rate multiplier at 0-based iteration ``it``: linear warm-up from ``warmup_ratio`` over
    ``warmup_iters`` iterations, times 0.1 for every milestone (in iterations) already reached."""
    warm = 1.0 if it >= warmup_iters else warmup_ratio + (1.0 - warmup_ratio) * it / warmup_iters
    return warm * 0.1 ** sum(it >= m for m in milestones)


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """AdamW groups: weight decay everywhere except the attention-bias tables (official recipe)."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (no_decay if name.endswith("attention_biases") else decay).append(p)
    return [dict(params=decay, weight_decay=weight_decay), dict(params=no_decay, weight_decay=0.0)]


# ------------------------------------------------------------------------------------- evaluation
def to_coco_results(
    image_id: int, output: Mapping[str, torch.Tensor], label_to_cat: Sequence[int], mask_threshold: float = 0.5
) -> tuple[list[dict], list[dict]]:
    """One image's detections as COCO result entries: ``(bbox results, segm results)``.

    Args:
        image_id: COCO image id.
        output: torchvision detector output for the image (boxes xyxy in original pixels, labels,
            scores, optional masks ``(N, 1, H, W)`` probabilities); detections of label 0, the background
            (RetinaNet's), are left out (:func:`~.models.foreground`).
        label_to_cat: ``label_to_cat[label]`` is the COCO category id (index 0 unused).
        mask_threshold: probability above which a pixel belongs to the mask.
    """
    output = foreground(output)
    boxes = output["boxes"].detach().cpu().double()
    xywh = torch.cat([boxes[:, :2], boxes[:, 2:] - boxes[:, :2]], 1).tolist()
    scores = output["scores"].detach().cpu().tolist()
    cats = [int(label_to_cat[int(l)]) for l in output["labels"].cpu()]
    bbox = [dict(image_id=image_id, category_id=c, bbox=b, score=s) for b, c, s in zip(xywh, cats, scores)]
    segm = []
    if "masks" in output and len(cats):
        rles = encode_masks((output["masks"][:, 0] > mask_threshold).cpu().numpy())  # from (N, H, W)
        segm = [dict(image_id=image_id, category_id=c, segmentation=r, score=s) for r, c, s in zip(rles, cats, scores)]
    return bbox, segm


@torch.no_grad()
def evaluate(
    model: nn.Module,
    dataset: CocoDetection,
    env: DistEnv | None = None,
    batch_size: int = 2,
    workers: int = 0,
    progress: bool = True,
) -> tuple[dict[str, float], str]:
    """Run ``model`` over ``dataset`` (split across processes) and score it with COCOeval against the whole
    ground truth (:meth:`~.data.CocoDetection.ground_truth`): the objects and images the annotation check left out,
    which the model is not given, count as missed, as pycocotools scores the file as given.

    Returns:
        ``(metrics, summary)`` on every rank: metrics keyed ``bbox_AP``, ``bbox_AP50``, ... and, for
        models with masks, ``segm_AP`` ...; summary is COCOeval's text table.
    """
    env = env or DistEnv()
    was_training = model.training
    model.eval()
    shard = Guarded(torch.utils.data.Subset(dataset, range(env.rank, len(dataset), env.world)))
    loader = StopSafeLoader(shard, batch_size=batch_size, num_workers=workers, collate_fn=collate,
                            worker_init_fn=ignore_stop_signals)
    label_to_cat = [0] + [cid for cid, _ in dataset.categories]
    bbox, segm = [], []
    hidden = None if progress and env.is_main else True  # None: a bar where stderr is a terminal, none in a log file
    unreadable = None
    for batch, unreadable in tqdm(until_unreadable(batches(loader)), total=len(loader), desc="eval", disable=hidden,
                                  leave=False):
        if unreadable is not None:  # this rank's image: every rank raises it below, none waits in the gathering
            break
        images, targets = batch
        outputs = model([im.to(env.device) for im in images])
        for target, output in zip(targets, outputs):
            b, s = to_coco_results(int(target["image_id"]), output, label_to_cat)
            bbox += b
            segm += s
    model.train(was_training)
    unreadable = first_message(env, unreadable)
    if unreadable:
        raise BadImageError(unreadable)
    gathered = gather_objects(env, (bbox, segm))
    metrics, summary = {}, ""
    if env.is_main:
        bbox = [r for part in gathered for r in part[0]]
        segm = [r for part in gathered for r in part[1]]
        kinds = [("bbox", bbox)] + ([("segm", segm)] if dataset.masks else [])
        truth = dataset.ground_truth()  # what the check left out too: missed
        for kind, res in kinds:
            values, text = coco_metrics(truth, res, kind, truth.getImgIds())
            metrics.update({f"{kind}_{k}": v for k, v in values.items()})
            summary += text
    return broadcast_object(env, (metrics, summary))


def evaluate_checkpoint(
    checkpoint: str | os.PathLike,
    val_json: str | os.PathLike,
    val_images: str | os.PathLike,
    *,
    batch_size: int = 2,
    workers: int = 4,
    strict: bool = False,
    device: str = "auto",
) -> tuple[dict[str, float], str]:
    """COCOeval of a checkpoint written by :func:`train` on COCO-format data (alone or under ``torchrun``).

    Args:
        checkpoint: ``model.pth`` or ``checkpoint.pth``.
        val_json: instances JSON; its categories must be the ones the model was trained on.
        val_images: image folder.
        batch_size: images per process and step. workers: data-loading processes per process.
        strict: refuse degenerate boxes and masks, and images too thin for the detector's resize,
            instead of skipping them.
        device: ``auto``, ``cpu`` or ``cuda``.

    Returns:
        ``(metrics, summary)`` as :func:`evaluate`, on every rank.
    """
    if not val_json or not val_images:
        raise ValueError("give the evaluation data: --val-json FILE --val-images DIR (or --data COCO_ROOT)")
    if not (is_int(batch_size) and 1 <= batch_size <= 1024) or not (is_int(workers) and 0 <= workers <= 256):
        raise ValueError(f"--batch-size must be in 1..1024 and --workers in 0..256, got {batch_size} and {workers}")
    with joined(device) as env:  # warnings said by rank 0 alone: every rank checks the same data and files
        model, config = load_detector(checkpoint, env.device)
        masks = config["kind"] == "maskrcnn"
        check = check_coco(val_json, val_images, strict=strict, require_masks=masks, resize=detector_resize(config),
                           purpose="evaluation")
        if [c for c, _ in check.categories] != [c for c, _ in config["categories"]]:
            raise ValueError(
                f"{val_json} lists categories {[c for c, _ in check.categories]} but the model was trained on "
                f"{[c for c, _ in config['categories']]}; evaluate it on a file of the categories it was trained on"
            )
        dataset = CocoDetection(check, val_images, masks=masks)
        return evaluate(model, dataset, env, batch_size, workers)


# --------------------------------------------------------------------------------------- training
def model_config(cfg: DetectionTrainConfig, categories: Sequence[tuple[int, str]]) -> dict[str, Any]:
    """The plain dict that rebuilds the run's detector (stored in every checkpoint)."""
    if cfg.model not in KINDS:
        raise ValueError(f"unknown --model {cfg.model!r}; choose one of {', '.join(KINDS)}")
    return dict(
        kind=cfg.model,
        backbone=resolve_name(cfg.backbone),
        num_classes=len(categories) + 1,
        categories=[[int(c), str(n)] for c, n in categories],
        freeze_bn=cfg.freeze_bn,
        trainable_backbone_layers=cfg.trainable_backbone_layers,
        dials=dict(cfg.dials),
        min_size=cfg.min_size,
        max_size=cfg.max_size,
        model_kwargs=dict(cfg.model_kwargs),
    )


def plot_losses(metrics_file: str | os.PathLike, out: str | os.PathLike) -> Path | None:
    """Plot the step losses and learning rate of a ``metrics.jsonl`` to ``out`` (PNG); None if empty.

    Only step records with a numeric ``iter`` and ``lr`` are drawn, and of them only their numbers
    (a row edited by hand is left out, not a failure at the end of a run).

    Raises:
        DataError: a line of the file is not a JSON object (:func:`~cgavit.io.read_jsonl`).
    """
    steps = [{k: v for k, v in r.items() if _is_number(v)} for r in read_jsonl(metrics_file)
             if r.get("type") == "step" and _is_number(r.get("iter")) and _is_number(r.get("lr"))]
    if not steps:
        return None
    return training_curves(steps, Path(out), x="iter", rate="lr", skip=("type", "epoch"))


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def train(cfg: DetectionTrainConfig) -> dict[str, Any]:
    """Train a detector on COCO-format data; return the last epoch's record (with its evaluation
    when ``val_json`` is given; empty when a resumed run had no epoch left).

    Writes to ``cfg.output`` (rank 0 only): ``checkpoint.pth`` after every epoch (model, optimizer,
    scheduler, epoch: what ``resume`` needs), ``model.pth`` at the end (weights and config, for
    ``eval``/``predict``), ``metrics.jsonl`` (one line per ``log_every`` iterations and per epoch)
    and ``loss.png``.

    A SIGINT (Ctrl-C), SIGTERM or SIGHUP while it trains stops it after the update in progress, with
    ``checkpoint.pth`` saved there (``resume`` goes on from that update), or after the evaluation in progress;
    the signal then has its usual effect (Ctrl-C: ``KeyboardInterrupt``). A second Ctrl-C stops it at once. One that
    comes after the run's last update stops nothing: the run ends as it would have, with nothing left to resume.

    Raises:
        ValueError: bad options (:meth:`DetectionTrainConfig.validate`), an output folder holding another
            run, a ``--train-bn`` run that would meet a batch of one image too small for BatchNorm,
            diverged loss.
        DataError: bad data (every offending annotation named), an image that cannot be read.
        CheckpointError: a ``resume`` or ``pretrained_backbone`` file that cannot be used.
    """
    cfg.validate()
    with joined(cfg.device) as env:  # warnings said by rank 0 alone: every rank checks the same data and files
        stopper = Stopper(announce=env.is_main)
        try:
            record, stopped = _train(cfg, env, stopper)
        finally:
            stopper.uninstall()
    if stopped:  # saved where it stopped: the signal now does what it was sent for (one after the last update stopped nothing)
        signal.raise_signal(stopper.signum)
    return record


@dataclass
class _Run:
    """What every epoch of one training run shares."""

    cfg: DetectionTrainConfig
    env: DistEnv
    config: dict[str, Any]  # model_config(): stored in every checkpoint
    model: nn.Module  # wrapped in DistributedDataParallel with more than one process
    raw_model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    sampler: SeededSampler  # over a DistributedSampler: (index, seed of its augmentation) pairs
    loader: torch.utils.data.DataLoader
    stopper: Stopper

    @property
    def out(self) -> Path:
        return Path(self.cfg.output)

    @property
    def metrics_path(self) -> Path:
        return self.out / "metrics.jsonl"


def _train(cfg: DetectionTrainConfig, env: DistEnv, stopper: Stopper) -> tuple[dict[str, Any], bool]:
    """``(the last epoch's record, whether a signal stopped the run)``: :func:`_epochs`, after the data, checkpoint and
    folder are checked."""
    train_check, train_set, val_set = _datasets(cfg)
    _check_one_image_batches(cfg, train_set, env.world)
    config = model_config(cfg, train_check.categories)
    resume, ckpt = _resume_checkpoint(cfg, config)
    if ckpt is not None and not _epochs_left(cfg, env, resume, ckpt):
        return {}, False
    if cfg.freeze_bn and not cfg.pretrained_backbone and ckpt is None and env.is_main:
        log.warning(
            "training a random backbone with frozen BatchNorm: its zero-initialised BatchNorm scales keep every "
            "residual FFN and attention branch at zero. Give --pretrained-backbone (ImageNet weights) or --train-bn"
        )
    if cfg.trainable_backbone_layers < BACKBONE_LAYERS and not cfg.pretrained_backbone and ckpt is None and env.is_main:
        log.warning("--trainable-backbone-layers %d without --pretrained-backbone: the frozen parts of the backbone keep "
                    "their random weights (torchvision trains all %d then)", cfg.trainable_backbone_layers, BACKBONE_LAYERS)
    run = _setup(cfg, env, config, ckpt, train_set, stopper)
    start_epoch = int(ckpt["epoch"]) if ckpt is not None else 0
    if ckpt is not None:
        _check_iterations_per_epoch(run, resume, ckpt)
    if env.is_main:
        if ckpt is not None:
            within = f" and update {ckpt['epoch_step']} of epoch {start_epoch + 1}" if ckpt["epoch_step"] else ""
            log.info("resumed from %s after epoch %d%s (iteration %d)", resume, start_epoch, within, ckpt["iteration"])
        elif run.metrics_path.exists():
            log.warning("%s exists: appending to it (use --resume auto to continue that run)", run.metrics_path)
        log.info(
            "%s on %s: %d images (%d categories), %d process(es) x batch %d, %d iterations/epoch, epochs %d..%d",
            cfg.model, cfg.backbone, len(train_set), len(train_check.categories), env.world, cfg.batch_size,
            len(run.loader), start_epoch + 1, cfg.epochs,
        )
    with RunLock(run.out, env):  # makes the folder; one run per folder; stale temporaries cleared under it
        unrecorded = on_main(env, lambda: _clear_records(run, ckpt))  # a damaged or unwritable file: every rank's error
        if broadcast_object(env, unrecorded):
            _record_again(run, val_set, resume, ckpt)
        stopper.install()  # from here a signal stops the run where it can be saved
        return _epochs(run, val_set, ckpt)


def _clear_records(run: _Run, ckpt: Mapping[str, Any] | None) -> bool:
    """Rank 0's part of a run's start in its locked folder: the temporaries of interrupted writes removed, and
    ``metrics.jsonl`` read (a damaged one stops the run now, not after its last epoch) and, when resuming, cleared of
    the rows written after the checkpoint (:func:`_drop_rows_after`). Returns whether it lacks the record of the
    epoch a checkpoint saved at an epoch's end ended (:func:`_record_again`)."""
    for tmp in remove_stale_temporaries(run.out):
        log.info("removed %s, left by an interrupted write", tmp)
    rows = read_jsonl(run.metrics_path)
    if ckpt is None:
        return False
    done = int(ckpt["epoch"])
    _drop_rows_after(run.metrics_path, rows, done, int(ckpt["iteration"]))
    return done > 0 and not ckpt["epoch_step"] and not any(r.get("type") == "epoch" and r.get("epoch") == done for r in rows)


def _record_again(run: _Run, val_set: CocoDetection | None, resume: str, ckpt: Mapping[str, Any]) -> None:
    """Append the record of the epoch ``ckpt`` ended, which ``metrics.jsonl`` lacks: the run stopped between the two
    writes (killed during the epoch's evaluation, a full disk). Its losses are those the checkpoint keeps; its
    evaluation, where one is due, is made again on the checkpoint's weights. A collective: every rank calls it."""
    cfg, epoch, row = run.cfg, int(ckpt["epoch"]), ckpt.get("record")
    if not (isinstance(row, dict) and row.get("epoch") == epoch and all(isinstance(v, (int, float, str)) for v in row.values())):
        return  # a checkpoint written before they kept their epoch's record
    if run.env.is_main:
        log.warning("%s has no record of epoch %d, which %s ended with (the run stopped between the two): written again",
                    run.metrics_path, epoch, resume)
    row = dict(row)
    if val_set is not None and (epoch >= cfg.epochs or (cfg.eval_every and epoch % cfg.eval_every == 0)):
        row.update(_evaluate_epoch(run, val_set, row))
    on_main(run.env, lambda: append_jsonl(run.metrics_path, row))


def _drop_rows_after(path: Path, rows: list[dict], done: int, step: int) -> None:
    """Drop from ``metrics.jsonl`` the rows written after a checkpoint of ``done`` epochs and ``step`` updates: the
    step rows of later updates and the rows of epochs after ``done``, which a run killed before it could save left
    and the resumed run trains again and records anew (rows without those numbers, edited by hand, are kept)."""
    def later(row: dict) -> bool:
        if row.get("type") == "step" and _is_number(row.get("iter")):
            return row["iter"] > step
        return _is_number(row.get("epoch")) and row["epoch"] > done

    kept = [r for r in rows if not later(r)]
    if len(kept) < len(rows):
        write_jsonl(path, kept)
        log.info("dropped %d rows of %s written after its checkpoint's update %d (trained again now)",
                 len(rows) - len(kept), path, step)


def _epochs(run: _Run, val_set: CocoDetection | None, ckpt: Mapping[str, Any] | None) -> tuple[dict[str, Any], bool]:
    """The epochs of ``run`` from where ``ckpt`` (if any) left it to ``cfg.epochs``, then the final weights; the
    last epoch's record (of this call: empty when a signal stopped it before an epoch ended), and whether a signal
    stopped the run (one that comes after its last update stops nothing: the run ends as it would have).

    Each epoch's checkpoint is written before its evaluation, so an evaluation that fails (a damaged
    validation image) does not lose the epoch; its record is appended after it, with its scores. A signal
    stops the run after the update in progress, saved there, or after the epoch's evaluation."""
    cfg, env = run.cfg, run.env
    start_epoch, step = (int(ckpt["epoch"]), int(ckpt["iteration"])) if ckpt is not None else (0, 0)
    part = dict(ckpt.get("partial") or {}) if ckpt is not None and ckpt["epoch_step"] else {}
    row: dict[str, Any] = {}
    for epoch in range(start_epoch, cfg.epochs):
        record, step = _train_epoch(run, epoch, step, part if epoch == start_epoch else {})
        if record["type"] == "partial":  # stopped by a signal mid-epoch
            part = {k: record[k] for k in ("updates", "sums", "count", "time_s")}
            on_main(env, lambda: _save_checkpoint(run, epoch, step, part))  # a failed write: every rank's error
            _report_stop(run, f"stopped after update {record['updates']} of epoch {epoch + 1}")
            return row, True
        row = record
        path = on_main(env, lambda: _save_checkpoint(run, epoch + 1, step, record=row))
        if env.is_main:
            log.info("epoch %d: loss %.4f (%.0f s), checkpoint %s", row["epoch"], row["loss"], row["time_s"], path)
        last = epoch + 1 == cfg.epochs
        if val_set is not None and (last or (cfg.eval_every and (epoch + 1) % cfg.eval_every == 0)):
            row.update(_evaluate_epoch(run, val_set, row))
        on_main(env, lambda: append_jsonl(run.metrics_path, row))
        if not last and any_true(env, run.stopper.signum is not None):
            _report_stop(run, f"stopped after epoch {epoch + 1}")
            return row, True
    done = max(cfg.epochs, start_epoch)  # more than --epochs: a finished run's missing model.pth (_epochs_left)
    on_main(env, lambda: (save_torch(run.out / "model.pth", dict(format=CHECKPOINT_FORMAT, config=run.config,
                                                                 model=run.raw_model.state_dict(), epoch=done)),
                          plot_losses(run.metrics_path, run.out / "loss.png")))
    return row, False


def _report_stop(run: _Run, what: str) -> None:
    """Every rank takes the signal that stopped the run (:meth:`~cgavit.train.engine.Stopper.agree`; a collective),
    so that each stops with it; rank 0 says ``what`` and how to go on."""
    run.stopper.agree(run.env)
    if run.env.is_main:
        log.warning("%s (by %s): %s holds it; continue with the same command and --resume auto", what,
                    signal.Signals(run.stopper.signum).name, run.out / "checkpoint.pth")


def _datasets(cfg: DetectionTrainConfig) -> tuple[CocoCheck, CocoDetection, CocoDetection | None]:
    """``(training check, training set, validation set or None)``, every file checked first."""
    masks, resize = cfg.model == "maskrcnn", _resize(cfg)
    train_check = check_coco(cfg.train_json, cfg.train_images, strict=cfg.strict, require_masks=masks, resize=resize)
    val_set = None
    if cfg.val_json:
        val_check = check_coco(cfg.val_json, cfg.val_images, strict=cfg.strict, require_masks=masks, resize=resize,
                               purpose="evaluation")
        if [c for c, _ in val_check.categories] != [c for c, _ in train_check.categories]:
            raise ValueError(
                f"the validation categories {val_check.categories} differ from the training ones "
                f"{train_check.categories}; both files must list the same categories"
            )
        val_set = CocoDetection(val_check, cfg.val_images, masks=masks)
    train_set = CocoDetection(train_check, cfg.train_images, masks=masks, transforms=train_transform(cfg.hflip))
    if len(train_set) == 0:
        raise ValueError(f"{cfg.train_json} lists no images the detector can take")
    return train_check, train_set, val_set


def _resize(cfg: DetectionTrainConfig) -> Resize:
    """How the run's detector resizes and pads its images."""
    return detector_resize(dict(min_size=cfg.min_size, max_size=cfg.max_size, model_kwargs=cfg.model_kwargs))


def _drop_last(cfg: DetectionTrainConfig, num_images: int, world: int) -> bool:
    """Whether the training loader drops an incomplete last batch: with BatchNorm trained, when each
    process has a whole batch (``DistributedSampler`` gives each ``ceil(num_images / world)``). Every
    batch then holds ``--batch-size`` images, never a last one too small for BatchNorm
    (:func:`_check_one_image_batches`)."""
    return _trains_batchnorm(cfg) and math.ceil(num_images / world) >= cfg.batch_size


def _trains_batchnorm(cfg: DetectionTrainConfig) -> bool:
    """Whether the run trains BatchNorm of the backbone's last stage, whose stride-64 map a lone small image makes 1x1:
    ``--train-bn``, with that stage among the trainable parts."""
    return not cfg.freeze_bn and cfg.trainable_backbone_layers > 0


def _check_one_image_batches(cfg: DetectionTrainConfig, train_set: CocoDetection, world: int) -> None:
    """Refuse, before anything is built, a run whose trained BatchNorm (``--train-bn``) would meet a batch
    of one image whose stride-64 map is 1x1: one value per channel, which BatchNorm cannot train on."""
    if not _trains_batchnorm(cfg) or min(cfg.batch_size, math.ceil(len(train_set) / world)) > 1:
        return  # with --train-bn every batch holds this many images (_drop_last)
    resize = _resize(cfg)
    for image_id in train_set.ids:
        info = train_set.coco.imgs[image_id]
        if coarsest_map_size(info["width"], info["height"], resize) == (1, 1):
            w, h = resize.resized(info["width"], info["height"])
            raise ValueError(
                f"--train-bn with batches of one image cannot train on image {image_id} ({info['file_name']}): resized to "
                f"{w}x{h} px (--min-size {cfg.min_size}, --max-size {cfg.max_size}), its stride-64 map is 1x1, one value per "
                "channel for BatchNorm; use --batch-size 2 or more (with at least 2 images per process), --min-size and "
                "--max-size over 64, or frozen BatchNorm (no --train-bn, with --pretrained-backbone)"
            )


def _resume_checkpoint(cfg: DetectionTrainConfig, config: Mapping[str, Any]) -> tuple[str | None, dict[str, Any] | None]:
    """``(path, checkpoint)`` to continue from (``"auto"``: the output's checkpoint.pth if present),
    checked to describe the same detector and data; ``(None, None)`` for a fresh run. The output
    folder must be free (:func:`_check_output_free`)."""
    resume = cfg.resume
    if resume == "auto":
        path = Path(cfg.output) / "checkpoint.pth"
        resume = str(path) if os.path.lexists(path) else None
    _check_output_free(Path(cfg.output), resume)
    if not resume:
        return None, None
    ckpt = read_checkpoint(resume)
    old = {k: ckpt["config"].get(k) for k in ("kind", "backbone", "num_classes", "categories", "dials", "freeze_bn")}
    old["trainable_backbone_layers"] = ckpt["config"].get("trainable_backbone_layers", BACKBONE_LAYERS)  # files before it: all
    new = {k: config[k] for k in old}
    differ = "; ".join(f"{k} {shown(old[k])} there, {shown(new[k])} here" for k in old if old[k] != new[k])
    if differ:
        raise ValueError(f"{resume} holds another detector than this run asks for ({differ}); they must match to resume: "
                         "give the options and training annotations it started with, or another --output to start afresh "
                         "(nothing was written)")
    if not (is_int(ckpt.get("epoch")) and ckpt["epoch"] >= 0 and is_int(ckpt.get("iteration")) and ckpt["iteration"] >= 0
            and isinstance(ckpt.get("optimizer"), dict) and isinstance(ckpt.get("scheduler"), dict)):
        raise CheckpointError(f"{resume} cannot be resumed from: it needs 'epoch', 'iteration', 'optimizer' and 'scheduler' "
                              "(model.pth holds weights only; resume from checkpoint.pth)")
    ckpt["epoch_step"] = _stopped_within_epoch(ckpt, resume)
    check_against_tensors(config, ckpt["model"], resume)
    return resume, ckpt


def _stopped_within_epoch(ckpt: Mapping[str, Any], resume: str) -> int:
    """The updates of its unfinished epoch a checkpoint saved by a signal holds (0: saved at an epoch's end, or
    written before mid-epoch saves), its ``partial`` record of them checked: their count, the loss sums over the
    processes (finite numbers), the count of those, the seconds they took; and the processes that made them.

    Raises:
        CheckpointError: any of them malformed (the file is damaged).
    """
    within = ckpt.get("epoch_step", 0)
    if not (is_int(within) and within >= 0):
        raise CheckpointError(f"{resume} is damaged: its 'epoch_step' must be a whole number >= 0, got {within!r}")
    if within == 0:
        return 0
    part, world = ckpt.get("partial"), ckpt.get("world_size")
    if not (isinstance(part, dict) and part.get("updates") == within and isinstance(part.get("sums"), dict)
            and all(isinstance(k, str) and is_number(v) for k, v in part["sums"].items())
            and is_number(part.get("count")) and part["count"] > 0 and is_number(part.get("time_s")) and part["time_s"] >= 0
            and is_int(world) and world >= 1):
        raise CheckpointError(f"{resume} is damaged: it was saved after update {within} of an epoch, but its record of "
                              "those updates ('partial', 'world_size') is missing or malformed; resume from another copy")
    return within


def _epochs_left(cfg: DetectionTrainConfig, env: DistEnv, resume: str, ckpt: Mapping[str, Any]) -> bool:
    """Whether a resumed run has anything to do: epochs left, or, for a finished run in its own folder,
    the ``model.pth`` it stopped before writing (missing, damaged, or of an earlier epoch: a run resumed with more
    ``--epochs`` and stopped after its last ``checkpoint.pth``). A finished run is left as it stands (said); resumed
    into another folder it is refused, as ``cgavit train`` does; one stopped within an epoch past ``--epochs`` too."""
    done = int(ckpt["epoch"])
    if done < cfg.epochs:
        return True
    if ckpt["epoch_step"]:
        raise ValueError(f"{resume} was stopped within epoch {done + 1}, past --epochs {cfg.epochs}: give --epochs "
                         f"{done + 1} or more to finish it (nothing was written)")
    what = f"{resume} has trained {done} epoch{'s' if done != 1 else ''}, and --epochs {cfg.epochs} leaves nothing to train"
    out = Path(cfg.output)
    if out.resolve() != Path(resume).resolve().parent:
        raise ValueError(f"{what}; give a larger --epochs (e.g. --epochs {done + 1}) to train on (nothing was written)")
    held = _model_epoch(out / "model.pth")
    if env.is_main:
        log.warning("%s: %s; give a larger --epochs to train on", what,
                    f"the run in {out} is left as it stands" if held == done else "writing the model.pth it stopped before"
                    if held is None else f"its model.pth holds epoch {held}, written before: writing epoch {done}'s")
    return held != done


def _model_epoch(path: Path) -> int | None:
    """The epoch of the weights ``model.pth`` at ``path`` holds; None where it is missing or cannot be read (a run
    stopped before or while writing it)."""
    try:
        epoch = read_checkpoint(path).get("epoch") if os.path.lexists(path) else None
    except CheckpointError:
        return None
    return epoch if is_int(epoch) else None


def _check_iterations_per_epoch(run: _Run, resume: str, ckpt: Mapping[str, Any]) -> None:
    """Refuse to resume with another number of updates per epoch (batch size, processes or training
    images changed): the schedule's milestones, counted in updates, would fall mid-epoch. A run stopped within
    an epoch is checked by :func:`_check_mid_epoch` too."""
    done, within, per_epoch = int(ckpt["epoch"]), int(ckpt["epoch_step"]), len(run.loader)
    made = int(ckpt["iteration"]) - within  # the updates of the epochs finished
    old = ckpt.get("train_config")
    old_batch = old.get("batch_size") if isinstance(old, dict) and is_int(old.get("batch_size")) else None
    if within:
        _check_mid_epoch(run, resume, ckpt)
    if made == done * per_epoch and within < per_epoch:
        return
    raise ValueError(
        f"{resume} made {made} updates in {done} epoch{'s' if done != 1 else ''}"
        f"{f' ({made / done:g} per epoch)' if done else ''}, and this run makes {per_epoch} per epoch "
        f"({len(run.loader.dataset)} images, {run.env.world} process(es) x --batch-size {run.cfg.batch_size}): the learning-rate "
        f"schedule would shift. Resume with the --batch-size{f' ({old_batch})' if old_batch else ''}, number of processes "
        "and training images the run started with (nothing was written)"
    )


def _check_mid_epoch(run: _Run, resume: str, ckpt: Mapping[str, Any]) -> None:
    """A run stopped within an epoch goes on from the image its updates reached, counted in its own batches of its own
    processes' shares of the epoch's order, which its ``--seed`` drew: another batch size, number of processes or seed
    would skip other images than those it trained on, and is refused (an epoch's end may change any of them, as
    ``cgavit train``'s). A training set changed since the stop (images added or removed) is warned about: the rest of
    the epoch is drawn from the new set's order."""
    cfg, env, done, within = run.cfg, run.env, int(ckpt["epoch"]), int(ckpt["epoch_step"])
    old = ckpt.get("train_config") if isinstance(ckpt.get("train_config"), dict) else {}
    old_batch = old.get("batch_size") if is_int(old.get("batch_size")) else None
    if (old_batch, ckpt["world_size"]) != (cfg.batch_size, env.world):
        raise ValueError(
            f"{resume} was stopped after update {within} of epoch {done + 1}, made by {ckpt['world_size']} process(es) x "
            f"--batch-size {old_batch}: resume it with those, not {env.world} x {cfg.batch_size} (another batch size "
            "or number of processes can start at an epoch's end; nothing was written)"
        )
    if is_int(old.get("seed")) and old["seed"] != cfg.seed:
        raise ValueError(f"{resume} was stopped after update {within} of epoch {done + 1}, of an order drawn with --seed "
                         f"{old['seed']}: resume it with --seed {old['seed']}, not {cfg.seed} (another seed can start at an "
                         "epoch's end; nothing was written)")
    recorded, now = ckpt.get("train_split"), _train_split(run)
    if isinstance(recorded, dict) and recorded != now and env.is_main:
        log.warning(
            "%s was stopped after update %d of epoch %d on a training set of %s images; %s now holds %d%s: the rest of that "
            "epoch is drawn from the new set's order, so some of its images are trained on twice in it and others not at "
            "all (the epochs after it are whole)", resume, within, done + 1, recorded.get("images"), cfg.train_json,
            now["images"], " (other images)" if recorded.get("images") == now["images"] else "")


def _train_split(run: _Run) -> dict:
    """The fingerprint of the run's training images in their order (:func:`~cgavit.train.data.split_fingerprint` of
    their file names and ids), which the positions of a stopped epoch index."""
    train_set = run.loader.dataset.dataset  # within Guarded
    return split_fingerprint([(train_set.coco.imgs[i]["file_name"], i) for i in train_set.ids], train_set.image_dir)


def _check_output_free(out: Path, resume: str | None) -> None:
    """Refuse an output folder holding another run's checkpoint.pth or model.pth, which this run would
    overwrite: any folder that holds them, unless this run resumes the checkpoint in it (``--resume``
    of a file in that folder), as ``cgavit train`` does."""
    held = [name for name in ("checkpoint.pth", "model.pth") if os.path.lexists(out / name)]
    own = bool(resume) and out.is_dir() and Path(resume).resolve().parent == out.resolve()
    if held and not own:
        again = (f"continue the run of {resume} in its own folder (--output {Path(resume).parent}), or " if resume
                 else "continue it with --resume auto, or ")
        raise ValueError(f"{out} already holds a run ({', '.join(held)}); {again}choose another --output "
                         "(nothing in it was changed)")


def _setup(
    cfg: DetectionTrainConfig, env: DistEnv, config: dict[str, Any], ckpt: dict | None, train_set: CocoDetection, stopper: Stopper
) -> _Run:
    """Model, optimizer, schedule and loader of a run, restored from ``ckpt`` when resuming."""
    torch.manual_seed(cfg.seed)
    model = build_detector(config, None if ckpt else cfg.pretrained_backbone, trust=cfg.trust_checkpoint)
    model.to(env.device)
    optimizer = torch.optim.AdamW(param_groups(model, cfg.weight_decay), lr=cfg.lr)
    shares = torch.utils.data.DistributedSampler(train_set, env.world, env.rank, shuffle=True, seed=cfg.seed)
    sampler = SeededSampler(shares, cfg.seed, env.rank)  # each image's flip keyed to its position in the epoch
    loader = StopSafeLoader(
        Guarded(train_set), batch_size=cfg.batch_size, sampler=sampler, num_workers=cfg.workers, collate_fn=collate,
        worker_init_fn=ignore_stop_signals,
        drop_last=_drop_last(cfg, len(train_set), env.world),
    )
    milestones = [e * len(loader) for e in cfg.lr_steps]
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda it: lr_factor(it, cfg.warmup_iters, cfg.warmup_ratio, milestones)
    )
    if ckpt is not None:
        model.load_state_dict(ckpt["model"])
        try:
            optimizer.load_state_dict(ckpt["optimizer"])
            scheduler.load_state_dict(ckpt["scheduler"])
        except (ValueError, KeyError, TypeError, IndexError, RuntimeError) as err:
            raise CheckpointError(f"{cfg.resume}: its optimizer or schedule state does not fit this run ({err}); the file is damaged") from None
    wrapped = model
    if env.world > 1:
        wrapped = nn.parallel.DistributedDataParallel(model, device_ids=[env.local_rank] if env.device.type == "cuda" else None)
    return _Run(cfg, env, config, wrapped, model, optimizer, scheduler, sampler, loader, stopper)


def _train_epoch(run: _Run, epoch: int, step: int, part: Mapping[str, Any]) -> tuple[dict[str, Any], int]:
    """Epoch ``epoch`` from its update ``part["updates"]`` (0, or where a stopped run left it: ``part`` holds the
    checkpoint's record of the updates before); returns its ``metrics.jsonl`` record (mean losses over all
    processes and updates) and the step. A signal stops it after the update in progress: the record is then of
    type ``"partial"``, with what a checkpoint keeps of the epoch so far (:func:`_epoch_sums`). An image one rank
    cannot read, or a loss that is not finite on one, stops every rank with that rank's line (agreed at every
    update with the signals): none is left in a collective the others never join."""
    cfg, env = run.cfg, run.env
    start = int(part.get("updates", 0))
    run.sampler.set_epoch(epoch)  # the order: (seed, epoch) alone
    run.sampler.start = start * cfg.batch_size  # this process's images the updates before trained on
    updates, made = start + len(run.loader), start
    run.model.train()
    sums: dict[str, float] = {}
    t0 = time.time()
    bar = tqdm(until_unreadable(batches(run.loader)), total=updates, initial=start, desc=f"epoch {epoch + 1}/{cfg.epochs}",
               disable=None if env.is_main else True, leave=False)  # a terminal's: else a log line every --log-every
    lr = run.optimizer.param_groups[0]["lr"]
    for batch, unreadable in bar:
        if any_true(env, unreadable is not None):  # an image this rank or another could not read: every rank stops
            raise BadImageError(first_message(env, unreadable))
        seed_all(epoch_seed(cfg.seed, epoch, env.rank, stream=16 + made))  # RPN / RoI sampling: keyed to the update
        values, lr = _train_step(run, *batch, step)
        diverged = None if math.isfinite(values["loss"]) else _diverged(values, step)
        step, made = step + 1, made + 1
        # every rank stops where any was signalled (after the epoch's last update: at its end), or where any diverged
        stop, failed = any_each(env, [made < updates and run.stopper.signum is not None, diverged is not None])
        if failed:  # nothing of the epoch is saved: checkpoint.pth keeps its start
            raise ValueError(first_message(env, diverged))
        for k, v in values.items():
            sums[k] = sums.get(k, 0.0) + v
        bar.set_postfix(loss=f"{values['loss']:.3f}", lr=f"{lr:.2e}")
        if cfg.log_every and step % cfg.log_every == 0:
            keys = sorted(values)
            avg = reduce_sum(env, [values[k] for k in keys])
            record = dict(type="step", epoch=epoch + 1, iter=step, lr=lr, **{k: v / env.world for k, v in zip(keys, avg)})
            on_main(env, lambda: append_jsonl(run.metrics_path, record))
            if env.is_main and bar.disable:  # stderr is no terminal (a log file): a line, not the bar's redraws
                log.info("epoch %d/%d [%d/%d] loss %.4f lr %.2e", epoch + 1, cfg.epochs, made, updates, record["loss"], lr)
        if stop:
            break
    sums, count = _epoch_sums(env, sums, made - start, part)
    seconds = float(part.get("time_s", 0.0)) + time.time() - t0
    if made < updates:
        return dict(type="partial", epoch=epoch + 1, updates=made, sums=sums, count=count, time_s=seconds), step
    # lr: the rate of the epoch's last update (the optimiser's holds the next one's, after the scheduler's step)
    row: dict[str, Any] = dict(type="epoch", epoch=epoch + 1, iter=step, lr=lr, time_s=round(seconds, 2))
    row.update({k: v / count for k, v in sums.items()})
    return row, step


def _epoch_sums(env: DistEnv, sums: Mapping[str, float], made: int, part: Mapping[str, Any]) -> tuple[dict[str, float], float]:
    """``(loss sums, count)`` of an epoch so far over all processes: this process's ``sums`` of its ``made``
    updates, summed over the processes (a collective), plus those of the updates before (``part``, a stopped
    run's). Each mean loss is its sum / count."""
    before = part.get("sums", {})
    keys = sorted(set(sums) | set(before))
    totals = reduce_sum(env, [sums.get(k, 0.0) for k in keys] + [float(made)])
    return {k: v + float(before.get(k, 0.0)) for k, v in zip(keys, totals)}, totals[-1] + float(part.get("count", 0.0))


def _train_step(run: _Run, images: Sequence[torch.Tensor], targets: Sequence[dict], step: int) -> tuple[dict[str, float], float]:
    """One optimizer step; returns the loss values and the learning rate it used. The caller checks the loss: under
    several processes a rank whose loss is not finite still joins the backward's gradient all-reduce, so that every
    rank reaches the check that stops them all (nothing is saved after it)."""
    device = run.env.device
    images = [im.to(device) for im in images]
    targets = [{k: v.to(device) if torch.is_tensor(v) else v for k, v in t.items()} for t in targets]
    losses = run.model(images, targets)
    loss = sum(losses.values())
    run.optimizer.zero_grad(set_to_none=True)
    loss.backward()  # a loss that is not finite too: the gradients' all-reduce waits for every rank
    run.optimizer.step()
    lr = run.optimizer.param_groups[0]["lr"]
    run.scheduler.step()
    return {"loss": loss.item(), **{k: v.item() for k, v in losses.items()}}, lr


def _diverged(values: Mapping[str, float], step: int) -> str:
    """What stops a run whose loss at iteration ``step`` is not finite (``values``: its terms, by :func:`_train_step`)."""
    return (f"the loss became {values['loss']} at iteration {step} "
            f"({ {k: round(v, 4) for k, v in values.items() if k != 'loss'} }); nothing was saved from this step; lower "
            "--lr, lengthen --warmup-iters, or check the annotations and the starting weights (--pretrained-backbone, --resume)")


def _save_checkpoint(
    run: _Run, done: int, step: int, part: Mapping[str, Any] | None = None, record: Mapping[str, Any] | None = None
) -> Path:
    """Replace ``checkpoint.pth`` (rank 0) with the run's state after ``done`` epochs and ``step`` updates in all: at
    an epoch's end, with the epoch's ``metrics.jsonl`` ``record`` (its losses, before its evaluation), or within the
    next epoch, whose updates so far ``part`` records (their count ``updates``, loss ``sums`` over the processes and
    ``count``, ``time_s``)."""
    state = dict(
        format=CHECKPOINT_FORMAT, config=run.config, model=run.raw_model.state_dict(), optimizer=run.optimizer.state_dict(),
        scheduler=run.scheduler.state_dict(), epoch=done, iteration=step, epoch_step=int(part["updates"]) if part else 0,
        partial=dict(part or {}), world_size=run.env.world, train_config=_plain(asdict(run.cfg)),
        train_split=_train_split(run) if part else None,  # what the positions of the unfinished epoch index
        record=dict(record or {}),  # the epoch's row, written again by a resume where the run stopped before it
    )
    return save_torch(run.out / "checkpoint.pth", state)


def _evaluate_epoch(run: _Run, val_set: CocoDetection, row: dict[str, Any]) -> dict[str, float]:
    """COCOeval of the epoch just saved. A validation image that cannot be read stops the run with the
    epoch's record appended and its checkpoint named (it was saved first); an interruption appends the record too."""
    cfg, env, epoch = run.cfg, run.env, row["epoch"]
    try:
        metrics, summary = evaluate(run.raw_model, val_set, env, cfg.batch_size, cfg.workers)
    except BaseException as err:  # a damaged image, Ctrl-C, SIGTERM: the epoch's record goes beside its checkpoint
        if env.is_main:
            append_jsonl(run.metrics_path, row)
        if not isinstance(err, DataError):
            raise
        raise DataError(f"{err}. Epoch {epoch} was saved before its evaluation ({run.out / 'checkpoint.pth'}): fix "
                        "the validation data, evaluate it with `cgavit detect eval`, and continue with --resume auto") from None
    if env.is_main:
        # the table is the message's own text: the terminal escapes line breaks in a value put into a message
        log.info("epoch %d COCO evaluation\n" + summary.replace("%", "%%"), epoch)
    return metrics


def _plain(obj: Any) -> Any:
    """``obj`` with tuples as lists (a form ``torch.load(weights_only=True)`` always accepts)."""
    if isinstance(obj, Mapping):
        return {str(k): _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    return obj
