"""``cgavit train``, ``cgavit eval``, ``cgavit predict`` and ``cgavit demo``: thin over :mod:`cgavit.train`.

The training flags are one flat table below; their defaults (shown in ``--help``) are read from
:class:`~cgavit.train.TrainConfig`, so the command and the library cannot disagree. Flags are parsed
with ``argparse.SUPPRESS`` defaults, so the options a user typed can be told apart: on ``--resume``
they win over the ones stored in the checkpoint.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from ..io import printable
from ..train import TrainConfig, evaluate_checkpoint, predict, train
from ..train.config import AMP_DTYPES, CLIP_MODES, DISTILLATION_TYPES, INTERPOLATIONS, train_defaults
from ..train.demo import run_demo, summary_lines
from .common import add_dial_args, dials_from_args, image_size

# (flags, argparse keywords): every TrainConfig field but the dials, in the order --help lists them
TRAIN_OPTIONS: tuple[tuple[tuple[str, ...], dict], ...] = (
    # data
    (("--data",), dict(metavar="DIR", help="dataset root with train/<class>/ and val/<class>/ image folders")),
    (("--train-split",), dict(help="training split folder name")),
    (("--val-split",), dict(help="validation split folder name")),
    (("--img-size",), dict(type=int, help="training and evaluation image size in pixels")),
    (("--crop-pct",), dict(type=float, help="evaluation centre-crop fraction (resize to img_size/crop_pct first)")),
    (("--interpolation",), dict(choices=INTERPOLATIONS, help="resize interpolation")),
    (("--mean",), dict(type=float, nargs=3, metavar=("R", "G", "B"), help="normalisation mean (ImageNet's)")),
    (("--std",), dict(type=float, nargs=3, metavar=("R", "G", "B"), help="normalisation std (ImageNet's)")),
    (("--workers", "-j"), dict(type=int, help="data-loading worker processes per training process")),
    (("--strict",), dict(action="store_true", help="stop at the first unreadable image instead of skipping it")),
    # model
    (("--model",), dict(help="variant efficientvit_m0..m5 (dials below change it)")),
    (("--drop-path",), dict(type=float, help="stochastic-depth rate")),
    (("--finetune",), dict(metavar="CKPT", help="start from these weights (official, timm or cgavit file); "
                           "a classifier for another class count is replaced")),
    # optimisation
    (("--epochs",), dict(type=int, help="epochs of the cosine schedule")),
    (("--cooldown-epochs",), dict(type=int, help="extra epochs at --min-lr after the cosine (timm semantics). "
                                  "The official config names 10, but its DeiT loop stops at --epochs")),
    (("--batch-size", "-b"), dict(type=int, help="batch size per process (official: 256 x 8 GPUs)")),
    (("--lr",), dict(type=float, help="peak learning rate (default: --lr-base x total batch / --lr-base-size)")),
    (("--lr-base",), dict(type=float, help="learning rate at the reference batch size")),
    (("--lr-base-size",), dict(type=int, help="reference total batch size for --lr-base")),
    (("--opt",), dict(help="timm optimiser name")),
    (("--opt-eps",), dict(type=float, help="optimiser epsilon")),
    (("--momentum",), dict(type=float, help="momentum (SGD-type optimisers)")),
    (("--weight-decay",), dict(type=float, help="weight decay (none on attention biases, norms, biases)")),
    (("--warmup-epochs",), dict(type=int, help="linear warm-up epochs")),
    (("--warmup-lr",), dict(type=float, help="learning rate at the start of the warm-up")),
    (("--min-lr",), dict(type=float, help="learning rate at the end of the cosine")),
    (("--sched-on-updates",), dict(action="store_true", help="step the schedule every update instead of every epoch "
                                   "(smoother for short runs)")),
    (("--clip-grad",), dict(type=float, help="gradient clipping value; 0 disables")),
    (("--clip-mode",), dict(choices=CLIP_MODES, help="gradient clipping mode")),
    # augmentation and regularisation
    (("--aa",), dict(help="timm auto-augment policy; 'none' disables")),
    (("--reprob",), dict(type=float, help="random-erasing probability")),
    (("--hflip",), dict(type=float, help="horizontal-flip probability")),
    (("--scale",), dict(type=float, nargs=2, metavar=("MIN", "MAX"), help="random-resized-crop area range")),
    (("--color-jitter",), dict(type=float, help="colour-jitter strength (ignored when --aa is set)")),
    (("--smoothing",), dict(type=float, help="label smoothing")),
    (("--mixup",), dict(type=float, help="mixup alpha; 0 disables")),
    (("--cutmix",), dict(type=float, help="cutmix alpha; 0 disables")),
    (("--mixup-prob",), dict(type=float, help="probability of applying mixup or cutmix to a batch")),
    (("--mixup-switch-prob",), dict(type=float, help="probability of cutmix rather than mixup when both are on")),
    (("--aug-repeats",), dict(type=int, help="repeated augmentation (DeiT) across processes; used when "
                              "running several processes, 0 or 1 disables")),
    (("--model-ema",), dict(action=argparse.BooleanOptionalAction, help="keep an exponential moving average of the weights")),
    (("--model-ema-decay",), dict(type=float, help="EMA decay per update")),
    (("--model-ema-eval",), dict(action="store_true", help="also evaluate the EMA weights every epoch")),
    # distillation (DeiT)
    (("--distillation-type",), dict(choices=DISTILLATION_TYPES, help="DeiT distillation through the distillation head")),
    (("--distillation-alpha",), dict(type=float, help="weight of the distillation loss")),
    (("--distillation-tau",), dict(type=float, help="temperature of soft distillation")),
    (("--teacher",), dict(help="teacher: a timm or cgavit model name (with --teacher-weights), or a checkpoint "
                          "trained here")),
    (("--teacher-weights",), dict(metavar="FILE", help="local weights file for --teacher (never downloaded)")),
    # run
    (("--output",), dict(metavar="DIR", help="run folder for last.pt, best.pt, metrics.jsonl, curves.png "
                         "(default runs/<model>-<time>)")),
    (("--resume",), dict(metavar="CKPT", help="continue the run saved in CKPT (e.g. DIR/last.pt); options not "
                         "given again are taken from it")),
    (("--seed",), dict(type=int, help="random seed")),
    (("--device",), dict(help="auto, cpu or cuda")),
    (("--amp",), dict(action="store_true", help="mixed precision on GPU (ignored on CPU)")),
    (("--amp-dtype",), dict(choices=AMP_DTYPES, help="mixed-precision type")),
    (("--log-interval",), dict(type=int, help="updates between log lines when not on a terminal")),
    (("--progress",), dict(action=argparse.BooleanOptionalAction, help="progress bar (default: when stderr is a terminal)")),
)


def dest(flags: tuple[str, ...]) -> str:
    """The TrainConfig field of a flag: ``--batch-size`` -> ``batch_size``."""
    return flags[0].lstrip("-").replace("-", "_")


def _with_default(kw: dict, default: object) -> dict:
    """``kw`` with the default named in its help text."""
    kw = dict(kw)
    if kw.get("action") == argparse.BooleanOptionalAction:
        if default is not None:
            kw["help"] = f"{kw['help']} (default: {'on' if default else 'off'})"
    elif default not in (None, False):
        shown = " ".join(map(str, default)) if isinstance(default, tuple) else default
        kw["help"] = f"{kw['help']} (default: {shown})"
    return kw


def add_train_args(parser: argparse.ArgumentParser) -> None:
    """Add every training option and the design dials to ``parser`` (defaults: SUPPRESS)."""
    defaults = train_defaults()
    for flags, kw in TRAIN_OPTIONS:
        parser.add_argument(*flags, dest=dest(flags), default=argparse.SUPPRESS, **_with_default(kw, defaults[dest(flags)]))
    # a testing aid: behave as if SIGTERM arrived after this many updates (same code path)
    parser.add_argument("--interrupt-after", dest="interrupt_after", type=int, default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    add_dial_args(parser)


def typed_options(args: argparse.Namespace) -> dict:
    """The training options given on the command line, as TrainConfig fields (dials under ``dials``)."""
    names = [dest(flags) for flags, _ in TRAIN_OPTIONS] + ["interrupt_after"]
    typed = {name: getattr(args, name) for name in names if hasattr(args, name)}
    dials = dials_from_args(args)
    if dials:
        typed["dials"] = dials
    return typed


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """The run a ``cgavit train`` command line asks for: with ``--resume``, the checkpoint's options
    overridden by the ones typed; otherwise the typed ones over the recipe's defaults."""
    typed = typed_options(args)
    resume = typed.pop("resume", None)
    if resume:
        return TrainConfig.resume_from(resume, **typed)
    return TrainConfig(**typed)


