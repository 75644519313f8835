"""The sandwich layout (design notes, chapter 2): one memory-bound attention between cheap FFN layers.

A standard ViT block is attention then FFN. EfficientViT's block puts ``N`` depthwise-conv + FFN
pairs before one local-window cascaded group attention and ``M`` after it (the paper: ``N = M = 1``),
so a stage spends most of its depth in compute-bound pointwise layers and runs the attention once.
``ffn_per_side=(0, 1)`` is the standard layout the ablation compares against.
"""

from __future__ import annotations

import torch
from torch import nn

from .attention import LocalWindowAttention
from .layers import FFN, ConvBN, Residual


def dw_ffn_pair(dim: int, ffn_ratio: float, drop: float, dw_bn_init: float = 0.0) -> list[nn.Module]:
    """Residual depthwise 3x3 Conv-BN (local token interaction) then residual FFN.

    ``dw_bn_init`` is the depthwise branch's initial BatchNorm scale: 0 (the branch starts as identity) in the
    sandwich blocks, 1 in the subsample blocks, as the official code initialises them (the FFN's last BatchNorm
    starts at 0 in both)."""
    return [
        Residual(ConvBN(dim, dim, 3, 1, 1, groups=dim, bn_weight_init=dw_bn_init), drop),
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
        self.pre = nn.Sequential(*[m for _ in range(before) for m in dw_ffn_pair(dim, ffn_ratio, drop_path)])
        self.mixer = Residual(LocalWindowAttention(dim, window, **attn_kwargs), drop_path)
        self.post = nn.Sequential(*[m for _ in range(after) for m in dw_ffn_pair(dim, ffn_ratio, drop_path)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.post(self.mixer(self.pre(x)))
