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
import re
import resource
import shlex
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from ..factory import load_model
from ..bounds import check_threads
from ..io import DataError, make_folder, read_json_record, write_json, write_text
from .config import TrainConfig, TrainResult
from .distributed import DistEnv, RunLock, launched_world
from .engine import train
from .inference import evaluate_checkpoint, export_weights

log = logging.getLogger(__name__)

IMG_SIZE = 64
# a reduced efficientvit_m0: stage widths 32/48/64 (paper 64/128/192), one sandwich block per stage
# (paper 1/2/3), two heads per stage (paper 4), query kernels 5,5. Cascade, group split, sandwich
# layout and narrow Q/K (16) are the paper's.
DEMO_DIALS = {"embed_dim": (32, 48, 64), "depth": (1, 1, 1), "num_heads": (2, 2, 2), "kernels": (5, 5)}
DEMO_EPOCHS = 15
DIGITS_MEAN = (0.3, 0.3, 0.3)
DIGITS_STD = (0.4, 0.4, 0.4)
#: How the demo names a digit image: its index among scikit-learn's digits.
_DEMO_NAME = re.compile(r"[0-9]{4}\.png")


def write_digits(root: str | Path, val_fraction: float = 0.2, seed: int = 0) -> dict:
    """Write scikit-learn's digits as ``root/{train,val}/<digit>/<n>.png`` (8x8 grayscale PNGs).

    The split is stratified by class with a fixed seed (``seed`` modulo 2**32, as scikit-learn takes it); an existing, complete folder of the same split is
    reused. Any other split there (another seed or fraction, a write that was stopped, images removed or added since)
    is replaced: its images are removed first, so no image of one split's training set is among another's held-out
    ones. What the demo did not write there (a class folder that is no digit, a file among the digits) is refused, and
    nothing of it is removed.

    Returns:
        ``{"train": n_train, "val": n_val, "classes": ["0", ..., "9"]}``.
    """
    # scikit-learn is imported here, its one place: it is slow to import and only the demo needs it
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    root = make_folder(root, "demo data folder")  # a file there: one line, not a traceback from SPLIT.json's unlink
    digits = load_digits()
    images = np.clip(np.round(digits.images * (255.0 / 16.0)), 0, 255).astype(np.uint8)  # (1797, 8, 8)
    labels = digits.target
    idx_train, idx_val = train_test_split(  # scikit-learn takes seeds below 2**32, --seed up to 2**63 - 1
        np.arange(len(labels)), test_size=val_fraction, random_state=seed % 2**32, stratify=labels
    )
    classes = [str(c) for c in range(10)]
    marker = root / "SPLIT.json"
    summary = {"train": len(idx_train), "val": len(idx_val), "classes": classes, "seed": seed, "val_fraction": val_fraction}
    expected = {(split, c): set() for split in ("train", "val") for c in classes}
    for split, idx in (("train", idx_train), ("val", idx_val)):
        for i in idx:
            expected[split, str(labels[i])].add(f"{i:04d}.png")
    _check_only_digits(root, classes)
    if _recorded_split(marker) == summary and _holds(root, expected):
        return summary
    marker.unlink(missing_ok=True)  # until the new split is whole, the folder holds no split
    for split, idx in (("train", idx_train), ("val", idx_val)):
        for c in classes:
            for earlier in make_folder(root / split / c, "demo data folder").glob("[0-9][0-9][0-9][0-9].png"):
                earlier.unlink()  # an earlier split's image (the names are the demo's own: _check_only_digits)
        for i in idx:
            Image.fromarray(images[i], mode="L").save(root / split / str(labels[i]) / f"{i:04d}.png")
    write_text(marker, json.dumps(summary))
    return summary


def _recorded_split(marker: Path) -> dict | None:
    """The split the demo's ``SPLIT.json`` records; None where there is none, or one damaged (a hand's edit): the
    split is then written again, as after a stopped write (a damaged one stopped the demo with 'Expecting ...')."""
    if not marker.is_file():
        return None
    try:
        return read_json_record(marker)
    except DataError:
        return None


def _holds(root: Path, expected: dict[tuple[str, str], set[str]]) -> bool:
    """Whether each ``root/split/class`` folder holds exactly the images ``expected`` names (none removed, none
    added since the split was written)."""
    def names(folder: Path) -> set[str]:
        return {p.name for p in folder.iterdir() if not p.name.startswith(".")} if folder.is_dir() else set()

    return all(names(root / split / c) == want for (split, c), want in expected.items())


