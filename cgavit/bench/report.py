"""The bench's outputs: the text tables, the environment record, bench.csv, bench.json and the
accuracy-against-throughput plot (all files written atomically)."""

from __future__ import annotations

import csv
import platform
import time
from pathlib import Path

import torch

from ..analysis.plots import matplotlib_api, plain_log_labels
from ..deploy import ACCURACY_TOLERANCE, AGREEMENT_TARGET, NoiseFloor, PathChoice, cpu_features
from ..io import atomic_write, make_folder, replace_together, staging, write_json
from .candidates import PEERS_TOP1_SIDE, Result
from .optional import timm_version
from .precision import PrecisionRow
from .train_speed import TrainingRow

BATCH_NOTE = (
    "Batch size decides throughput: these are images/s at batch {batch}. Batch-1 latency and "
    "batch-2048 GPU throughput measure different things; compare figures only at the same batch, "
    "threads, precision and image size (the paper: CPU 1 thread batch 16 fp32; GPU batch 2048 AMP)."
)
#: Where the published top-1 figures were measured: every EfficientViT variant and most peers at 224 px.
TOP1_SIDES = "224 px" + "".join(f"; {peer} {side} px" for peer, side in PEERS_TOP1_SIDE.items())
TABLE_NOTE = (
    "img/s: median over timed rounds; IQR: 25th-75th percentile; 'x timm port': ratio of medians to "
    "timm's efficientvit_msra (BatchNorm fused by timm, torch.jit.trace) with the same weights, same run; "
    "rel err: our output vs that port's; top-1: the published ImageNet-1k accuracy at each model's own "
    f"resolution ({TOP1_SIDES}), whatever size was timed, not measured here."
)
#: The plot's y axis: the published top-1, each at its model's own resolution.
PLOT_TOP1_LABEL = f"published ImageNet-1k top-1 (%)\nat each model's own resolution ({TOP1_SIDES})"
PRECISION_NOTE = (
    "top-1 agree / max rel err: against the plain fused fp32 model in eager mode (max rel err: the largest "
    "per-image ||a-b||/||b|| of the logits); x fp32: throughput ratio to the first row; acc / change: top-1 "
    "accuracy against the labels and its change from fp32 in points; target: agreement >= {agree:.1f}% and "
    "accuracy within {acc:.1f} point of fp32 ('MISSES' marks a path that does not meet it).\n"
    "{images}"
)
CSV_HEADER = ("model", "kind", "variant", "img_s_median", "iqr_low", "iqr_high", "min", "max",
              "ratio_to_timm_port", "rel_err_vs_timm", "published_top1")
PLOT_NAME = "accuracy_vs_throughput.png"


def format_table(results: list[Result]) -> str:
    """The main table: one line per candidate (an empty table for no results)."""
    head = f"{'model':<52}{'img/s':>9}{'IQR':>17}{'x timm port':>12}{'rel err':>9}{'top-1':>7}"
    lines = [head, "-" * len(head)]
    for r in results:
        lo, hi = r.iqr
        ratio = f"{r.ratio_to_timm:.2f}" if r.ratio_to_timm is not None else ""
        err = f"{r.rel_err_vs_timm:.0e}" if r.rel_err_vs_timm is not None else ""
        top1 = f"{r.top1:.1f}" if r.top1 is not None else ""
        lines.append(f"{r.name:<52}{r.median:>9.1f}{f'{lo:.1f}-{hi:.1f}':>17}{ratio:>12}{err:>9}{top1:>7}")
    return "\n".join(lines)


def format_precision_table(rows: list[PrecisionRow]) -> str:
    """The precision check: one line per model, path and image set."""
    lines = [f"{'model':<17}{'path':<32}{'images':<8}{'n':>6}{'img/s':>8}{'x fp32':>7}{'top-1 agree':>12}"
             f"{'max rel err':>12}{'classes':>8}{'acc':>8}{'change':>8}  target"]
    for r in rows:
        acc = "" if r["accuracy"] is None else f"{100 * r['accuracy']:.1f}%"
        change = "" if r["accuracy_change"] is None else f"{r['accuracy_change']:+.1f}"
        verdict = "meets" if r["meets_target"] else "MISSES"
        images = r["images"] if len(r["images"]) <= 7 else "folder"
        lines.append(f"{r['model']:<17.16}{r['path']:<32}{images:<8}{r['n']:>6}{r['img_s']:>8.1f}"
                     f"{r['ratio_to_fp32']:>7.2f}{100 * r['top1_agreement']:>11.1f}%{r['max_rel_err']:>12.1e}"
                     f"{r['fp32_distinct_classes']:>8}{acc:>8}{change:>8}  {verdict}")
    return "\n".join(lines)


def precision_note(images: dict[str, str | int]) -> str:
    """The note under the precision table: the columns, the target, and which images were used."""
    n, size = images.get("evaluated_images"), images.get("img_size")
    which = "every image" if images.get("every", True) else f"{n} images, drawn at random (a fixed seed),"
    at = f" at the checkpoint's {size}x{size} px" if size else ""
    text = (f"Evaluated: {which} of {images['evaluated']}{at}. int8 calibrated on {images['calibration_images']} "
            f"training images of {images['calibration']} (never on the evaluated ones).")
    return PRECISION_NOTE.format(agree=100 * AGREEMENT_TARGET, acc=ACCURACY_TOLERANCE, images=text)


def format_noise_floor(floor: NoiseFloor) -> str:
    """The line under the precision table that gives its agreement column a scale: fp32's own near-ties."""
    return (f"For scale: on these images, {floor.describe()}, the rounding an 8-bit image already carries: "
            "a decision that such noise changes is a near-tie of the model's own.")


