"""``cgavit bench``: throughput of our variants vs timm's port and peers, same run (the paper's protocol)."""

from __future__ import annotations

import argparse

from ..bench import BenchConfig, BenchReport, format_table, run_bench
from ..bench.candidates import PEERS_TOP1
from ..bench.ceiling import format_ceilings
from ..bench.precision import CALIBRATION_IMAGES, RUNTIMES
from ..bench.report import (
    BATCH_NOTE,
    TABLE_NOTE,
    format_auto,
    format_auto_order,
    format_noise_floor,
    format_precision_table,
    format_training,
    precision_note,
)
from ..bench.run import resolve_protocol
from .common import image_size


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    """The typed config for the parsed ``cgavit bench`` flags."""
    return BenchConfig(
        device=args.device,
        threads=args.threads,
        batch=args.batch,
        img_size=image_size(args.img_size),
        precision=args.precision,
        models=tuple(args.models),
        peers=peers_from_args(args.peers),
        warmup=args.warmup,
        repeats=args.repeats,
        compile=not args.no_compile,
        onnx=args.onnx,
        runtimes=tuple(args.runtimes),
        train=args.train,
        precision_check=args.precision_check,
        skip_table=args.skip_table,
        checkpoint=args.checkpoint or None,
        trust_checkpoint=args.trust_checkpoint,
        data=args.data or None,
        calibration_images=args.calibration_images,
        eval_images=args.eval_images,
        train_split=args.train_split,
        val_split=args.val_split,
        train_batch=args.train_batch,
        out=args.out or None,
    )


def peers_from_args(peers: list[str]) -> tuple[str, ...]:
    """``--peers``: the names, or ``none`` alone for no peers."""
    if "none" not in peers:
        return tuple(peers)
    if len(set(peers)) > 1:
        raise ValueError(f"--peers none means no peers, and {' '.join(p for p in peers if p != 'none')} was given "
                         "beside it; give none alone, or the peers to time")
    return ()


def print_section(section: str, report: BenchReport) -> None:
    """Print one finished section of the report (``run_bench``'s ``on_section``)."""
    if section == "table":
        if report.results:
            print(format_table(report.results))
            print(TABLE_NOTE)
            print(BATCH_NOTE.format(batch=report.protocol.batch))
        if report.ceilings:
            print(format_ceilings(report.ceilings))
        if report.auto_order:
            print(format_auto_order(report.auto_order))
    elif section == "precision":
        print("\n" + format_precision_table(report.precision))
        print(precision_note(report.precision_images))
        if report.noise_floor is not None:
            print(format_noise_floor(report.noise_floor))
        if report.auto is not None:
            print(format_auto(report.auto))
    elif section == "training" and report.training:
        print(format_training(report.training))


def run(args: argparse.Namespace) -> int:
    cfg = config_from_args(args)
    if not cfg.skip_table or cfg.precision_check:  # training alone prints its own protocol with its figures
        print(resolve_protocol(cfg).describe(sized=not cfg.skip_table))
    report = run_bench(cfg, on_section=print_section)
    if report.files:
        print(f"wrote {', '.join(str(p) for p in report.files)}")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "bench",
        help="throughput of our variants vs timm's port and peers, same run (the paper's protocol)",
        description="Time cgavit's inference paths, timm's efficientvit_msra port (same weights) and timm peers "
        "round-robin in one process. Defaults are the paper's protocol: CPU 1 thread, batch 16, fp32; "
        "GPU batch 2048, AMP. Random weights (throughput does not depend on them); published top-1 "
        "figures are used for the accuracy-throughput plot.",
    )
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="default cpu")
    p.add_argument("--threads", type=int, help="intra-op threads (default: 1 on CPU, as the paper)")
    p.add_argument("--batch", type=int, help="batch size (default: 16 on CPU, 2048 on GPU)")
    p.add_argument("--img-size", type=int, nargs="+", default=[224], metavar="N",
                   help="N or H W of the table and --train (default 224; --precision-check: the checkpoint's)")
    p.add_argument("--precision", choices=["fp32", "bf16", "amp"],
                   help="our optimize() precision on CPU, where the baselines run fp32 (default fp32); on GPU the "
                   "autocast of every row: amp fp16, bf16, fp32 none (default amp)")
    p.add_argument("--models", nargs="+", default=["efficientvit_m0", "efficientvit_m4"], metavar="NAME",
                   help="our variants (default efficientvit_m0 efficientvit_m4)")
    p.add_argument("--peers", nargs="+", default=list(PEERS_TOP1), metavar="NAME",
                   help=f"timm peers with random weights, or 'none' (default: {' '.join(PEERS_TOP1)})")
    p.add_argument("--warmup", type=int, default=10, help="untimed calls per candidate (default 10)")
    p.add_argument("--repeats", type=int, default=30, help="timed rounds, one batch per candidate each (default 30)")
    p.add_argument("--no-compile", action="store_true", help="optimize() without torch.compile (quick runs)")
    p.add_argument("--no-onnx", dest="onnx", action="store_false",
                   help="skip optimize()'s ONNX Runtime backend (its default on CPU for fp32)")
    p.add_argument("--train", action="store_true", help="also time training steps (forward+backward) vs timm's port, on the CPU")
    p.add_argument("--runtimes", nargs="+", default=[], choices=RUNTIMES, metavar="NAME",
                   help=f"more runtimes to time beside torch, on the CPU: {', '.join(RUNTIMES)} (main table: fp32 rows; "
                   "--precision-check: fp32, int8 and OpenVINO bf16); onnxruntime is on unless --no-onnx; "
                   "executorch and tflite take minutes to export")
    p.add_argument("--precision-check", action="store_true",
                   help="also compare every fp32, bf16 and int8 path of a trained model (needs --checkpoint and "
                   "--data): throughput, top-1 agreement with fp32, accuracy and logit error")
    p.add_argument("--skip-table", action="store_true", help="skip the main throughput table (e.g. with --precision-check)")
    p.add_argument("--checkpoint", default="", help="--precision-check: trained weights (best.pt, model.safetensors, "
                   "...); the image size and preprocessing are the checkpoint's")
    p.add_argument("--trust-checkpoint", action="store_true",
                   help="allow pickled objects in --checkpoint (runs code from it: only for files you trust)")
    p.add_argument("--data", default="", help="--precision-check with --checkpoint: image folder; DIR/val evaluated, "
                   "DIR/train for the int8 calibration")
    p.add_argument("--calibration-images", type=int, default=CALIBRATION_IMAGES,
                   help=f"training images int8 is calibrated on (default {CALIBRATION_IMAGES})")
    p.add_argument("--eval-images", type=int, default=0, help="evaluated images (default 0: the whole val split; more than it holds is refused)")
    p.add_argument("--train-split", default="train", help="calibration split folder name (default train)")
    p.add_argument("--val-split", default="val", help="evaluated split folder name (default val)")
    p.add_argument("--train-batch", type=int, default=64, help="--train: batch of the training comparison (default 64)")
    p.add_argument("--output", "--out", dest="out", default="bench-results", help="folder for bench.csv, bench.json and the plot; with --skip-table, bench.json alone "
                   "(default bench-results; '' = write none)")
    p.set_defaults(func=run)
