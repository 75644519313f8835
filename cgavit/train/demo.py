"""``cgavit demo`` / ``make demo``: the whole training pipeline on real data that needs no download.

scikit-learn ships the UCI handwritten digits (1797 grayscale 8x8 images, 10 classes). The demo
writes them as an image folder (``train`` 80% / ``val`` 20%, stratified, fixed seed), then runs the
same :func:`~cgavit.train.train` as ``cgavit train`` with a small-data recipe on a reduced M0 with
cascaded group attention, evaluates the held-out split with the final weights (no model selection
on it), and writes the checkpoint, ``report.json``, ``report.md`` and ``curves.png``.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from ..io import atomic_write

log = logging.getLogger(__name__)

IMG_SIZE = 64
# a reduced efficientvit_m0: stage widths 32/48/64 (paper 64/128/192), one sandwich block per stage
# (paper 1/2/3), two heads per stage (paper 4), query kernels 5,5. Cascade, group split, sandwich
# layout and narrow Q/K (16) are the paper's.
DEMO_DIALS = ["--embed-dim", "32,48,64", "--depth", "1,1,1", "--num-heads", "2,2,2", "--kernels", "5,5"]
DEMO_EPOCHS = 15
DIGITS_MEAN = (0.3, 0.3, 0.3)
DIGITS_STD = (0.4, 0.4, 0.4)


def write_digits(root: str | Path, val_fraction: float = 0.2, seed: int = 0) -> dict:
    """Write scikit-learn's digits as ``root/{train,val}/<digit>/<n>.png`` (8x8 grayscale PNGs).

    The split is stratified by class with a fixed seed; an existing, complete folder is reused.

    Returns:
        ``{"train": n_train, "val": n_val, "classes": ["0", ..., "9"]}``.
    """
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    root = Path(root)
    digits = load_digits()
    images = np.clip(np.round(digits.images * (255.0 / 16.0)), 0, 255).astype(np.uint8)  # (1797, 8, 8)
    labels = digits.target
    idx_train, idx_val = train_test_split(
        np.arange(len(labels)), test_size=val_fraction, random_state=seed, stratify=labels
    )
    classes = [str(c) for c in range(10)]
    marker = root / "SPLIT.json"
    summary = {"train": len(idx_train), "val": len(idx_val), "classes": classes, "seed": seed, "val_fraction": val_fraction}
    if marker.is_file() and json.loads(marker.read_text()) == summary:
        return summary
    for split, idx in (("train", idx_train), ("val", idx_val)):
        for c in classes:
            (root / split / c).mkdir(parents=True, exist_ok=True)
        for i in idx:
            Image.fromarray(images[i], mode="L").save(root / split / str(labels[i]) / f"{i:04d}.png")
    atomic_write(marker, lambda tmp: Path(tmp).write_text(json.dumps(summary)))
    return summary


def demo_argv(data: str | Path, output: str | Path, epochs: int = DEMO_EPOCHS, seed: int = 0) -> list[str]:
    """The ``cgavit train`` options the demo runs (the small-data recipe).

    Changes from the ImageNet recipe, for 1437 tiny grayscale images: 64 px; no horizontal flip
    (digits are not mirror-symmetric); crops of 60-100% of the area; a milder RandAugment (m6);
    no mixup/cutmix and no repeated augmentation; batch 64 at lr 2e-3 with a one-epoch warm-up,
    stepped every update; no EMA (0.99996 needs far more updates than 300); centre crop 1.0.
    """
    return [
        "--data", str(data),
        "--output", str(output),
        "--model", "efficientvit_m0", *DEMO_DIALS,
        "--img-size", str(IMG_SIZE),
        "--crop-pct", "1.0",
        "--epochs", str(epochs),
        "--batch-size", "64",
        "--lr", "2e-3",
        "--warmup-epochs", "1",
        "--sched-on-updates",
        "--aa", "rand-m6-mstd0.5",
        "--hflip", "0",
        "--scale", "0.6", "1.0",
        "--reprob", "0.1",
        "--mixup", "0", "--cutmix", "0",
        "--aug-repeats", "0",
        "--no-model-ema",
        "--mean", *map(str, DIGITS_MEAN),
        "--std", *map(str, DIGITS_STD),
        "--seed", str(seed),
        "--workers", "1",
        "--log-interval", "10",
    ]


def run_demo(
    output: str | Path = "runs/demo",
    epochs: int | None = None,
    threads: int | None = None,
    seed: int = 0,
    progress: bool | None = None,
) -> dict:
    """Write the digits, train, evaluate, report. Returns the report dict (also in ``report.json``).

    Args:
        output: folder for data, checkpoints, report and curves; an earlier demo there is replaced.
        epochs: training epochs (default 15).
        threads: torch intra-op threads (default: one less than the cores, at most 4: one loader
            worker prepares batches beside the training).
        seed: seed for the split and the training.
        progress: progress bar (default: when stderr is a terminal).
    """
    from .engine import train
    from .inference import evaluate_checkpoint, export_weights, load_model

    output = Path(output)
    run_dir = output / "run"
    for name in ("last.pt", "best.pt", "best.safetensors", "metrics.jsonl", "curves.png", "train.log"):
        (run_dir / name).unlink(missing_ok=True)  # the demo owns this folder: start afresh
    old_threads = torch.get_num_threads()
    threads = threads or max(1, min(4, (os.cpu_count() or 2) - 1))
    torch.set_num_threads(threads)
    t0, cpu0, children0 = time.perf_counter(), time.process_time(), _children_cpu()
    try:
        split = write_digits(output / "data", seed=seed)
        print(f"digits: {split['train']} train / {split['val']} held-out images, 10 classes -> {output / 'data'}")
        argv = demo_argv(output / "data", run_dir, epochs or DEMO_EPOCHS, seed)
        if progress is not None:
            argv.append("--progress" if progress else "--no-progress")
        result = train(argv)
        if result["interrupted"]:
            print(f"demo stopped; continue it with: cgavit train --resume {run_dir / 'last.pt'}")
            return result
        weights = export_weights(run_dir / "last.pt", run_dir / "model.safetensors")
        held_out = evaluate_checkpoint(output / "data", run_dir / "last.pt", split="val", workers=0, device="cpu")
    finally:
        torch.set_num_threads(old_threads)
    wall = time.perf_counter() - t0
    cpu = time.process_time() - cpu0 + _children_cpu() - children0  # this process + its loader workers
    report = {
        "dataset": "scikit-learn load_digits (UCI handwritten digits), 8x8 upscaled to 64x64",
        "split": split,
        "model": "efficientvit_m0 with dials " + " ".join(DEMO_DIALS),
        "params": sum(p.numel() for p in load_model(weights)[0].parameters()),
        "epochs": result["epochs"],
        "held_out_top1": held_out["top1"],
        "held_out_top5": held_out["top5"],
        "held_out_loss": held_out["loss"],
        "held_out_images": held_out["n"],
        "best_epoch_top1": result["best_top1"],
        "train_wall_s": result["wall_s"],
        "total_wall_s": round(wall, 1),
        "total_cpu_s": round(cpu, 1),
        "cpu_cores": os.cpu_count(),
        "torch_threads": threads,
        "checkpoint": str(run_dir / "last.pt"),
        "weights": str(weights),
        "curves": str(run_dir / "curves.png"),
        "metrics": str(run_dir / "metrics.jsonl"),
        "command": "cgavit train " + " ".join(demo_argv(output / "data", run_dir, epochs or DEMO_EPOCHS, seed)),
    }
    atomic_write(output / "report.json", lambda tmp: Path(tmp).write_text(json.dumps(report, indent=1)))
    atomic_write(output / "report.md", lambda tmp: Path(tmp).write_text(_markdown(report)))
    print(
        f"\nheld-out top-1 {report['held_out_top1']:.2f}% ({report['held_out_images']} images never trained on, final "
        f"weights), top-5 {report['held_out_top5']:.2f}%, {report['epochs']} epochs in {report['train_wall_s']:.0f} s "
        f"({report['total_cpu_s']:.0f} CPU-s)"
    )
    print(f"report:     {output / 'report.md'} (and report.json)")
    print(f"curves:     {report['curves']}")
    print(f"checkpoint: {report['checkpoint']} (training state), {weights} (weights + class names)")
    example = sorted((output / "data" / "val" / "7").glob("*.png"))[:1]
    if example:
        print(f"try:        cgavit predict {example[0]} --checkpoint {weights}")
    return report


def _children_cpu() -> float:
    import resource

    use = resource.getrusage(resource.RUSAGE_CHILDREN)
    return use.ru_utime + use.ru_stime


def _markdown(r: dict) -> str:
    return f"""# cgavit demo: handwritten digits

| | |
|---|---|
| data | {r['dataset']}; {r['split']['train']} train / {r['split']['val']} held-out images, 10 classes |
| model | {r['model']} ({r['params'] / 1e3:.0f} k parameters) |
| training | {r['epochs']} epochs, {r['train_wall_s']:.0f} s wall on {r['torch_threads']} torch thread(s) + 1 loader worker; {r['total_cpu_s']:.0f} CPU-seconds in all |
| **held-out top-1** | **{r['held_out_top1']:.2f}%** (final weights; the held-out split picked nothing) |
| held-out top-5 | {r['held_out_top5']:.2f}% |
| held-out loss | {r['held_out_loss']:.4f} |

![training curves](run/curves.png)

Files: `{r['checkpoint']}` (training checkpoint), `{r['weights']}` (weights with class names),
`{r['metrics']}` (one JSON line per epoch).

Reproduce: `{r['command']}`
"""
