"""The ablation ladder (seed chapters 2-7), trained under one budget and measured side by side.

Rungs, each adding one idea to the one before:

1. ``standard``: one attention then one FFN per block (``ffn_per_side=(0, 1)``), every head reads all
   channels (``group_split`` off, ``cascade`` off), tied widths ``key_dim = value width = C/h``
   (``attn_ratio=1``), FFN ratio 4. Its depth is raised until its parameter count is closest to
   rung 2's (the paper compares the layouts at similar size; :func:`match_depth`).
2. ``sandwich``: the sandwich layout, one dw+FFN pair each side of the attention (``ffn_per_side=1``).
3. ``groups``: each head reads its own channel group (``group_split`` on).
4. ``cascade``: each head's output is added to the next head's input (``cascade`` on).
5. ``realloc``: parameter reallocation: narrow Q/K (``key_dim=16``), wide V (the default
   ``value width = C/h``), FFN ratio 2. This is the paper's block.

Every (rung, seed) trains in its own folder and writes ``result.json`` when measured; a study that is
stopped continues where it was, and a run stopped mid-training resumes from its last checkpoint
(the trainer's ``--resume``). The summary (``ablation.json``, ``ablation_table.md``, PNG plots) is
rebuilt from the result files, with CPU throughput of all rungs measured together, interleaved.
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import math
import shlex
import statistics
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from ..cli.common import dials_to_argv
from ..factory import create_model, resolve_name
from ..variants import VARIANTS
from ..io import atomic_write

log = logging.getLogger(__name__)

RUNGS = ("standard", "sandwich", "groups", "cascade", "realloc")
RUNG_TITLES = {
    "standard": "1 standard (attn+FFN, MHSA, tied Q/K/V, FFN x4)",
    "sandwich": "2 + sandwich layout",
    "groups": "3 + channel groups",
    "cascade": "4 + cascade",
    "realloc": "5 + reallocation (Q/K 16, FFN x2)",
}
ARCH_FIELDS = ("embed_dim", "depth", "num_heads", "window_size", "kernels")


# ------------------------------------------------------------------------------------ the ladder
def _base_arch(model: str, overrides: dict) -> dict:
    """The base architecture fields (widths, depths, heads, windows, kernels) with overrides."""
    cfg = VARIANTS[resolve_name(model)].cfg.with_dials(**overrides)
    return {f: tuple(getattr(cfg, f)) for f in ARCH_FIELDS}


def count_params(model_name: str, dials: dict, num_classes: int, img_size: int) -> int:
    """Parameters of ``model_name`` built with ``dials``."""
    m = create_model(model_name, num_classes=num_classes, img_size=img_size, **dials)
    return sum(p.numel() for p in m.parameters())


def rung_dials(rung: str, arch: dict) -> dict:
    """The design dials of one rung on top of the base architecture ``arch`` (depth not matched)."""
    if rung not in RUNGS:
        raise ValueError(f"unknown rung {rung!r}; choose from {', '.join(RUNGS)}")
    tied = tuple(c // h for c, h in zip(arch["embed_dim"], arch["num_heads"]))
    if any(c % h for c, h in zip(arch["embed_dim"], arch["num_heads"])):
        raise ValueError(f"widths {arch['embed_dim']} must be divisible by the heads {arch['num_heads']} for tied Q/K/V widths")
    d = dict(arch)
    d.update(ffn_per_side=(0, 1), group_split=False, cascade=False, key_dim=tied, attn_ratio=1.0, ffn_ratio=4.0)
    if RUNGS.index(rung) >= 1:
        d["ffn_per_side"] = (1, 1)
    if RUNGS.index(rung) >= 2:
        d["group_split"] = True
    if RUNGS.index(rung) >= 3:
        d["cascade"] = True
    if RUNGS.index(rung) >= 4:
        d.update(key_dim=(16, 16, 16), ffn_ratio=2.0)
        del d["attn_ratio"]  # the default: value width C/h
    return d


def match_depth(model_name: str, arch: dict, num_classes: int, img_size: int) -> tuple[tuple[int, int, int], int, int]:
    """Depth for rung 1 whose parameter count is closest to rung 2's.

    Searches every non-decreasing depth ``(d1 <= d2 <= d3)`` with ``base_i <= d_i <= 2 * base_i + 1``;
    ties go to the smaller total depth.

    Returns:
        ``(depth, params of rung 1 at that depth, params of rung 2)``.
    """
    target = count_params(model_name, rung_dials("sandwich", arch), num_classes, img_size)
    base = arch["depth"]
    best = None
    for depth in itertools.product(*[range(b, 2 * b + 2) for b in base]):
        if any(a > b for a, b in zip(depth, depth[1:])):
            continue  # keep the base's non-decreasing depth profile
        d = rung_dials("standard", {**arch, "depth": depth})
        n = count_params(model_name, d, num_classes, img_size)
        key = (abs(n - target), sum(depth))
        if best is None or key < best[0]:
            best = (key, depth, n)
    return best[1], best[2], target


@dataclass
class Variant:
    """One rung of the ladder: its name and the full dial set it is built with."""

    rung: str
    dials: dict

    @property
    def title(self) -> str:
        return RUNG_TITLES[self.rung]


def build_ladder(model_name: str, arch_overrides: dict, num_classes: int, img_size: int, rungs=RUNGS) -> tuple[list[Variant], dict]:
    """The variants to train, and a note on the parameter matching done."""
    arch = _base_arch(model_name, arch_overrides)
    depth, p1, p2 = match_depth(model_name, arch, num_classes, img_size)
    note = dict(
        base_depth=list(arch["depth"]),
        standard_depth=list(depth),
        standard_params=p1,
        sandwich_params=p2,
        rule="rung 1 depth: the non-decreasing (d1, d2, d3) with base_i <= d_i <= 2*base_i+1 whose parameter count is closest to rung 2's",
    )
    out = []
    for r in rungs:
        d = rung_dials(r, arch)
        if r == "standard":
            d["depth"] = depth
        out.append(Variant(r, d))
    return out, note


# ------------------------------------------------------------------------------------ measuring
@torch.no_grad()
def measure_throughput(models: dict[str, torch.nn.Module], img_size: int, batch: int = 16, rounds: int = 5, seconds: float = 1.0) -> dict[str, dict]:
    """CPU images/s of each model, fused (BatchNorm folded) and traced, one thread, fp32.

    The models are timed round-robin, ``rounds`` times each for about ``seconds``, so load from
    other processes hits all of them alike; the median round is reported with the spread.
    """
    from ..deploy import fuse

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        x = torch.randn(batch, 3, img_size, img_size)
        traced = {}
        for name, m in models.items():
            f = fuse(m.eval())
            with warnings.catch_warnings():  # tracer notes on shape checks: shapes are fixed here
                warnings.simplefilter("ignore")
                t = torch.jit.trace(f, x, check_trace=False)
            for _ in range(3):
                t(x)
            traced[name] = t
        rates: dict[str, list[float]] = {n: [] for n in models}
        for _ in range(rounds):
            for name, t in traced.items():
                n, start = 0, time.perf_counter()
                while True:
                    t(x)
                    n += 1
                    el = time.perf_counter() - start
                    if el >= seconds:
                        break
                rates[name].append(n * batch / el)
    finally:
        torch.set_num_threads(threads)
    return {
        n: dict(img_s=statistics.median(r), min=min(r), max=max(r), rounds=rounds, batch=batch) for n, r in rates.items()
    }


# ------------------------------------------------------------------------------------ the study
def _write_json(path: Path, obj) -> None:
    atomic_write(path, lambda t: Path(t).write_text(json.dumps(obj, indent=1)))


def add_ablate_args(p: argparse.ArgumentParser) -> None:
    """Options of ``cgavit ablate``."""
    p.add_argument("--data", required=True, help="dataset folder: DIR/train/<class>/<img> and DIR/val (or DIR/test)")
    p.add_argument("--output", required=True, help="study folder (per-variant folders, results, table, plots)")
    p.add_argument("--epochs", type=int, required=True, help="training epochs of every variant")
    p.add_argument("--model", default="efficientvit_m0", help="base variant whose widths/heads/depths the ladder starts from")
    p.add_argument("--embed-dim", type=lambda s: tuple(int(v) for v in s.split(",")), help="base widths, three values (default: the variant's)")
    p.add_argument("--num-heads", type=lambda s: tuple(int(v) for v in s.split(",")), help="base heads per stage (default: the variant's)")
    p.add_argument("--depth", type=lambda s: tuple(int(v) for v in s.split(",")), help="base depths (rungs 2-5; rung 1 is matched)")
    p.add_argument("--img-size", type=int, default=224, help="training and evaluation size")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-3, help="peak learning rate (AdamW, cosine)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0], help="one training run per seed and variant")
    p.add_argument("--rungs", nargs="+", choices=RUNGS, default=list(RUNGS), help="which rungs to run")
    p.add_argument("--train-subset", type=int, default=0, help="use this many training images, balanced per class (0 = all)")
    p.add_argument("--val-subset", type=int, default=0, help="use this many validation images, balanced per class (0 = all)")
    p.add_argument("--heads-images", type=int, default=64, help="validation images for the head-similarity measurement")
    p.add_argument("--threads", type=int, default=1, help="torch threads for training")
    p.add_argument("--train-args", default="", help="extra options passed to the trainer, as one quoted string")
    p.add_argument("--no-throughput", action="store_true", help="skip the CPU throughput measurement")
    p.add_argument("--speed-rounds", type=int, default=5, help="interleaved timing rounds per variant (throughput: the median)")
    p.add_argument("--speed-seconds", type=float, default=1.0, help="seconds per timing round")


class StudyStopped(Exception):
    """A training run was stopped by a signal (its checkpoint is saved; the study can continue)."""


def prepare_data(data: str | Path, out: Path, train_subset: int, val_subset: int, seed: int = 0) -> Path:
    """The dataset folder the trainer reads: ``data`` itself, or balanced, seeded subsets as symlinks.

    ``data`` needs ``train/`` and ``val/`` (or ``test/``) class folders. When a subset is asked for, or
    the held-out split is named ``test``, ``out/data/{train,val}/<class>/`` is filled with links to the
    chosen files (once; a later call with other sizes is refused).
    """
    from .data import balanced_subset, list_images

    root = Path(data)
    if not root.is_dir():
        raise FileNotFoundError(f"data folder {root} does not exist")
    held = next((s for s in ("val", "test") if (root / s).is_dir()), None)
    if not (root / "train").is_dir() or held is None:
        raise ValueError(f"{root} needs train/<class>/ and val/<class>/ (or test/<class>/) image folders")
    if not train_subset and not val_subset and held == "val":
        return root
    dest = out / "data"
    spec = dict(source=str(root.resolve()), train_subset=train_subset, val_subset=val_subset, seed=seed)
    marker = dest / "subset.json"
    if marker.exists():
        if json.loads(marker.read_text()) != spec:
            raise ValueError(f"{dest} was made from other data or subset sizes ({marker.read_text().strip()}); use another --output")
        return dest
    for split, src, n in (("train", "train", train_subset), ("val", held, val_subset)):
        paths, labels, classes = list_images([root / src])
        if labels is None:
            raise ValueError(f"{root / src} has no class folders")
        for i in balanced_subset(labels, len(paths), n, seed):
            link = dest / split / classes[labels[i]] / paths[i].name
            link.parent.mkdir(parents=True, exist_ok=True)
            if not link.exists():
                link.symlink_to(paths[i].resolve())
    _write_json(marker, spec)
    return dest


def _trained_epochs(last: Path) -> int:
    from ..train.checkpoint import load

    return int(load(last)["next_epoch"]) if last.exists() else 0


def run_variant(variant: Variant, seed: int, args: argparse.Namespace, data_dir: Path, out: Path, heads_batch: torch.Tensor) -> dict:
    """Train (or continue) one (variant, seed) and measure it; returns and writes its ``result.json``."""
    from ..info import count_macs
    from ..train import evaluate_checkpoint, load_model, train
    from ..train.records import read_metrics
    from .heads import head_similarity, mean_similarity

    run_dir = out / "runs" / variant.rung / f"seed{seed}"
    result_file = run_dir / "result.json"
    if result_file.exists():
        log.info("%s seed %d: done before, reading %s", variant.rung, seed, result_file)
        return json.loads(result_file.read_text())
    argv = [
        "--data", str(data_dir), "--model", args.model, "--epochs", str(args.epochs), "--batch-size", str(args.batch_size),
        "--img-size", str(args.img_size), "--lr", str(args.lr), "--seed", str(seed), "--output", str(run_dir),
        *dials_to_argv(variant.dials), *shlex.split(args.train_args),
    ]
    last = run_dir / "last.pt"
    if _trained_epochs(last) >= args.epochs:
        log.info("%s seed %d: training finished before, measuring", variant.rung, seed)
        summary = {}
    else:
        if last.exists():
            log.info("%s seed %d: resuming %s", variant.rung, seed, last)
            argv += ["--resume", str(last)]
        else:
            log.info("%s seed %d: training  cgavit train %s", variant.rung, seed, " ".join(argv))
        summary = train(argv)
        if summary.get("interrupted"):
            raise StudyStopped(f"training of {variant.rung} seed {seed} was stopped; run the same command again to continue")
    ev = evaluate_checkpoint(data_dir, last, batch_size=args.batch_size, workers=0, device="cpu")
    model, _ = load_model(last, device="cpu")
    blocks = head_similarity(model, heads_batch)
    res = dict(
        rung=variant.rung,
        title=variant.title,
        seed=seed,
        dials={k: list(v) if isinstance(v, tuple) else v for k, v in variant.dials.items()},
        params=sum(p.numel() for p in model.parameters()),
        macs=count_macs(model, (args.img_size, args.img_size)),
        top1=ev["top1"],
        top5=ev["top5"],
        val_loss=ev["loss"],
        val_images=ev["n"],
        best_top1=summary.get("best_top1"),
        head_similarity=mean_similarity(blocks),
        head_similarity_blocks=[b.to_dict() for b in blocks],
        train_epoch_s=round(sum(r.get("epoch_s", 0.0) for r in read_metrics(run_dir / "metrics.jsonl")), 1),
        train_argv=[a for a in argv if a != "--resume" and a != str(last)],
    )
    _write_json(result_file, res)
    return res


def _trainer_option(train_args: str, name: str):
    """The value the trainer will use for option ``name`` given ``--train-args``."""
    from ..train.engine import build_parser
    from ..train.recipe import finalize_args

    parsed, _ = finalize_args(build_parser().parse_args(["--data", "."] + shlex.split(train_args)))
    return getattr(parsed, name)


def _spread(vals: list[float]) -> float:
    return statistics.stdev(vals) if len(vals) > 1 else float("nan")


def summarize(results: list[dict], throughput: dict | None, rungs: list[str]) -> list[dict]:
    """One row per rung: sizes, throughput, and top-1 / head similarity over seeds."""
    rows = []
    for r in rungs:
        rs = [x for x in results if x["rung"] == r]
        if not rs:
            continue
        top1 = [x["top1"] for x in rs]
        sim = [x["head_similarity"] for x in rs]
        row = dict(
            rung=r,
            title=RUNG_TITLES[r],
            params=rs[0]["params"],
            macs=rs[0]["macs"],
            depth=rs[0]["dials"]["depth"],
            seeds=[x["seed"] for x in rs],
            top1=top1,
            top1_mean=statistics.mean(top1),
            top1_sd=_spread(top1),
            head_similarity=sim,
            head_similarity_mean=statistics.mean(sim),
            head_similarity_sd=_spread(sim),
            head_similarity_stages=_per_stage(rs),
            stage_tokens={str(b["stage"]): b["tokens"] for b in rs[0]["head_similarity_blocks"]},
            train_epoch_s=statistics.mean(x["train_epoch_s"] for x in rs),
        )
        if throughput and r in throughput:
            row["throughput"] = throughput[r]
        rows.append(row)
    return rows


def _per_stage(results: list[dict]) -> dict[str, float]:
    """Mean head similarity of each stage's blocks (windows of more than one token), over seeds."""
    vals: dict[str, list[float]] = {}
    for x in results:
        for b in x["head_similarity_blocks"]:
            if b["tokens"] > 1 and b["num_heads"] > 1:
                vals.setdefault(str(b["stage"]), []).append(b["mean_off_diagonal"])
    return {k: statistics.mean(v) for k, v in sorted(vals.items())}


