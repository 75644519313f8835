"""RetinaNet and Mask R-CNN (torchvision) on an EfficientViT + FPN backbone, as in the paper.

The detectors, heads, losses, box coding and resizing are torchvision's; this module only builds the
backbone, the anchor generator and the RoI poolers for its five pyramid levels. ``num_classes``
follows torchvision: it counts the background class 0, so a dataset with K categories needs K + 1.
"""

from __future__ import annotations

import difflib
import inspect
import logging
import math
import numbers
import os
from collections.abc import Mapping
from typing import Any, NamedTuple

import numpy as np
import torch
from numpy.typing import ArrayLike
from torch import nn
from torchvision.models.detection import MaskRCNN, RetinaNet
from torchvision.models.detection.anchor_utils import AnchorGenerator
from torchvision.models.detection.image_list import ImageList
from torchvision.models.detection.transform import GeneralizedRCNNTransform
from torchvision.ops import MultiScaleRoIAlign
from torchvision.ops.poolers import initLevelMapper

from ..bounds import IMG_SIZE_RANGE, MIN_INPUT_SIZE
from ..schema import shown
from .backbone import BACKBONE_LAYERS, BACKBONE_STRIDES, EfficientViTFPN, detection_body
from .schema import MAX_CATEGORIES, is_int

log = logging.getLogger(__name__)

KINDS = ("retinanet", "maskrcnn")
#: Settings torchvision's transform takes from its ``**kwargs`` (no parameter of its own to read them from).
TRANSFORM_KWARGS = ("_skip_resize",)
#: Detector arguments the builders below give torchvision themselves: options of their own, or the pyramid's parts.
BUILT_HERE = frozenset({"backbone", "num_classes", "min_size", "max_size", "trainable_backbone_layers", "anchor_generator",
                        "rpn_anchor_generator", "box_roi_pool", "mask_roi_pool"})
#: The :data:`BUILT_HERE` settings ``detect train`` has an option of its own for.
OWN_OPTIONS = ("min_size", "max_size", "trainable_backbone_layers")
ASPECT_RATIOS = (0.5, 1.0, 2.0)
#: torchvision pads the images of a batch to a multiple of this (GeneralizedRCNNTransform's size_divisible).
SIZE_DIVISIBLE = 32


class Resize(NamedTuple):
    """How the detectors resize and pad an image (torchvision's GeneralizedRCNNTransform, evaluating).

    Attributes:
        min_size, max_size: the shorter side goes to ``min_size`` unless the longer would exceed ``max_size``.
        size_divisible: each side of a batch is padded up to a multiple of this.
        fixed_size: ``(width, height)`` every image is resized to instead, or None.
    """

    min_size: int
    max_size: int
    size_divisible: int = SIZE_DIVISIBLE
    fixed_size: tuple[int, int] | None = None

    def resized(self, width: int, height: int) -> tuple[int, int]:
        """``(width, height)`` of a ``width x height`` image after the resize."""
        if self.fixed_size is not None:
            return int(self.fixed_size[0]), int(self.fixed_size[1])
        return resized_size(width, height, self.min_size, self.max_size)

    def padded(self, width: int, height: int) -> tuple[int, int]:
        """``(width, height)`` of the batch holding a ``width x height`` image alone: resized, then padded."""
        d = self.size_divisible
        w, h = self.resized(width, height)
        return math.ceil(w / d) * d, math.ceil(h / d) * d


def detector_resize(config: Mapping[str, Any]) -> Resize:
    """The :class:`Resize` of a detector config: its ``min_size`` and ``max_size`` (defaults 800 and 1333,
    torchvision's) and the ``size_divisible`` and ``fixed_size`` of its ``model_kwargs``."""
    settings = config.get("model_kwargs") or {}
    fixed = settings.get("fixed_size")
    return Resize(int(config.get("min_size", 800)), int(config.get("max_size", 1333)),
                  int(settings.get("size_divisible") or SIZE_DIVISIBLE), None if fixed is None else tuple(int(v) for v in fixed))


def resized_size(width: int, height: int, min_size: int, max_size: int) -> tuple[int, int]:
    """``(width, height)`` of an image after the detectors' resize: the shorter side to ``min_size``
    unless the longer would exceed ``max_size``, each side rounded down (torchvision's
    GeneralizedRCNNTransform)."""
    scale = min(min_size / min(width, height), max_size / max(width, height))
    return math.floor(width * scale), math.floor(height * scale)


