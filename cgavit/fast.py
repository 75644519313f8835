"""Inference-only modules for the fast deploy paths (:func:`cgavit.deploy.optimize` and the exports).

They are built from an already fused model (every BatchNorm folded) and compute the same function
with fewer, cheaper operators:

* the attention scale is folded into the query's depthwise conv, the relative-position bias is
  precomputed, and the window partition is one permute each way;
* each head's query, key and value come from three 1x1 convs (the rows of its one ``qkv`` conv), not
  one conv and a split: the same arithmetic, and in int8 each gets its own range; OpenVINO runs a
  ``Split`` with a reference kernel, and M4's int8 ran 9-13 % faster there without it (ONNX Runtime
  alike either way; BENCHMARKS.md, "int8 on AVX2");
* a depthwise residual ``x + dw(x)`` becomes one depthwise conv whose centre tap carries the ``+ x``
  (:func:`fold_depthwise_residual`);
* given the image size (:func:`swap_fast_modules` with ``img_size``), every reshape is written with
  constant sizes and the batch as ``-1``, so an exported graph has no shape arithmetic left in it
  (an ONNX export of M4 goes from 1,702 nodes to about 600).

The training modules in :mod:`cgavit.attention` are untouched.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .attention import FusedCascadedGroupAttention, LocalWindowAttention, window_bias
from .bounds import is_whole
from .layers import FFN, PatchMerging, Residual, SqueezeExcite, conv_like
from .model import image_size_pair


class FastCascadedGroupAttention(nn.Module):
    """Cascaded group attention for inference, made from a :class:`FusedCascadedGroupAttention`.

    Same arithmetic as the fused module up to float rounding; the per-head loop stays (head ``j``
    reads head ``j-1``'s output, so the heads are inherently sequential).

    Args:
        fused: the fused attention to copy weights from (not modified).
        size: ``(h, w)`` of every map this module will see, to precompute the bias for it and write
            the reshapes with constant sizes; None (default) works on any map up to the window.
    """

    def __init__(self, fused: FusedCascadedGroupAttention, size: tuple[int, int] | None = None) -> None:
        super().__init__()
        if not isinstance(fused, FusedCascadedGroupAttention):
            raise ValueError(
                f"FastCascadedGroupAttention needs a fused attention (cgavit.fuse first), got {type(fused).__name__}"
            )
        self.num_heads = fused.num_heads
        self.key_dim = fused.key_dim
        self.value_dim = fused.value_dim
        self.group_width = fused.dim // fused.num_heads
        self.window = fused.window
        self.cascade = fused.cascade
        self.group_split = fused.group_split
        self.size = None if size is None else (int(size[0]), int(size[1]))
        if self.size is not None and not (0 <= self.size[0] <= self.window and 0 <= self.size[1] <= self.window):
            raise ValueError(f"size {self.size[0]}x{self.size[1]} is not a map this attention can attend (at most "
                             f"{self.window} a side, its window); for larger maps build a FastWindowAttention")
        kd, vd = self.key_dim, self.value_dim
        self.q = nn.ModuleList(_copy_conv(c, rows=slice(0, kd)) for c in fused.qkvs)
        self.k = nn.ModuleList(_copy_conv(c, rows=slice(kd, 2 * kd)) for c in fused.qkvs)
        self.v = nn.ModuleList(_copy_conv(c, rows=slice(2 * kd, 2 * kd + vd)) for c in fused.qkvs)
        self.dws = nn.ModuleList(_copy_conv(c, scale=fused.scale) for c in fused.dws)  # q * d^-0.5 folded in
        self.proj = _copy_conv(fused.proj[1])
        full = fused.bias_full.detach()  # (heads, window**2, window**2)
        bias = full if self.size is None else window_bias(full, self.window, *self.size)
        self.register_buffer("bias", bias.clone())  # (heads, N, N) of the full window, or of ``size``

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check_map(x)
        H, W = self.size or x.shape[2:]
        N = H * W
        bias = self.bias if self.size else window_bias(self.bias, self.window, H, W)  # (heads, N, N)
        groups = x.split(self.group_width, 1) if self.group_split else [x] * self.num_heads
        kd, vd = self.key_dim, self.value_dim
        B = -1 if self.size else x.shape[0]  # exports keep the batch symbolic; eager runs take any batch, 0 too
        outs = []
        feat = groups[0]
        for i in range(self.num_heads):
            if i > 0:
                feat = feat + groups[i] if self.cascade else groups[i]
            q = self.dws[i](self.q[i](feat)).reshape(B, kd, N)  # already scaled by key_dim^-0.5
            attn = torch.matmul(q.transpose(1, 2), self.k[i](feat).reshape(B, kd, N)) + bias[i]  # (B, N, N)
            attn = attn.softmax(dim=-1)
            feat = torch.matmul(self.v[i](feat).reshape(B, vd, N), attn.transpose(1, 2)).reshape(B, vd, H, W)
            outs.append(feat)
        return self.proj(torch.relu(torch.cat(outs, 1)))  # (B, C, H, W)

    def _check_map(self, x: torch.Tensor) -> None:
        """Refuse a map of another size than the one built for (its reshapes would make a wrong batch of it), or
        one larger than the window (its tokens would take the biases of other offsets), as the fused module does."""
        H, W = x.shape[2:]
        if self.size is not None and (H, W) != self.size:
            raise ValueError(f"this attention was built for {self.size[0]}x{self.size[1]} maps, got {H}x{W}: build it "
                             "again for your map size, or without a size")
        if H > self.window or W > self.window:
            raise ValueError(f"a {H}x{W} map is larger than this attention's {self.window}x{self.window} window; give "
                             "it to FastWindowAttention, which splits a map into windows")


class FastWindowAttention(nn.Module):
    """Local window attention for inference: pad, partition with one permute, attend, merge, crop.

    Args:
        lwa: a :class:`~cgavit.attention.LocalWindowAttention` whose attention is fused.
        size: ``(H, W)`` of the maps it will see (constant-size reshapes, a precomputed bias; another
            size is refused); None (default) takes any size.
    """

    def __init__(self, lwa: LocalWindowAttention, size: tuple[int, int] | None = None) -> None:
        super().__init__()
        self.window = ws = lwa.window
        self.channels = lwa.attn.dim
        self.size = None if size is None else (int(size[0]), int(size[1]))
        whole = self.size is not None and self.size[0] <= ws and self.size[1] <= ws
        self.attn = FastCascadedGroupAttention(lwa.attn, None if self.size is None else self.size if whole else (ws, ws))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.size is not None and tuple(x.shape[2:]) != self.size:
            raise ValueError(
                f"this inference graph was built for {self.size[0]}x{self.size[1]} maps here, got "
                f"{x.shape[2]}x{x.shape[3]}: build it again for your image size"
            )
        H, W = self.size or x.shape[2:]
        ws, C = self.window, self.channels
        if H <= ws and W <= ws:
            return self.attn(x)
        pad_b, pad_r = (ws - H % ws) % ws, (ws - W % ws) % ws
        if pad_b or pad_r:
            x = F.pad(x, (0, pad_r, 0, pad_b))
        nH, nW = (H + pad_b) // ws, (W + pad_r) // ws
        B = -1 if self.size else x.shape[0]  # as in the attention: symbolic only in exports
        # (B, C, nH, ws, nW, ws) -> (B*nH*nW, C, ws, ws)
        x = x.reshape(B, C, nH, ws, nW, ws).permute(0, 2, 4, 1, 3, 5).reshape(-1 if B == -1 else B * nH * nW, C, ws, ws)
        x = self.attn(x)
        # (B, nH, nW, C, ws, ws) -> (B, C, nH*ws, nW*ws)
        x = x.reshape(B, nH, nW, C, ws, ws).permute(0, 3, 1, 4, 2, 5).reshape(B, C, nH * ws, nW * ws)
        if pad_b or pad_r:
            x = x[:, :, :H, :W]
        return x


def _copy_conv(conv: nn.Conv2d, scale: float = 1.0, rows: slice = slice(None)) -> nn.Conv2d:
    """``conv`` (its output channels ``rows``) times ``scale``, biased."""
    bias = conv.bias if conv.bias is not None else torch.zeros(conv.out_channels, device=conv.weight.device)
    return conv_like(conv, conv.weight[rows] * scale, bias[rows] * scale)


def fold_depthwise_residual(residual: Residual) -> nn.Conv2d | None:
    """``x + dw(x)`` as one depthwise conv (the identity added to the centre tap), for a fused
    :class:`~cgavit.layers.Residual` around a stride-1, same-padded depthwise ``nn.Conv2d``;
    None for any other residual."""
    conv = residual.m
    if not (isinstance(conv, nn.Conv2d) and conv.groups == conv.in_channels == conv.out_channels):
        return None
    kh, kw = conv.kernel_size
    if conv.stride != (1, 1) or conv.dilation != (1, 1) or kh % 2 == 0 or kw % 2 == 0 \
            or conv.padding != (kh // 2, kw // 2) or conv.padding_mode != "zeros":
        return None
    weight = conv.weight.detach().clone()
    weight[:, 0, kh // 2, kw // 2] += 1.0
    bias = conv.bias if conv.bias is not None else torch.zeros_like(weight[:, 0, 0, 0])
    return conv_like(conv, weight, bias)


@torch.no_grad()
def window_input_sizes(model: nn.Module, img_size: tuple[int, int]) -> dict[int, tuple[int, int]]:
    """``{id(module): (H, W)}``: the map size each :class:`LocalWindowAttention` of ``model`` sees
    for ``img_size`` images (one dry run on a single zero image)."""
    sizes: dict[int, tuple[int, int]] = {}

    def record(module: nn.Module, args: tuple) -> None:
        sizes[id(module)] = tuple(args[0].shape[2:])

    hooks = [m.register_forward_pre_hook(record) for m in model.modules() if isinstance(m, LocalWindowAttention)]
    try:
        param = next(model.parameters())
        model(torch.zeros(1, getattr(model, "in_chans", 3), *img_size, device=param.device, dtype=param.dtype))
    finally:
        for hook in hooks:
            hook.remove()
    return sizes


@torch.no_grad()
def swap_fast_modules(
    model: nn.Module, img_size: tuple[int, int] | None = None, fold_residuals: bool = True
) -> nn.Module:
    """Replace, in place, every fused :class:`LocalWindowAttention` of ``model`` by its fast form,
    fold every depthwise residual into its conv (``fold_residuals``) and make every ReLU whose input
    nothing else reads in-place (saves one allocation per activation; :func:`private_relu`); returns
    ``model``, or its fast form when ``model`` is itself a :class:`LocalWindowAttention`.

    With ``img_size`` (one side, or ``(H, W)``) the fast modules are specialised to the maps ``img_size`` images give
    (the form for exporting: an image of another size is then refused); without it they take any size. For a
    :class:`LocalWindowAttention` itself, ``img_size`` is the size of its map.

    Raises:
        ValueError: a model not fused (:func:`cgavit.fuse`; refused before anything changes), or a bad ``img_size``.
    """
    unfused = [name or "the model" for name, m in model.named_modules()
               if isinstance(m, LocalWindowAttention) and not isinstance(m.attn, FusedCascadedGroupAttention)]
    if unfused:  # refused before anything is swapped: the caller's model is left as it was
        raise ValueError(f"swap_fast_modules needs a fused model (cgavit.fuse first); {unfused[0]} is not fused")
    if isinstance(model, LocalWindowAttention):  # its input is the map: no dry run of images
        return FastWindowAttention(model, _map_size(img_size))
    sizes = window_input_sizes(model, image_size_pair(img_size)) if img_size is not None else {}
    _swap(model, sizes, fold_residuals)
    return model


def _map_size(size: object) -> tuple[int, int] | None:
    """A map's ``(H, W)`` from one side or a pair of positive whole numbers (None stays None)."""
    sides = size if isinstance(size, (tuple, list)) else (size, size)
    if size is not None and (len(sides) != 2 or not all(is_whole(s) for s in sides)):
        raise ValueError(f"img_size of a LocalWindowAttention is the size of its map: one side or (H, W), positive "
                         f"whole numbers; got {size!r}")
    return None if size is None else (int(sides[0]), int(sides[1]))


#: cgavit's blocks whose ``act`` ReLU is only ever given a conv's output, which nothing else reads
OWN_ACTIVATIONS = (FFN, PatchMerging, SqueezeExcite)


def private_relu(parent: nn.Module, name: str, previous: nn.Module | None) -> bool:
    """Whether the ReLU ``parent.<name>`` may work in place: the ``act`` of one of cgavit's blocks
    (:data:`OWN_ACTIVATIONS`), or a ReLU right after a conv or linear layer in an ``nn.Sequential``
    (``previous``: the child before it). Any other module's ReLU may be given a tensor its module
    reads again (``torch.cat([f, self.act(f)])``), which an in-place ReLU would overwrite."""
    if isinstance(parent, OWN_ACTIVATIONS):
        return name == "act"
    return isinstance(parent, nn.Sequential) and isinstance(previous, (nn.Conv2d, nn.Linear))


def _swap(module: nn.Module, sizes: dict[int, tuple[int, int]], fold_residuals: bool) -> None:
    previous = None
    for name, child in module.named_children():
        folded = fold_depthwise_residual(child) if fold_residuals and isinstance(child, Residual) else None
        if isinstance(child, LocalWindowAttention):
            setattr(module, name, FastWindowAttention(child, sizes.get(id(child))))
        elif folded is not None:
            setattr(module, name, folded)
        elif isinstance(child, nn.ReLU):
            if private_relu(module, name, previous):
                setattr(module, name, nn.ReLU(inplace=True))
        else:
            _swap(child, sizes, fold_residuals)
        previous = child