def _fmt_sd(mean: float, sd: float, digits: int) -> str:
    return f"{mean:.{digits}f}" if math.isnan(sd) else f"{mean:.{digits}f} ± {sd:.{digits}f}"


def table_markdown(rows: list[dict]) -> str:
    """The study's table (GitHub markdown)."""
    base = rows[0].get("throughput", {}).get("img_s") if rows else None
    lines = [
        "| variant | depth | params (M) | MACs (M) | CPU img/s (median, min–max) | vs rung 1 | top-1 % (mean ± sd) | top-1 per seed | head similarity (mean ± sd) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        tp = r.get("throughput")
        tp_s = f"{tp['img_s']:.0f} ({tp['min']:.0f}–{tp['max']:.0f})" if tp else "—"
        ratio = f"{tp['img_s'] / base:.2f}×" if tp and base else "—"
        lines.append(
            f"| {r['title']} | {','.join(map(str, r['depth']))} | {r['params'] / 1e6:.3f} | {r['macs'] / 1e6:.1f} | {tp_s} | {ratio} | "
            f"{_fmt_sd(r['top1_mean'], r['top1_sd'], 2)} | {', '.join(f'{v:.2f}' for v in r['top1'])} | "
            f"{_fmt_sd(r['head_similarity_mean'], r['head_similarity_sd'], 3)} |"
        )
    return "\n".join(lines) + "\n"


def plot_study(rows: list[dict], out: Path) -> list[Path]:
    """``ablation_top1.png``, ``ablation_speed_accuracy.png``, ``ablation_heads.png``."""
    from .plots import bar_chart, scatter

    labels = [f"{RUNGS.index(r['rung']) + 1} {r['rung']}" for r in rows]
    stages = sorted({int(k) for r in rows for k in r["head_similarity_stages"]})
    sd = lambda v: 0.0 if math.isnan(v) else v  # noqa: E731
    paths = [
        bar_chart(
            {"top-1": [r["top1_mean"] for r in rows]}, labels, out / "ablation_top1.png", ylabel="top-1 % (validation)",
            title="top-1 per rung (bars: mean over seeds, whiskers: sd)", errors={"top-1": [sd(r["top1_sd"]) for r in rows]},
        ),
        bar_chart(
            {lab: [r["head_similarity_stages"].get(str(i), float("nan")) for i in stages] for lab, r in zip(labels, rows)},
            [f"stage {i + 1} ({rows[0]['stage_tokens'][str(i)]} tokens)" for i in stages],
            out / "ablation_heads.png", ylabel="mean cosine similarity between heads",
            title="head similarity per stage (mean over its blocks and seeds)", ylim=(0, 1.05),
        ),
    ]
    if all("throughput" in r for r in rows):
        paths.append(
            scatter(
                [(r["throughput"]["img_s"], r["top1_mean"], lab) for r, lab in zip(rows, labels)],
                out / "ablation_speed_accuracy.png", xlabel="CPU images/s (1 thread, batch 16, fused, traced)",
                ylabel="top-1 %", title="speed vs accuracy along the ladder",
                yerr=[sd(r["top1_sd"]) for r in rows],
                xerr=[[r["throughput"]["img_s"] - r["throughput"]["min"] for r in rows], [r["throughput"]["max"] - r["throughput"]["img_s"] for r in rows]],
            )
        )
    return paths


def run_from_args(args: argparse.Namespace) -> int:
    """``cgavit ablate``: train and measure every (rung, seed) not done yet, then write the summary."""
    from ..train.data import list_split
    from .data import load_images

    if args.epochs < 1:
        raise ValueError(f"--epochs must be at least 1, got {args.epochs}")
    torch.set_num_threads(max(1, args.threads))
    out = Path(args.output)
    t0 = time.perf_counter()
    data_dir = prepare_data(args.data, out, args.train_subset, args.val_subset)
    classes, _ = list_split(data_dir, "train")
    overrides = {k: getattr(args, k) for k in ("embed_dim", "num_heads", "depth") if getattr(args, k) is not None}
    variants, note = build_ladder(args.model, overrides, len(classes), args.img_size, rungs=[r for r in RUNGS if r in args.rungs])
    spec = dict(
        model=args.model, arch=overrides and {k: list(v) for k, v in overrides.items()}, epochs=args.epochs, batch_size=args.batch_size,
        img_size=args.img_size, lr=args.lr, train_args=args.train_args, data=str(Path(args.data).resolve()),
        train_subset=args.train_subset, val_subset=args.val_subset,
    )
    spec_file = out / "study.json"
    if spec_file.exists():
        old = json.loads(spec_file.read_text())
        if old["spec"] != json.loads(json.dumps(spec)):
            changed = sorted(k for k in spec if old["spec"].get(k) != json.loads(json.dumps(spec))[k])
            raise ValueError(f"{out} holds a study with other settings ({', '.join(changed)}); use another --output or the same options")
    _write_json(spec_file, dict(spec=spec, matching=note, variants=[dict(rung=v.rung, dials={k: list(x) if isinstance(x, tuple) else x for k, x in v.dials.items()}) for v in variants]))
    crop = _trainer_option(args.train_args, "crop_pct")
    heads_batch, _, _ = load_images([data_dir / "val"], args.img_size, args.heads_images, crop_pct=crop, seed=0)
    results = []
    try:
        for seed in args.seeds:  # seed-major: a study cut short still has every rung for the first seeds
            for v in variants:
                results.append(run_variant(v, seed, args, data_dir, out, heads_batch))
    except StudyStopped as err:
        log.warning("%s", err)
        return 130
    throughput = None
    if not args.no_throughput:
        log.info("measuring CPU throughput of %d variants (interleaved)", len(variants))
        models = {v.rung: create_model(args.model, num_classes=len(classes), img_size=args.img_size, **v.dials) for v in variants}
        throughput = measure_throughput(models, args.img_size, rounds=args.speed_rounds, seconds=args.speed_seconds)
    rows = summarize(results, throughput, [v.rung for v in variants])
    table = table_markdown(rows)
    plots = plot_study(rows, out)
    _write_json(
        out / "ablation.json",
        dict(spec=spec, matching=note, seeds=args.seeds, rows=rows, throughput_protocol="torch.set_num_threads(1), batch 16, fp32, BatchNorm fused, traced, random weights; "
             f"{args.speed_rounds} interleaved rounds of ~{args.speed_seconds:g} s per variant, median", this_invocation_s=round(time.perf_counter() - t0, 1),
             train_epoch_s_total=round(sum(x["train_epoch_s"] for x in results), 1)),
    )
    atomic_write(out / "ablation_table.md", lambda t: Path(t).write_text(table))
    print(table)
    print(f"parameter matching: rung 1 depth {note['standard_depth']} ({note['standard_params'] / 1e6:.3f} M) vs rung 2 depth "
          f"{note['base_depth']} ({note['sandwich_params'] / 1e6:.3f} M)")
    print(f"wrote {out / 'ablation.json'}, {out / 'ablation_table.md'}, " + ", ".join(map(str, plots)))
    return 0
