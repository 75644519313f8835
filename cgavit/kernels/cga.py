"""The fused cascaded-group-attention kernel (Triton, inference) and its launcher.

One Triton program attends one window of one image at a time and loops over windows (a launch is
a few programs per streaming multiprocessor: persistent). For each window it runs every head of
:class:`~cgavit.attention.FusedCascadedGroupAttention` on chip, in order:

1. the head's input: its channel slice (``group_split``) read straight from ``x`` ``(B, C, H, W)``
   at the window's positions, plus the previous head's output (``cascade``);
2. the 1x1 q/k/v projection (weight and bias);
3. the depthwise conv on q inside the window (zero padding at the window border), with the
   attention scale ``key_dim**-0.5`` folded into its weight and bias;
4. scores ``q k^T`` plus the relative-position bias of each token pair, gathered from
   ``bias_full`` by the tokens' (row, col) in the window;
5. softmax over the keys and the product with v.

With ``project=True`` the concatenated head outputs then go through ReLU and the output 1x1
projection in the same program, and the kernel writes the block's output ``(B, C, H, W)`` once;
with ``project=False`` it writes the concatenated head outputs ``(B, heads * value_dim, H, W)``.

Windows are found by index arithmetic: a map no larger than the window in both sides is one window
of its own ``H x W`` tokens (biases of the top-left corner of the window grid); a larger map is cut
into ``window x window`` windows from the top-left, and the tokens past the bottom/right border are
zeros of ``x`` before the projection (they get the projection bias and take part in attention, as
in the reference, which zero-pads), never stored. Loads and stores are masked; no padded or
permuted copy of ``x`` is made, and any strides work (channels-last included).

Tiles: the window's tokens are padded to a power of two >= 16 (``BLOCK_N``: 64 for a 7x7 window),
as is the key width; input channels, value channels and output channels are walked in chunks of
``CHUNK``, so no channel count is limited and registers hold at most a few ``(BLOCK_N, CHUNK)``
tiles plus the ``(BLOCK_N, BLOCK_N)`` attention weights, which bound the window to
``MAX_WINDOW_TOKENS`` tokens. Each program has a small fp32 scratch in global memory (L1/L2
resident): q on the window grid with a zero border, read back once per conv tap at a constant
shift; and the head outputs, which the next head (cascade) and the output projection read back.
``tl.debug_barrier`` orders each write before its reads.

Precisions: float32 (dot products in IEEE fp32, for the tests), float16 and bfloat16 (dot operands
in the input's type, accumulation, softmax and the scratch in float32).

Triton is imported at the top of this module: import it through :func:`cgavit.kernels.load`, the
one place that does so. Set ``TRITON_INTERPRET=1`` before that import to run the kernels on the
CPU (slowly), which is how the tests check them without a GPU; :func:`compile_kernel` checks that
they compile for a GPU without one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import triton
import triton.language as tl

from ..bounds import is_whole

MAX_WINDOW_TOKENS = 256  # tokens of one window (16 x 16): the score tile is (BLOCK_N, BLOCK_N) fp32
PROGRAMS_PER_SM = 4  # persistent programs launched per streaming multiprocessor
CPU_PROGRAMS = 4  # programs under the interpreter (it runs them one after another)
CHUNK = 32  # channels per step of the input, value, and output-projection loops
DOT_TYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


@dataclass(frozen=True)
class CgaLayout:
    """The shape of one cascaded group attention, as the kernel needs it.

    Args:
        dim: channels in and out.
        num_heads: heads.
        key_dim: query/key width per head.
        value_dim: value width per head.
        window: side of the attention window (the bias table is ``window**2`` square).
        kernel: side of the depthwise query kernel (odd; smaller per-head kernels are zero-padded
            to it, centred).
        cascade: add each head's output to the next head's input.
        group_split: each head reads its own ``dim // num_heads`` channels (else all ``dim``).
    """

    dim: int
    num_heads: int
    key_dim: int
    value_dim: int
    window: int
    kernel: int
    cascade: bool
    group_split: bool

    def __post_init__(self) -> None:
        sizes = {name: getattr(self, name) for name in ("dim", "num_heads", "key_dim", "value_dim", "window", "kernel")}
        bad = {name: value for name, value in sizes.items() if not is_whole(value)}
        if bad:
            raise ValueError(f"a CgaLayout's sizes must be positive integers, got {bad}")
        for name, value in sizes.items():  # plain ints (a NumPy integer is one too): the kernel's constants
            object.__setattr__(self, name, int(value))
        if self.kernel % 2 == 0:
            raise ValueError(f"the query kernel must be odd (a centred 'same' conv), got {self.kernel}")
        if self.group_split and self.dim % self.num_heads:
            raise ValueError(f"group_split needs dim ({self.dim}) divisible by num_heads ({self.num_heads})")

    @property
    def in_per_head(self) -> int:
        """Input channels of one head's q/k/v projection."""
        return self.dim // self.num_heads if self.group_split else self.dim

    def weight_shapes(self) -> dict[str, tuple[int, ...]]:
        """The shape of each of :class:`CgaWeights` this layout takes, by field name."""
        qkv, taps, tokens = 2 * self.key_dim + self.value_dim, self.kernel * self.kernel, self.window**2
        return dict(
            qkv_weight=(self.num_heads, qkv, self.in_per_head), qkv_bias=(self.num_heads, qkv),
            dw_weight=(self.num_heads, taps, self.key_dim), dw_bias=(self.num_heads, self.key_dim),
            bias_full=(self.num_heads, tokens, tokens),
            proj_weight=(self.dim, self.num_heads * self.value_dim), proj_bias=(self.dim,),
        )


