"""``cgavit detect train|eval|predict|shapes``: COCO-format detection from the command line.

Every command runs alone or under ``torchrun`` (``train`` and ``eval`` split the work across the
processes; only rank 0 writes or prints).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from dataclasses import fields
from pathlib import Path
from typing import Any

from ..detection import DetectionTrainConfig, evaluate_checkpoint, predict_images, train, write_shapes_dataset
from ..detection.coco import STAT_NAMES
from ..detection.shapes import check_shapes_destination, check_shapes_request
from ..io import DataError, printable, printable_line
from .common import add_dial_args, dials_from_args
from .options import add_options, option_values

#: The DetectionTrainConfig fields ``detect train`` has a flag for (the dials and ``--model-arg``, the
#: dict fields, are spelled by hand).
TRAIN_FIELDS: tuple[str, ...] = tuple(f.name for f in fields(DetectionTrainConfig) if f.name not in ("dials", "model_kwargs"))
#: The options ``detect train`` and ``detect eval`` share.
COMMON_FIELDS = ("device", "batch_size", "workers", "strict")


def coco_paths(args: argparse.Namespace, train: bool) -> None:
    """Fill the json/image paths from ``--data`` (the COCO 2017 folder layout) where not given."""
    root = getattr(args, "data", None)
    if not root:
        return
    root = Path(root)
    if train:
        args.train_json = args.train_json or str(root / "annotations" / "instances_train2017.json")
        args.train_images = args.train_images or str(root / "train2017")
    args.val_json = args.val_json or str(root / "annotations" / "instances_val2017.json")
    args.val_images = args.val_images or str(root / "val2017")


def model_args(items: list[str]) -> dict[str, Any]:
    """``["key=value", ...]`` as keyword arguments; values are read as JSON where they parse."""
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.isidentifier():
            raise ValueError(f"--model-arg expects KEY=VALUE (e.g. box_detections_per_img=300), got {item!r}")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


def train_config(args: argparse.Namespace) -> DetectionTrainConfig:
    """The ``detect train`` options as the library's config."""
    coco_paths(args, train=True)
    values = option_values(args, TRAIN_FIELDS)
    values["lr_steps"] = tuple(values["lr_steps"])
    return DetectionTrainConfig(**values, dials=dials_from_args(args), model_kwargs=model_args(args.model_arg))


def _is_main() -> bool:
    return os.environ.get("RANK", "0") == "0"


def run_train(args: argparse.Namespace) -> int:
    cfg = train_config(args)
    metrics = train(cfg)
    if metrics and _is_main():
        print(json.dumps(shown_metrics(metrics)))
        written = [name for name in ("checkpoint.pth", "model.pth", "metrics.jsonl", "loss.png") if (Path(cfg.output) / name).is_file()]
        note = "" if "loss.png" in written else " (no loss.png: no loss was logged; runs shorter than --log-every iterations log none)"
        print(f"{', '.join(written)} in {cfg.output}{note}")
        if "model.pth" in written:
            print(f"try:   {printable_line('   or   '.join(shlex.join(c) for c in next_commands(cfg)))}")
    return 0


def next_commands(cfg: DetectionTrainConfig) -> list[list[str]]:
    """What to run on a trained detector: draw its detections, and evaluate it on the validation data it was given."""
    model = str(Path(cfg.output) / "model.pth")
    commands = [["cgavit", "detect", "predict", "IMAGE", "--checkpoint", model]]
    if cfg.val_json and cfg.val_images:
        commands.append(["cgavit", "detect", "eval", "--checkpoint", model, "--val-json", cfg.val_json,
                         "--val-images", cfg.val_images])
    return commands


def shown_metrics(record: dict[str, Any]) -> dict[str, float]:
    """What ``detect train`` prints of its last epoch's record: the loss and the COCO scores (``bbox_AP``, ...;
    not RetinaNet's ``bbox_regression`` loss, whose name starts the same), rounded."""
    scores = {f"{kind}_{stat}" for kind in ("bbox", "segm") for stat in STAT_NAMES}
    return {k: round(v, 4) for k, v in record.items() if k in scores or k == "loss"}


