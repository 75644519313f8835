"""Which of an int8 answer's float layers could run in bf16 instead of fp32, and what each choice buys.

``cgavit quantize`` keeps a few layers float in one precision: fp32, or bf16 for all of them (the ``bf16-layers``
float part, where bf16 is native). When the answer it returns has an fp32 float part, this asks whether a mix would
do better: some float layers as bf16 convolutions, the rest fp32, the rest of the float part fp32. From the report's
OpenVINO fp32 answer (the fewest float layers that met the target on both halves), it builds that answer and
variants with subsets of its float layers in bf16 (all; the stem's; the patch merges'; each stage's merge; the
stem's without its first convolution; with ``--each``, every layer alone). Each is judged on the checkpoint's
DIR/VAL against its fused fp32 model (decisions changed, accuracy change), and timed on a variant with random
weights (M4 by default, 224 px, batch 16, 1 thread, round-robin, beside fp32 ONNX Runtime and every layer int8):
M0-M4 share their layer names. Needs a CPU with native bf16 (BENCHMARKS.md, "int8 on AMX").

Usage::

    python benchmarks/int8_bf16_float_layers.py --report q/c96s1.quantize.json \\
        --checkpoint runs/c10-5k-m0-96-s1/best.safetensors --data cifar10-5k --val-split test
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from functools import partial
from pathlib import Path

import torch

from cgavit import load_model
from cgavit.bench import load_calibration, load_labelled
from cgavit.cli.types import image_folder, readable_file, variant_name
from cgavit.deploy import Int8Options, compare_logits, cpu_features, fuse
from cgavit.deploy.onnx import OnnxModule, even_batches, export_onnx
from cgavit.deploy.openvino import OpenVinoInt8Builder, OpenVinoModule, bf16_convolutions
from cgavit.deploy.sensitivity import padded_logits
from cgavit.timing import round_robin

sys.path.insert(0, str(Path(__file__).resolve().parent))
from int8_speed import float_layers, speed_probe  # noqa: E402  (shared with the speed script)


def fp32_answer(report: str) -> list[str]:
    """The float layers of the report's smallest OpenVINO fp32-float-part build that met its target (on both halves,
    where it held images out): :func:`int8_speed.float_layers`'s rule, for one report."""
    layers = float_layers([report])["openvino"]
    if not layers:
        raise SystemExit(f"{report}: no OpenVINO fp32-float-part build with float layers met the target")
    return layers


def variants(layers: list[str], each: bool) -> dict[str, list[str]]:
    """Label -> the float layers made bf16 convolutions (the others stay fp32)."""
    stem = [name for name in layers if name.startswith("patch_embed.")]
    merges = [name for name in layers if ".downsample." in name]
    subsets = {"every float layer bf16": layers, "the stem's bf16": stem, "the patch merges' bf16": merges,
               "the stem's but patch_embed.conv1 bf16": [n for n in stem if n != "patch_embed.conv1"]}
    for stage in sorted({name.split(".")[1] for name in merges}):
        subsets[f"stage {stage}'s merge bf16"] = [n for n in merges if n.startswith(f"stages.{stage}.")]
    if each:
        subsets.update({f"{name} bf16": [name] for name in layers})
    return {"every float layer fp32 (the answer)": [], **{k: v for k, v in subsets.items() if v}}


def build(builder: OpenVinoInt8Builder, layers: list[str], bf16: list[str]) -> OpenVinoModule:
    """The int8 build with ``layers`` float, ``bf16`` of them bf16 convolutions, compiled with an fp32 float part."""
    model = builder.build(layers)
    return OpenVinoModule(bf16_convolutions(model, [builder.layers[n] for n in bf16]), 1, "int8", "fp32")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--report", required=True, type=readable_file,
                   help="a cgavit quantize report (NAME.quantize.json) with an OpenVINO search")
    p.add_argument("--checkpoint", required=True, type=readable_file, help="the checkpoint the report quantised")
    p.add_argument("--data", required=True, type=image_folder,
                   help="image folder with DIR/train and DIR/VAL class folders")
    p.add_argument("--val-split", default="val", help="evaluation split (default val)")
    p.add_argument("--model", type=variant_name, default="efficientvit_m4",
                   help="variant timed with random weights (default efficientvit_m4)")
    p.add_argument("--each", action="store_true", help="also each float layer alone in bf16")
    args = p.parse_args()
    if not cpu_features().native_bf16:
        raise SystemExit(f"no native bf16 on this CPU ({cpu_features().describe()}): bf16 float layers are not a choice here")
    torch.set_num_threads(1)
    layers = fp32_answer(args.report)
    subsets = variants(layers, args.each)
    model, info = load_model(args.checkpoint)
    ev = load_labelled(args.data, args.val_split, info, 0)
    calibration = even_batches(load_calibration(args.data, "train", info).images)
    size = (info.img_size, info.img_size)
    reference = padded_logits(fuse(model), ev.images)
    builder = OpenVinoInt8Builder(model, size, calibration, Int8Options().for_cpu(cpu_features()))
    judged = {label: compare_logits(padded_logits(build(builder, layers, bf16), ev.images), reference, ev.labels)
              for label, bf16 in subsets.items()}
    m4, x, m4_calibration, opts = speed_probe(args.model, 224)
    scratch = tempfile.TemporaryDirectory(prefix="cgavit-bench-")  # removed when main returns
    m4_builder = OpenVinoInt8Builder(m4, (224, 224), m4_calibration, opts)
    paths = {"fp32 ONNX Runtime": OnnxModule(export_onnx(m4, Path(scratch.name) / "fp32.onnx", (224, 224)), 1),
             "every layer int8": OpenVinoModule(m4_builder.build([]), 1, "int8", "fp32")}
    paths.update({label: build(m4_builder, layers, bf16) for label, bf16 in subsets.items()})
    with torch.no_grad():
        times = round_robin({label: partial(m, x) for label, m in paths.items()}, 5, 20)
    ort = times["fp32 ONNX Runtime"].median_rate(16)
    print(f"{args.checkpoint}: {len(ev.images)} images of {args.data}/{args.val_split}; the answer's {len(layers)} float "
          f"layers: {', '.join(layers)}\n{args.model} timed at 224 px, batch 16, 1 thread; {cpu_features().describe()}\n")
    print("| float layers in bf16 | top-1 agreement (changed) | accuracy change | img/s | x fp32 ONNX Runtime |")
    print("|---|---:|---:|---:|---:|")
    for label, t in times.items():
        a = judged.get(label)
        verdict = f"{100 * a.top1_agreement:.2f} % ({a.changed}) | {a.accuracy_change:+.2f}" if a else "– | –"
        print(f"| {label} | {verdict} | {t.median_rate(16):.1f} | {t.median_rate(16) / ort:.2f} |")


if __name__ == "__main__":
    main()
