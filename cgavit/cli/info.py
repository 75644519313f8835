"""``cgavit info``: the variant table (params, MACs, widths, depths, heads)."""

from __future__ import annotations

import argparse
import json

from ..factory import list_models, resolve_name
from ..info import variant_rows
from .common import image_size


def run(args: argparse.Namespace) -> int:
    size = image_size(args.img_size)
    names = list_models() if not args.model else list(dict.fromkeys(resolve_name(m) for m in args.model))  # once each
    rows = variant_rows(size, names)
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    head = f"{'model':<17}{'params(M)':>10}{'MACs(M)':>9}{'top-1':>7}  {'widths':<14}{'depths':<9}heads   @ {size[0]}x{size[1]}"
    print(head)
    print("-" * len(head))
    for r in rows:
        print(
            f"{r['model']:<17}{r['params_m']:>10.2f}{r['macs_m']:>9.0f}{r['top1']:>7.1f}  "
            f"{','.join(map(str, r['widths'])):<14}{','.join(map(str, r['depths'])):<9}{','.join(map(str, r['heads']))}"
        )
    print(f"params and MACs are counted on the models at {size[0]}x{size[1]} (torch.utils.flop_counter); top-1 is the "
          "published ImageNet-1k figure at 224x224, whatever size the table is counted at.")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "info",
        help="print the variant table (params, MACs, widths, depths, heads)",
        description="Print each EfficientViT variant's parameters and MACs (counted on the model at --img-size), "
        "its published ImageNet-1k top-1 (at 224 px) and its widths, depths and heads per stage: the names "
        "--model takes in every command.",
    )
    p.add_argument("--img-size", type=int, nargs="+", default=[224], metavar="N", help="input size: N or H W (default 224)")
    p.add_argument("--model", nargs="*", help="only these variants, e.g. efficientvit_m0 m4 (default: all)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=run)
