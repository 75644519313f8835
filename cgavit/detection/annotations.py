"""Checking a COCO instances file against its image folder before anything trains on it.

A COCO-format dataset is an image folder plus an instances JSON (``images``, ``annotations``,
``categories``). :func:`check_coco` reads the JSON and reports every entry that cannot be used, all
at once and each by its id and field: a value of the wrong type or out of bounds (see
:mod:`.schema`), an annotation that points at a missing image (id or file) or an unknown category,
a box or mask that cannot be used. Degenerate boxes and masks, and images the detectors' resize
cannot take, are skipped with a warning.
"""

from __future__ import annotations

import json
import logging
import os
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import TYPE_CHECKING, Any

import numpy as np

from ..images import open_image
from ..io import DataError, UnreadableFileError, check_readable_file
from .coco import coco_index, encode_masks, rle_box_area, segmentation_rle, xyxy_boxes
from ..schema import MAX_NAME_LENGTH, shown
from .models import Resize, boxes_keep_area, resize_problem
from .schema import MAX_CATEGORIES, image_size_problem, is_int, is_number, segmentation_problem

if TYPE_CHECKING:
    from .coco import COCO

log = logging.getLogger(__name__)

_SHOW = 12  # offending entries listed per problem before "... and N more"
Problems = dict[str, list[str]]  # kind of problem -> offending entries
MALFORMED_IMAGES = "image entries with a missing or malformed field"
MALFORMED_CATEGORIES = "category entries with a missing or malformed field"
MALFORMED_ANNOTATIONS = "annotation entries with a missing or malformed field"
#: What :func:`check_coco` reads a file for, and the option that names its image folder.
PURPOSES = {"training": "--train-images", "evaluation": "--val-images"}
#: Why an annotation without a usable mask is an error, by purpose.
BAD_MASKS = {"training": "annotations without a usable mask (Mask R-CNN needs one; train RetinaNet for boxes only)",
             "evaluation": "annotations without a usable mask (a Mask R-CNN checkpoint is scored on masks too; fix "
                           "them, or evaluate a RetinaNet for boxes only)"}
UNREADABLE_IMAGES = "image files that cannot be read"


def _listing(entries: list[str]) -> str:
    shown_ = "\n    ".join(entries[:_SHOW])
    more = f"\n    ... and {len(entries) - _SHOW} more" if len(entries) > _SHOW else ""
    return f"\n    {shown_}{more}"


@dataclass
class CocoCheck:
    """The outcome of :func:`check_coco`: a cleaned dataset dict and what was dropped.

    Attributes:
        dataset: the instances dict with unusable annotations and images removed, every image's
            ``width`` and ``height`` and every annotation's ``area`` present (feed it to pycocotools).
        categories: ``[(category_id, name), ...]`` in the order of the contiguous labels 1..K.
        skipped: ``"annotation <id> (image <id> <file>): <why>"`` for every dropped annotation and
            ``"image <id> <file>: <why>"`` for every dropped image.
        left_out: the dropped entries themselves, ``{"images": [...], "annotations": [...]}`` (the annotations
            of dropped images included), which the detector is never given but COCOeval scores, as missed, as
            pycocotools, torchvision's references and mmdetection score the file as given: a box keeps its
            ``area`` (0 where missing and the box has none), a mask covering no pixel becomes an empty run-length
            mask (pycocotools cannot read a polygon under 3 points).
    """

    dataset: dict[str, Any]
    categories: list[tuple[int, str]]
    skipped: list[str] = field(default_factory=list)
    left_out: dict[str, list[dict]] = field(default_factory=lambda: {"images": [], "annotations": []})

    def coco(self) -> COCO:
        """A pycocotools ``COCO`` index over :attr:`dataset` (its progress prints silenced)."""
        return coco_index(self.dataset)

    def ground_truth(self) -> COCO:
        """The index COCOeval scores against: :attr:`dataset` and the :attr:`left_out` entries, as pycocotools
        scores the file as given: an object the detector is not given counts as missed (:func:`check_coco`)."""
        return coco_index({**self.dataset, "images": self.dataset["images"] + self.left_out["images"],
                           "annotations": self.dataset["annotations"] + self.left_out["annotations"]})


