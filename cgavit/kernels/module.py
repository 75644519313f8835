"""The Triton inference form of a fused :class:`~cgavit.attention.LocalWindowAttention`.

Built from an already fused model (every BatchNorm folded, see :func:`cgavit.fuse`); computes the
same function as the fused module with one kernel launch per block (:mod:`cgavit.kernels.cga`).
Inference only: no backward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..attention import FusedCascadedGroupAttention, LocalWindowAttention
from .cga import CgaLayout, CgaWeights, cga_forward, check_window, interpreted

__all__ = ["TritonWindowAttention", "interpreted", "swap_triton_modules"]  # interpreted: cga's, for kernels.interpreted()


def _kernel_size(conv: nn.Conv2d) -> int:
    k = conv.kernel_size[0]
    if conv.kernel_size != (k, k) or k % 2 == 0 or conv.padding != (k // 2, k // 2) or conv.stride != (1, 1):
        raise ValueError(f"the query conv must be square, odd, stride 1 and 'same' padded, got {conv}")
    return k


def _centred(weight: torch.Tensor, size: int) -> torch.Tensor:
    """A depthwise weight ``(kd, 1, k, k)`` zero-padded to ``size x size``, centred, one row per tap:
    ``(size * size, kd)``."""
    pad = (size - weight.shape[-1]) // 2
    return F.pad(weight[:, 0], (pad, pad, pad, pad)).flatten(1).t()


class TritonWindowAttention(nn.Module):
    """Local window attention run by the fused Triton CGA kernel.

    Same function as the fused :class:`~cgavit.attention.LocalWindowAttention` it is built from, up
    to float rounding; the source module is not modified.

    Args:
        lwa: a local window attention whose attention is fused (``cgavit.fuse`` the model first).
        project: let the kernel apply ReLU and the output projection too. Default True; False
            leaves them to ``torch`` (one 1x1 conv after the kernel).
    """

    def __init__(self, lwa: LocalWindowAttention, project: bool = True) -> None:
        super().__init__()
        attn = lwa.attn
        if not isinstance(attn, FusedCascadedGroupAttention):
            raise ValueError(
                "TritonWindowAttention needs a fused attention (cgavit.fuse the model first), "
                f"got {type(attn).__name__}"
            )
        check_window(lwa.window)
        kernel = max(_kernel_size(dw) for dw in attn.dws)
        self.project = project
        self.layout = CgaLayout(
            attn.dim, attn.num_heads, attn.key_dim, attn.value_dim, lwa.window, kernel, attn.cascade, attn.group_split
        )
        with torch.no_grad():
            self.register_buffer("qkv_weight", torch.stack([c.weight[:, :, 0, 0] for c in attn.qkvs]).contiguous())
            self.register_buffer("qkv_bias", torch.stack([c.bias for c in attn.qkvs]).contiguous())
            dw = torch.stack([_centred(c.weight, kernel) for c in attn.dws])  # (heads, kernel**2, kd)
            self.register_buffer("dw_weight", (dw * attn.scale).contiguous())  # q * key_dim**-0.5 folded in
            self.register_buffer("dw_bias", (torch.stack([c.bias for c in attn.dws]) * attn.scale).contiguous())
            self.register_buffer("bias_full", attn.bias_full.detach().clone().contiguous())
            proj = attn.proj[1]
            self.register_buffer("proj_weight", proj.weight[:, :, 0, 0].clone().contiguous())
            self.register_buffer("proj_bias", proj.bias.detach().clone())

    def weights(self) -> CgaWeights:
        """The buffers in the kernel's order."""
        return CgaWeights(
            self.qkv_weight, self.qkv_bias, self.dw_weight, self.dw_bias,
            self.bias_full, self.proj_weight, self.proj_bias,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``(B, dim, H, W)`` -> ``(B, dim, H, W)``, in ``x``'s dtype and memory format."""
        if x.requires_grad and torch.is_grad_enabled():
            raise ValueError("the Triton CGA kernel has no backward; run it under torch.no_grad() or inference_mode()")
        out = cga_forward(x, self.layout, self.weights(), project=self.project)
        if self.project:
            return out
        weight = self.proj_weight.to(x.dtype)[:, :, None, None]
        return F.conv2d(torch.relu(out), weight, self.proj_bias.to(x.dtype))

    def extra_repr(self) -> str:
        return f"{self.layout}, project={self.project}"


def swap_triton_modules(model: nn.Module, project: bool = True) -> nn.Module:
    """Replace, in place, every fused :class:`~cgavit.attention.LocalWindowAttention` of ``model``
    (``model`` itself included) by a :class:`TritonWindowAttention`; returns ``model`` (or the
    replacement when ``model`` is one).

    Raises:
        ValueError: when an attention is not fused (``cgavit.fuse`` the model first), or attends windows larger
            than the kernel's 16x16; refused before anything is swapped, so ``model`` is left as it was.
    """
    attentions = [(name or "the model", m) for name, m in model.named_modules() if isinstance(m, LocalWindowAttention)]
    unfused = [name for name, m in attentions if not isinstance(m.attn, FusedCascadedGroupAttention)]
    if unfused:
        raise ValueError(f"swap_triton_modules needs a fused model (cgavit.fuse first); {unfused[0]} is not fused")
    for name, m in attentions:
        check_window(m.window, name)
    return _swap(model, project)


def _swap(model: nn.Module, project: bool) -> nn.Module:
    if isinstance(model, LocalWindowAttention):
        return TritonWindowAttention(model, project)
    for name, child in model.named_children():
        if isinstance(child, LocalWindowAttention):
            setattr(model, name, TritonWindowAttention(child, project))
        else:
            _swap(child, project)
    return model