def _check_only_digits(root: Path, classes: list[str]) -> None:
    """Refuse what the demo did not write in its data folder, which training would learn too: class folders the
    digits have not, and files among the digits not named as the demo names them (nothing of them is removed); and a
    ``SPLIT.json`` that is no file, which the demo cannot replace."""
    if (root / "SPLIT.json").exists() and not (root / "SPLIT.json").is_file():
        raise ValueError(f"the demo's data folder {root} holds a SPLIT.json that is no file (a folder?), where the demo "
                         "records its split; move it away, or give the demo another --output")
    for split in ("train", "val"):
        folder = root / split
        entries = [p for p in folder.iterdir() if not p.name.startswith(".")] if folder.is_dir() else []
        other = sorted(p.name for p in entries if p.is_dir() and p.name not in classes)
        other += sorted(str(f.relative_to(folder)) for p in entries if p.is_dir() and p.name in classes
                        for f in p.iterdir() if not f.name.startswith(".") and not _DEMO_NAME.fullmatch(f.name))
        if other:
            raise ValueError(f"the demo's data folder {folder} holds what the demo did not write ({', '.join(other[:5])}): "
                             "training would learn it too; move it away, or give the demo another --output")


def demo_config(
    data: str | Path, output: str | Path, epochs: int = DEMO_EPOCHS, seed: int = 0, progress: bool | None = None
) -> TrainConfig:
    """The training the demo runs (the small-data recipe).

    Changes from the ImageNet recipe, for 1437 tiny grayscale images: 64 px; no horizontal flip
    (digits are not mirror-symmetric); crops of 60-100% of the area; a milder RandAugment (m6);
    no mixup/cutmix and no repeated augmentation; batch 64 at lr 2e-3 with a one-epoch warm-up (none for a
    one-epoch run), stepped every update; no EMA (0.99996 needs far more updates than 300); centre crop 1.0.
    """
    return TrainConfig(
        data=str(data), output=str(output), model="efficientvit_m0", dials=dict(DEMO_DIALS), img_size=IMG_SIZE,
        crop_pct=1.0, epochs=epochs, batch_size=64, lr=2e-3, warmup_epochs=min(1, epochs - 1), sched_on_updates=True,
        aa="rand-m6-mstd0.5", hflip=0.0, scale=(0.6, 1.0), reprob=0.1, mixup=0.0, cutmix=0.0, aug_repeats=0,
        model_ema=False, mean=DIGITS_MEAN, std=DIGITS_STD, seed=seed, workers=1, log_interval=10, progress=progress,
    )


#: What a demo's run folder holds, removed when a new demo starts there.
DEMO_RUN_FILES = ("last.pt", "best.pt", "best.safetensors", "metrics.jsonl", "curves.png", "train.log",
                  "model.safetensors")


def run_demo(
    output: str | Path = "runs/demo",
    epochs: int | None = None,
    threads: int | None = None,
    seed: int = 0,
    progress: bool | None = None,
    say: Callable[[str], object] = log.info,
) -> dict:
    """Write the digits, train, evaluate, report.

    Args:
        output: folder for data, checkpoints, report and curves; an earlier demo there is replaced.
        epochs: training epochs (default 15).
        threads: torch intra-op threads (default: one less than the cores, at most 4: one loader
            worker prepares batches beside the training).
        seed: seed for the split and the training.
        progress: progress bar (default: when stderr is a terminal).
        say: where the line about the data goes before training starts (``print`` for a command).

    Returns:
        The report (also in ``report.json``), or, when the training was stopped by a signal, the
        training's :meth:`~cgavit.train.TrainResult.to_dict` (``"interrupted"`` true; continue it
        with ``cgavit train --resume`` its ``"last"``).

    Raises:
        ValueError: started as several processes (``torchrun --nproc_per_node N``), or an ``output`` that is a file.
    """
    output = Path(output)
    if launched_world() > 1:  # each process would take the demo's folder for another run's (its sibling's)
        raise ValueError(f"cgavit demo runs as one process, and torchrun started {launched_world()}: run it without "
                         f"torchrun; the digits it writes to {output / 'data'} can then be trained on by several "
                         f"(torchrun ... -m cgavit train --data {output / 'data'})")
    if output.exists() and not output.is_dir():
        raise ValueError(f"--output {output} is not a folder; give a folder for the demo's data and run")
    if threads is not None:
        check_threads(threads)
    run_dir = output / "run"
    cfg = demo_config(output / "data", run_dir, DEMO_EPOCHS if epochs is None else epochs, seed, progress)
    cfg.validate()
    with RunLock(make_folder(output, "demo folder"), DistEnv()):  # a second demo stops here, touching nothing
        return _locked_demo(output, cfg, threads, seed, say)


