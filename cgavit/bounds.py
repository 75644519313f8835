"""The one table of bounds on what a user or a file may ask for: image sizes, crops, class counts,
decoded pixels, threads and resize interpolations (and :func:`check_threads`, the one check of a thread count).

Everything that takes these values from outside (the model core, weights metadata, training and
evaluation options, the command line, image decoding) reads them from here, so a bound changes in one
place. Architecture bounds (widths, depths, heads, ratios) are the model config's own, in
:data:`cgavit.variants.CONFIG_LIMITS`.
"""

from __future__ import annotations

import numbers

#: Smallest and largest image side, in pixels, that a model is built for or evaluated at. Below 32 px
#: the four stride-2 stem convolutions leave no map for three stages.
IMG_SIZE_RANGE = (32, 4096)
MIN_INPUT_SIZE = IMG_SIZE_RANGE[0]

#: Evaluation centre-crop fraction (resize to ``img_size / crop_pct``, then crop).
CROP_PCT_RANGE = (0.2, 1.0)

#: Largest classifier a file may declare.
MAX_CLASSES = 100_000

#: The input channels a network may take (1: grey, 3: RGB, more: multispectral).
IN_CHANS_RANGE = (1, 64)

#: Largest image, in decoded pixels, that training, evaluation, prediction and detection open; a
#: larger one is refused from its header, before any pixel is decoded (a decompression bomb).
MAX_IMAGE_PIXELS = 50_000_000

#: Largest image an explorer upload may decode to (a 5 KB PNG can declare 6300x6300).
MAX_UPLOAD_PIXELS = 16_000_000

#: Threads a command may run with (``--threads``): more than any CPU has; 100,000 asked for memory a process has not.
THREADS_RANGE = (1, 1024)

#: The resize interpolations a checkpoint, a training run or a command may name.
INTERPOLATIONS = ("bicubic", "bilinear", "nearest")


def is_whole(value: object, low: int = 1) -> bool:
    """Whether ``value`` is a whole number (an int or a NumPy integer; not a bool) of at least ``low``."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool) and value >= low


def check_threads(threads: object, flag: str = "--threads") -> None:
    """Raise ``ValueError`` unless ``threads`` is a whole number in :data:`~cgavit.bounds.THREADS_RANGE`."""
    lo, hi = THREADS_RANGE
    if isinstance(threads, bool) or not isinstance(threads, int) or not lo <= threads <= hi:
        raise ValueError(f"{flag} must be a whole number within {lo}..{hi}, got {threads!r}")