def check_coco(
    ann_file: str | Path,
    image_dir: str | Path,
    *,
    strict: bool = False,
    require_masks: bool = False,
    resize: Resize | tuple[int, int] | None = None,
    purpose: str = "training",
) -> CocoCheck:
    """Read and check a COCO instances file against its image folder.

    Errors (raised together in one :class:`~cgavit.io.DataError` that names every offending entry by its id
    and field): unreadable or malformed JSON; image entries without an integer ``id``, a ``file_name``, or
    with a ``width``/``height`` that is not a positive integer, exceeds :data:`~.schema.MAX_IMAGE_PIXELS` or
    is not the size its file's header declares; categories without an integer ``id``, or whose ``name`` is
    not printable text of 1 to :data:`~.schema.MAX_NAME_LENGTH` characters (names are printed, and stored in
    checkpoints); duplicate ids; image files missing from ``image_dir`` or not readable; annotations whose
    ``image_id`` is not an image, whose ``category_id`` is not a category, whose ``bbox`` is not four finite
    numbers, whose ``iscrowd`` is not 0/1 or ``area`` not a number >= 0; and with ``require_masks``,
    annotations without a usable ``segmentation`` (polygons inside the image's reach, run-length masks of
    exactly the image's size). An entry without ``width``/``height`` gets its file's (no pixel is decoded).

    Degenerate boxes (width or height <= 0, or none left as the detectors take them,
    :func:`~.coco.xyxy_boxes`), with ``require_masks`` segmentations that cover no pixel of the image
    (crowd regions included), and with ``resize`` images the detectors cannot take (a side of 0 after the
    resize, or under 32 px once padded) with their annotations are dropped with one warning listing them
    all; a file left without annotations is trained on with a warning. With ``strict=True`` both are
    errors. A polygon of an odd count of numbers is an error. Without ``require_masks`` (RetinaNet)
    ``segmentation`` is never read or checked. COCOeval scores what is dropped as missed (:attr:`CocoCheck.left_out`).

    Args:
        ann_file: instances JSON.
        image_dir: folder the images' ``file_name`` entries are relative to.
        strict: refuse what would be dropped (degenerate boxes, masks, images) and files without
            annotations instead of warning.
        require_masks: every annotation needs a segmentation (Mask R-CNN).
        resize: the detector's :class:`~.models.Resize` (:func:`~.models.detector_resize`), or its
            ``(min_size, max_size)``, to drop images it cannot take (:func:`~.models.resize_problem`);
            None checks no image's shape.
        purpose: ``"training"`` or ``"evaluation"``, as its messages say (and ``--train-images`` or ``--val-images``).

    Raises:
        DataError: with the list of problems and what to do about them.
        UnreadableFileError: ``ann_file`` or ``image_dir`` is missing or cannot be read.
    """
    if purpose not in PURPOSES:
        raise ValueError(f"purpose must be one of {', '.join(PURPOSES)}, got {purpose!r}")
    ann_file, image_dir = Path(ann_file), Path(image_dir)
    data = _read_instances(ann_file, image_dir)
    problems: Problems = defaultdict(list)  # kind of problem -> offending entries, in reading order
    images, unusable = _check_images(data["images"], image_dir, problems)
    categories = _check_categories(data["categories"], problems, ann_file)
    thin = _unresizable_images(images, unusable, resize := None if resize is None else Resize(*resize))
    found = _Found(images, unusable, categories, require_masks, set(thin), resize, purpose)
    kept, skipped, dropped = _check_annotations(data["annotations"], found, problems)
    skipped = list(thin.values()) + skipped
    _verdict(ann_file, problems, strict, skipped, (bool(kept), dropped, thin, purpose))
    left_out = {"images": [images[i] for i in thin], "annotations": [_as_missed(a, found) for a in dropped]}
    kept_images = [img for i, img in images.items() if i not in thin]
    return CocoCheck({**data, "images": kept_images, "annotations": kept}, sorted(categories.items()), skipped, left_out)


