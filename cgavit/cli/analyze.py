"""``cgavit analyze heads|taylor``: head similarity and Taylor channel importance of a model."""

from __future__ import annotations

import argparse

from ..analysis.plots import stage_label
from ..analysis.reports import TARGETS, AnalysisConfig, run_heads, run_taylor
from .common import add_dial_args, dials_from_args
from .options import add_options, option_values

#: The AnalysisConfig fields both analyses take as flags, in the order ``--help`` lists them (then the dials).
ANALYSIS_FIELDS: tuple[str, ...] = (
    "model", "checkpoint", "trust_checkpoint", "pretrained", "data", "images", "output", "img_size", "crop_pct", "num_images",
    "num_classes", "batch_size", "seed",
)


def analysis_config(args: argparse.Namespace) -> AnalysisConfig:
    """The options both analyses share, as the library's config."""
    values = option_values(args, ANALYSIS_FIELDS)
    values["images"] = tuple(values["images"])
    return AnalysisConfig(**values, dials=dials_from_args(args))


def _similarity(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f}"  # one head (no pairs), or no block with pairs and tokens


def run_heads_command(args: argparse.Namespace) -> int:
    run = run_heads(analysis_config(args))
    print(f"{'block':<8}{'module':<30}{'heads':>6}{'tokens':>7}{'windows':>8}  mean off-diagonal similarity")
    for b in run.blocks:  # the figures' label (from 1) beside the module path (from 0, as the JSON's indices)
        print(f"{b.label:<8}{b.name:<30}{b.num_heads:>6}{b.tokens:>7}{b.windows:>8}  {_similarity(b.mean_off_diagonal)}")
    print(f"mean over blocks (more than one token): {_similarity(run.report['mean_similarity'])}")
    print(f"wrote {run.json_path}, " + ", ".join(str(p) for p in run.plots))
    return 0


def _kept(value: float | None) -> str:
    return "no gradient" if value is None else f"{value:.2f}"


def run_taylor_command(args: argparse.Namespace) -> int:
    run = run_taylor(analysis_config(args), args.targets, args.prune_ratio, args.list_pruned)
    against = "folder labels" if run.targets == "labels" else "model's own predictions"
    print(f"loss: cross-entropy against the {against} ({run.report['loss_targets_reason']})")
    print(f"{'block':<8}{'module':<22}{'Q':>10}{'K':>10}{'V':>10}{'FFN':>10}{'proj':>10}   mean |w*dL/dw| per channel")
    for b in run.blocks:
        m = b.to_dict()["mean"]
        print(f"{b.label:<8}{b.name:<22}" + "".join(f"{m[k]:>10.3g}" if m[k] is not None else f"{'-':>10}" for k in ("q", "k", "v", "ffn", "proj")))
    for b in (b for b in run.blocks if b.no_gradient):
        print(f"no gradient in {b.label} ({b.name}) {' '.join(k.upper() for k in b.no_gradient)}: importance exactly 0, "
              "left out of the pruning budget")
    print(f"fraction kept after pruning the least important {100 * args.prune_ratio:g} % of Q/K/V/FFN channels:")
    for s, fr in run.kept["kept"].items():
        print(f"  {stage_label(s)} (stages.{s}): " + "  ".join(f"{k.upper()} {_kept(v)}" for k, v in fr.items()))
    print(f"wrote {run.json_path}, " + ", ".join(str(p) for p in run.plots))
    return 0


def _common(p: argparse.ArgumentParser) -> None:
    add_options(p, AnalysisConfig, ANALYSIS_FIELDS)
    add_dial_args(p)


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
    h.set_defaults(func=run_heads_command)
    t = asub.add_parser(
        "taylor",
        help="first-order Taylor importance of Q/K/V/FFN/projection channels",
        description="|w * dL/dw| summed per output channel over the images (eval mode, mean cross-entropy). Writes "
        "taylor.json, taylor_spread.png (Q/K vs V vs FFN importance per stage) and taylor_pruning.png (channels kept "
        "per stage and kind when the least important --prune-ratio of all are removed). Needs trained weights "
        "(--checkpoint or --pretrained): a random model's gradients are all zero.",
    )
    _common(t)
    t.add_argument("--targets", choices=TARGETS, default="auto",
                   help="loss targets: folder labels, or the model's own predictions; auto = labels when the folder's classes are the "
                   "model's (by name where the checkpoint records them, else by count), else predictions (default)")
    t.add_argument("--prune-ratio", type=float, default=0.3, help="pruning budget: fraction of Q/K/V/FFN channels removed, least important first (default 0.3)")
    t.add_argument("--list-pruned", type=int, default=50, help="how many first-pruned channels to list in the JSON (default 50)")
    t.set_defaults(func=run_taylor_command)
    p.set_defaults(func=lambda a: (p.print_help(), 2)[1])
