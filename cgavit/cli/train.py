"""``cgavit train``, ``cgavit eval``, ``cgavit predict`` and ``cgavit demo``: thin over :mod:`cgavit.train`.

The training flags are generated from :class:`~cgavit.train.TrainConfig` (:mod:`.options`): each
field's flag, help and default (shown in ``--help``) come from the dataclass, so the command and the
library cannot disagree. Flags are parsed with ``argparse.SUPPRESS`` defaults, so the options a user
typed can be told apart: on ``--resume`` they win over the ones stored in the checkpoint.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from dataclasses import fields

from ..bounds import INTERPOLATIONS
from ..deploy.agreement import Agreement
from ..images import skipped_text
from ..io import printable, printable_line
from ..train import TrainConfig, evaluate_checkpoint, predict, train
from ..train.demo import DEMO_EPOCHS, run_demo, summary_lines
from ..train.evaluation import top5_text
from .common import add_dial_args, dials_from_args, image_size
from .options import add_options, option_values

#: The TrainConfig fields ``cgavit train`` has a flag for, in the order ``--help`` lists them (the
#: design dials, the ``dials`` field, follow as flags of their own).
TRAIN_FIELDS: tuple[str, ...] = tuple(f.name for f in fields(TrainConfig) if f.name != "dials")


def add_train_args(parser: argparse.ArgumentParser) -> None:
    """Add every training option and the design dials to ``parser`` (defaults: SUPPRESS)."""
    add_options(parser, TrainConfig, TRAIN_FIELDS, suppress=True)
    add_dial_args(parser)


def typed_options(args: argparse.Namespace) -> dict:
    """The training options given on the command line, as TrainConfig fields (dials under ``dials``)."""
    typed = option_values(args, TRAIN_FIELDS)
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
    cfg = config_from_args(args)
    result = train(cfg)
    if int(os.environ.get("RANK", "0")) == 0:
        print(json.dumps({k: v for k, v in result.to_dict().items() if k != "classes"}, indent=1))
        if result.weights:  # on stderr: stdout is the JSON alone
            use = [["cgavit", "eval", "--checkpoint", result.weights, "--data", cfg.data or "DIR"],
                   ["cgavit", "predict", "IMAGE", "--checkpoint", result.weights]]
            print(f"try:   {printable_line('   or   '.join(shlex.join(c) for c in use))}", file=sys.stderr)
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
        reference=args.reference,
    )
    if int(os.environ.get("RANK", "0")) != 0:
        return 0
    if args.json:
        print(json.dumps(res))
    else:
        print(  # the paths escaped, newlines too: a name cannot forge a line of output
            f"{printable_line(res['checkpoint'])} on {printable_line(res['data'])} "
            f"({res['n']} images at {res['img_size']} px, crop {res['crop_pct']}): "
            f"top-1 {res['top1']:.2f}%  "
            + top5_text(res["top5"], res["num_classes"])
            + f"  loss {res['loss']:.4f}"
            + (f"  ({skipped_text(res['skipped'])})" if res["skipped"] else "")
        )
        if args.reference:
            print(f"top-1 agreement with {printable_line(res['reference'])}: {res['agreement']:.2f}% "
                  f"({res['changed']} of {res['n']} decisions changed; 95% interval {agreement_interval(res['agreement'], res['n'])})")
    return 0


def agreement_interval(percent: float, n: int) -> str:
    """Wilson's 95 % interval of an agreement of ``percent`` on ``n`` images, as ``"a-b%"``."""
    return Agreement(n=n, top1_agreement=percent / 100, max_rel_err=0.0).shown_interval()


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
        width = len(str(max((len(row["top"]) for row in good), default=1)))  # ranks 1-9 aligned with 10 and up
        for row in good:  # file and class names may hold escape sequences and newlines: printed escaped
            print(printable_line(str(row["image"])))
            for rank, t in enumerate(row["top"], 1):
                print(f"  {rank:>{width}}. {100 * t['prob']:6.2f}%  {printable_line(t['name'])}  (class {t['index']})")
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
        print(f"demo stopped; continue it with: {shlex.join(['cgavit', 'train', '--resume', str(report['last'])])}")
        return 128 + int(report["signal"]) if report.get("signal") is not None else 130
    print("\n".join(summary_lines(report, args.output)))
    return 0


def _add_model_source(p: argparse.ArgumentParser) -> None:
    p.add_argument("--checkpoint", metavar="FILE", help="best.pt/last.pt/best.safetensors trained here, an official/timm file, or a file from cgavit export / quantize (.onnx, OpenVINO .xml: run in its runtime on the CPU, with the preprocessing and class names it carries)")
    p.add_argument("--model", help="variant name (needed for files that do not record it)")
    p.add_argument("--pretrained", action="store_true", help="use the published ImageNet-1k weights of --model (downloads once)")
    p.add_argument("--ema", action="store_true", help="use the EMA weights of a training checkpoint")
    p.add_argument("--trust-checkpoint", action="store_true", help="allow pickled objects in a third-party file (runs its code)")
    p.add_argument("--img-size", type=int, default=None,
                   help="input size, which the network is built for (its attention windows; default: the checkpoint's, "
                   "else 224)")
    add_dial_args(p)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "train",
        help="train on an image folder with the official recipe (single process or torchrun)",
        description="Train an EfficientViT on DIR/train/<class>/, evaluating on DIR/val/<class>/ every epoch. Defaults "
        "are the official recipe; option names follow timm's train.py. Under torchrun the same command runs "
        "DistributedDataParallel (NCCL on GPU, gloo on CPU). Writes into the --output run folder: last.pt every epoch, "
        "best.pt, best.safetensors, metrics.jsonl, train.log and curves.png. SIGTERM/SIGINT save last.pt before exiting.",
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
    p.add_argument("--interpolation", default=None, choices=INTERPOLATIONS, help="resize interpolation (default: the checkpoint's, else bicubic)")
    p.add_argument("--batch-size", "-b", type=int, default=128, help="batch size per process (default 128)")
    p.add_argument("--workers", "-j", type=int, default=4, help="loader workers (default 4)")
    p.add_argument("--device", default="auto", help="auto, cpu or cuda (default auto: a GPU when there is one, the CPU "
                   "for an exported file)")
    p.add_argument("--strict", action="store_true", help="stop at an unreadable image instead of skipping it")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--reference", metavar="FILE", default=None,
                   help="also report top-1 agreement with this checkpoint or exported file on the same images: give "
                        "the fp32 checkpoint an int8 file was quantised from to see the share of its decisions the "
                        "file keeps on images of your own (a checkpoint that records its network, as files written "
                        "here do; --trust-checkpoint applies to it too)")
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
    p.add_argument("--output", default="runs/demo", metavar="DIR", help="output folder (default runs/demo); an earlier demo's results there are replaced")
    p.add_argument("--epochs", type=int, default=None, help=f"training epochs (default {DEMO_EPOCHS}, the demo recipe's; 1 for a quick look at the pipeline)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: cores - 1, at most 4)")
    p.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None, help="progress bar (default: on a terminal)")
    p.set_defaults(func=_demo)
