"""int8 speed at the paper's CPU protocol with a float/int8 split: timm's port, fp32 and int8 runtimes, one run.

Speed does not depend on the weights' values, so the variant (M4 by default) has random weights; the
layers kept in float are the ones a trained reference needed in each runtime (``cgavit quantize`` writes
every build it judged in ``NAME.quantize.json``, ``curves``; M0-M4 share their depths, so names carry over). Every path is
timed round-robin by :func:`cgavit.timing.round_robin` in the same run (batch 16, 1 thread, 224 px) and
reported as a ratio to timm's traced port and to fp32 ONNX Runtime (BENCHMARKS.md, "int8 on AVX2" and
"int8 on AMX"). On a CPU with native bf16 the OpenVINO builds are timed with their float part in bf16 and with
only the float layers in bf16 too (``openvino+bf16`` and ``openvino+bf16-layers`` curves of the reports), beside
the whole model in bf16 (OpenVINO, and torch.compile). ``--f16`` also times the OpenVINO int8 builds compiled with
``INFERENCE_PRECISION_HINT`` ``f16`` (their float part in f16, where OpenVINO offers FP16 on this CPU). ``--each``
times each report's OpenVINO split (fp32 float part) as a path of its own, in the same round-robin, to compare
two answers for one model.

Usage::

    python benchmarks/int8_speed.py --float-layers c96.quantize.json c64.quantize.json [--model efficientvit_m4]
    python benchmarks/int8_speed.py --float-layers old/c96s1.quantize.json new/c96s1.quantize.json --each
"""

from __future__ import annotations

import argparse
import json
import tempfile
from dataclasses import replace
from functools import partial
from pathlib import Path

import torch

import cgavit
from cgavit.bench import timm_port
from cgavit.bench.candidates import trace
from cgavit.cli.types import image_side, variant_name, whole_number
from cgavit.deploy import Int8Options, cpu_features
from cgavit.deploy.int8 import float_parts_for_cpu
from cgavit.deploy.onnx import OnnxInt8Builder, OnnxModule, export_onnx
from cgavit.deploy.openvino import OpenVinoInt8Builder, OpenVinoModule, convert_openvino
from cgavit.testing import randomize_
from cgavit.timing import round_robin


def float_layers(reports: list[str]) -> dict[str, list[str]]:
    """Per path (``onnxruntime``, ``openvino``, ``openvino+bf16``, ``openvino+bf16-layers``: runtime and float part), the union (in order) of
    the float layers that met the target in the ``cgavit quantize`` reports: each report's fewest that met it in
    each path it searched (its curves; where the report held images out of the search, on those images too)."""
    layers: dict[str, dict[str, None]] = {"onnxruntime": {}, "openvino": {}, "openvino+bf16": {}, "openvino+bf16-layers": {}}
    for path in reports:
        record = json.loads(Path(path).read_text())
        target, held_out = record["target"], record.get("held_out_images", 0) > 0

        def held_out_meets(point: dict) -> bool:  # the report's target on the held-out images
            h = point.get("held_out")
            return h is not None and h["agreement"] >= target["agreement"] - 1e-9 and (
                h["accuracy_change"] is None or abs(h["accuracy_change"]) <= target["accuracy_tolerance"] + 1e-9)

        for runtime, points in record["curves"].items():
            meeting = [p["float_layers"] for p in points if p["meets_target"] and (not held_out or held_out_meets(p))]
            if meeting:
                layers.setdefault(runtime, {}).update(dict.fromkeys(min(meeting, key=len)))
    return {runtime: list(names) for runtime, names in layers.items()}