def _locked_demo(output: Path, cfg: TrainConfig, threads: int | None, seed: int, say: Callable[[str], object]) -> dict:
    """:func:`run_demo` in its folder, which it holds: the earlier demo's files go first (the demo owns the
    folder), so a stopped demo leaves no report of another."""
    run_dir = Path(cfg.output)
    t0, cpu0, children0 = time.perf_counter(), time.process_time(), _children_cpu()
    split = write_digits(output / "data", seed=seed)  # first: data it refuses leaves the earlier demo's files as they were
    results = [run_dir / name for name in DEMO_RUN_FILES] + [output / "report.json", output / "report.md"]
    earlier = [path for path in results if path.exists()]
    if earlier:  # said before they go, so that a second demo is not found to have replaced the first afterwards
        say(f"replacing the earlier demo's results in {output} (checkpoints, report, curves)")
    for path in earlier:
        path.unlink(missing_ok=True)
    old_threads = torch.get_num_threads()
    threads = threads or max(1, min(4, (os.cpu_count() or 2) - 1))
    torch.set_num_threads(threads)
    try:
        say(f"digits: {split['train']} train / {split['val']} held-out images, 10 classes -> {output / 'data'}")
        result = train(cfg)
        if result.interrupted:
            return result.to_dict()
        weights = export_weights(run_dir / "last.pt", run_dir / "model.safetensors")
        held_out = evaluate_checkpoint(output / "data", run_dir / "last.pt", split="val", workers=0, device="cpu")
    finally:
        torch.set_num_threads(old_threads)
    cost = {
        "total_wall_s": round(time.perf_counter() - t0, 1),
        "total_cpu_s": round(time.process_time() - cpu0 + _children_cpu() - children0, 1),  # with its loader workers
        "cpu_cores": os.cpu_count(),
        "torch_threads": threads,
    }
    report = _report(cfg, split, result, held_out, weights, cost)
    write_json(output / "report.json", report, indent=1)
    write_text(output / "report.md", _markdown(report))
    return report


def _report(cfg: TrainConfig, split: dict, result: TrainResult, held_out: dict, weights: Path, cost: dict) -> dict:
    run_dir = Path(cfg.output)
    return {
        "dataset": "scikit-learn load_digits (UCI handwritten digits), 8x8 upscaled to 64x64",
        "split": split,
        "model": "efficientvit_m0 with dials " + shlex.join(TrainConfig(dials=DEMO_DIALS).to_argv()),
        "params": sum(p.numel() for p in load_model(weights)[0].parameters()),
        "epochs": result.epochs,
        "held_out_top1": held_out["top1"],
        "held_out_top5": held_out["top5"],
        "held_out_loss": held_out["loss"],
        "held_out_images": held_out["n"],
        "best_epoch_top1": result.best_top1,
        "train_wall_s": result.wall_s,
        **cost,
        "checkpoint": str(run_dir / "last.pt"),
        "weights": str(weights),
        "curves": str(run_dir / "curves.png"),
        "metrics": str(run_dir / "metrics.jsonl"),
        "command": shlex.join(["cgavit", "train", *replace(cfg, progress=None).to_argv()]),  # pasted into a shell
    }


def _epochs(n: int) -> str:
    return f"{n} epoch" if n == 1 else f"{n} epochs"


def summary_lines(report: dict, output: str | Path) -> list[str]:
    """What ``cgavit demo`` prints after a finished demo: the held-out result and where the files are."""
    output = Path(output)
    lines = [
        f"\nheld-out top-1 {report['held_out_top1']:.2f}% ({report['held_out_images']} images never trained on, final "
        f"weights), top-5 {report['held_out_top5']:.2f}%, {_epochs(report['epochs'])} in {report['train_wall_s']:.0f} s "
        f"({report['total_cpu_s']:.0f} CPU-s)",
        f"report:     {output / 'report.md'} (and report.json)",
        f"curves:     {report['curves']}",
        f"checkpoint: {report['checkpoint']} (training state), {report['weights']} (weights + class names)",
    ]
    example = sorted((output / "data" / "val" / "7").glob("*.png"))[:1]
    if example:
        command = ["cgavit", "predict", str(example[0]), "--checkpoint", str(report["weights"])]
        lines.append(f"try:        {shlex.join(command)}")  # pasted into a shell: paths with spaces quoted
    return lines


def _children_cpu() -> float:
    use = resource.getrusage(resource.RUSAGE_CHILDREN)
    return use.ru_utime + use.ru_stime


def _markdown(r: dict) -> str:
    return f"""# cgavit demo: handwritten digits

| | |
|---|---|
| data | {r['dataset']}; {r['split']['train']} train / {r['split']['val']} held-out images, 10 classes |
| model | {r['model']} ({r['params'] / 1e3:.0f} k parameters) |
| training | {_epochs(r['epochs'])}, {r['train_wall_s']:.0f} s wall on {r['torch_threads']} torch thread(s) + 1 loader worker; {r['total_cpu_s']:.0f} CPU-seconds in all |
| **held-out top-1** | **{r['held_out_top1']:.2f}%** (final weights; the held-out split picked nothing) |
| held-out top-5 | {r['held_out_top5']:.2f}% |
| held-out loss | {r['held_out_loss']:.4f} |

![training curves](run/curves.png)

Files: `{r['checkpoint']}` (training checkpoint), `{r['weights']}` (weights with class names),
`{r['metrics']}` (one JSON line per epoch).

Reproduce: `{r['command']}`
"""
