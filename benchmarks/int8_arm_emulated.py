"""ONNX Runtime's int8 on emulated Arm cores: does an int8 file made and judged on x86 decide alike on Arm?

cgavit keeps int8 weights 8-bit on Arm (:mod:`cgavit.deploy.int8`: its dot products, and the widening multiplies of
cores without them, do not saturate as x86's AVX2 kernels do). This script checks that on two emulated cores, one
without dot products (``cortex-a72``, a Graviton 1 or Raspberry Pi 4 class core) and one with them (``neoverse-n1``,
Graviton 2), and how far the same file's decisions move between this x86 machine and Arm. It exports a trained
checkpoint to ONNX and quantises it with cgavit's ONNX Runtime recipe (every layer int8) with 7-bit and with 8-bit
weights, runs the three files here and in a child process under ``qemu-aarch64``, and reports each int8 file's
decisions against that CPU's fp32 ones, and against this machine's. Nothing is timed: emulated instructions say
nothing of a real core's speed.

The child is an Arm Python with numpy and ONNX Runtime alone (PyPI's Arm torch wheels are CUDA builds): Debian's
arm64 packages unpacked into a folder and the Arm wheels installed beside them. qemu 7.2 shows the child this
machine's ``/proc/cpuinfo``, on which ONNX Runtime's CPU probe crashes, so the child sees an Arm one, bound over it
in a mount namespace of its own (``unshare -m``: run this as root). Once, on Debian 12 (bookworm)::

    dpkg --add-architecture arm64 && apt-get update && apt-get install -y qemu-user
    mkdir -p arm/debs && cd arm/debs && apt-get download libc6:arm64 libgcc-s1:arm64 libstdc++6:arm64 \\
        python3.11-minimal:arm64 libpython3.11-minimal:arm64 libpython3.11-stdlib:arm64 libexpat1:arm64 \\
        zlib1g:arm64 libffi8:arm64 libssl3:arm64 libbz2-1.0:arm64 liblzma5:arm64 libsqlite3-0:arm64 \\
        libncursesw6:arm64 libtinfo6:arm64 libreadline8:arm64 libuuid1:arm64 libdb5.3:arm64 libgomp1:arm64 \\
        libcrypt1:arm64 libnsl2:arm64 libtirpc3:arm64
    cd .. && for d in debs/*.deb; do dpkg -x $d sysroot; done
    pip install --target site --platform manylinux_2_28_aarch64 --platform manylinux2014_aarch64 \\
        --python-version 3.11 --only-binary=:all: onnxruntime==1.32.0 numpy

Usage::

    python benchmarks/int8_arm_emulated.py --checkpoint runs/c10-5k-m0-96/best.safetensors --data cifar10-5k \\
        --val-split test --sysroot arm/sysroot --site arm/site
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

#: Each emulated core: whether it has Arm's int8 dot products, and the ``Features`` line its ``/proc/cpuinfo`` shows.
CORES = {
    "cortex-a72": ("no dot products", "fp asimd evtstrm crc32 cpuid", "0xd08"),
    "neoverse-n1": ("asimddp dot products", "fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid "
                    "asimdrdm lrcpc dcpop asimddp ssbs", "0xd0c"),
}
FILES = ("fp32", "7-bit", "8-bit")


def run_files(folder: str) -> None:
    """In any Python with numpy and ONNX Runtime: each file of ``folder`` on its ``images.npy`` (one thread, batches
    of 16), the logits saved beside them as ``NAME.logits.npy``."""
    import onnxruntime as ort

    images = np.load(Path(folder) / "images.npy")
    for name in FILES:
        options = ort.SessionOptions()
        options.intra_op_num_threads = 1
        session = ort.InferenceSession(str(Path(folder) / f"{name}.onnx"), options, providers=["CPUExecutionProvider"])
        feed = session.get_inputs()[0].name
        logits = [session.run(None, {feed: images[i:i + 16]})[0] for i in range(0, len(images), 16)]
        np.save(Path(folder) / f"{name}.logits.npy", np.concatenate(logits))


def cpuinfo(core: str) -> str:
    """A two-core ``/proc/cpuinfo`` of ``core`` (what the kernel of such a machine shows)."""
    _, features, part = CORES[core]
    one = (f"BogoMIPS\t: 50.00\nFeatures\t: {features}\nCPU implementer\t: 0x41\nCPU architecture: 8\n"
           f"CPU variant\t: 0x0\nCPU part\t: {part}\nCPU revision\t: 1\n")
    return "".join(f"processor\t: {i}\n{one}\n" for i in range(2))


def run_emulated(folder: Path, core: str, sysroot: Path, site: Path) -> None:
    """:func:`run_files` on ``folder`` in an Arm Python under ``qemu-aarch64 -cpu core``."""
    (folder / "cpuinfo").write_text(cpuinfo(core))
    python = sysroot / "usr" / "bin" / "python3.11"
    inner = (f"mount --bind {folder / 'cpuinfo'} /proc/cpuinfo && exec qemu-aarch64 -cpu {core} -L {sysroot} {python} "
             f"{Path(__file__).resolve()} --run-files {folder}")
    subprocess.run(["unshare", "-m", "sh", "-c", inner], check=True, env={**os.environ, "PYTHONPATH": str(site)})


def main() -> None:
    if sys.argv[1:2] == ["--run-files"]:
        run_files(sys.argv[2])
        return
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from int8_emulated import checkpoint_files  # this folder's: the files an emulated run compares
    from int8_where_lost import reference_arguments  # and the checkpoint-and-images arguments

    p = reference_arguments(__doc__.split("\n\n")[0])
    p.add_argument("--sysroot", required=True, help="the unpacked arm64 packages (see the module notes)")
    p.add_argument("--site", required=True, help="the folder the Arm numpy and ONNX Runtime wheels were installed in")
    args = p.parse_args()
    if shutil.which("qemu-aarch64") is None or shutil.which("unshare") is None:
        sys.exit("needs qemu-aarch64 (Debian: apt-get install qemu-user) and unshare (util-linux), run as root")

    import torch

    from cgavit.deploy import compare_logits, cpu_features

    scratch = tempfile.TemporaryDirectory(prefix="cgavit-bench-")  # removed when main returns
    base = Path(scratch.name)
    made = base / "made"
    made.mkdir()
    ev, files = checkpoint_files(args, made)
    assert [f.stem for f in files] == list(FILES), files  # the names run_files reads
    np.save(made / "images.npy", ev.images.numpy())
    logits = {}
    for where in ("here", *CORES):  # each in a folder of its own: the same files, its own logits
        folder = base / where
        shutil.copytree(made, folder)
        run_files(str(folder)) if where == "here" else run_emulated(folder, where, Path(args.sysroot).resolve(),
                                                                    Path(args.site).resolve())
        logits[where] = {name: torch.from_numpy(np.load(folder / f"{name}.logits.npy")) for name in FILES}
    here = logits["here"]
    print(f"{args.checkpoint}: {len(ev.images)} images of {args.data}/{args.val_split}, ONNX Runtime, every layer int8;"
          f" here: {cpu_features().describe()}\n")
    print("| weights | CPU | top-1 agreement with that CPU's fp32 (changed) | accuracy change | decisions unlike this "
          "machine's | largest logit difference from this machine's |\n|---|---|---:|---:|---:|---:|")
    for name in FILES:
        for where, run in logits.items():
            a = compare_logits(run[name], run["fp32"], ev.labels)
            unlike = int((run[name].argmax(1) != here[name].argmax(1)).sum())
            label = "this machine" if where == "here" else f"{where} ({CORES[where][0]})"
            shown = "" if where == "here" else f"{unlike} | {(run[name] - here[name]).abs().max().item():.1e}"
            print(f"| {name} | {label} | {100 * a.top1_agreement:.2f} % ({a.changed}) | {a.accuracy_change:+.2f} | "
                  f"{shown or ' | '} |")


if __name__ == "__main__":
    main()