def _as_missed(ann: dict, found: _Found) -> dict:
    """A dropped annotation as COCOeval scores it, a miss: its ``area`` (0 where missing and its box has none),
    and with masks, an empty run-length mask for one covering no pixel."""
    img = found.images[ann["image_id"]]
    missed = {**ann, "area": ann.get("area", max(ann["bbox"][2], 0) * max(ann["bbox"][3], 0))}
    if found.require_masks and _degenerate_mask(ann["segmentation"], img["height"], img["width"]):
        missed["segmentation"] = encode_masks(np.zeros((1, img["height"], img["width"]), np.uint8))[0]
    return missed


def _verdict(ann_file: Path, problems: Problems, strict: bool, skipped: list[str], outcome: tuple) -> None:
    """Raise the file's problems (with ``strict``, what is skipped and a file without annotations are
    problems too), else warn about what is skipped and about a file without annotations. ``outcome``: whether
    any annotation is kept, the annotations dropped, the images dropped whole (by id), and what the file is read for."""
    any_kept, dropped, thin, purpose = outcome
    affected, whole, dropped = sorted({a["image_id"] for a in dropped} | set(thin)), len(thin), len(dropped)
    if strict and skipped:
        problems["degenerate images, boxes or masks (refused with --strict; drop --strict to skip them with a warning)"] = skipped
    if strict and not any_kept and not problems:
        problems["no annotations (refused with --strict)"].append(f"{ann_file} has no usable annotation")
    if problems:
        raise _problems_error(ann_file, problems, purpose)
    if skipped and purpose == "training":
        log.warning("%s: skipping %d degenerate entries:%s", ann_file, len(skipped), _listing(skipped))
    elif skipped:
        more = len(affected) - _SHOW
        ids = ", ".join(map(str, affected[:_SHOW])) + (f", ... and {more} more" if more > 0 else "")
        log.warning("%s: %d ground-truth annotations on %d images (ids %s%s) are not given to the detector; they count "
                    "as missed in the COCO scores, as pycocotools scores the file as given:%s", ann_file, dropped,
                    len(affected), ids, f"; {whole} of them left out whole" if whole else "", _listing(skipped))
    if not any_kept:
        what = ("a detector trained on it learns background only, and its COCO scores are -1" if purpose == "training"
                else "each of its objects counts as missed (above)" if dropped
                else "there is nothing to find: its COCO scores are -1")
        log.warning("%s has no usable annotation: %s (--strict refuses such a file)", ann_file, what)


def _problems_error(ann_file: Path, problems: Problems, purpose: str) -> DataError:
    text = "".join(f"\n  {len(v)} {k}:{_listing(v)}" for k, v in problems.items())
    return DataError(
        f"{ann_file} has problems, so it was not used for {purpose}:{text}\n"
        f"Fix or remove these entries (or point {PURPOSES[purpose]} at the folder that holds the files)."
    )


@dataclass
class _Found:
    """What the images and categories of an instances file hold, for checking its annotations."""

    images: dict[int, dict]  # image id -> image entry
    unusable: set[int]  # ids of images whose entry is malformed or whose file is missing or unreadable
    categories: dict[int, str]  # category id -> name
    require_masks: bool
    dropped: set[int]  # ids of images skipped whole, their annotations with them
    resize: Resize | None  # the detector's, if known
    purpose: str  # what the file is read for (PURPOSES)

    def where(self, ann: dict) -> str:
        img = self.images.get(ann.get("image_id")) if is_int(ann.get("image_id")) else None
        name = f" {img['file_name']}" if img and isinstance(img.get("file_name"), str) else ""
        return f"annotation {ann.get('id')} (image {shown(ann.get('image_id'))}{name})"


