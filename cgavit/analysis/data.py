"""Small image inputs for the analyses: a folder (class sub-folders or flat) or a list of files."""

from __future__ import annotations

import logging
import random
from collections.abc import Sequence
from pathlib import Path

import torch
from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
from torch.utils.data import Dataset

from ..io import DataError
from ..images import BadImageError, SkippedImages
from ..factory import ModelInfo
from ..train.data import list_split, load_transformed
from ..train.inference import eval_transform
from ..train.data.layout import IMAGE_EXTENSIONS, files_under

log = logging.getLogger(__name__)

def _images_in(folder: Path) -> list[Path]:
    return [p for p in files_under(folder) if p.suffix.lower() in IMAGE_EXTENSIONS]


#: Folder names a dataset gives its splits: a ``--data`` whose folders are these, each of folders, is a dataset's root.
SPLIT_NAMES = frozenset({"train", "val", "valid", "validation", "test"})


def _check_not_dataset_root(root: Path) -> None:
    """Refuse a dataset's root (``DIR/train/<class>/``, ``DIR/val/<class>/``) given for one split: its splits would
    be read as classes, the images of every split drawn alike and labelled by the split they are in."""
    folders = [d for d in root.iterdir() if not d.name.startswith(".") and d.is_dir()]
    if not folders or any(d.name.lower() not in SPLIT_NAMES for d in folders):
        return
    if all(any(not e.name.startswith(".") and e.is_dir() for e in d.iterdir()) for d in folders):
        names = sorted(d.name for d in folders)
        pick = next((n for n in names if n.lower() != "train"), names[0])
        raise ValueError(f"{root} holds the splits {', '.join(names)} (folders of class folders), not classes: give one "
                         f"split's folder, e.g. --data {root / pick}")


def list_images(sources: Sequence[str | Path]) -> tuple[list[Path], list[int] | None, list[str] | None]:
    """Image files and, for a folder of class sub-folders, their labels.

    Args:
        sources: one folder, or image files. A folder whose sub-folders hold the images is read as
            ``DIR/<class>/<image>``, as training reads a split (:func:`~cgavit.train.data.list_split`: classes sorted
            by name, as timm and torchvision do; hidden folders left out); a folder of images without sub-folders, or
            a list of files, has no labels.

    Returns:
        ``(paths, labels, class_names)``; ``labels`` and ``class_names`` are None without classes.

    Raises:
        FileNotFoundError: a source does not exist.
        ValueError: no images found, a folder mixed with files, or a dataset's root (``DIR/train/<class>/``,
            ``DIR/val/<class>/``) whose splits would be read as classes.
        DataError: a labelled folder that training would refuse too, e.g. a class folder without images (left out,
            it would shift the index of every class after it).
    """
    paths = [Path(s) for s in sources]
    if not paths:
        raise ValueError("give a data folder (--data DIR) or image files")
    for p in paths:
        if not p.exists():
            raise FileNotFoundError(f"{p} does not exist")
    if len(paths) == 1 and paths[0].is_dir():
        root = paths[0]
        _check_not_dataset_root(root)
        if any(not d.name.startswith(".") and d.is_dir() and _images_in(d) for d in root.iterdir()):
            # DIR/<class>/<image>, read as training and evaluation read a split: the same classes in the same order
            # (hidden folders are none, a class folder without images is refused), the same images
            classes, samples = list_split(root)
            return [Path(p) for p, _ in samples], [y for _, y in samples], classes
        files = _images_in(root)
        if not files:
            raise ValueError(f"no images ({', '.join(IMAGE_EXTENSIONS)}) found in {root}")
        return files, None, None
    if any(p.is_dir() for p in paths):
        raise ValueError("give either one folder or image files, not a mix")
    bad = [str(p) for p in paths if p.suffix.lower() not in IMAGE_EXTENSIONS]
    if bad:
        raise ValueError(f"not image files (expected {', '.join(IMAGE_EXTENSIONS)}): {', '.join(bad)}")
    return paths, None, None


def balanced_subset(labels: Sequence[int] | None, count: int, n: int, seed: int = 0) -> list[int]:
    """Indices of ``n`` items out of ``count``: the same number per class when labelled (a class with fewer items
    gives all it has, and the others make up the rest), seeded.

    With ``n <= 0`` or ``n >= count`` all indices are returned (in order).
    """
    if n <= 0 or n >= count:
        return list(range(count))
    rng = random.Random(seed)
    if labels is None:
        return sorted(rng.sample(range(count), n))
    by_class: dict[int, list[int]] = {}
    for i, y in enumerate(labels):
        by_class.setdefault(y, []).append(i)
    classes = sorted(by_class)
    per, extra = divmod(n, len(classes))
    out = []
    for j, c in enumerate(classes):
        idx = by_class[c]
        take = min(len(idx), per + (1 if j < extra else 0))
        out += rng.sample(idx, take)
    if len(out) < n:  # classes with fewer images than their share: the rest drawn from the others, so n are given
        chosen = set(out)
        out += rng.sample([i for i in range(count) if i not in chosen], n - len(out))
    return sorted(out)


class ImageList(Dataset):
    """``(image tensor, label)`` pairs over image files; label -1 where there are no labels.

    Images are read with :func:`cgavit.images.load_image` (any mode; pipes never opened; sizes
    bounded), which raises :class:`~cgavit.images.BadImageError` naming an unreadable file."""

    def __init__(self, paths: Sequence[Path], labels: Sequence[int] | None, transform) -> None:
        self.paths = list(paths)
        self.labels = list(labels) if labels is not None else None
        self.transform = transform

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        x = load_transformed(self.paths[i], self.transform)
        return x, (self.labels[i] if self.labels is not None else -1)


def load_images(
    sources: Sequence[str | Path], img_size: int, num_images: int = 64, crop_pct: float = 0.875, seed: int = 0, mean=None,
    std=None, interpolation: str = "bicubic", channels: int = 3,
) -> tuple[torch.Tensor, torch.Tensor | None, list[str] | None]:
    """Read up to ``num_images`` images (balanced over classes) into one batch, fed as evaluation feeds them
    (:func:`~cgavit.train.inference.eval_transform`: read as RGB, or greyscale for ``channels`` 1, resized with
    ``interpolation``, centre-cropped ``crop_pct``, normalised with ``mean``/``std``, ImageNet's unless given); an
    image that cannot be read is skipped with a warning.

    Returns:
        ``(images (B, channels, S, S), labels (B,) or None, class names or None)``.

    Raises:
        ValueError: ``channels`` other than 1 or 3.
        DataError: none of the chosen images can be read.
    """
    feed = ModelInfo([], img_size, crop_pct, interpolation, mean or IMAGENET_DEFAULT_MEAN, std or IMAGENET_DEFAULT_STD)
    transform = eval_transform(feed, channels, img_size, crop_pct, interpolation)
    paths, labels, classes = list_images(sources)
    keep = balanced_subset(labels, len(paths), num_images, seed)
    ds = ImageList([paths[i] for i in keep], [labels[i] for i in keep] if labels else None, transform)
    items, bad = [], {}
    for i in range(len(ds)):
        try:
            items.append(ds[i])
        except BadImageError as err:
            bad[str(ds.paths[i])] = str(err)
    SkippedImages().report(bad)
    if not items:
        raise DataError(f"none of the {len(ds)} images chosen from {', '.join(map(str, sources))} could be read")
    x = torch.stack([t for t, _ in items])
    y = torch.tensor([lab for _, lab in items]) if labels else None
    return x, y, classes
