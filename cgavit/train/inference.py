"""Evaluation and prediction with any checkpoint: one trained here (``best.pt``, ``last.pt``,
``best.safetensors``), an official release file or a timm file.

A checkpoint trained here carries its model name, dials, image size, normalisation and class names,
so nothing else is needed; other files need ``--model`` (and the dials they were trained with) and
get ImageNet-1k class names when they have 1000 outputs.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from functools import lru_cache
from importlib import resources
from pathlib import Path

import torch
from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
from torch import nn

from ..factory import create_model, resolve_name
from ..io import DataError, sniff_format
from ..variants import VARIANTS
from ..weights import (
    CROP_PCT_RANGE,
    IMG_SIZE_RANGE,
    CheckpointError,
    WeightsMeta,
    convert_state_dict,
    load_checkpoint,
    read_state_dict,
    read_weights_meta,
    save_weights,
)
from . import checkpoint as ckpt_io
from .config import TrainConfig
from .data import BadImageError, ImageFolderDataset, build_transform, check_folder, eval_sampler, list_split, load_image, make_loader
from .distributed import setup, teardown
from .evaluation import evaluate
from .records import weights_meta

log = logging.getLogger(__name__)


@lru_cache(maxsize=1)
def imagenet_classes() -> list[tuple[str, str]]:
    """The 1000 ImageNet-1k ``(synset, description)`` pairs in class-index order (package data built
    from timm's ImageNet metadata)."""
    text = resources.files(__package__).joinpath("imagenet_classes.txt").read_text()
    return [tuple(line.split("\t", 1)) for line in text.splitlines() if line.strip()]


@dataclass
class ModelInfo:
    """How to feed and read a loaded model."""

    class_names: list[str]
    img_size: int = 224
    crop_pct: float = 0.875
    interpolation: str = "bicubic"
    mean: tuple[float, ...] = IMAGENET_DEFAULT_MEAN
    std: tuple[float, ...] = IMAGENET_DEFAULT_STD
    source: str = ""
    extra: dict = field(default_factory=dict)


def _names_for(num_classes: int, stored: list[str] | None) -> list[str]:
    if stored and len(stored) == num_classes:
        return list(stored)
    if num_classes == 1000:
        return [desc.split(",")[0] for _, desc in imagenet_classes()]
    return [f"class {i}" for i in range(num_classes)]


def load_model(
    path: str | Path | None,
    model_name: str | None = None,
    dials: dict | None = None,
    *,
    pretrained: bool = False,
    use_ema: bool = False,
    trust: bool = False,
    device: str | torch.device = "cpu",
) -> tuple[nn.Module, ModelInfo]:
    """Rebuild a network from a checkpoint and return it in eval mode with its :class:`ModelInfo`.

    Args:
        path: ``best.pt`` / ``last.pt`` (training checkpoints), ``*.safetensors`` written here, or an
            official / timm file (then ``model_name`` is needed). None with ``pretrained``.
        model_name: variant name for files that do not record it; for files that do, it must agree.
        dials: design dials for files that do not record them.
        pretrained: load the published ImageNet-1k weights of ``model_name`` (downloads once).
        use_ema: take the EMA weights of a training checkpoint.
        trust: allow pickled objects in third-party files (runs code from the file).
        device: where to put the model.

    Raises:
        CheckpointError: unreadable file or one that does not fit.
        ValueError: not enough information to build the model.
    """
    if path is None:
        if not (pretrained and model_name):
            raise ValueError("give --checkpoint FILE, or --model NAME --pretrained for the published weights")
        model = create_model(model_name, pretrained=True, **(dials or {}))
        info = ModelInfo(_names_for(model.num_classes, None), source=f"{model_name} (published)")
    else:
        model, info = _from_file(ckpt_io.readable(path), model_name, dials, use_ema, trust)
    ckpt_io.check_finite(model.state_dict(), info.source)
    return model.eval().to(device), info


def _from_file(path: Path, model_name: str | None, dials: dict | None, use_ema: bool, trust: bool) -> tuple[nn.Module, ModelInfo]:
    """A network from a weights file written here, a training checkpoint, or an official / timm file."""
    meta = read_weights_meta(path)
    if meta is not None and meta.model:
        return _from_safetensors(path, meta)
    if sniff_format(path) in ("zip", "pickle"):
        try:
            ck = ckpt_io.read_torch_file(path)
        except Exception:
            ck = None  # damaged, or pickled objects: read_state_dict below says which
        if ckpt_io.is_training_checkpoint(ck):
            ckpt_io.check(ck, path)
            return _from_training(path, ck, model_name, use_ema)
    sd = convert_state_dict(read_state_dict(path, trust=trust, prefer_ema=use_ema))  # official / timm / bare
    if not model_name:
        raise ValueError(f"{path} does not record its architecture; pass --model NAME (and the dials it was trained with)")
    head = sd.get("head.linear.weight")
    num_classes = int(head.shape[0]) if head is not None else 1000
    model = create_model(model_name, num_classes=num_classes, distillation="head_dist.linear.weight" in sd, **(dials or {}))
    load_checkpoint(model, sd)
    return model, ModelInfo(_names_for(num_classes, None), source=str(path))


def _from_training(path: Path, ck: dict, model_name: str | None, use_ema: bool) -> tuple[nn.Module, ModelInfo]:
    """A network from a training checkpoint (checked by :func:`checkpoint.check`); its recorded options
    are validated, and checked against its tensors, before the network is built."""
    cfg = TrainConfig.from_checkpoint(ck, path)
    if model_name and model_name.split(".")[0] not in (cfg.model, f"efficientvit_{model_name}"):
        log.warning("--model %s differs from the checkpoint's %s; using the checkpoint's", model_name, cfg.model)
    sd = ck["model_ema"] if use_ema and ck.get("model_ema") is not None else ck["model"]
    classes = list(ck.get("classes") or [])
    num_classes = _recorded_classes(sd, classes, cfg, path)
    model = create_model(
        cfg.model, num_classes=num_classes, img_size=cfg.img_size, distillation=cfg.distillation_type != "none", **cfg.dials
    )
    load_checkpoint(model, sd)
    info = ModelInfo(
        _names_for(model.num_classes, classes),
        img_size=cfg.img_size,
        crop_pct=cfg.crop_pct,
        interpolation=cfg.interpolation,
        mean=cfg.mean or IMAGENET_DEFAULT_MEAN,
        std=cfg.std or IMAGENET_DEFAULT_STD,
        source=str(path),
    )
    return model, info


def _recorded_classes(sd: dict, classes: list[str], cfg: TrainConfig, path: Path) -> int:
    """The class count of a training checkpoint, after checking the recorded class names and network
    width against the classifier it holds (so a record that asks for more than its tensors builds
    nothing)."""
    head = sd.get("head.linear.weight")
    if head is None or head.ndim != 2:
        raise CheckpointError(f"{path}: its weights have no classifier 'head.linear.weight'; the file is damaged")
    width = VARIANTS[resolve_name(cfg.model)].cfg.with_dials(**cfg.dials).embed_dim[-1]
    if head.shape[1] != width or (classes and len(classes) != head.shape[0]):
        raise CheckpointError(
            f"{path}: its record ({len(classes)} classes, last width {width}) disagrees with its classifier of "
            f"shape {tuple(head.shape)}; the file is damaged"
        )
    return int(head.shape[0])


def _from_safetensors(path: Path, meta: WeightsMeta) -> tuple[nn.Module, ModelInfo]:
    model = create_model(
        meta.model,
        num_classes=meta.num_classes,
        img_size=meta.img_size,
        distillation=meta.distillation,
        **meta.dials(),
    )
    load_checkpoint(model, path)
    info = ModelInfo(
        _names_for(meta.num_classes, list(meta.class_names or [])),
        img_size=meta.img_size,
        crop_pct=meta.crop_pct,
        interpolation=meta.interpolation,
        mean=meta.mean,
        std=meta.std,
        source=str(path),
    )
    return model, info


def export_weights(checkpoint: str | Path, path: str | Path, use_ema: bool = False) -> Path:
    """Write a training checkpoint's weights in the package's safetensors format, with the metadata
    (model, config, class names, input size, normalisation) that :func:`load_model` rebuilds from."""
    ck = ckpt_io.load(checkpoint)
    model, info = load_model(checkpoint, use_ema=use_ema)
    cfg = TrainConfig.from_checkpoint(ck, checkpoint)
    meta = weights_meta(cfg, model, info.class_names, {"epoch": str(int(ck["next_epoch"]) - 1)})
    return save_weights(model, path, meta)


def evaluate_checkpoint(
    data: str | Path,
    checkpoint: str | Path | None,
    model_name: str | None = None,
    *,
    split: str | None = None,
    img_size: int | None = None,
    crop_pct: float | None = None,
    interpolation: str | None = None,
    batch_size: int = 128,
    workers: int = 4,
    device: str = "auto",
    dials: dict | None = None,
    use_ema: bool = False,
    pretrained: bool = False,
    strict: bool = False,
    trust: bool = False,
) -> dict:
    """Top-1, top-5 (percent) and loss of a checkpoint on an image folder; distributed under torchrun.

    Args:
        data: dataset root (its ``split``, default ``val``, is used when present) or a split folder.
        checkpoint: any file :func:`load_model` reads.
        img_size, crop_pct, interpolation: evaluation transform; default: what the checkpoint
            records, else 224 / 0.875 / bicubic.
        split: sub-folder of ``data`` to evaluate.

    Returns:
        ``{"top1", "top5", "loss", "n", "skipped", "img_size", "crop_pct", "checkpoint", "data"}``.

    Raises:
        DataError: ``data`` is no image folder, or none of its images can be read.
        CheckpointError: an unreadable or damaged checkpoint (NaN/inf weights included).
        ValueError: options out of bounds.
    """
    check_eval_options(img_size, crop_pct, batch_size, workers)
    root = check_folder(data)
    env = setup(device)
    try:
        model, info = load_model(checkpoint, model_name, dials, use_ema=use_ema, pretrained=pretrained, trust=trust, device=env.device)
        split_dir = root / (split or "val") if (root / (split or "val")).is_dir() or split else root
        classes, samples = _split_for(split_dir, model.num_classes)
        size = img_size or info.img_size
        pct = crop_pct or info.crop_pct
        interp = interpolation or info.interpolation
        transform = build_transform(size, False, interpolation=interp, crop_pct=pct, mean=info.mean, std=info.std)
        ds = ImageFolderDataset(samples, classes, transform, strict=strict)
        loader = make_loader(ds, batch_size, eval_sampler(ds, env.world, env.rank), workers, pin_memory=env.device.type == "cuda")
        res = evaluate(model, loader, env)
        for p in res.pop("bad_paths"):
            log.warning("skipped unreadable image %s", p)
        if res["n"] == 0:
            raise DataError(f"none of the {len(samples)} images in {split_dir} could be read; no metrics to report")
        res.update(img_size=size, crop_pct=pct, interpolation=interp, checkpoint=str(checkpoint), data=str(split_dir), world_size=env.world)
        return res
    finally:
        teardown(env)


def _split_for(split_dir: Path, num_classes: int) -> tuple[list[str], list[tuple[str, int]]]:
    """The classes and samples of ``split_dir``, which must have one class folder per model output."""
    classes, samples = list_split(split_dir)
    if len(classes) != num_classes:
        raise DataError(f"{split_dir} has {len(classes)} class folders but the model predicts {num_classes} classes")
    return classes, samples


def check_eval_options(img_size: int | None, crop_pct: float | None, batch_size: int = 1, workers: int = 0) -> None:
    """Raise ``ValueError`` when an evaluation image size or crop fraction (None: the checkpoint's)
    is out of bounds (sizes within 32..4096 pixels, crops within 0.2..1), or the batch size is below 1
    or the worker count below 0."""
    if batch_size < 1 or workers < 0:
        raise ValueError(f"--batch-size must be at least 1 and --workers at least 0, got {batch_size} and {workers}")
    lo, hi = IMG_SIZE_RANGE
    if img_size is not None and (isinstance(img_size, bool) or not isinstance(img_size, int) or not lo <= img_size <= hi):
        raise ValueError(f"--img-size must be between {lo} and {hi} pixels, got {img_size}")
    lo, hi = CROP_PCT_RANGE
    if crop_pct is not None and not (math.isfinite(crop_pct) and lo <= crop_pct <= hi):
        raise ValueError(f"--crop-pct must be within {lo}..{hi}, got {crop_pct}")


@torch.no_grad()
def predict(
    images: list[str | Path],
    checkpoint: str | Path | None,
    model_name: str | None = None,
    *,
    topk: int = 5,
    img_size: int | None = None,
    crop_pct: float | None = None,
    dials: dict | None = None,
    use_ema: bool = False,
    pretrained: bool = False,
    trust: bool = False,
    device: str = "cpu",
) -> list[dict]:
    """The ``topk`` classes of each image, any PIL mode (grayscale, RGBA, palette, CMYK, 16-bit,
    float) and any size. An image that cannot be read does not stop the others.

    Returns:
        One row per image, in order: ``{"image", "top": [{"index", "name", "prob"}, ...]}`` with
        probabilities in [0, 1], or ``{"image", "error"}`` for an image that cannot be read (missing,
        empty, a pipe, not an image, truncated, too large); ``topk`` beyond the class count shows all.

    Raises:
        ValueError: ``topk`` below 1, or ``img_size`` / ``crop_pct`` out of bounds.
        CheckpointError: an unreadable or damaged checkpoint (NaN/inf weights included).
    """
    if isinstance(topk, bool) or not isinstance(topk, int) or topk < 1:
        raise ValueError(f"--topk must be at least 1, got {topk}")
    check_eval_options(img_size, crop_pct)
    model, info = load_model(checkpoint, model_name, dials, use_ema=use_ema, pretrained=pretrained, trust=trust, device=device)
    if topk > model.num_classes:
        log.warning("--topk %d is more than the model's %d classes: showing all of them", topk, model.num_classes)
    size = img_size or info.img_size
    transform = build_transform(size, False, interpolation=info.interpolation, crop_pct=crop_pct or info.crop_pct, mean=info.mean, std=info.std)
    synsets = imagenet_classes() if model.num_classes == 1000 else None
    out = []
    for path in images:
        try:
            x = transform(load_image(path)).unsqueeze(0).to(device)  # (1, 3, size, size)
        except BadImageError as err:
            out.append({"image": str(path), "error": str(err)})
            continue
        prob = model(x).float().softmax(dim=1)[0]
        p, i = prob.topk(min(topk, prob.numel()))
        top = []
        for pi, ii in zip(p.tolist(), i.tolist()):
            row = {"index": ii, "name": info.class_names[ii], "prob": pi}
            if synsets is not None and info.class_names[ii] == synsets[ii][1].split(",")[0]:
                row["synset"] = synsets[ii][0]
            top.append(row)
        out.append({"image": str(path), "top": top})
    return out