def speed_probe(name: str, img_size: int) -> tuple[torch.nn.Module, torch.Tensor, list[torch.Tensor], Int8Options]:
    """The paper's CPU protocol for int8 speed: the variant with random weights (seed 0), one batch of 16, four
    random calibration batches, this CPU's int8 options; one torch thread."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = randomize_(cgavit.create_model(name, img_size=img_size), seed=0).eval()
    size = (img_size, img_size)
    calibration = [torch.randn(16, 3, *size) for _ in range(4)]
    return model, torch.randn(16, 3, *size), calibration, Int8Options().for_cpu(cpu_features())


def beside_fp32_onnxruntime(name: str, model: torch.nn.Module, x: torch.Tensor, paths: dict) -> None:
    """Time ``paths`` (label -> a module taking ``x``) beside ``model`` in fp32 ONNX Runtime, in one round-robin, and
    print the table (``name``: the variant, 224 px, batch 16, 1 thread)."""
    with tempfile.TemporaryDirectory(prefix="cgavit-bench-") as scratch:
        paths = {"fp32 ONNX Runtime": OnnxModule(export_onnx(model, Path(scratch) / "fp32.onnx", (224, 224)), 1), **paths}
    with torch.no_grad():
        times = round_robin({label: partial(m, x) for label, m in paths.items()}, 5, 20)
    ort = times["fp32 ONNX Runtime"].median_rate(16)
    print(f"\n{name}, 224 px, batch 16, 1 thread; load {open('/proc/loadavg').read().split()[:3]}\n")
    print("| path | img/s | x fp32 ONNX Runtime |\n|---|---:|---:|")
    for label, t in times.items():
        print(f"| {label} | {t.median_rate(16):.1f} | {t.median_rate(16) / ort:.2f} |")


def f16_builds(ov: OpenVinoInt8Builder, split: list[str], weights: str) -> dict[str, OpenVinoModule]:
    """OpenVINO's int8 builds (every layer int8, and ``split`` float) compiled with their float part in f16."""
    from cgavit.deploy.openvino import _core

    if "FP16" not in _core().get_property("CPU", "OPTIMIZATION_CAPABILITIES"):
        raise SystemExit(f"--f16: OpenVINO offers no FP16 on this CPU ({cpu_features().describe()})")
    builds = {}
    for layers in dict.fromkeys([(), tuple(split)]):
        module = OpenVinoModule(ov.build(list(layers)), 1, "int8")
        module.config["INFERENCE_PRECISION_HINT"] = "f16"  # OpenVinoModule offers f32 and bf16 only
        label = f"{len(layers)} layers float" if layers else "every layer int8"
        builds[f"int8 OpenVINO {weights}, {label}, f16 float part"] = module
    return builds


