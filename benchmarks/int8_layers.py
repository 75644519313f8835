"""Each convolution's time in fp32 and in int8, in ONNX Runtime's and OpenVINO's own profilers, on this CPU.

What ``cgavit quantize`` measures before its search (:func:`cgavit.deploy.onnx.onnxruntime_conv_times`,
:func:`cgavit.deploy.openvino.openvino_conv_times`): where int8 pays and where it does not. The variant
(M4 by default, random weights: speed does not depend on the values) is quantised every layer int8
(4 random calibration batches) and profiled on one batch of 16 with 1 thread, the paper's CPU protocol.
Layers are grouped by kind (the stem, the downsampling patch-merge, the FFN pointwise convolutions,
the attention's q/k/v, query depthwise and projection convolutions, the token-interaction depthwise
ones, the squeeze-excitation); the layers int8 makes no faster are listed with their times
(BENCHMARKS.md, "int8 on AVX2").

Usage::

    python benchmarks/int8_layers.py [--model efficientvit_m4] [--img-size 224] [--runs 10]
"""

from __future__ import annotations

import argparse
import re
import tempfile
from collections import defaultdict
from pathlib import Path

from int8_speed import speed_probe  # this folder's speed protocol (run as python benchmarks/int8_layers.py)

from cgavit.cli.types import image_side, variant_name, whole_number
from cgavit.deploy import cpu_features
from cgavit.deploy.onnx import OnnxInt8Builder, export_onnx, onnxruntime_conv_times
from cgavit.deploy.openvino import OpenVinoInt8Builder, openvino_available, openvino_conv_times
from cgavit.deploy.sensitivity import no_faster_in_int8

#: Layer kinds, by the first pattern a layer's name matches.
KINDS = [("stem", r"^patch_embed\."), ("squeeze-excitation", r"\.se\."), ("patch-merge", r"\.patchmerge\."),
         ("attention q/k/v", r"\.attn\.[qkv]\.\d+$"), ("attention query depthwise", r"\.attn\.dws\."),
         ("attention projection", r"\.attn\.proj$"), ("FFN pointwise", r"\.m\.pw[12]$"),
         ("token-interaction depthwise", r"\.m$")]


def kind(layer: str) -> str:
    return next((name for name, pattern in KINDS if re.search(pattern, layer)), "other")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=variant_name, default="efficientvit_m4", help="variant (default efficientvit_m4)")
    p.add_argument("--img-size", type=image_side, default=224, help="input size (default 224)")
    p.add_argument("--runs", type=whole_number(1), default=10, help="profiled calls, the median kept (default 10)")
    args = p.parse_args()
    model, x, calibration, opts = speed_probe(args.model, args.img_size)
    size = (args.img_size, args.img_size)
    profiles = {}
    with tempfile.TemporaryDirectory() as tmp:
        src = export_onnx(model, Path(tmp) / "src.onnx", size, fold_residuals=False)
        with OnnxInt8Builder(src, calibration, opts) as builder:
            layers = list(builder.layers)
            profiles["ONNX Runtime"] = (onnxruntime_conv_times(src, x, layers, runs=args.runs),
                                        onnxruntime_conv_times(builder.build([]), x, layers, runs=args.runs))
    if openvino_available():
        ov = OpenVinoInt8Builder(model, size, calibration, opts)
        profiles["OpenVINO"] = (openvino_conv_times(ov.float_model, x, ov.layers, runs=args.runs),
                                openvino_conv_times(ov.build([]), x, ov.layers, runs=args.runs))
    print(f"{args.model}, {size[0]} px, batch 16, 1 thread, every layer int8 "
          f"({'7-bit' if opts.reduce_range else '8-bit'} weights); {cpu_features().describe()}; "
          f"load {open('/proc/loadavg').read().split()[:3]}\n")
    print("| runtime | layers | kind | fp32 ms | int8 ms | x faster in int8 |\n|---|---:|---|---:|---:|---:|")
    for runtime, (fp32, int8) in profiles.items():
        sums: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0.0])
        for layer in fp32:
            row = sums[kind(layer)]
            row[0] += 1
            row[1] += fp32[layer]
            row[2] += int8.get(layer, 0.0)
        sums["all convolutions"] = [len(fp32), sum(fp32.values()), sum(int8.get(k, 0.0) for k in fp32)]
        for name, (n, a, b) in sums.items():
            print(f"| {runtime} | {n} | {name} | {a:.2f} | {b:.2f} | {a / b if b else float('nan'):.2f} |")
    for runtime, (fp32, int8) in profiles.items():
        slow = no_faster_in_int8(fp32, int8)
        listed = ", ".join(f"`{s.layer}` {s.int8_ms:.2f} ms int8 against {s.fp32_ms:.2f} fp32" for s in slow)
        print(f"\n{runtime}: no faster in int8 (slower by >= 1 % of the fp32 convolution time): {listed or 'none'}")
        for layer in [k for k in fp32 if k.startswith("patch_embed.")]:
            print(f"  {layer}: fp32 {fp32[layer]:.2f} ms, int8 {int8.get(layer, float('nan')):.2f} ms")


if __name__ == "__main__":
    main()
