"""What a COCO instances file may declare, checked field by field before anything trusts it.

pycocotools' C code believes what it is given: a run-length mask whose ``size`` is larger than its
image, whose counts add up to more pixels than it declares, or whose compressed string is malformed
makes it allocate without bound or write past its buffer (a ``"size": [1000000, 1000000]`` kills the
process with a segmentation fault). The checks here are plain Python and run before any decoder
sees a value; :func:`segmentation_problem` is the one test every mask passes first.
"""

from __future__ import annotations

import math
from typing import Any

from ..bounds import MAX_IMAGE_PIXELS
from ..schema import shown

#: Most categories a detection dataset may list (LVIS has 1203): a RetinaNet head for this many
#: classes already holds 200 million parameters.
MAX_CATEGORIES = 10_000

_MAX_JSON_INT = 2**53  # larger integers do not survive the float conversions pycocotools makes
_RLE_CHUNKS = 7  # a count in a compressed RLE string takes at most 7 characters of 5 bits (35 bits)


def is_int(value: Any) -> bool:
    """An integer as JSON gives it (``True``/``False`` are not), small enough to be exact as a float."""
    return isinstance(value, int) and not isinstance(value, bool) and abs(value) <= _MAX_JSON_INT


def is_number(value: Any) -> bool:
    """A finite number as JSON gives it (``True``/``False`` and NaN/infinity are not)."""
    if isinstance(value, float):
        return math.isfinite(value)
    return is_int(value)


def image_size_problem(width: Any, height: Any) -> str | None:
    """Why an image's declared ``width`` / ``height`` cannot be used, else None (both must be given).

    The size bound is :data:`~cgavit.bounds.MAX_IMAGE_PIXELS` (50 megapixels, e.g. 8660 x 5773; one
    such image is 600 MB as the float tensor the models take), as for every image file opened."""
    for name, value in (("width", width), ("height", height)):
        if not (is_int(value) and value >= 1):
            return f"'{name}' must be a positive whole number of pixels, got {shown(value)}"
    if width * height > MAX_IMAGE_PIXELS:
        return (
            f"declares {width}x{height} pixels ({width * height / 1e6:.0f} megapixels), above the "
            f"{MAX_IMAGE_PIXELS / 1e6:.0f}-megapixel bound for detection images; resize the image"
        )
    return None


def segmentation_problem(seg: Any, height: int, width: int) -> str | None:
    """Why ``seg`` must not be handed to pycocotools for a ``height x width`` image, else None.

    Polygons must be lists of finite numbers within one image size of the image (farther points make
    the rasteriser allocate in proportion to their distance); run-length masks must declare exactly
    the image's ``[height, width]``, and their counts (a list, or COCO's compressed string) must be
    well formed and cover exactly ``height * width`` pixels. A polygon of an odd count of numbers is
    malformed (a point without its y). Polygons with fewer than three points, and an empty list, are
    not a problem here (they are degenerate, which the caller decides about).
    """
    if isinstance(seg, list):
        return _polygon_problem(seg, height, width)
    if isinstance(seg, dict):
        return _rle_problem(seg, height, width)
    return f"'segmentation' must be polygons (a list) or run-length (an object), got {type(seg).__name__}"


def _polygon_problem(polygons: list, height: int, width: int) -> str | None:
    for i, poly in enumerate(polygons):
        if not isinstance(poly, list) or not all(is_number(v) for v in poly):
            return f"'segmentation': a polygon must be a flat list of finite x, y numbers, got {shown(poly)}"
        if len(poly) % 2:  # pycocotools would drop the last number without a word
            return f"'segmentation': polygon {i + 1} has {len(poly)} numbers, an odd count (each point is an x and a y)"
        xs, ys = poly[0::2], poly[1::2]
        if any(not -width <= x <= 2 * width for x in xs) or any(not -height <= y <= 2 * height for y in ys):
            return f"'segmentation': a polygon has points far outside the {width}x{height} image"
    return None


def _rle_problem(rle: dict, height: int, width: int) -> str | None:
    size = rle.get("size")
    if not (isinstance(size, list) and len(size) == 2 and all(is_int(v) for v in size)):
        return f"run-length 'size' must be [height, width] as two integers, got {shown(size)}"
    if size != [height, width]:
        return f"run-length 'size' {size} disagrees with the image's [height, width] = [{height}, {width}]"
    counts = rle.get("counts")
    if isinstance(counts, bytes):
        counts = counts.decode("ascii", errors="replace")
    if isinstance(counts, str):
        runs = compressed_counts(counts)
        if runs is None:
            return "run-length 'counts' is not a valid compressed COCO string"
    elif isinstance(counts, list) and all(is_int(v) and v >= 0 for v in counts):
        runs = counts
    else:
        return f"run-length 'counts' must be a compressed string or a list of non-negative integers, got {shown(counts)}"
    if sum(runs) != height * width:
        return f"run-length 'counts' cover {sum(runs)} pixels, but a {height}x{width} mask has {height * width}"
    return None


def compressed_counts(text: str) -> list[int] | None:
    """The run lengths of a compressed COCO RLE string, or None when it is malformed.

    The format (pycocotools ``rleFrString``): each count is written in 5-bit chunks, least
    significant first, as characters ``chr(48 + chunk)``; bit 0x20 says another chunk follows, bit
    0x10 of the last chunk is the sign; from the third count on, the value is stored as the
    difference to the count two places earlier.
    """
    counts: list[int] = []
    i = 0
    while i < len(text):
        value, k, more = 0, 0, True
        while more:
            if i == len(text) or k == _RLE_CHUNKS:
                return None  # the string ends inside a count, or a count longer than any mask
            c = ord(text[i]) - 48
            if not 0 <= c < 64:
                return None
            value |= (c & 0x1F) << (5 * k)
            more = bool(c & 0x20)
            i += 1
            k += 1
            if not more and c & 0x10:
                value |= -1 << (5 * k)
        if len(counts) > 2:
            value += counts[-2]
        if not 0 <= value < 2**32:
            return None
        counts.append(value)
    return counts
