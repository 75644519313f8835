"""Where the sensitive layers' int8 loses decisions in OpenVINO: their activations, their weights, or both?

The layers a trained reference needs in float (the stem's convolutions, the patch merges') are where int8
pays most on AVX2, so a cheaper way to keep them precise would move the AVX2 speed targets. This script
takes cgavit's every-layer-int8 OpenVINO build (NNCF, this CPU's weight range, ``patch_embed.conv1`` float
since it costs nothing there) and, for groups of those layers, gives back to float

* **both** (the layer float, as ``cgavit quantize`` keeps it),
* only the **activation** (the convolution reads its input without the quantiser, its weights stay int8),
* only the **weights** (fp32 weights and bias, the input still quantised),

and tries two cheap remedies: for the activation, the input carried as **two int8 tensors** (the quantised
input and its quantised remainder, 16 bits of range), each through the same int8 convolution, summed; for the
weights, **8-bit weights** (symmetric per output channel, the fp32 bias back) in those layers only, with the
input's 8-bit quantiser (the uint8 x int8 kernels may saturate there on AVX2) or with a 7-bit one (128 levels
over the same range: a pair of products stays under 2^15). Last, where the saturation lands: every layer but
``patch_embed.conv1`` with 8-bit weights, and every layer int8 with only ``patch_embed.conv1``'s weights 8-bit. Each build is
judged top-1 against the fused fp32 model on DIR/VAL.

Usage::

    python benchmarks/int8_where_lost.py --checkpoint runs/c10-5k-m0-96/best.safetensors --data cifar10-5k --val-split test
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import openvino as ov
import torch

from cgavit import load_model
from cgavit.bench import load_calibration, load_labelled
from cgavit.cli.types import image_folder, readable_file
from cgavit.deploy import Int8Options, compare_logits, cpu_features, fuse
from cgavit.deploy.openvino import OpenVinoInt8Builder, OpenVinoModule, restore_float_layers
from cgavit.deploy.sensitivity import padded_logits

OPS = ov.opset13


def _ops(model) -> dict:
    return {op.get_friendly_name(): op for op in model.get_ordered_ops()}


def activations_float(model, nodes: list[str]):
    """A copy of ``model`` whose named convolutions read their input past its quantiser."""
    out = model.clone()
    ops = _ops(out)
    for name in nodes:
        conv = ops[name]
        conv.input(0).replace_source_output(conv.input_value(0).get_node().input_value(0))
    out.validate_nodes_and_infer_types()
    return out


def weights_float(model, float_model, nodes: list[str], levels: int | None = None):
    """A copy of ``model`` whose named convolutions get their fp32 weights and bias back, their input still quantised:
    the layers made float (:func:`restore_float_layers`) with the input quantisers put back in front of them (with
    ``levels`` levels over the same range instead of their own, if given)."""
    restored = restore_float_layers(model, float_model, nodes)
    quantised, ops = _ops(model), _ops(restored)
    for name in nodes:
        fq = quantised[name].input_value(0).get_node()
        if fq.get_type_name() != "FakeQuantize":  # no quantiser right in front of it: nothing to put back
            continue
        again = OPS.fake_quantize(ops[name].input_value(0), *(fq.input_value(i) for i in range(1, 5)),
                                  levels or fq.get_attributes()["levels"])
        ops[name].input(0).replace_source_output(again.output(0))
    restored.validate_nodes_and_infer_types()
    return restored


def two_int8_inputs(model, nodes: list[str]):
    """A copy of ``model`` in which each named convolution also convolves its input's quantisation remainder, itself
    quantised to int8 (the remainder of a step ``s`` lies in [-s/2, s/2]), and adds the two results."""
    out = model.clone()
    ops = _ops(out)
    for name in nodes:
        conv = ops[name]
        fq = conv.input_value(0).get_node()
        low, high = (fq.input_value(i).get_node().get_data().astype(np.float32) for i in (1, 2))
        step = float(np.max((high - low) / (fq.get_attributes()["levels"] - 1))) / 254.0
        rest = OPS.subtract(fq.input_value(0), fq.output(0))
        rest = OPS.fake_quantize(rest, np.float32(-128 * step), np.float32(127 * step), np.float32(-128 * step),
                                 np.float32(127 * step), 256)
        make = OPS.group_convolution if conv.get_type_name() == "GroupConvolution" else OPS.convolution
        second = make(rest, conv.input_value(1), strides=list(conv.get_strides()), pads_begin=list(conv.get_pads_begin()),
                      pads_end=list(conv.get_pads_end()), dilations=list(conv.get_dilations()))
        readers = list(conv.output(0).get_target_inputs())
        total = OPS.add(conv.output(0), second.output(0))
        for reader in readers:
            reader.replace_source_output(total.output(0))
    out.validate_nodes_and_infer_types()
    return out


def eight_bit_weights(model, float_model, nodes: list[str], levels: int | None = None):
    """:func:`weights_float` with the fp32 weights quantised to 8 bits (symmetric per output channel): the named
    convolutions keep their fp32 bias and input quantiser (``levels``: as there; 128 gives 7-bit activations)."""
    out = weights_float(model, float_model, nodes, levels)
    ops = _ops(out)
    for name in nodes:
        conv = ops[name]
        w = conv.input_value(1).get_node().get_data().astype(np.float32)
        scale = np.maximum(np.abs(w.reshape(len(w), -1)).max(1) / 127.0, 1e-12).reshape([-1] + [1] * (w.ndim - 1))
        q = np.clip(np.round(w / scale), -127, 127).astype(np.int8)
        conv.input(1).replace_source_output(OPS.multiply(OPS.convert(OPS.constant(q), "f32"),
                                                         OPS.constant(scale.astype(np.float32))).output(0))
    out.validate_nodes_and_infer_types()
    return out


def reference_arguments(description: str) -> argparse.ArgumentParser:
    """The arguments of the scripts that judge OpenVINO builds of a trained reference: its checkpoint and images."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--checkpoint", required=True, type=readable_file,
                   help="a trained checkpoint (cgavit train's best.safetensors)")
    p.add_argument("--data", required=True, type=image_folder,
                   help="image folder with DIR/train and DIR/VAL class folders")
    p.add_argument("--val-split", default="val", help="evaluation split (default val)")
    return p


