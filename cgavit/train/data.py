"""Image-folder data for training and evaluation: layout checks, any-mode image decoding, transforms,
samplers and loaders whose order and augmentation are reproducible per epoch.

Layout (the ImageNet-1k one)::

    DIR/train/<class>/<image>     DIR/val/<class>/<image>

Class indices are the sorted class-folder names, so an ImageNet ``val`` folder of synset names gets
the standard 1000-class order. An image that cannot be decoded is reported by path and skipped (the
count travels with each batch, so it is exact across loader workers), or raises with ``strict``. So is
an image that declares more than :data:`MAX_IMAGE_PIXELS` pixels (a decompression bomb): its header is
read, never its pixels.
"""

from __future__ import annotations

import logging
import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageOps
from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD, create_transform
from timm.data.auto_augment import posterize
from timm.data.distributed_sampler import RepeatAugSampler
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler, SequentialSampler

from ..bounds import MAX_IMAGE_PIXELS
from ..io import DataError, UnreadableFileError, check_readable_file

log = logging.getLogger(__name__)

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".gif", ".tif", ".tiff", ".webp", ".ppm", ".pgm", ".pbm")

#: Largest image decoded (width x height): 50 megapixels, about 150 MB as RGB. A larger one is refused
#: from its header, before any pixel is decoded, and handled as an unreadable image.


class BadImageError(DataError):
    """An image file that cannot be decoded (raised instead of skipping when ``strict``)."""


def check_folder(path: str | Path, what: str = "data folder") -> Path:
    """Return ``path`` if it is a folder that can be listed; raise :class:`~cgavit.io.DataError`
    naming it and saying what is wrong otherwise (missing, a file, a pipe, or not permitted)."""
    path = Path(path)
    if not path.exists():
        raise DataError(f"{what} {path} does not exist; check the path")
    if not path.is_dir():
        raise DataError(f"{what} {path} is not a folder (a file, pipe or device); give the folder")
    try:
        next(path.iterdir(), None)
    except OSError as err:
        raise DataError(f"{what} {path} cannot be listed ({err.strerror or err}); fix its permissions") from None
    return path


# --------------------------------------------------------------------------------- layout scanning
def list_split(root: str | Path, split: str | None = None) -> tuple[list[str], list[tuple[str, int]]]:
    """Class names and ``(path, class index)`` samples of one image-folder split.

    Args:
        root: the dataset folder (``split`` is looked up inside it), or the split folder itself
            when ``split`` is None.
        split: ``"train"``, ``"val"``, ... or None.

    Raises:
        DataError: the folder is missing, not a folder, has no class folders, or a class folder holds
            no image; the message names the folder and says what the layout must be.
    """
    if split:
        check_folder(root)
    folder = Path(root) / split if split else Path(root)
    if not folder.exists():
        raise DataError(
            f"data folder {folder} does not exist; expected the image-folder layout "
            f"DIR/train/<class>/<image> and DIR/val/<class>/<image>"
        )
    check_folder(folder)
    classes = sorted(p.name for p in folder.iterdir() if p.is_dir() and not p.name.startswith("."))
    if not classes:
        raise DataError(f"{folder} has no class folders; put each class's images in {folder}/<class name>/")
    samples: list[tuple[str, int]] = []
    empty = []
    for idx, name in enumerate(classes):
        files = sorted(
            p for p in (folder / name).rglob("*") if p.suffix.lower() in IMAGE_EXTENSIONS and p.is_file()
        )
        if not files:
            empty.append(name)
        samples.extend((str(p), idx) for p in files)
    if empty:
        shown = ", ".join(empty[:5]) + (" ..." if len(empty) > 5 else "")
        raise DataError(
            f"{len(empty)} class folder(s) in {folder} hold no images ({shown}); remove them or add images "
            f"(recognised extensions: {' '.join(IMAGE_EXTENSIONS)})"
        )
    return classes, samples


def check_layout(root: str | Path, train_split: str = "train", val_split: str = "val") -> dict:
    """Check both splits before training starts and that they name the same classes.

    Returns:
        ``{"classes": [...], "train": samples, "val": samples}``.

    Raises:
        DataError: a missing or empty split or class folder, or class sets that differ.
    """
    train_classes, train_samples = list_split(root, train_split)
    val_classes, val_samples = list_split(root, val_split)
    if train_classes != val_classes:
        only_t = sorted(set(train_classes) - set(val_classes))[:5]
        only_v = sorted(set(val_classes) - set(train_classes))[:5]
        raise DataError(
            f"the {train_split} and {val_split} splits of {root} name different classes "
            f"(only in {train_split}: {only_t}; only in {val_split}: {only_v}); both need the same class folders"
        )
    return {"classes": train_classes, "train": train_samples, "val": val_samples}


