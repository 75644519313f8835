"""A generated COCO-format dataset of coloured shapes, for smoke tests and demonstrations.

Squares and triangles (random rotation, polygon masks) and circles (RLE masks) on plain backgrounds,
never overlapping, so every mask is exactly what is visible. Category ids are deliberately not
contiguous (1, 3, 7), as in COCO. It checks that the whole pipeline works; it says nothing about
accuracy on natural images.
"""

from __future__ import annotations

import colorsys
import json
import math
import os
import random
import re
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

from ..bounds import IMG_SIZE_RANGE
from ..io import atomic_write, write_json
from .coco import encode_masks, rle_box_area, segmentation_rle

SHAPE_CATEGORIES = ({"id": 1, "name": "square"}, {"id": 3, "name": "circle"}, {"id": 7, "name": "triangle"})


def _polygon(kind: str, cx: float, cy: float, r: float, angle: float) -> list[float]:
    corners = 4 if kind == "square" else 3
    pts = []
    for i in range(corners):
        a = angle + 2 * math.pi * i / corners
        pts += [cx + r * math.cos(a), cy + r * math.sin(a)]
    return pts


def draw_shapes_image(rng: random.Random, size: tuple[int, int], max_shapes: int) -> tuple[Image.Image, list[dict]]:
    """One image and its annotations (``category_id``, ``bbox``, ``segmentation``, ``area``)."""
    h, w = size
    bg = tuple(rng.randint(0, 255) for _ in range(3))
    img = Image.new("RGB", (w, h), bg)
    draw = ImageDraw.Draw(img)
    placed: list[tuple[float, float, float]] = []
    anns = []
    for _ in range(rng.randint(1, max_shapes)):
        for _attempt in range(50):  # rejection sampling: no two shapes touch
            r = rng.uniform(0.1, 0.22) * min(h, w)
            cx, cy = rng.uniform(r, w - r), rng.uniform(r, h - r)
            if all(math.hypot(cx - x, cy - y) > r + q + 2 for x, y, q in placed):
                break
        else:
            continue
        placed.append((cx, cy, r))
        cat = rng.choice(SHAPE_CATEGORIES)
        hue = rng.random()
        color = tuple(int(255 * c) for c in colorsys.hsv_to_rgb(hue, rng.uniform(0.6, 1.0), rng.uniform(0.6, 1.0)))
        if cat["name"] == "circle":
            draw.ellipse((cx - r, cy - r, cx + r, cy + r), fill=color)
            canvas = Image.new("L", (w, h), 0)
            ImageDraw.Draw(canvas).ellipse((cx - r, cy - r, cx + r, cy + r), fill=1)
            rle = encode_masks(np.array(canvas, dtype=np.uint8)[None])[0]
            seg = {"size": [h, w], "counts": rle["counts"]}
        else:
            poly = _polygon(cat["name"], cx, cy, r, rng.uniform(0, 2 * math.pi))
            draw.polygon(poly, fill=color)
            seg = [[round(v, 2) for v in poly]]
            rle = segmentation_rle(seg, h, w)
        box, area = rle_box_area(rle)
        anns.append(dict(category_id=cat["id"], bbox=box, segmentation=seg, area=area, iscrowd=0))
    return img, anns


def check_shapes_destination(root: str | Path, split: str) -> None:
    """Refuse to write the ``split`` of a shapes dataset over files that are not an earlier one's.

    Raises:
        ValueError: ``root/<split>.json`` exists and is not a shapes dataset's annotations (a user's own COCO file,
            say), or, with no annotations there, ``root/<split>/`` holds files of other names than the images
            this writes (those an earlier run stopped midway left are its own); ``root`` or ``root/<split>``
            is a file.
    """
    root = Path(root)
    ann, image_dir = root / f"{split}.json", root / split
    for path in (root, image_dir):
        if os.path.lexists(path) and not path.is_dir():
            raise ValueError(f"{path} is a file, not a folder; give --output a new or empty folder (nothing was written)")
    if ann.exists():
        try:
            ours = json.loads(ann.read_text()).get("categories") == list(SHAPE_CATEGORIES)
        except (OSError, ValueError, AttributeError):
            ours = False
        if not ours:
            raise ValueError(f"{ann} exists and is not a shapes dataset's annotations; give --output a new or empty folder "
                             "(nothing was written)")
    elif image_dir.is_dir():  # images it writes before the json: an earlier run stopped midway left them
        own = re.compile(rf"\.?{re.escape(split)}_\d{{5}}\.png(\..*)?")  # atomic_write's temporaries too
        if any(not own.fullmatch(p.name) for p in image_dir.iterdir()):
            raise ValueError(f"{image_dir} holds files of its own; give --output a new or empty folder (nothing was written)")


def check_shapes_request(num_images: int, size: int | tuple[int, int], max_shapes: int) -> tuple[int, int]:
    """The ``(H, W)`` of the images :func:`write_shapes_dataset` is asked for, its arguments checked.

    Raises:
        ValueError: ``num_images`` outside 0..100000, ``max_shapes`` outside 1..100, a side outside 32..4096.
    """
    hw = (size, size) if isinstance(size, int) else tuple(size)
    if not 0 <= num_images <= 100_000:
        raise ValueError(f"the number of images (--num-train, --num-val) must be in 0..100000, got {num_images}")
    if not 1 <= max_shapes <= 100:
        raise ValueError(f"--max-shapes must be in 1..100, got {max_shapes}")
    low, high = IMG_SIZE_RANGE
    if len(hw) != 2 or not all(low <= s <= high for s in hw):
        raise ValueError(f"--size must be in {low}..{high} pixels, got {size}")
    return hw


def write_shapes_dataset(
    root: str | Path,
    num_images: int = 8,
    size: int | tuple[int, int] = 160,
    seed: int = 0,
    max_shapes: int = 3,
    split: str = "train",
) -> tuple[Path, Path]:
    """Write ``root/<split>/*.png`` and ``root/<split>.json`` (COCO instances); return both paths. An earlier shapes
    dataset there is replaced; anything else is refused (:func:`check_shapes_destination`), as are arguments out of
    bounds (:func:`check_shapes_request`).

    Args:
        root: output folder (created).
        num_images: images to draw.
        size: image side, or ``(H, W)``.
        seed: random seed; the same seed gives the same files.
        max_shapes: at most this many shapes per image (at least one).
        split: name of the image folder and JSON file.
    """
    root = Path(root)
    hw = check_shapes_request(num_images, size, max_shapes)
    check_shapes_destination(root, split)
    image_dir = root / split
    image_dir.mkdir(parents=True, exist_ok=True)
    # an earlier dataset's annotations go before its images are drawn again: a run stopped midway then leaves
    # images without annotations (written again by the next run), not new images under the old annotations
    (root / f"{split}.json").unlink(missing_ok=True)
    rng = random.Random(seed)
    images, annotations = [], []
    for i in range(num_images):
        img, anns = draw_shapes_image(rng, hw, max_shapes)
        name = f"{split}_{i:05d}.png"
        atomic_write(image_dir / name, lambda tmp: img.save(tmp, format="PNG"))
        images.append(dict(id=i + 1, file_name=name, height=hw[0], width=hw[1]))
        for a in anns:
            annotations.append(dict(id=len(annotations) + 1, image_id=i + 1, **a))
    ann_file = write_json(root / f"{split}.json", dict(images=images, annotations=annotations, categories=list(SHAPE_CATEGORIES)), indent=None)
    return image_dir, ann_file
