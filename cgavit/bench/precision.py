"""The precision check: every inference path the package offers, timed round-robin, and compared with
the plain fp32 model on real labelled images.

For each path: throughput and its ratio to the first (fp32 torch) path, top-1 agreement with fp32,
accuracy and its change, and the largest per-image relative logit error; a reduced path is marked
as meeting or missing the target (:data:`cgavit.deploy.AGREEMENT_TARGET`, agreement >= 99.5 % and
accuracy within 0.5 point). int8 is calibrated on *training* images, never on the evaluated ones.

With a trained checkpoint (``--checkpoint F --data DIR``) the images are ``DIR/val`` (evaluated) and
``DIR/train`` (calibration), preprocessed with the checkpoint's own evaluation transform.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TypedDict

import torch
from torch import nn

from ..classes import check_classes, class_difference, model_indices
from ..deploy import Agreement, PathChoice, RuntimeModule, compare_logits, cpu_features, fuse, optimize
from ..deploy.agreement import NoiseFloor, batched_logits, noise_floor
from ..deploy.formats import FORMATS, runtime_format, runtime_path
from ..factory import ModelInfo, UnrecordedArchitecture, load_model
from ..timing import round_robin
from ..train.data import list_split, load_transformed
from ..train.data.layout import same_split
from ..train.inference import eval_transform

log = logging.getLogger(__name__)

#: Runtimes ``cgavit bench`` can time beside torch (every export format's); the first two build in seconds, the
#: others in minutes.
RUNTIMES = tuple(fmt.backend for fmt in FORMATS.values())


class PrecisionRow(TypedDict):
    """One inference path of one model on one image set."""

    model: str
    path: str  # e.g. "bf16 torch.compile", "int8 ONNX Runtime (static)"
    images: str  # "photos", "cifar" or the evaluated folder
    n: int  # images
    img_s: float  # median images/s over the timed rounds
    ratio_to_fp32: float  # throughput ratio to the first path
    top1_agreement: float  # share of images with the fp32 model's top-1 class
    rel_err: float  # ||logits - fp32 logits|| / ||fp32 logits|| over the whole set
    max_rel_err: float  # the largest per-image relative logit error
    fp32_distinct_classes: int  # distinct fp32 top-1 classes among the images
    accuracy: float | None  # against the labels, else None
    accuracy_change: float | None  # percentage points against fp32's accuracy
    meets_target: bool  # agreement >= 99.5 % and accuracy within 0.5 point
    calibration_images: int  # training images int8 was calibrated on (0 for other paths)


@dataclass
class LabelledImages:
    """Preprocessed images ``(N, C, H, W)``, their class indices ``(N,)``, where they came from, and how many
    images that folder holds (``available``: more than N when a limit drew some of them)."""

    images: torch.Tensor
    labels: torch.Tensor
    source: str
    classes: list[str] = field(default_factory=list)
    available: int = 0
    files: tuple[str, ...] = ()  # the image files, in the order of ``images``


#: Training images int8 is calibrated on unless told otherwise (``--calibration-images``).
CALIBRATION_IMAGES = 256
#: The order calibration images are drawn in (:func:`load_labelled`'s seed), one for every command and script, so
#: that ``cgavit export``, ``quantize`` and ``bench`` calibrate a checkpoint on the same images.
CALIBRATION_SEED = 1


def load_labelled(root: str | Path, split: str, info: ModelInfo, limit: int = 0, seed: int = 0, *,
                  channels: int = 3) -> LabelledImages:
    """``limit`` images (0: all) of ``root/split/<class>/`` in a seeded random order, preprocessed with
    the checkpoint's evaluation transform (its size, crop, interpolation, mean and std) for a model taking
    ``channels``-channel images: greyscale for 1, RGB for 3 (:func:`~cgavit.train.inference.eval_transform`).

    Raises:
        ValueError: the split folder is missing or malformed (the message says the layout), or its images would
            not fit in memory (:data:`MEMORY_SHARE`), or ``channels`` is neither 1 nor 3.
    """
    transform = eval_transform(info, channels, info.img_size, info.crop_pct, info.interpolation)
    classes, samples = list_split(root, split)
    order = torch.randperm(len(samples), generator=torch.Generator().manual_seed(seed)).tolist()
    chosen = [samples[i] for i in (order[:limit] if limit > 0 else order)]
    _check_fits_in_memory(len(chosen), 4 * channels * info.img_size ** 2, Path(root) / split)
    images = torch.stack([load_transformed(path, transform) for path, _ in chosen])  # (N, C, H, W)
    labels = torch.tensor([label for _, label in chosen])
    return LabelledImages(images, labels, str(Path(root) / split), classes, len(samples), tuple(p for p, _ in chosen))


#: The share of the memory free when images are loaded that they may take, preprocessed (the runtimes' copies and
#: the model's activations need the rest).
MEMORY_SHARE = 0.5


def _check_fits_in_memory(count: int, image_bytes: int, source: Path) -> None:
    """Refuse ``count`` preprocessed images of ``image_bytes`` each that would take more than :data:`MEMORY_SHARE`
    of the memory free now (a whole ImageNet split is tens of GB: the process would be killed, with no message).

    Raises:
        ValueError: too many images, with how much they need and what to ask for instead.
    """
    free = free_memory()
    need = count * image_bytes
    if free is not None and need > MEMORY_SHARE * free:
        fits = max(1, int(MEMORY_SHARE * free // image_bytes))
        raise ValueError(f"{source}: {count} images take {_size(need)} once preprocessed, more than "
                         f"{MEMORY_SHARE:.0%} of the {_size(free)} free here; ask for at most about {fits} "
                         "(--eval-images, --calibration-images, --qat-images)")


def _size(n: int) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def free_memory() -> int | None:
    """Bytes of memory free for a new allocation now (Linux: ``MemAvailable``), None where it is not known."""
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def load_calibration(root: str | Path, split: str, info: ModelInfo, limit: int = CALIBRATION_IMAGES, *,
                     channels: int = 3) -> LabelledImages:
    """The ``limit`` images of ``root/split`` that int8 is calibrated on: :func:`load_labelled` in the order every
    cgavit command draws them (:data:`CALIBRATION_SEED`)."""
    return load_labelled(root, split, info, limit, seed=CALIBRATION_SEED, channels=channels)


def calibration_and_evaluation(
    root: str | Path, train_split: str, val_split: str, info: ModelInfo, num_classes: int | None,
    calibration_images: int = CALIBRATION_IMAGES, eval_images: int = 0, *, all_calibration_images: bool = False,
    channels: int = 3,
) -> tuple[LabelledImages, LabelledImages]:
    """The images int8 is calibrated on (:func:`load_calibration` of ``root/train_split``) and the labelled images
    it is judged on (``eval_images`` of ``root/val_split``, 0: all): the one place every int8 command loads them.

    Args:
        num_classes: the classes the model predicts, which both folders must hold (by the names ``info``
            records, where it records them: the labels are then the model's indices of those names); None for a
            model without trained classes (random weights).
        all_calibration_images: refuse a folder that holds fewer than ``calibration_images`` images.
        channels: the model's input channels, 1 or 3 (:func:`load_labelled`).

    Raises:
        ValueError: the same folder for both, however it is spelt (int8 judged on its own calibration images says
            nothing about other images), a missing or malformed folder, class folders unlike the model's (the
            message names the difference) or each other's, fewer evaluation images than ``eval_images``, or too few
            calibration images.
    """
    train_dir, val_dir = Path(root) / train_split, Path(root) / val_split
    if same_split(root, train_split, val_split):
        raise ValueError(f"calibration and evaluation must be different images; --train-split {train_split!r} and "
                         f"--val-split {val_split!r} are the same folder")
    splits = {split: list_split(root, split) for split in (train_split, val_split)}  # refused before decoding
    folders = {split: classes for split, (classes, _) in splits.items()}
    if num_classes is None:
        if folders[train_split] != folders[val_split]:
            raise ValueError(f"{train_dir} and {val_dir} must hold the same class folders: "
                             f"{class_difference(folders[val_split], folders[train_split])}")
    else:
        for split, classes in folders.items():
            check_classes(Path(root) / split, classes, info, num_classes)
    _check_eval_count(val_dir, len(splits[val_split][1]), eval_images)
    calib = load_calibration(root, train_split, info, calibration_images, channels=channels)
    evaluated = load_labelled(root, val_split, info, eval_images, channels=channels)
    shared = same_files(calib.files, evaluated.files)
    if shared:
        raise ValueError(f"{len(shared)} of the evaluation images are calibration images too, under another name (e.g. "
                         f"{shared[0]}: a link to, or a hard link of, a file of {train_dir}); int8 judged on its own "
                         "calibration images says nothing about other images: give --val-split a folder of other images")
    if num_classes is not None and info.names_recorded:
        calib, evaluated = (_in_model_order(split, info) for split in (calib, evaluated))
    if all_calibration_images and len(calib.images) < calibration_images:
        raise ValueError(f"{calib.source} holds {len(calib.images)} images, fewer than --calibration-images "
                         f"{calibration_images}; give more images or a smaller count")
    return calib, evaluated


def evaluation_images(root: str | Path, split: str, info: ModelInfo, num_classes: int | None,
                      eval_images: int = 0, *, channels: int = 3) -> LabelledImages:
    """The labelled images of ``root/split`` a file is judged on where nothing is calibrated (fp32): as the
    evaluation half of :func:`calibration_and_evaluation`, without a training split.

    Raises:
        ValueError: a missing or malformed folder, class folders unlike the model's, fewer images than
            ``eval_images``.
    """
    classes, files = list_split(root, split)
    if num_classes is not None:
        check_classes(Path(root) / split, classes, info, num_classes)
    _check_eval_count(Path(root) / split, len(files), eval_images)
    evaluated = load_labelled(root, split, info, eval_images, channels=channels)
    return _in_model_order(evaluated, info) if num_classes is not None and info.names_recorded else evaluated


def _check_eval_count(folder: Path, held: int, eval_images: int) -> None:
    if eval_images > held:  # 0: all of them
        raise ValueError(f"{folder} holds {held} images, fewer than --eval-images {eval_images}; "
                         "give a smaller count, or 0 for all of them")


def same_files(these: Sequence[str], those: Sequence[str]) -> list[str]:
    """The files of ``those`` that are one of ``these`` under any name (a link to it, or a hard link: the same
    device and inode)."""
    def identity(path: str) -> tuple[int, int] | None:
        try:
            st = os.stat(path)
        except OSError:
            return None
        return st.st_dev, st.st_ino

    ids = {identity(p) for p in these} - {None}
    return [p for p in those if identity(p) in ids]


def _in_model_order(split: LabelledImages, info: ModelInfo) -> LabelledImages:
    """``split`` (checked by :func:`~cgavit.classes.check_classes`) labelled with the checkpoint's indices
    of its class names."""
    index = model_indices(split.classes, info)
    return LabelledImages(split.images, index[split.labels], split.source, list(info.class_names), split.available,
                          split.files)


def path_label(precision: str, runtime: str, compile: bool = True) -> str:
    """The row name of a path, e.g. ``"fp32 torch.compile"``, ``"int8 OpenVINO"``."""
    if runtime == "torch":
        return f"{precision} torch{'.compile' if compile else ' eager'}"
    name = runtime_format(runtime).runtime
    return f"{precision} {name}" + (" (static)" if (precision, runtime) == ("int8", "onnxruntime") else "")


def inference_paths(
    model: nn.Module, x: torch.Tensor, calibration: list[torch.Tensor], runtimes: tuple[str, ...],
    compile: bool = True,
) -> dict[str, RuntimeModule]:
    """Every path offered for ``model`` on this CPU, built on the example batch ``x``, fp32 first.

    torch: fp32 and bf16; each runtime in ``runtimes``: fp32 and, where it offers it, int8 calibrated
    on ``calibration`` (OpenVINO also bf16 where the CPU has native bf16). Built without
    ``optimize``'s tolerance check: the rows report the error instead.
    """
    native_bf16 = cpu_features().native_bf16
    plan = [("fp32", "torch")] + [("fp32", r) for r in runtimes] + [("bf16", "torch")]
    plan += [("bf16", "openvino")] if "openvino" in runtimes and native_bf16 else []
    plan += [("int8", r) for r in runtimes if r != "tflite"]
    fused = fuse(model)
    paths = {}
    for precision, runtime in plan:
        label = path_label(precision, runtime, compile)
        log.info("precision check: building %s", label)
        if runtime == "torch":
            paths[label] = optimize(model, x, precision, backend="torch", compile=compile, check=False)
        elif runtime == "openvino" and precision == "bf16":
            paths[label] = optimize(model, x, "bf16", backend="openvino", check=False)
        else:
            fmt = runtime_format(runtime).name
            paths[label] = runtime_path(fused, x, fmt, precision, calibration if precision == "int8" else None)
    return paths


def time_paths(paths: dict[str, nn.Module], x: torch.Tensor, warmup: int, repeats: int) -> dict[str, float]:
    """Median images/s of each path on ``x``, timed round-robin."""
    with torch.no_grad():
        timings = round_robin({k: partial(fn, x) for k, fn in paths.items()}, warmup, repeats)
    return {k: t.median_rate(len(x)) for k, t in timings.items()}


def precision_rows(
    name: str, paths: dict[str, nn.Module], reference: nn.Module, images: torch.Tensor, labels: torch.Tensor | None,
    set_name: str, rates: dict[str, float], calibration_images: int, batch: int = 16,
) -> list[PrecisionRow]:
    """Each path compared with ``reference`` (the plain fp32 model) on ``images`` (and ``labels``)."""
    ref = batched_logits(reference, images, batch)
    first = next(iter(paths))
    rows = []
    for path, fn in paths.items():
        out = batched_logits(fn, images, batch)
        a: Agreement = compare_logits(out, ref, labels)
        rows.append(PrecisionRow(
            model=name, path=path, images=set_name, n=a.n, img_s=rates[path], ratio_to_fp32=rates[path] / rates[first],
            top1_agreement=a.top1_agreement, rel_err=float((out - ref).norm() / ref.norm()), max_rel_err=a.max_rel_err,
            fp32_distinct_classes=int(ref.argmax(1).unique().numel()), accuracy=a.accuracy,
            accuracy_change=a.accuracy_change, meets_target=a.meets_target,
            calibration_images=calibration_images if path.startswith("int8") else 0,
        ))
    return rows


@dataclass
class CheckpointPrecision:
    """What :func:`checkpoint_precision` measured: the rows, the images used, ``auto``'s choice, and for scale the
    decisions the fp32 model changes on the evaluated images under half a grey level of pixel noise."""

    rows: list[PrecisionRow]
    evaluated: str
    calibration: str
    calibration_images: int
    auto: PathChoice | None
    noise_floor: NoiseFloor | None = None
    evaluated_images: int = 0
    img_size: int = 0
    split_images: int = 0  # images in the evaluated folder (more than evaluated_images when some were drawn)


def checkpoint_precision(
    checkpoint: str | Path, data: str | Path, batch: int, warmup: int, repeats: int, *,
    runtimes: tuple[str, ...] = ("onnxruntime",), compile: bool = True, calibration_images: int = CALIBRATION_IMAGES,
    eval_images: int = 0, train_split: str = "train", val_split: str = "val", trust: bool = False,
) -> CheckpointPrecision:
    """The precision check of a trained checkpoint on ``data/val_split`` (int8 calibrated on
    ``calibration_images`` images of ``data/train_split``), and the path ``optimize(precision="auto")``
    picks for it on this CPU with those calibration images, judging each reduced path on the evaluated images.

    Raises:
        ValueError: a missing or malformed split folder, the same split for both, class folders unlike the
            checkpoint's, a count below 1, a checkpoint that does not record its network.
        CheckpointError: an unreadable checkpoint.
    """
    if calibration_images < 1:
        raise ValueError(f"--calibration-images must be at least 1, got {calibration_images}")
    try:
        model, info = load_model(checkpoint, trust=trust)
    except UnrecordedArchitecture:  # its advice, --model NAME, is no option of the precision check
        raise ValueError(f"--checkpoint {Path(checkpoint).name} does not record its network (a bare state dict, an "
                         "official or timm file); the precision check needs weights saved by cgavit (cgavit train's "
                         "model.safetensors or best.pt, or cgavit.save_weights)") from None
    calib, evaluated = calibration_and_evaluation(data, train_split, val_split, info, model.num_classes,
                                                  calibration_images, eval_images, channels=model.in_chans)
    batches = list(calib.images.split(batch))
    x = evaluated.images[torch.arange(batch) % len(evaluated.images)]  # real images as the example batch
    paths = inference_paths(model, x, batches, runtimes, compile)
    rates = time_paths(paths, x, warmup, repeats)
    name, fused = Path(checkpoint).name, fuse(model)
    rows = precision_rows(name, paths, fused, evaluated.images, evaluated.labels, evaluated.source, rates,
                          len(calib.images), batch)
    auto = optimize(model, x, "auto", calibration=batches, evaluation=list(evaluated.images.split(batch)), check=False,
                    compile=compile).choice  # judged on the table's images, not on the training ones it calibrates on
    floor = noise_floor(fused, evaluated.images, tuple(info.std), batch=batch)
    return CheckpointPrecision(rows, evaluated.source, calib.source, len(calib.images), auto, floor,
                               len(evaluated.images), info.img_size, evaluated.available)
