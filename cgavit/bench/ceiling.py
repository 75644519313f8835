"""The fp32 ceiling beside the main table: how fast any fp32 path could run these FLOPs on this CPU.

A variant's multiply-accumulates per image (``torch.utils.flop_counter`` on the model) at the
machine's measured fp32 matmul peak (a large square matmul at the protocol's threads, the best rate
of several, :func:`cgavit.analysis.roofline.measure_peaks`) give the images/s no fp32 implementation
can exceed without doing fewer FLOPs: every convolution and matmul at the speed of the best-case
GEMM, and nothing else costing anything. Its ratio to timm's port, measured in the same run, bounds
every "x timm port" figure of the table; the best path's share of the ceiling says how much is left.
"""

from __future__ import annotations

from typing import TypedDict

from ..analysis.roofline import measure_peaks
from ..factory import create_model
from ..info import count_macs
from .candidates import Result


class CeilingRow(TypedDict):
    """One variant's fp32 ceiling (what bench.json stores under ``fp32_ceiling``)."""

    model: str
    gflop_per_image: float  # 2 x multiply-accumulates, one image
    peak_gflops: float  # this CPU's measured fp32 matmul rate at the protocol's threads
    ceiling_img_s: float  # peak / FLOPs per image
    timm_img_s: float  # timm's port, same run
    ceiling_ratio_to_timm: float
    best_path: str  # our fastest row of the table
    best_ratio_to_timm: float
    share_of_ceiling: float  # best path img/s / ceiling img/s


def fp32_ceilings(results: list[Result], img_size: tuple[int, int], peak_seconds: float = 0.5) -> list[CeilingRow]:
    """The ceiling of every variant in ``results`` that has a timm port row (measured just now)."""
    ports = {r.variant: r for r in results if r.kind == "timm-port"}
    if not ports:
        return []
    peak = measure_peaks(seconds=peak_seconds)["flops"]
    rows = []
    for variant, port in ports.items():
        ours = [r for r in results if r.kind == "ours" and r.variant == variant]
        best = max(ours, key=lambda r: r.median)
        flops = 2.0 * count_macs(create_model(variant, img_size=img_size), img_size)
        ceiling = peak / flops
        rows.append(CeilingRow(
            model=variant, gflop_per_image=flops / 1e9, peak_gflops=peak / 1e9, ceiling_img_s=ceiling,
            timm_img_s=port.median, ceiling_ratio_to_timm=ceiling / port.median, best_path=best.name,
            best_ratio_to_timm=best.median / port.median, share_of_ceiling=best.median / ceiling))
    return rows


def format_ceilings(rows: list[CeilingRow]) -> str:
    """One line per variant, under the main table."""
    return "\n".join(
        f"fp32 ceiling {r['model']}: {r['gflop_per_image']:.3f} GFLOP/image at this CPU's measured fp32 matmul "
        f"peak ({r['peak_gflops']:.0f} GFLOP/s) = {r['ceiling_img_s']:.0f} img/s at most, "
        f"{r['ceiling_ratio_to_timm']:.2f}x the timm port in this run; the fastest path here "
        f"({r['best_path'].split(' ', 2)[-1]}, {r['best_ratio_to_timm']:.2f}x) runs at "
        f"{100 * r['share_of_ceiling']:.0f}% of it"
        for r in rows
    )
