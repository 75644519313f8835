"""How many of a trained model's own fp32 decisions change under input changes nobody would call a different image.

``cgavit quantize`` holds int8 to an agreement target with fp32 (99.5 % by default). A model that is unsure of many
answers (near-ties between two classes) changes some of them under any perturbation at all, so this measures the
scale the target sits on: on the checkpoint's DIR/VAL images, the fused fp32 model's decisions against its decisions
on the same images with uniform pixel noise of a quarter, half and one grey level (an 8-bit image already carries
half a grey level of rounding; three seeded draws each, :func:`cgavit.deploy.noise_floor`), with the input rounded to
bf16, and with every pixel one grey level brighter. With ``--compare FILE`` (an exported ``.onnx`` or ``.xml``, such as
``cgavit quantize`` writes), also the decisions that file changes, and how many of them one grey level of noise
changes too (in any of its draws): near-ties of fp32's own. Nothing is timed. BENCHMARKS.md ("For scale: ...").

Usage::

    python benchmarks/noise_floor.py --checkpoint runs/c10-5k-m0-96-s1/best.safetensors --data cifar10-5k --val-split test
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from cgavit import load_model
from cgavit.bench import load_labelled
from cgavit.cli.types import readable_file
from cgavit.deploy import compare_logits, fuse, open_exported
from cgavit.deploy.agreement import NOISE_DRAWS, batched_logits, noisy_logits
from cgavit.deploy.sensitivity import padded_logits

sys.path.insert(0, str(Path(__file__).resolve().parent))
from int8_where_lost import reference_arguments  # noqa: E402  (this folder's checkpoint-and-images arguments)


def main() -> None:
    p = reference_arguments(__doc__.split("\n\n")[0])
    p.add_argument("--compare", metavar="FILE", type=readable_file,
                   help="an exported model of the checkpoint (.onnx, .xml) to set beside")
    args = p.parse_args()
    torch.set_num_threads(1)
    model, info = load_model(args.checkpoint)
    ev = load_labelled(args.data, args.val_split, info, 0)
    fused = fuse(model)
    clean = batched_logits(fused, ev.images)
    grey = torch.tensor([1.0 / (255.0 * s) for s in info.std]).view(1, -1, 1, 1)  # one grey level, normalised
    print(f"{args.checkpoint}: {len(ev.images)} images of {args.data}/{args.val_split}; decisions of the fp32 model "
          "that change (of all), and its accuracy change\n")
    print("| input change | decisions changed | accuracy change |")
    print("|---|---:|---:|")
    near_ties = torch.zeros(len(ev.images), dtype=torch.bool)  # changed by one grey level of noise in some draw
    for level in (0.25, 0.5, 1.0):
        flips = [out.argmax(1) != clean.argmax(1) for out in noisy_logits(fused, ev.images, tuple(info.std), level)]
        print(f"| uniform noise of +-{level:g} grey level, {NOISE_DRAWS} draws | "
              f"{', '.join(str(int(f.sum())) for f in flips)} | |")
        if level == 1.0:
            near_ties = torch.stack(flips).any(0)
    for label, x in (("the input rounded to bf16", ev.images.bfloat16().float()),
                     ("every pixel one grey level brighter", ev.images + grey)):
        a = compare_logits(batched_logits(fused, x), clean, ev.labels)
        print(f"| {label} | {a.changed} | {a.accuracy_change:+.2f} |")
    if args.compare:
        module, _ = open_exported(args.compare)
        out = padded_logits(module, ev.images)
        a = compare_logits(out, clean, ev.labels)
        changed = out.argmax(1) != clean.argmax(1)
        print(f"| {args.compare} | {a.changed} | {a.accuracy_change:+.2f} |\n\nOf the {a.changed} decisions it changes, "
              f"{int((changed & near_ties).sum())} are changed by uniform noise of +-1 grey level too (in one of "
              f"{NOISE_DRAWS} draws; {int(near_ties.sum())} decisions in all are).")


if __name__ == "__main__":
    main()
