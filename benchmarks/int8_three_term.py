"""The sensitive layers as three int8 convolutions instead of one fp32 one: does it keep decisions, and is it faster?

On AMX an int8 convolution is many times faster than an fp32 one, so a layer that int8 cannot carry in one
convolution might be carried in several. Each named layer ``y = conv(x, W) + b`` becomes

    conv(q(x), q(W)) + conv(q'(x - q(x)), q(W)) + conv(q(x), q''(W - q(W))) + b

where ``q(x)`` quantises the input over the calibration images' min/max (zero on a level, as the int8 kernels have
it), ``q'`` its remainder (one step of ``q`` wide) with 8 bits of its own, ``q(W)`` the weights per output channel and ``q''`` their remainder per
output channel: about 16 bits for both operands, and only the remainder x remainder term left out. The bias is the
fp32 one. The base is cgavit's every-layer-int8 OpenVINO build with the layers float in fp32 (what ``cgavit
quantize`` answers), and the three-term form replaces them; each build is judged top-1 against the fused fp32
model on DIR/VAL, then timed on M4 with random weights (224 px, batch 16, 1 thread, round-robin) beside fp32 ONNX
Runtime, every layer int8, ``patch_embed.conv1`` alone float and the answer with it int8. The layers are a quantize
report's OpenVINO fp32-float-part answer (BENCHMARKS.md, "Fifth AMX session").

Usage::

    python benchmarks/int8_three_term.py --report q/c96s1.quantize.json \\
        --checkpoint runs/c10-5k-m0-96-s1/best.safetensors --data cifar10-5k --val-split test
"""

from __future__ import annotations

import sys
from functools import partial
from pathlib import Path

import numpy as np
import openvino as ov
import torch

from cgavit.cli.types import readable_file, variant_name
from cgavit.deploy import compare_logits, cpu_features
from cgavit.deploy.openvino import OpenVinoInt8Builder, OpenVinoModule
from cgavit.deploy.sensitivity import padded_logits

sys.path.insert(0, str(Path(__file__).resolve().parent))
from int8_adaround import conv_inputs  # noqa: E402
from int8_bf16_float_layers import fp32_answer  # noqa: E402
from int8_speed import beside_fp32_onnxruntime, speed_probe  # noqa: E402
from int8_where_lost import int8_base, reference_arguments  # noqa: E402

OPS = ov.opset13


def input_ranges(float_model, nodes: list[str], batches: list[np.ndarray]) -> dict[str, tuple[float, float]]:
    """Each named convolution's input min and max over the calibration batches, in the fp32 model."""
    images = torch.from_numpy(np.concatenate(batches))
    return {node: (float(x.min()), float(x.max())) for node in nodes for x in [conv_inputs(float_model, node, images)]}


def _fq(value, low, high, levels: int):
    """An OpenVINO FakeQuantize of ``value`` over [low, high] (scalars or per-channel arrays) in ``levels`` levels."""
    c = partial(np.asarray, dtype=np.float32)
    return OPS.fake_quantize(value, c(low), c(high), c(low), c(high), levels)


def _weight_fq(w: np.ndarray):
    """``w`` quantised symmetric per output channel (255 levels), and the fp32 remainder."""
    amax = np.maximum(np.abs(w.reshape(len(w), -1)).max(1), 1e-12).reshape([-1] + [1] * (w.ndim - 1))
    step = amax / 127.0
    rest = w - np.clip(np.round(w / step), -127, 127) * step
    return _fq(OPS.constant(w.astype(np.float32)), -amax, amax, 255), rest


