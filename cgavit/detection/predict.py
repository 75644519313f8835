"""A trained detector on image files: detections drawn (boxes, labels, scores, masks) and listed."""

from __future__ import annotations

import io
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torch import nn
from torchvision.transforms.v2 import functional as TF

from ..images import load_image
from ..io import DataError, UnreadableFileError, atomic_write, check_readable_file
from ..train.distributed import DistEnv
from ..train.distributed import setup as setup_distributed
from ..train.distributed import teardown as teardown_distributed
from .checkpoint import load_detector
from .draw import draw_detections
from .models import detector_resize, foreground, resize_problem


@dataclass
class Prediction:
    """One image's detections scoring at least the threshold, and where the drawing was written.

    Attributes:
        image: the input file. drawn: the drawing written (PNG, or the format ``out``'s suffix names).
        names: category name of each detection. scores: its score.
        boxes: ``[x0, y0, x1, y1]`` in the image's pixels.
        limit: the detector's most detections per image when it returned that many, all scoring at least the
            threshold (others may score as much), else None.
        limit_setting: the torchvision setting that holds the limit (a ``--model-arg`` of training): RetinaNet's
            ``detections_per_img``, Mask R-CNN's ``box_detections_per_img``.

    RetinaNet's detections of label 0, the background (an output of its classifier that training only pushes
    down), are left out.
    """

    image: Path
    drawn: Path
    names: list[str]
    scores: list[float]
    boxes: list[list[float]]
    limit: int | None = None
    limit_setting: str = "detections_per_img"


def predict_images(
    checkpoint: str | os.PathLike,
    images: Sequence[str | os.PathLike],
    out: str | os.PathLike | None = None,
    score_threshold: float = 0.5,
    device: str = "auto",
) -> Iterator[Prediction]:
    """Run a checkpoint written by ``cgavit detect train`` on ``images`` and draw its detections.

    The paths are checked before anything runs; the predictions then come one image at a time. An
    image that cannot be decoded (not an image, damaged, too large) or run (too thin for the detector's
    resize, :func:`~.models.resize_problem`) does not stop the others: after the last one, a
    :class:`~cgavit.io.DataError` names every image that was skipped and why.

    Args:
        checkpoint: ``model.pth`` or ``checkpoint.pth``.
        images: image files.
        out: output image (one image; PNG, or the format its suffix names) or folder (an existing folder
            is one whatever its name); default ``<image name>_pred.png`` in the current folder.
        score_threshold: draw and list detections scoring at least this; the detector's own ``score_thresh`` is
            lowered for the prediction where it is higher (:func:`admit_scores_from`).
        device: ``auto`` (this process's GPU if any), ``cpu`` or ``cuda``.

    Raises:
        FileNotFoundError: an image does not exist. UnreadableFileError: an image path is a folder,
        a pipe, empty or not permitted. ValueError: ``out`` names a file for several images, or a
        ``score_threshold`` outside [0, 1]. CheckpointError: not a usable detection checkpoint.
        DataError: after the other images, naming those that could not be decoded or run.
    """
    if not 0.0 <= score_threshold <= 1.0:
        raise ValueError(f"--score-threshold must be in [0, 1], got {score_threshold}")
    paths = [Path(p) for p in images]
    for p in paths:
        if not os.path.lexists(p):
            raise FileNotFoundError(f"image {p} does not exist")
        check_readable_file(p, "image")
    drawn = drawing_paths(paths, Path(out) if out is not None else None)
    env = setup_distributed(device)
    try:
        model, config = load_detector(checkpoint, env.device)
    except BaseException:
        teardown_distributed(env)
        raise
    admit_scores_from(model, score_threshold)
    return _predictions(model, config, paths, drawn, score_threshold, env)


def admit_scores_from(model: nn.Module, threshold: float) -> None:
    """Make a torchvision detector return its detections scoring ``threshold`` or more: it keeps only scores above
    its own ``score_thresh`` (RetinaNet's; Mask R-CNN's ``roi_heads``), 0.05 unless set at training, which is lowered
    to the float32 just under ``threshold`` where it is not already under it. Only inference reads the setting, and
    a lower one adds detections without changing those it returned (each extra one scores less than they do)."""
    heads = getattr(model, "roi_heads", model)
    below = float(np.nextafter(np.float32(threshold), np.float32(-np.inf)))  # scores > below: scores >= threshold
    heads.score_thresh = min(float(heads.score_thresh), below)