def each_report_builds(ov: OpenVinoInt8Builder, reports: list[str], weights: str) -> dict[str, OpenVinoModule]:
    """Each report's OpenVINO split (fp32 float part: its ``openvino`` curve) as its own int8 build, labelled by it."""
    builds = {}
    for report in reports:
        split = float_layers([report])["openvino"]
        if split:
            builds[f"int8 OpenVINO {weights}, {len(split)} layers float ({report})"] = OpenVinoModule(
                ov.build(split), 1, "int8")
    return builds


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--float-layers", nargs="*", default=[], metavar="REPORT",
                   help="cgavit quantize reports (NAME.quantize.json): in each runtime a report searched, the fewest "
                        "float layers that met its target stay float in that runtime's int8 build (the union "
                        "over the reports)")
    p.add_argument("--model", type=variant_name, default="efficientvit_m4", help="variant (default efficientvit_m4)")
    p.add_argument("--img-size", type=image_side, default=224, help="input size (default 224)")
    p.add_argument("--repeats", type=whole_number(1), default=20, help="timed rounds (default 20)")
    p.add_argument("--qat", action="store_true", help="also time the int8 file quantisation-aware fine-tuning writes "
                                                       "(cgavit quantize --qat; needs cgavit[qat])")
    p.add_argument("--qat-float", nargs="*", default=["patch_embed.conv1"], metavar="LAYER",
                   help="--qat: also time it with these layers float (default patch_embed.conv1)")
    p.add_argument("--f16", action="store_true", help="also time the OpenVINO int8 builds with their float part in f16 "
                                                       "(INFERENCE_PRECISION_HINT f16; needs FP16 in OpenVINO's CPU "
                                                       "capabilities, e.g. avx512_fp16)")
    p.add_argument("--each", action="store_true", help="also time each report's OpenVINO split (fp32 float part) as a "
                                                        "path of its own, in the same round-robin")
    args = p.parse_args()
    model, x, calibration, opts = speed_probe(args.model, args.img_size)
    size = (args.img_size, args.img_size)
    keep = float_layers(args.float_layers)
    scratch = tempfile.TemporaryDirectory(prefix="cgavit-bench-")  # removed when main returns
    tmp = Path(scratch.name)
    paths = {
        "timm traced port": trace(timm_port(model, args.model, size), x),
        "fp32 ONNX Runtime": OnnxModule(export_onnx(model, tmp / "fp32.onnx", size), 1),
        "fp32 OpenVINO": OpenVinoModule(convert_openvino(model, size), 1),
    }
    weights = "7-bit" if opts.reduce_range else "8-bit"
    src = export_onnx(model, tmp / "src.onnx", size, fold_residuals=False)
    with OnnxInt8Builder(src, calibration, opts) as builder:
        missing = [layer for layer in keep["onnxruntime"] if layer not in builder.layers]
        if missing:
            raise SystemExit(f"{args.model} has no layers {missing[:5]}: give reports of a variant of its depth")
        stem = [layer for layer in builder.layers if layer.startswith("patch_embed.")]
        paths[f"int8 ONNX Runtime {weights}, every layer int8"] = OnnxModule(builder.build([]), 1, "int8")
        paths[f"int8 ONNX Runtime {weights}, the stem ({len(stem)} layers) float"] = OnnxModule(builder.build(stem), 1, "int8")
        if keep["onnxruntime"]:
            paths[f"int8 ONNX Runtime {weights}, {len(keep['onnxruntime'])} layers float"] = OnnxModule(
                builder.build(keep["onnxruntime"]), 1, "int8")
    with OnnxInt8Builder(src, calibration, replace(opts, weights="uint8")) as builder:
        paths["int8 ONNX Runtime U8U8, every layer int8"] = OnnxModule(builder.build([]), 1, "int8")
    ov = OpenVinoInt8Builder(model, size, calibration, opts)
    missing = [layer for path in ("openvino", "openvino+bf16", "openvino+bf16-layers") for layer in keep[path]
               if layer not in ov.layers]
    if missing:
        raise SystemExit(f"{args.model} has no OpenVINO layers {missing[:5]}: give reports of a variant of its depth")
    parts = float_parts_for_cpu(cpu_features())
    if "bf16" in parts:
        paths["bf16 OpenVINO"] = OpenVinoModule(ov.float_model, 1, "bf16")
        paths["bf16 torch.compile"] = cgavit.optimize(model, x, "bf16", backend="torch", check=False)
    for part in parts:
        label, split = ("", keep["openvino"]) if part == "fp32" else (f", {part} float part", keep[f"openvino+{part}"])
        if part != "bf16-layers":  # every layer int8, it is the fp32 float part's build
            paths[f"int8 OpenVINO {weights}, every layer int8{label}"] = OpenVinoModule(ov.build([]), 1, "int8", part)
        if split:
            paths[f"int8 OpenVINO {weights}, {len(split)} layers float{label}"] = OpenVinoModule(
                ov.build(split, part), 1, "int8", part)
    if args.f16:
        paths.update(f16_builds(ov, keep["openvino"], weights))
    if args.each:
        paths.update(each_report_builds(ov, args.float_layers, weights))
    if args.qat:  # the file quantisation-aware fine-tuning writes (ranges from its observers; no training needed for speed)
        from cgavit.deploy.openvino import openvino_from_onnx
        from cgavit.deploy.qat import QatConfig, qat_finetune, qat_onnx

        for layers in dict.fromkeys([(), tuple(args.qat_float)]):
            graph = qat_finetune(model, torch.cat(calibration), bool(opts.reduce_range), QatConfig(epochs=0),
                                 float_layers=layers)
            path = tmp / f"qat{len(layers)}.onnx"
            path.write_bytes(qat_onnx(graph, x))
            label = f"{len(layers)} layers float" if layers else "every layer int8"
            paths[f"int8 QAT file (learnt ranges), ONNX Runtime, {label}"] = OnnxModule(path, 1, "int8")
            paths[f"int8 QAT file (learnt ranges), OpenVINO, {label}"] = OpenVinoModule(openvino_from_onnx(path), 1, "int8")
    print(f"{args.model}, {size[0]} px, batch 16, 1 thread; {cpu_features().describe()}; "
          f"load {open('/proc/loadavg').read().split()[:3]}\n")
    with torch.no_grad():
        times = round_robin({name: partial(m, x) for name, m in paths.items()}, 5, args.repeats)
    port, ort = times["timm traced port"].median_rate(16), times["fp32 ONNX Runtime"].median_rate(16)
    print("| path | img/s | x timm's port | x fp32 ONNX Runtime |\n|---|---:|---:|---:|")
    for name, t in times.items():
        rate = t.median_rate(16)
        print(f"| {name} | {rate:.1f} | {rate / port:.2f} | {rate / ort:.2f} |")


if __name__ == "__main__":
    main()
