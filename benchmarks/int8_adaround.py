"""Would learnt rounding let the sensitive layers stay int8? AdaRound on cgavit's OpenVINO int8 build.

The ninth AVX2 session found that the decisions int8 changes turn on the rounding of the stem's and the patch merges'
convolutions, not on their activation ranges. AdaRound (Nagel et al., ICML 2020) chooses, for each int8 weight,
whether to round it up or down so that the layer's output stays closest to fp32's on calibration images. Here it
runs on cgavit's every-layer-int8 OpenVINO build (NNCF, this CPU's weight range), layer by layer in graph order, on
the inputs the quantised model gives each layer (so a layer can make up for the error before it, and for its own
input quantiser), with its soft rounding annealed to 0/1 (a rectified sigmoid, its regulariser's exponent 20 -> 2,
Adam, the first fifth of the steps without it); then the layer's bias is set to fp32's plus the mean output error
its new rounding leaves on those images (NNCF's bias correction was for the old rounding). The build is judged
top-1 against the fused fp32 model on DIR/VAL beside NNCF's rounding, with every layer int8 and with ``patch_embed.conv1``
float. Per layer it prints the output error on the calibration images with round-to-nearest and with AdaRound.
Under ``ONEDNN_MAX_CPU_ISA=AVX2`` the weights are 7-bit and OpenVINO decides as on an AVX2 CPU (BENCHMARKS.md).

Usage::

    python benchmarks/int8_adaround.py --checkpoint runs/c10-5k-m0-96-s1/best.safetensors --data cifar10-5k --val-split test
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import openvino as ov
import torch
import torch.nn.functional as F

from cgavit.cli.types import whole_number
from cgavit.deploy import compare_logits, cpu_features
from cgavit.deploy.openvino import OpenVinoModule, _folded_weights, compile_cpu, restore_float_layers
from cgavit.deploy.sensitivity import padded_logits

sys.path.insert(0, str(Path(__file__).resolve().parent))
from int8_where_lost import int8_base, reference_arguments  # noqa: E402  (this folder's base build)

OPS = ov.opset13
#: AdaRound's rectified sigmoid stretches to [GAMMA, ZETA] before clipping to [0, 1].
ZETA, GAMMA = 1.1, -0.1


def soft_rounding(v: torch.Tensor) -> torch.Tensor:
    return torch.clamp(torch.sigmoid(v) * (ZETA - GAMMA) + GAMMA, 0, 1)


def conv_inputs(model, node: str, images: torch.Tensor, batch: int = 32) -> torch.Tensor:
    """What the named convolution node of an ``openvino.Model`` reads, over ``images`` (whole batches only)."""
    m = model.clone()
    ops = {op.get_friendly_name(): op for op in m.get_ordered_ops()}
    m.add_outputs([ops[node].input_value(0)])
    m.reshape([batch, *images.shape[1:]])
    compiled = compile_cpu(m, {"INFERENCE_PRECISION_HINT": "f32", "INFERENCE_NUM_THREADS": 1})
    return torch.cat([torch.from_numpy(compiled(x.numpy())[compiled.outputs[1]].copy())
                      for x in images.split(batch) if len(x) == batch])


def torch_conv(node):
    """The convolution node's arithmetic in torch: ``f(x, weights)``, grouped convolutions included."""
    strides, pads, dilations = list(node.get_strides()), list(node.get_pads_begin()), list(node.get_dilations())
    if list(node.get_pads_end()) != pads:
        raise SystemExit(f"{node.get_friendly_name()}: asymmetric padding is not handled here")

    def f(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        if node.get_type_name() == "GroupConvolution":  # (groups, out/groups, in/groups, kh, kw)
            w = w.reshape(w.shape[0] * w.shape[1], *w.shape[2:])
            return F.conv2d(x, w, None, strides, pads, dilations, groups=x.shape[1] // w.shape[1])
        return F.conv2d(x, w, None, strides, pads, dilations)
    return f


def adaround(conv, x_int8: torch.Tensor, x_fp32: torch.Tensor, weights: torch.Tensor, scale: torch.Tensor, qmax: float,
             steps: int, reg: float = 0.01, batch: int = 32):
    """Integer weights, each ``floor(w / scale)`` or one more, that keep ``conv(x_int8, scale * q)`` closest to
    ``conv(x_fp32, weights)``; with the output error (mean square) of round-to-nearest and of the result, and the
    result's per-image error maps ``(N, out, H, W)``."""
    floor = torch.floor(weights / scale)
    rest = (weights / scale - floor).clamp(0.01, 0.99)
    v = (-torch.log((ZETA - GAMMA) / (rest - GAMMA) - 1)).requires_grad_(True)  # soft_rounding(v) == rest
    opt = torch.optim.Adam([v], lr=1e-3)
    with torch.no_grad():
        target = conv(x_fp32, weights)
    g, warm = torch.Generator().manual_seed(0), steps // 5
    for step in range(steps):
        idx = torch.randint(0, len(x_int8), (batch,), generator=g)
        loss = F.mse_loss(conv(x_int8[idx], scale * torch.clamp(floor + soft_rounding(v), -qmax, qmax)), target[idx])
        if step >= warm:
            beta = 20 + (2 - 20) * (step - warm) / (steps - warm)
            loss = loss + reg * (1 - (2 * soft_rounding(v) - 1).abs().pow(beta)).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        q = torch.clamp(floor + (soft_rounding(v) >= 0.5).float(), -qmax, qmax)
        nearest = torch.clamp(torch.round(weights / scale), -qmax, qmax)
        residual = target - conv(x_int8, scale * q)
        return q, float(F.mse_loss(conv(x_int8, scale * nearest), target)), float(residual.pow(2).mean()), residual


def int8_weights(conv):
    """The int8 constant, ``Convert`` and per-channel scale NNCF feeds a convolution's weights through."""
    mul = conv.input_value(1).get_node()
    a, b = mul.input_value(0).get_node(), mul.input_value(1).get_node()
    convert, scale = (a, b) if a.get_type_name() == "Convert" else (b, a)
    return convert.input_value(0).get_node(), convert, scale


def main() -> None:
    p = reference_arguments(__doc__.split("\n\n")[0])
    p.add_argument("--layers", nargs="*", default=None,
                   help="layers to round anew (default: the stem's convolutions and the patch merges')")
    p.add_argument("--steps", type=whole_number(1), default=1000, help="optimisation steps per layer (default 1000)")
    args = p.parse_args()
    info, _, ev, reference, builder, _ = int8_base(args)
    calibration = builder.batches[0]
    images = torch.from_numpy(calibration)
    layers = args.layers or [n for n in builder.layers if n.startswith("patch_embed.") or ".patchmerge.conv" in n]
    nncf_rounding = builder.build([])
    model = nncf_rounding.clone()
    ops = {op.get_friendly_name(): op for op in model.get_ordered_ops()}
    plain = {op.get_friendly_name(): op for op in builder.float_model.get_ordered_ops()}
    print(f"{args.checkpoint}: {len(ev.images)} images judged, AdaRound on {len(images)} calibration images; "
          f"{cpu_features().describe()}\n")
    print("| layer | int8 weight range | output error, nearest | AdaRound | weights changed |\n|---|---:|---:|---:|---:|")
    for layer in [n for n in builder.layers if n in layers]:
        node = builder.layers[layer]
        conv, original = ops[node], plain[node]
        constant, convert, scale = int8_weights(conv)
        q_nncf = constant.get_data().astype(np.float32)
        qmax = float(np.abs(q_nncf).max())
        weights = torch.from_numpy(_folded_weights(original).reshape(q_nncf.shape))
        q, nearest, learnt, residual = adaround(
            torch_conv(conv), conv_inputs(model, node, images), conv_inputs(builder.float_model, node, images),
            weights, torch.from_numpy(scale.get_data().astype(np.float32)), qmax, args.steps)
        convert.input(0).replace_source_output(OPS.constant(q.numpy().astype(np.int8)).output(0))
        shift = residual.double().mean(dim=(0, 2, 3)).float().numpy()
        for reader in conv.output(0).get_target_inputs():  # the bias: fp32's, plus the mean error left
            add, twin = reader.get_node(), plain.get(reader.get_node().get_friendly_name())
            if add.get_type_name() != "Add" or twin is None:
                continue
            for i in range(2):
                kinds = (add.input_value(i).get_node().get_type_name(), twin.input_value(i).get_node().get_type_name())
                if kinds == ("Constant", "Constant"):
                    bias = twin.input_value(i).get_node().get_data().astype(np.float32)
                    add.input(i).replace_source_output(OPS.constant(bias + shift.reshape(bias.shape)).output(0))
        model.validate_nodes_and_infer_types()
        changed = 100 * float((q.numpy() != q_nncf).mean())
        print(f"| `{layer}` | +-{qmax:.0f} | {nearest:.3e} | {learnt:.3e} | {changed:.1f} % |", flush=True)

    def judge(m, label: str) -> None:
        a = compare_logits(padded_logits(OpenVinoModule(m, 1, "int8"), ev.images), reference, ev.labels)
        print(f"| {label} | {100 * a.top1_agreement:.2f} % ({a.changed}) | {a.accuracy_change:+.2f} |", flush=True)

    print("\n| build | top-1 agreement (changed) | accuracy change |\n|---|---:|---:|")
    first = [builder.layers["patch_embed.conv1"]]
    judge(nncf_rounding, "every layer int8, NNCF's rounding")
    judge(model, f"every layer int8, AdaRound in {len(layers)} layers")
    for m, label in ((nncf_rounding, "NNCF's rounding"), (model, "AdaRound in the others")):
        judge(restore_float_layers(m, builder.float_model, first), f"`patch_embed.conv1` float, {label}")


if __name__ == "__main__":
    main()