def _read_instances(ann_file: Path, image_dir: Path) -> dict[str, Any]:
    """The JSON of an instances file, with ``images``, ``categories`` and ``annotations`` lists."""
    check_readable_file(ann_file, "annotation file")
    if not image_dir.is_dir():
        what = "is not a folder" if image_dir.exists() else "does not exist"
        raise UnreadableFileError(f"image folder {image_dir} {what}; give the folder that holds the images")
    if not os.access(image_dir, os.R_OK | os.X_OK):
        raise UnreadableFileError(f"image folder {image_dir} is not readable by this user; fix its permissions")
    try:
        data = json.loads(ann_file.read_bytes())
    except (ValueError, RecursionError) as err:  # JSON errors, bad UTF-8, integers of 4300+ digits, deep nesting
        raise DataError(f"{ann_file} is not valid JSON ({shown(str(err), 200)}); is it a COCO instances file?") from None
    if not isinstance(data, dict) or not all(isinstance(data.get(k), list) for k in ("images", "categories")):
        raise DataError(f"{ann_file} is not a COCO instances file: it needs 'images' and 'categories' lists")
    if not isinstance(data.get("annotations", []), list):
        raise DataError(f"{ann_file}: 'annotations' must be a list")
    return {**data, "annotations": data.get("annotations", [])}


def _image_problem(img: Any) -> str | None:
    """What is wrong with one ``images`` entry's fields, else None."""
    if not isinstance(img, dict):
        return f"not an object: {shown(img)}"
    if not is_int(img.get("id")):
        return f"'id' must be an integer, got {shown(img.get('id'))}"
    name = img.get("file_name")
    if not (isinstance(name, str) and name and "\0" not in name and len(name) <= 4096):
        return f"'file_name' must be a file name (text), got {shown(name)}"
    parts = PurePosixPath(name.replace("\\", "/"))
    if parts.is_absolute() or PureWindowsPath(name).is_absolute() or ".." in parts.parts:
        return f"'file_name' must be a path inside the image folder (no leading '/', no '..'), got {shown(name)}"
    if "width" in img or "height" in img:
        if "width" not in img or "height" not in img:
            return "needs both 'width' and 'height', or neither (its file's header then gives them)"
        return image_size_problem(img["width"], img["height"])
    return None


def _check_images(entries: list, image_dir: Path, problems: Problems) -> tuple[dict[int, dict], set[int]]:
    """``(id -> image entry, ids of unusable entries: malformed, or the file missing or unreadable)``;
    every problem noted."""
    images: dict[int, dict] = {}
    unusable = set()
    for i, img in enumerate(entries):
        why = _image_problem(img)
        has_id = isinstance(img, dict) and is_int(img.get("id"))
        if why:
            label = f"image {img['id']}" if has_id else f"images[{i}]"
            problems[MALFORMED_IMAGES].append(f"{label}: {why}")
        if not has_id:
            continue
        if img["id"] in images:
            problems["duplicate image ids"].append(f"image {img['id']} ({img.get('file_name')})")
        images[img["id"]] = img
        if why:
            unusable.add(img["id"])
    _check_files(images, unusable, image_dir, problems)
    return images, unusable


def _check_files(images: dict[int, dict], unusable: set[int], image_dir: Path, problems: Problems) -> None:
    """Note each usable image whose file is missing or cannot be read, or whose entry's ``width``/``height``
    are not the size its file's header declares (adding it to ``unusable``), and give each usable entry
    without them that size (no pixel is decoded): boxes are clipped to it, masks drawn at it and the
    detectors' resize judged by it before training, not an epoch into it."""
    for i, img in list(images.items()):
        if i in unusable:
            continue
        path = image_dir / img["file_name"]
        try:
            check_readable_file(path, "image file")
            opened, (width, height) = open_image(path)
            opened.close()
            if "width" not in img:
                images[i] = {**img, "width": width, "height": height}
            elif (img["width"], img["height"]) != (width, height):
                unusable.add(i)
                problems["image entries whose size is not their file's"].append(
                    f"image {i} ({img['file_name']}): the entry says {img['width']}x{img['height']}, the file is "
                    f"{width}x{height} (fix the entry, or drop its 'width' and 'height' to take the file's)")
        except UnreadableFileError as err:
            unusable.add(i)
            if os.path.lexists(path):
                problems[UNREADABLE_IMAGES].append(f"image {i}: {err}")
            else:
                problems[f"image files missing from {image_dir}"].append(f"image {i}: {img['file_name']}")
        except DataError as err:  # not an image, a damaged header, too large
            unusable.add(i)
            problems[UNREADABLE_IMAGES].append(f"image {i}: {err}")


