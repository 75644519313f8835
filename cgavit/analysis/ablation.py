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

Every (rung, seed) trains in its own folder with :func:`cgavit.train.train` and writes ``result.json``
when measured; a study that is stopped continues where it was, and a run stopped mid-training
resumes from its last checkpoint (:meth:`cgavit.train.TrainConfig.resume_from`). The summary
(``ablation.json``, ``ablation_table.md``, PNG plots) is rebuilt from the result files, with CPU
throughput of all rungs measured together, round-robin (:func:`cgavit.timing.round_robin`).
"""

from __future__ import annotations

import itertools
import json
import logging
import math
import statistics
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..deploy import fuse
from ..factory import create_model, resolve_name
from ..fields import option
from ..info import count_macs
from ..io import write_json, write_text
from ..timing import round_robin, time_call
from ..train import TrainConfig, TrainResult, evaluate_checkpoint, load_model, train
from ..train import checkpoint as train_checkpoint
from ..train.config import check_dials, train_defaults
from ..train.data import check_folder, list_split
from ..train.records import read_metrics
from ..variants import VARIANTS
from .data import balanced_subset, list_images, load_images
from .heads import head_similarity, mean_similarity
from .plots import bar_chart, scatter

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


# ------------------------------------------------------------------------------------ the options
@dataclass
class AblationConfig:
    """One study; the fields are the ``cgavit ablate`` options, each documented by its ``help`` text
    (the line ``cgavit ablate --help`` shows for it).

    Args:
        train_args: further :class:`~cgavit.train.TrainConfig` fields for every run (dials under
            ``"dials"``; they win over the rung's). The command takes them as ``cgavit train``
            options in one string, ``--train-args``.
    """

    data: str = option(help="dataset folder: DIR/train/<class>/<img> and DIR/val (or DIR/test)")
    output: str = option(help="study folder (per-variant folders, results, table, plots)")
    epochs: int = option(help="training epochs of every variant")
    model: str = option("efficientvit_m0", "base variant whose widths/heads/depths the ladder starts from")
    embed_dim: tuple[int, ...] | None = option(None, "base widths, three values (default: the variant's)", sep=",")
    num_heads: tuple[int, ...] | None = option(None, "base heads per stage (default: the variant's)", sep=",")
    depth: tuple[int, ...] | None = option(
        None, "base depths (rungs 2-5; rung 1 is matched in parameters to rung 2; default: the variant's)", sep=","
    )
    img_size: int = option(224, "training and evaluation size in pixels")
    batch_size: int = option(64, "training batch size")
    lr: float = option(1e-3, "peak learning rate (AdamW, cosine)")
    seeds: tuple[int, ...] = option((0,), "one training run per seed and variant")
    rungs: tuple[str, ...] = option(RUNGS, "which rungs to run", choices=RUNGS)
    train_subset: int = option(0, "use this many training images, balanced per class (0 = all)")
    val_subset: int = option(0, "use this many validation images, balanced per class (0 = all)")
    heads_images: int = option(64, "validation images for the head-similarity measurement")
    threads: int = option(1, "torch threads for training")
    train_args: dict = field(default_factory=dict)
    no_throughput: bool = option(False, "skip the CPU throughput measurement")
    speed_rounds: int = option(5, "interleaved timing rounds per variant (throughput: the median)")
    speed_seconds: float = option(1.0, "seconds per timing round")

    def __post_init__(self) -> None:
        self.data, self.output = str(self.data), str(self.output)
        for name in ("embed_dim", "num_heads", "depth"):
            if getattr(self, name) is not None:
                setattr(self, name, tuple(getattr(self, name)))
        self.seeds, self.rungs = tuple(self.seeds), tuple(self.rungs)

    def validate(self) -> None:
        """Raise ``ValueError`` for options that cannot work, naming the one to change."""
        if self.epochs < 1:
            raise ValueError(f"--epochs must be at least 1, got {self.epochs}")
        if not self.seeds:
            raise ValueError("--seeds needs at least one seed")
        unknown = [r for r in self.rungs if r not in RUNGS]
        if unknown or not self.rungs:
            raise ValueError(f"--rungs must name some of {', '.join(RUNGS)}, got {list(self.rungs)}")
        if self.speed_rounds < 1 or self.speed_seconds <= 0:
            raise ValueError("--speed-rounds must be at least 1 and --speed-seconds positive")
        bad = sorted(set(self.train_args) - set(train_defaults()))
        if bad:
            raise ValueError(f"--train-args names no training option {bad}")
        if self.threads < 1 or self.heads_images < 1 or self.train_subset < 0 or self.val_subset < 0:
            raise ValueError("--threads and --heads-images must be at least 1, --train-subset and --val-subset at least 0")
        budget = dict(data=self.data, model=self.model, epochs=self.epochs, batch_size=self.batch_size, img_size=self.img_size, lr=self.lr)
        owned = sorted(set(self.train_args) & {*budget, "seed", "output", "resume"})
        if owned:
            raise ValueError(f"--train-args cannot set {', '.join(owned)}: the study sets them (use its own options)")
        for seed in self.seeds:  # the training options every run gets, within the trainer's bounds
            TrainConfig(**budget, seed=seed, **{**self.train_args, "dials": {}}).check_values()
        check_dials({k: getattr(self, k) for k in ("embed_dim", "num_heads", "depth") if getattr(self, k) is not None})
        check_dials(self.train_args.get("dials", {}))


# ------------------------------------------------------------------------------------ measuring
@torch.no_grad()
def measure_throughput(models: dict[str, torch.nn.Module], img_size: int, batch: int = 16, rounds: int = 5, seconds: float = 1.0) -> dict[str, dict]:
    """CPU images/s of each model, fused (BatchNorm folded) and traced, one thread, fp32.

    The models are timed round-robin (:func:`cgavit.timing.round_robin`): each round runs every
    model for about ``seconds`` in turn, ``rounds`` rounds, so load from other processes hits all
    of them alike; the median round is reported with the spread.

    Returns:
        ``{name: {"img_s" (median), "min", "max", "rounds", "batch"}}``.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        x = torch.randn(batch, 3, img_size, img_size)
        calls, images = {}, {}
        for name, m in models.items():
            traced = _traced(m, x)
            one = [time_call(lambda: traced(x)) for _ in range(3)][-1]  # the first calls warm up
            repeats = max(1, round(seconds / max(one, 1e-9)))
            calls[name] = _repeated(traced, x, repeats)
            images[name] = repeats * batch
        timings = round_robin(calls, warmup=0, repeats=rounds)
    finally:
        torch.set_num_threads(threads)
    out = {}
    for name, t in timings.items():
        rates = t.per_second(images[name])
        out[name] = dict(img_s=t.median_rate(images[name]), min=min(rates), max=max(rates), rounds=rounds, batch=batch)
    return out


def _traced(model: torch.nn.Module, x: torch.Tensor) -> torch.jit.ScriptModule:
    with warnings.catch_warnings():  # tracer notes on shape checks: shapes are fixed here
        warnings.simplefilter("ignore")
        return torch.jit.trace(fuse(model.eval()), x, check_trace=False)


def _repeated(fn, x: torch.Tensor, repeats: int):
    def call() -> None:
        for _ in range(repeats):
            fn(x)

    return call


# ------------------------------------------------------------------------------------ the study
class StudyStopped(Exception):
    """A training run was stopped by a signal (its checkpoint is saved; the study can continue)."""


def prepare_data(data: str | Path, out: Path, train_subset: int, val_subset: int, seed: int = 0) -> Path:
    """The dataset folder the trainer reads: ``data`` itself, or balanced, seeded subsets as symlinks.

    ``data`` needs ``train/`` and ``val/`` (or ``test/``) class folders. When a subset is asked for, or
    the held-out split is named ``test``, ``out/data/{train,val}/<class>/`` is filled with links to the
    chosen files (once; a later call with other sizes is refused).
    """
    root = check_folder(data)
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
    write_json(marker, spec)
    return dest


def _trained_epochs(last: Path) -> int:
    return int(train_checkpoint.load(last)["next_epoch"]) if last.exists() else 0


def train_options(cfg: AblationConfig, variant: Variant, seed: int, data_dir: Path, run_dir: Path) -> dict:
    """The :class:`~cgavit.train.TrainConfig` fields of one (variant, seed) run: the study's budget,
    the rung's dials, then ``cfg.train_args`` (which win)."""
    extra = dict(cfg.train_args)
    dials = {**variant.dials, **extra.pop("dials", {})}
    return dict(
        data=str(data_dir), model=cfg.model, epochs=cfg.epochs, batch_size=cfg.batch_size, img_size=cfg.img_size,
        lr=cfg.lr, seed=seed, output=str(run_dir), dials=dials, **extra,
    )


def _train_variant(cfg: AblationConfig, variant: Variant, seed: int, options: dict, last: Path) -> TrainResult | None:
    """Train (or continue) one run; None when it had finished before."""
    if _trained_epochs(last) >= cfg.epochs:
        log.info("%s seed %d: training finished before, measuring", variant.rung, seed)
        return None
    if last.exists():
        log.info("%s seed %d: resuming %s", variant.rung, seed, last)
        run_cfg = TrainConfig.resume_from(last, **options)
    else:
        run_cfg = TrainConfig(**options)
        log.info("%s seed %d: training  cgavit train %s", variant.rung, seed, " ".join(run_cfg.to_argv()))
    summary = train(run_cfg)
    if summary.interrupted:
        raise StudyStopped(f"training of {variant.rung} seed {seed} was stopped; run the same command again to continue")
    return summary


def run_variant(variant: Variant, seed: int, cfg: AblationConfig, data_dir: Path, out: Path, heads_batch: torch.Tensor) -> dict:
    """Train (or continue) one (variant, seed) and measure it; returns and writes its ``result.json``."""
    run_dir = out / "runs" / variant.rung / f"seed{seed}"
    result_file = run_dir / "result.json"
    if result_file.exists():
        log.info("%s seed %d: done before, reading %s", variant.rung, seed, result_file)
        return json.loads(result_file.read_text())
    options = train_options(cfg, variant, seed, data_dir, run_dir)
    last = run_dir / "last.pt"
    summary = _train_variant(cfg, variant, seed, options, last)
    ev = evaluate_checkpoint(data_dir, last, batch_size=cfg.batch_size, workers=0, device="cpu")
    model, _ = load_model(last, device="cpu")
    blocks = head_similarity(model, heads_batch)
    res = dict(
        rung=variant.rung,
        title=variant.title,
        seed=seed,
        dials={k: list(v) if isinstance(v, tuple) else v for k, v in variant.dials.items()},
        params=sum(p.numel() for p in model.parameters()),
        macs=count_macs(model, (cfg.img_size, cfg.img_size)),
        top1=ev["top1"],
        top5=ev["top5"],
        val_loss=ev["loss"],
        val_images=ev["n"],
        best_top1=summary.best_top1 if summary is not None else None,
        head_similarity=mean_similarity(blocks),
        head_similarity_blocks=[b.to_dict() for b in blocks],
        train_epoch_s=round(sum(r.get("epoch_s", 0.0) for r in read_metrics(run_dir / "metrics.jsonl")), 1),
        train_argv=TrainConfig(**options).to_argv(),
    )
    write_json(result_file, res)
    return res


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


# ------------------------------------------------------------------------------------ the whole study
@dataclass
class StudySummary:
    """What :func:`run_ablation` wrote: one row per rung, the markdown table, the depth matching of
    rung 1, and the files."""

    rows: list[dict]
    table: str
    matching: dict
    json_path: Path
    table_path: Path
    plots: list[Path]


@dataclass
class _Study:
    data_dir: Path
    classes: list[str]
    variants: list[Variant]
    matching: dict
    spec: dict


def _prepare_study(cfg: AblationConfig, out: Path) -> _Study:
    """Data, ladder and ``study.json``; refuses a folder that holds a study with other settings."""
    data_dir = prepare_data(cfg.data, out, cfg.train_subset, cfg.val_subset)
    classes, _ = list_split(data_dir, "train")
    overrides = {k: getattr(cfg, k) for k in ("embed_dim", "num_heads", "depth") if getattr(cfg, k) is not None}
    variants, note = build_ladder(cfg.model, overrides, len(classes), cfg.img_size, rungs=[r for r in RUNGS if r in cfg.rungs])
    spec = json.loads(json.dumps(dict(
        model=cfg.model, arch=overrides and {k: list(v) for k, v in overrides.items()}, epochs=cfg.epochs,
        batch_size=cfg.batch_size, img_size=cfg.img_size, lr=cfg.lr, train_args=cfg.train_args,
        data=str(Path(cfg.data).resolve()), train_subset=cfg.train_subset, val_subset=cfg.val_subset,
    )))
    spec_file = out / "study.json"
    if spec_file.exists():
        old = json.loads(spec_file.read_text())["spec"]
        if old != spec:
            changed = sorted(k for k in spec if old.get(k) != spec[k])
            raise ValueError(f"{out} holds a study with other settings ({', '.join(changed)}); use another --output or the same options")
    variants_json = [
        dict(rung=v.rung, dials={k: list(x) if isinstance(x, tuple) else x for k, x in v.dials.items()}) for v in variants
    ]
    write_json(spec_file, dict(spec=spec, matching=note, variants=variants_json))
    return _Study(data_dir, classes, variants, note, spec)


def run_ablation(cfg: AblationConfig) -> StudySummary:
    """Train and measure every (rung, seed) not done yet, then write the summary.

    Seed-major: a study cut short still has every rung for the first seeds.

    Raises:
        StudyStopped: a training run was stopped by a signal (run the same study again to continue).
        ValueError: bad options, data, or a folder holding a study with other settings.
    """
    cfg.validate()
    torch.set_num_threads(max(1, cfg.threads))
    out = Path(cfg.output)
    t0 = time.perf_counter()
    study = _prepare_study(cfg, out)
    crop = TrainConfig(**cfg.train_args).crop_pct
    heads_batch, _, _ = load_images([study.data_dir / "val"], cfg.img_size, cfg.heads_images, crop_pct=crop, seed=0)
    results = [run_variant(v, seed, cfg, study.data_dir, out, heads_batch) for seed in cfg.seeds for v in study.variants]
    throughput = None
    if not cfg.no_throughput:
        log.info("measuring CPU throughput of %d variants (interleaved)", len(study.variants))
        models = {
            v.rung: create_model(cfg.model, num_classes=len(study.classes), img_size=cfg.img_size, **v.dials)
            for v in study.variants
        }
        throughput = measure_throughput(models, cfg.img_size, rounds=cfg.speed_rounds, seconds=cfg.speed_seconds)
    rows = summarize(results, throughput, [v.rung for v in study.variants])
    table = table_markdown(rows)
    plots = plot_study(rows, out)
    protocol = ("torch.set_num_threads(1), batch 16, fp32, BatchNorm fused, traced, random weights; "
                f"{cfg.speed_rounds} interleaved rounds of ~{cfg.speed_seconds:g} s per variant, median")
    json_path = write_json(out / "ablation.json", dict(
        spec=study.spec, matching=study.matching, seeds=list(cfg.seeds), rows=rows, throughput_protocol=protocol,
        this_invocation_s=round(time.perf_counter() - t0, 1),
        train_epoch_s_total=round(sum(x["train_epoch_s"] for x in results), 1),
    ))
    table_path = write_text(out / "ablation_table.md", table)
    return StudySummary(rows, table, study.matching, json_path, table_path, plots)
