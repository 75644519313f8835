"""``cgavit export``: a model to ONNX, OpenVINO, ExecuTorch or TFLite/LiteRT, checked in that runtime
against PyTorch."""

from __future__ import annotations

import argparse
import logging
import shlex
from pathlib import Path

from torch import nn

from ..bench.precision import CALIBRATION_IMAGES, LabelledImages, calibration_and_evaluation, evaluation_images
from ..deploy import EXPORT_TOLERANCE, FORMATS, check_parity, export_model, load_exported
from ..deploy.formats import FIXED_BATCH_FORMATS, export_metadata, require_format
from ..deploy.fusion import named_output
from ..deploy.openvino import ir_path
from ..factory import ModelInfo, create_model, load_model
from ..io import printable_line, replace_together, staging
from .common import add_dial_args, dials_from_args, image_size

__all__ = ["EXPORT_TOLERANCE", "register", "run"]

log = logging.getLogger(__name__)


def load_for_export(args: argparse.Namespace) -> tuple[nn.Module, ModelInfo, tuple[int, int]]:
    """The model, how to feed it, and the export size: a checkpoint as :func:`~cgavit.load_model` rebuilds it (one
    trained here records its architecture, and dial flags that contradict it are refused; an official or timm file
    needs ``--model`` and takes the dials), or a randomly initialised ``--model``."""
    if args.checkpoint:
        size = image_size(args.img_size) if args.img_size else None
        square = size[0] if size and size[0] == size[1] else None  # built for it; else at the recorded size
        model, info = load_model(args.checkpoint, args.model, dials_from_args(args) or None, img_size=square,
                                 trust=args.trust_checkpoint)
        # info.img_size is the size built for (--img-size's, else the recorded one): --data's images are read at it
        return model, info, size or (info.img_size, info.img_size)
    if not args.model:
        raise ValueError("give --model NAME, or --checkpoint FILE written by cgavit train (it records the model)")
    size = image_size(args.img_size or [224])
    log.warning("no --checkpoint: exporting randomly initialised weights, which classify nothing (for a trained "
                "model, give --checkpoint its file: one written by cgavit train, or the authors' .pth with --model)")
    return create_model(args.model, img_size=size, **dials_from_args(args)), ModelInfo([], img_size=size[0]), size


def calibration_and_check(args: argparse.Namespace, info: ModelInfo, channels: int,
                          size: tuple[int, int]) -> tuple[LabelledImages | None, LabelledImages | None]:
    """With ``--data``: training images to calibrate int8 on (none for fp32) and validation images to check against,
    read for a model of ``channels`` input channels taking ``size`` images (square: the commands read images so)."""
    if args.calibration_images < 1 or args.eval_images < 0 or args.batch < 1:
        raise ValueError("--calibration-images and --batch must be at least 1, --eval-images at least 0")
    ignored = [flag for flag, given in (
        ("--batch", args.batch != 1 and not FORMATS[args.format].fixed_batch),
        ("--calibration-images", args.calibration_images != CALIBRATION_IMAGES and args.precision != "int8"),
        ("--eval-images", args.eval_images and not args.data),
        ("--train-split", args.train_split != "train" and (not args.data or args.precision != "int8")),
        ("--val-split", args.val_split != "val" and not args.data)) if given]
    if ignored:
        raise ValueError(f"{', '.join(ignored)} would change nothing here (--batch is fixed in "
                         f"{' and '.join(FIXED_BATCH_FORMATS)} files only; --calibration-images and --train-split are "
                         "read for --precision int8, --val-split and --eval-images with --data): leave them out")
    if args.data and size[0] != size[1]:
        raise ValueError(f"--data images are read square (resized and centre-cropped to N x N), and this file takes "
                         f"{size[0]}x{size[1]}: export at one size, --img-size N, to calibrate or check on --data")
    if not args.data:
        if args.precision == "int8":
            raise ValueError("--precision int8 needs --data DIR: calibration on DIR/train, the agreement check on DIR/val")
        return None, None
    num_classes = len(info.class_names) if info.names_recorded else None  # a file without names: any labelled folder
    if args.precision != "int8":  # nothing to calibrate: DIR/val alone
        return None, evaluation_images(args.data, args.val_split, info, num_classes, args.eval_images,
                                       channels=channels)
    return calibration_and_evaluation(args.data, args.train_split, args.val_split, info, num_classes,
                                      args.calibration_images, args.eval_images,
                                      all_calibration_images=args.precision == "int8",  # never fewer than asked
                                      channels=channels)


def output_format(args: argparse.Namespace) -> str:
    """The format to write: ``--format``, else the one ``--output``'s suffix names, else ONNX.

    Raises:
        ValueError: ``--format`` and a suffix of another format disagree (a file named for one runtime
            holding another's format fails later, far from here).
    """
    named = {fmt.suffix: name for name, fmt in FORMATS.items()}.get(Path(args.output).suffix.lower())
    if args.format and named and named != args.format:
        raise ValueError(f"--output {Path(args.output).name} has the suffix of --format {named}, but --format "
                         f"{args.format} was given: name the file with {FORMATS[args.format].suffix}, or drop --format")
    return args.format or named or "onnx"


def files_of(out: Path) -> list[Path]:
    """An exported file and, for an OpenVINO ``.xml``, the ``.bin`` of weights beside it."""
    return [out] + ([out.with_suffix(".bin")] if out.suffix == ".xml" else [])


