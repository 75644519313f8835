"""Real images for the precision check: sample photos shipped with the installed libraries, and
CIFAR-10 from its JPEG tarball or folder, preprocessed for the model (bicubic resize, ImageNet
normalisation)."""

from __future__ import annotations

import tarfile
import tempfile
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torch import nn

from ..variants import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
from .optional import matplotlib_sample_photo, skimage_photo

#: scikit-image's sample photos used (plus matplotlib's grace_hopper.jpg).
SKIMAGE_PHOTOS = ("astronaut", "coffee", "chelsea", "rocket", "hubble_deep_field", "immunohistochemistry",
                  "retina", "colorwheel")


def to_model_input(arr: np.ndarray, size: tuple[int, int]) -> torch.Tensor:
    """uint8 ``(H, W[, C])`` array to a normalised ``(3, *size)`` tensor (bicubic resize, ImageNet mean/std)."""
    a = np.asarray(arr)
    if a.ndim == 2:
        a = np.stack([a] * 3, -1)
    x = torch.from_numpy(np.array(a[..., :3])).permute(2, 0, 1).float()[None] / 255.0  # (1, 3, H, W)
    x = nn.functional.interpolate(x, size=size, mode="bicubic", align_corners=False).clamp_(0, 1)[0]
    mean = torch.tensor(IMAGENET_DEFAULT_MEAN)[:, None, None]
    std = torch.tensor(IMAGENET_DEFAULT_STD)[:, None, None]
    return (x - mean) / std


def sample_photos(
    size: tuple[int, int], cifar: str | Path | None = None, per_class: int = 20
) -> dict[str, torch.Tensor]:
    """Real photographs shipped with the installed libraries, preprocessed for the model.

    ``photos``: scikit-image's sample photos plus matplotlib's grace_hopper.jpg, ``(9, 3, *size)``.
    With ``cifar`` (the CIFAR-10 JPEG tarball or its extracted ``cifar10`` folder) also the keys of
    :func:`load_cifar`.
    """
    photos = [to_model_input(skimage_photo(n), size) for n in SKIMAGE_PHOTOS]
    photos.append(to_model_input(matplotlib_sample_photo("grace_hopper.jpg"), size))
    out = {"photos": torch.stack(photos)}
    if cifar:
        out.update(load_cifar(cifar, size, per_class))
    return out


def load_cifar(path: str | Path, size: tuple[int, int], per_class: int = 20) -> dict[str, torch.Tensor]:
    """``per_class`` CIFAR-10 images of each class from the JPEG tarball or its extracted folder.

    Returns ``cifar`` / ``cifar_labels`` (test images ``(N, 3, *size)``, labels ``(N,)``) and
    ``train`` / ``train_labels`` (as many train images: the linear probe and the int8 calibration
    use these, never the test images).
    """
    root = Path(path)
    if not root.exists():
        raise FileNotFoundError(f"CIFAR-10 not found at {root}: give the JPEG tarball or its extracted folder")
    with tempfile.TemporaryDirectory() as tmp:
        if root.is_file():
            root = _extract_first(root, Path(tmp), per_class)
        out = {}
        for split, key in (("test", "cifar"), ("train", "train")):
            out[key], out[f"{key}_labels"] = _load_split(root / split, size, per_class)
    return out


def _extract_first(tarball: Path, dest: Path, per_class: int) -> Path:
    """Extract the first ``per_class`` JPEGs of each class folder; returns the extracted top folder."""
    with tarfile.open(tarball) as tar:
        keep = [m for m in tar.getmembers() if m.name.endswith(".jpg")
                and int(Path(m.name).stem) < per_class]  # files are numbered 0000.jpg... per class
        tar.extractall(dest, members=keep, filter="data")
    return next(dest.glob("*"))


def _load_split(folder: Path, size: tuple[int, int], per_class: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Images ``(N, 3, *size)`` and labels ``(N,)`` of one split folder with 10 class sub-folders."""
    classes = sorted(d.name for d in folder.iterdir() if d.is_dir())
    if len(classes) != 10:
        raise ValueError(f"expected 10 class folders under {folder}, found {len(classes)}")
    imgs, labels = [], []
    for label, cls in enumerate(classes):
        for f in sorted((folder / cls).glob("*.jpg"))[:per_class]:
            imgs.append(to_model_input(np.array(Image.open(f).convert("RGB")), size))
            labels.append(label)
    return torch.stack(imgs), torch.tensor(labels)