def run_files_child(run_files: Callable[[list[Path], torch.Tensor], dict]) -> bool:
    """In a child started by :func:`run_files_elsewhere` (``--run-files IMAGES OUT FILE...``): ``run_files`` on the
    files and images, saved to OUT; True there, False in any other process."""
    if sys.argv[1:2] != ["--run-files"]:
        return False
    images, out, *files = sys.argv[2:]
    torch.save(run_files([Path(f) for f in files], torch.load(images, weights_only=True)), out)
    return True


def run_files_elsewhere(script: str, files: list[Path], images: torch.Tensor, tmp: Path, env: dict[str, str],
                        prefix: tuple[str, ...] = ()) -> dict:
    """``script``'s ``run_files`` on ``files`` and ``images`` in a child process with environment ``env``, started
    through ``prefix`` (an emulator's command, or nothing); its stderr is dropped only under a prefix."""
    torch.save(images, tmp / "images.pt")
    subprocess.run([*prefix, sys.executable, script, "--run-files", str(tmp / "images.pt"), str(tmp / "out.pt"),
                    *map(str, files)], env=env, check=True, stderr=subprocess.DEVNULL if prefix else None)
    return torch.load(tmp / "out.pt", weights_only=True)


def int8_base(args: argparse.Namespace):
    """One thread; the checkpoint fused, its DIR/VAL images and their fp32 logits, and cgavit's OpenVINO int8
    builder for it (256 calibration images of DIR/train, this CPU's options) with the base build of these
    scripts: every layer int8 but ``patch_embed.conv1``. Returns ``(info, fused, ev, reference, builder, base)``."""
    torch.set_num_threads(1)
    model, info = load_model(args.checkpoint)
    ev = load_labelled(args.data, args.val_split, info, 0)
    calibration = load_calibration(args.data, "train", info).images
    fused = fuse(model)
    builder = OpenVinoInt8Builder(fused, (info.img_size, info.img_size), [calibration],
                                  Int8Options().for_cpu(cpu_features()))
    return info, fused, ev, padded_logits(fused, ev.images), builder, builder.build(["patch_embed.conv1"])


def main() -> None:
    args = reference_arguments(__doc__.split("\n\n")[0]).parse_args()
    _, _, ev, reference, builder, base = int8_base(args)
    layers = builder.layers
    groups = {
        "the stem's conv2-conv4": [n for n in layers if n.startswith("patch_embed.") and n != "patch_embed.conv1"],
        "the first patch merge's three": [n for n in layers if n.startswith("stages.1.downsample.patchmerge.conv")],
    }
    groups["both, and the second patch merge's three"] = groups["the stem's conv2-conv4"] + \
        groups["the first patch merge's three"] + [n for n in layers if n.startswith("stages.2.downsample.patchmerge.conv")]

    def judge(m, label: str) -> None:
        a = compare_logits(padded_logits(OpenVinoModule(m, 1, "int8"), ev.images), reference, ev.labels)
        print(f"| {label} | {100 * a.top1_agreement:.2f} % ({a.changed}) | {a.accuracy_change:+.2f} |", flush=True)

    print(f"{args.checkpoint}: {len(ev.images)} images judged; {cpu_features().describe()}\n")
    print("| build | top-1 agreement (changed) | accuracy change |\n|---|---:|---:|")
    judge(builder.build([]), "every layer int8")
    judge(base, "`patch_embed.conv1` float (the base of the rows below)")
    for label, group in groups.items():
        nodes = [layers[n] for n in group]
        judge(restore_float_layers(base, builder.float_model, nodes), f"{label}: float")
        judge(activations_float(base, nodes), f"{label}: activations float, weights int8")
        judge(weights_float(base, builder.float_model, nodes), f"{label}: weights float, activations int8")
        judge(two_int8_inputs(base, nodes), f"{label}: input as two int8 tensors")
        judge(eight_bit_weights(base, builder.float_model, nodes), f"{label}: 8-bit weights, 8-bit activations")
        judge(eight_bit_weights(base, builder.float_model, nodes, 128), f"{label}: 8-bit weights, 7-bit activations")
    rest = [node for name, node in layers.items() if name != "patch_embed.conv1"]
    judge(eight_bit_weights(base, builder.float_model, rest), "every layer but `patch_embed.conv1` with 8-bit weights")
    judge(eight_bit_weights(builder.build([]), builder.float_model, [layers["patch_embed.conv1"]]),
          "every layer int8, `patch_embed.conv1` with 8-bit weights")


if __name__ == "__main__":
    main()
