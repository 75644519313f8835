"""ONNX Runtime's int8 on an emulated AVX2 CPU: how would an AVX-512 or AMX machine's int8 file decide on an AVX2 EPYC?

ONNX Runtime's int8 kernels (MLAS) pick their instructions from the CPU's ``CPUID``, which oneDNN's ISA cap does
not touch (``int8_isa_cap.py`` covers OpenVINO that way). Debian's ``qemu-user`` runs a process as another CPU:
``qemu-x86_64 -cpu EPYC-Milan`` presents a Zen 3 EPYC (AVX2, neither AVX-512 nor VNNI; qemu 7.2 or later emulates
AVX2), whose uint8 x int8 kernels add pairs of products into 16 bits and saturate on 8-bit weights
(:mod:`cgavit.deploy.int8`). This script exports a trained checkpoint to ONNX and quantises it with cgavit's ONNX
Runtime recipe (every layer int8) twice, with 7-bit weights (the AVX2 range) and with 8-bit ones. It runs the
three files here and in a child process under the emulator, and reports each int8 file's decisions against the
fp32 file's in the same process, with the CPU class cgavit probes there. Nothing is timed: emulated instructions
say nothing of a real CPU's speed.

Usage::

    python benchmarks/int8_emulated.py --checkpoint runs/c10-5k-m0-96/best.safetensors --data cifar10-5k \\
        --val-split test [--cpu EPYC-Milan]
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

import torch

from cgavit import load_model
from cgavit.bench import LabelledImages, load_calibration, load_labelled
from cgavit.deploy import Int8Options, compare_logits, cpu_features
from cgavit.deploy.cpu import uncapped_environ
from cgavit.deploy.onnx import OnnxModule, even_batches, export_onnx, quantize_onnx
from cgavit.deploy.sensitivity import padded_logits

sys.path.insert(0, str(Path(__file__).resolve().parent))
from int8_where_lost import reference_arguments, run_files_child, run_files_elsewhere  # noqa: E402  (this folder's checkpoint-and-images arguments)

WEIGHTS = {"7-bit": True, "8-bit": False}  # the label -> Int8Options.reduce_range


def checkpoint_files(args: argparse.Namespace, folder: Path) -> tuple[LabelledImages, list[Path]]:
    """The checkpoint's DIR/VAL images, and in ``folder`` its fp32 ONNX file and the int8 ones with 7-bit and with
    8-bit weights (cgavit's ONNX Runtime recipe, every layer int8, its calibration images): what an emulated run
    compares. One torch thread."""
    torch.set_num_threads(1)
    model, info = load_model(args.checkpoint)
    ev = load_labelled(args.data, args.val_split, info, 0)
    calibration = even_batches(load_calibration(args.data, "train", info).images)
    files = [export_onnx(model, folder / "fp32.onnx", (info.img_size, info.img_size), fold_residuals=False)]
    for label, reduce_range in WEIGHTS.items():
        files.append(quantize_onnx(files[0], folder / f"{label}.onnx", calibration, Int8Options(reduce_range=reduce_range)))
    return ev, files


def run_files(files: list[Path], images: torch.Tensor) -> dict:
    """Each ONNX file's logits on ``images`` in this process, with the CPU cgavit probes here."""
    torch.set_num_threads(1)
    out = {"cpu": cpu_features().describe()}
    for f in files:
        out[f.stem] = padded_logits(OnnxModule(f, 1), images)
    return out


def main() -> None:
    if run_files_child(run_files):
        return
    p = reference_arguments(__doc__.split("\n\n")[0])
    p.add_argument("--cpu", default="EPYC-Milan", help="qemu's CPU model of the emulated run (default EPYC-Milan, "
                   "a Zen 3 EPYC; Haswell is another AVX2-only one)")
    args = p.parse_args()
    qemu = shutil.which("qemu-x86_64")
    if qemu is None:
        sys.exit("qemu-x86_64 not found: install Debian's qemu-user (7.2 or later emulates AVX2)")
    scratch = tempfile.TemporaryDirectory(prefix="cgavit-bench-")  # removed when main returns
    tmp = Path(scratch.name)
    ev, files = checkpoint_files(args, tmp)
    own = run_files(files, ev.images)
    emulated = run_files_elsewhere(__file__, files, ev.images, tmp, uncapped_environ(), (qemu, "-cpu", args.cpu))
    print(f"{args.checkpoint}: {len(ev.images)} images of {args.data}/{args.val_split}, ONNX Runtime, "
          "every layer int8")
    print(f"own CPU: {own['cpu']}\nunder qemu-x86_64 -cpu {args.cpu}: {emulated['cpu']}")
    fp32 = compare_logits(emulated["fp32"], own["fp32"], ev.labels)
    print(f"fp32 emulated against fp32 here: {100 * fp32.top1_agreement:.2f} % ({fp32.changed} changed), "
          f"largest relative logit error {fp32.max_rel_err:.1e}\n")
    print("| weights | CPU | top-1 agreement with that CPU's fp32 (changed) | accuracy change "
          "| largest relative logit error | largest logit difference from this CPU's |")
    print("|---|---|---:|---:|---:|---:|")
    for f in files[1:]:
        for name, run in (("own", own), (args.cpu, emulated)):
            a = compare_logits(run[f.stem], run["fp32"], ev.labels)
            diff = (run[f.stem] - own[f.stem]).abs().max().item()
            print(f"| {f.stem} | {name} | {100 * a.top1_agreement:.2f} % ({a.changed}) | {a.accuracy_change:+.2f} "
                  f"| {a.max_rel_err:.1e} | {'' if run is own else f'{diff:.1e}'} |")


if __name__ == "__main__":
    main()
