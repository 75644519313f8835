"""Activation equalisation before int8 (SmoothQuant's rule on ReLU-separated convolution pairs): does it help?

int8 quantises a convolution's input per tensor, one range for all its channels. A ReLU commutes with a
positive per-channel scale, so between two convolutions the producer's output channel ``i`` can be
divided by ``s_i`` and the consumer's input column ``i`` multiplied by it without changing the function;
with ``s_i = a_i ** alpha / w_i ** (1 - alpha)`` (``a_i`` the channel's calibration maximum, ``w_i`` the
largest weight the consumer applies to it) activation ranges and weight columns meet halfway
(``alpha=1`` gives every channel one range; a depthwise consumer, whose weights are quantised per channel
anyway, always gets 1). The pairs of an EfficientViT: the stem's four convolutions in a chain, each FFN's
two, each patch merge's expand -> depthwise -> (SE, project). The attention's are left alone (the cascade
feeds a head's value output into the next head).

This script equalises the fused fp32 model, checks that its logits did not move, quantises it with
cgavit's recipe (every layer int8) in ONNX Runtime and OpenVINO with 7-bit weights (the AVX2 weight
range) and 8-bit ones, and judges each against the unequalised fp32 model on DIR/VAL. It was measured
on the CIFAR-10 references and **did not help** (BENCHMARKS.md), so cgavit does not ship it.

Usage::

    python benchmarks/int8_equalize.py --checkpoint runs/c10-5k-m0-96/best.safetensors --data cifar10-5k \\
        --val-split test [--alphas 0,0.5,1] [--which ov7,ov8,ort7]
"""

from __future__ import annotations

import copy
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

from cgavit import load_model
from cgavit.bench import load_calibration, load_labelled
from cgavit.deploy import Int8Options, compare_logits, fuse
from cgavit.deploy.onnx import OnnxInt8Builder, OnnxModule, even_batches, export_onnx
from cgavit.deploy.openvino import OpenVinoInt8Builder, OpenVinoModule
from cgavit.deploy.sensitivity import padded_logits
from cgavit.layers import FFN, PatchMerging

sys.path.insert(0, str(Path(__file__).resolve().parent))
from int8_where_lost import reference_arguments  # noqa: E402  (this folder's checkpoint-and-images arguments)


def pairs(model: nn.Module) -> list[tuple[nn.Conv2d, tuple[nn.Conv2d, ...], bool]]:
    """(producer, consumers, depthwise consumer) for each ReLU between convolutions of a fused model."""
    out = []
    for name, m in model.named_modules():
        if name.endswith("patch_embed"):
            convs = [c for c in m.children() if isinstance(c, nn.Conv2d)]
            out += [(a, (b,), False) for a, b in zip(convs, convs[1:])]
        elif isinstance(m, FFN):
            out.append((m.pw1, (m.pw2,), False))
        elif isinstance(m, PatchMerging):
            out += [(m.conv1, (m.conv2,), True), (m.conv2, (m.se.fc1, m.conv3), False)]
    return out


def column_maxima(conv: nn.Conv2d) -> torch.Tensor:
    """The largest weight magnitude ``conv`` applies to each input channel (dense or depthwise)."""
    return conv.weight.abs().amax(dim=(0, 2, 3) if conv.groups == 1 else (1, 2, 3))


@torch.no_grad()
def equalize(model: nn.Module, batches: list[torch.Tensor], alpha: float, limit: float = 1e3) -> None:
    """Equalise a fused model in place (module notes)."""
    found = pairs(model)
    maxima: dict[int, torch.Tensor] = {}

    def hook(i):
        def record(_m, _x, y):
            top = y.clamp(min=0).amax(dim=(0, 2, 3))
            maxima[i] = top if i not in maxima else torch.maximum(maxima[i], top)
        return record

    handles = [p.register_forward_hook(hook(i)) for i, (p, _, _) in enumerate(found)]
    for x in batches:
        model(x)
    for h in handles:
        h.remove()
    for i, (producer, consumers, depthwise) in enumerate(found):
        a = maxima[i]
        w = torch.stack([column_maxima(c) for c in consumers]).amax(dim=0)
        live = (a > a.max() * 1e-6) & (w > 0)
        power = 1.0 if depthwise else alpha
        s = torch.ones_like(a)
        s[live] = a[live] ** power / w[live] ** (1.0 - power)
        s[live] /= torch.exp(torch.log(s[live]).mean())  # geometric mean 1
        s = s.clamp(1.0 / limit, limit)
        producer.weight.div_(s[:, None, None, None])
        producer.bias.div_(s)
        for c in consumers:
            c.weight.mul_(s[None, :, None, None] if c.groups == 1 else s[:, None, None, None])


def main() -> None:
    p = reference_arguments(__doc__.split("\n\n")[0])
    p.add_argument("--alphas", default="0,0.5,1", help="balances to try, comma-separated (0: not equalised)")
    p.add_argument("--which", default="ov7,ov8,ort7,ort8",
                   help="builds: ov/ort (OpenVINO, ONNX Runtime) with 7- or 8-bit weights, comma-separated")
    args = p.parse_args()
    torch.set_num_threads(1)
    model, info = load_model(args.checkpoint)
    ev = load_labelled(args.data, args.val_split, info, 0)
    batches = even_batches(load_calibration(args.data, "train", info).images)
    scratch = tempfile.TemporaryDirectory(prefix="cgavit-bench-")  # removed when main returns
    size, tmp = (info.img_size, info.img_size), Path(scratch.name)
    fused = fuse(model)
    reference = padded_logits(fused, ev.images)
    print(f"{args.checkpoint}: {len(ev.images)} images judged, every layer int8\n")
    print("| alpha | build | top-1 agreement (changed) | accuracy change | fp32 logits moved by |\n|---:|---|---:|---:|---:|")
    for alpha in (float(a) for a in args.alphas.split(",")):
        m = copy.deepcopy(fused)
        if alpha > 0:
            equalize(m, batches, alpha)
        moved = (padded_logits(m, ev.images[:64]) - reference[:64]).abs().max().item()
        for which in args.which.split(","):
            start, opts = time.time(), Int8Options(reduce_range=which.endswith("7"))
            if which.startswith("ov"):
                module = OpenVinoModule(OpenVinoInt8Builder(m, size, batches, opts).build(), 1, "int8")
            else:
                export_onnx(m, tmp / "src.onnx", size, fold_residuals=False)
                with OnnxInt8Builder(tmp / "src.onnx", batches, opts) as b:
                    module = OnnxModule(b.build(), 1, "int8")
            a = compare_logits(padded_logits(module, ev.images), reference, ev.labels)
            print(f"| {alpha:g} | {which} | {100 * a.top1_agreement:.2f} % ({a.changed}) | {a.accuracy_change:+.2f} "
                  f"| {moved:.1e} ({time.time() - start:.0f} s) |", flush=True)


if __name__ == "__main__":
    main()
