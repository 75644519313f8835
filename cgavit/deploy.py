"""Inference forms of a model: BatchNorm folding (``fuse``)."""

from __future__ import annotations

import copy

import torch
from torch import nn

from .attention import CascadedGroupAttention
from .layers import BNLinear, ConvBN

_FUSABLE = (ConvBN, BNLinear, CascadedGroupAttention)


def _swap_fused(module: nn.Module) -> None:
    for name, child in module.named_children():
        if isinstance(child, _FUSABLE):
            setattr(module, name, child.fuse())
        else:
            _swap_fused(child)


@torch.no_grad()
def fuse(model: nn.Module) -> nn.Module:
    """Return an eval-mode inference copy of ``model`` with every BatchNorm folded away.

    Conv-BN pairs become one ``nn.Conv2d``, BN+Linear heads one ``nn.Linear``, and each attention's
    relative-position bias is gathered once into a buffer. ``model`` itself is not modified;
    fusing an already fused model changes nothing.

    Raises:
        ValueError: if a BatchNorm remains that is not part of a Conv-BN or BN-Linear pair.
    """
    if not isinstance(model, nn.Module):
        raise ValueError(f"fuse expects an nn.Module, got {type(model).__name__}")
    fused = copy.deepcopy(model).eval()
    if isinstance(fused, _FUSABLE):
        fused = fused.fuse().eval()
    else:
        _swap_fused(fused)
    left = [n for n, m in fused.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    if left:
        raise ValueError(f"these BatchNorm layers have no conv/linear to fold into: {left}")
    for p in fused.parameters():
        p.requires_grad_(False)
    return fused
