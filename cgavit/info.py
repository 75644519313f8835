"""``cgavit info``: the variant table measured from the models themselves."""

from __future__ import annotations

import argparse
import json

import torch
from torch.utils.flop_counter import FlopCounterMode

from .factory import create_model, list_models
from .variants import VARIANTS


def count_macs(model: torch.nn.Module, img_size: tuple[int, int]) -> int:
    """Multiply-accumulates of one forward pass on one image (``torch.utils.flop_counter``)."""
    x = torch.randn(1, getattr(model, "in_chans", 3), *img_size)
    was_training = model.training
    model.eval()
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        model(x)
    model.train(was_training)
    return counter.get_total_flops() // 2


def variant_rows(img_size: tuple[int, int] = (224, 224), names: list[str] | None = None) -> list[dict]:
    """One dict per variant: measured params/MACs beside the published figures."""
    rows = []
    for name in names or list_models():
        info = VARIANTS[name]
        model = create_model(name)
        cfg = info.cfg
        rows.append(
            dict(
                model=name,
                params_m=round(sum(p.numel() for p in model.parameters()) / 1e6, 3),
                macs_m=round(count_macs(model, img_size) / 1e6, 1),
                published_params_m=info.params_m,
                published_macs_m=info.macs_m,
                top1=info.top1,
                widths=list(cfg.embed_dim),
                depths=list(cfg.depth),
                heads=list(cfg.num_heads),
                img_size=list(img_size),
            )
        )
    return rows


def _run(args: argparse.Namespace) -> int:
    size = tuple(args.img_size) if len(args.img_size) == 2 else (args.img_size[0],) * 2
    names = [n for n in list_models() if not args.model or n in args.model]
    if args.model and len(names) != len(args.model):
        raise ValueError(f"unknown model in {args.model}; available: {', '.join(list_models())}")
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
    print("params and MACs are counted on the models (torch.utils.flop_counter); top-1 is the published ImageNet-1k figure.")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("info", help="print the variant table (params, MACs, widths, depths, heads)")
    p.add_argument("--img-size", type=int, nargs="+", default=[224], metavar="N", help="input size: N or H W (default 224)")
    p.add_argument("--model", nargs="*", help="only these variants")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=_run)