def _train(args: argparse.Namespace) -> int:
    result = train(config_from_args(args))
    if int(os.environ.get("RANK", "0")) == 0:
        print(json.dumps({k: v for k, v in result.to_dict().items() if k != "classes"}, indent=1))
    if result.interrupted and result.signal is not None:
        return 128 + int(result.signal)
    return 0


def _img_size(args: argparse.Namespace) -> int | None:
    """``--img-size`` within the commands' bounds (None: the checkpoint's)."""
    return None if args.img_size is None else image_size(args.img_size)[0]


def _eval(args: argparse.Namespace) -> int:
    res = evaluate_checkpoint(
        args.data,
        args.checkpoint,
        args.model,
        split=args.split,
        img_size=_img_size(args),
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
    """Print the classes of the images that could be read (text or JSON), then one error line per image
    that could not; exit 1 when some could not, 2 when none could."""
    rows = predict(
        args.images,
        args.checkpoint,
        args.model,
        topk=args.topk,
        img_size=_img_size(args),
        dials=dials_from_args(args),
        use_ema=args.ema,
        pretrained=args.pretrained,
        trust=args.trust_checkpoint,
        device=args.device,
    )
    good = [row for row in rows if "top" in row]
    if args.json:
        print(json.dumps(good, indent=1))
    else:
        for row in good:  # file and class names may hold escape sequences: printed escaped
            print(printable(str(row["image"])))
            for rank, t in enumerate(row["top"], 1):
                print(f"  {rank}. {100 * t['prob']:6.2f}%  {printable(t['name'])}  (class {t['index']})")
    sys.stdout.flush()
    for row in rows:
        if "error" in row:
            print(f"cgavit predict: error: {printable(' '.join(row['error'].split()))}", file=sys.stderr)
    if len(good) == len(rows):
        return 0
    return 1 if good else 2


def _demo(args: argparse.Namespace) -> int:
    report = run_demo(args.output, epochs=args.epochs, threads=args.threads, seed=args.seed, progress=args.progress, say=print)
    if report.get("interrupted"):
        print(f"demo stopped; continue it with: cgavit train --resume {report['last']}")
        return 0
    print("\n".join(summary_lines(report, args.output)))
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
    p.add_argument("--interpolation", default=None, choices=INTERPOLATIONS, help="resize interpolation (default bicubic)")
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
