"""Roofline analysis (design notes, chapter 1): which operators are compute-bound and which memory-bound.

For every aten operator a forward pass runs, an analytic model gives the FLOPs it does
(``torch.utils.flop_counter``'s formulas for matmuls/convolutions/attention, a per-element count for
element-wise work: 5 for softmax as in the seed, 1 for add/mul/ReLU...) and the bytes it moves (its
input and output tensors read/written once; views move nothing). Their ratio is the arithmetic
intensity. The machine's own peak FLOP/s (a large fp32 matmul) and memory bandwidth (a large copy)
are measured first; an operator whose intensity is below peak/bandwidth (the ridge point) is
memory-bound. Each operator call's time is measured with ``torch.profiler``: the call runs inside
its own ``record_function`` range (so the time is that call's alone, not a guess from names).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile, record_function
from torch.utils._python_dispatch import TorchDispatchMode  # torch's only home of the dispatch-mode base
from torch.utils.flop_counter import flop_registry

from ..deploy import fuse
from ..factory import create_model, resolve_name

log = logging.getLogger(__name__)

#: FLOPs per output element of element-wise / reduction operators (the design notes' softmax: max,
#: subtract, exp, sum, divide = 5; an inference BatchNorm: a scale and a shift = 2, as once its statistics are
#: folded; timm's peers keep theirs).
ELEMENTWISE_FLOPS = {
    "softmax": 5, "_softmax": 5, "log_softmax": 5, "layer_norm": 8, "native_layer_norm": 8, "gelu": 8,
    "sigmoid": 4, "hardswish": 4, "hardsigmoid": 3, "silu": 5, "add": 1, "sub": 1, "mul": 1, "div": 1, "relu": 1,
    "clamp_min": 1, "clamp": 2, "hardtanh": 2, "mean": 1, "sum": 1, "addcmul": 2, "rsub": 1,
    "native_batch_norm": 2, "_native_batch_norm_legit_no_training": 2,
}
#: Operators that only re-describe memory (no bytes move); everything else moves its tensors.
VIEW_OPS = {
    "view", "_unsafe_view", "reshape", "_reshape_alias", "permute", "transpose", "t", "expand", "split",
    "split_with_sizes", "chunk", "slice", "select", "unsqueeze", "squeeze", "flatten", "as_strided",
    "alias", "detach", "unbind", "unflatten", "view_as", "expand_as", "numpy_T", "lift_fresh",
}


@dataclass
class OpCost:
    """Analytic cost of one operator call: ``flops`` and ``bytes`` moved, ``intensity`` = their ratio."""

    flops: float
    bytes: float

    @property
    def intensity(self) -> float:
        return self.flops / self.bytes if self.bytes else float("inf")


def matmul_cost(m: int, n: int, k: int, bytes_per_el: int, batch: int = 1) -> OpCost:
    """``(m x k) @ (k x n)``: 2·m·n·k FLOPs; read both operands, write the result once."""
    return OpCost(2.0 * batch * m * n * k, float(batch * (m * k + k * n + m * n) * bytes_per_el))


def elementwise_cost(numel: int, flops_per_el: float, bytes_per_el: int, reads: int = 1) -> OpCost:
    """``reads`` input tensors of ``numel`` elements in, one out, ``flops_per_el`` per output element."""
    return OpCost(float(numel * flops_per_el), float((reads + 1) * numel * bytes_per_el))


def attention_costs(tokens: int, channels: int, bytes_per_el: int = 2) -> dict[str, OpCost]:
    """The design notes' worked example: one self-attention layer's score matmul, softmax and value mix.

    ``attention_costs(196, 192, 2)`` gives the score matmul ~64 FLOP/byte and the softmax ~1.3.
    """
    t, c = tokens, channels
    return {
        "score matmul Q·Kᵀ": matmul_cost(t, t, c, bytes_per_el),
        "softmax": elementwise_cost(t * t, ELEMENTWISE_FLOPS["softmax"], bytes_per_el),
        "value mix A·V": matmul_cost(t, c, t, bytes_per_el),
    }


# ------------------------------------------------------------------------------ machine peaks
def measure_peaks(seconds: float = 0.5, n: int = 1024) -> dict[str, float]:
    """This machine's fp32 matmul FLOP/s and copy bandwidth (bytes/s, read+write), current threads."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    src = torch.randn(32 * 2**20 // 4)  # 32 MiB: larger than the caches
    dst = torch.empty_like(src)

    def best(fn, work: float) -> float:
        fn()
        rates, start = [], time.perf_counter()
        while time.perf_counter() - start < seconds or len(rates) < 3:
            t0 = time.perf_counter()
            fn()
            rates.append(work / (time.perf_counter() - t0))
        return max(rates)

    flops = best(lambda: torch.mm(a, b), 2.0 * n**3)
    bandwidth = best(lambda: dst.copy_(src), 2.0 * src.numel() * 4)
    return dict(flops=flops, bandwidth=bandwidth, ridge=flops / bandwidth)


# ------------------------------------------------------------------------- per-operator records
def _nbytes(x) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_nbytes(v) for v in x)
    return 0


