"""int8 files judged on images their search never saw: a test folder less the images ``cgavit quantize`` judged on.

``cgavit quantize`` judges its answer on held-out images, but the same held-out images also decide where its search
stops (the first build that meets the target there wins), so their figure reads somewhat high when smaller builds
missed there first. This script judges the files it wrote against the fp32 checkpoint on the images of ``--data``
(``DIR/<class>/``) that are not, by content, among those of ``--seen`` (the folder quantize judged on): top-1
agreement with Wilson's 95 % interval, and the accuracy change (BENCHMARKS.md, "Tenth AMX session").

Usage::

    python benchmarks/int8_fresh_images.py --checkpoint runs/c10-5k-m0-96-s1/best.pt --data c10-fulltest/test \\
        --seen cifar10-5k/test q/c96s1.xml q2/c96s1.xml
"""

from __future__ import annotations

import argparse
import hashlib
from pathlib import Path

import torch

from cgavit import load_model
from cgavit.cli.types import image_folder, readable_file
from cgavit.deploy import compare_logits, cpu_features, fuse
from cgavit.deploy.artifact import quantized_artifact
from cgavit.deploy.sensitivity import padded_logits
from cgavit.train.data import build_transform, list_split, load_image


def digests(folder: Path) -> set[str]:
    """The content digests of the files under ``folder``."""
    return {hashlib.sha256(p.read_bytes()).hexdigest() for p in folder.rglob("*") if p.is_file()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", required=True, type=readable_file,
                   help="the fp32 checkpoint the files were quantised from")
    p.add_argument("--data", required=True, type=image_folder, help="a split folder of images by class (DIR/<class>/)")
    p.add_argument("--seen", required=True, type=image_folder,
                   help="the folder cgavit quantize judged on: its images are left out")
    p.add_argument("files", nargs="+", help="int8 files cgavit quantize wrote (.onnx or .xml)")
    args = p.parse_args()
    torch.set_num_threads(1)
    model, info = load_model(args.checkpoint)
    seen = digests(Path(args.seen))
    _, samples = list_split(args.data)
    fresh = [(path, label) for path, label in samples if hashlib.sha256(Path(path).read_bytes()).hexdigest() not in seen]
    transform = build_transform(info.img_size, False, interpolation=info.interpolation, crop_pct=info.crop_pct,
                                mean=info.mean, std=info.std)
    x = torch.stack([transform(load_image(path)) for path, _ in fresh])
    y = torch.tensor([label for _, label in fresh])
    with torch.no_grad():
        reference = padded_logits(fuse(model), x)
    print(f"{cpu_features().describe()}; {len(samples) - len(fresh)} of {len(samples)} images in {args.data} were "
          f"among the {len(seen)} of {args.seen}; judged on the other {len(fresh)}; fp32 top-1 "
          f"{100 * (reference.argmax(1) == y).float().mean():.2f} %\n")
    print("| file | agreement (changed) | 95 % interval | accuracy change |\n|---|---:|---:|---:|")
    for name in args.files:
        with torch.no_grad():
            a = compare_logits(padded_logits(quantized_artifact(name).module, x), reference, y)
        low, high = a.interval()
        print(f"| {name} | {100 * a.top1_agreement:.2f} % ({a.changed} of {a.n}) | {100 * low:.2f}-{100 * high:.2f} % "
              f"| {a.accuracy_change:+.2f} |", flush=True)


if __name__ == "__main__":
    main()