def written(out: Path) -> str:
    """The file written and its size (an OpenVINO ``.bin`` holds nearly all of it)."""
    files = files_of(out)
    return f"{' + '.join(str(f) for f in files)} ({sum(f.stat().st_size for f in files) / 1e6:.1f} MB)"


def failed_name(out: Path) -> Path:
    """Where a build that fails its check goes, so that a file already at ``out`` is kept: ``NAME.failed.onnx``."""
    return out.with_name(f"{out.stem}.failed{out.suffix}")


def run(args: argparse.Namespace) -> int:
    args.format = output_format(args)
    if args.dynamic_size:
        raise ValueError(
            "--dynamic-size is not supported: the window attention pads and partitions each stage "
            "differently for different image sizes, so one ONNX graph cannot serve them all; export "
            "once per size with --img-size H W"
        )
    fmt = require_format(args.format, args.precision)
    model, info, size = load_for_export(args)
    # refused before the work, not when the build is moved into place: a folder where the file (or .bin) goes
    out = ir_path(args.output) if args.format == "openvino" else named_output(args.output, fmt.suffix,
                                                                               f"a file for {fmt.runtime}")
    channels = getattr(model, "in_chans", 3)
    metadata = export_metadata(info, args.format, size, channels)  # refused before the work too
    with staging(out) as tmp:  # the build is made and checked beside its destination, moved there if it passes
        calib, check = calibration_and_check(args, info, channels, size)
        batches = list(calib.images.split(16)) if calib is not None else None
        built = export_model(model, tmp / out.name, args.format, size, args.precision, batches, args.batch,
                             info=metadata)
        parity = check_parity(load_exported(built, args.format, args.precision), model, size, args.precision,
                              fmt.runtime, check.images if check else None, check.labels if check else None)
        dest = out if parity.ok else failed_name(out)
        replace_together([(f, dest.with_suffix(f.suffix)) for f in reversed(files_of(built))])  # OpenVINO's .bin first
    batch = f"batch {args.batch} fixed" if fmt.fixed_batch else "batch dynamic"
    print(f"wrote {written(dest)}, {batch}, size {size[0]}x{size[1]} fixed"
          + (f", {args.precision} calibrated on {len(calib.images)} images of {calib.source}" if calib else ""))
    for line in parity.lines():
        print(line)
    if not parity.ok:
        print(f"{dest} does not pass its check (above): it is kept for a look under that name, and {out} was not "
              f"written{' (the file there is as it was)' if out.exists() else ''}; do not ship it; exit status 1")
        return 1
    if FORMATS[args.format].metadata and metadata.class_names and size[0] == size[1]:  # a file eval and predict take
        name = printable_line(shlex.quote(str(dest)))
        print(f"try:   cgavit predict IMAGE --checkpoint {name}   or   cgavit eval --checkpoint {name} --data DIR")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "export",
        help="export a model to ONNX, OpenVINO, ExecuTorch or TFLite and check it in that runtime against PyTorch",
        description="Fuse BatchNorm, export (ONNX and OpenVINO: batch dynamic; ExecuTorch and TFLite: batch fixed by "
        "--batch), then run the file in its own runtime at batch 1 and 16 and print its relative error against "
        f"PyTorch (fp32: must be <= {EXPORT_TOLERANCE:.0e}). int8 (onnx, openvino, executorch) is calibrated on "
        "--data DIR/train and checked by top-1 agreement with fp32 on DIR/val (target: >= 99.5%, accuracy within "
        "0.5 point). Each format needs its extra: " + ", ".join(f"{k}: cgavit[{f.extra}]" for k, f in FORMATS.items()),
    )
    p.add_argument("--model", help="variant name, e.g. efficientvit_m0 (optional for checkpoints written by cgavit train)")
    p.add_argument("--checkpoint", help="weights file (official, timm or cgavit format); default random weights")
    p.add_argument("--trust-checkpoint", action="store_true",
                   help="allow pickled objects in the checkpoint (runs code from it: only for files you trust)")
    p.add_argument("--format", default=None, choices=list(FORMATS),
                   help="export format (default: the one --output's suffix names, else onnx)")
    p.add_argument("--output", required=True, help="output file, e.g. m0.onnx, m0.xml (+ m0.bin), m0.pte, m0.tflite; a name "
                   "without its format's suffix gets it (m0 -> m0.onnx); written atomically")
    p.add_argument("--img-size", type=int, nargs="+", metavar="N",
                   help="input size N or H W (default: the checkpoint's, else 224)")
    p.add_argument("--precision", default="fp32", choices=["fp32", "int8"], help="fp32 (default) or int8 (needs --data)")
    p.add_argument("--data", help="image folder: int8 calibration on DIR/train, agreement check on DIR/val")
    p.add_argument("--calibration-images", type=int, default=CALIBRATION_IMAGES,
                   help=f"training images int8 is calibrated on (default {CALIBRATION_IMAGES})")
    p.add_argument("--eval-images", type=int, default=0, help="validation images of the agreement check (default 0: all; more than the split holds is refused)")
    p.add_argument("--train-split", default="train", help="calibration split folder name (default train)")
    p.add_argument("--val-split", default="val", help="checked split folder name (default val)")
    p.add_argument("--batch", type=int, default=1, help="executorch, tflite: the batch size fixed in the file (default 1)")
    p.add_argument("--dynamic-size", action="store_true", help="not supported (explains why): export once per size")
    add_dial_args(p)
    p.set_defaults(func=run)
