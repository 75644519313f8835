"""``cgavit roofline``: per-operator FLOPs, bytes, intensity, time and compute/memory-bound verdict."""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import asdict

import torch

from ..bounds import THREADS_RANGE
from ..deploy import cpu_features
from ..analysis.roofline import (build, format_peaks, format_rows, format_summary, given_peaks, measure_peaks,
                                 profile_model, summarize)
from .common import image_size

#: Most input pixels one profiled batch may hold (batch x H x W): 768 MiB of fp32 RGB input, e.g. 1024 x 256 x 256.
MAX_BATCH_PIXELS = 2**26
#: (flag, lowest, highest) of the whole-number options.
INT_BOUNDS = (("--batch", 1, 4096), ("--threads", *THREADS_RANGE), ("--repeats", 1, 1000), ("--top", 1, 100_000))


def check_args(args: argparse.Namespace) -> None:
    """Raise ``ValueError`` naming the flag whose value is out of bounds."""
    image_size(args.img_size)
    for flag, lo, hi in INT_BOUNDS:
        value = getattr(args, flag[2:])
        if not lo <= value <= hi:
            raise ValueError(f"{flag} must be in {lo}..{hi}, got {value}")
    if args.batch * args.img_size**2 > MAX_BATCH_PIXELS:
        raise ValueError(
            f"--batch {args.batch} at --img-size {args.img_size} is {args.batch * args.img_size**2 / 1e6:.0f} "
            f"megapixels of input, above {MAX_BATCH_PIXELS / 1e6:.0f}; use a smaller batch or image"
        )
    if not (math.isfinite(args.peak_seconds) and 0 < args.peak_seconds <= 600):
        raise ValueError(f"--peak-seconds must be in (0, 600], got {args.peak_seconds}")
    for flag, value in (("--peak-gflops", args.peak_gflops), ("--bandwidth-gbs", args.bandwidth_gbs)):
        if value is not None and not (math.isfinite(value) and value > 0):
            raise ValueError(f"{flag} must be a positive number, got {value}")


def run(args: argparse.Namespace) -> int:
    check_args(args)
    torch.set_num_threads(args.threads)
    say = (lambda *a: None) if args.json else print  # --json: stdout is the JSON object alone
    models = {name: build(name, args.img_size) for name in ([args.model, args.compare] if args.compare else [args.model])}
    peaks = measure_peaks(seconds=args.peak_seconds)  # after the names are known good: it takes a while
    if args.peak_gflops or args.bandwidth_gbs:  # e.g. figures measured on a quiet machine
        peaks = given_peaks(peaks, args.peak_gflops, args.bandwidth_gbs)
    machine = cpu_features().describe()  # the peaks measured here are this CPU class's, not another's
    say(f"CPU: {machine}\n" + format_peaks(peaks, args.threads, args.peak_gflops, args.bandwidth_gbs))
    summaries, operators = {}, {}
    for name, model in models.items():
        x = torch.randn(args.batch, 3, args.img_size, args.img_size)
        rows = profile_model(model, x, peaks, repeats=args.repeats)
        summaries[name] = summarize(rows)
        operators[name] = [dict(asdict(r), intensity=r.intensity if r.bytes else None) for r in rows[:args.top]]
        say(f"\n{name}: batch {args.batch}, {args.img_size}px, fp32 — top operators by measured time")
        say(format_rows(rows, peaks, args.top))
    say("\n" + format_summary(summaries))
    say("FLOPs and bytes are per forward pass of the whole batch; a FLOP is one multiply or add, so a matmul or "
        "convolution counts 2 per multiply-accumulate (cgavit info counts MACs), element-wise operators their own "
        "per-element count. MB = 10^6 bytes. memory-bound: share of measured operator time in operators below the "
        "ridge point; views: share in operators that move no data (pure per-call overhead). Bytes assume every "
        "tensor is read and written once (caches ignored); times include each call's dispatch and profiler overhead.")
    if args.json:
        setup = dict(batch=args.batch, img_size=args.img_size, threads=args.threads, repeats=args.repeats,
                     peak_gflops=args.peak_gflops, bandwidth_gbs=args.bandwidth_gbs)  # given in place of measured
        print(json.dumps(dict(machine=machine, setup=setup, peaks=peaks, summaries=summaries, operators=operators),
                         indent=1))
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "roofline",
        help="per-operator FLOPs, bytes, intensity, time and compute/memory-bound verdict",
        description="Measure this machine's peak FLOP/s and bandwidth, then profile --repeats forward passes in "
        "fp32 (cgavit variants fused, timm models with random weights), per pass: per operator FLOPs (2 per "
        "multiply-accumulate), bytes moved, arithmetic intensity, measured time (torch.profiler) and whether it is "
        "compute- or memory-bound; the summary compares the memory-bound share with a standard ViT.",
    )
    p.add_argument("--model", default="efficientvit_m4", help="cgavit variant or timm model (default efficientvit_m4)")
    p.add_argument("--compare", default="deit_tiny_patch16_224",
                   help="second model side by side (default deit_tiny_patch16_224; '' for none)")
    p.add_argument("--batch", type=int, default=16, help="images per profiled forward pass (default 16)")
    p.add_argument("--img-size", type=int, default=224, help="input size in pixels, square (default 224)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads for the peaks and the profile (default 1, as cgavit bench on CPU)")
    p.add_argument("--repeats", type=int, default=3, help="profiled forward passes (default 3)")
    p.add_argument("--top", type=int, default=20,
                   help="rows to print per model, slowest first: one per operator and input shapes (default 20)")
    p.add_argument("--json", action="store_true", help="print only one JSON object: the CPU (model and class), the "
                   "setup (with the peaks given, null where measured), the peaks used, each model's summary and its "
                   "--top operator rows")
    p.add_argument("--peak-seconds", type=float, default=1.0, help="seconds per peak micro-benchmark (default 1; best rate kept)")
    p.add_argument("--peak-gflops", type=float, help="use this fp32 peak (GFLOP/s) instead of the measured one")
    p.add_argument("--bandwidth-gbs", type=float, help="use this bandwidth (GB/s, read+write) instead of the measured one")
    p.set_defaults(func=run)