def resize_problem(width: int, height: int, resize: Resize) -> str | None:
    """Why the detectors cannot run a ``width x height`` image alone in its batch, else None: its resize
    leaves a side of 0 pixels (``"too thin: ..."``), or the padded batch has a side under the
    backbone's :data:`~cgavit.bounds.MIN_INPUT_SIZE` (``size_divisible`` or ``fixed_size`` set small)."""
    w, h = resize.resized(width, height)
    if min(w, h) < 1:
        return (f"too thin: {width}x{height} px becomes {w}x{h} px at the detector's resize (shorter side to "
                f"{resize.min_size}, longer side at most {resize.max_size}); crop it to a side ratio under {resize.max_size}:1")
    pw, ph = resize.padded(width, height)
    if min(pw, ph) >= MIN_INPUT_SIZE:
        return None
    how = (f"resized to the fixed_size {w}x{h}" if resize.fixed_size is not None
           else f"resized to {w}x{h} px (shorter side to {resize.min_size}, longer side at most {resize.max_size})")
    return (f"too small: {width}x{height} px is {how} and padded to {pw}x{ph} (size_divisible {resize.size_divisible}), "
            f"and the backbone takes at least {MIN_INPUT_SIZE} px a side; crop it to a side ratio nearer 1:1, or give "
            f"the detector a larger {'fixed_size' if resize.fixed_size is not None else 'size_divisible'}")


def boxes_keep_area(xyxy: np.ndarray, widths: ArrayLike, heights: ArrayLike, resize: Resize | None = None) -> np.ndarray:
    """Which training boxes keep an area up to torchvision's check of them (it refuses a box with
    ``x1 <= x0`` or ``y1 <= y0`` mid-training): mirrored or not (the training augmentation) and, with
    the detector's ``resize`` (:class:`Resize`), resized as GeneralizedRCNNTransform resizes
    them, every step in float32 as torchvision computes it.

    Args:
        xyxy: ``(N, 4)`` float32 boxes (:func:`~.coco.xyxy_boxes`).
        widths, heights: ``(N,)`` sizes of their images in pixels.
        resize: ``(min_size, max_size)``, or None to judge them at the images' own size.

    Returns:
        ``(N,)`` bool.
    """
    widths, heights = np.asarray(widths).reshape(-1), np.asarray(heights).reshape(-1)
    mirrored = xyxy.copy()
    mirrored[:, [2, 0]] = -(xyxy[:, [0, 2]] - widths.astype(np.float32)[:, None])  # torchvision's horizontal flip
    boxes = [xyxy, mirrored]
    if resize is not None:
        new = np.array([resize.resized(w, h) for w, h in zip(widths.tolist(), heights.tolist())], dtype=np.float32)
        ratio = new.reshape(-1, 2) / np.stack([widths, heights], 1).astype(np.float32)  # (N, 2): x and y ratios
        boxes = [b * np.tile(ratio, 2) for b in boxes]  # torchvision's resize_boxes
    return np.logical_and.reduce([(b[:, 2] > b[:, 0]) & (b[:, 3] > b[:, 1]) for b in boxes])


