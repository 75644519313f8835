"""Cascaded group attention (design notes, chapters 4-5), its relative-position biases, local windows.

Shapes follow the official code: feature maps are ``(B, C, H, W)``; inside a window a head's
queries and keys are ``(B, key_dim, N)`` with ``N = h * w`` tokens.
"""

from __future__ import annotations

import copy
import math
import weakref
from abc import ABC, abstractmethod
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from .layers import ConvBN
from .reallocation import value_width


def relative_bias_index(h: int, w: int, window: int, device: torch.device | None = None) -> torch.Tensor:
    """Index into a ``window x window`` offset table for every token pair of an ``h x w`` map.

    The table is the LeViT/official one: entry ``|dy| * window + |dx|`` holds the bias of two tokens
    ``dy`` rows and ``dx`` columns apart (the order in which the official code first meets each
    offset). Valid for ``h, w <= window``.

    Returns:
        LongTensor ``(h*w, h*w)``.
    """
    ys, xs = torch.meshgrid(
        torch.arange(h, device=device), torch.arange(w, device=device), indexing="ij"
    )
    ys, xs = ys.flatten(), xs.flatten()  # (N,)
    index = (ys[:, None] - ys[None, :]).abs_().mul_(window)  # in place: two (N, N) tensors at most, not five
    return index.add_((xs[:, None] - xs[None, :]).abs_())  # (N, N)


def query_kernels(kernels: Sequence[int], heads: int) -> tuple[int, ...]:
    """The depthwise kernel on each of ``heads`` heads' queries: the listed ones in order, the last repeated for
    more heads than the list (the published table lists four)."""
    kernels = tuple(kernels)
    return (kernels + kernels[-1:] * heads)[:heads]


#: Each window's full index, one tensor per window side and device for every module that holds it (held weakly:
#: freed with the last module). It is ``(window**2, window**2)`` int64 (128 MiB at the largest window, 64), and a
#: copy per module made a small file of many attention modules at that window ask for gigabytes when built.
_SHARED_INDEX: weakref.WeakValueDictionary[tuple[int, str], torch.Tensor] = weakref.WeakValueDictionary()


def shared_window_index(window: int, device=None) -> torch.Tensor:
    """:func:`relative_bias_index` of a full ``window x window`` window on ``device``, the one tensor every
    module at that window shares there (never written to: an index)."""
    device = torch.device(device if device is not None else "cpu")
    if device.index is None and device.type not in ("cpu", "meta"):
        device = torch.empty(0, device=device).device  # "cuda" is the current one: its key names it
    index = _SHARED_INDEX.get((window, str(device)))
    if index is None:
        with torch.inference_mode(False):  # an ordinary tensor even when made under inference mode
            index = relative_bias_index(window, window, window, device)
        _SHARED_INDEX[(window, str(index.device))] = index
    return index


def window_bias(bias_full: torch.Tensor, window: int, h: int, w: int) -> torch.Tensor:
    """The ``(heads, h*w, h*w)`` block of a full-window bias ``(heads, window**2, window**2)`` for an
    ``h x w`` map (``h, w <= window``): the biases depend only on offsets, so the map's tokens take
    the top-left ``h x w`` corner of the window grid."""
    if h == window and w == window:
        return bias_full
    ys, xs = torch.meshgrid(
        torch.arange(h, device=bias_full.device), torch.arange(w, device=bias_full.device), indexing="ij"
    )
    pos = (ys * window + xs).flatten()
    return bias_full[:, pos][:, :, pos]


def resize_bias_table(table: torch.Tensor, window: int) -> torch.Tensor:
    """Resize a ``(heads, w*w)`` relative-position bias table to ``(heads, window*window)`` (bicubic),
    as the official detection code does for windows of another size. ``w*w`` must be a square
    (:func:`cgavit.schema.check_tensor` checks a file's tables before they get here)."""
    heads, n = table.shape
    w = math.isqrt(n)
    assert w * w == n and w > 0, f"a bias table's second size must be a square, got {n}"
    grid = table.reshape(1, heads, w, w).float()
    out = F.interpolate(grid, size=(window, window), mode="bicubic", align_corners=False)
    return out.reshape(heads, window * window).to(table.dtype)


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward hands on a contiguous gradient.

    torch 2.14's BatchNorm2d backward is wrong for a batch of one when the incoming gradient is
    channels-last-strided, which is what the score matmul sends back to the query's Conv-BN.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