def run_eval(args: argparse.Namespace) -> int:
    coco_paths(args, train=False)
    metrics, summary = evaluate_checkpoint(
        args.checkpoint, args.val_json, args.val_images, batch_size=args.batch_size, workers=args.workers,
        strict=args.strict, device=args.device,
    )
    if _is_main():
        if not args.json:
            print(summary)
        print(json.dumps({k: round(v, 4) for k, v in metrics.items()}))
    return 0


def run_predict(args: argparse.Namespace) -> int:
    """Draw and list each image's detections; exit 1 when some images could not be read, 2 when none could
    (as ``cgavit predict``)."""
    threshold, done = args.score_threshold, 0
    try:
        for pred in predict_images(args.checkpoint, args.images, args.out, threshold, args.device):
            limit = f" (the detector's limit per image, {pred.limit_setting}: more may score as much)" if pred.limit else ""
            image, drawn = printable_line(str(pred.image)), printable_line(str(pred.drawn))  # newlines too: one line each
            print(f"{image}: {len(pred.scores)} detections >= {threshold}{limit} -> {drawn}")
            for name, score, box in zip(pred.names, pred.scores, pred.boxes):
                print(f"  {printable_line(name):<16} {score:.3f}  [{', '.join(f'{v:.1f}' for v in box)}]")
            done += 1
    except DataError as err:  # the images that could not be read, after the others
        if not done:
            raise
        sys.stdout.flush()
        print(f"cgavit detect: error: {printable(' '.join(str(err).split()))}", file=sys.stderr)
        return 1
    return 0


