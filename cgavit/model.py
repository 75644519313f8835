"""The EfficientViT network: patch embedding, sandwich blocks, subsample blocks, stages, head."""

from __future__ import annotations

from collections import OrderedDict

import torch
from torch import nn

from .attention import LocalWindowAttention
from .layers import FFN, BNLinear, ConvBN, PatchMerging, Residual
from .variants import EfficientViTConfig

PATCH_SIZE = 16
MIN_INPUT_SIZE = 32


def _dw_ffn_pair(dim: int, ffn_ratio: float, drop: float) -> list[nn.Module]:
    """Residual depthwise 3x3 Conv-BN (local token interaction) then residual FFN."""
    return [
        Residual(ConvBN(dim, dim, 3, 1, 1, groups=dim, bn_weight_init=0.0), drop),
        Residual(FFN(dim, int(dim * ffn_ratio)), drop),
    ]


class SandwichBlock(nn.Module):
    """``pre`` (dw + FFN) x N, one local-window cascaded group attention, ``post`` (dw + FFN) x M.

    The paper's block is N = M = 1 (``ffn_per_side=1``); ``(0, 1)`` is the standard
    attention-then-FFN layout used by the ablation study.

    Args:
        dim: channels.
        window: attention window side.
        ffn_per_side: ``(N, M)`` dw+FFN pairs before and after the attention.
        ffn_ratio: FFN expansion.
        drop_path: stochastic-depth rate of every residual branch.
        **attn_kwargs: forwarded to :class:`~cgavit.attention.CascadedGroupAttention`.
    """

    def __init__(
        self,
        dim: int,
        window: int,
        ffn_per_side: tuple[int, int] = (1, 1),
        ffn_ratio: float = 2.0,
        drop_path: float = 0.0,
        **attn_kwargs,
    ) -> None:
        super().__init__()
        before, after = ffn_per_side
        self.pre = nn.Sequential(*[m for _ in range(before) for m in _dw_ffn_pair(dim, ffn_ratio, drop_path)])
        self.mixer = Residual(LocalWindowAttention(dim, window, **attn_kwargs), drop_path)
        self.post = nn.Sequential(*[m for _ in range(after) for m in _dw_ffn_pair(dim, ffn_ratio, drop_path)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.post(self.mixer(self.pre(x)))


class Stage(nn.Module):
    """Optional subsample block (dw+FFN, patch merging, dw+FFN) followed by sandwich blocks."""

    def __init__(
        self,
        in_dim: int,
        dim: int,
        depth: int,
        window: int,
        downsample: bool,
        ffn_ratio: float,
        drop_paths: list[float],
        **block_kwargs,
    ) -> None:
        super().__init__()
        if downsample:
            self.downsample = nn.Sequential(
                OrderedDict(
                    res1=nn.Sequential(*_dw_ffn_pair(in_dim, ffn_ratio, 0.0)),
                    patchmerge=PatchMerging(in_dim, dim),
                    res2=nn.Sequential(*_dw_ffn_pair(dim, ffn_ratio, 0.0)),
                )
            )
        else:
            self.downsample = nn.Identity()
        self.blocks = nn.Sequential(
            *[
                SandwichBlock(dim, window, ffn_ratio=ffn_ratio, drop_path=drop_paths[i], **block_kwargs)
                for i in range(depth)
            ]
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(self.downsample(x))


def stage_resolution(size: int, stage: int) -> int:
    """Feature-map side after the patch embedding and ``stage`` stride-2 subsamples."""
    r = size
    for _ in range(4):  # four 3x3 stride-2 convs, padding 1
        r = (r - 1) // 2 + 1
    for _ in range(stage):
        r = (r - 1) // 2 + 1
    return r


class EfficientViT(nn.Module):
    """EfficientViT (Liu et al., CVPR 2023): a three-stage cascaded-group-attention network.

    Args:
        cfg: architecture and design dials (see :class:`~cgavit.variants.EfficientViTConfig`).
        num_classes: classifier outputs; 0 gives a feature extractor with an identity head.
        in_chans: input image channels. Default 3.
        img_size: the size the model is built for, an int or ``(H, W)``; it sets each stage's
            attention window to ``min(window, stage resolution)`` as the official code does.
            Any other size >= 32 px also runs. Default 224.
        distillation: add a DeiT-style distillation head (outputs averaged in eval mode).
        drop_path_rate: stochastic depth, rising linearly over the sandwich blocks. Default 0.
    """

    def __init__(
        self,
        cfg: EfficientViTConfig,
        num_classes: int = 1000,
        in_chans: int = 3,
        img_size: int | tuple[int, int] = 224,
        distillation: bool = False,
        drop_path_rate: float = 0.0,
    ) -> None:
        super().__init__()
        cfg.validate()
        if num_classes < 0:
            raise ValueError(f"num_classes must be >= 0, got {num_classes}")
        if in_chans < 1:
            raise ValueError(f"in_chans must be >= 1, got {in_chans}")
        if not 0.0 <= drop_path_rate < 1.0:
            raise ValueError(f"drop_path_rate must be in [0, 1), got {drop_path_rate}")
        img_hw = (img_size, img_size) if isinstance(img_size, int) else tuple(img_size)
        if len(img_hw) != 2 or min(img_hw) < MIN_INPUT_SIZE:
            raise ValueError(f"img_size must be an int or (H, W) of at least {MIN_INPUT_SIZE}, got {img_size}")
        self.cfg = cfg
        self.img_size = img_hw
        self.in_chans = in_chans
        self.num_classes = num_classes
        self.num_features = cfg.embed_dim[-1]
        d0 = cfg.embed_dim[0]
        self.patch_embed = nn.Sequential(
            OrderedDict(
                conv1=ConvBN(in_chans, d0 // 8, 3, 2, 1),
                relu1=nn.ReLU(),
                conv2=ConvBN(d0 // 8, d0 // 4, 3, 2, 1),
                relu2=nn.ReLU(),
                conv3=ConvBN(d0 // 4, d0 // 2, 3, 2, 1),
                relu3=nn.ReLU(),
                conv4=ConvBN(d0 // 2, d0, 3, 2, 1),
            )
        )
        total_blocks = sum(cfg.depth)
        rates = [drop_path_rate * i / max(total_blocks - 1, 1) for i in range(total_blocks)]
        stages, self.feature_info = [], []
        for i in range(3):
            res = min(stage_resolution(s, i) for s in img_hw)
            window = min(cfg.window_size[i], res)
            stages.append(
                Stage(
                    in_dim=cfg.embed_dim[max(i - 1, 0)],
                    dim=cfg.embed_dim[i],
                    depth=cfg.depth[i],
                    window=window,
                    downsample=i > 0,
                    ffn_ratio=cfg.ffn_ratio,
                    drop_paths=rates[sum(cfg.depth[:i]) : sum(cfg.depth[: i + 1])],
                    ffn_per_side=cfg.ffn_per_side,
                    key_dim=cfg.key_dim[i],
                    num_heads=cfg.num_heads[i],
                    value_dim=cfg.value_dim(i),
                    kernels=cfg.kernels,
                    cascade=cfg.cascade,
                    group_split=cfg.group_split,
                )
            )
            self.feature_info.append(
                dict(num_chs=cfg.embed_dim[i], reduction=PATCH_SIZE * 2**i, module=f"stages.{i}")
            )
        self.stages = nn.Sequential(*stages)
        self.distillation = distillation
        self.head = BNLinear(self.num_features, num_classes) if num_classes > 0 else nn.Identity()
        self.head_dist = (
            BNLinear(self.num_features, num_classes) if distillation and num_classes > 0 else None
        )

    # ----------------------------------------------------------------------------- interface
    def check_input(self, x: torch.Tensor) -> None:
        """Raise ``ValueError`` unless ``x`` is an image batch ``(B, in_chans, H>=32, W>=32)``."""
        if not isinstance(x, torch.Tensor):
            raise ValueError(f"expected a torch.Tensor image batch, got {type(x).__name__}")
        if x.ndim != 4:
            hint = "; add a batch dimension with x.unsqueeze(0)" if x.ndim == 3 else ""
            raise ValueError(f"expected a 4-D batch (B, C, H, W), got shape {tuple(x.shape)}{hint}")
        if x.shape[1] != self.in_chans:
            raise ValueError(
                f"expected {self.in_chans} input channels, got {x.shape[1]} (shape {tuple(x.shape)}); "
                "convert the images (e.g. PIL .convert('RGB')) or build with in_chans="
                f"{x.shape[1]}"
            )
        if x.shape[2] < MIN_INPUT_SIZE or x.shape[3] < MIN_INPUT_SIZE:
            raise ValueError(
                f"images must be at least {MIN_INPUT_SIZE}x{MIN_INPUT_SIZE} pixels, got "
                f"{x.shape[2]}x{x.shape[3]}; resize them up first"
            )

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        """Image batch ``(B, 3, H, W)`` to the last stage map ``(B, C3, ~H/64, ~W/64)``."""
        self.check_input(x)
        return self.stages(self.patch_embed(x))

    def forward_intermediates(
        self,
        x: torch.Tensor,
        indices: int | list[int] | tuple[int, ...] | None = None,
        intermediates_only: bool = True,
        stop_early: bool = False,
    ) -> list[torch.Tensor] | tuple[torch.Tensor, list[torch.Tensor]]:
        """The stage maps at strides 16/32/64 (``indices`` selects; an int n = the last n).

        Returns the list of maps, or ``(final features, maps)`` when ``intermediates_only=False``.
        """
        self.check_input(x)
        if indices is None:
            take = [0, 1, 2]
        elif isinstance(indices, int):
            if not 1 <= indices <= 3:
                raise ValueError(f"indices as an int means 'the last n stages', 1..3; got {indices}")
            take = list(range(3 - indices, 3))
        else:
            take = sorted({int(i) % 3 if -3 <= int(i) < 3 else -1 for i in indices})
            if -1 in take:
                raise ValueError(f"stage indices must be in -3..2, got {indices}")
        x = self.patch_embed(x)
        maps = []
        last = max(take) if stop_early else 2
        for i, stage in enumerate(self.stages):
            if i > last:
                break
            x = stage(x)
            if i in take:
                maps.append(x)
        return maps if intermediates_only else (x, maps)

    def forward_head(self, x: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        """Pool a stage-3 map ``(B, C3, h, w)`` and classify; ``pre_logits`` returns ``(B, C3)``."""
        x = x.mean((2, 3))  # (B, C3)
        if pre_logits:
            return x
        if self.head_dist is None:
            return self.head(x)
        out, out_dist = self.head(x), self.head_dist(x)
        if self.training and not torch.jit.is_tracing():
            return out, out_dist
        return (out + out_dist) / 2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_head(self.forward_features(x))

    def get_classifier(self) -> nn.Module:
        return self.head

    def reset_classifier(self, num_classes: int, global_pool: str | None = None) -> None:
        """Replace the classifier (and distillation head) with fresh ones for ``num_classes``."""
        if global_pool not in (None, "avg"):
            raise ValueError(f"only average pooling is supported, got global_pool={global_pool!r}")
        if num_classes < 0:
            raise ValueError(f"num_classes must be >= 0, got {num_classes}")
        self.num_classes = num_classes
        device = next(self.parameters()).device
        self.head = (BNLinear(self.num_features, num_classes) if num_classes > 0 else nn.Identity()).to(device)
        self.head_dist = (
            BNLinear(self.num_features, num_classes).to(device) if self.distillation and num_classes > 0 else None
        )

    @torch.jit.ignore
    def no_weight_decay(self) -> set[str]:
        """Parameter names exempt from weight decay (the attention bias tables)."""
        return {n for n, _ in self.named_parameters() if n.endswith("attention_biases")}