def three_term(model, ranges: dict[str, tuple[float, float]], terms: int = 3):
    """``model`` (fp32 float layers named in ``ranges``) with each of those convolutions as ``terms`` int8 ones
    (3: the module notes; 2: without the weights' remainder; 1: the input over its min/max and 8-bit weights)."""
    out = model.clone()
    ops = {op.get_friendly_name(): op for op in out.get_ordered_ops()}
    for name, (low, high) in ranges.items():
        conv = ops[name]
        make = OPS.group_convolution if conv.get_type_name() == "GroupConvolution" else OPS.convolution
        kw = dict(strides=list(conv.get_strides()), pads_begin=list(conv.get_pads_begin()),
                  pads_end=list(conv.get_pads_end()), dilations=list(conv.get_dilations()))
        x = conv.input_value(0)
        w = conv.input_value(1).get_node().get_data().astype(np.float32)
        step = (high - min(low, 0.0)) / 255.0
        zero = round(-min(low, 0.0) / step)  # zero exactly on a level: else the kernels' rounded zero point is not
        # what the graph's remainder was taken from (the log: logits off by 1e-2 on the layers with signed inputs)
        low, high = -zero * step, (255 - zero) * step
        xq = _fq(x, low, high, 256)
        wq, w_rest = _weight_fq(w)
        total = make(xq, wq, **kw)
        if terms >= 2:
            x_rest = _fq(OPS.subtract(x, xq), -128 * step / 254, 127 * step / 254, 256)
            total = OPS.add(total, make(x_rest, wq, **kw))
        if terms >= 3:
            w_rest_q, _ = _weight_fq(w_rest)
            total = OPS.add(total, make(xq, w_rest_q, **kw))
        for reader in list(conv.output(0).get_target_inputs()):
            reader.replace_source_output(total.output(0))
    out.validate_nodes_and_infer_types()
    return out


def variants(builder: OpenVinoInt8Builder, layers: list[str]) -> dict:
    """Label -> OpenVINO int8 model: every layer int8, ``patch_embed.conv1`` alone fp32, ``layers`` fp32 (the answer),
    ``layers`` but ``patch_embed.conv1`` fp32, and ``layers`` as 1, 2 and 3 int8 terms (with ``patch_embed.conv1`` fp32
    too). The three-term inputs' ranges are measured on the builder's calibration batches."""
    first = "patch_embed.conv1"
    ranges = input_ranges(builder.float_model, [builder.layers[n] for n in layers], builder.batches)
    answer = builder.build(layers)
    builds = {"every layer int8": builder.build([]), f"{first} alone fp32": builder.build([first]),
              "the answer: the layers fp32": answer,
              f"the answer but {first} int8": builder.build([n for n in layers if n != first]),
              **{f"the layers as {t} int8 term(s)": three_term(answer, ranges, t) for t in (1, 2, 3)}}
    builds[f"the layers as 3 int8 terms, {first} fp32"] = three_term(
        answer, {node: r for node, r in ranges.items() if node != builder.layers.get(first)}, 3)
    return builds


def main() -> None:
    p = reference_arguments(__doc__.split("\n\n")[0])
    p.add_argument("--report", required=True, type=readable_file,
                   help="a cgavit quantize report with an OpenVINO fp32-float-part answer")
    p.add_argument("--layers", nargs="*", help="the layers instead of the report's answer")
    p.add_argument("--model", type=variant_name, default="efficientvit_m4",
                   help="variant timed with random weights (default M4)")
    args = p.parse_args()
    layers = args.layers or fp32_answer(args.report)
    _, _, ev, reference, builder, _ = int8_base(args)
    print(f"{args.checkpoint}: {len(ev.images)} images; {len(layers)} layers: {', '.join(layers)}; "
          f"{cpu_features().describe()}\n")
    print("| build | top-1 agreement (changed) | accuracy change |\n|---|---:|---:|")
    for label, m in variants(builder, layers).items():
        a = compare_logits(padded_logits(OpenVinoModule(m, 1, "int8"), ev.images), reference, ev.labels)
        print(f"| {label} | {100 * a.top1_agreement:.2f} % ({a.changed}) | {a.accuracy_change:+.2f} |", flush=True)
    m4, x, m4_calibration, opts = speed_probe(args.model, 224)
    beside_fp32_onnxruntime(args.model, m4, x, {label: OpenVinoModule(m, 1, "int8") for label, m in
                            variants(OpenVinoInt8Builder(m4, (224, 224), m4_calibration, opts), layers).items()})


if __name__ == "__main__":
    main()
