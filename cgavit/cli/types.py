"""Argparse types of counts, image sides, variant names and input paths, for the developer scripts in
``benchmarks/``: each checks with the package's own rule (:mod:`cgavit.bounds` through :func:`.common.image_size`,
:func:`~cgavit.variants.resolve_name`, :func:`~cgavit.io.check_readable_file`,
:func:`~cgavit.train.data.check_folder`), so a bad value is one line and exit 2 before any work.

Not a command module: it loads the training data layer (timm), which the core commands run without.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

from ..io import check_readable_file
from ..train.data import check_folder
from ..variants import resolve_name
from .common import image_size


def whole_number(low: int) -> Callable[[str], int]:
    """An argparse ``type``: a whole number of at least ``low`` (``--batch 0`` is one line and exit 2, not a
    traceback minutes later)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {value}")
        return value

    return parse


def image_side(text: str) -> int:
    """An argparse ``type``: one image side in pixels, within :data:`~cgavit.bounds.IMG_SIZE_RANGE`."""
    try:
        side = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number of pixels, got {text!r}") from None
    try:
        return image_size(side, "the side")[0]
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def variant_name(text: str) -> str:
    """An argparse ``type``: a registered variant (``m4`` or ``efficientvit_m4``), as its registered name."""
    try:
        return resolve_name(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def readable_file(text: str) -> Path:
    """An argparse ``type``: a regular, readable, non-empty file (:func:`~cgavit.io.check_readable_file`)."""
    try:
        return check_readable_file(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def image_folder(text: str) -> Path:
    """An argparse ``type``: an existing folder (:func:`~cgavit.train.data.check_folder`)."""
    try:
        return check_folder(text, "folder")
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
