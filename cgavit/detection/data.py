"""COCO-format detection data: checking an annotation file, and a dataset for torchvision's detectors.

A COCO-format dataset is an image folder plus an instances JSON (``images``, ``annotations``,
``categories``). :func:`check_coco` reads the JSON and reports, before any training starts, every
annotation that points at a missing image (id or file), names an unknown category, or has a box that
cannot be used; :class:`CocoDetection` then serves ``(image, target)`` pairs in the form torchvision's
RetinaNet and Mask R-CNN take (boxes ``xyxy`` in pixels, contiguous labels ``1..K``, binary masks).
"""

from __future__ import annotations

import json
import logging
import math
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from PIL import Image
from torchvision import tv_tensors
from torchvision.transforms import v2

from .coco import coco_index, decode_masks, segmentation_rle

if TYPE_CHECKING:
    from .coco import COCO

log = logging.getLogger(__name__)

_SHOW = 12  # offending entries listed per problem before "... and N more"
Problems = dict[str, list[str]]  # kind of problem -> offending entries


def _listing(entries: list[str]) -> str:
    shown = "\n    ".join(entries[:_SHOW])
    more = f"\n    ... and {len(entries) - _SHOW} more" if len(entries) > _SHOW else ""
    return f"\n    {shown}{more}"


@dataclass
class CocoCheck:
    """The outcome of :func:`check_coco`: a cleaned dataset dict and what was dropped.

    Attributes:
        dataset: the instances dict with unusable annotations removed (feed it to pycocotools).
        categories: ``[(category_id, name), ...]`` in the order of the contiguous labels 1..K.
        skipped: ``"annotation <id> (image <id> <file>): <why>"`` for every dropped annotation.
    """

    dataset: dict[str, Any]
    categories: list[tuple[int, str]]
    skipped: list[str] = field(default_factory=list)

    def coco(self) -> COCO:
        """A pycocotools ``COCO`` index over :attr:`dataset` (its progress prints silenced)."""
        return coco_index(self.dataset)


def _segmentation_problem(seg: Any) -> tuple[str, str] | None:
    """``("error" | "degenerate", why)`` when a COCO ``segmentation`` cannot be used, else None.

    A polygon with fewer than three points is degenerate (skipped like a degenerate box); anything
    that is not polygons or RLE at all is an error.
    """
    if isinstance(seg, list):
        if not seg:
            return "degenerate", "empty segmentation"
        for poly in seg:
            if not isinstance(poly, list) or not all(isinstance(v, (int, float)) and math.isfinite(v) for v in poly):
                return "error", "a polygon must be a flat list of finite x, y numbers"
            if len(poly) < 6 or len(poly) % 2:
                return "degenerate", f"polygon with {len(poly)} coordinates (needs 3 or more x, y points)"
        return None
    if isinstance(seg, dict):
        if "counts" not in seg or "size" not in seg:
            return "error", "an RLE segmentation needs 'counts' and 'size'"
        return None
    return "error", f"segmentation must be polygons (list) or RLE (dict), got {type(seg).__name__}"


def _box_problem(box: list[float], img: dict) -> str | None:
    """Why an ``[x, y, w, h]`` box is degenerate (no area, or none inside the image), else None."""
    x, y, w, h = box
    if w <= 0 or h <= 0:
        return f"bbox {box}: width or height <= 0"
    if "width" in img and "height" in img:
        if min(x + w, img["width"]) - max(x, 0) <= 0 or min(y + h, img["height"]) - max(y, 0) <= 0:
            return f"bbox {box}: outside the {img['width']}x{img['height']} image"
    return None


def check_coco(
    ann_file: str | Path,
    image_dir: str | Path,
    *,
    strict: bool = False,
    require_masks: bool = False,
) -> CocoCheck:
    """Read and check a COCO instances file against its image folder.

    Errors (raised together in one ``ValueError`` that names every offending entry): unreadable or
    malformed JSON, duplicate image / annotation / category ids, image files missing from
    ``image_dir``, annotations whose ``image_id`` is not an image or whose ``category_id`` is not a
    category, a ``bbox`` that is not four finite numbers, and (with ``require_masks``) a missing or
    malformed ``segmentation`` on a non-crowd annotation.

    Degenerate boxes (width or height <= 0, or nothing left after clipping to the image) and, with
    ``require_masks``, polygons of fewer than three points are dropped with one warning listing them
    all; with ``strict=True`` they are errors too.

    Args:
        ann_file: instances JSON.
        image_dir: folder the images' ``file_name`` entries are relative to.
        strict: refuse degenerate boxes instead of skipping them.
        require_masks: every non-crowd annotation needs a segmentation (Mask R-CNN).

    Raises:
        ValueError: with the list of problems and what to do about them.
        FileNotFoundError: ``ann_file`` or ``image_dir`` does not exist.
    """
    ann_file, image_dir = Path(ann_file), Path(image_dir)
    data = _read_instances(ann_file, image_dir)
    problems: Problems = defaultdict(list)  # kind of problem -> offending entries, in reading order
    images, missing_files = _check_images(data["images"], image_dir, problems)
    categories = _check_categories(data["categories"], problems)
    if not categories and not problems:
        problems["no categories"].append(f"{ann_file} lists no categories")
    found = _Found(images, missing_files, categories, require_masks)
    kept, skipped = _check_annotations(data["annotations"], found, problems)
    if strict and skipped:
        problems["degenerate boxes or masks (refused with --strict; drop --strict to skip them with a warning)"] = skipped
    if problems:
        text = "".join(f"\n  {len(v)} {k}:{_listing(v)}" for k, v in problems.items())
        raise ValueError(
            f"{ann_file} has problems, nothing was trained:{text}\n"
            "Fix or remove these entries (or point --*-images at the folder that holds the files)."
        )
    if skipped:
        log.warning("%s: skipping %d degenerate annotations:%s", ann_file, len(skipped), _listing(skipped))
    clean = dict(data)
    clean["annotations"] = kept
    clean["categories"] = [c for c in data["categories"] if isinstance(c, dict)]
    return CocoCheck(clean, sorted(categories.items()), skipped)


