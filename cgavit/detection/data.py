"""COCO-format detection data for torchvision's detectors.

:class:`CocoDetection` serves ``(image, target)`` pairs of a file :func:`~.annotations.check_coco`
has checked, in the form torchvision's RetinaNet and Mask R-CNN take (boxes ``xyxy`` in pixels,
contiguous labels ``1..K``, binary masks). Every image is read through the package's one opener,
:mod:`cgavit.images`, which never opens a pipe or device and refuses an image too large to decode
before decoding it.

Loader workers hand a failed read back as an :class:`UnreadableItem` (see :class:`Guarded` and
:func:`batches`), so the main process raises it as the one-line error it is rather than wrapped in
the worker's traceback.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from PIL import Image
from torchvision import tv_tensors
from torchvision.transforms import v2

from ..images import BadImageError, decode, open_image
from ..io import DataError, UnreadableFileError
from ..train.data.samplers import seed_all
from .annotations import CocoCheck
from .coco import decode_masks, segmentation_rle, xyxy_boxes

if TYPE_CHECKING:
    from .coco import COCO


def train_transform(hflip: float = 0.5) -> v2.Transform | None:
    """Training augmentation of the 1x schedule: random horizontal flip with probability ``hflip``
    (boxes and masks follow); None when ``hflip`` is 0."""
    if not 0.0 <= hflip <= 1.0:
        raise ValueError(f"the flip probability (--hflip) must be in [0, 1], got {hflip}")
    return v2.RandomHorizontalFlip(hflip) if hflip > 0 else None


class CocoDetection(torch.utils.data.Dataset):
    """COCO-format images and instances for torchvision's detectors.

    Item ``i`` is ``(image, target)``: ``image`` a float ``(3, H, W)`` tensor in [0, 1] (the model
    normalises and resizes), ``target`` a dict with ``boxes`` ``(N, 4)`` xyxy pixels, ``labels``
    ``(N,)`` in 1..K (the order of :attr:`categories`), ``image_id``, and with ``masks=True`` also
    ``masks`` ``(N, H, W)`` uint8. Crowd annotations are left out of training targets (COCOeval
    uses them from the annotation file).

    Args:
        check: result of :func:`~.annotations.check_coco`.
        image_dir: image folder.
        masks: include instance masks.
        transforms: a torchvision ``v2`` transform applied to ``(image, target)``.

    Reading an item raises :class:`~cgavit.io.DataError` naming the
    image when it cannot be read.
    """

    def __init__(self, check: CocoCheck, image_dir: str | Path, masks: bool = False, transforms: v2.Transform | None = None) -> None:
        self.coco = check.coco()
        self.check = check
        self.categories = check.categories
        self.cat_to_label = {cid: i + 1 for i, (cid, _) in enumerate(check.categories)}
        self.image_dir = Path(image_dir)
        self.ids = sorted(self.coco.imgs)
        self.masks = masks
        self.transforms = transforms

    def __len__(self) -> int:
        return len(self.ids)

    def ground_truth(self) -> COCO:
        """The index COCOeval scores this dataset's detections against: :attr:`coco` and the entries the check left
        out (:meth:`~.annotations.CocoCheck.ground_truth`), which count as missed."""
        return self.check.ground_truth() if any(self.check.left_out.values()) else self.coco

    def load_image(self, image_id: int) -> Image.Image:
        """The RGB image of ``image_id``, checked against the size the annotation file gives it.

        Raises:
            DataError: the image cannot be read (:class:`~cgavit.images.BadImageError`: missing, a
                pipe, not an image, damaged, truncated, too large) or is not of the annotated size;
                the message names the image id and the file.
        """
        info = self.coco.imgs[image_id]
        path = self.image_dir / info["file_name"]
        try:
            img, size = open_image(path)
            with img:
                if "width" in info and "height" in info and size != (info["width"], info["height"]):
                    raise DataError(
                        f"image {path} is {size[0]}x{size[1]} but the annotation file says {info['width']}x{info['height']}; "
                        "fix the file's width/height entries"
                    )
                return decode(img, f"image {path}")
        except DataError as err:
            raise DataError(f"image {image_id}: {err}") from None

    def __getitem__(self, item: int | tuple[int, int]) -> tuple[torch.Tensor, dict[str, Any]]:
        """``item``: an index, or ``(index, seed)`` as a :class:`~cgavit.train.data.SeededSampler` gives them in
        training: the random generators are then seeded with ``seed`` before the image is read, so its flip is the
        same whichever loader worker reads it, and in a resumed epoch too."""
        index, seed = item if isinstance(item, tuple) else (item, None)
        if seed is not None:
            seed_all(seed)
        image_id = self.ids[index]
        img = self.load_image(image_id)
        w, h = img.size
        anns = [a for a in self.coco.imgToAnns.get(image_id, []) if not a.get("iscrowd", 0)]
        boxes = torch.from_numpy(xyxy_boxes([a["bbox"] for a in anns], w, h))  # (N, 4), as the check judged them
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


@dataclass(frozen=True)
class UnreadableItem:
    """What a loader worker hands back for an item it could not read: the error's message, raised
    again by :func:`batches` in the main process."""

    message: str


class Guarded(torch.utils.data.Dataset):
    """``dataset`` for a ``DataLoader`` whose batches go through :func:`batches`: an item that cannot
    be read becomes an :class:`UnreadableItem`, so the loop stops with the item's own one-line
    :class:`~cgavit.images.BadImageError`, whichever process read it."""

    def __init__(self, dataset: torch.utils.data.Dataset) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> Any:
        try:
            return self.dataset[index]
        except (DataError, UnreadableFileError) as err:
            return UnreadableItem(str(err))


def collate(batch: list) -> tuple | UnreadableItem:
    """Detection batches are lists: ``(images, targets)``; a batch with an unreadable item is that item."""
    failed = [item for item in batch if isinstance(item, UnreadableItem)]
    return failed[0] if failed else tuple(zip(*batch))


def batches(loader: Iterable) -> Iterator[tuple]:
    """The batches of a loader over a :class:`Guarded` dataset.

    Raises:
        BadImageError: an image could not be read (the message names it); under several processes the caller
            shares it with the other ranks (:func:`~cgavit.train.data.until_unreadable`).
    """
    for batch in loader:
        if isinstance(batch, UnreadableItem):
            raise BadImageError(f"{batch.message}; fix or remove it from the annotation file")
        yield batch
