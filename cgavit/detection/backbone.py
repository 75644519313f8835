"""EfficientViT as a detection backbone: frozen BatchNorm, 7x7 windows, FPN with up-sampled levels.

The paper's detection setup (official ``EfficientViTFPN`` for mmdetection): the three stage maps at
strides 16/32/64 feed an FPN with 256 channels; ``num_up`` chained 2x2 stride-2 transposed
convolutions (each followed by a 3x3 conv) add finer levels at strides 8 (RetinaNet) and 4 (Mask
R-CNN); RetinaNet adds one coarser level with a 3x3 stride-2 conv on the last backbone map. Five
levels either way. The FPN itself is torchvision's :class:`~torchvision.ops.FeaturePyramidNetwork`;
the extra levels are one :class:`~torchvision.ops.feature_pyramid_network.ExtraFPNBlock`.
"""

from __future__ import annotations

import logging
import os
from collections import OrderedDict
from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import nn
from timm.layers import freeze_batch_norm_2d
from torchvision.ops import FeaturePyramidNetwork
from torchvision.ops.feature_pyramid_network import ExtraFPNBlock

from ..factory import create_model, load_pretrained, resolve_name
from ..loading import load_checkpoint
from ..model import EfficientViT
from ..schema import shown
from ..variants import VARIANTS
from .schema import is_int

log = logging.getLogger(__name__)

DETECTION_WINDOW = 7  # the official detection code attends in 7x7 windows in every stage
BACKBONE_STRIDES = (16, 32, 64)
#: The backbone's parts ``trainable_backbone_layers`` counts, from the input: the patch embedding and the three
#: stages (torchvision's ResNet counts conv1 and layer1..layer4, five).
BACKBONE_LAYERS = 4


def check_trainable_layers(value: object) -> None:
    """Raise ``ValueError`` unless ``value`` is a whole number in 0..:data:`BACKBONE_LAYERS` (torchvision's
    ``_validate_trainable_layers`` bounds, for cgavit's four parts)."""
    if not (is_int(value) and 0 <= value <= BACKBONE_LAYERS):
        raise ValueError(f"'trainable_backbone_layers' must be a whole number in 0..{BACKBONE_LAYERS} (how many of the "
                         f"backbone's parts train, from the last: stage 3, stage 2, stage 1, the patch embedding), got {shown(value)}")


def freeze_backbone_layers(body: EfficientViT, trainable_layers: int) -> EfficientViT:
    """Freeze all but the last ``trainable_layers`` of ``body``'s parts (the patch embedding, stage 1, 2, 3):
    their parameters get ``requires_grad=False`` and their BatchNorm becomes a FrozenBatchNorm2d holding the same
    statistics, so neither a step nor a forward pass in training mode changes them (torchvision's
    ``resnet_fpn_backbone`` freezes the leading layers the same way, under frozen BatchNorm). ``trainable_layers``
    0 freezes the whole backbone (the FPN and the heads still train); :data:`BACKBONE_LAYERS` freezes nothing.
    Returns ``body``, changed in place."""
    check_trainable_layers(trainable_layers)
    frozen = BACKBONE_LAYERS - trainable_layers
    if frozen > 0:
        body.patch_embed = freeze_batch_norm_2d(body.patch_embed).requires_grad_(False)
    for i in range(frozen - 1):
        body.stages[i] = freeze_batch_norm_2d(body.stages[i]).requires_grad_(False)
    return body