def _unresizable_images(images: dict[int, dict], unusable: set[int], resize: Resize | None) -> dict[int, str]:
    """``image id -> "image <id> <file>: <why>"`` for each usable image the detectors cannot take after
    ``resize`` (:func:`~.models.resize_problem`)."""
    thin = {}
    for i, img in images.items():
        why = None if resize is None or i in unusable else resize_problem(img["width"], img["height"], resize)
        if why:
            thin[i] = f"image {i} {img['file_name']}: {why} (its annotations are left out with it)"
    return thin


def _check_categories(entries: list, problems: Problems, ann_file: Path) -> dict[int, str]:
    """``category id -> name``; malformed entries, duplicate ids, and none or too many noted."""
    categories: dict[int, str] = {}
    for i, cat in enumerate(entries):
        if not isinstance(cat, dict) or not is_int(cat.get("id")):
            got = shown(cat.get("id")) if isinstance(cat, dict) else f"not an object: {shown(cat)}"
            problems[MALFORMED_CATEGORIES].append(f"categories[{i}]: 'id' must be an integer, got {got}")
            continue
        name = cat.get("name", str(cat["id"]))
        if not (isinstance(name, str) and 0 < len(name) <= MAX_NAME_LENGTH and name.isprintable()):
            problems[MALFORMED_CATEGORIES].append(
                f"category {cat['id']}: 'name' must be printable text of 1 to {MAX_NAME_LENGTH} characters (it is "
                f"printed and stored in the checkpoint), got {shown(name)}"
            )
            continue
        if cat["id"] in categories:
            problems["duplicate category ids"].append(f"category {cat['id']}")
        categories[cat["id"]] = name
    if not categories and not problems:
        problems["no categories"].append(f"{ann_file} lists no categories")
    if len(categories) > MAX_CATEGORIES:
        problems["too many categories"].append(f"{ann_file} lists {len(categories)}; at most {MAX_CATEGORIES} are supported")
    return categories


def _check_annotations(anns: list, found: _Found, problems: Problems) -> tuple[list[dict], list[str], list[dict]]:
    """``(usable annotations, "<where>: <why>" of each degenerate one, the annotations dropped without an error:
    degenerate ones and those of dropped images)``; errors go to ``problems``."""
    checked, dropped = [], []  # (annotation, why it is degenerate or None) of those without errors, in reading order
    ann_ids = Counter(a["id"] for a in anns if isinstance(a, dict) and is_int(a.get("id")))
    for i, ann in enumerate(anns):
        if not isinstance(ann, dict) or not is_int(ann.get("id")):
            got = shown(ann.get("id")) if isinstance(ann, dict) else f"not an object: {shown(ann)}"
            problems[MALFORMED_ANNOTATIONS].append(f"annotations[{i}]: 'id' must be an integer, got {got}")
            continue
        if ann_ids[ann["id"]] > 1:
            problems["duplicate annotation ids"].append(found.where(ann))
            continue
        error, why = _annotation_problem(ann, found)
        if error:
            problems[error].append(why)
        elif ann["image_id"] in found.dropped:  # listed with its image
            dropped.append(ann)
        else:
            checked.append((ann, why))
    kept, skipped = [], []
    for (ann, why), box_why in zip(checked, _box_problems([ann for ann, _ in checked], found)):
        if why or box_why:
            skipped.append(f"{found.where(ann)}: {why or box_why}")
            dropped.append(ann)
        else:
            kept.append(ann if "area" in ann else {**ann, "area": float(ann["bbox"][2] * ann["bbox"][3])})
    return kept, skipped, dropped


