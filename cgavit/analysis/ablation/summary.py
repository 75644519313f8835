"""The study's summary from its result files: one row per rung over seeds, the markdown table and
the PNG plots."""

from __future__ import annotations

import math
import statistics
from pathlib import Path

from ..plots import bar_chart, scatter, stage_label
from .ladder import RUNG_TITLES, RUNGS


def _spread(vals: list[float]) -> float:
    return statistics.stdev(vals) if len(vals) > 1 else float("nan")


def _number(value: float | None) -> float:
    """A figure of a result file: null there (no value: e.g. head similarity with one head) is NaN here."""
    return float("nan") if value is None else value


def summarize(results: list[dict], throughput: dict | None, rungs: list[str]) -> list[dict]:
    """One row per rung: sizes, throughput, and top-1 / head similarity over seeds."""
    rows = []
    for r in rungs:
        rs = [x for x in results if x["rung"] == r]
        if not rs:
            continue
        top1 = [_number(x["top1"]) for x in rs]
        sim = [_number(x["head_similarity"]) for x in rs]
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
    if math.isnan(mean):
        return "n/a"
    return f"{mean:.{digits}f}" if math.isnan(sd) else f"{mean:.{digits}f} ± {sd:.{digits}f}"


def table_markdown(rows: list[dict]) -> str:
    """The study's table (GitHub markdown)."""
    base = rows[0].get("throughput", {}).get("img_s") if rows else None
    first = RUNGS.index(rows[0]["rung"]) + 1 if rows else 1  # the speed-up is against the first rung studied
    lines = [
        f"| variant | depth | params (M) | MACs (M) | CPU img/s (median, min–max) | vs rung {first} | top-1 % (mean ± sd) | top-1 per seed | head similarity (mean ± sd) |",
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


def _no_similarity_note(rows: list[dict]) -> str:
    """Why the head-similarity chart has no bars ("" when it has some): no block with two heads (one head has no
    pair to compare), over windows of more than one token where a stage has one-token windows."""
    if not rows or any(r["head_similarity_stages"] for r in rows):
        return ""
    if all(t > 1 for t in rows[0]["stage_tokens"].values()):
        return "no block has two heads to compare"
    return "no block has two heads over windows of more than one token to compare"


def plot_study(rows: list[dict], out: Path) -> list[Path]:
    """``ablation_top1.png``, ``ablation_speed_accuracy.png``, ``ablation_heads.png``."""
    labels = [f"{RUNGS.index(r['rung']) + 1} {r['rung']}" for r in rows]
    stages = sorted({int(k) for r in rows for k in r["head_similarity_stages"]})
    tokens = rows[0]["stage_tokens"] if rows else {}
    if not stages:  # every stage drawn empty, and why: as analyze heads says "n/a" for a block of one head
        stages = sorted(int(k) for k in tokens)
    sd = lambda v: 0.0 if math.isnan(v) else v  # noqa: E731
    paths = [
        bar_chart(
            {"top-1": [r["top1_mean"] for r in rows]}, labels, out / "ablation_top1.png", ylabel="top-1 % (validation)",
            title="top-1 per rung (bars: mean over seeds, whiskers: sd)", errors={"top-1": [sd(r["top1_sd"]) for r in rows]},
        ),
        bar_chart(
            {lab: [r["head_similarity_stages"].get(str(i), float("nan")) for i in stages] for lab, r in zip(labels, rows)},
            [f"{stage_label(i)} ({tokens[str(i)]} tokens)" for i in stages],
            out / "ablation_heads.png", ylabel="mean cosine similarity between heads",
            title="head similarity per stage (mean over its blocks and seeds)", ylim=(0, 1.05),
            message=_no_similarity_note(rows),
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
