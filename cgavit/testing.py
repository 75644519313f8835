"""Helpers for verifying fast paths: realistic BatchNorm statistics and bias tables.

Default BatchNorm statistics (mean 0, var 1, weight 1 or 0, bias 0) make almost any fold look right,
so every equivalence check in this package first randomises them.
"""

from __future__ import annotations

import torch
from torch import nn

from .attention import CascadedGroupAttention, FusedCascadedGroupAttention


@torch.no_grad()
def randomize_(model: nn.Module, seed: int = 0) -> nn.Module:
    """Give every BatchNorm random statistics and affine parameters and every attention (trainable or
    fused) a random bias table, in place; returns ``model``."""
    g = torch.Generator().manual_seed(seed)
    for m in model.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            n = m.num_features
            m.running_mean.copy_(torch.randn(n, generator=g) * 0.5)
            m.running_var.copy_(torch.rand(n, generator=g) * 1.5 + 0.5)
            m.weight.copy_(torch.randn(n, generator=g) * 0.5 + 1.0)
            m.bias.copy_(torch.randn(n, generator=g) * 0.3)
        elif isinstance(m, CascadedGroupAttention):
            m.attention_biases.copy_(torch.randn(m.attention_biases.shape, generator=g) * 0.5)
        elif isinstance(m, FusedCascadedGroupAttention):  # a random offset table, expanded like fuse() does
            m.set_bias_table(torch.randn(m.num_heads, m.window * m.window, generator=g) * 0.5)
    return model


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """``||a - b|| / ||b||`` in float64."""
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))