# -------------------------------------------------------------------------------------- decoding
def to_rgb(img: Image.Image) -> Image.Image:
    """Any PIL image as 8-bit RGB.

    Transparent images (RGBA, LA, PA, palette with transparency) are composited on white; 16-bit,
    32-bit integer and float images are scaled to 0-255 by their value range; CMYK, grayscale, 1-bit
    and palette images go through PIL's conversion.
    """
    if img.mode in ("I;16", "I;16L", "I;16B", "I;16N", "I", "F"):
        arr = np.asarray(img, dtype=np.float32)
        if img.mode.startswith("I;16"):
            arr = arr / 257.0
        elif img.mode == "F" and arr.size and arr.min() >= 0.0 and arr.max() <= 1.0:
            arr = arr * 255.0
        elif arr.size and (arr.min() < 0 or arr.max() > 255):
            hi = 65535.0 if img.mode == "I" and arr.min() >= 0 and arr.max() <= 65535 else None
            if hi is not None:
                arr = arr / 257.0
            else:  # arbitrary range: stretch what is there
                lo, top = float(arr.min()), float(arr.max())
                arr = (arr - lo) * (255.0 / max(top - lo, 1e-12))
        img = Image.fromarray(np.clip(np.nan_to_num(arr), 0, 255).round().astype(np.uint8), "L")
    if img.mode == "P" and "transparency" in img.info:
        img = img.convert("RGBA")
    if img.mode in ("RGBA", "LA", "PA", "RGBa", "La"):
        rgba = img.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return img if img.mode == "RGB" else img.convert("RGB")


def load_image(path: str | Path) -> Image.Image:
    """Open, fully decode and convert to RGB.

    The path is checked first (a pipe or device is never opened, so nothing blocks), and the size the
    header declares before any pixel is decoded (at most :data:`MAX_IMAGE_PIXELS`).

    Raises:
        BadImageError: the file is missing, empty, not a regular file, not an image, truncated,
            or too large; the message names it.
    """
    try:
        check_readable_file(path, "image")
    except UnreadableFileError as err:
        raise BadImageError(str(err)) from None
    try:
        with Image.open(path) as img:
            _check_pixels(img, path)
            img.load()
            return to_rgb(img)
    except BadImageError:
        raise
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as err:
        raise BadImageError(f"cannot read image {path}: {err}") from None


def _check_pixels(img: Image.Image, path: str | Path) -> None:
    width, height = img.size
    if width * height > MAX_IMAGE_PIXELS:
        raise BadImageError(
            f"image {path} declares {width}x{height} pixels ({width * height / 1e6:.0f} MP), over the "
            f"{MAX_IMAGE_PIXELS / 1e6:.0f} MP that are decoded; downscale it"
        )


# --------------------------------------------------------------------------------------- dataset
@dataclass(frozen=True)
class BadSample:
    """Placeholder a dataset returns for an unreadable image (filtered out by :func:`collate`)."""

    path: str
    error: str


class ImageFolderDataset(Dataset):
    """``(path, label)`` samples decoded with :func:`load_image` and transformed.

    ``__getitem__`` returns ``(image, label, index)``, or a :class:`BadSample` for a file that
    cannot be decoded (raises :class:`BadImageError` instead when ``strict``).

    Args:
        samples: ``(path, class index)`` pairs, e.g. from :func:`list_split`.
        classes: class names, index order.
        transform: PIL image -> tensor.
        strict: stop at the first unreadable image instead of skipping it.
    """

    def __init__(
        self,
        samples: Sequence[tuple[str, int]],
        classes: Sequence[str],
        transform: Callable | None = None,
        strict: bool = False,
    ) -> None:
        self.samples = list(samples)
        self.classes = list(classes)
        self.transform = transform
        self.strict = strict

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, item: int | tuple[int, int]):
        """``item``: an index, or ``(index, seed)`` from :class:`SeededSampler`, which seeds python,
        numpy and torch first so the sample's augmentation depends on the seed alone (not on which
        loader worker draws it, nor on what that worker drew before)."""
        index, seed = item if isinstance(item, tuple) else (item, None)
        path, label = self.samples[index]
        try:
            img = load_image(path)
        except BadImageError as err:
            if self.strict:
                raise BadImageError(f"{err} (run without --strict to skip unreadable images)") from None
            return BadSample(path, str(err))
        if seed is not None:
            seed_all(seed)
        return (self.transform(img) if self.transform else img), label, index