def format_auto(choice: PathChoice) -> str:
    """The line saying which path ``optimize(precision="auto")`` chose, and why."""
    return f"optimize(precision='auto') chose: {choice.precision} {choice.backend}. Why: {choice.reason}"


def format_auto_order(order: list[PathChoice]) -> str:
    """The line saying what ``optimize(precision="auto")`` tries on this CPU without calibration images."""
    if not order:
        return "optimize(precision='auto'): no path available"
    paths = ", ".join(f"{c.precision} {c.backend}" for c in order)
    return (f"optimize(precision='auto') here tries, in order: {paths}; the first reduced path whose top-1 "
            f"agreement with fp32 meets {100 * AGREEMENT_TARGET:.1f}% is kept (fp32 always is); with calibration "
            f"images int8 comes first. Why: {order[0].reason.split('; kept only')[0]}")


def format_training(rows: list[TrainingRow]) -> str:
    """The training comparison: one line per variant."""
    return "\n".join(
        f"training (forward+backward, batch {r['batch']}, train mode, {r['warmup']} warm-up + {r['repeats']} timed "
        f"rounds): {r['model']} cgavit "
        f"{r['cgavit_ips']:.1f} img/s, timm {r['timm_ips']:.1f} img/s, ratio {r['ratio']:.2f}"
        for r in rows
    )


def environment(device: torch.device | None = None) -> dict[str, str]:
    """CPU model and class (:func:`~cgavit.deploy.cpu_features`: a VM's model name, e.g. "AMD EPYC", is the same for
    an AVX2-only and an AVX-512 CPU), on a CUDA ``device`` the GPU's name and CUDA version, library versions and
    date, for the record."""
    features = cpu_features()
    on_gpu = device is not None and device.type == "cuda"
    gpu = dict(gpu=torch.cuda.get_device_name(device), cuda=str(torch.version.cuda)) if on_gpu else {}
    return dict(cpu=features.model_name or platform.processor() or "", cpu_class=features.cpu_class, **gpu,
                torch=torch.__version__, timm=timm_version(), python=platform.python_version(),
                date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))


def write_csv(results: list[Result], path: str | Path) -> Path:
    """bench.csv: one row per candidate (images/s median, IQR, range, ratio, error, published top-1)."""

    def write(tmp: str) -> None:
        with open(tmp, "w", newline="") as fh:
            w = csv.writer(fh)
            w.writerow(CSV_HEADER)
            for r in results:
                w.writerow([r.name, r.kind, r.variant, f"{r.median:.2f}", f"{r.iqr[0]:.2f}", f"{r.iqr[1]:.2f}",
                            f"{min(r.ips):.2f}", f"{max(r.ips):.2f}",
                            "" if r.ratio_to_timm is None else f"{r.ratio_to_timm:.3f}",
                            "" if r.rel_err_vs_timm is None else f"{r.rel_err_vs_timm:.2e}", r.top1 or ""])

    return atomic_write(path, write)


def plot(results: list[Result], path: str | Path, title: str) -> Path:
    """Published top-1 against measured images/s (log scale), one point per candidate; a PNG."""
    mpl = matplotlib_api()
    fig, ax = mpl.pyplot.subplots(figsize=(8, 5.5))
    colors = {"ours": "tab:red", "timm-port": "tab:gray", "peer": "tab:blue"}
    kinds = (("ours", "cgavit (this package)"), ("timm-port", "timm efficientvit_msra port"), ("peer", "timm peers"))
    for kind, legend in kinds:
        pts = [r for r in results if r.kind == kind and r.top1 is not None]
        if pts:
            ax.scatter([r.median for r in pts], [r.top1 for r in pts], c=colors[kind], label=legend, s=40)
            for r in pts:
                label = r.name.replace("cgavit ", "").replace("timm ", "").replace("efficientvit_", "")
                stacked = sum(1 for q in results if q.top1 == r.top1 and results.index(q) < results.index(r))
                ax.annotate(label, (r.median, r.top1), fontsize=6, xytext=(4, 4 + 8 * stacked),
                            textcoords="offset points", arrowprops=dict(arrowstyle="-", lw=0.3, color="0.6"))
    ax.set_xscale("log")
    ax.xaxis.set_major_formatter(mpl.ticker.ScalarFormatter())
    ax.xaxis.set_minor_formatter(plain_log_labels())  # 2000, 3000: not 2x10^3 beside a plain 1000
    ax.set_xlabel("measured throughput (images/s, log scale)")
    ax.set_ylabel(PLOT_TOP1_LABEL, fontsize=9)
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    atomic_write(path, lambda tmp: fig.savefig(tmp, dpi=130, format="png"))
    mpl.pyplot.close(fig)
    return Path(path)


def write_report(out: str | Path, record: dict, results: list[Result], title: str) -> list[Path]:
    """Write ``bench.json`` (``record``), ``bench.csv`` and the plot into folder ``out``; returns their paths.
    Without ``results`` (the main table skipped) ``bench.json`` alone, which holds the other sections.

    The files are written beside the folder's as temporaries and moved into place together
    (:func:`~cgavit.io.replace_together`): a run stopped while writing leaves the earlier set or this one, never a
    mix; without ``results``, an earlier run's ``bench.csv`` and plot, which would describe another run than this
    ``bench.json``, are removed in the same step."""
    out = make_folder(out, "bench output folder")
    names = ("bench.csv", "bench.json", PLOT_NAME)
    with staging(out / "bench.json") as tmp:
        made = {"bench.json": write_json(tmp / "bench.json", record)}
        if results:
            made["bench.csv"] = write_csv(results, tmp / "bench.csv")
            made[PLOT_NAME] = plot(results, tmp / PLOT_NAME, title)
        replace_together([(made.get(name), out / name) for name in names if name in made or (out / name).exists()])
    return [out / name for name in names if name in made]
