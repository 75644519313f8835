"""An int8 OpenVINO file judged with each float part: what a user who compiles it differently gets.

OpenVINO runs what int8 leaves in float in its inference precision, and on a CPU with native bf16 its
default is bf16 (BENCHMARKS.md, "int8 on AMX"). This compiles one ``.xml`` that ``cgavit quantize`` wrote
with ``INFERENCE_PRECISION_HINT`` ``f32`` and (where the CPU has native bf16) ``bf16``, and with its float
layers made bf16 convolutions (the ``bf16-layers`` float part; from a file with an fp32 or bf16 one), and judges each
against the checkpoint's fused fp32 model on DIR/VAL: top-1 agreement (decisions changed) and accuracy
change, beside the float part the file records in its metadata; where OpenVINO offers FP16 on this CPU (e.g.
``avx512_fp16``), with ``INFERENCE_PRECISION_HINT`` ``f16`` too. Nothing is timed.

Usage::

    python benchmarks/int8_float_part.py --file q3/c96.xml --checkpoint runs/c10-5k-m0-96/best.safetensors \\
        --data cifar10-5k --val-split test
"""

from __future__ import annotations

import argparse

import torch

from cgavit import load_model
from cgavit.bench import load_labelled
from cgavit.cli.types import image_folder, readable_file, whole_number
from cgavit.deploy import compare_logits, cpu_features, fuse, open_exported
from cgavit.deploy.int8 import float_parts_for_cpu
from cgavit.deploy.openvino import OpenVinoModule, _core, bf16_convolutions, convolution_nodes
from cgavit.deploy.sensitivity import padded_logits


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--file", required=True, type=readable_file,
                   help="an int8 OpenVINO .xml written by cgavit quantize (its .bin beside it)")
    p.add_argument("--checkpoint", required=True, type=readable_file, help="the checkpoint it was quantised from")
    p.add_argument("--data", required=True, type=image_folder, help="image folder with the evaluation split")
    p.add_argument("--val-split", default="val", help="evaluation split folder name (default val)")
    p.add_argument("--eval-images", type=whole_number(0), default=0,
                   help="evaluation images (default 0: the whole split)")
    args = p.parse_args()
    torch.set_num_threads(1)
    model, info = load_model(args.checkpoint)
    evaluation = load_labelled(args.data, args.val_split, info, args.eval_images)
    reference = padded_logits(fuse(model), evaluation.images)
    recorded, meta = open_exported(args.file)
    features = cpu_features()
    recorded_part = meta.int8.get("float_part", "fp32")
    print(f"{args.file}: int8, float part recorded as {recorded_part}, verdict {meta.int8.get('agreement')}; "
          f"{features.describe()}\n")
    print("| float part | top-1 agreement (changed) | accuracy (change) |\n|---|---:|---:|")
    for part in float_parts_for_cpu(features):
        graph = recorded.model
        if (part == "bf16-layers") != (recorded_part == "bf16-layers"):  # the float layers' convolutions change type
            if part != "bf16-layers":
                continue  # a bf16-layers file's fp32 graph is not in it
            nodes = convolution_nodes(graph)
            graph = bf16_convolutions(graph.clone(), [nodes[layer] for layer in meta.int8.get("float_layers", ())])
        module = OpenVinoModule(graph, 1, "int8", part)
        a = compare_logits(padded_logits(module, evaluation.images), reference, evaluation.labels)
        hint = module.config["INFERENCE_PRECISION_HINT"]
        print(f"| {part} (INFERENCE_PRECISION_HINT {hint}) | {100 * a.top1_agreement:.2f} % ({a.changed}) | "
              f"{100 * a.accuracy:.2f} % ({a.accuracy_change:+.2f}) |")
    if recorded_part != "bf16-layers" and "FP16" in _core().get_property("CPU", "OPTIMIZATION_CAPABILITIES"):
        module = OpenVinoModule(recorded.model, 1, "int8")
        module.config["INFERENCE_PRECISION_HINT"] = "f16"  # OpenVinoModule offers f32 and bf16 only
        a = compare_logits(padded_logits(module, evaluation.images), reference, evaluation.labels)
        print(f"| f16 (INFERENCE_PRECISION_HINT f16) | {100 * a.top1_agreement:.2f} % ({a.changed}) | "
              f"{100 * a.accuracy:.2f} % ({a.accuracy_change:+.2f}) |")


if __name__ == "__main__":
    main()
