"""Helpers for verifying fast paths: realistic BatchNorm statistics and bias tables.

Default BatchNorm statistics (mean 0, var 1, weight 1 or 0, bias 0) make almost any fold look right,
so every equivalence check in this package first randomises them. Statistics drawn without regard to the
activations' scale make another blind spot: a freshly initialised conv shrinks its input (its weights' variance
is a third of ``1 / fan_in``), a BatchNorm holding a variance near 1 does not restore it, and its bias and mean
add constants, so after a few layers a network's logits hardly depend on its input (two unrelated images'
logits of a randomised M0 differ by about 1e-4, relative). A check of whole-model logits at 1e-5 then barely
sees a path that computes on the wrong pixels: give :func:`randomize_` ``images`` for such checks.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from .attention import CascadedGroupAttention, FusedCascadedGroupAttention


@torch.no_grad()
def randomize_(model: nn.Module, seed: int = 0, images: torch.Tensor | None = None) -> nn.Module:
    """Give every BatchNorm random statistics and affine parameters and every attention (trainable or
    fused) a random bias table, in place; returns ``model``.

    Args:
        model: any module; its BatchNorms and attentions are changed.
        seed: the draws' seed. Default 0.
        images: a batch ``model`` takes (several images): each BatchNorm's statistics are then drawn around
            those of its own input on them (one eval-mode pass, each set before it runs; the modules' modes are
            kept), so that its output depends on its input: two unrelated images' logits then differ by about
            their own size, not by 1e-4 of it (see the module doc).
            Default None: statistics drawn without regard to the activations' scale.
    """
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
    if images is not None:
        _statistics_from(model, images, g)
    return model


def _statistics_from(model: nn.Module, images: torch.Tensor, g: torch.Generator) -> None:
    """Set each BatchNorm's running statistics, as it is about to run on ``model(images)`` in eval mode, to its
    input's per-channel mean shifted by up to about a fifth of a standard deviation and its variance scaled by
    0.5 to 1.5: near what it sees, never exactly."""

    def draw(norm: nn.Module, args: tuple) -> None:
        x = args[0].detach().double()
        dims = [0, *range(2, x.dim())]  # every axis but the channels
        mean, var = x.mean(dims), x.var(dims, unbiased=False)
        n = norm.num_features
        shift, scale = torch.randn(n, generator=g, dtype=x.dtype), torch.rand(n, generator=g, dtype=x.dtype) + 0.5
        norm.running_mean.copy_(mean + shift.to(x.device) * 0.2 * var.sqrt())
        norm.running_var.copy_(var * scale.to(x.device) + norm.eps)

    norms = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    hooks = [m.register_forward_pre_hook(draw) for m in norms]
    training = [m.training for m in model.modules()]
    try:
        model.eval()(images)
    finally:
        for hook in hooks:
            hook.remove()
        for m, mode in zip(model.modules(), training):
            m.training = mode


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """``||a - b|| / ||b||`` in float64."""
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


@contextmanager
def full_fp32() -> Iterator[None]:
    """Run CUDA float32 convolutions and matrix products in full float32 inside (TF32 off), and restore torch's
    flags on the way out; nothing changes on the CPU.

    torch's default lets cuDNN round a float32 convolution's inputs to TF32 (a 10-bit mantissa: ~1e-4 to 1e-3
    relative) on Ampere and later GPUs. A float32 reference made so is no reference for a check at 1e-5: the Triton
    kernel's products are IEEE float32, and a path that folds a scale or the identity into its weights rounds them
    differently, so a check there failed paths that are right."""
    cudnn, matmul = torch.backends.cudnn, torch.backends.cuda.matmul
    matmul_tf32 = matmul.allow_tf32
    with cudnn.flags(enabled=cudnn.enabled, benchmark=cudnn.benchmark, deterministic=cudnn.deterministic,
                     allow_tf32=False):
        matmul.allow_tf32 = False
        try:
            yield
        finally:
            matmul.allow_tf32 = matmul_tf32
