"""Evaluation and prediction with any checkpoint: one trained here (``best.pt``, ``last.pt``,
``best.safetensors``), an official release file or a timm file, rebuilt by :func:`cgavit.load_model`.

A checkpoint trained here carries its model name, dials, image size, normalisation and class names,
so nothing else is needed; other files need ``--model`` (and the dials they were trained with) and
get ImageNet-1k class names when they have 1000 outputs.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn
from torchvision.transforms import Compose, Grayscale

from ..bounds import CROP_PCT_RANGE, IMG_SIZE_RANGE, INTERPOLATIONS
from ..classes import check_classes, model_indices, same_classes
from ..deploy import FORMATS, ExportInfo, open_exported
from ..deploy.formats import SUFFIX_FORMATS, ExportFormat, format_of_head
from ..factory import ModelInfo, UnrecordedArchitecture, load_model
from ..imagenet import class_names, imagenet_classes
from ..images import SkippedImages
from ..io import CheckpointError, DataError, sniff_format
from ..variants import channel_normalisation
from ..weights import save_weights
from . import checkpoint as ckpt_io
from .config import BOUNDS, TrainConfig
from .data import BadImageError, ImageFolderDataset, build_transform, check_folder, check_split_name, eval_sampler, list_split, load_transformed, make_loader
from .distributed import joined, resolve_device
from .evaluation import evaluate
from .records import weights_meta

log = logging.getLogger(__name__)


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
    reference: str | Path | None = None,
) -> dict:
    """Top-1, top-5 (percent) and loss of a checkpoint on an image folder; distributed under torchrun.

    Args:
        data: dataset root (its ``split``, default ``val``, is used when present) or a split folder.
        checkpoint: any file :func:`load_model` reads.
        img_size, crop_pct, interpolation: evaluation transform; default: what the checkpoint
            records, else 224 / 0.875 / bicubic.
        split: sub-folder of ``data`` to evaluate.
        reference: a checkpoint or exported file to compare with on the same images, such as the fp32 checkpoint an
            int8 file was quantised from (:func:`check_reference`): adds ``"reference"``, ``"agreement"`` (percent of
            images whose top-1 class is the reference's) and ``"changed"`` (images whose is not) to the result.

    Returns:
        ``{"top1", "top5", "loss", "n", "skipped", "img_size", "crop_pct", "checkpoint", "data"}``.

    Raises:
        DataError: ``data`` is no image folder, or none of its images can be read.
        CheckpointError: an unreadable or damaged checkpoint (NaN/inf weights included).
        ValueError: options out of bounds, or a reference for other classes or other preprocessing.
    """
    check_eval_options(img_size, crop_pct, batch_size, workers, interpolation)
    root = check_folder(data)
    exported = is_exported(checkpoint)
    _refuse_needless_trust(checkpoint, reference, trust)
    with joined(inference_device(device, checkpoint, reference)) as env:  # under torchrun: warnings once, by rank 0
        model, info, num_classes = open_for_inference(  # with a reference, --trust-checkpoint may be for it alone
            checkpoint, model_name, dials, img_size=img_size, use_ema=use_ema, pretrained=pretrained,
            trust=trust and not (exported and reference is not None), device=env.device)
        split_dir = _split_folder(root, split)
        size, pct, interp = img_size or info.img_size, crop_pct or info.crop_pct, interpolation or info.interpolation
        ds = _eval_dataset(split_dir, info, num_classes, eval_transform(info, input_channels(model), size, pct, interp),
                           guessed=split is None and split_dir == root)
        loader = make_loader(ds, batch_size, eval_sampler(ds, env.world, env.rank), workers,
                             pin_memory=env.device.type == "cuda", strict=strict)
        against = None if reference is None else check_reference(reference, info, num_classes, (size, pct, interp),
                                                                  env.device, trust, input_channels(model))
        res = _checked_metrics(evaluate(model, loader, env, reference=against), len(ds), split_dir, checkpoint)
        res.update(img_size=size, crop_pct=pct, interpolation=interp, checkpoint=str(checkpoint), data=str(split_dir),
                   world_size=env.world, num_classes=num_classes, **({} if reference is None else {"reference": str(reference)}))
        return res


def _refuse_needless_trust(checkpoint: str | Path | None, reference: str | Path | None, trust: bool) -> None:
    """Refuse ``--trust-checkpoint`` where the evaluated file and its reference are both exported files: it was
    ignored without a word (with one of them a checkpoint, it applies to that one)."""
    if trust and is_exported(checkpoint) and is_exported(reference):
        raise ValueError(f"{Path(checkpoint).name} and --reference {Path(reference).name} are both exported files, "
                         "which carry their network and hold no pickled objects: drop --trust-checkpoint")


def is_exported(path: str | Path | None) -> bool:
    """Whether ``path`` names an exported file that carries its metadata (a suffix of
    :data:`~cgavit.deploy.formats.SUFFIX_FORMATS`: ``.onnx``, ``.xml``), which runs in its runtime on the CPU."""
    return path is not None and Path(path).suffix.lower() in SUFFIX_FORMATS


def inference_device(device: str | torch.device, *files: str | Path | None) -> str | torch.device:
    """``device``, where ``"auto"`` is the CPU when one of ``files`` is an exported file (which runs there only): on a
    machine with a GPU, ``cgavit eval --checkpoint model.onnx`` was refused with 'give --device cpu'."""
    return "cpu" if isinstance(device, str) and device == "auto" and any(map(is_exported, files)) else device


def _split_folder(root: Path, split: str | None) -> Path:
    """``root/split``; without a split, ``root/val`` where it exists, else ``root`` itself."""
    check_split_name(root, split, "--split")  # "" was read as "val"
    return root / (split or "val") if (root / (split or "val")).is_dir() or split else root


def _eval_dataset(split_dir: Path, info: ModelInfo, num_classes: int, transform: Callable,
                  guessed: bool = False) -> ImageFolderDataset:
    """``split_dir``'s images labelled in the model's class order, through its evaluation ``transform``.

    ``guessed``: ``split_dir`` is the data folder itself, taken as the split because it has no ``val``. Where the
    folders read as its classes hold folders of their own (``train/``, ``test/``: splits), the error of a checkpoint
    with names says to name one with ``--split`` (it said 'give the folder the model was trained on'), and one without
    names, which matches folders by count, warns so: a 2-class file evaluated ``train`` and ``test`` as its classes.
    """
    try:
        classes, samples = split_for_model(split_dir, info, num_classes)
    except DataError as err:
        splits = _nested_folders(split_dir) if guessed else []
        if not splits:
            raise
        raise DataError(f"{err}. {_split_hint(split_dir, splits)}") from None
    if guessed and not info.names_recorded:  # folders matched by count alone: looked into only then
        splits = _nested_folders(split_dir)
        if len(splits) == len(classes):
            log.warning("evaluating %s as class folders; %s", ", ".join(map(repr, classes[:5])),
                        _split_hint(split_dir, splits))
    return ImageFolderDataset(samples, classes, transform)


def _split_hint(folder: Path, splits: list[str]) -> str:
    """What to say of a data folder without ``val`` whose sub-folders ``splits`` hold folders of their own: that they
    look like splits, and the ``--split`` to give (the first that is not ``train``)."""
    pick = next((name for name in splits if name != "train"), splits[0])
    return (f"{folder} has no val folder, and {', '.join(map(repr, splits[:5]))} hold folders of their own: if they "
            f"are splits, name the one to evaluate, e.g. --split {pick}")


def _nested_folders(folder: Path) -> list[str]:
    """The names of ``folder``'s visible sub-folders that hold folders themselves (splits, not classes of images)."""
    def holds_folders(path: str) -> bool:
        with os.scandir(path) as entries:
            return any(e.is_dir() and not e.name.startswith(".") for e in entries)

    try:
        return sorted(e.name for e in os.scandir(folder) if e.is_dir() and not e.name.startswith(".")
                      and holds_folders(e.path))
    except OSError:  # unreadable: the error already raised says what it could
        return []


def input_channels(model: nn.Module) -> int:
    """The channels of the images ``model`` takes: an exported file's declared input, a checkpoint's ``in_chans``."""
    shape = getattr(model, "input_shape", None)
    return shape[1] if shape else getattr(model, "in_chans", 3)


def eval_transform(info: ModelInfo, channels: int, size: int, crop_pct: float, interpolation: str) -> Callable:
    """The evaluation transform (PIL image -> ``(channels, size, size)``) of a model taking ``channels``-channel
    images: each image read as greyscale (Pillow's ``'L'``) for 1 channel, as RGB for 3, then resized, cropped and
    normalised by ``info``'s mean and std (three for one channel averaged, as its export records them:
    :func:`~cgavit.variants.channel_normalisation`).

    Raises:
        ValueError: another channel count: the commands read images as greyscale or RGB.
    """
    if channels not in (1, 3):
        raise ValueError(f"the model takes {channels}-channel images, and cgavit's commands read images as greyscale (1 "
                         "channel) or RGB (3): feed it from Python, with images of its channels")
    mean, std = channel_normalisation(info.mean, info.std, channels)
    transform = build_transform(size, False, interpolation=interpolation, crop_pct=crop_pct, mean=mean, std=std)
    return transform if channels == 3 else Compose([Grayscale(1), transform])


def check_reference(reference: str | Path, info: ModelInfo, num_classes: int, transform: tuple[int, float, str],
                    device: torch.device, trust: bool = False, channels: int = 3) -> nn.Module:
    """The model to compare an evaluated one with: a checkpoint that records its network (as files written here do),
    or an exported file, opened for the evaluated model's images (``transform``: their size, crop fraction and
    interpolation) once it predicts the same classes as that model (``info``, ``num_classes``) and normalises as it
    does: the images are prepared once, for the evaluated model (another crop or interpolation is warned about).
    ``trust``: allow pickled objects in it, as in the evaluated file. ``channels``: the evaluated model's input channels.

    Raises:
        ValueError: no such file, one that cannot be read or that does not record its network, an exported file
            for another image size, another class count, other recorded class names, other input channels, or
            another mean and std (as the images' channels take them: :func:`eval_transform`); the message starts
            with ``--reference``.
    """
    size, crop_pct, interpolation = transform
    name = Path(reference).name
    if not str(reference):
        raise ValueError("--reference needs a checkpoint or exported file, got an empty name")
    exported = is_exported(reference)
    try:
        model, ref, classes = open_for_inference(reference, img_size=None if exported else size, device=device,
                                                 trust=trust and not exported)
    except UnrecordedArchitecture:
        raise ValueError(f"--reference {name} does not record its network (a bare state dict, an official or timm "
                         "file); give a checkpoint written by cgavit, such as the one the evaluated file was made "
                         "from") from None
    except ValueError as err:
        raise ValueError(f"--reference {name}: {err}") from None
    if exported and ref.img_size != size:
        raise ValueError(f"--reference {name} was exported for {ref.img_size} px images and the model evaluated runs at "
                         f"{size} px; give a reference for {size} px images")
    if (ref.crop_pct, ref.interpolation) != (crop_pct, interpolation):
        log.warning("--reference %s records crop %s and %s resizing; it is given the evaluated model's images (crop %s, "
                    "%s)", name, ref.crop_pct, ref.interpolation, crop_pct, interpolation)
    if classes != num_classes or (ref.names_recorded and info.names_recorded and
                                  not same_classes(ref.class_names, info.class_names)):
        raise ValueError(f"--reference {name} predicts other classes ({classes}: {', '.join(ref.class_names[:3])}, ...) "
                         f"than the model evaluated ({num_classes}: {', '.join(info.class_names[:3])}, ...); give the "
                         "checkpoint it was exported or quantised from")
    if input_channels(model) != channels:
        raise ValueError(f"--reference {name} takes {input_channels(model)}-channel images and the model evaluated "
                         f"{channels}-channel ones; give the checkpoint it was exported or quantised from")
    (ref_mean, ref_std), (mean, std) = (channel_normalisation(i.mean, i.std, channels) for i in (ref, info))
    if not (_close(ref_mean, mean) and _close(ref_std, std)):
        raise ValueError(f"--reference {name} normalises with mean {ref_mean} and std {ref_std}, the model "
                         f"evaluated with {mean} and {std}: they would not see the same images")
    return model


def _close(a, b) -> bool:
    return len(a) == len(b) and all(math.isclose(x, y, rel_tol=1e-5, abs_tol=1e-6) for x, y in zip(a, b))


def _checked_metrics(res: dict, images: int, split_dir: Path, checkpoint: object) -> dict:
    """:func:`evaluate`'s metrics, once they mean something: unreadable images warned about; none read, or
    outputs that are not finite (a diverged model), refused."""
    res.pop("bad_paths")
    SkippedImages().report(res.pop("bad_errors"))
    if res["n"] == 0:
        raise DataError(f"none of the {images} images in {split_dir} could be read; no metrics to report")
    broken = res.pop("nonfinite")
    if broken:
        raise ValueError(f"{checkpoint} gives outputs that are not finite on {broken} of {res['n']} images "
                         "(a diverged model): its metrics would mean nothing; use a checkpoint from before it diverged")
    return res


def open_for_inference(
    checkpoint: str | Path | None,
    model_name: str | None = None,
    dials: dict | None = None,
    *,
    img_size: int | None = None,
    use_ema: bool = False,
    pretrained: bool = False,
    trust: bool = False,
    device: str | torch.device = "cpu",
) -> tuple[nn.Module, ModelInfo, int]:
    """The network ``eval`` and ``predict`` run: a checkpoint through :func:`~cgavit.factory.load_model`,
    or an exported ``.onnx`` / OpenVINO ``.xml`` file (:data:`~cgavit.deploy.formats.SUFFIX_FORMATS`) in its runtime on the
    CPU, read with the preprocessing and class names its metadata carries, so that the file a user will
    ship is the file they check.

    Returns:
        ``(model, info, number of classes)``.

    Raises:
        ValueError: an ExecuTorch or LiteRT file (no metadata to read it by), an exported file with options that
            only a checkpoint takes (``--model``, dials,
            ``--ema``, ``--pretrained``, ``--trust-checkpoint``), another device than the CPU, an
            ``--img-size`` other than the file's, a file without cgavit metadata, or a network without a classifier.
        CheckpointError: an unreadable or damaged checkpoint.
    """
    _refuse_unrun_format(checkpoint)
    if not is_exported(checkpoint):
        try:
            model, info = load_model(checkpoint, model_name, dials, img_size=img_size, use_ema=use_ema,
                                     pretrained=pretrained, trust=trust, device=device)  # built for --img-size, if given
        except CheckpointError:
            _refuse_renamed_export(checkpoint)
            raise
        if model.num_classes == 0:
            raise ValueError(f"{checkpoint} has no classifier (num_classes 0: a feature extractor), and eval and predict "
                             "need one: fine-tune it for your classes with cgavit train --finetune")
        return model, info, model.num_classes
    name = Path(checkpoint).name
    given = [flag for flag, value in (("--model", model_name), ("dial flags", dials), ("--ema", use_ema),
                                      ("--pretrained", pretrained), ("--trust-checkpoint", trust)) if value]
    if given:
        raise ValueError(f"{name} is an exported file: it carries its network and weights, so drop {', '.join(given)}")
    if torch.device(device).type != "cpu":
        raise ValueError(f"{name} runs in its runtime on the CPU (ONNX Runtime or OpenVINO): give --device cpu, or "
                         "evaluate the checkpoint it was exported from on the GPU")
    model, exported = open_exported(checkpoint)
    return model, exported_model_info(exported, name, img_size), len(exported.class_names)


def _refuse_unrun_format(checkpoint: str | Path | None) -> None:
    """Refuse an ExecuTorch ``.pte`` or LiteRT ``.tflite`` file, which records no class names or preprocessing, saying
    what eval and predict run instead: it was 'an exported model, not weights: give the checkpoint it was exported
    from', which named neither the files they run nor how to run this one."""
    suffix = Path(checkpoint).suffix.lower() if checkpoint is not None else ""
    fmt = next((f for f in FORMATS.values() if f.suffix == suffix and not f.metadata), None)
    if fmt is not None:
        raise _unrun_format(f"{Path(checkpoint).name}, a file for {fmt.runtime},", fmt)


def _unrun_format(described: str, fmt: ExportFormat) -> ValueError:
    """The refusal of a file of ``fmt``, a format without metadata, ``described`` as the start of the line."""
    runnable = " and ".join(f.suffix for f in FORMATS.values() if f.metadata)
    return ValueError(f"{described} records no class names or preprocessing: eval and predict run {runnable} files; "
                      f"export the checkpoint to one of them to check the network here, or run this file with "
                      f"cgavit.deploy.load_exported(path, {fmt.name!r})")



def _refuse_renamed_export(checkpoint: str | Path | None) -> None:
    """Refuse, naming its format, an exported file under another suffix that the weights reader could not read (a
    ``model`` downloaded without its ``.onnx``, an ``.xml`` renamed ``.pt``): it was 'neither safetensors nor a PyTorch
    checkpoint ... or a truncated download?', and eval and predict tell an exported file by its suffix."""
    try:  # a pipe is never opened (it would block): the reader refused it
        if not os.path.isfile(checkpoint) or sniff_format(checkpoint) != "unknown":  # a damaged checkpoint: said
            return
        with open(checkpoint, "rb") as f:
            head = f.read(16)
    except (OSError, TypeError, ValueError):  # the reader's own error said what is wrong with the path
        return
    fmt = format_of_head(head)
    if fmt is None:
        return
    if not fmt.metadata:
        raise _unrun_format(f"{Path(checkpoint).name} is a file for {fmt.runtime} by its first bytes, which", fmt)
    beside = " (its .bin beside it, of the same name)" if fmt.name == "openvino" else ""
    raise ValueError(f"{Path(checkpoint).name} is a file for {fmt.runtime} by its first bytes, not a checkpoint: eval "
                     f"and predict tell an exported file by its suffix; name it {Path(checkpoint).stem}{fmt.suffix}"
                     f"{beside}")


def exported_model_info(exported: ExportInfo, name: str, img_size: int | None = None) -> ModelInfo:
    """The :class:`~cgavit.factory.ModelInfo` of an exported file, from the metadata it carries. Its class
    names count as its own (matched to class folders by name) unless they are the placeholders a
    checkpoint without names gets (ImageNet-1k's, or ``class 0``, ``class 1``, ...).

    Raises:
        ValueError: ``img_size`` other than the file's, a file that is not square, or no class names.
    """
    h, w = exported.img_size
    if h != w:
        raise ValueError(f"{name} takes {h}x{w} images; eval and predict use square inputs: export it at one size")
    if img_size is not None and img_size != h:
        raise ValueError(f"{name} was exported for {h} px images; drop --img-size {img_size}, or export it at that size")
    names = list(exported.class_names)
    if not names:
        raise ValueError(f"{name} records no class names, so eval and predict cannot name its outputs: a model without a "
                         "classifier (num_classes=0) exports so, as do cgavit export --model without --checkpoint (random "
                         "weights, to try the format) and export_model without info=; export a classifier's checkpoint "
                         "with cgavit export, or give export_model the ModelInfo load_model returned (or an ExportInfo "
                         "naming its classes)")
    return ModelInfo(class_names=names, img_size=h, crop_pct=exported.crop_pct, interpolation=exported.interpolation,
                     mean=tuple(exported.mean), std=tuple(exported.std), source=name,
                     names_recorded=names != class_names(len(names)))


def split_for_model(split_dir: Path, info: ModelInfo, num_classes: int) -> tuple[list[str], list[tuple[str, int]]]:
    """The classes and samples of ``split_dir``, labelled in the model's class order.

    A checkpoint that records its class names is matched by name: every class folder must be one of
    them (a subset is fine: its labels are mapped to the checkpoint's indices, and the log says so).
    A file without names (official, timm) needs one class folder per output, in sorted order.

    Raises:
        DataError: a class folder the checkpoint does not know, or (without recorded names) a class
            count that differs from the model's.
    """
    classes, samples = list_split(split_dir)
    try:
        check_classes(split_dir, classes, info, num_classes, subset=True)
    except ValueError as err:
        raise DataError(str(err)) from None
    if not info.names_recorded:
        return classes, samples
    if len(classes) != len(info.class_names):  # a subset (check_classes: each folder is one of the checkpoint's)
        log.warning("evaluating %d of the checkpoint's %d classes (%s), matched by name", len(classes),
                    len(info.class_names), ", ".join(classes[:5]) + (" ..." if len(classes) > 5 else ""))
    index = model_indices(classes, info).tolist()
    return list(info.class_names), [(path, index[label]) for path, label in samples]


def check_eval_options(img_size: int | None, crop_pct: float | None, batch_size: int = 1, workers: int = 0,
                       interpolation: str | None = None) -> None:
    """Raise ``ValueError`` when an evaluation image size or crop fraction (None: the checkpoint's)
    is out of bounds (sizes within 32..4096 pixels, crops within 0.2..1), the interpolation (None: the checkpoint's)
    is not one of :data:`~cgavit.bounds.INTERPOLATIONS` (``"cubic"`` raised a bare ``KeyError`` once the model was
    loaded), or the batch size is below 1 or the worker count outside 0..1024, as training's (each worker is a
    process: ``-j 100000`` forked them all)."""
    low, high = BOUNDS["workers"]
    if batch_size < 1 or not low <= workers <= high:
        raise ValueError(f"--batch-size must be at least 1 and --workers within {low}..{high}, got {batch_size} and "
                         f"{workers}")
    lo, hi = IMG_SIZE_RANGE
    if img_size is not None and (isinstance(img_size, bool) or not isinstance(img_size, int) or not lo <= img_size <= hi):
        raise ValueError(f"--img-size must be between {lo} and {hi} pixels, got {img_size}")
    lo, hi = CROP_PCT_RANGE
    if crop_pct is not None and not (math.isfinite(crop_pct) and lo <= crop_pct <= hi):
        raise ValueError(f"--crop-pct must be within {lo}..{hi}, got {crop_pct}")
    if interpolation is not None and interpolation not in INTERPOLATIONS:
        raise ValueError(f"--interpolation must be one of {', '.join(INTERPOLATIONS)}, got {interpolation!r}")


@torch.no_grad()
def predict(
    images: list[str | Path] | str | Path,
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
    float) and any size. An image that cannot be read does not stop the others. ``images``: a list of paths, or
    one path (a ``str`` or ``Path``: one image, not a list of its characters).

    Returns:
        One row per image, in order: ``{"image", "top": [{"index", "name", "prob"}, ...]}`` with
        probabilities in [0, 1], or ``{"image", "error"}`` for an image that cannot be read (missing,
        empty, a pipe, not an image, truncated, too large); ``topk`` beyond the class count shows all.

    Raises:
        ValueError: ``topk`` below 1, ``img_size`` / ``crop_pct`` out of bounds, or a ``device`` that is not here
            (:func:`~cgavit.train.distributed.resolve_device`).
        CheckpointError: an unreadable or damaged checkpoint (NaN/inf weights included).
    """
    if isinstance(topk, bool) or not isinstance(topk, int) or topk < 1:
        raise ValueError(f"--topk must be at least 1, got {topk}")
    check_eval_options(img_size, crop_pct)
    images = [images] if isinstance(images, (str, os.PathLike)) else list(images)  # "cat.png": one image
    device = resolve_device(inference_device(device, checkpoint))
    model, info, num_classes = open_for_inference(
        checkpoint, model_name, dials, img_size=img_size, use_ema=use_ema, pretrained=pretrained, trust=trust, device=device)
    if topk > num_classes:
        log.warning("--topk %d is more than the model's %d classes: showing all of them", topk, num_classes)
    size = img_size or info.img_size
    transform = eval_transform(info, input_channels(model), size, crop_pct or info.crop_pct, info.interpolation)
    synsets = imagenet_classes() if num_classes == 1000 else None
    out = []
    for path in images:
        try:
            x = load_transformed(path, transform).unsqueeze(0).to(device)  # (1, C, size, size)
        except BadImageError as err:
            out.append({"image": str(path), "error": str(err)})
            continue
        logits = model(x).float()[0]
        if not bool(torch.isfinite(logits).all()):
            out.append({"image": str(path), "error": f"the model's outputs on {path} are not finite (a diverged model); "
                                                      "use a checkpoint from before it diverged"})
            continue
        out.append({"image": str(path), "top": _top_classes(logits, info.class_names, topk, synsets)})
    return out


def _top_classes(logits: torch.Tensor, names: list[str], topk: int, synsets: list | None) -> list[dict]:
    """``{"index", "name", "prob"}`` of the ``topk`` most probable classes of one image's ``logits``, with the
    ImageNet ``"synset"`` where ``synsets`` is given and the class is ImageNet's of that index."""
    p, i = logits.softmax(dim=0).topk(min(topk, logits.numel()))
    top = []
    for pi, ii in zip(p.tolist(), i.tolist()):
        row = {"index": ii, "name": names[ii], "prob": pi}
        if synsets is not None and names[ii] == synsets[ii][1].split(",")[0]:
            row["synset"] = synsets[ii][0]
        top.append(row)
    return top