class CascadedHeads(nn.Module, ABC):
    """The per-head loop shared by :class:`CascadedGroupAttention` and its inference form.

    Head ``j`` reads its own slice of the channels (``group_split``), plus the output of head
    ``j-1`` (``cascade``); projects it with ``qkvs[j]`` to a query and key of ``key_dim`` and a value
    of ``value_dim``; refines the query with ``dws[j]``; attends with the relative-position bias of
    :meth:`attention_bias`; the concatenated head outputs go through ``proj`` (ReLU, 1x1 conv).
    Subclasses provide the modules and :meth:`attention_bias`.
    """

    # Subclasses set ``num_heads``, ``key_dim``, ``value_dim``, ``window`` (int), ``cascade``, ``group_split``
    # (bool), ``scale`` (float) and the modules ``qkvs``, ``dws`` (nn.ModuleList, one per head) and ``proj``
    # (nn.Sequential). No class annotations: TorchScript takes them for the attributes' types, and under
    # ``from __future__ import annotations`` they are strings it cannot read.

    @abstractmethod
    def attention_bias(self, h: int, w: int) -> torch.Tensor:
        """The ``(heads, h*w, h*w)`` bias for an ``h x w`` window (``h, w <= self.window``); each
        subclass stores its biases in its own form."""

    def _run_heads(self, x: torch.Tensor, maps: list[torch.Tensor] | None) -> torch.Tensor:
        B, C, H, W = x.shape
        if H > self.window or W > self.window:  # offsets past the table would read another offset's bias
            raise ValueError(f"a {H}x{W} map is larger than this attention's {self.window}x{self.window} window; give "
                             "it to LocalWindowAttention, which splits a map into windows, or build this one with "
                             f"window={max(H, W)}")
        bias = self.attention_bias(H, W)  # (heads, N, N)
        groups = x.chunk(self.num_heads, dim=1) if self.group_split else [x] * self.num_heads
        outs = []
        feat = groups[0]
        for i, (qkv, dw) in enumerate(zip(self.qkvs, self.dws)):  # TorchScript indexes no ModuleList by a variable
            if i > 0:
                feat = feat + groups[i] if self.cascade else groups[i]
            feat = qkv(feat)  # (B, 2*kd + vd, H, W)
            q, k, v = feat.view(B, 2 * self.key_dim + self.value_dim, H, W).split([self.key_dim, self.key_dim, self.value_dim], 1)
            q = dw(q)
            if not torch.jit.is_scripting():  # a trace or script can hold no Python autograd function
                if q.requires_grad and not torch.jit.is_tracing():
                    q = _ContiguousGrad.apply(q)
            q, k, v = q.flatten(2), k.flatten(2), v.flatten(2)  # (B, kd|vd, N)
            attn = (q.transpose(-2, -1) @ k) * self.scale + bias[i]  # (B, N, N)
            attn = attn.softmax(dim=-1)
            if maps is not None:
                maps.append(attn)
            feat = (v @ attn.transpose(-2, -1)).view(B, self.value_dim, H, W)
            outs.append(feat)
        return self.proj(torch.cat(outs, 1))  # (B, C, H, W)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._run_heads(x, None)

    def head_attention_maps(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Each head's softmax attention for ``x`` ``(B, C, H, W)``: ``num_heads`` x ``(B, N, N)``.

        The same arithmetic as :meth:`forward` (used by the head-similarity analysis).
        """
        maps: list[torch.Tensor] = []
        self._run_heads(x, maps)
        return maps


class CascadedGroupAttention(CascadedHeads):
    """Cascaded group attention over one window of tokens (the trainable form).

    Head ``j`` reads its own slice of the channels (``group_split``), plus the output of head
    ``j-1`` (``cascade``); projects it with one 1x1 Conv-BN to a query and key of ``key_dim`` and a
    value of ``value_dim``; refines the query with a depthwise Conv-BN; attends with a learned
    relative-position bias; and the concatenated head outputs go through ReLU and a 1x1 Conv-BN.

    Args:
        dim: channels in and out.
        key_dim: query/key width per head. Default 16.
        num_heads: heads. Default 4.
        value_dim: value width per head. Default ``dim // num_heads`` (the paper's choice).
        window: side of the largest window this module attends over (bias table size). Default 7.
        kernels: per-head kernel size of the depthwise conv on the query. Default 5 for every head.
        cascade: add each head's output to the next head's input. Default True.
        group_split: give each head its own ``dim / num_heads`` channels; False gives every head all
            ``dim`` channels (standard multi-head attention). Default True.
    """

    def __init__(
        self,
        dim: int,
        key_dim: int = 16,
        num_heads: int = 4,
        value_dim: int | None = None,
        window: int = 7,
        kernels: Sequence[int] | None = None,
        cascade: bool = True,
        group_split: bool = True,
    ) -> None:
        super().__init__()
        check_attention_dims(dim, key_dim, num_heads, value_dim, cascade, group_split)
        value_dim = value_width(dim, num_heads, key_dim, None) if value_dim is None else value_dim
        kernels = query_kernels(tuple(kernels) if kernels is not None else (5,), num_heads)
        if len(kernels) < num_heads or any(k < 1 or k % 2 == 0 for k in kernels):
            raise ValueError(f"query kernels must be odd and positive, got {list(kernels)}")
        self.dim = dim
        self.num_heads = num_heads
        self.key_dim = key_dim
        self.value_dim = value_dim
        self.window = window
        self.cascade = cascade
        self.group_split = group_split
        self.scale = key_dim**-0.5
        in_per_head = dim // num_heads if group_split else dim
        self.qkvs = nn.ModuleList(
            ConvBN(in_per_head, 2 * key_dim + value_dim) for _ in range(num_heads)
        )
        self.dws = nn.ModuleList(ConvBN(key_dim, key_dim, k, 1, k // 2, groups=key_dim) for k in kernels)
        self.proj = nn.Sequential(nn.ReLU(), ConvBN(value_dim * num_heads, dim, bn_weight_init=0.0))
        self.attention_biases = nn.Parameter(torch.zeros(num_heads, window * window))
        # on the table's device: a build under ``with torch.device("meta")`` makes both there
        self.register_buffer("attention_bias_idxs", shared_window_index(window, self.attention_biases.device),
                             persistent=False)

    def full_window_index(self) -> torch.Tensor:
        """The full window's index into the bias table, on the table's device. The index is arithmetic, not
        state (it is in no state dict), so it is rebuilt wherever it does not live with the table: a model made
        on the meta device and given its weights by ``load_state_dict(..., assign=True)`` keeps a meta index."""
        if self.attention_bias_idxs.device != self.attention_biases.device:
            self._rebuild_index()
        return self.attention_bias_idxs

    def _rebuild_index(self) -> None:
        self.attention_bias_idxs = shared_window_index(self.window, self.attention_biases.device)

    def _apply(self, fn, recurse: bool = True):
        before = self.attention_bias_idxs
        super()._apply(fn, recurse)
        # a new index tensor is a moved or, after to_empty(), an uninitialised one: the shared one where the table is
        if self.attention_bias_idxs is not before or self.attention_bias_idxs.device != self.attention_biases.device:
            self._rebuild_index()
        return self

    def attention_bias(self, h: int, w: int) -> torch.Tensor:
        """The ``(heads, h*w, h*w)`` bias for an ``h x w`` window (``h, w <= self.window``)."""
        if h == self.window and w == self.window:
            if torch.jit.is_scripting():  # scripted where its index lives (torch.jit.script moves no module)
                idx = self.attention_bias_idxs
            else:
                idx = self.full_window_index()
        else:
            idx = relative_bias_index(h, w, self.window, self.attention_biases.device)
        return self.attention_biases[:, idx]

    @torch.no_grad()
    def set_window(self, window: int) -> None:
        """Attend over ``window x window`` windows from now on: the bias table is resized (bicubic, as
        :func:`~cgavit.loading.fit_state_dict` resizes a file's table for a model built at another size)."""
        if window == self.window:
            return
        table = resize_bias_table(self.attention_biases.detach(), window)
        self.attention_biases = nn.Parameter(table, requires_grad=self.attention_biases.requires_grad)
        self.window = window
        self._rebuild_index()

    @torch.no_grad()
    def fuse(self) -> "FusedCascadedGroupAttention":
        """Inference copy: every Conv-BN folded to a Conv2d, the bias gathered once into a buffer."""
        return FusedCascadedGroupAttention(self)


class FusedCascadedGroupAttention(CascadedHeads):
    """Inference form of :class:`CascadedGroupAttention`, built by its ``fuse()``.

    Every Conv-BN is one biased ``nn.Conv2d`` and the window's bias is expanded once into
    ``bias_full`` ``(heads, window**2, window**2)``, so no lookup runs per call. The source module is
    not modified.

    Args:
        attn: the trained attention to fold (eval-mode statistics are used).
    """

    @torch.no_grad()
    def __init__(self, attn: CascadedGroupAttention) -> None:
        super().__init__()
        for name in ("dim", "num_heads", "key_dim", "value_dim", "window", "cascade", "group_split", "scale"):
            setattr(self, name, getattr(attn, name))
        self.qkvs = nn.ModuleList(m.fuse() for m in attn.qkvs)
        self.dws = nn.ModuleList(m.fuse() for m in attn.dws)
        self.proj = nn.Sequential(nn.ReLU(), attn.proj[1].fuse())
        full = attn.attention_biases[:, attn.full_window_index()].detach().clone()  # (heads, N, N)
        self.register_buffer("bias_full", full)

    def attention_bias(self, h: int, w: int) -> torch.Tensor:
        return window_bias(self.bias_full, self.window, h, w)

    @torch.no_grad()
    def set_bias_table(self, table: torch.Tensor) -> None:
        """Replace the bias with the one a ``(heads, window**2)`` offset table gives."""
        idx = relative_bias_index(self.window, self.window, self.window, self.bias_full.device)
        self.bias_full.copy_(table.to(self.bias_full)[:, idx])

    @torch.no_grad()
    def set_window(self, window: int) -> None:
        """As :meth:`CascadedGroupAttention.set_window`. The offset table is the bias of the window's first
        token to every other (row 0 of ``bias_full``: token ``(dy, dx)`` sits at ``dy * window + dx``)."""
        if window == self.window:
            return
        table = resize_bias_table(self.bias_full[:, 0, :], window)
        self.window = window
        self.bias_full = torch.empty(self.num_heads, window**2, window**2).to(self.bias_full)
        self.set_bias_table(table)

    def fuse(self) -> "FusedCascadedGroupAttention":
        """Already fused: a copy."""
        return copy.deepcopy(self)


def check_attention_dims(
    dim: int,
    key_dim: int,
    num_heads: int,
    value_dim: int | None,
    cascade: bool,
    group_split: bool,
) -> None:
    """Raise ``ValueError`` for a head layout that cannot work, saying what to change."""
    if num_heads < 1 or key_dim < 1 or dim < 1:
        raise ValueError(
            f"dim, key_dim and num_heads must be positive, got dim={dim}, key_dim={key_dim}, "
            f"num_heads={num_heads}"
        )
    if group_split and dim % num_heads:
        raise ValueError(
            f"channel groups need the width ({dim}) divisible by the head count ({num_heads}); "
            f"choose num_heads among {[h for h in range(1, dim + 1) if dim % h == 0 and h <= 16]} "
            "or set group_split=False"
        )
    if value_dim is not None and value_dim < 1:
        raise ValueError(f"value width must be positive, got {value_dim}; raise attn_ratio")
    if cascade:
        if not group_split:
            raise ValueError(
                "cascade=True adds each head's output to the next head's channel group, so it needs "
                "group_split=True; for standard multi-head attention set cascade=False too"
            )
        vd = value_width(dim, num_heads, key_dim, None) if value_dim is None else value_dim
        if vd != dim // num_heads:
            raise ValueError(
                f"with cascade=True a head's value width ({vd}) must equal its channel group "
                f"({dim}//{num_heads}={dim // num_heads}); leave attn_ratio at its default "
                f"(width / (key_dim * heads)) or set cascade=False"
            )


class LocalWindowAttention(nn.Module):
    """Cascaded group attention applied in non-overlapping windows.

    A map no larger than the window in both sides is attended whole (with the biases of the offsets
    it has). A larger map is zero-padded at the bottom/right to a multiple of the window, split
    into windows, attended, merged and cropped, as in the official code.

    Args:
        dim: channels.
        window: window side (the official ``min(7, stage resolution)``).
        **attn_kwargs: forwarded to :class:`CascadedGroupAttention`.
    """

    def __init__(self, dim: int, window: int = 7, **attn_kwargs) -> None:
        super().__init__()
        if window < 1:
            raise ValueError(f"window size must be positive, got {window}")
        self.window = window
        self.attn = CascadedGroupAttention(dim, window=window, **attn_kwargs)

    def set_window(self, window: int) -> None:
        """Attend over ``window x window`` windows from now on (the attention's bias table is resized)."""
        if window < 1:
            raise ValueError(f"window size must be positive, got {window}")
        self.attn.set_window(window)
        self.window = window

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, C, H, W = x.shape
        ws = self.window
        if H <= ws and W <= ws:
            return self.attn(x)
        x = x.permute(0, 2, 3, 1)  # (B, H, W, C)
        pad_b = (ws - H % ws) % ws
        pad_r = (ws - W % ws) % ws
        if pad_b or pad_r:
            x = F.pad(x, (0, 0, 0, pad_r, 0, pad_b))
        pH, pW = H + pad_b, W + pad_r
        nH, nW = pH // ws, pW // ws
        # (B, nH, ws, nW, ws, C) -> (B*nH*nW, C, ws, ws)
        x = x.view(B, nH, ws, nW, ws, C).transpose(2, 3).reshape(B * nH * nW, ws, ws, C)
        x = self.attn(x.permute(0, 3, 1, 2))
        # (B*nH*nW, C, ws, ws) -> (B, pH, pW, C)
        x = x.permute(0, 2, 3, 1).view(B, nH, nW, ws, ws, C).transpose(2, 3).reshape(B, pH, pW, C)
        if pad_b or pad_r:
            x = x[:, :H, :W].contiguous()
        return x.permute(0, 3, 1, 2)
