"""COCO's formats as the detectors take them, and everything that touches pycocotools: boxes,
COCO indexes, RLE masks, COCOeval.

pycocotools is imported in one place, :func:`pycocotools_api`, on first use: building, drawing and
running the detectors does not need it, reading COCO data and scoring does. It comes with the
``detect`` extra (``pip install 'cgavit[detect]'``).
"""

from __future__ import annotations

import contextlib
import functools
import io
from collections.abc import Iterable, Sequence
from types import ModuleType
from typing import TYPE_CHECKING, Any

import numpy as np
from numpy.typing import ArrayLike

from ..io import DataError
from .schema import segmentation_problem

if TYPE_CHECKING:  # for annotations only; the import at run time is pycocotools_api's
    from pycocotools.coco import COCO

STAT_NAMES = ("AP", "AP50", "AP75", "APs", "APm", "APl", "AR1", "AR10", "AR100", "ARs", "ARm", "ARl")


@functools.cache
def pycocotools_api() -> tuple[ModuleType, type, type]:
    """``(pycocotools.mask, COCO, COCOeval)``: the package's one pycocotools import.

    Raises:
        ImportError: pycocotools is not installed (the message says how to install it).
    """
    try:
        from pycocotools import mask
        from pycocotools.coco import COCO
        from pycocotools.cocoeval import COCOeval
    except ImportError as err:
        raise ImportError(f"COCO data and evaluation need pycocotools ({err}): pip install 'cgavit[detect]'") from err
    return mask, COCO, COCOeval


def coco_index(dataset: dict[str, Any]) -> COCO:
    """A pycocotools ``COCO`` index over an instances dict (its progress prints silenced)."""
    _, COCO, _ = pycocotools_api()
    coco = COCO()
    coco.dataset = dataset
    with contextlib.redirect_stdout(io.StringIO()):
        coco.createIndex()
    return coco


def xyxy_boxes(bboxes: Sequence[Sequence[float]], width: ArrayLike, height: ArrayLike) -> np.ndarray:
    """COCO ``[x, y, width, height]`` boxes as the detectors are trained on them: ``(N, 4)`` float32
    ``[x0, y0, x1, y1]`` pixels, clipped to the ``width x height`` image (one size, or one per box).

    The one conversion :class:`~.data.CocoDetection` builds its targets with and the annotation check
    judges boxes by (:func:`~.models.boxes_keep_area`): a box a few float32 steps wide at its position,
    or overlapping the image by less, has ``x1 <= x0`` here.
    """
    boxes = np.asarray(bboxes, dtype=np.float32).reshape(-1, 4)
    boxes[:, 2:] += boxes[:, :2]
    for axis, side in ((0, width), (1, height)):
        np.clip(boxes[:, axis::2], 0, np.asarray(side, dtype=np.float32).reshape(-1, 1), out=boxes[:, axis::2])
    return boxes


def segmentation_rle(seg: Any, h: int, w: int) -> dict[str, Any]:
    """Any COCO segmentation (polygons, uncompressed or compressed RLE) of an ``h x w`` image as one
    compressed RLE.

    Raises:
        DataError: ``seg`` is malformed or declares another size than ``h x w``
            (:func:`~.schema.segmentation_problem`; checked before pycocotools sees it).
    """
    problem = segmentation_problem(seg, h, w)
    if problem:
        raise DataError(f"cannot use a mask of a {w}x{h} image: {problem}")
    mask, _, _ = pycocotools_api()
    if isinstance(seg, list):
        return mask.merge(mask.frPyObjects(seg, h, w))
    if isinstance(seg.get("counts"), list):
        return mask.frPyObjects(seg, h, w)
    return seg


def decode_masks(rles: Sequence[dict[str, Any]]) -> np.ndarray:
    """Binary masks ``(H, W, N)`` uint8 of compressed RLEs."""
    mask, _, _ = pycocotools_api()
    return mask.decode(list(rles))


def encode_masks(masks: np.ndarray) -> list[dict[str, Any]]:
    """Compressed RLEs of binary masks ``(N, H, W)``, ``counts`` as ASCII text (JSON-ready)."""
    mask, _, _ = pycocotools_api()
    rles = mask.encode(np.asfortranarray(masks.astype(np.uint8).transpose(1, 2, 0)))
    for rle in rles:
        rle["counts"] = rle["counts"].decode("ascii")
    return rles


def rle_box_area(rle: dict[str, Any]) -> tuple[list[float], float]:
    """``([x, y, width, height], area in pixels)`` of a compressed RLE."""
    mask, _, _ = pycocotools_api()
    return [float(v) for v in mask.toBbox(rle)], float(mask.area(rle))


def coco_metrics(
    coco_gt: COCO, results: list[dict], iou_type: str, image_ids: Iterable[int] | None = None
) -> tuple[dict[str, float], str]:
    """COCOeval of ``results`` against ``coco_gt``.

    Returns:
        ``({"AP": .., "AP50": .., ..., "ARl": ..}, summary table text)``; values in [0, 1], -1 where
        the ground truth has no object of that size (COCOeval's convention), with or without
        detections: no detections score 0 where there are objects.
    """
    _, _, COCOeval = pycocotools_api()
    with contextlib.redirect_stdout(io.StringIO()) as text:
        coco_dt = coco_gt.loadRes(results) if results else _no_detections(coco_gt)
        ev = COCOeval(coco_gt, coco_dt, iou_type)
        if image_ids is not None:
            ev.params.imgIds = sorted(image_ids)
        ev.evaluate()
        ev.accumulate()
        ev.summarize()
    summary = text.getvalue()
    summary = summary[summary.find(" Average Precision"):] if " Average Precision" in summary else summary
    title = iou_type if results else f"{iou_type} (no detections)"
    return {k: float(v) for k, v in zip(STAT_NAMES, ev.stats)}, f"{title}:\n{summary}"


def _no_detections(coco_gt: COCO) -> COCO:
    """An empty result set over ``coco_gt``'s images (``loadRes`` cannot make one from an empty list)."""
    gt = coco_gt.dataset
    return coco_index({"images": list(gt.get("images", [])), "categories": list(gt.get("categories", [])), "annotations": []})
