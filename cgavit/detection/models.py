"""RetinaNet and Mask R-CNN (torchvision) on an EfficientViT + FPN backbone, as in the paper.

The detectors, heads, losses, box coding and resizing are torchvision's; this module only builds the
backbone, the anchor generator and the RoI poolers for its five pyramid levels. ``num_classes``
follows torchvision: it counts the background class 0, so a dataset with K categories needs K + 1.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torchvision.models.detection import MaskRCNN, RetinaNet
from torchvision.models.detection.anchor_utils import AnchorGenerator
from torchvision.ops import MultiScaleRoIAlign

from .backbone import EfficientViTFPN, detection_body

KINDS = ("retinanet", "maskrcnn")
ASPECT_RATIOS = (0.5, 1.0, 2.0)


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

    def forward(self, image_list, feature_maps: list[torch.Tensor]) -> list[torch.Tensor]:
        grid_sizes = [fm.shape[-2:] for fm in feature_maps]
        dtype, device = feature_maps[0].dtype, feature_maps[0].device
        strides = [[torch.tensor(s, dtype=torch.int64, device=device)] * 2 for s in self.strides]
        self.set_cell_anchors(dtype, device)
        per_level = self.grid_anchors(grid_sizes, strides)  # [(h*w*A, 4) per level]
        anchors = torch.cat(per_level)
        return [anchors for _ in image_list.image_sizes]


def retinanet(
    backbone: str = "efficientvit_m4",
    num_classes: int = 81,
    pretrained_backbone: str | os.PathLike | Mapping[str, torch.Tensor] | None = None,
    *,
    trust: bool = False,
    freeze_bn: bool = True,
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
        dials: design dials for the backbone (see :func:`cgavit.create_model`).
        min_size: shorter image side after torchvision's resize. Default 800.
        max_size: longest side cap. Default 1333.
        **kwargs: passed on to :class:`torchvision.models.detection.RetinaNet` (score_thresh,
            detections_per_img, ...).
    """
    body = detection_body(backbone, pretrained_backbone, trust, freeze_bn, **dict(dials or {}))
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
        dials: design dials for the backbone.
        min_size: shorter image side after torchvision's resize. Default 800.
        max_size: longest side cap. Default 1333.
        **kwargs: passed on to :class:`torchvision.models.detection.MaskRCNN` (rpn_* / box_* settings).
    """
    body = detection_body(backbone, pretrained_backbone, trust, freeze_bn, **dict(dials or {}))
    fpn = EfficientViTFPN(body, 256, num_up=2, num_down=0)
    anchors = PyramidAnchorGenerator(tuple((8 * s,) for s in fpn.strides), (ASPECT_RATIOS,) * len(fpn.strides), fpn.strides)
    roi_levels = list(fpn.level_names[:4])
    return MaskRCNN(
        fpn,
        num_classes,
        min_size=min_size,
        max_size=max_size,
        rpn_anchor_generator=anchors,
        box_roi_pool=MultiScaleRoIAlign(roi_levels, output_size=7, sampling_ratio=2),
        mask_roi_pool=MultiScaleRoIAlign(roi_levels, output_size=14, sampling_ratio=2),
        **kwargs,
    )


def build_detector(config: Mapping[str, Any], pretrained_backbone=None, trust: bool = False) -> nn.Module:
    """Build a detector from a plain config dict (as stored in cgavit detection checkpoints).

    Keys: ``kind`` (``retinanet`` | ``maskrcnn``), ``backbone``, ``num_classes``, optional
    ``freeze_bn`` (default True), ``dials``, ``min_size``, ``max_size`` and ``model_kwargs`` (torchvision settings).
    """
    kind = config.get("kind")
    if kind not in KINDS:
        raise ValueError(f"unknown detector kind {kind!r}; choose one of {', '.join(KINDS)}")
    build = retinanet if kind == "retinanet" else maskrcnn
    extra = dict(config.get("model_kwargs") or {})
    try:
        return build(
            config.get("backbone", "efficientvit_m4"),
            int(config["num_classes"]),
            pretrained_backbone,
            trust=trust,
            freeze_bn=bool(config.get("freeze_bn", True)),
            dials=config.get("dials") or {},
            min_size=int(config.get("min_size", 800)),
            max_size=int(config.get("max_size", 1333)),
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
