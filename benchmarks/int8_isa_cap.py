"""OpenVINO's int8 under oneDNN's ISA cap: does an AVX-512 or AMX machine decide as an AVX2-only one would?

``ONEDNN_MAX_CPU_ISA=AVX2`` keeps oneDNN's kernels, OpenVINO's among them, to AVX2, and AVX2's uint8 x int8
kernels add pairs of products into 16 bits, which saturates on 8-bit weights (:mod:`cgavit.deploy.int8`). This
script quantises a trained checkpoint with cgavit's OpenVINO recipe (every layer int8, fp32 float part) twice,
with 7-bit weights (the AVX2 range) and with 8-bit ones, and saves both files. It then runs each file twice:
here with this CPU's own kernels, and in a child process under the cap. For each run it reports the decisions
against fp32 on DIR/VAL, and for the capped run how far its logits are from the uncapped run's. It also names
the int8 kernels each run compiled. With ``--emulate CPU`` a third run, uncapped, goes under ``qemu-x86_64 -cpu CPU``,
whose ``CPUID`` is an AVX2-only CPU's, to check that the cap gives what such a CPU gives (``int8_emulated.py`` does
the same for ONNX Runtime). Nothing is timed: the cap changes the kernels, not the chip they run on.

Usage::

    python benchmarks/int8_isa_cap.py --checkpoint runs/c10-5k-m0-96/best.safetensors --data cifar10-5k \\
        --val-split test [--cap AVX2] [--emulate EPYC-Milan]
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

import torch

from cgavit import load_model
from cgavit.bench import load_calibration, load_labelled
from cgavit.deploy import Int8Options, compare_logits, cpu_features, fuse
from cgavit.deploy.cpu import uncapped_environ
from cgavit.deploy.onnx import even_batches
from cgavit.deploy.openvino import OpenVinoInt8Builder, OpenVinoModule, save_openvino
from cgavit.deploy.metadata import ExportInfo
from cgavit.deploy.sensitivity import padded_logits

sys.path.insert(0, str(Path(__file__).resolve().parent))
from int8_where_lost import reference_arguments, run_files_child, run_files_elsewhere  # noqa: E402  (this folder's checkpoint-and-images arguments)

WEIGHTS = {"7-bit": True, "8-bit": False}  # the label -> Int8Options.reduce_range


def int8_kernels(module: OpenVinoModule) -> str:
    """The primitive types of the int8 nodes OpenVINO compiled ``module`` with (e.g. ``jit_avx2_1x1_I8``)."""
    ops = module.compiled_for(16).get_runtime_model().get_ops()
    kinds = {op.get_rt_info()["primitiveType"].astype(str) for op in ops if "primitiveType" in op.get_rt_info()}
    return ", ".join(sorted(k for k in kinds if k.endswith("_I8") and not k.startswith(("ref", "reorder"))))


def run_files(files: list[Path], images: torch.Tensor) -> dict:
    """Each OpenVINO file's logits on ``images`` and its int8 kernels, in this process (under its cap, if any)."""
    torch.set_num_threads(1)
    out = {"cpu": cpu_features().describe()}
    for f in files:
        module = OpenVinoModule(f, 1, "int8", "fp32")
        out[f.stem] = {"logits": padded_logits(module, images), "kernels": int8_kernels(module)}
    return out


def main() -> None:
    if run_files_child(run_files):
        return
    p = reference_arguments(__doc__.split("\n\n")[0])
    p.add_argument("--cap", default="AVX2", help="the ONEDNN_MAX_CPU_ISA value of the capped run (default AVX2)")
    p.add_argument("--emulate", metavar="CPU", help="also run the files uncapped under qemu-x86_64 -cpu CPU (e.g. "
                   "EPYC-Milan, a Zen 3 EPYC: AVX2-only by its CPUID; Debian's qemu-user, 7.2 or later)")
    args = p.parse_args()
    torch.set_num_threads(1)
    model, info = load_model(args.checkpoint)
    ev = load_labelled(args.data, args.val_split, info, 0)
    calibration = even_batches(load_calibration(args.data, "train", info).images)
    scratch = tempfile.TemporaryDirectory(prefix="cgavit-bench-")  # removed when main returns
    size, tmp = (info.img_size, info.img_size), Path(scratch.name)
    reference = padded_logits(fuse(model), ev.images)
    files = []
    for label, reduce_range in WEIGHTS.items():
        built = OpenVinoInt8Builder(model, size, calibration, Int8Options(reduce_range=reduce_range)).build()
        files.append(tmp / f"{label}.xml")
        save_openvino(built, files[-1], ExportInfo(img_size=size))
    own = run_files(files, ev.images)
    env = {**uncapped_environ(), "ONEDNN_MAX_CPU_ISA": args.cap}
    capped = run_files_elsewhere(__file__, files, ev.images, tmp, env)
    runs = [("own", own), (args.cap, capped)]
    if args.emulate:
        qemu = shutil.which("qemu-x86_64")
        if qemu is None:
            sys.exit("qemu-x86_64 not found: install Debian's qemu-user (7.2 or later emulates AVX2)")
        runs.append((f"qemu {args.emulate}", run_files_elsewhere(__file__, files, ev.images, tmp, uncapped_environ(),
                                                                 (qemu, "-cpu", args.emulate))))
    print(f"{args.checkpoint}: {len(ev.images)} images of {args.data}/{args.val_split}, "
          "every layer int8, fp32 float part")
    print(f"own kernels: {own['cpu']}\nunder ONEDNN_MAX_CPU_ISA={args.cap}: {capped['cpu']}")
    print("".join(f"under qemu-x86_64 -cpu {args.emulate}: {run['cpu']}" for name, run in runs[2:]) + "\n")
    print("| weights | kernels | int8 kernels compiled | top-1 agreement with fp32 (changed) | accuracy change "
          "| largest relative logit error | largest logit difference from this CPU's own kernels |")
    print("|---|---|---|---:|---:|---:|---:|")
    for f in files:
        for name, run in runs:
            a = compare_logits(run[f.stem]["logits"], reference, ev.labels)
            diff = (run[f.stem]["logits"] - own[f.stem]["logits"]).abs().max().item()
            print(f"| {f.stem} | {name} | {run[f.stem]['kernels']} | {100 * a.top1_agreement:.2f} % ({a.changed}) "
                  f"| {a.accuracy_change:+.2f} | {a.max_rel_err:.1e} | {'' if run is own else f'{diff:.1e}'} |")


if __name__ == "__main__":
    main()