class CgaWeights(NamedTuple):
    """The kernel's weights, contiguous, on the input's device (any float dtype).

    ``qkv_weight`` ``(heads, 2*key_dim + value_dim, in_per_head)``, ``qkv_bias``
    ``(heads, 2*key_dim + value_dim)``; ``dw_weight`` ``(heads, kernel*kernel, key_dim)`` (one row
    per tap) and ``dw_bias`` ``(heads, key_dim)``, both already multiplied by ``key_dim**-0.5``;
    ``bias_full`` ``(heads, window**2, window**2)``; ``proj_weight`` ``(dim, heads*value_dim)``,
    ``proj_bias`` ``(dim,)``.
    """

    qkv_weight: torch.Tensor
    qkv_bias: torch.Tensor
    dw_weight: torch.Tensor
    dw_bias: torch.Tensor
    bias_full: torch.Tensor
    proj_weight: torch.Tensor
    proj_bias: torch.Tensor


# ----------------------------------------------------------------------------------- the kernel
@triton.jit
def _project_rows(
    x_ptr, x_off, inside, sxc, prev_ptr, use_prev, w_ptr, b_ptr, n_rows,
    CIN: tl.constexpr, HV: tl.constexpr, CASCADE: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_CI: tl.constexpr, DOT: tl.constexpr, PREC: tl.constexpr,
):
    """``(BLOCK_N, BLOCK_R)`` fp32 rows ``[0, n_rows)`` of one head's 1x1 projection (weight rows of
    ``CIN`` at ``w_ptr``, bias at ``b_ptr``) of the head's input at the window's tokens.

    The input is ``x``'s channels at ``x_ptr`` (zeros at tokens past the map's border, as the
    reference pads), plus, when cascading and ``use_prev``, the previous head's output: ``CIN``
    columns at ``prev_ptr`` in the heads scratch (rows of ``HV``). Walked in ``BLOCK_CI`` chunks."""
    tok = tl.arange(0, BLOCK_N)
    r = tl.arange(0, BLOCK_R)
    acc = tl.zeros((BLOCK_N, BLOCK_R), tl.float32)
    for c0 in range(0, CIN, BLOCK_CI):
        ch = c0 + tl.arange(0, BLOCK_CI)
        in_ch = (ch < CIN)[None, :]
        feat = tl.load(x_ptr + x_off[:, None] + ch[None, :] * sxc, mask=inside[:, None] & in_ch, other=0.0)
        feat = feat.to(tl.float32)  # (BLOCK_N, BLOCK_CI)
        if CASCADE:
            feat += tl.load(prev_ptr + tok[:, None] * HV + ch[None, :], mask=in_ch & use_prev, other=0.0)
        w_mask = (r < n_rows)[None, :] & (ch < CIN)[:, None]
        w = tl.load(w_ptr + r[None, :] * CIN + ch[:, None], mask=w_mask, other=0.0)  # W[r, ch]^T
        acc = tl.dot(feat.to(DOT), w.to(DOT), acc, input_precision=PREC)
    return acc + tl.load(b_ptr + r, mask=r < n_rows, other=0.0).to(tl.float32)[None, :]