@dataclass
class _Found:
    """What the images and categories of an instances file hold, for checking its annotations."""

    images: dict[Any, dict]  # image id -> image entry
    missing_files: set  # ids of images whose file is missing
    categories: dict[Any, str]  # category id -> name
    require_masks: bool

    def where(self, ann: dict) -> str:
        img = self.images.get(ann.get("image_id"))
        name = f" {img['file_name']}" if img else ""
        return f"annotation {ann.get('id')} (image {ann.get('image_id')}{name})"


def _read_instances(ann_file: Path, image_dir: Path) -> dict[str, Any]:
    """The JSON of an instances file, with ``images``, ``categories`` and ``annotations`` lists."""
    if not ann_file.is_file():
        raise FileNotFoundError(f"annotation file {ann_file} does not exist")
    if not image_dir.is_dir():
        raise FileNotFoundError(f"image folder {image_dir} does not exist")
    try:
        data = json.loads(ann_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{ann_file} is not valid JSON ({err}); is it a COCO instances file?") from None
    if not isinstance(data, dict) or not all(isinstance(data.get(k), list) for k in ("images", "categories")):
        raise ValueError(f"{ann_file} is not a COCO instances file: it needs 'images' and 'categories' lists")
    if not isinstance(data.get("annotations", []), list):
        raise ValueError(f"{ann_file}: 'annotations' must be a list")
    return {**data, "annotations": data.get("annotations", [])}


def _check_images(entries: list, image_dir: Path, problems: Problems) -> tuple[dict[Any, dict], set]:
    """``(id -> image entry, ids whose file is missing)``; malformed and duplicate entries noted."""
    images: dict[Any, dict] = {}
    for img in entries:
        if not isinstance(img, dict) or "id" not in img or "file_name" not in img:
            problems["images without an 'id' or 'file_name'"].append(repr(img)[:120])
            continue
        if img["id"] in images:
            problems["duplicate image ids"].append(f"image {img['id']} ({img['file_name']})")
        images[img["id"]] = img
    missing_files = {i for i, img in images.items() if not (image_dir / img["file_name"]).is_file()}
    for i in sorted(missing_files, key=str):
        problems[f"image files missing from {image_dir}"].append(f"image {i}: {images[i]['file_name']}")
    return images, missing_files


def _check_categories(entries: list, problems: Problems) -> dict[Any, str]:
    """``category id -> name``; entries without an id and duplicate ids noted."""
    categories: dict[Any, str] = {}
    for cat in entries:
        if not isinstance(cat, dict) or "id" not in cat:
            problems["categories without an 'id'"].append(repr(cat)[:120])
            continue
        if cat["id"] in categories:
            problems["duplicate category ids"].append(f"category {cat['id']}")
        categories[cat["id"]] = str(cat.get("name", cat["id"]))
    return categories


def _check_annotations(anns: list, found: _Found, problems: Problems) -> tuple[list[dict], list[str]]:
    """``(usable annotations, "<where>: <why>" of each degenerate one)``; errors go to ``problems``."""
    kept, skipped = [], []
    ann_ids = Counter(a.get("id") for a in anns if isinstance(a, dict))
    for ann in anns:
        if not isinstance(ann, dict) or "id" not in ann:
            problems["annotations without an 'id'"].append(repr(ann)[:120])
            continue
        if ann_ids[ann["id"]] > 1:
            problems["duplicate annotation ids"].append(found.where(ann))
            continue
        error, why = _annotation_problem(ann, found)
        if error:
            problems[error].append(why)
        elif why:
            skipped.append(f"{found.where(ann)}: {why}")
        else:
            kept.append(ann)
    return kept, skipped


def _annotation_problem(ann: dict, found: _Found) -> tuple[str | None, str | None]:
    """``(kind of error, entry)`` for an unusable annotation, ``(None, why)`` for a degenerate one,
    ``(None, None)`` for a good one."""
    where = found.where(ann)
    if ann.get("image_id") not in found.images:
        return "annotations referring to an image id not in 'images'", where
    if ann["image_id"] in found.missing_files:
        return "annotations on images whose file is missing", where
    if ann.get("category_id") not in found.categories:
        known = sorted(found.categories)
        return f"annotations with an unknown category_id (known: {known})", f"{where}: category_id {ann.get('category_id')!r}"
    box = ann.get("bbox")
    if not (isinstance(box, list) and len(box) == 4 and all(isinstance(v, (int, float)) and math.isfinite(v) for v in box)):
        return "annotations whose bbox is not [x, y, width, height] as four finite numbers", f"{where}: bbox {box!r}"
    why = None
    if found.require_masks and not ann.get("iscrowd", 0):
        problem = _segmentation_problem(ann["segmentation"]) if "segmentation" in ann else ("error", "no segmentation")
        if problem and problem[0] == "error":
            return "annotations without a usable mask (Mask R-CNN needs one; train RetinaNet for boxes only)", f"{where}: {problem[1]}"
        why = problem[1] if problem else None
    return None, why or _box_problem(box, found.images[ann["image_id"]])


def train_transform(hflip: float = 0.5) -> v2.Transform | None:
    """Training augmentation of the 1x schedule: random horizontal flip with probability ``hflip``
    (boxes and masks follow); None when ``hflip`` is 0."""
    if not 0.0 <= hflip <= 1.0:
        raise ValueError(f"the flip probability must be in [0, 1], got {hflip}")
    return v2.RandomHorizontalFlip(hflip) if hflip > 0 else None


class CocoDetection(torch.utils.data.Dataset):
    """COCO-format images and instances for torchvision's detectors.

    Item ``i`` is ``(image, target)``: ``image`` a float ``(3, H, W)`` tensor in [0, 1] (the model
    normalises and resizes), ``target`` a dict with ``boxes`` ``(N, 4)`` xyxy pixels, ``labels``
    ``(N,)`` in 1..K (the order of :attr:`categories`), ``image_id``, and with ``masks=True`` also
    ``masks`` ``(N, H, W)`` uint8. Crowd annotations are left out of training targets (COCOeval
    uses them from the annotation file).

    Args:
        check: result of :func:`check_coco`.
        image_dir: image folder.
        masks: include instance masks.
        transforms: a torchvision ``v2`` transform applied to ``(image, target)``.
    """

    def __init__(self, check: CocoCheck, image_dir: str | Path, masks: bool = False, transforms: v2.Transform | None = None) -> None:
        self.coco = check.coco()
        self.categories = check.categories
        self.cat_to_label = {cid: i + 1 for i, (cid, _) in enumerate(check.categories)}
        self.image_dir = Path(image_dir)
        self.ids = sorted(self.coco.imgs)
        self.masks = masks
        self.transforms = transforms

    def __len__(self) -> int:
        return len(self.ids)

    def load_image(self, image_id: int) -> Image.Image:
        info = self.coco.imgs[image_id]
        path = self.image_dir / info["file_name"]
        try:
            img = Image.open(path).convert("RGB")
        except OSError as err:
            raise ValueError(f"cannot read image {image_id} ({path}): {err}") from None
        if "width" in info and "height" in info and img.size != (info["width"], info["height"]):
            raise ValueError(
                f"image {image_id} ({path}) is {img.size[0]}x{img.size[1]} but the annotation file says "
                f"{info['width']}x{info['height']}; fix the file's width/height entries"
            )
        return img

    def __getitem__(self, index: int) -> tuple[torch.Tensor, dict[str, Any]]:
        image_id = self.ids[index]
        img = self.load_image(image_id)
        w, h = img.size
        anns = [a for a in self.coco.imgToAnns.get(image_id, []) if not a.get("iscrowd", 0)]
        boxes = torch.tensor([a["bbox"] for a in anns], dtype=torch.float32).reshape(-1, 4)
        boxes[:, 2:] += boxes[:, :2]  # xywh -> xyxy
        boxes[:, 0::2] = boxes[:, 0::2].clamp(0, w)
        boxes[:, 1::2] = boxes[:, 1::2].clamp(0, h)
        target: dict[str, Any] = {
            "boxes": tv_tensors.BoundingBoxes(boxes, format="XYXY", canvas_size=(h, w)),
            "labels": torch.tensor([self.cat_to_label[a["category_id"]] for a in anns], dtype=torch.int64),
            "image_id": image_id,
        }
        if self.masks:
            rles = [segmentation_rle(a["segmentation"], h, w) for a in anns]
            m = torch.from_numpy(decode_masks(rles)).permute(2, 0, 1) if rles else torch.zeros(0, h, w)
            target["masks"] = tv_tensors.Mask(m.to(torch.uint8))
        image = tv_tensors.Image(v2.functional.pil_to_tensor(img))
        if self.transforms is not None:
            image, target = self.transforms(image, target)
        image = v2.functional.to_dtype(image, torch.float32, scale=True).as_subclass(torch.Tensor)
        target = {k: v.as_subclass(torch.Tensor) if isinstance(v, torch.Tensor) else v for k, v in target.items()}
        return image, target


def collate(batch: list) -> tuple:
    """Detection batches are lists: ``(images, targets)``."""
    return tuple(zip(*batch))
