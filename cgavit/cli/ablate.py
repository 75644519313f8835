"""``cgavit ablate``: the sandwich / group / cascade / reallocation ladder, over
:func:`cgavit.analysis.ablation.run_ablation`."""

from __future__ import annotations

import argparse
import logging
import shlex

from ..analysis.ablation import AblationConfig, StudyStopped, run_ablation
from .options import add_options, option_values
from .parser import CommandParser
from .train import add_train_args, typed_options

log = logging.getLogger(__name__)

#: The AblationConfig fields with a generated flag, in the order ``--help`` lists them: the study's,
#: then ``--train-args`` (spelled by hand: ``cgavit train`` options in one string), then the timing's.
STUDY_FIELDS: tuple[str, ...] = (
    "data", "output", "epochs", "model", "embed_dim", "num_heads", "depth", "img_size", "batch_size", "lr", "seeds",
    "rungs", "train_subset", "val_subset", "heads_images", "threads",
)
MEASURE_FIELDS: tuple[str, ...] = ("no_throughput", "speed_rounds", "speed_seconds")


class _TrainArgsParser(CommandParser):
    """The ``cgavit train`` options, raising ``ValueError`` instead of exiting on a bad one."""

    def error(self, message: str):
        raise ValueError(f"--train-args: {message}")


def train_args(text: str) -> dict:
    """``--train-args`` (``cgavit train`` options in one string) as TrainConfig fields."""
    parser = _TrainArgsParser(prog="cgavit ablate --train-args", add_help=False)
    add_train_args(parser)
    try:
        words = shlex.split(text)
    except ValueError as err:  # "No closing quotation"
        raise ValueError(f"--train-args {text!r}: {str(err).lower()}; quote the options as a shell would") from None
    return typed_options(parser.parse_args(words))


def ablation_config(args: argparse.Namespace) -> AblationConfig:
    """The study the command line asks for."""
    values = option_values(args, STUDY_FIELDS + MEASURE_FIELDS)
    return AblationConfig(**values, train_args=train_args(args.train_args))


def run(args: argparse.Namespace) -> int:
    try:
        summary = run_ablation(ablation_config(args))
    except StudyStopped as err:
        log.warning("%s", err)
        return 128 + int(err.signum)  # 130 for Ctrl-C, 143 for SIGTERM, as every command
    note = summary.matching
    print(summary.table)
    print(f"parameter matching: rung 1 depth {note['standard_depth']} ({note['standard_params'] / 1e6:.3f} M) vs rung 2 depth "
          f"{note['base_depth']} ({note['sandwich_params'] / 1e6:.3f} M)")
    print(f"wrote {summary.json_path}, {summary.table_path}, " + ", ".join(map(str, summary.plots)))
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "ablate",
        help="train the sandwich / group / cascade / reallocation ladder and tabulate it",
        description="Train, under one budget and recipe, the ladder: (1) standard layout, (2) + sandwich, (3) + channel "
        "groups, (4) + cascade, (5) + reallocation; then measure params, MACs, CPU throughput, top-1 and head "
        "similarity. Each (variant, seed) keeps its own folder and result file, so an interrupted study continues "
        "where it stopped.",
    )
    add_options(p, AblationConfig, STUDY_FIELDS)
    p.add_argument("--train-args", default="", help="extra cgavit train options for every run, as one quoted string; design "
                   "dials among them (--cascade off, --embed-dim ...) build every rung's model, the timed ones too")
    add_options(p, AblationConfig, MEASURE_FIELDS)
    p.set_defaults(func=run)
