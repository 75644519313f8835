"""A trained detector on image files: detections drawn (boxes, labels, scores, masks) and listed."""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from torchvision.transforms.v2 import functional as TF

from ..images import load_image
from ..io import DataError, UnreadableFileError, atomic_write, check_readable_file
from ..train.distributed import DistEnv
from ..train.distributed import setup as setup_distributed
from ..train.distributed import teardown as teardown_distributed
from .checkpoint import load_detector
from .draw import draw_detections


@dataclass
class Prediction:
    """One image's detections scoring at least the threshold, and where the drawing was written.

    Attributes:
        image: the input file. drawn: the PNG written.
        names: category name of each detection. scores: its score.
        boxes: ``[x0, y0, x1, y1]`` in the image's pixels.
    """

    image: Path
    drawn: Path
    names: list[str]
    scores: list[float]
    boxes: list[list[float]]


def predict_images(
    checkpoint: str | os.PathLike,
    images: Sequence[str | os.PathLike],
    out: str | os.PathLike | None = None,
    score_threshold: float = 0.5,
    device: str = "auto",
) -> Iterator[Prediction]:
    """Run a checkpoint written by ``cgavit detect train`` on ``images`` and draw its detections.

    The paths are checked before anything runs; the predictions then come one image at a time. An
    image that cannot be decoded (not an image, damaged, too large) does not stop the others: after
    the last one, a :class:`~cgavit.io.DataError` names every image that was skipped.

    Args:
        checkpoint: ``model.pth`` or ``checkpoint.pth``.
        images: image files.
        out: output PNG (one image) or folder; default ``<image name>_pred.png`` in the current folder.
        score_threshold: draw and list detections scoring at least this.
        device: ``auto`` (this process's GPU if any), ``cpu`` or ``cuda``.

    Raises:
        FileNotFoundError: an image does not exist. UnreadableFileError: an image path is a folder,
        a pipe, empty or not permitted. ValueError: ``out`` names a file for several images, or a
        ``score_threshold`` outside [0, 1]. CheckpointError: not a usable detection checkpoint.
        DataError: after the readable images, naming those that could not be decoded.
    """
    if not 0.0 <= score_threshold <= 1.0:
        raise ValueError(f"--score-threshold must be in [0, 1], got {score_threshold}")
    paths = [Path(p) for p in images]
    for p in paths:
        if not os.path.lexists(p):
            raise FileNotFoundError(f"image {p} does not exist")
        check_readable_file(p, "image")
    dst = Path(out) if out is not None else None
    if dst is not None and len(paths) > 1 and dst.suffix:
        raise ValueError(f"--out {dst} looks like a file but {len(paths)} images were given; pass a folder")
    env = setup_distributed(device)
    try:
        model, config = load_detector(checkpoint, env.device)
    except BaseException:
        teardown_distributed(env)
        raise
    return _predictions(model, config, paths, dst, score_threshold, env)


def _predictions(
    model: nn.Module, config: dict, paths: list[Path], out: Path | None, threshold: float, env: DistEnv
) -> Iterator[Prediction]:
    names = ["background"] + [n for _, n in config["categories"]]
    skipped = []
    try:
        for p in paths:
            try:
                raw = TF.pil_to_tensor(load_image(p))  # (3, H, W) uint8
            except (DataError, UnreadableFileError) as err:
                skipped.append(str(err))
                continue
            with torch.no_grad():
                output = model([TF.to_dtype(raw, torch.float32, scale=True).to(env.device)])[0]
            drawn = draw_detections(raw, output, names, threshold)
            dst = out if out is not None and out.suffix else (out or Path(".")) / f"{p.stem}_pred.png"
            atomic_write(dst, lambda tmp: TF.to_pil_image(drawn).save(tmp, format="PNG"))
            keep = output["scores"] >= threshold
            yield Prediction(
                image=p, drawn=dst, names=[names[label] for label in output["labels"][keep].tolist()],
                scores=output["scores"][keep].tolist(), boxes=output["boxes"][keep].tolist(),
            )
    finally:
        teardown_distributed(env)
    if skipped:
        raise DataError(f"{len(skipped)} of {len(paths)} images skipped: " + "; ".join(skipped))