def run_shapes(args: argparse.Namespace) -> int:
    for split, n in (("train", args.num_train), ("val", args.num_val)):  # both checked before either is written
        check_shapes_request(n, args.size, args.max_shapes)
        check_shapes_destination(args.out, split)
    for split, n, seed in (("train", args.num_train, args.seed), ("val", args.num_val, args.seed + 1)):
        d, j = write_shapes_dataset(args.out, n, args.size, seed=seed, max_shapes=args.max_shapes, split=split)
        print(f"{split}: {n} images in {d}, annotations {j}")
    out = Path(args.out)
    command = ["cgavit", "detect", "train", "--train-json", str(out / "train.json"), "--train-images", str(out / "train"),
               "--val-json", str(out / "val.json"), "--val-images", str(out / "val"), "--backbone", "efficientvit_m0",
               "--train-bn", "--min-size", str(args.size), "--max-size", str(args.size)]
    print(f"try:   {printable_line(shlex.join(command))}")  # a random backbone needs --train-bn (see its help)
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    det = sub.add_parser(
        "detect",
        help="object detection / instance segmentation: RetinaNet and Mask R-CNN with EfficientViT backbones",
        description="RetinaNet and Mask R-CNN (torchvision) with an EfficientViT backbone and the paper's FPN, "
        "trained and evaluated (pycocotools COCOeval) on COCO-format data: an image folder plus an instances JSON. "
        "Multi-GPU: torchrun --nproc_per_node=N -m cgavit detect train ...",
    )
    cmds = det.add_subparsers(dest="detect_command", metavar="{train,eval,predict,shapes}")
    det.set_defaults(func=lambda a: (det.print_help(), 2)[1])

    t = cmds.add_parser(
        "train", help="train on COCO-format data (paper's 1x recipe by default)",
        description="Train RetinaNet or Mask R-CNN. Defaults are the paper's 1x COCO recipe: AdamW lr 1e-4, weight decay "
        "0.05 (none on attention biases), 12 epochs, lr x0.1 after epochs 8 and 11, 500 linear warm-up iterations, "
        "BatchNorm frozen, shorter side 800 (max 1333), random horizontal flips. Writes checkpoint.pth every epoch, "
        "and where Ctrl-C or SIGTERM stops the run (--resume auto goes on from there), model.pth, metrics.jsonl and "
        "loss.png to --output.",
    )
    g = t.add_argument_group("data")
    g.add_argument("--data", metavar="COCO_ROOT", help="a COCO 2017 folder (train2017/, val2017/, annotations/instances_*2017.json)")
    add_options(g, DetectionTrainConfig, ("train_json", "train_images", "val_json", "val_images"))
    m = t.add_argument_group("model")
    add_options(m, DetectionTrainConfig, ("model", "backbone", "pretrained_backbone", "freeze_bn", "trainable_backbone_layers",
                                            "trust_checkpoint"))
    m.add_argument("--model-arg", action="append", default=[], metavar="KEY=VALUE",
                   help="a torchvision detector setting (repeatable), e.g. detections_per_img=300 (RetinaNet), "
                        "box_detections_per_img=300 or rpn_batch_size_per_image=128 (Mask R-CNN); a name it does not take is refused")
    add_options(m, DetectionTrainConfig, ("min_size", "max_size"))
    add_dial_args(t)
    r = t.add_argument_group("recipe")
    add_options(r, DetectionTrainConfig, ("epochs", "lr_steps", "warmup_iters", "warmup_ratio", "lr", "weight_decay", "hflip", "seed"))
    add_options(t, DetectionTrainConfig, COMMON_FIELDS)
    o = t.add_argument_group("output")
    add_options(o, DetectionTrainConfig, ("output", "resume", "eval_every", "log_every"))
    t.set_defaults(func=run_train)

    e = cmds.add_parser("eval", help="COCO bbox (and segm) mAP of a trained checkpoint",
                        description="Evaluate a checkpoint with pycocotools COCOeval (bbox; segm too for Mask R-CNN).")
    e.add_argument("--checkpoint", required=True, help="model.pth or checkpoint.pth written by `cgavit detect train`")
    e.add_argument("--data", metavar="COCO_ROOT", help="a COCO 2017 folder (uses val2017)")
    e.add_argument("--val-json", help="instances JSON")
    e.add_argument("--val-images", help="image folder")
    e.add_argument("--json", action="store_true", help="print only the metrics as JSON")
    add_options(e, DetectionTrainConfig, COMMON_FIELDS)  # the same options, texts and defaults as training's
    e.set_defaults(func=run_eval)

    p = cmds.add_parser("predict", help="draw a checkpoint's detections (boxes, labels, scores, masks) on images",
                        description="Run a trained detector on images and save them with boxes, labels, scores and masks drawn.")
    p.add_argument("images", nargs="+", help="image files")
    p.add_argument("--checkpoint", required=True, help="model.pth or checkpoint.pth written by `cgavit detect train`")
    p.add_argument("--output", "--out", dest="out", help="output image (one image; its format by its suffix: .png, "
                   ".jpg, ...), or folder (default: <image name>_pred.png in the current folder; images of the same "
                   "name get -2, -3, ...); never one of the images")
    p.add_argument("--score-threshold", type=float, default=0.5, help="draw detections scoring at least this (default 0.5; "
                   "one under the detector's own score_thresh, 0.05 unless trained with another --model-arg, lowers it)")
    p.add_argument("--device", default="auto", help="auto, cpu or cuda (default auto)")
    p.set_defaults(func=run_predict)

    s = cmds.add_parser("shapes", help="write a small generated COCO-format dataset of coloured shapes (for trying the pipeline)",
                        description="Generate coloured squares, circles and triangles on plain backgrounds with boxes and "
                        "polygon/RLE masks, as train/ + train.json and val/ + val.json. A smoke test, not a benchmark.")
    s.add_argument("--output", "--out", dest="out", required=True, help="output folder")
    s.add_argument("--num-train", type=int, default=200, help="training images (default 200)")
    s.add_argument("--num-val", type=int, default=50, help="validation images (default 50)")
    s.add_argument("--size", type=int, default=192, help="image side in pixels (default 192)")
    s.add_argument("--max-shapes", type=int, default=4, help="at most this many shapes per image (default 4)")
    s.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    s.set_defaults(func=run_shapes)