@dataclass
class Batch:
    """A collated batch: images ``(B, 3, H, W)``, labels ``(B,)``, dataset indices ``(B,)`` and the
    paths of the samples that were skipped because they could not be read."""

    images: torch.Tensor | None
    labels: torch.Tensor | None
    indices: torch.Tensor | None
    bad: list[str]

    def __len__(self) -> int:
        return 0 if self.labels is None else len(self.labels)


def collate(items: list) -> Batch:
    """Stack the good samples and keep the paths of the bad ones."""
    good = [it for it in items if not isinstance(it, BadSample)]
    bad = [it.path for it in items if isinstance(it, BadSample)]
    if not good:
        return Batch(None, None, None, bad)
    return Batch(
        torch.stack([g[0] for g in good]),
        torch.tensor([g[1] for g in good], dtype=torch.long),
        torch.tensor([g[2] for g in good], dtype=torch.long),
        bad,
    )


# ------------------------------------------------------------------------------------ transforms
def build_transform(
    img_size: int,
    training: bool,
    *,
    auto_augment: str | None = "rand-m9-mstd0.5-inc1",
    interpolation: str = "bicubic",
    re_prob: float = 0.25,
    crop_pct: float = 0.875,
    hflip: float = 0.5,
    scale: tuple[float, float] = (0.08, 1.0),
    color_jitter: float = 0.4,
    mean: Sequence[float] = IMAGENET_DEFAULT_MEAN,
    std: Sequence[float] = IMAGENET_DEFAULT_STD,
) -> Callable:
    """timm's train (RandomResizedCrop, flip, RandAugment, random erasing) or eval (resize, center
    crop) transform, PIL image -> normalised tensor ``(3, img_size, img_size)``."""
    if training:
        return _pillow_safe(create_transform(
            img_size,
            is_training=True,
            auto_augment=auto_augment or None,
            interpolation=interpolation,
            re_prob=re_prob,
            re_mode="pixel",
            re_count=1,
            hflip=hflip,
            scale=scale,
            color_jitter=color_jitter,
            mean=tuple(mean),
            std=tuple(std),
        ))
    return create_transform(
        img_size, is_training=False, interpolation=interpolation, crop_pct=crop_pct, mean=tuple(mean), std=tuple(std)
    )


def _posterize_any_bits(img: Image.Image, bits_to_keep: int, **_) -> Image.Image:
    """Posterize that keeps 0 bits as older Pillow did (a black image); Pillow >= 10 raises instead."""
    if bits_to_keep >= 8:
        return img
    if bits_to_keep <= 0:
        return img.point(lambda _: 0)
    return ImageOps.posterize(img, bits_to_keep)


def _pillow_safe(transform: Callable) -> Callable:
    """Patch the RandAugment ops of a timm transform (this instance only) so ``PosterizeIncreasing``
    at the top magnitude (``rand-m9-mstd0.5-inc1`` reaches it) does not raise on current Pillow."""
    for t in getattr(transform, "transforms", []):
        for op in getattr(t, "ops", []):
            if getattr(op, "aug_fn", None) is posterize:
                op.aug_fn = _posterize_any_bits
    return transform


# -------------------------------------------------------------------------------------- samplers
def epoch_seed(seed: int, epoch: int, rank: int = 0, stream: int = 0) -> int:
    """A 63-bit seed derived from ``(seed, epoch, rank, stream)``, so each epoch's data order and
    augmentation can be replayed exactly after a resume."""
    return int(np.random.SeedSequence([seed, epoch, rank, stream]).generate_state(2, np.uint64)[0] >> 1)


def seed_all(seed: int) -> None:
    """Seed python's ``random``, numpy's global generator and torch's (CPU, and CUDA once started).

    Cheap enough to call per sample: unlike ``torch.manual_seed`` it does not queue a CUDA seeding
    call (with a captured stack trace) while CUDA is not initialised.
    """
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.default_generator.manual_seed(seed)
    if torch.cuda.is_initialized():
        torch.cuda.manual_seed_all(seed)


class SeededSampler(Sampler[tuple[int, int]]):
    """Wraps a training sampler to yield ``(index, seed)``: the seed of the sample at position ``p``
    of epoch ``e`` on rank ``r`` is a function of ``(seed, e, r, p)``, so augmentation does not depend
    on the worker count, and a resumed epoch can start at any position (``start``) without replaying
    the batches before it.

    Args:
        inner: the sampler that chooses the indices (``set_epoch`` is forwarded).
        seed: the run's seed.
        rank: this process's rank.
    """

    def __init__(self, inner: Sampler[int], seed: int, rank: int = 0) -> None:
        self.inner, self.seed, self.rank = inner, seed, rank
        self.epoch = 0
        self.start = 0  # positions of this epoch already trained on

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        if hasattr(self.inner, "set_epoch"):
            self.inner.set_epoch(epoch)

    def __iter__(self):
        base = epoch_seed(self.seed, self.epoch, self.rank, stream=4)
        for pos, index in enumerate(self.inner):
            if pos >= self.start:
                yield index, (base + pos) % 2**63

    def __len__(self) -> int:
        return max(len(self.inner) - self.start, 0)


