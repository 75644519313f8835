"""Image-folder data for training and evaluation, one module per job:

- :mod:`.layout`: the ``DIR/train/<class>/`` layout: :func:`list_split`, :func:`check_layout`, and
  :func:`unreadable_classes` (a class none of whose images can be read stops a run before it trains);
- :mod:`.transforms`: timm's train and eval transforms (:func:`build_transform`);
- :mod:`.samplers`: keyed seeds (:func:`epoch_seed`, :func:`seed_all`) and samplers whose order and
  augmentation replay exactly after a resume (:func:`train_sampler`, :func:`eval_sampler`);
- :mod:`.loaders`: :class:`ImageFolderDataset`, :class:`Batch` and :func:`make_loader`, which skip
  (and count) unreadable images.

Images are opened by :mod:`cgavit.images` (the package's one opener); its :func:`load_image`,
:func:`to_rgb` and :class:`BadImageError` are re-exported here for the loaders' users.
"""

from ...images import BadImageError, load_image, to_rgb
from .layout import (
    IMAGE_EXTENSIONS, check_folder, check_layout, check_split_name, list_split, split_fingerprint, unreadable_classes,
)
from .loaders import Batch, BadSample, ImageFolderDataset, collate, make_loader, until_unreadable
from .samplers import EpochRandomSampler, PaddedEvalSampler, SeededSampler, epoch_seed, eval_sampler, seed_all, train_sampler
from .transforms import build_transform, load_transformed

__all__ = [
    "IMAGE_EXTENSIONS",
    "BadImageError",
    "BadSample",
    "Batch",
    "EpochRandomSampler",
    "ImageFolderDataset",
    "PaddedEvalSampler",
    "SeededSampler",
    "build_transform",
    "check_folder",
    "check_layout",
    "check_split_name",
    "collate",
    "epoch_seed",
    "eval_sampler",
    "list_split",
    "load_image",
    "load_transformed",
    "make_loader",
    "seed_all",
    "split_fingerprint",
    "to_rgb",
    "train_sampler",
    "unreadable_classes",
    "until_unreadable",
]