@triton.jit
def _depthwise_q(
    q, scratch_ptr, row, col, valid, w_ptr, b_ptr,
    KD: tl.constexpr, KS: tl.constexpr, WW: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_KD: tl.constexpr,
):
    """The depthwise ``KS x KS`` conv of q over the window grid, zero outside it.

    The scratch holds the window grid with a zero border of ``KS // 2``: ``(WH + KS - 1) x
    (WW + KS - 1)`` rows of ``BLOCK_KD``, zeroed once per program, of which only the inside is ever
    written. q goes in; each tap reads it back at a constant shift, with no masks."""
    d = tl.arange(0, BLOCK_KD)
    PW: tl.constexpr = WW + KS - 1
    base = tl.where(valid, row * PW + col, 0)  # the scratch row of each token's tap (0, 0)
    tl.debug_barrier()  # every thread is done reading the scratch (previous head or window)
    tl.store(scratch_ptr + (base + KS // 2 * (PW + 1))[:, None] * BLOCK_KD + d[None, :], q, mask=valid[:, None])
    tl.debug_barrier()
    tile = scratch_ptr + base[:, None] * BLOCK_KD + d[None, :]  # (BLOCK_N, BLOCK_KD): tap (0, 0)
    w_row = w_ptr + d  # the weight is (KS * KS, KD): one row per tap
    in_kd = d < KD
    acc = tl.zeros((BLOCK_N, BLOCK_KD), tl.float32)
    for tap in tl.static_range(KS * KS):
        shifted = tl.load(tile + (tap // KS * PW + tap % KS) * BLOCK_KD)
        acc += shifted * tl.load(w_row + tap * KD, mask=in_kd, other=0.0).to(tl.float32)[None, :]
    return acc + tl.load(b_ptr + d, mask=d < KD, other=0.0).to(tl.float32)[None, :]


@triton.jit
def _attention_weights(q, k, bias_ptr, row, col, valid, WS: tl.constexpr, DOT: tl.constexpr, PREC: tl.constexpr):
    """``softmax(q k^T + bias)`` ``(BLOCK_N, BLOCK_N)`` for one head, in ``DOT`` (q already scaled).

    The bias of tokens ``i, j`` is ``bias_full[pos_i, pos_j]`` with ``pos = row * WS + col``;
    keys past the window's tokens are masked out."""
    s = tl.dot(q.to(DOT), tl.trans(k.to(DOT)), input_precision=PREC)  # (BLOCK_N, BLOCK_N)
    pos = row * WS + col
    both = valid[:, None] & valid[None, :]
    s += tl.load(bias_ptr + pos[:, None] * (WS * WS) + pos[None, :], mask=both, other=0.0).to(tl.float32)
    s = tl.where(valid[None, :], s, float("-inf"))
    p = tl.exp(s - tl.max(s, axis=1)[:, None])
    return (p / tl.sum(p, axis=1)[:, None]).to(DOT)


@triton.jit
def _project_out(
    heads_ptr, out_ptr, o_off, inside, soc, w_ptr, b_ptr,
    C: tl.constexpr, HV: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_CO: tl.constexpr,
    BLOCK_K: tl.constexpr, DOT: tl.constexpr, PREC: tl.constexpr,
):
    """``out = W_proj @ relu(heads) + b`` for the window's tokens, from the head outputs
    ``(BLOCK_N, HV)`` in the scratch (written before the caller's barrier), in ``BLOCK_CO``
    output-channel chunks."""
    tok = tl.arange(0, BLOCK_N)
    for co0 in range(0, C, BLOCK_CO):
        co = co0 + tl.arange(0, BLOCK_CO)
        acc = tl.zeros((BLOCK_N, BLOCK_CO), tl.float32)
        for k0 in range(0, HV, BLOCK_K):
            kk = k0 + tl.arange(0, BLOCK_K)
            a = tl.load(heads_ptr + tok[:, None] * HV + kk[None, :], mask=(kk < HV)[None, :], other=0.0)
            a = tl.maximum(a, 0.0)  # the ReLU before the projection
            w_mask = (kk < HV)[:, None] & (co < C)[None, :]
            w = tl.load(w_ptr + co[None, :] * HV + kk[:, None], mask=w_mask, other=0.0)
            acc = tl.dot(a.to(DOT), w.to(DOT), acc, input_precision=PREC)  # w: W_proj[co, kk]^T
        acc += tl.load(b_ptr + co, mask=co < C, other=0.0).to(tl.float32)[None, :]
        mask = inside[:, None] & (co < C)[None, :]
        tl.store(out_ptr + o_off[:, None] + co[None, :] * soc, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def cga_kernel(
    x_ptr, out_ptr, scratch_ptr, qkv_w, qkv_b, dw_w, dw_b, bias_ptr, proj_w, proj_b,
    H, W, n_windows, windows_x, windows_per_image, scratch_stride,
    sxb, sxc, sxh, sxw, sob, soc, soh, sow,
    C: tl.constexpr, HEADS: tl.constexpr, KD: tl.constexpr, VD: tl.constexpr, CIN: tl.constexpr,
    GROUP_SPLIT: tl.constexpr, CASCADE: tl.constexpr, PROJECT: tl.constexpr,
    WS: tl.constexpr, WH: tl.constexpr, WW: tl.constexpr, KS: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_KD: tl.constexpr, BLOCK_VC: tl.constexpr, BLOCK_CI: tl.constexpr,
    BLOCK_CO: tl.constexpr, BLOCK_K: tl.constexpr, DOT: tl.constexpr, PREC: tl.constexpr,
):
    """Every head of a cascaded group attention over ``WH x WW`` windows; see the module doc."""
    pid = tl.program_id(0)
    tok = tl.arange(0, BLOCK_N)
    row, col, valid = tok // WW, tok % WW, tok < WH * WW
    vc = tl.arange(0, BLOCK_VC)
    HV: tl.constexpr = HEADS * VD
    QKV: tl.constexpr = 2 * KD + VD
    q_scratch = scratch_ptr + pid.to(tl.int64) * scratch_stride  # (WH + KS - 1, WW + KS - 1, BLOCK_KD)
    GRID: tl.constexpr = (WH + KS - 1) * (WW + KS - 1) * BLOCK_KD
    for g0 in range(0, GRID, BLOCK_N):  # zero the q grid once: its border is never written again
        tl.store(q_scratch + g0 + tok, tl.zeros((BLOCK_N,), tl.float32), mask=g0 + tok < GRID)
    heads_scratch = q_scratch + GRID  # (BLOCK_N, HV): the head outputs
    for win in range(pid, n_windows, tl.num_programs(0)):
        b = (win // windows_per_image).to(tl.int64)
        gy = (win % windows_per_image) // windows_x * WH + row
        gx = (win % windows_per_image) % windows_x * WW + col
        inside = valid & (gy < H) & (gx < W)  # tokens that exist in the map (others are padding)
        x_off = b * sxb + gy * sxh + gx * sxw
        o_off = b * sob + gy * soh + gx * sow
        for j in range(HEADS):
            x_head = x_ptr + j * CIN * GROUP_SPLIT * sxc
            prev = heads_scratch + (j - 1) * VD  # the previous head's output, read when cascading
            w_head = qkv_w + j * QKV * CIN
            b_head = qkv_b + j * QKV
            q = _project_rows(x_head, x_off, inside, sxc, prev, j > 0, w_head, b_head, KD,
                              CIN, HV, CASCADE, BLOCK_N, BLOCK_KD, BLOCK_CI, DOT, PREC)
            k = _project_rows(x_head, x_off, inside, sxc, prev, j > 0, w_head + KD * CIN, b_head + KD, KD,
                              CIN, HV, CASCADE, BLOCK_N, BLOCK_KD, BLOCK_CI, DOT, PREC)
            q = _depthwise_q(q, q_scratch, row, col, valid, dw_w + j * KD * KS * KS, dw_b + j * KD,
                             KD, KS, WW, BLOCK_N, BLOCK_KD)
            p = _attention_weights(q, k, bias_ptr + j * WS * WS * WS * WS, row, col, valid, WS, DOT, PREC)
            for v0 in range(0, VD, BLOCK_VC):  # values and the head's output, BLOCK_VC channels at a time
                v = _project_rows(x_head, x_off, inside, sxc, prev, j > 0, w_head + (2 * KD + v0) * CIN,
                                  b_head + 2 * KD + v0, VD - v0,
                                  CIN, HV, CASCADE, BLOCK_N, BLOCK_VC, BLOCK_CI, DOT, PREC)
                o = tl.dot(p, v.to(DOT), input_precision=PREC)  # (BLOCK_N, BLOCK_VC)
                ch = j * VD + v0 + vc
                in_head = (v0 + vc < VD)[None, :]
                tl.store(heads_scratch + tok[:, None] * HV + ch[None, :], o, mask=in_head)
                if not PROJECT:
                    tl.store(out_ptr + o_off[:, None] + ch[None, :] * soc, o.to(out_ptr.dtype.element_ty),
                             mask=inside[:, None] & in_head)
            tl.debug_barrier()  # head j's output is in the scratch for head j + 1 and the projection
        if PROJECT:
            _project_out(heads_scratch, out_ptr, o_off, inside, soc, proj_w, proj_b,
                         C, HV, BLOCK_N, BLOCK_CO, BLOCK_K, DOT, PREC)


# --------------------------------------------------------------------------------- the launcher
INTERPRETED = not isinstance(cga_kernel, triton.runtime.JITFunction)  # TRITON_INTERPRET=1 at definition


def interpreted() -> bool:
    """Whether the kernel runs in Triton's interpreter (``TRITON_INTERPRET=1`` when it was defined)."""
    return INTERPRETED


def _tile(n: int, cap: int | None = None) -> int:
    """``n`` rounded up to a power of two, at least 16 (``tl.dot``'s minimum), at most ``cap``."""
    size = max(16, triton.next_power_of_2(n))
    return size if cap is None else min(size, max(16, cap))


def window_grid(layout: CgaLayout, height: int, width: int) -> tuple[int, int]:
    """The ``(rows, cols)`` of one attention window on an ``height x width`` map: the map itself
    when it fits in the window, else ``window x window``."""
    if height <= layout.window and width <= layout.window:
        return height, width
    return layout.window, layout.window


def check_window(window: int, where: str = "this attention") -> None:
    """Raise ``ValueError`` for a window the kernel cannot attend: more than ``MAX_WINDOW_TOKENS`` tokens (16 x 16),
    saying what to run instead (``where`` names the attention in the message)."""
    if window**2 > MAX_WINDOW_TOKENS:
        raise ValueError(
            f"{where} attends {window}x{window} windows ({window**2} tokens), over the Triton kernel's "
            f"{MAX_WINDOW_TOKENS} (16x16); run such a model with optimize(..., backend='torch'), or fused as it is"
        )


def check_inputs(x: torch.Tensor, layout: CgaLayout, weights: CgaWeights) -> None:
    """Raise ``ValueError`` for an input or weights the kernel cannot take, saying what to do (``TypeError`` for
    an ``x`` that is no tensor or a ``layout`` that is no :class:`CgaLayout`)."""
    if not isinstance(x, torch.Tensor) or not isinstance(layout, CgaLayout):
        raise TypeError(f"cga_forward takes a tensor and a CgaLayout, got {type(x).__name__} and {type(layout).__name__}")
    if x.dim() != 4 or x.shape[1] != layout.dim:
        raise ValueError(f"expected a (B, {layout.dim}, H, W) feature map, got shape {tuple(x.shape)}")
    if x.dtype not in DOT_TYPES:
        raise ValueError(f"the CGA kernel takes float32, float16 or bfloat16 input, got {x.dtype}: cast the input, "
                         "or a model holding the kernel (optimize's result included, whose input follows its "
                         "weights), with .float(), .half() or .bfloat16()")
    if interpreted() and x.dtype == torch.bfloat16:
        raise ValueError(
            "Triton's interpreter (TRITON_INTERPRET=1) multiplies bfloat16 matrices wrongly; "
            "use float32 or float16 there, bfloat16 on a GPU"
        )
    if not interpreted() and x.device.type != "cuda":
        raise ValueError(
            f"the compiled CGA kernel needs a GPU tensor, got one on {x.device}; for the CPU set "
            "TRITON_INTERPRET=1 before cgavit.kernels.load() (slow: for tests)"
        )
    check_window(layout.window)
    if layout.cascade and layout.in_per_head != layout.value_dim:
        raise ValueError("cascade needs value_dim == dim // num_heads (as CascadedGroupAttention checks)")
    _check_weights(x, layout, weights)


def _check_weights(x: torch.Tensor, layout: CgaLayout, weights: CgaWeights) -> None:
    """Raise ``ValueError`` for weights the kernel would read wrongly: not a floating-point tensor, of another
    shape than ``layout`` gives (the kernel reads them by the layout: out of bounds), or not contiguous on ``x``'s
    device."""
    if len(weights) != len(CgaWeights._fields) or not all(isinstance(t, torch.Tensor) for t in weights):
        raise ValueError(f"weights must be {len(CgaWeights._fields)} tensors, a CgaWeights ({', '.join(CgaWeights._fields)})")
    shapes = layout.weight_shapes()
    named = dict(zip(CgaWeights._fields, weights))
    misshapen = {name: tuple(t.shape) for name, t in named.items() if tuple(t.shape) != shapes[name]}
    if misshapen:
        expected = {name: shapes[name] for name in misshapen}
        raise ValueError(f"weights of the wrong shape for {layout}: got {misshapen}, expected {expected}; build them "
                         "with TritonWindowAttention(...).weights()")
    not_float = [name for name, t in named.items() if not t.is_floating_point()]
    if not_float:
        raise ValueError(f"weights {not_float} must be floating point tensors")
    wrong = [name for name, t in named.items() if t.device != x.device or not t.is_contiguous()]
    if wrong:
        raise ValueError(f"weights {wrong} must be contiguous and on the input's device ({x.device})")


def _output(x: torch.Tensor, channels: int) -> torch.Tensor:
    """An empty ``(B, channels, H, W)`` tensor in ``x``'s dtype and memory format."""
    channels_last = x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous()
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    return torch.empty((x.shape[0], channels, *x.shape[2:]), device=x.device, dtype=x.dtype, memory_format=fmt)


def _programs(device: torch.device, n_windows: int) -> int:
    if device.type != "cuda":
        return min(n_windows, CPU_PROGRAMS)
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return min(n_windows, sms * PROGRAMS_PER_SM)


def kernel_constants(
    layout: CgaLayout, height: int, width: int, dtype: torch.dtype, project: bool
) -> dict[str, Any]:
    """The compile-time arguments of :func:`cga_kernel` for a ``height x width`` map of ``dtype``
    (``num_warps`` included): what one compiled variant of the kernel is specialised on.

    Raises:
        ValueError: a ``dtype`` the kernel has no variant for.
    """
    if dtype not in DOT_TYPES:
        raise ValueError(f"the CGA kernel is compiled for float32, float16 or bfloat16, got {dtype}")
    wh, ww = window_grid(layout, height, width)
    hv = layout.num_heads * layout.value_dim
    block_n = _tile(wh * ww)
    return dict(
        C=layout.dim, HEADS=layout.num_heads, KD=layout.key_dim, VD=layout.value_dim, CIN=layout.in_per_head,
        GROUP_SPLIT=int(layout.group_split), CASCADE=layout.cascade, PROJECT=project,
        WS=layout.window, WH=wh, WW=ww, KS=layout.kernel,
        BLOCK_N=block_n, BLOCK_KD=_tile(layout.key_dim), BLOCK_VC=_tile(layout.value_dim, CHUNK),
        BLOCK_CI=_tile(layout.in_per_head, CHUNK), BLOCK_CO=_tile(layout.dim, CHUNK), BLOCK_K=_tile(hv, CHUNK),
        DOT=DOT_TYPES[dtype], PREC="ieee", num_warps=4 if block_n <= 32 else 8,
    )


def scratch_size(constants: dict[str, Any]) -> int:
    """fp32 elements of one program's scratch: the bordered q grid, then the head outputs."""
    c = constants
    q_grid = (c["WH"] + c["KS"] - 1) * (c["WW"] + c["KS"] - 1) * c["BLOCK_KD"]
    return q_grid + c["BLOCK_N"] * c["HEADS"] * c["VD"]


def _launch(x: torch.Tensor, layout: CgaLayout, weights: CgaWeights, project: bool) -> torch.Tensor:
    out = _output(x, layout.dim if project else layout.num_heads * layout.value_dim)
    if x.numel() == 0:
        return out
    B, _, H, W = x.shape
    wh, ww = window_grid(layout, H, W)
    windows_x = triton.cdiv(W, ww)
    windows_per_image = triton.cdiv(H, wh) * windows_x
    n_windows = B * windows_per_image
    constants = kernel_constants(layout, H, W, x.dtype, project)
    programs = _programs(x.device, n_windows)
    per_program = scratch_size(constants)
    scratch = torch.empty((programs, per_program), device=x.device, dtype=torch.float32)
    cga_kernel[(programs,)](
        x, out, scratch, *weights, H, W, n_windows, windows_x, windows_per_image, per_program,
        *x.stride(), *out.stride(), **constants,
    )
    return out


def compile_kernel(
    layout: CgaLayout, height: int, width: int, dtype: torch.dtype, project: bool = True, arch: int = 90
) -> triton.compiler.CompiledKernel:
    """Compile the kernel for an NVIDIA GPU of compute capability ``arch`` (90: Hopper, 80: Ampere)
    without launching it: no GPU is needed, so CI checks that the kernel builds (the interpreter
    does not run Triton's compiler). Its ``asm`` holds the ``ttgir``, ``ptx`` and ``cubin``.

    Raises:
        RuntimeError: when the kernel module was defined under ``TRITON_INTERPRET=1``.
        ValueError: a ``dtype`` other than float32, float16 or bfloat16.
    """
    if interpreted():
        raise RuntimeError("compile_kernel needs the kernels defined without TRITON_INTERPRET=1")
    constants = kernel_constants(layout, height, width, dtype, project)
    num_warps = constants.pop("num_warps")
    data = {torch.float32: "*fp32", torch.float16: "*fp16", torch.bfloat16: "*bf16"}[dtype]
    signature = {name: "i32" for name in cga_kernel.arg_names}
    signature.update({name: "*fp32" for name in ("scratch_ptr", *cga_kernel.arg_names[3:10])})
    signature.update(x_ptr=data, out_ptr=data, **{name: "constexpr" for name in constants})
    source = triton.compiler.ASTSource(cga_kernel, signature, constexprs=constants)
    target = triton.backends.compiler.GPUTarget("cuda", arch, 32)
    return triton.compile(source, target=target, options=dict(num_warps=num_warps))


@torch.library.custom_op("cgavit::cga_window_attention", mutates_args=())
def cga_window_attention(
    x: torch.Tensor,
    qkv_weight: torch.Tensor,
    qkv_bias: torch.Tensor,
    dw_weight: torch.Tensor,
    dw_bias: torch.Tensor,
    bias_full: torch.Tensor,
    proj_weight: torch.Tensor,
    proj_bias: torch.Tensor,
    num_heads: int,
    key_dim: int,
    value_dim: int,
    window: int,
    kernel: int,
    cascade: bool,
    group_split: bool,
    project: bool,
) -> torch.Tensor:
    """The kernel as a PyTorch operator (``torch.ops.cgavit.cga_window_attention``), so that
    ``torch.compile`` keeps it whole in its graph and compiles the rest of the model around it.
    Call :func:`cga_forward`, which checks the inputs first."""
    layout = CgaLayout(x.shape[1], num_heads, key_dim, value_dim, window, kernel, cascade, group_split)
    weights = CgaWeights(qkv_weight, qkv_bias, dw_weight, dw_bias, bias_full, proj_weight, proj_bias)
    return _launch(x, layout, weights, project)


@cga_window_attention.register_fake
def _cga_window_attention_shape(x, qkv_weight, qkv_bias, dw_weight, dw_bias, bias_full, proj_weight, proj_bias,
                                num_heads, key_dim, value_dim, window, kernel, cascade, group_split, project):
    return _output(x, x.shape[1] if project else num_heads * value_dim)


def cga_forward(x: torch.Tensor, layout: CgaLayout, weights: CgaWeights, project: bool = True) -> torch.Tensor:
    """Local window attention of ``x`` ``(B, dim, H, W)`` with one Triton kernel launch.

    Args:
        x: the feature map, any strides; float32, float16 or bfloat16.
        layout: the attention's shape.
        weights: its weights (see :class:`CgaWeights`).
        project: fuse ReLU and the output projection. Default True.

    Returns:
        ``(B, dim, H, W)`` with ``project``, else the concatenated head outputs
        ``(B, heads * value_dim, H, W)``; ``x``'s dtype and memory format.

    Raises:
        ValueError: for an input or weights the kernel cannot take (weights of another shape than ``layout``
            gives included: the kernel would read past them).
        TypeError: ``x`` not a tensor, ``layout`` not a :class:`CgaLayout`.
    """
    check_inputs(x, layout, weights)
    return cga_window_attention(
        x, *weights, layout.num_heads, layout.key_dim, layout.value_dim, layout.window, layout.kernel,
        layout.cascade, layout.group_split, project,
    )
