"""The first convolution's int8 weights rounded with GPTQ, against NNCF's rounding.

For a trained checkpoint, cgavit's OpenVINO int8 builder is made twice on the same 256 calibration images of DIR/train:
with NNCF's rounding for every layer (``Int8Options(gptq_first_layer=False)``) and with GPTQ's for the first
convolution (the default: :mod:`cgavit.deploy.first_layer`). Each is judged top-1 against the fused fp32 model
on DIR/VAL with only the first convolution int8, every layer int8, and the first convolution float. Then M4 with
random weights is timed with every layer int8 both ways and with the first convolution float (224 px, batch 16,
1 thread, round-robin) beside fp32 ONNX Runtime. Under ``ONEDNN_MAX_CPU_ISA=AVX2`` the builds get 7-bit weights and AVX2's int8
kernels (their decisions only: BENCHMARKS.md, "AVX2's int8 arithmetic on any x86 CPU").

Usage::

    python benchmarks/int8_first_layer.py --checkpoint runs/c10-5k-m0-96-s1/best.safetensors \\
        --data cifar10-5k --val-split test [--skip-speed]
"""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import torch

from cgavit.cli.types import variant_name
from cgavit.deploy import compare_logits, cpu_features
from cgavit.deploy.openvino import OpenVinoInt8Builder, OpenVinoModule
from cgavit.deploy.sensitivity import padded_logits

sys.path.insert(0, str(Path(__file__).resolve().parent))
from int8_speed import beside_fp32_onnxruntime, speed_probe  # noqa: E402
from int8_where_lost import int8_base, reference_arguments  # noqa: E402

FIRST = "patch_embed.conv1"


def builds(builder: OpenVinoInt8Builder) -> dict:
    """Label -> int8 OpenVINO model: only the first convolution int8, every layer int8, the first convolution float."""
    others = [layer for layer in builder.layers if layer != FIRST]
    how = "GPTQ's" if builder.gptq_layer else "NNCF's"
    return {f"only the first convolution int8 ({how})": builder.build(others),
            f"every layer int8 ({how} first)": builder.build([]),
            f"every layer int8 but the first convolution ({how} builder)": builder.build([FIRST])}


def timed(name: str) -> None:
    """M4 with random weights, timed with every layer int8 (NNCF's and GPTQ's first convolution) and with the first
    convolution float, beside fp32 ONNX Runtime."""
    m4, x, calibration, opts = speed_probe(name, 224)
    paths = {}
    for gptq in (False, True):  # every layer int8 both ways, the first convolution float once
        made = builds(OpenVinoInt8Builder(m4, (224, 224), calibration, replace(opts, gptq_first_layer=gptq)))
        paths.update({label: OpenVinoModule(made[label], 1, "int8") for label in list(made)[1:3 - gptq]})
    beside_fp32_onnxruntime(name, m4, x, paths)


def main() -> None:
    p = reference_arguments(__doc__.split("\n\n")[0])
    p.add_argument("--model", type=variant_name, default="efficientvit_m4",
                   help="variant timed with random weights (default M4)")
    p.add_argument("--skip-speed", action="store_true", help="judge only")
    args = p.parse_args()
    info, fused, ev, reference, gptq, _ = int8_base(args)  # the default builder: GPTQ's first convolution
    plain = OpenVinoInt8Builder(fused, (info.img_size, info.img_size), [torch.from_numpy(b) for b in gptq.batches],
                                replace(gptq.options, gptq_first_layer=False))
    print(f"{args.checkpoint}: {len(ev.images)} images; {cpu_features().describe()}; weights "
          f"{'7' if plain.options.reduce_range else '8'}-bit\n")
    print("| build | top-1 agreement (changed) | accuracy change |\n|---|---:|---:|")
    for builder in (plain, gptq):
        for label, m in builds(builder).items():
            a = compare_logits(padded_logits(OpenVinoModule(m, 1, "int8"), ev.images), reference, ev.labels)
            print(f"| {label} | {100 * a.top1_agreement:.2f} % ({a.changed}) | {a.accuracy_change:+.2f} |", flush=True)
    if args.skip_speed:
        return
    timed(args.model)

if __name__ == "__main__":
    main()
