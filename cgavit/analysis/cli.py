"""``cgavit analyze heads|taylor`` and ``cgavit ablate``: thin commands over the analyses."""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

from ..cli.common import add_dial_args, dials_from_args

log = logging.getLogger(__name__)


def load_analysis_model(args: argparse.Namespace):
    """The model to analyse and how to feed it: ``(model, img_size, crop_pct, mean, std)``.

    With ``--checkpoint`` / ``--pretrained`` the model is rebuilt as :func:`cgavit.train.load_model`
    does (files trained here record their architecture, image size and preprocessing); otherwise a
    randomly initialised ``--model`` with the given dials is built.
    """
    from ..factory import create_model

    dials = dials_from_args(args)
    if args.checkpoint or args.pretrained:
        from ..train import load_model

        if args.checkpoint and args.pretrained:
            raise ValueError("give --checkpoint FILE or --pretrained, not both")
        if args.num_classes is not None:
            raise ValueError("--num-classes is for randomly initialised models; a checkpoint sets its own class count")
        model, info = load_model(args.checkpoint, args.model, dials or None, pretrained=args.pretrained)
        return model, args.img_size or info.img_size, args.crop_pct or info.crop_pct, info.mean, info.std
    log.warning("no --checkpoint: analysing randomly initialised weights")
    size = args.img_size or 224
    model = create_model(args.model or "efficientvit_m0", num_classes=args.num_classes or 1000, img_size=size, **dials)
    return model, size, args.crop_pct or 0.875, None, None


def _sources(args: argparse.Namespace) -> list[str]:
    if args.data and args.images:
        raise ValueError("give either --data DIR or image files, not both")
    if not args.data and not args.images:
        raise ValueError("give --data DIR (class sub-folders or images) or image files")
    return [args.data] if args.data else list(args.images)


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="variant (default: the checkpoint's, else efficientvit_m0)")
    p.add_argument("--checkpoint", help="weights: best.pt/last.pt/*.safetensors trained here (architecture and preprocessing read from the file), or an official/timm file (give --model and dials)")
    p.add_argument("--pretrained", action="store_true", help="use the published ImageNet-1k weights of --model (downloaded once to the torch hub cache)")
    p.add_argument("--data", help="image folder: DIR/<class>/<img> (labelled) or DIR/<img>")
    p.add_argument("images", nargs="*", help="image files (instead of --data)")
    p.add_argument("--output", required=True, help="folder for the JSON and PNG files")
    p.add_argument("--img-size", type=int, default=None, help="input size (default: the checkpoint's, else 224)")
    p.add_argument("--crop-pct", type=float, default=None, help="centre-crop fraction after resizing (default: the checkpoint's, else 0.875)")
    p.add_argument("--num-images", type=int, default=64, help="images to use, balanced over classes (default 64; 0 = all)")
    p.add_argument("--num-classes", type=int, default=None, help="classifier size (default: the checkpoint's, else 1000)")
    p.add_argument("--batch-size", type=int, default=32, help="images per forward pass (default 32)")
    p.add_argument("--seed", type=int, default=0, help="seed for the image sample and random weights (default 0)")
    add_dial_args(p)


