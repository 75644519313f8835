"""``cgavit train``, ``cgavit eval``, ``cgavit predict`` and ``cgavit demo``: thin over the library."""

from __future__ import annotations

import argparse
import json

from ..cli.common import add_dial_args, dials_from_args


def _train(args: argparse.Namespace) -> int:
    import os

    from .engine import run

    result = run(args)
    if int(os.environ.get("RANK", "0")) == 0:
        print(json.dumps({k: v for k, v in result.items() if k != "classes"}, indent=1))
    if result["interrupted"] and result.get("signal") is not None:
        return 128 + int(result["signal"])
    return 0


def _eval(args: argparse.Namespace) -> int:
    import os

    from .inference import evaluate_checkpoint

    res = evaluate_checkpoint(
        args.data,
        args.checkpoint,
        args.model,
        split=args.split,
        img_size=args.img_size,
        crop_pct=args.crop_pct,
        interpolation=args.interpolation,
        batch_size=args.batch_size,
        workers=args.workers,
        device=args.device,
        dials=dials_from_args(args),
        use_ema=args.ema,
        pretrained=args.pretrained,
        strict=args.strict,
        trust=args.trust_checkpoint,
    )
    if int(os.environ.get("RANK", "0")) != 0:
        return 0
    if args.json:
        print(json.dumps(res))
    else:
        print(
            f"{res['checkpoint']} on {res['data']} ({res['n']} images at {res['img_size']} px, crop {res['crop_pct']}): "
            f"top-1 {res['top1']:.2f}%  top-5 {res['top5']:.2f}%  loss {res['loss']:.4f}"
            + (f"  ({res['skipped']} unreadable images skipped)" if res["skipped"] else "")
        )
    return 0


def _predict(args: argparse.Namespace) -> int:
    from .inference import predict

    rows = predict(
        args.images,
        args.checkpoint,
        args.model,
        topk=args.topk,
        img_size=args.img_size,
        dials=dials_from_args(args),
        use_ema=args.ema,
        pretrained=args.pretrained,
        trust=args.trust_checkpoint,
        device=args.device,
    )
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    for row in rows:
        print(row["image"])
        for rank, t in enumerate(row["top"], 1):
            print(f"  {rank}. {100 * t['prob']:6.2f}%  {t['name']}  (class {t['index']})")
    return 0


def _demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    run_demo(args.output, epochs=args.epochs, threads=args.threads, seed=args.seed, progress=args.progress)
    return 0


def _add_model_source(p: argparse.ArgumentParser) -> None:
    p.add_argument("--checkpoint", metavar="FILE", help="best.pt/last.pt/best.safetensors trained here, or an official/timm file")
    p.add_argument("--model", help="variant name (needed for files that do not record it)")
    p.add_argument("--pretrained", action="store_true", help="use the published ImageNet-1k weights of --model (downloads once)")
    p.add_argument("--ema", action="store_true", help="use the EMA weights of a training checkpoint")
    p.add_argument("--trust-checkpoint", action="store_true", help="allow pickled objects in a third-party file (runs its code)")
    p.add_argument("--img-size", type=int, default=None, help="input size (default: the checkpoint's, else 224)")
    add_dial_args(p)


def register(sub: argparse._SubParsersAction) -> None:
    from .recipe import add_train_args

    p = sub.add_parser(
        "train",
        help="train on an image folder with the official recipe (single process or torchrun)",
        description="Train an EfficientViT on DIR/train/<class>/, evaluating on DIR/val/<class>/ every epoch. Defaults "
        "are the official recipe; option names follow timm's train.py. Under torchrun the same command runs "
        "DistributedDataParallel (NCCL on GPU, gloo on CPU). Writes DIR/last.pt every epoch, best.pt, "
        "best.safetensors, metrics.jsonl, train.log and curves.png. SIGTERM/SIGINT save last.pt before exiting.",
    )
    add_train_args(p)
    p.set_defaults(func=_train)

    p = sub.add_parser(
        "eval",
        help="top-1, top-5 and loss of a checkpoint on an image folder",
        description="Evaluate a checkpoint on DIR/val/<class>/ (or a split folder given directly). Runs distributed "
        "under torchrun with exactly the single-process metrics.",
    )
    p.add_argument("--data", required=True, metavar="DIR", help="dataset root or split folder")
    p.add_argument("--split", default=None, help="split folder inside --data (default: val when present)")
    p.add_argument("--crop-pct", type=float, default=None, help="centre-crop fraction (default: the checkpoint's, else 0.875)")
    p.add_argument("--interpolation", default=None, choices=("bicubic", "bilinear", "nearest"), help="resize interpolation (default bicubic)")
    p.add_argument("--batch-size", "-b", type=int, default=128, help="batch size per process (default 128)")
    p.add_argument("--workers", "-j", type=int, default=4, help="loader workers (default 4)")
    p.add_argument("--device", default="auto", help="auto, cpu or cuda (default auto)")
    p.add_argument("--strict", action="store_true", help="stop at an unreadable image instead of skipping it")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    _add_model_source(p)
    p.set_defaults(func=_eval)

    p = sub.add_parser(
        "predict",
        help="top-5 classes of image files",
        description="Classify images of any mode (grayscale, RGBA, palette, CMYK, 16-bit, float) and size. Class "
        "names: the dataset's for checkpoints trained here, ImageNet-1k's for 1000-class models.",
    )
    p.add_argument("images", nargs="+", metavar="IMAGE", help="image files")
    p.add_argument("--topk", type=int, default=5, help="classes to show (default 5)")
    p.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    p.add_argument("--json", action="store_true", help="print JSON")
    _add_model_source(p)
    p.set_defaults(func=_predict)

    p = sub.add_parser(
        "demo",
        help="zero-setup demo: train a small CGA model on scikit-learn's handwritten digits (minutes on 2 CPU cores)",
        description="Writes scikit-learn's bundled 8x8 digits (1797 images, no download) as an image folder, trains a "
        "small EfficientViT with cascaded group attention on it at 64 px through the same training engine as "
        "`cgavit train`, evaluates the held-out split, and writes a checkpoint, report and curves.",
    )
    p.add_argument("--output", default="runs/demo", metavar="DIR", help="output folder (default runs/demo)")
    p.add_argument("--epochs", type=int, default=None, help="training epochs (default: the demo recipe's)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: cores - 1, at most 4)")
    p.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None, help="progress bar (default: on a terminal)")
    p.set_defaults(func=_demo)