def detection_body(
    name: str = "efficientvit_m4",
    pretrained: str | os.PathLike | Mapping[str, torch.Tensor] | None = None,
    trust: bool = False,
    freeze_bn: bool = True,
    *,
    trainable_layers: int = BACKBONE_LAYERS,
    **dials,
) -> EfficientViT:
    """The EfficientViT trunk for detection: no classifier, 7x7 windows everywhere, frozen BN.

    The model is built for an image size large enough that every stage keeps its full window
    (``min(window, stage resolution) = window``), as the official detection code does; it then runs
    at any input size >= 32 px (larger maps are split into windows, smaller ones attended whole).

    Args:
        name: variant, ``efficientvit_m0`` ... ``efficientvit_m5``.
        pretrained: ImageNet weights: a checkpoint path in any supported format (official, timm,
            cgavit), what ``torch.load`` returns from one (a state dict, wrapped or not, as
            :func:`~cgavit.loading.load_checkpoint` takes it), or ``"imagenet"`` for the official release
            file (:func:`cgavit.factory.load_pretrained`: downloaded once, a damaged cached copy named). The
            classifier is dropped and attention-bias tables of other windows (the 224-px models
            use 4x4 in the last stage) are resized bicubically. ``None``: random initialisation.
        trust: allow pickled objects in ``pretrained`` (only for files you trust).
        freeze_bn: replace every BatchNorm by a :class:`~torchvision.ops.FrozenBatchNorm2d` holding
            the same statistics and affine parameters (:func:`timm.layers.freeze_batch_norm_2d`; the
            paper's setting, meant for ImageNet weights). False keeps ordinary, trained BatchNorm: needed
            to train a random backbone, whose zero-initialised BatchNorm scales (last BN of every
            residual FFN and attention branch) would otherwise keep those branches at zero.
        trainable_layers: how many of the backbone's four parts train, counted from the last (stage 3, stage 2,
            stage 1, the patch embedding): 0..4, default 4 (all, the paper's ``frozen_stages=-1``). The others are
            frozen by :func:`freeze_backbone_layers`, BatchNorm included, whatever ``freeze_bn``. Unlike
            torchvision's builders, a value under 4 is kept without ImageNet weights (the detectors are also built
            so before a checkpoint's weights are loaded into them).
        **dials: design dials (see :func:`cgavit.create_model`).

    Returns:
        An :class:`~cgavit.model.EfficientViT` with ``num_classes=0``.
    """
    check_trainable_layers(trainable_layers)  # before any weights are read
    cfg = VARIANTS[resolve_name(name)].cfg
    cfg = cfg.with_dials(**dials) if dials else cfg
    build_size = max(512, 64 * max(cfg.window_size))  # stage 3 is at stride 64: res >= window
    body = create_model(name, num_classes=0, img_size=build_size, **dials)
    if pretrained is not None:  # the classifier is dropped by the loader: the body has none
        if isinstance(pretrained, str) and pretrained == "imagenet":
            report, source = load_pretrained(body, name), f"the published {resolve_name(name)} weights"
        else:
            report = load_checkpoint(body, pretrained, trust=trust)
            source = "state dict" if isinstance(pretrained, Mapping) else str(pretrained)
        log.info(
            "backbone weights from %s (classifier dropped; %d attention-bias tables resized to %dx%d windows)",
            source, len(report["resized"]), DETECTION_WINDOW, DETECTION_WINDOW,
        )
    body = freeze_batch_norm_2d(body) if freeze_bn else body
    return freeze_backbone_layers(body, trainable_layers)


def _init_conv(m: nn.Module) -> None:
    # the FPN's own initialisation (torchvision FeaturePyramidNetwork)
    nn.init.kaiming_uniform_(m.weight, a=1)
    nn.init.zeros_(m.bias)


