"""Building blocks shared by every EfficientViT model: Conv-BN, BN-Linear, residual, FFN, SE.

Each block that carries a BatchNorm knows how to fold itself into a plain ``nn.Conv2d`` /
``nn.Linear`` for inference (``fuse()``); :func:`cgavit.deploy.fuse` walks a model and swaps them.
"""

from __future__ import annotations

import torch
from torch import nn


class ConvBN(nn.Sequential):
    """A bias-free ``Conv2d`` followed by ``BatchNorm2d`` (the official ``Conv2d_BN``).

    Args:
        in_ch: input channels.
        out_ch: output channels.
        kernel_size: square kernel size. Default 1.
        stride: convolution stride. Default 1.
        padding: zero padding on every side. Default 0.
        groups: convolution groups (``in_ch`` for a depthwise conv). Default 1.
        bn_weight_init: initial BatchNorm scale; 0 makes a residual branch start as identity.
    """

    def __init__(
        self,
        in_ch: int,
        out_ch: int,
        kernel_size: int = 1,
        stride: int = 1,
        padding: int = 0,
        groups: int = 1,
        bn_weight_init: float = 1.0,
    ) -> None:
        super().__init__()
        self.conv = nn.Conv2d(in_ch, out_ch, kernel_size, stride, padding, groups=groups, bias=False)
        self.bn = nn.BatchNorm2d(out_ch)
        nn.init.constant_(self.bn.weight, bn_weight_init)
        nn.init.zeros_(self.bn.bias)

    @torch.no_grad()
    def fuse(self) -> nn.Conv2d:
        """Return one ``nn.Conv2d`` computing what this module computes in eval mode."""
        conv, bn = self.conv, self.bn
        scale = bn.weight / torch.sqrt(bn.running_var + bn.eps)  # (out,)
        return conv_like(conv, conv.weight * scale[:, None, None, None], bn.bias - bn.running_mean * scale)


def uninitialised_on(module: nn.Module, like: torch.Tensor) -> nn.Module:
    """``module``, made on the meta device, given uninitialised tensors on ``like``'s device and dtype, for the
    caller to fill. Built so, a folded layer draws no initial weights: folding leaves the caller's random number
    stream where it was (a seeded script's later draws do not depend on what it fused or optimised)."""
    return module.to_empty(device=like.device).to(dtype=like.dtype)


@torch.no_grad()
def conv_like(conv: nn.Conv2d, weight: torch.Tensor, bias: torch.Tensor) -> nn.Conv2d:
    """A biased ``nn.Conv2d`` with ``conv``'s geometry (stride, padding, groups, ...) and the given
    ``weight`` and ``bias`` (their rows are its output channels), on ``conv``'s device and dtype, its
    parameters requiring gradients as ``conv``'s weight does (a frozen, fused conv's replacement stays frozen)."""
    out = nn.Conv2d(
        conv.in_channels,
        weight.shape[0],
        conv.kernel_size,
        conv.stride,
        conv.padding,
        dilation=conv.dilation,
        groups=conv.groups,
        bias=True,
        device="meta",
    )
    out = uninitialised_on(out, conv.weight)
    out.weight.copy_(weight)
    out.bias.copy_(bias)
    return out.requires_grad_(conv.weight.requires_grad)


class BNLinear(nn.Sequential):
    """``BatchNorm1d`` followed by ``Linear``: the classifier head.

    Args:
        in_features: input features.
        out_features: output features (classes).
        std: standard deviation of the truncated-normal weight initialisation. Default 0.02.
        drop: dropout between the two while training (a ``drop`` module only when above 0, so the
            head's modules are the official ones by default). Default 0.
    """

    def __init__(self, in_features: int, out_features: int, std: float = 0.02, drop: float = 0.0) -> None:
        super().__init__()
        self.bn = nn.BatchNorm1d(in_features)
        if drop > 0:
            self.drop = nn.Dropout(drop)
        self.linear = nn.Linear(in_features, out_features)
        nn.init.trunc_normal_(self.linear.weight, std=std)
        nn.init.zeros_(self.linear.bias)

    @torch.no_grad()
    def fuse(self) -> nn.Linear:
        """Return one ``nn.Linear`` computing what this module computes in eval mode."""
        bn, lin = self.bn, self.linear
        scale = bn.weight / torch.sqrt(bn.running_var + bn.eps)  # (in,)
        shift = bn.bias - bn.running_mean * scale  # (in,)
        fused = uninitialised_on(nn.Linear(lin.in_features, lin.out_features, device="meta"), lin.weight)
        fused.weight.copy_(lin.weight * scale[None, :])
        fused.bias.copy_(lin.weight @ shift + lin.bias)
        return fused


class Residual(nn.Module):
    """``x + m(x)``, with optional per-sample stochastic depth while training.

    Args:
        m: the residual branch.
        drop: probability of dropping the branch for a sample during training. Default 0.
    """

    def __init__(self, m: nn.Module, drop: float = 0.0) -> None:
        super().__init__()
        if not 0.0 <= drop < 1.0:
            raise ValueError(f"drop path rate must be in [0, 1), got {drop}")
        self.m = m
        self.drop = drop

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training and self.drop > 0:
            keep = torch.rand(x.shape[0], 1, 1, 1, device=x.device) >= self.drop
            return x + self.m(x) * keep.to(x.dtype) / (1.0 - self.drop)
        return x + self.m(x)


class FFN(nn.Module):
    """Pointwise feed-forward: 1x1 Conv-BN, ReLU, 1x1 Conv-BN (zero-initialised last BN).

    Args:
        dim: input and output channels.
        hidden: hidden channels (``ffn_ratio * dim``).
    """

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.pw1 = ConvBN(dim, hidden)
        self.act = nn.ReLU()
        self.pw2 = ConvBN(hidden, dim, bn_weight_init=0.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.pw2(self.act(self.pw1(x)))


def make_divisible(value: float, divisor: int = 8) -> int:
    """Round ``value`` to the nearest multiple of ``divisor`` (at least ``divisor``)."""
    return max(divisor, int(value + divisor / 2) // divisor * divisor)


class SqueezeExcite(nn.Module):
    """Squeeze-excitation: global mean, 1x1 conv down, ReLU, 1x1 conv up, sigmoid gate.

    Args:
        channels: channels in and out.
        rd_ratio: reduction ratio of the hidden width (rounded to a multiple of 8). Default 0.25.
    """

    def __init__(self, channels: int, rd_ratio: float = 0.25) -> None:
        super().__init__()
        hidden = make_divisible(channels * rd_ratio, 8)
        self.fc1 = nn.Conv2d(channels, hidden, 1)
        self.act = nn.ReLU()
        self.fc2 = nn.Conv2d(hidden, channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = x.mean((2, 3), keepdim=True)  # (B, C, 1, 1)
        return x * torch.sigmoid(self.fc2(self.act(self.fc1(s))))


class PatchMerging(nn.Module):
    """Stride-2 downsampling between stages: expand 4x, depthwise 3x3/2, SE, project.

    Args:
        dim: input channels.
        out_dim: output channels.
    """

    def __init__(self, dim: int, out_dim: int) -> None:
        super().__init__()
        hidden = dim * 4
        self.conv1 = ConvBN(dim, hidden)
        self.act = nn.ReLU()
        self.conv2 = ConvBN(hidden, hidden, 3, 2, 1, groups=hidden)
        self.se = SqueezeExcite(hidden, 0.25)
        self.conv3 = ConvBN(hidden, out_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.act(self.conv1(x))
        x = self.act(self.conv2(x))  # (B, 4C, ceil(H/2), ceil(W/2))
        return self.conv3(self.se(x))