def detection_limit(model: nn.Module) -> int:
    """How many detections per image a torchvision detector returns at most (RetinaNet's ``detections_per_img``,
    Mask R-CNN's ``roi_heads.detections_per_img``)."""
    return int(getattr(model, "roi_heads", model).detections_per_img)


def limit_setting(model: nn.Module) -> str:
    """The name of the setting that sets :func:`detection_limit` as the detector's builder takes it (``--model-arg``):
    Mask R-CNN's is ``box_detections_per_img`` (its ``detections_per_img`` is no setting), RetinaNet's
    ``detections_per_img``."""
    return "box_detections_per_img" if hasattr(model, "roi_heads") else "detections_per_img"


def drawing_paths(images: list[Path], out: Path | None) -> list[Path]:
    """Where each image's drawing goes: ``out`` itself for one image when it names a file (a name with a
    suffix that is not an existing folder), else ``<image name>_pred.png`` in folder ``out`` (default: the
    current folder), ``-2``, ``-3``, ... added to the name for images of the same name from different folders.

    Raises:
        ValueError: ``out`` names a file for several images, or a format PIL does not write; or a drawing
            would replace one of the images.
    """
    if out is not None and out.suffix and not out.is_dir():
        if len(images) > 1:
            raise ValueError(f"--output {out} looks like a file but {len(images)} images were given; pass a folder")
        if not _writes_pictures(_image_format(out)):
            raise ValueError(f"--output {out}: {out.suffix} is not an image format a colour drawing can be written in "
                             "here; name it .png or .jpg, or give a folder")
        drawn = [out]
    else:
        folder, drawn = out or Path("."), []
        for image in images:
            name, n = f"{image.stem}_pred.png", 1
            while folder / name in drawn:
                n += 1
                name = f"{image.stem}-{n}_pred.png"
            drawn.append(folder / name)
    given = {os.path.realpath(image) for image in images}
    for image, path in zip(images, drawn):
        if os.path.realpath(path) in given:
            raise ValueError(f"the drawing of {image} would replace the image {path}; give another --out")
    return drawn


def _writes_pictures(image_format: str | None) -> bool:
    """Whether Pillow writes a colour drawing in ``image_format``: a format it lists may only hold other modes
    (XBM: 1-bit) or need a plug-in that is not installed (HDF5, GRIB, WMF), which is found by trying one pixel."""
    if image_format not in Image.SAVE:
        return False
    try:
        Image.new("RGB", (1, 1)).save(io.BytesIO(), format=image_format)
    except (OSError, ValueError, KeyError, TypeError):
        return False
    return True


def _image_format(path: Path) -> str | None:
    """The Pillow format a file's suffix names (``.jpg``: JPEG), None for one it does not know."""
    return Image.registered_extensions().get(path.suffix.lower())


def _predictions(
    model: nn.Module, config: dict, paths: list[Path], drawn: list[Path], threshold: float, env: DistEnv
) -> Iterator[Prediction]:
    names = ["background"] + [n for _, n in config["categories"]]
    limit, setting, skipped = detection_limit(model), limit_setting(model), []
    try:
        for p, dst in zip(paths, drawn):
            try:
                raw = TF.pil_to_tensor(load_image(p, upright=False))  # (3, H, W) uint8, as training reads it
            except (DataError, UnreadableFileError) as err:
                skipped.append(str(err))
                continue
            problem = resize_problem(raw.shape[2], raw.shape[1], detector_resize(config))
            if problem:
                skipped.append(f"image {p}: {problem}")
                continue
            with torch.no_grad():
                output = model([TF.to_dtype(raw, torch.float32, scale=True).to(env.device)])[0]
            shown = foreground(output)  # RetinaNet's label 0, the background, is not shown
            shown = {k: v[shown["scores"] >= threshold] for k, v in shown.items()}
            picture = TF.to_pil_image(draw_detections(raw, shown, names, threshold))
            atomic_write(dst, lambda tmp: picture.save(tmp, format=_image_format(dst)))
            full = len(output["scores"]) == limit and bool((output["scores"] >= threshold).all())
            yield Prediction(
                image=p, drawn=dst, names=[names[label] for label in shown["labels"].tolist()],
                scores=shown["scores"].tolist(), boxes=shown["boxes"].tolist(), limit=limit if full else None,
                limit_setting=setting,
            )
    finally:
        teardown_distributed(env)
    if skipped:
        raise DataError(f"{len(skipped)} of {len(paths)} images skipped: " + "; ".join(skipped))