def _annotation_problem(ann: dict, found: _Found) -> tuple[str | None, str | None]:
    """``(kind of error, entry)`` for an unusable annotation, ``(None, why)`` for one whose mask is
    degenerate, ``(None, None)`` for a good one (its box is judged by :func:`_box_problems`)."""
    where = found.where(ann)
    if not is_int(ann.get("image_id")):
        return MALFORMED_ANNOTATIONS, f"{where}: 'image_id' must be an integer"
    if ann["image_id"] not in found.images:
        return "annotations referring to an image id not in 'images'", where
    if ann["image_id"] in found.unusable:
        return "annotations on images whose entry or file is unusable (see above)", where
    if not is_int(ann.get("category_id")) or ann["category_id"] not in found.categories:
        known = sorted(found.categories)
        return f"annotations with an unknown category_id (known: {known})", f"{where}: category_id {shown(ann.get('category_id'))}"
    box = ann.get("bbox")
    if not (isinstance(box, list) and len(box) == 4 and all(is_number(v) for v in box)):
        return "annotations whose bbox is not [x, y, width, height] as four finite numbers", f"{where}: bbox {shown(box)}"
    if ann.get("iscrowd", 0) not in (0, 1) or isinstance(ann.get("iscrowd", 0), float):
        return MALFORMED_ANNOTATIONS, f"{where}: 'iscrowd' must be 0 or 1, got {shown(ann['iscrowd'])}"
    if "area" in ann and not (is_number(ann["area"]) and ann["area"] >= 0):
        return MALFORMED_ANNOTATIONS, f"{where}: 'area' must be a number >= 0, got {shown(ann['area'])}"
    img = found.images[ann["image_id"]]
    why = None
    if found.require_masks:
        if "segmentation" not in ann:
            return BAD_MASKS[found.purpose], f"{where}: no segmentation"
        problem = segmentation_problem(ann["segmentation"], img["height"], img["width"])
        if problem:
            return BAD_MASKS[found.purpose], f"{where}: {problem}"
        why = _degenerate_mask(ann["segmentation"], img["height"], img["width"])  # crowd regions too: COCOeval rasterises them
    return None, why


def _degenerate_mask(seg: Any, height: int, width: int) -> str | None:
    """Why a (well-formed) segmentation is degenerate: no polygon, one of fewer than three points, or
    a mask that covers no pixel of the ``height x width`` image as it is rasterised for training
    (polygons outside the image or of no area, an all-zero run-length mask)."""
    if isinstance(seg, list):
        if not seg:
            return "empty segmentation (no polygon)"
        for i, poly in enumerate(seg):
            if len(poly) < 6:
                return f"polygon {i + 1} has {len(poly) // 2} points (a polygon needs 3 or more)"
    if rle_box_area(segmentation_rle(seg, height, width))[1] == 0:
        return f"empty segmentation (it covers no pixel of the {width}x{height} image)"
    return None


def _box_problems(anns: list[dict], found: _Found) -> list[str | None]:
    """Why each annotation's ``[x, y, w, h]`` box is degenerate, else None: no area, or none left as
    the detectors are trained on it: 32-bit ``[x0, y0, x1, y1]`` clipped to the image
    (:func:`~.coco.xyxy_boxes`), mirrored or not, and resized (:func:`~.models.boxes_keep_area`)."""
    if not anns:
        return []
    sizes = np.array([(found.images[a["image_id"]]["width"], found.images[a["image_id"]]["height"]) for a in anns])
    xyxy = xyxy_boxes([a["bbox"] for a in anns], sizes[:, 0], sizes[:, 1])
    keep = boxes_keep_area(xyxy, sizes[:, 0], sizes[:, 1], found.resize)
    whys = []
    for ann, (width, height), xyxy_box, kept in zip(anns, sizes.tolist(), xyxy.tolist(), keep.tolist()):
        box = ann["bbox"]
        if box[2] <= 0 or box[3] <= 0:
            whys.append(f"bbox {box}: width or height <= 0")
        elif not kept:
            shown_box = ", ".join(f"{v:.9g}" for v in xyxy_box)  # float32 in full
            whys.append(f"bbox {box}: outside the {width}x{height} image, or too thin to keep as the detector takes it "
                        f"(32-bit [x0, y0, x1, y1] clipped to the image: [{shown_box}]; nothing left there, or once mirrored or resized)")
        else:
            whys.append(None)
    return whys
