"""How far quantisation-aware fine-tuning's schedule moves a trained model's int8 decisions.

``cgavit quantize --qat`` fine-tunes for ``--epochs`` on the training split with fixed settings. This
fine-tunes once with the schedule given here (training images, epochs, learning rate, distillation
temperature, convolutions left float), writes the int8 file as ``--qat`` does
(:func:`cgavit.deploy.qat.qat_onnx`, the ranges it learnt) and judges it in ONNX Runtime and in OpenVINO
(float part fp32) against the checkpoint's fused fp32 model on DIR/VAL: top-1 agreement (decisions changed),
accuracy change. One markdown row per runtime, to collect in BENCHMARKS.md ("int8 on AMX"). Nothing is timed:
the file's speed does not depend on the schedule (``python benchmarks/int8_speed.py --qat``).

Usage::

    python benchmarks/int8_qat_schedule.py --checkpoint runs/c10-5k-m0-96-s1/best.safetensors --data cifar10 \\
        --val-split test --train-images 5000 --epochs 10
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from cgavit import load_model
from cgavit.bench import load_labelled
from cgavit.bench.precision import load_calibration
from cgavit.cli.types import image_folder, readable_file, whole_number
from cgavit.deploy import compare_logits, cpu_features, fuse
from cgavit.deploy.int8 import Int8Options
from cgavit.deploy.openvino import openvino_from_onnx
from cgavit.deploy.qat import QatConfig, qat_finetune, qat_onnx
from cgavit.deploy.quantize import int8_module
from cgavit.deploy.sensitivity import padded_logits


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", required=True, type=readable_file, help="the trained checkpoint")
    p.add_argument("--data", required=True, type=image_folder,
                   help="image folder with the training and evaluation splits")
    p.add_argument("--train-split", default="train", help="images to fine-tune on (default train)")
    p.add_argument("--val-split", default="val", help="images to judge on (default val)")
    p.add_argument("--train-images", type=whole_number(1), default=5000, help="training images (default 5000)")
    p.add_argument("--eval-images", type=whole_number(0), default=0,
                   help="evaluation images (default 0: the whole split)")
    p.add_argument("--epochs", type=whole_number(0), default=2,
                   help="fine-tuning epochs (default 2, as --qat; 0: ranges alone)")
    p.add_argument("--lr", type=float, default=1e-5, help="AdamW learning rate (default 1e-5, as --qat)")
    p.add_argument("--temperature", type=float, default=1.0, help="distillation temperature (default 1)")
    p.add_argument("--float-layers", nargs="*", default=[], metavar="LAYER",
                   help="convolutions left float (export-form names, e.g. patch_embed.conv1)")
    args = p.parse_args()
    torch.set_num_threads(1)
    model, info = load_model(args.checkpoint)
    evaluation = load_labelled(args.data, args.val_split, info, args.eval_images)
    train = load_calibration(args.data, args.train_split, info, args.train_images)
    opts = Int8Options().for_cpu(cpu_features())
    config = QatConfig(epochs=args.epochs, lr=args.lr, temperature=args.temperature)
    start = time.perf_counter()
    tuned = qat_finetune(model, train.images.float(), bool(opts.reduce_range), config,
                         calibration=train.images[:256].float(), float_layers=args.float_layers)
    seconds = time.perf_counter() - start
    data = qat_onnx(tuned, evaluation.images[:2])
    reference = padded_logits(fuse(model), evaluation.images)
    schedule = (f"{len(train.images)} images x {args.epochs} epochs, lr {args.lr:g}, T {args.temperature:g}, "
                f"float: {', '.join(args.float_layers) or 'none'} ({seconds:.0f} s)")
    print(f"{cpu_features().describe()}; {len(evaluation.images)} images of {evaluation.source}, "
          f"fp32 top-1 {100 * float((reference.argmax(1) == evaluation.labels).double().mean()):.2f} %\n")
    print("| schedule | runtime | top-1 agreement (changed) | accuracy change |\n|---|---|---:|---:|")
    with tempfile.TemporaryDirectory(prefix="qat-schedule-") as tmp:
        path = Path(tmp) / "qat.onnx"
        path.write_bytes(data)
        for runtime, artifact in (("onnxruntime", data), ("openvino", openvino_from_onnx(path))):
            a = compare_logits(padded_logits(int8_module(runtime, artifact, 1), evaluation.images), reference,
                               evaluation.labels)
            print(f"| {schedule} | {runtime} | {100 * a.top1_agreement:.2f} % ({a.changed}) | "
                  f"{a.accuracy_change:+.2f} |")

if __name__ == "__main__":
    main()