class EpochRandomSampler(Sampler[int]):
    """A shuffle of the whole dataset drawn from ``(seed, epoch)``; ``set_epoch`` like
    ``DistributedSampler``."""

    def __init__(self, n: int, seed: int = 0) -> None:
        self.n, self.seed, self.epoch = n, seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        g = torch.Generator().manual_seed(epoch_seed(self.seed, self.epoch, stream=1))
        return iter(torch.randperm(self.n, generator=g).tolist())

    def __len__(self) -> int:
        return self.n


class _SeededRepeatAug(Sampler[int]):
    """timm's ``RepeatAugSampler`` (DeiT's repeated augmentation), whose own shuffle is seeded by
    the epoch alone, re-keyed here by the run's seed too."""

    def __init__(self, dataset, world: int, rank: int, repeats: int, seed: int) -> None:
        self.inner = RepeatAugSampler(dataset, num_replicas=world, rank=rank, shuffle=True, num_repeats=repeats)
        self.seed = seed

    def set_epoch(self, epoch: int) -> None:
        self.inner.set_epoch(epoch_seed(self.seed, epoch, stream=2))

    def __iter__(self):
        return iter(self.inner)

    def __len__(self) -> int:
        return len(self.inner)


def train_sampler(dataset, world: int, rank: int, seed: int, aug_repeats: int) -> SeededSampler:
    """Repeated augmentation across processes when ``aug_repeats > 1`` and ``world > 1`` (DeiT),
    ``DistributedSampler`` for several processes, a seeded shuffle for one; wrapped in
    :class:`SeededSampler`."""
    if world > 1 and aug_repeats > 1:
        inner = _SeededRepeatAug(dataset, world, rank, aug_repeats, seed)
    elif world > 1:
        inner = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=seed, drop_last=False)
    else:
        inner = EpochRandomSampler(len(dataset), seed)
    return SeededSampler(inner, seed, rank)


class PaddedEvalSampler(Sampler[int]):
    """Rank ``rank``'s share of ``0..n-1`` in order, padded with repeats so every rank gets the same
    count (as ``DistributedSampler``); the padding is dropped again by index after gathering."""

    def __init__(self, n: int, world: int, rank: int) -> None:
        self.n, self.world, self.rank = n, world, rank
        self.per_rank = math.ceil(n / world) if n else 0

    def __iter__(self):
        total = self.per_rank * self.world
        idx = [i % self.n for i in range(total)] if self.n else []
        return iter(idx[self.rank : total : self.world])

    def __len__(self) -> int:
        return self.per_rank


def _worker_init(worker_id: int) -> None:
    # torch seeds python's random and itself per worker from the loader's generator; numpy too:
    np.random.seed(torch.initial_seed() % 2**32)


def make_loader(
    dataset: Dataset,
    batch_size: int,
    sampler: Sampler,
    workers: int,
    *,
    drop_last: bool = False,
    pin_memory: bool = False,
    generator: torch.Generator | None = None,
) -> DataLoader:
    """A DataLoader with :func:`collate` and per-worker numpy seeding."""
    return DataLoader(
        dataset,
        batch_size=batch_size,
        sampler=sampler,
        num_workers=workers,
        collate_fn=collate,
        drop_last=drop_last,
        pin_memory=pin_memory,
        worker_init_fn=_worker_init if workers > 0 else None,
        generator=generator,
        persistent_workers=False,
    )


def eval_sampler(dataset, world: int, rank: int) -> Sampler:
    """In-order sampler for evaluation: plain for one process, padded shares for several."""
    return PaddedEvalSampler(len(dataset), world, rank) if world > 1 else SequentialSampler(dataset)


__all__ = [
    "BadImageError",
    "Batch",
    "MAX_IMAGE_PIXELS",
    "ImageFolderDataset",
    "EpochRandomSampler",
    "PaddedEvalSampler",
    "SeededSampler",
    "build_transform",
    "check_folder",
    "check_layout",
    "collate",
    "epoch_seed",
    "eval_sampler",
    "list_split",
    "load_image",
    "make_loader",
    "seed_all",
    "to_rgb",
    "train_sampler",
]