def _prepare(args: argparse.Namespace):
    import torch

    from .data import load_images

    torch.manual_seed(args.seed)
    model, img_size, crop_pct, mean, std = load_analysis_model(args)
    x, y, classes = load_images(_sources(args), img_size, args.num_images, crop_pct, args.seed, mean, std)
    # near-equal batches (no trailing batch of one image)
    n = max(1, -(-x.shape[0] // max(args.batch_size, 1)))
    batches = list(zip(x.tensor_split(n), y.tensor_split(n) if y is not None else [None] * n))
    return model, img_size, batches, y, classes


def _label(args) -> str:
    if args.checkpoint:
        return "(" + "/".join(Path(args.checkpoint).parts[-3:]) + ")"
    return f"({args.model or 'efficientvit_m0'}{', published' if args.pretrained else ', random weights'})"


def _header(args, model, img_size, n) -> dict:
    from dataclasses import asdict

    return dict(
        model=args.model,
        config=asdict(model.cfg),
        checkpoint=args.checkpoint or ("published" if args.pretrained else None),
        img_size=img_size,
        num_images=n,
        dials={k: list(v) if isinstance(v, tuple) else v for k, v in dials_from_args(args).items()},
        seed=args.seed,
    )


def _run_heads(args: argparse.Namespace) -> int:
    from ..io import atomic_write
    from .heads import head_similarity, mean_similarity, plot_similarity

    model, img_size, batches, _, _ = _prepare(args)
    blocks = head_similarity(model, [x for x, _ in batches])
    out = Path(args.output)
    report = _header(args, model, img_size, sum(x.shape[0] for x, _ in batches))
    report.update(mean_similarity=mean_similarity(blocks), blocks=[b.to_dict() for b in blocks])
    atomic_write(out / "heads.json", lambda t: Path(t).write_text(json.dumps(report, indent=1)))
    plots = plot_similarity(blocks, out, title=_label(args))
    print(f"{'block':<30}{'heads':>6}{'tokens':>7}{'windows':>8}  mean off-diagonal similarity")
    for b in blocks:
        print(f"{b.name:<30}{b.num_heads:>6}{b.tokens:>7}{b.windows:>8}  {b.mean_off_diagonal:.3f}")
    print(f"mean over blocks (more than one token): {report['mean_similarity']:.3f}")
    print(f"wrote {out / 'heads.json'}, " + ", ".join(str(p) for p in plots))
    return 0


def _run_taylor(args: argparse.Namespace) -> int:
    from ..io import atomic_write
    from .taylor import kept_fraction, plot_importance, taylor_importance

    model, img_size, batches, y, classes = _prepare(args)
    use_labels = args.targets == "labels" or (
        args.targets == "auto" and y is not None and classes is not None and len(classes) == model.num_classes
    )
    if use_labels and y is None:
        raise ValueError("--targets labels needs --data DIR with one sub-folder per class")
    if use_labels and int(y.max()) >= model.num_classes:
        raise ValueError(f"the data has {len(classes)} classes but the model {model.num_classes}; use --targets predictions or --num-classes")
    targets = "labels" if use_labels else "predictions"
    blocks = taylor_importance(model, [(x, yy if use_labels else None) for x, yy in batches])
    kept = kept_fraction(blocks, args.prune_ratio)
    out = Path(args.output)
    report = _header(args, model, img_size, sum(x.shape[0] for x, _ in batches))
    report.update(
        loss_targets=targets,
        prune_ratio=args.prune_ratio,
        kept_fraction={str(s + 1): v for s, v in kept["kept"].items()},
        pruned_first=kept["pruned"][: args.list_pruned],
        pruned_count=len(kept["pruned"]),
        blocks=[b.to_dict() for b in blocks],
    )
    atomic_write(out / "taylor.json", lambda t: Path(t).write_text(json.dumps(report, indent=1)))
    plots = plot_importance(blocks, args.prune_ratio, out, title=_label(args))
    print(f"loss: cross-entropy against the {'folder labels' if use_labels else 'model' + chr(39) + 's own predictions'}")
    print(f"{'block':<22}{'Q':>10}{'K':>10}{'V':>10}{'FFN':>10}{'proj':>10}   mean |w*dL/dw| per channel")
    for b in blocks:
        m = b.to_dict()["mean"]
        print(f"{b.name:<22}" + "".join(f"{m[k]:>10.3g}" if m[k] is not None else f"{'-':>10}" for k in ("q", "k", "v", "ffn", "proj")))
    print(f"fraction kept after pruning the least important {args.prune_ratio:.0%} of Q/K/V/FFN channels:")
    for s, fr in kept["kept"].items():
        print(f"  stage {s + 1}: " + "  ".join(f"{k.upper()} {v:.2f}" for k, v in fr.items()))
    print(f"wrote {out / 'taylor.json'}, " + ", ".join(str(p) for p in plots))
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "analyze",
        help="head similarity and Taylor channel importance of a model",
        description="Analyses of a (trained) model on a few images: how alike its heads attend, and which channels matter.",
    )
    asub = p.add_subparsers(dest="analysis", metavar="ANALYSIS")
    h = asub.add_parser(
        "heads",
        help="cosine similarity between the heads' attention maps, per block",
        description="For every attention block, the h x h cosine similarity of the heads' attention maps (flattened, averaged "
        "over images and windows). Writes heads.json, heads_matrices.png (heatmaps) and heads_mean.png (mean "
        "off-diagonal similarity per block).",
    )
    _common(h)
    h.set_defaults(func=_run_heads)
    t = asub.add_parser(
        "taylor",
        help="first-order Taylor importance of Q/K/V/FFN/projection channels",
        description="|w * dL/dw| summed per output channel over the images (eval mode, mean cross-entropy). Writes "
        "taylor.json, taylor_spread.png (Q/K vs V vs FFN importance per stage) and taylor_pruning.png (channels kept "
        "per stage and kind when the least important --prune-ratio of all are removed).",
    )
    _common(t)
    t.add_argument("--targets", choices=("auto", "labels", "predictions"), default="auto",
                   help="loss targets: folder labels, or the model's own predictions; auto = labels when the folder has as many classes as the model (default)")
    t.add_argument("--prune-ratio", type=float, default=0.3, help="pruning budget: fraction of Q/K/V/FFN channels removed, least important first (default 0.3)")
    t.add_argument("--list-pruned", type=int, default=50, help="how many first-pruned channels to list in the JSON (default 50)")
    t.set_defaults(func=_run_taylor)
    p.set_defaults(func=lambda a: (p.print_help(), 2)[1])

    from .ablation import add_ablate_args

    a = sub.add_parser(
        "ablate",
        help="train the sandwich / group / cascade / reallocation ladder and tabulate it",
        description="Train, under one budget and recipe, the ladder: (1) standard layout, (2) + sandwich, (3) + channel "
        "groups, (4) + cascade, (5) + reallocation; then measure params, MACs, CPU throughput, top-1 and head "
        "similarity. Each (variant, seed) keeps its own folder and result file, so an interrupted study continues "
        "where it stopped.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add_ablate_args(a)
    a.set_defaults(func=_run_ablate)


def _run_ablate(args: argparse.Namespace) -> int:
    from .ablation import run_from_args

    return run_from_args(args)
