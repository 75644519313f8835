"""Inference-only modules for the fast deploy path (:func:`cgavit.deploy.optimize`).

They are built from an already fused model (every BatchNorm folded) and compute the same function
with fewer, cheaper operators: the attention scale folded into the query's depthwise conv, the
relative-position bias precomputed, ``scaled_dot_product_attention`` doing scores, bias, softmax and
the value product in one kernel, and the window partition done with one permute each way.
The training modules in :mod:`cgavit.attention` are untouched.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .attention import FusedCascadedGroupAttention, LocalWindowAttention, window_bias
from .layers import conv_like


class FastCascadedGroupAttention(nn.Module):
    """Cascaded group attention for inference, made from a :class:`FusedCascadedGroupAttention`.

    Same arithmetic as the fused module up to float rounding; the per-head loop stays (head ``j``
    reads head ``j-1``'s output, so the heads are inherently sequential).

    Args:
        fused: the fused attention to copy weights from (not modified).
    """

    def __init__(self, fused: FusedCascadedGroupAttention) -> None:
        super().__init__()
        if not isinstance(fused, FusedCascadedGroupAttention):
            raise ValueError(
                f"FastCascadedGroupAttention needs a fused attention (cgavit.fuse first), got {type(fused).__name__}"
            )
        self.num_heads = fused.num_heads
        self.key_dim = fused.key_dim
        self.value_dim = fused.value_dim
        self.window = fused.window
        self.cascade = fused.cascade
        self.group_split = fused.group_split
        self.qkvs = nn.ModuleList(_copy_conv(c) for c in fused.qkvs)
        self.dws = nn.ModuleList(_copy_conv(c, scale=fused.scale) for c in fused.dws)  # q * d^-0.5 folded in
        self.proj = _copy_conv(fused.proj[1])
        self.register_buffer("bias_full", fused.bias_full.detach().clone())  # (heads, N, N) of the full window

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, C, H, W = x.shape
        N = H * W
        bias = window_bias(self.bias_full, self.window, H, W)  # (heads, N, N)
        groups = x.chunk(self.num_heads, dim=1) if self.group_split else [x] * self.num_heads
        outs = []
        feat = groups[0]
        for i in range(self.num_heads):
            if i > 0:
                feat = feat + groups[i] if self.cascade else groups[i]
            q, k, v = self.qkvs[i](feat).split([self.key_dim, self.key_dim, self.value_dim], 1)
            q = self.dws[i](q)  # already scaled by key_dim^-0.5
            q = q.reshape(B, 1, self.key_dim, N).transpose(-2, -1)  # (B, 1, N, kd)
            k = k.reshape(B, 1, self.key_dim, N).transpose(-2, -1)  # (B, 1, N, kd)
            v = v.reshape(B, 1, self.value_dim, N).transpose(-2, -1)  # (B, 1, N, vd)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=bias[i], scale=1.0)  # (B, 1, N, vd)
            feat = o.transpose(-2, -1).reshape(B, self.value_dim, H, W)
            outs.append(feat)
        return self.proj(torch.relu(torch.cat(outs, 1)))  # (B, C, H, W)


class FastWindowAttention(nn.Module):
    """Local window attention for inference: pad, partition with one permute, attend, merge, crop.

    Args:
        lwa: a :class:`~cgavit.attention.LocalWindowAttention` whose attention is fused.
    """

    def __init__(self, lwa: LocalWindowAttention) -> None:
        super().__init__()
        self.window = lwa.window
        self.attn = FastCascadedGroupAttention(lwa.attn)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, C, H, W = x.shape
        ws = self.window
        if H <= ws and W <= ws:
            return self.attn(x)
        pad_b, pad_r = (ws - H % ws) % ws, (ws - W % ws) % ws
        if pad_b or pad_r:
            x = F.pad(x, (0, pad_r, 0, pad_b))
        nH, nW = (H + pad_b) // ws, (W + pad_r) // ws
        # (B, C, nH, ws, nW, ws) -> (B*nH*nW, C, ws, ws)
        x = x.view(B, C, nH, ws, nW, ws).permute(0, 2, 4, 1, 3, 5).reshape(B * nH * nW, C, ws, ws)
        x = self.attn(x)
        # (B, nH, nW, C, ws, ws) -> (B, C, nH*ws, nW*ws)
        x = x.view(B, nH, nW, C, ws, ws).permute(0, 3, 1, 4, 2, 5).reshape(B, C, nH * ws, nW * ws)
        if pad_b or pad_r:
            x = x[:, :, :H, :W]
        return x


def _copy_conv(conv: nn.Conv2d, scale: float = 1.0) -> nn.Conv2d:
    bias = conv.bias if conv.bias is not None else torch.zeros(conv.out_channels, device=conv.weight.device)
    return conv_like(conv, conv.weight * scale, bias * scale)


def swap_fast_modules(model: nn.Module) -> nn.Module:
    """Replace, in place, every fused :class:`LocalWindowAttention` of ``model`` by its fast form and
    make every ReLU in-place (saves one allocation per activation); returns ``model``."""
    for name, child in model.named_children():
        if isinstance(child, LocalWindowAttention):
            setattr(model, name, FastWindowAttention(child))
        elif isinstance(child, nn.ReLU):
            setattr(model, name, nn.ReLU(inplace=True))
        else:
            swap_fast_modules(child)
    return model