def _shape_key(args) -> tuple:
    out = []
    for a in args:
        if isinstance(a, torch.Tensor):
            out.append(tuple(a.shape))
        elif isinstance(a, (list, tuple)) and a and all(isinstance(v, torch.Tensor) for v in a):
            out.append(tuple(tuple(v.shape) for v in a))
    return tuple(out)


def op_cost(func, args, kwargs, out) -> OpCost:
    """Analytic FLOPs and bytes of one aten call (see the module docstring)."""
    name = func._overloadpacket.__name__
    if name in VIEW_OPS:
        return OpCost(0.0, 0.0)
    moved = float(sum(_nbytes(a) for a in args) + sum(_nbytes(v) for v in kwargs.values()) + _nbytes(out))
    if func._overloadpacket in flop_registry:
        return OpCost(float(flop_registry[func._overloadpacket](*args, **kwargs, out_val=out)), moved)
    first = out[0] if isinstance(out, (tuple, list)) and out else out  # e.g. layer_norm -> (y, mean, rstd)
    numel = first.numel() if isinstance(first, torch.Tensor) else 0
    if name in ("mean", "sum") and args and isinstance(args[0], torch.Tensor):
        numel = args[0].numel()  # a reduction does one op per input element
    return OpCost(float(numel * ELEMENTWISE_FLOPS.get(name.rstrip("_"), 0)), moved)


def _sdpa_cpu_flops(q, k, v, *args, **kwargs) -> float:
    """CPU flash attention: two matmuls (2·N·M·d each) and the softmax over the (N, M) scores."""
    b = q.numel() // (q.shape[-2] * q.shape[-1])
    n, m, d, dv = q.shape[-2], k.shape[-2], q.shape[-1], v.shape[-1]
    return 2.0 * b * n * m * (d + dv) + ELEMENTWISE_FLOPS["softmax"] * b * n * m


class _Recorder(TorchDispatchMode):
    """Records every aten call's analytic cost and wraps it in a ``torch.profiler`` range
    ``roofline#<index>``, so the profiler measures exactly that call."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[tuple[str, tuple, OpCost]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        with record_function(f"roofline#{len(self.records)}"):
            out = func(*args, **kwargs)
        name = func._overloadpacket.__name__
        if name == "_scaled_dot_product_flash_attention_for_cpu":
            cost = OpCost(_sdpa_cpu_flops(*args[:3]), float(sum(_nbytes(a) for a in args[:3]) + _nbytes(out[0])))
        else:
            cost = op_cost(func, args, kwargs, out)
        self.records.append((f"aten::{name}", _shape_key(args), cost))
        return out


@dataclass
class OpRow:
    """One operator kind with its input shapes: calls, totals, intensity, measured time, verdict."""

    op: str
    shapes: str
    calls: int
    flops: float
    bytes: float
    time_s: float
    bound: str  # "compute", "memory" or "view" (moves nothing)

    @property
    def intensity(self) -> float:
        return self.flops / self.bytes if self.bytes else float("inf")


def profile_model(model: nn.Module, x: torch.Tensor, peaks: dict[str, float], repeats: int = 3) -> list[OpRow]:
    """Per-operator roofline rows of ``model(x)``: analytic cost, profiler time, verdict."""
    model.eval()
    with torch.no_grad():
        for _ in range(2):
            model(x)
        with profile(activities=[ProfilerActivity.CPU]) as prof, _Recorder() as rec:
            for _ in range(repeats):
                model(x)
    times = [0.0] * len(rec.records)
    for ev in prof.events():
        if ev.name.startswith("roofline#"):
            times[int(ev.name[9:])] = ev.cpu_time_total * 1e-6
    grouped: dict[tuple, list] = {}
    for (name, shapes, cost), seconds in zip(rec.records, times):
        g = grouped.setdefault((name, shapes), [0, 0.0, 0.0, 0.0])
        g[0] += 1 / repeats
        g[1] += cost.flops / repeats
        g[2] += cost.bytes / repeats
        g[3] += seconds / repeats
    rows = []
    for (name, shapes), (calls, flops, nbytes, seconds) in grouped.items():
        bound = "view" if nbytes == 0 else ("compute" if flops / nbytes >= peaks["ridge"] else "memory")
        rows.append(OpRow(name, str(list(shapes))[:60], round(calls), flops, nbytes, seconds, bound))
    rows.sort(key=lambda r: -r.time_s)
    return rows


def summarize(rows: list[OpRow]) -> dict[str, float]:
    """Measured time by verdict and the memory-bound share of the operators' time."""
    total = sum(r.time_s for r in rows)
    mem = sum(r.time_s for r in rows if r.bound == "memory")
    view = sum(r.time_s for r in rows if r.bound == "view")
    comp = sum(r.time_s for r in rows if r.bound == "compute")
    return dict(total_s=total, memory_s=mem, compute_s=comp, view_s=view,
                memory_share=mem / total if total else 0.0, view_share=view / total if total else 0.0,
                flops=sum(r.flops for r in rows), bytes=sum(r.bytes for r in rows))


