"""Each post-training int8 choice on one trained checkpoint, every layer int8: what it keeps of fp32's decisions.

The table behind the defaults of :class:`cgavit.deploy.Int8Options` (BENCHMARKS.md, "int8 on AVX2"). Every
row quantises the whole network (no layer kept in float) with one choice changed, calibrates on
``--calibration-images`` images of DIR/TRAIN and judges on DIR/VAL against the fused fp32 model: top-1
agreement (decisions changed), accuracy and its change, and the speed against fp32 ONNX Runtime,
timed round-robin in the same run (batch 16, 1 thread). ONNX Runtime rows call
``onnxruntime.quantization.quantize_static`` directly (so that choices ``cgavit`` does not offer can be
measured too); OpenVINO rows go through cgavit's NNCF recipe, except "as shipped" (NNCF's defaults).

Usage::

    python benchmarks/int8_choices.py --checkpoint runs/c10-5k-m0-96/best.safetensors \\
        --data cifar10-5k --val-split test [--which ort|ov|all]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from functools import partial
from pathlib import Path

import torch

from cgavit import load_model
from cgavit.bench import load_calibration, load_labelled
from cgavit.bench.precision import CALIBRATION_IMAGES
from cgavit.cli.types import image_folder, readable_file, whole_number
from cgavit.deploy import Int8Options, compare_logits, fuse
from cgavit.deploy.onnx import QUANTIZED_OPS, OnnxModule, even_batches, export_onnx
from cgavit.deploy.openvino import OpenVinoInt8Builder, OpenVinoModule, convert_openvino, kept_signal_stack
from cgavit.deploy.runtime import pad_batch
from cgavit.deploy.sensitivity import padded_logits
from cgavit.timing import round_robin


class Bench:
    """One checkpoint's fp32 reference and the calibration batches every choice shares."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.model, info = load_model(args.checkpoint)
        self.evaluation = load_labelled(args.data, args.val_split, info, args.eval_images)
        calibration = load_calibration(args.data, args.train_split, info, args.calibration_images)
        self.size = (info.img_size, info.img_size)
        self.scratch = tempfile.TemporaryDirectory(prefix="cgavit-bench-")  # removed with the bench
        self.tmp = Path(self.scratch.name)
        self.reference = padded_logits(fuse(self.model), self.evaluation.images)
        self.fp32 = OnnxModule(export_onnx(self.model, self.tmp / "fp32.onnx", self.size), 1)
        self.x = pad_batch(self.evaluation.images[:16], 16)
        self.batches = even_batches(calibration.images)
        acc = float((self.reference.argmax(1) == self.evaluation.labels).float().mean())
        print(f"## {args.checkpoint}: fp32 accuracy {100 * acc:.2f} % on {len(self.evaluation.images)} images, "
              f"calibrated on {len(calibration.images)}; load {open('/proc/loadavg').read().split()[:3]}\n")
        print("| choice (every layer int8) | top-1 agreement (changed) | accuracy (change) | x fp32 ONNX Runtime |")
        print("|---|---:|---:|---:|")

    def report(self, label: str, module) -> None:
        a = compare_logits(padded_logits(module, self.evaluation.images), self.reference, self.evaluation.labels)
        with torch.no_grad():
            t = round_robin({"int8": partial(module, self.x), "fp32": partial(self.fp32, self.x)}, 3, 15)
        speed = t["int8"].median_rate(16) / t["fp32"].median_rate(16)
        print(f"| {label} | {100 * a.top1_agreement:.2f} % ({a.changed}) | {100 * a.accuracy:.2f} % "
              f"({a.accuracy_change:+.2f}) | {speed:.2f} |", flush=True)

    def onnxruntime(self, label: str, **overrides) -> None:
        from onnxruntime import quantization as q
        from onnxruntime.quantization.shape_inference import quant_pre_process

        src, pre, out = self.tmp / "src.onnx", self.tmp / "pre.onnx", self.tmp / "int8.onnx"
        if not pre.exists():
            export_onnx(self.model, src, self.size, fold_residuals=False)
            quant_pre_process(str(src), str(pre), skip_symbolic_shape=True)
        options = dict(quant_format=q.QuantFormat.QDQ, per_channel=True, activation_type=q.QuantType.QUInt8,
                       weight_type=q.QuantType.QInt8, op_types_to_quantize=["Conv"],
                       extra_options={"CalibPercentile": 99.999})
        options.update(overrides)
        reader = iter([{"images": b.numpy()} for b in self.batches])
        q.quantize_static(str(pre), str(out), type("Reader", (), {"get_next": lambda _: next(reader, None)})(), **options)
        self.report("ONNX Runtime " + label, OnnxModule(out, 1, "int8"))

    def openvino(self, label: str, options: Int8Options | None = None) -> None:
        if options is None:
            import nncf

            with kept_signal_stack():  # NNCF compiles with OpenVINO Cores of its own
                model = nncf.quantize(convert_openvino(self.model, self.size, fold_residuals=False),
                                      nncf.Dataset([b.numpy() for b in self.batches]), subset_size=len(self.batches),
                                      preset=nncf.QuantizationPreset.MIXED, fast_bias_correction=False)
        else:
            model = OpenVinoInt8Builder(self.model, self.size, self.batches, options).build()
        self.report("OpenVINO " + label, OpenVinoModule(model, 1, "int8"))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", required=True, type=readable_file,
                   help="a trained checkpoint (cgavit train's best.safetensors)")
    p.add_argument("--data", required=True, type=image_folder,
                   help="image folder with DIR/TRAIN and DIR/VAL class folders")
    p.add_argument("--train-split", default="train", help="calibration split (default train)")
    p.add_argument("--val-split", default="val", help="evaluation split (default val)")
    p.add_argument("--calibration-images", type=whole_number(1), default=CALIBRATION_IMAGES,
                   help=f"calibration images (default {CALIBRATION_IMAGES})")
    p.add_argument("--eval-images", type=whole_number(0), default=0,
                   help="evaluation images (default 0: the whole split)")
    p.add_argument("--which", choices=("ort", "ov", "all"), default="all", help="runtimes to measure (default all)")
    args = p.parse_args()
    torch.set_num_threads(1)
    bench = Bench(args)
    start = time.time()
    if args.which in ("ort", "all"):
        from onnxruntime.quantization import CalibrationMethod as CM
        from onnxruntime.quantization import QuantType

        bench.onnxruntime("U8S8 8-bit weights, min-max (before this work)")
        bench.onnxruntime("U8S8 7-bit weights (reduce_range), min-max", reduce_range=True)
        bench.onnxruntime("U8U8 8-bit weights, min-max", weight_type=QuantType.QUInt8)
        bench.onnxruntime("7-bit, percentile 99.999, convolutions only", reduce_range=True, calibrate_method=CM.Percentile)
        bench.onnxruntime("7-bit, percentile 99.999, each ReLU quantised with its convolution (default)", reduce_range=True,
                          calibrate_method=CM.Percentile, op_types_to_quantize=list(QUANTIZED_OPS))
        bench.onnxruntime("7-bit, entropy", reduce_range=True, calibrate_method=CM.Entropy)
        bench.onnxruntime("7-bit, min-max, per-tensor weights", reduce_range=True, per_channel=False)
        bench.onnxruntime("7-bit, min-max, attention matmuls int8 too", reduce_range=True,
                          op_types_to_quantize=["Conv", "MatMul"])
    if args.which in ("ov", "all"):
        bench.openvino("as NNCF ships it (MIXED preset, full bias correction, overflow fix on the first layer)")
        bench.openvino("7-bit (overflow fix everywhere), attention int8", Int8Options(reduce_range=True, attention_float=False))
        bench.openvino("7-bit, attention float, min-max", Int8Options(reduce_range=True, calibration="minmax"))
        bench.openvino("7-bit, attention float, fast bias correction",
                       Int8Options(reduce_range=True, calibration="minmax", bias_correction="fast"))
        bench.openvino("7-bit, attention float, no bias correction",
                       Int8Options(reduce_range=True, calibration="minmax", bias_correction="none"))
        bench.openvino("7-bit, attention float, percentile (default)", Int8Options(reduce_range=True, calibration="percentile"))
        bench.openvino("7-bit, attention float, entropy", Int8Options(reduce_range=True, calibration="entropy"))
    print(f"\n({time.time() - start:.0f} s)")


if __name__ == "__main__":
    main()
