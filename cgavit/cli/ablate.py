"""``cgavit ablate``: the sandwich / group / cascade / reallocation ladder, over
:func:`cgavit.analysis.ablation.run_ablation`."""

from __future__ import annotations

import argparse
import logging
import shlex

from ..analysis.ablation import RUNGS, AblationConfig, StudyStopped, ablation_defaults, run_ablation
from .train import add_train_args, typed_options

log = logging.getLogger(__name__)


def _stages(text: str) -> tuple[int, ...]:
    return tuple(int(v) for v in text.split(","))


class _TrainArgsParser(argparse.ArgumentParser):
    """The ``cgavit train`` options, raising ``ValueError`` instead of exiting on a bad one."""

    def error(self, message: str):
        raise ValueError(f"--train-args: {message}")


def train_args(text: str) -> dict:
    """``--train-args`` (``cgavit train`` options in one string) as TrainConfig fields."""
    parser = _TrainArgsParser(prog="cgavit ablate --train-args", add_help=False)
    add_train_args(parser)
    return typed_options(parser.parse_args(shlex.split(text)))


def ablation_config(args: argparse.Namespace) -> AblationConfig:
    """The study the command line asks for."""
    return AblationConfig(
        data=args.data, output=args.output, epochs=args.epochs, model=args.model, embed_dim=args.embed_dim,
        num_heads=args.num_heads, depth=args.depth, img_size=args.img_size, batch_size=args.batch_size, lr=args.lr,
        seeds=tuple(args.seeds), rungs=tuple(args.rungs), train_subset=args.train_subset, val_subset=args.val_subset,
        heads_images=args.heads_images, threads=args.threads, train_args=train_args(args.train_args),
        no_throughput=args.no_throughput, speed_rounds=args.speed_rounds, speed_seconds=args.speed_seconds,
    )


def run(args: argparse.Namespace) -> int:
    try:
        summary = run_ablation(ablation_config(args))
    except StudyStopped as err:
        log.warning("%s", err)
        return 130
    note = summary.matching
    print(summary.table)
    print(f"parameter matching: rung 1 depth {note['standard_depth']} ({note['standard_params'] / 1e6:.3f} M) vs rung 2 depth "
          f"{note['base_depth']} ({note['sandwich_params'] / 1e6:.3f} M)")
    print(f"wrote {summary.json_path}, {summary.table_path}, " + ", ".join(map(str, summary.plots)))
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    d = ablation_defaults()
    p = sub.add_parser(
        "ablate",
        help="train the sandwich / group / cascade / reallocation ladder and tabulate it",
        description="Train, under one budget and recipe, the ladder: (1) standard layout, (2) + sandwich, (3) + channel "
        "groups, (4) + cascade, (5) + reallocation; then measure params, MACs, CPU throughput, top-1 and head "
        "similarity. Each (variant, seed) keeps its own folder and result file, so an interrupted study continues "
        "where it stopped.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--data", required=True, help="dataset folder: DIR/train/<class>/<img> and DIR/val (or DIR/test)")
    p.add_argument("--output", required=True, help="study folder (per-variant folders, results, table, plots)")
    p.add_argument("--epochs", type=int, required=True, help="training epochs of every variant")
    p.add_argument("--model", default=d["model"], help="base variant whose widths/heads/depths the ladder starts from")
    p.add_argument("--embed-dim", type=_stages, default=d["embed_dim"], help="base widths, three values (default: the variant's)")
    p.add_argument("--num-heads", type=_stages, default=d["num_heads"], help="base heads per stage (default: the variant's)")
    p.add_argument("--depth", type=_stages, default=d["depth"], help="base depths (rungs 2-5; rung 1 is matched)")
    p.add_argument("--img-size", type=int, default=d["img_size"], help="training and evaluation size")
    p.add_argument("--batch-size", type=int, default=d["batch_size"])
    p.add_argument("--lr", type=float, default=d["lr"], help="peak learning rate (AdamW, cosine)")
    p.add_argument("--seeds", type=int, nargs="+", default=list(d["seeds"]), help="one training run per seed and variant")
    p.add_argument("--rungs", nargs="+", choices=RUNGS, default=list(d["rungs"]), help="which rungs to run")
    p.add_argument("--train-subset", type=int, default=d["train_subset"], help="use this many training images, balanced per class (0 = all)")
    p.add_argument("--val-subset", type=int, default=d["val_subset"], help="use this many validation images, balanced per class (0 = all)")
    p.add_argument("--heads-images", type=int, default=d["heads_images"], help="validation images for the head-similarity measurement")
    p.add_argument("--threads", type=int, default=d["threads"], help="torch threads for training")
    p.add_argument("--train-args", default="", help="extra options passed to the trainer, as one quoted string")
    p.add_argument("--no-throughput", action="store_true", help="skip the CPU throughput measurement")
    p.add_argument("--speed-rounds", type=int, default=d["speed_rounds"], help="interleaved timing rounds per variant (throughput: the median)")
    p.add_argument("--speed-seconds", type=float, default=d["speed_seconds"], help="seconds per timing round")
    p.set_defaults(func=run)