def format_rows(rows: list[OpRow], peaks: dict[str, float], top: int = 20) -> str:
    total = sum(r.time_s for r in rows) or 1.0
    head = f"{'operator':<34}{'calls':>6}{'MFLOP':>10}{'MB moved':>10}{'FLOP/B':>8}{'ms':>9}{'time %':>7}  bound   roofline ms"
    head += "  input shapes"  # one row per operator and shapes: the shapes tell same-named rows apart
    lines = [head, "-" * len(head)]
    for r in rows[:top]:
        ideal = max(r.flops / peaks["flops"], r.bytes / peaks["bandwidth"]) * 1e3
        ai = f"{r.intensity:.1f}" if r.bytes else "-"
        lines.append(f"{r.op[:33]:<34}{r.calls:>6}{r.flops / 1e6:>10.1f}{r.bytes / 1e6:>10.2f}{ai:>8}"
                     f"{r.time_s * 1e3:>9.2f}{100 * r.time_s / total:>6.1f}%  {r.bound:<8}{ideal:>8.2f}     {r.shapes}")
    return "\n".join(lines)


def given_peaks(
    peaks: dict[str, float], peak_gflops: float | None = None, bandwidth_gbs: float | None = None
) -> dict[str, float]:
    """``peaks`` with the given fp32 peak (GFLOP/s) and/or bandwidth (GB/s, read+write) in place of the
    measured ones (e.g. figures measured on a quiet machine), and the ridge point recomputed."""
    flops = peak_gflops * 1e9 if peak_gflops else peaks["flops"]
    bandwidth = bandwidth_gbs * 1e9 if bandwidth_gbs else peaks["bandwidth"]
    return dict(peaks, flops=flops, bandwidth=bandwidth, ridge=flops / bandwidth)


def format_peaks(peaks: dict[str, float], threads: int, peak_gflops: float | None = None,
                 bandwidth_gbs: float | None = None) -> str:
    """The line naming the peaks the verdicts use, each labelled with where it comes from: measured on this
    machine just now, or given on the command line (:func:`given_peaks`; perhaps another machine's)."""

    def origin(given: float | None) -> str:
        return "given on the command line, not measured here" if given else f"measured here, {threads} thread(s)"

    return (f"peaks: fp32 matmul {peaks['flops'] / 1e9:.1f} GFLOP/s ({origin(peak_gflops)}), copy bandwidth "
            f"{peaks['bandwidth'] / 1e9:.1f} GB/s read+write ({origin(bandwidth_gbs)}); ridge point "
            f"{peaks['ridge']:.1f} FLOP/byte")


def format_summary(summaries: dict[str, dict[str, float]]) -> str:
    """One line per model: total FLOPs and bytes, intensity, operator time, memory-bound and view shares."""
    lines = [f"{'model':<26}{'GFLOP':>8}{'MB moved':>10}{'FLOP/B':>8}{'op time ms':>11}{'memory-bound':>14}{'views':>8}"]
    for name, s in summaries.items():
        lines.append(f"{name:<26}{s['flops'] / 1e9:>8.2f}{s['bytes'] / 1e6:>10.1f}{s['flops'] / s['bytes']:>8.1f}"
                     f"{s['total_s'] * 1e3:>11.1f}{100 * s['memory_share']:>13.1f}%{100 * s['view_share']:>7.1f}%")
    return "\n".join(lines)


def build(name: str, img_size: int) -> nn.Module:
    """A fused cgavit variant, or a timm model (random weights) for any other name."""
    try:
        key = resolve_name(name)
    except ValueError:
        return _timm_model(name, img_size)
    return fuse(create_model(key, img_size=img_size))


def _timm_model(name: str, img_size: int) -> nn.Module:
    """A timm model with random weights and explicit attention (Q·Kᵀ, softmax, A·V, as the paper's
    analysis and our model compute it). The one place timm is imported here: lazily, since the
    roofline of our own variants needs no timm."""
    try:
        import timm
    except ImportError as err:
        raise ValueError(f"{name!r} is not a cgavit variant, and timm models need timm: "
                         "pip install 'cgavit[bench]'") from err

    try:
        try:  # built for the size, where the model takes one (ViT, Swin, BEiT, ...)
            model = timm.create_model(name, pretrained=False, img_size=img_size).eval()
        except (TypeError, AssertionError, ValueError):  # takes no img_size (a CNN), or asserts on it (XCiT, Twins)
            model = timm.create_model(name, pretrained=False).eval()
    except RuntimeError as err:
        raise ValueError(f"unknown model {name!r}: neither a cgavit variant nor a timm model ({err})") from err
    for m in model.modules():
        if hasattr(m, "fused_attn"):
            m.fused_attn = False
    try:
        with torch.no_grad():
            model(torch.randn(1, 3, img_size, img_size))
    except (RuntimeError, AssertionError, ValueError) as err:  # timm's models assert on sizes they cannot run
        built = getattr(model, "pretrained_cfg", {}).get("input_size", ("?", "?", "?"))[1:]
        raise ValueError(f"timm's {name} cannot run {img_size}x{img_size} images ({' '.join(str(err).split())[:120]}); "
                         f"give another --img-size, e.g. the {built[0]}x{built[1]} it is made for") from None
    return model