class PyramidExtras(ExtraFPNBlock):
    """The levels the paper adds around the FPN's three (strides 16/32/64).

    Finer: ``num_up`` chained ``ConvTranspose2d(2x2, stride 2)`` starting at the finest FPN output,
    each followed by a 3x3 conv (strides 8, then 4). (The official neck starts the chain one step
    earlier, from the stride-16 lateral before its 3x3 conv; torchvision's FPN hands extra blocks
    its outputs only.) Coarser: ``num_down`` 3x3 stride-2 convs, the
    first on the last backbone map (mmdetection's ``add_extra_convs="on_input"``), later ones on the
    previous level after a ReLU.

    Args:
        channels: FPN width.
        num_up: finer levels to add.
        num_down: coarser levels to add.
        in_last: channels of the last backbone map.
    """

    def __init__(self, channels: int, num_up: int, num_down: int, in_last: int) -> None:
        super().__init__()
        self.up = nn.ModuleList(nn.ConvTranspose2d(channels, channels, 2, stride=2) for _ in range(num_up))
        self.up_out = nn.ModuleList(nn.Conv2d(channels, channels, 3, padding=1) for _ in range(num_up))
        self.down = nn.ModuleList(
            nn.Conv2d(in_last if i == 0 else channels, channels, 3, stride=2, padding=1) for i in range(num_down)
        )
        for m in self.modules():
            if isinstance(m, (nn.Conv2d, nn.ConvTranspose2d)):
                _init_conv(m)
        # the levels are named p<k> for stride 2**k, as the FPN's own are (the stage maps p4, p5, p6)
        self.first_level, self.last_level = (s.bit_length() - 1 for s in (BACKBONE_STRIDES[0], BACKBONE_STRIDES[-1]))

    def forward(
        self, results: list[torch.Tensor], x: list[torch.Tensor], names: list[str]
    ) -> tuple[list[torch.Tensor], list[str]]:
        finer = []
        feat = results[0]  # (B, C, H/16, W/16)
        for up, out in zip(self.up, self.up_out):
            feat = up(feat)  # twice the resolution
            finer.insert(0, out(feat))
        coarser = []
        feat = x[-1]  # last backbone map (B, C3, H/64, W/64)
        for i, conv in enumerate(self.down):
            feat = conv(feat if i == 0 else F.relu(feat))
            coarser.append(feat)
        finer_names = [f"p{self.first_level - i}" for i in range(len(finer), 0, -1)]
        coarser_names = [f"p{self.last_level + i + 1}" for i in range(len(coarser))]
        return finer + results + coarser, finer_names + names + coarser_names


class EfficientViTFPN(nn.Module):
    """EfficientViT trunk + FPN, the ``backbone`` torchvision's detectors expect.

    ``forward(images (B, 3, H, W))`` returns an ordered dict of five ``(B, out_channels, ., .)`` maps
    named ``p{k}`` for stride ``2**k`` (``p3``..``p7`` for RetinaNet, ``p2``..``p6`` for Mask R-CNN).

    Args:
        body: an :class:`~cgavit.model.EfficientViT` (see :func:`detection_body`).
        out_channels: FPN width. Default 256.
        num_up: transposed-conv levels finer than stride 16 (1: stride 8; 2: strides 8 and 4).
        num_down: conv levels coarser than stride 64.
    """

    def __init__(self, body: EfficientViT, out_channels: int = 256, num_up: int = 1, num_down: int = 1) -> None:
        super().__init__()
        if num_up < 0 or num_down < 0:
            raise ValueError(f"num_up and num_down must be >= 0, got {num_up}, {num_down}")
        self.body = body
        in_channels = [info["num_chs"] for info in body.feature_info]
        self.fpn = FeaturePyramidNetwork(
            in_channels, out_channels, extra_blocks=PyramidExtras(out_channels, num_up, num_down, in_channels[-1])
        )
        self.out_channels = out_channels
        self.strides = tuple([16 // 2**i for i in range(num_up, 0, -1)] + list(BACKBONE_STRIDES) + [64 * 2**i for i in range(1, num_down + 1)])
        self.stage_names = [f"p{s.bit_length() - 1}" for s in BACKBONE_STRIDES]  # the FPN's inputs
        self.level_names = tuple(f"p{s.bit_length() - 1}" for s in self.strides)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        if not torch.jit.is_scripting():  # TorchScript compiles no Python check (torchvision's detectors script)
            self.body.check_input(x)
        x = self.body.patch_embed(x)
        maps: dict[str, torch.Tensor] = OrderedDict()  # the stage maps at strides 16, 32, 64
        for i, stage in enumerate(self.body.stages):
            x = stage(x)
            maps[self.stage_names[i]] = x
        return self.fpn(maps)  # the levels named p<k> for stride 2**k, finest first (self.level_names)