def foreground(output: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """One image's detector output without its detections of label 0, the background. Mask R-CNN returns none;
    RetinaNet scores label 0 as one more class (an output that training only pushes down), whose detections are of
    no category: COCO's category ids are mapped to labels 1..K, and a dataset's category 0 is label 1."""
    keep = output["labels"] > 0
    return {k: v[keep] for k, v in output.items()}


def coarsest_map_size(width: int, height: int, resize: Resize) -> tuple[int, int]:
    """``(width, height)`` of the backbone's stride-64 map of an image alone in its batch: resized,
    padded (:meth:`Resize.padded`), each stride-2 step rounding up. BatchNorm that is trained cannot
    take a batch of one image whose map is 1x1 (one value per channel)."""
    stride = BACKBONE_STRIDES[-1]
    return tuple(math.ceil(s / stride) for s in resize.padded(width, height))


class PyramidAnchorGenerator(AnchorGenerator):
    """torchvision's ``AnchorGenerator`` with each level's stride given instead of inferred.

    torchvision infers a level's stride as ``padded image size // map size``, which is only exact when
    the padded size is a multiple of the coarsest stride (128 for RetinaNet here); otherwise anchors
    on the coarse levels drift away from the positions their features come from. With the strides
    known (the pyramid's), anchor ``i`` of a level sits at ``i * stride`` for any image size, as in
    mmdetection, and images need no extra padding.

    Args:
        sizes: anchor sizes per level (pixels).
        aspect_ratios: aspect ratios per level.
        strides: each level's stride in pixels.
    """

    def __init__(self, sizes: tuple[tuple[float, ...], ...], aspect_ratios: tuple[tuple[float, ...], ...], strides: tuple[int, ...]) -> None:
        super().__init__(sizes, aspect_ratios)
        if len(strides) != len(sizes):
            raise ValueError(f"one stride per level: {len(sizes)} levels, {len(strides)} strides")
        self.strides = tuple(int(s) for s in strides)

    def forward(self, image_list: ImageList, feature_maps: list[torch.Tensor]) -> list[torch.Tensor]:
        grid_sizes = [fm.shape[-2:] for fm in feature_maps]
        dtype, device = feature_maps[0].dtype, feature_maps[0].device
        strides = [[torch.tensor(s, dtype=torch.int64, device=device)] * 2 for s in self.strides]
        self.set_cell_anchors(dtype, device)
        per_level = self.grid_anchors(grid_sizes, strides)  # [(h*w*A, 4) per level]
        anchors = torch.cat(per_level)
        return [anchors for _ in image_list.image_sizes]


def detector_settings(kind: str) -> frozenset[str]:
    """The torchvision settings (``model_kwargs``, ``--model-arg``) a ``kind`` detector takes: its class's arguments
    and its transform's, but for :data:`BUILT_HERE`."""
    names = set(TRANSFORM_KWARGS)
    for cls in (RetinaNet if kind == "retinanet" else MaskRCNN, GeneralizedRCNNTransform):
        names |= {n for n, p in inspect.signature(cls.__init__).parameters.items()
                  if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and n != "self"}
    return frozenset(names - BUILT_HERE)


def unknown_settings(kind: str, settings: Mapping[str, Any]) -> str | None:
    """What is wrong with the names of ``settings`` for a ``kind`` detector, or None. torchvision hands names it does not
    know to its transform, which drops them: a misspelt setting would silently not take effect."""
    known = detector_settings(kind)
    for name in settings:
        if name in BUILT_HERE:
            return (f"{name} is set by cgavit itself, not a --model-arg setting"
                    + (f" (use --{name.replace('_', '-')})" if name in OWN_OPTIONS else ""))
        if name not in known:
            close = difflib.get_close_matches(name, sorted(known), n=1)
            cls = "RetinaNet" if kind == "retinanet" else "MaskRCNN"
            return (f"torchvision's {cls} takes no setting {name!r}" + (f"; did you mean {close[0]!r}?" if close else "")
                    + f" (help(torchvision.models.detection.{cls}) lists them)")
    return None


#: The settings taking lists, and what each list holds: ``(length, whole numbers, least value)``.
LIST_SETTINGS = {"image_mean": (3, False, 0.0), "image_std": (3, False, 1e-6), "bbox_reg_weights": (4, False, 1e-6),
                 "fixed_size": (2, True, 1)}


def _setting_defaults(kind: str) -> dict[str, Any]:
    """Each setting of a ``kind`` detector and its default in torchvision's signatures."""
    defaults: dict[str, Any] = {name: False for name in TRANSFORM_KWARGS}
    for cls in (RetinaNet if kind == "retinanet" else MaskRCNN, GeneralizedRCNNTransform):
        for name, p in inspect.signature(cls.__init__).parameters.items():
            defaults.setdefault(name, p.default)
    return {name: defaults.get(name) for name in detector_settings(kind)}


def bad_setting_value(name: str, value: Any, default: Any) -> str | None:
    """What is wrong with ``value`` for the torchvision setting ``name`` whose default is ``default``, or None (null
    is the default, always allowed). Thresholds and fractions are shares in [0, 1], counts whole numbers >= 1 (as
    their defaults are), lists those of :data:`LIST_SETTINGS`, and the settings that take a module none from here."""
    if value is None:
        return None
    if name in LIST_SETTINGS:
        n, whole, low = LIST_SETTINGS[name]
        items = value.tolist() if isinstance(value, np.ndarray) else value
        ok = isinstance(items, (list, tuple)) and len(items) == n and all(
            _finite(v) and (not whole or isinstance(v, numbers.Integral)) and v >= low for v in items)
        return None if ok else f"takes a list of {n} {'whole numbers' if whole else 'numbers'} >= {low:g}"
    if isinstance(default, bool):
        return None if isinstance(value, (bool, np.bool_)) else "takes true or false"
    number = _finite(value)
    if isinstance(default, int):
        ok = number and isinstance(value, numbers.Integral) and value >= 1
        return None if ok else "takes a whole number >= 1 (a count)"
    if isinstance(default, float):
        ok = number and (0 <= value <= 1 if name.endswith(("_thresh", "_fraction")) else True)
        return None if ok else ("takes a number in [0, 1]" if name.endswith(("_thresh", "_fraction")) else "takes a number")
    if isinstance(value, nn.Module) or callable(value):  # given in Python: torchvision's to judge
        return None
    return "takes a torchvision module, which only Python can give (build the detector there)"


def _finite(value: Any) -> bool:
    """Whether ``value`` is a finite real number (numpy's too; not a bool, nor an int too large for a float)."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def check_settings(kind: str, settings: Mapping[str, Any]) -> None:
    """Raise ``ValueError`` when a name in ``settings`` is not a setting of a ``kind`` detector (:func:`unknown_settings`)
    or its value is not one the setting takes (:func:`bad_setting_value`): checked before training, where a wrong
    type failed only at the first evaluation, a whole epoch later, and ``detections_per_img=-1`` dropped each
    image's last detection."""
    problem = unknown_settings(kind, settings)
    if problem:
        raise ValueError(f"detector setting (--model-arg): {problem}")
    defaults = _setting_defaults(kind)
    for name, value in settings.items():
        problem = bad_setting_value(name, value, defaults[name])
        if problem:
            raise ValueError(f"detector setting (--model-arg) {name}={shown(value)}: {name} {problem}")


def check_detector_args(num_classes: Any, min_size: Any, max_size: Any, *, several_min_sizes: bool = True) -> None:
    """Raise ``ValueError`` unless ``num_classes`` is an integer in 2..:data:`~.schema.MAX_CATEGORIES` + 1 (it counts
    the background class 0: K categories need K + 1) and ``min_size`` and ``max_size`` integers in
    :data:`~cgavit.bounds.IMG_SIZE_RANGE` pixels (with ``several_min_sizes``, ``min_size`` may be a list of them, one
    drawn per training image as torchvision does). Checked as the detector is built: num_classes 0 failed only at
    its first image, in a convolution, and min_size 0 in the resize."""
    if not (is_int(num_classes) and 2 <= num_classes <= MAX_CATEGORIES + 1):
        raise ValueError(f"'num_classes' must be an integer in 2..{MAX_CATEGORIES + 1} (it counts the background class 0: "
                         f"a dataset of K categories needs K + 1), got {shown(num_classes)}")
    low, high = IMG_SIZE_RANGE
    for key, value in (("min_size", min_size), ("max_size", max_size)):
        several = several_min_sizes and key == "min_size" and isinstance(value, (list, tuple)) and value
        values = value if several else [value]
        if not all(is_int(v) and low <= v <= high for v in values):
            raise ValueError(f"'{key}' must be an integer in {low}..{high} (pixels), got {shown(value)}")


class PyramidRoIAlign(MultiScaleRoIAlign):
    """torchvision's ``MultiScaleRoIAlign`` with each level's stride given instead of inferred.

    torchvision infers the levels' scales once, from the first batch it pools, as
    ``2 ** round(log2(map size / image size))``: when padding to a multiple of 32 stretches that batch's
    images by more than sqrt(2) (a resized side of 33-45 or 65-67 px), every scale comes out twice its
    value, and stays so for every later image. The pyramid's strides are known.

    Args:
        featmap_names: the pyramid levels to pool from, finest first.
        strides: their strides in pixels (powers of two).
        output_size: the pooled size.
        sampling_ratio: RoIAlign's sampling ratio.
    """

    def __init__(self, featmap_names: list[str], strides: tuple[int, ...], output_size: int, sampling_ratio: int) -> None:
        super().__init__(featmap_names, output_size=output_size, sampling_ratio=sampling_ratio)
        if len(strides) != len(featmap_names):
            raise ValueError(f"one stride per level: {len(featmap_names)} levels, {len(strides)} strides")
        self.scales = [1.0 / s for s in strides]
        self.map_levels = initLevelMapper(round(math.log2(strides[0])), round(math.log2(strides[-1])),
                                          canonical_scale=self.canonical_scale, canonical_level=self.canonical_level)


def retinanet(
    backbone: str = "efficientvit_m4",
    num_classes: int = 81,
    pretrained_backbone: str | os.PathLike | Mapping[str, torch.Tensor] | None = None,
    *,
    trust: bool = False,
    freeze_bn: bool = True,
    trainable_backbone_layers: int | None = None,
    dials: Mapping[str, Any] | None = None,
    min_size: int = 800,
    max_size: int = 1333,
    **kwargs,
) -> RetinaNet:
    """torchvision RetinaNet with an EfficientViT backbone and the paper's FPN.

    Pyramid levels p3..p7 (strides 8, 16, 32, 64, 128; 256 channels): the backbone's three stage maps,
    one transposed-conv level at stride 8, one conv level at stride 128. Anchors as in RetinaNet:
    sizes ``4 * stride * 2**(i/3)``, i = 0, 1, 2, aspect ratios 0.5, 1, 2 (9 per position).

    Args:
        backbone: ``efficientvit_m0`` ... ``efficientvit_m5`` (paper: M4).
        num_classes: classes including background (COCO: 81 with contiguous labels).
        pretrained_backbone: ImageNet checkpoint (any supported format), ``"imagenet"`` to download
            the official release, or None (random). See :func:`~cgavit.detection.backbone.detection_body`.
        trust: allow pickled objects in the checkpoint file.
        freeze_bn: frozen BatchNorm in the backbone (paper; needs ImageNet weights to make sense).
            False trains it, for random backbones.
        trainable_backbone_layers: how many of the backbone's four parts train, from the last (stage 3, stage 2,
            stage 1, the patch embedding), as torchvision's argument of that name counts ResNet's five: 0..4; None
            (torchvision's default spelling) or 4 trains all, as the paper. The others are frozen, BatchNorm included (see
            :func:`~cgavit.detection.backbone.freeze_backbone_layers`).
        dials: design dials for the backbone (see :func:`cgavit.create_model`).
        min_size: shorter image side after torchvision's resize. Default 800.
        max_size: longest side cap. Default 1333.
        **kwargs: passed on to :class:`torchvision.models.detection.RetinaNet` (score_thresh,
            detections_per_img, ...).
    """
    check_detector_args(num_classes, min_size, max_size)
    check_settings("retinanet", kwargs)
    layers = BACKBONE_LAYERS if trainable_backbone_layers is None else trainable_backbone_layers  # torchvision's None
    body = detection_body(backbone, pretrained_backbone, trust, freeze_bn, trainable_layers=layers, **dict(dials or {}))
    fpn = EfficientViTFPN(body, 256, num_up=1, num_down=1)
    anchors = PyramidAnchorGenerator(
        tuple(tuple(4 * s * 2 ** (i / 3) for i in range(3)) for s in fpn.strides),
        (ASPECT_RATIOS,) * len(fpn.strides),
        fpn.strides,
    )
    return RetinaNet(fpn, num_classes, min_size=min_size, max_size=max_size, anchor_generator=anchors, **kwargs)


def maskrcnn(
    backbone: str = "efficientvit_m4",
    num_classes: int = 81,
    pretrained_backbone: str | os.PathLike | Mapping[str, torch.Tensor] | None = None,
    *,
    trust: bool = False,
    freeze_bn: bool = True,
    trainable_backbone_layers: int | None = None,
    dials: Mapping[str, Any] | None = None,
    min_size: int = 800,
    max_size: int = 1333,
    **kwargs,
) -> MaskRCNN:
    """torchvision Mask R-CNN with an EfficientViT backbone and the paper's FPN.

    Pyramid levels p2..p6 (strides 4, 8, 16, 32, 64; 256 channels): two transposed-conv levels below
    the backbone's three. RPN anchors ``8 * stride`` (32..512 px), ratios 0.5, 1, 2; box RoIAlign 7x7
    and mask RoIAlign 14x14 over p2..p5 (the RPN sees all five).

    Args:
        backbone: ``efficientvit_m0`` ... ``efficientvit_m5`` (paper: M4).
        num_classes: classes including background (COCO: 81 with contiguous labels).
        pretrained_backbone: ImageNet checkpoint, ``"imagenet"``, or None (see :func:`retinanet`).
        trust: allow pickled objects in the checkpoint file.
        freeze_bn: frozen BatchNorm in the backbone (see :func:`retinanet`).
        trainable_backbone_layers: backbone parts that train, from the last: 0..4, None for all (see :func:`retinanet`).
        dials: design dials for the backbone.
        min_size: shorter image side after torchvision's resize. Default 800.
        max_size: longest side cap. Default 1333.
        **kwargs: passed on to :class:`torchvision.models.detection.MaskRCNN` (rpn_* / box_* settings).
    """
    check_detector_args(num_classes, min_size, max_size)
    check_settings("maskrcnn", kwargs)
    layers = BACKBONE_LAYERS if trainable_backbone_layers is None else trainable_backbone_layers  # torchvision's None
    body = detection_body(backbone, pretrained_backbone, trust, freeze_bn, trainable_layers=layers, **dict(dials or {}))
    fpn = EfficientViTFPN(body, 256, num_up=2, num_down=0)
    anchors = PyramidAnchorGenerator(tuple((8 * s,) for s in fpn.strides), (ASPECT_RATIOS,) * len(fpn.strides), fpn.strides)
    roi_levels, roi_strides = list(fpn.level_names[:4]), tuple(fpn.strides[:4])
    return MaskRCNN(
        fpn,
        num_classes,
        min_size=min_size,
        max_size=max_size,
        rpn_anchor_generator=anchors,
        box_roi_pool=PyramidRoIAlign(roi_levels, roi_strides, output_size=7, sampling_ratio=2),
        mask_roi_pool=PyramidRoIAlign(roi_levels, roi_strides, output_size=14, sampling_ratio=2),
        **kwargs,
    )


def build_detector(config: Mapping[str, Any], pretrained_backbone=None, trust: bool = False) -> nn.Module:
    """Build a detector from a plain config dict (as stored in cgavit detection checkpoints).

    Keys: ``kind`` (``retinanet`` | ``maskrcnn``), ``backbone``, ``num_classes``, optional
    ``freeze_bn`` (default True), ``trainable_backbone_layers`` (default 4), ``dials``, ``min_size``, ``max_size`` and
    ``model_kwargs`` (torchvision settings).
    """
    kind = config.get("kind")
    if kind not in KINDS:
        raise ValueError(f"unknown detector kind {kind!r}; choose one of {', '.join(KINDS)}")
    build = retinanet if kind == "retinanet" else maskrcnn
    extra = dict(config.get("model_kwargs") or {})
    for name in list(extra):  # a file from before names were checked: such a setting never took effect
        problem = unknown_settings(kind, {name: None})
        if problem:
            log.warning("left out the detector setting %s=%r, which never took effect: %s", name, extra.pop(name), problem)
    min_size, max_size = detector_resize(config)[:2]
    try:
        return build(
            config.get("backbone", "efficientvit_m4"),
            int(config["num_classes"]),
            pretrained_backbone,
            trust=trust,
            freeze_bn=bool(config.get("freeze_bn", True)),
            trainable_backbone_layers=config.get("trainable_backbone_layers", BACKBONE_LAYERS),
            dials=config.get("dials") or {},
            min_size=min_size,
            max_size=max_size,
            **extra,
        )
    except TypeError as err:
        if not extra:
            raise
        cls = "RetinaNet" if kind == "retinanet" else "MaskRCNN"
        raise ValueError(
            f"torchvision's {cls} does not accept the settings {sorted(extra)} ({err}); see "
            f"help(torchvision.models.detection.{cls}) for the names"
        ) from None
