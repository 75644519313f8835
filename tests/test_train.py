"""Training engine: resume equivalence, bad data, corrupt checkpoints, distillation, fine-tuning."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from cgavit.train import TrainConfig, train
from cgavit.train import checkpoint as ckpt_io
from cgavit.io import DataError
from cgavit.train.data import BadImageError, check_layout, list_split
from cgavit.io import CheckpointError
from cgavit.train.distributed import DistEnv, RunLock

TINY = dict(
    img_size=32, dials=dict(embed_dim=(16, 32, 48), depth=(1, 1, 1), num_heads=(2, 2, 2), kernels=(3, 3)),
    batch_size=4, workers=0, warmup_epochs=1, lr=3e-3, log_interval=1000, progress=False,
)
TINY_ARGV = TrainConfig(**TINY).to_argv()  # the same options as `cgavit train` flags


def tiny(**options) -> TrainConfig:
    """A tiny, fast run: TINY with ``options`` over it."""
    return TrainConfig(**{**TINY, **options})


def make_folder(root: Path, classes: int = 3, train: int = 6, val: int = 3, size: int = 36, seed: int = 0) -> Path:
    """A tiny image-folder dataset: class c is tinted in channel c."""
    rng = np.random.default_rng(seed)
    for split, n in (("train", train), ("val", val)):
        for c in range(classes):
            d = root / split / f"class_{c}"
            d.mkdir(parents=True, exist_ok=True)
            for i in range(n):
                a = (rng.random((size, size, 3)) * 90).astype(np.uint8)
                a[..., c % 3] += 120
                Image.fromarray(a).save(d / f"{i}.png")
    return root


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return make_folder(tmp_path_factory.mktemp("ds"))


def _weights(path: Path) -> dict[str, torch.Tensor]:
    return torch.load(path, map_location="cpu", weights_only=True)["model"]


def _child(script: str, *args: str) -> subprocess.CompletedProcess:
    """``script`` run by this Python in a process of its own (one thread), with ``args``; its output kept."""
    return subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})


# the run of test_a_closed_terminal_saves_the_run, in a process of its own: SIGHUP's default action there, as in
# a terminal; a real hang-up (kill) to the process after its second update; what train() returned, on stdout
_HANG_UP_CHILD = """
import ast, json, os, signal, sys
from torch.optim.optimizer import register_optimizer_step_post_hook
from cgavit.train import TrainConfig, train

signal.signal(signal.SIGHUP, signal.SIG_DFL)
updates = 0

def after_step(optimizer, args, kwargs):
    global updates
    updates += 1
    if updates == 2:
        os.kill(os.getpid(), signal.SIGHUP)

register_optimizer_step_post_hook(after_step)
result = train(TrainConfig(**ast.literal_eval(sys.argv[1])))
print(json.dumps({"interrupted": result.interrupted, "default_back": signal.getsignal(signal.SIGHUP) == signal.SIG_DFL}))
"""


@pytest.mark.skipif(not hasattr(signal, "SIGHUP"), reason="no SIGHUP on this platform")
def test_a_closed_terminal_saves_the_run(data, tmp_path):
    """SIGHUP (the terminal the run was started from closed) stops it like SIGTERM: last.pt is saved
    at the update reached, and the run resumes from there; before, the default action killed it.

    The run is a child process: without the engine's handler the hang-up kills the child (the test fails
    saying so), never the test worker (CI lost an xdist worker in an in-process version of this test)."""
    out = tmp_path / "hup"
    options = {**TINY, "data": str(data), "epochs": 2, "output": str(out)}
    proc = _child(_HANG_UP_CHILD, repr(options))
    assert proc.returncode != -signal.SIGHUP, "the hang-up killed the run: no SIGHUP handler in the engine"
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result == {"interrupted": True, "default_back": True}  # stopped, and the run's handler is gone after it
    ck = ckpt_io.load(out / "last.pt")
    assert (ck["next_epoch"], ck["next_step"]) == (0, 2)


@pytest.mark.skipif(not hasattr(signal, "SIGHUP"), reason="no SIGHUP on this platform")
def test_a_run_under_nohup_outlives_the_terminal(data, tmp_path):
    """A SIGHUP the process ignores when the run starts (``nohup cgavit train``) stays ignored: one
    arriving after the second update leaves the run going to its end."""
    from torch.optim.optimizer import register_optimizer_step_post_hook

    steps = []

    def hang_up(optimizer, args, kwargs) -> None:
        steps.append(signal.getsignal(signal.SIGHUP))
        if len(steps) == 2:
            signal.raise_signal(signal.SIGHUP)

    before = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    handle = register_optimizer_step_post_hook(hang_up)
    try:
        result = train(tiny(data=str(data), epochs=1, output=str(tmp_path / "nohup")))
    finally:
        handle.remove()
        signal.signal(signal.SIGHUP, before)
    assert not result.interrupted and len(steps) > 2 and set(steps) == {signal.SIG_IGN}


# the resumed side of test_resume_equals_uninterrupted, in a process of its own: a real SIGTERM to the process
# after the 4th update (the end of epoch 1); resumed, another after 2 more (mid-epoch 2); resumed with two loader
# workers to the end. What each train() returned and where its last.pt stands, on stdout
_STOPPED_TWICE_CHILD = """
import ast, json, signal, sys
from torch.optim.optimizer import register_optimizer_step_post_hook
from cgavit.train import TrainConfig, train
from cgavit.train import checkpoint as ckpt_io

options, last = ast.literal_eval(sys.argv[1]), sys.argv[2]
updates, stop_at = 0, [4, 2, None]

def after_step(optimizer, args, kwargs):
    global updates
    updates += 1
    if updates == stop_at[0]:
        signal.raise_signal(signal.SIGTERM)

register_optimizer_step_post_hook(after_step)
rows = []
for workers in (None, 0, 2):  # the first run, then two resumes of it
    updates = 0
    result = train(TrainConfig(**options) if workers is None else TrainConfig.resume_from(last, workers=workers))
    ck = ckpt_io.load(last)
    rows.append({"interrupted": result.interrupted, "epochs": result.epochs, "signal": result.signal,
                 "at": [ck["next_epoch"], ck["next_step"]], "rng": len(ck["rng"]), "seed": ck["args"]["seed"],
                 "loss": result.final_loss})
    stop_at.pop(0)
print(json.dumps(rows))
"""


def test_resume_equals_uninterrupted(data, tmp_path, one_thread):
    """Stopped by SIGTERM twice (the end of epoch 1, then mid-epoch 2) and resumed each time, a run ends
    with the weights, EMA, loss and records of the same run uninterrupted.

    The stopped runs are a child process (real signals there; a missing handler kills the child and the
    test says so), never the test worker: CI lost an xdist worker, with no traceback, in the in-process
    version of this test and of the closed-terminal one."""
    # every RNG consumer on: RandAugment, random erasing, mixup/cutmix, drop path, EMA; a worker process
    common = dict(data=str(data), epochs=3, drop_path=0.1, seed=3)
    full = train(tiny(**common, output=str(tmp_path / "full")))  # one thread, as the child: the same sums
    assert full.epochs == 3 and not full.interrupted
    out = tmp_path / "resumed"
    options = {**TINY, **common, "output": str(out)}
    proc = _child(_STOPPED_TWICE_CHILD, repr(options), str(out / "last.pt"))
    assert proc.returncode != -signal.SIGTERM, "SIGTERM killed the run: no SIGTERM handler in the engine"
    assert proc.returncode == 0, proc.stderr[-3000:]
    first, second, last = json.loads(proc.stdout.strip().splitlines()[-1])
    stopped = {"interrupted": True, "signal": signal.SIGTERM, "rng": 1, "seed": 3}
    assert first.items() >= {**stopped, "epochs": 1, "at": [1, 0]}.items(), first
    assert second.items() >= {**stopped, "at": [1, 2]}.items(), second  # mid-epoch 2
    assert last["epochs"] == 3 and not last["interrupted"] and last["at"] == [3, 0], last  # any worker count
    a, b = _weights(tmp_path / "full" / "last.pt"), _weights(out / "last.pt")
    for key in a:
        torch.testing.assert_close(b[key], a[key], rtol=1e-5, atol=1e-6, msg=key)
    ema_a = torch.load(tmp_path / "full" / "last.pt", weights_only=True)["model_ema"]
    ema_b = torch.load(out / "last.pt", weights_only=True)["model_ema"]
    for key in ema_a:
        torch.testing.assert_close(ema_b[key], ema_a[key], rtol=1e-5, atol=1e-6)
    assert abs(last["loss"] - full.final_loss) < 1e-5
    rows = [line for line in (out / "metrics.jsonl").read_text().splitlines() if line]
    assert len(rows) == 3  # one line per epoch, none duplicated by the resumes
    assert (out / "curves.png").stat().st_size > 1000



# `cgavit train` with two loader workers, in a session of its own: after its second update, SIGTERM to its whole
# process group, as `timeout`, a job scheduler or `kill -- -PGID` send it (the workers get it too)
_GROUP_TERMINATED_CHILD = """
import ast, os, signal, subprocess, sys, time
from torch.optim.optimizer import register_optimizer_step_post_hook
from cgavit.cli import main

updates = 0

def after_step(optimizer, args, kwargs):
    global updates
    updates += 1
    if updates == 2:
        subprocess.run(["kill", "-TERM", "--", f"-{os.getpgrp()}"])  # from another process, as timeout's
        time.sleep(2)  # the workers' fate is known before the run goes on (as while it waits for a batch)

register_optimizer_step_post_hook(after_step)
sys.exit(main(ast.literal_eval(sys.argv[1])))
"""


def test_a_process_group_terminated_mid_run_saves_it(data, tmp_path):
    """The loader workers got the group's SIGTERM too, died of it (torch's worker handler ends a worker on a
    SIGTERM its parent did not send), and torch raised "DataLoader worker ... killed by signal" in the run while it
    saved: a traceback and exit 1 instead of last.pt, "stopped" and exit 143."""
    out = tmp_path / "run"
    argv = ["train", "--data", str(data), *TINY_ARGV, "--epochs", "2", "--workers", "2", "--output", str(out)]
    proc = subprocess.run([sys.executable, "-c", _GROUP_TERMINATED_CHILD, repr(argv)], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"}, start_new_session=True)
    assert proc.returncode == 128 + signal.SIGTERM, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "killed by signal" not in proc.stderr, proc.stderr[-3000:]
    assert proc.stderr.count("received SIGTERM") == 1, proc.stderr[-3000:]  # the run's, not once more per worker
    assert ckpt_io.load(out / "last.pt")["next_step"] == 2

def test_the_start_line_says_1_epoch_and_the_epoch_line_no_top5_of_3_classes(tmp_path, caplog, monkeypatch):
    """The run's first log line said '1 epochs' (the demo's summary had been mended, this line not); its epoch line
    and curves.png gave a top-5 of 100 % for 3 classes, where eval says 'top-5 n/a (3 classes)'."""
    import matplotlib.pyplot as plt

    figures = []
    monkeypatch.setattr(plt, "close", figures.append)  # keep the figure to look at it
    root = make_folder(tmp_path / "ds")
    with caplog.at_level(logging.INFO, logger="cgavit"):
        train(tiny(data=str(root), epochs=1, workers=0, output=str(tmp_path / "run")))
    assert f", 1 epoch -> {tmp_path / 'run'}" in caplog.text, caplog.text
    assert "top-5 n/a (3 classes)" in caplog.text and "top-5 100" not in caplog.text, caplog.text
    (curves,) = figures
    assert [line.get_label() for line in curves.axes[1].get_lines()] == ["top-1"]
    monkeypatch.undo()
    plt.close(curves)


def test_the_curves_mark_whole_epochs(tmp_path, monkeypatch):
    """A one-epoch run's curves.png had its epoch axes ticked 0.96, 0.98, 1.00, 1.02, 1.04."""
    import matplotlib.pyplot as plt

    from cgavit.train import records

    figures = []
    monkeypatch.setattr(plt, "close", figures.append)  # keep the figure to look at it
    for epochs in (1, 3, 40):
        rows = [dict(epoch=e, train_loss=2.0, val_loss=2.1, val_top1=20.0, val_top5=50.0, lr=1e-4) for e in range(epochs)]
        records.plot_curves(rows, tmp_path / "curves.png")
        fig = figures.pop()
        for ax in fig.axes:
            lo, hi = ax.get_xlim()
            ticks = [t for t in ax.get_xticks() if lo <= t <= hi]
            assert ticks and all(float(t).is_integer() for t in ticks), (epochs, ax.get_title(), ticks)
        monkeypatch.undo()
        plt.close(fig)
        monkeypatch.setattr(plt, "close", figures.append)


def test_train_says_how_to_use_the_weights_it_wrote(tmp_path, capsys):
    """cgavit train printed its JSON result and stopped; on stderr (stdout stays the JSON alone) it now gives the
    commands that use best.safetensors, as the demo does, and they parse as written."""
    import shlex

    from cgavit.cli import build_parser, main

    root, out = make_folder(tmp_path / "my data"), tmp_path / "run"
    assert main(["train", "--data", str(root), *TINY_ARGV, "--epochs", "1", "--output", str(out)]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["weights"] == str(out / "best.safetensors")
    (line,) = [x for x in captured.err.splitlines() if x.startswith("try:")]
    evaluate, predict = (build_parser().parse_args(shlex.split(p)[1:]) for p in line[len("try:"):].split("   or   "))
    assert (evaluate.checkpoint, evaluate.data) == (str(out / "best.safetensors"), str(root))
    assert (predict.images, predict.checkpoint) == (["IMAGE"], str(out / "best.safetensors"))


def test_unreadable_images_are_skipped_and_counted(tmp_path, caplog):
    root = make_folder(tmp_path / "ds")
    (root / "train" / "class_0" / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n not really a png")
    (root / "val" / "class_1" / "cut.jpg").write_bytes(b"\xff\xd8\xff\xe0" + b"\x00" * 20)
    args = dict(data=str(root), epochs=1, workers=2, mixup=0, cutmix=0)
    with caplog.at_level(logging.WARNING, logger="cgavit"):
        res = train(tiny(**args, output=str(tmp_path / "run")))
    assert res.skipped_images == 2
    assert "broken.png" in caplog.text and "cut.jpg" in caplog.text
    assert "broken.png: cannot identify an image format" in caplog.text  # why, not only which
    row = (tmp_path / "run" / "metrics.jsonl").read_text()
    assert '"skipped_images": 2' in row
    with pytest.raises(BadImageError, match="broken.png|cut.jpg"):
        train(tiny(**{**args, "workers": 0}, output=str(tmp_path / "strict"), strict=True))


def test_strict_reads_the_validation_split_before_training(tmp_path, monkeypatch):
    """With --strict a truncated validation image stopped the run at the first evaluation: after a whole epoch of
    training, which was lost (no last.pt). It is now read before the first update (every rank its share)."""
    from cgavit.train import engine

    root = make_folder(tmp_path / "ds", classes=2, train=4, val=2)
    cut = root / "val" / "class_0" / "1.png"
    cut.write_bytes(cut.read_bytes()[:60])  # class_0 keeps a readable image: the per-class check lets it pass
    epochs, real = [], engine.train_one_epoch
    monkeypatch.setattr(engine, "train_one_epoch", lambda run, epoch, *args: epochs.append(epoch) or real(run, epoch, *args))
    out = tmp_path / "run"
    with pytest.raises(BadImageError, match=f"cannot read image {cut}: image file is truncated .run without --strict"):
        train(tiny(data=str(root), epochs=1, output=str(out), mixup=0, cutmix=0, strict=True))
    assert epochs == [] and not out.exists()  # refused at the start: no epoch, and the run's new folder removed


@pytest.mark.parametrize("split", ["train", "val"])
def test_a_class_with_no_readable_image_stops_the_run_before_training(tmp_path, split):
    """A class whose only images cannot be read is refused like a class with no image, before any
    update; the line names the class. (Classes that keep one readable image still train.)"""
    root = make_folder(tmp_path / "ds", classes=3, train=4, val=2)
    for f in (root / split / "class_1").iterdir():
        f.write_bytes(f.read_bytes()[:60])  # truncated: the header opens, the pixels do not
    (root / split / "class_2" / "0.png").write_bytes(b"not an image")  # class_2 keeps readable ones
    out = tmp_path / "run"
    with pytest.raises(DataError) as err:
        train(tiny(data=str(root), epochs=1, output=str(out), mixup=0, cutmix=0))
    assert str(err.value).startswith(f"1 class folder(s) in {root / split} hold no image that could be read (class_1); e.g. ")
    assert "image file is truncated" in str(err.value)  # what was wrong with one of them
    assert not (out / "last.pt").exists() and not (out / "metrics.jsonl").exists() and not (out / "run.lock").exists()


def test_layout_problems_reported_before_training(tmp_path):
    root = make_folder(tmp_path / "ds", classes=2, train=2, val=1)
    (root / "train" / "empty_class").mkdir()
    with pytest.raises(ValueError, match="empty_class"):
        check_layout(root)
    (root / "train" / "empty_class").rmdir()
    with pytest.raises(ValueError, match="does not exist"):
        train(tiny(data=str(root), val_split="test", output=str(tmp_path / "r")))
    for blank in ("", " "):  # "" read the dataset's train/ and val/ folders as two classes
        with pytest.raises(ValueError, match="a split must name a folder inside"):
            train(tiny(data=str(root), train_split=blank, output=str(tmp_path / "r")))
    assert not (tmp_path / "r").exists()


def test_a_pipe_in_a_class_folder_is_named_as_left_out(tmp_path, caplog):
    """A pipe (or socket, or device) named like an image was dropped from the split without a word."""
    root = make_folder(tmp_path / "ds", classes=2, train=2, val=1)
    os.mkfifo(root / "train" / "class_0" / "7.png")
    with caplog.at_level(logging.WARNING, logger="cgavit"):
        layout = check_layout(root)
    assert len(layout["train"]) == 4
    assert "1 file(s) in" in caplog.text and "no regular files" in caplog.text and "7.png" in caplog.text, caplog.text


def test_a_class_folder_linked_to_a_folder_above_it_is_refused(tmp_path):
    """val/other -> .. made every image of the split count twice, once under its class and once as 'other': eval said
    46 images and top-1 50 % on 23 images it classified right."""
    root = make_folder(tmp_path / "ds", classes=2, train=2, val=1)
    os.symlink("..", root / "val" / "other")
    with pytest.raises(DataError, match="class folders 'class_0' and 'other' of .* both reach the images of"):
        list_split(root, "val")
    os.unlink(root / "val" / "other")
    os.symlink("class_1", root / "val" / "also_1")  # another class's folder under a second name
    with pytest.raises(DataError, match="'also_1' and 'class_1'"):
        list_split(root, "val")
    (root / "val" / "also_1").unlink()
    assert len(list_split(root, "val")[1]) == 2


def test_files_a_split_leaves_out_are_warned_about_and_linked_val_folders_refused(tmp_path, caplog):
    root = make_folder(tmp_path / "ds", classes=2, train=2, val=1)
    (root / "train" / "loose.JPG").write_bytes((root / "train" / "class_0" / "0.png").read_bytes())
    os.symlink(root / "gone.png", root / "train" / "class_0" / "dangling.png")
    os.symlink("l2.png", root / "train" / "class_1" / "l1.png")
    os.symlink("l1.png", root / "train" / "class_1" / "l2.png")
    os.symlink(root / "gone", root / "train" / "bird")  # a class folder's link to nothing: not a loose file
    (root / "train" / "README.txt").write_text("not an image: not warned about")
    with caplog.at_level(logging.WARNING, logger="cgavit"):
        layout = check_layout(root)
    assert len(layout["train"]) == 4  # these were dropped without a word
    assert "1 image(s) directly in" in caplog.text and "loose.JPG" in caplog.text and "README" not in caplog.text
    assert "4 link(s) in" in caplog.text and "dangling.png" in caplog.text
    for c in ("class_0", "class_1"):  # each val class folder a link to train's: every val image a training image
        (root / "val2" / c).parent.mkdir(exist_ok=True)
        os.symlink(root / "train" / c, root / "val2" / c)
    with pytest.raises(DataError, match="reaches images of --train-split 'train' through links"):
        check_layout(root, val_split="val2")


def test_class_folders_are_matched_across_unicode_forms(tmp_path):
    """A folder named in decomposed form (as macOS stores names) was another class than the same name composed."""
    import unicodedata

    from cgavit.classes import check_classes, model_indices
    from cgavit.factory import ModelInfo
    from cgavit.train.data import list_split

    composed, decomposed = "caf\u00e9", unicodedata.normalize("NFD", "caf\u00e9")
    root = make_folder(tmp_path / "ds", classes=3, train=1, val=1)
    (root / "train" / "class_1").rename(root / "train" / composed)
    (root / "val" / "class_1").rename(root / "val" / decomposed)
    for split in ("train", "val"):  # "caff" sorts before "café" composed and after it decomposed
        (root / split / "class_2").rename(root / split / "caff")
    layout = check_layout(root)
    assert layout["classes"] == ["caff", composed, "class_0"]
    info = ModelInfo(class_names=["class_0", decomposed, "caff"], names_recorded=True)  # a checkpoint trained on a Mac
    classes, _ = list_split(root, "val")
    check_classes(root / "val", classes, info, 3)
    assert model_indices(classes, info).tolist() == [2, 1, 0]
    # a run an earlier cgavit started indexed the folders as stored (decomposed "café" before "caff"): resumed, its own
    # order is kept (a new order was refused as "other classes"); an order of other classes is not taken
    earlier = [decomposed, "caff", "class_0"]
    assert check_layout(root, order=earlier)["classes"] == [composed, "caff", "class_0"]
    assert check_layout(root, order=["caff", "x", "class_0"])["classes"] == ["caff", composed, "class_0"]
    os.mkdir(root / "val" / composed)
    with pytest.raises(DataError, match="the same name in two Unicode forms"):
        list_split(root, "val")


def test_corrupt_checkpoint_refused_and_left_alone(data, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    with RunLock(run, DistEnv()):  # a live run holds the folder (here this process, through another open file)
        with pytest.raises(ValueError, match=rf"another run \(pid {os.getpid()}\)"):
            train(tiny(data=str(data), epochs=1, output=str(run)))
    (run / "run.lock").write_text("999999999")  # left by a process that is gone: taken over
    train(tiny(data=str(data), epochs=1, output=str(run)))
    assert not (run / "run.lock").exists()
    good = (run / "last.pt").read_bytes()
    (run / "last.pt").write_bytes(good[: len(good) // 2])  # truncated by a crash mid-copy
    before = {p.name: p.stat().st_mtime_ns for p in run.iterdir()}
    with pytest.raises(CheckpointError, match="truncated|corrupt"):
        train(TrainConfig.resume_from(run / "last.pt"))
    assert {p.name: p.stat().st_mtime_ns for p in run.iterdir()} == before
    (run / "garbage.pt").write_bytes(b"\x00" * 100)
    with pytest.raises(CheckpointError):
        ckpt_io.load(run / "garbage.pt")
    # a fresh run refuses to overwrite a folder that holds one
    with pytest.raises(ValueError, match="already holds a run"):
        train(tiny(data=str(data), epochs=1, output=str(run)))
    # ... even one whose last.pt the user deleted (best.* were overwritten), and a resumed run refuses another
    # run's folder (it replaced last.pt and appended to metrics.jsonl)
    (run / "last.pt").write_bytes(good)
    other = tmp_path / "other"
    other.mkdir()
    for name in ("best.pt", "best.safetensors"):
        (other / name).write_bytes((run / name).read_bytes())
    before = {p.name: p.read_bytes() for p in other.iterdir()}
    with pytest.raises(ValueError, match=r"already holds a run \(best.pt, best.safetensors\); choose another"):
        train(tiny(data=str(data), epochs=1, output=str(other)))
    with pytest.raises(ValueError, match="already holds a run"):  # epochs left to train: else refused as finished
        train(TrainConfig.resume_from(run / "last.pt", output=str(other), epochs=2))
    assert {p.name: p.read_bytes() for p in other.iterdir()} == before


CLASSES = ["class_0", "class_1", "class_2"]
STUDENT = dict(mean=(0.1, 0.2, 0.3), std=(0.4, 0.5, 0.6))  # a student normalised its own way


def _teacher_file(path: Path, in_chans: int = 3, **feeding) -> Path:
    """A random m0 teacher of :data:`CLASSES` at 32 px (its logits depending on its input: :func:`randomize_`),
    saved with ``feeding`` (mean, std) recorded."""
    from cgavit import create_model
    from cgavit.schema import WeightsMeta
    from cgavit.testing import randomize_
    from cgavit.weights import save_weights

    torch.manual_seed(0)
    model = create_model("m0", num_classes=3, img_size=32, in_chans=in_chans).eval()
    with torch.no_grad():
        randomize_(model, images=torch.randn(4, in_chans, 32, 32))
    if path.suffix == ".pt":  # a training checkpoint: its options record the normalisation
        from cgavit.train import checkpoint as train_checkpoint

        record = TrainConfig(data=str(path.parent), model="efficientvit_m0", img_size=32, **feeding).to_record()
        return train_checkpoint.save(path, {
            "model": model.state_dict(), "model_ema": None, "optimizer": {}, "scheduler": {}, "scaler": None,
            "next_epoch": 1, "next_step": 0, "global_step": 1, "rng": [], "progress": {}, "world_size": 1,
            "args": record, "classes": CLASSES, "saved": "x"})
    meta = WeightsMeta(model="efficientvit_m0", config=model.cfg, num_classes=3, img_size=32, class_names=tuple(CLASSES),
                       in_chans=in_chans, **feeding)
    return save_weights(model, path, meta)


def _logits_in_the_loss(cfg: TrainConfig, images: torch.Tensor) -> torch.Tensor:
    """The teacher's logits inside a soft :class:`DistillationLoss` built for ``cfg``, on the student's ``images``."""
    from cgavit.train.recipe import DistillationLoss, build_teacher

    loss = DistillationLoss(torch.nn.CrossEntropyLoss(), build_teacher(cfg, CLASSES, torch.device("cpu")), "soft")
    seen = []
    loss.teacher.register_forward_hook(lambda module, args, out: seen.append(out))
    out = torch.zeros(len(images), 3)
    loss(images, (out, out), torch.zeros(len(images), dtype=torch.long))
    return seen[0]


@pytest.mark.parametrize("named, suffix", [(False, ".safetensors"), (True, ".safetensors"), (True, ".pt")],
                         ids=["checkpoint", "named-with-weights", "named-with-a-training-checkpoint"])
def test_the_teacher_sees_images_normalised_its_own_way(tmp_path, caplog, named, suffix):
    """The teacher was fed the student's batch, normalised with the student's mean and std, whatever its own were:
    a teacher recording others distilled from wrongly normalised images without a word. A training checkpoint given
    by ``--teacher-weights`` with its variant's name was still taken as normalised as ImageNet."""
    from cgavit import load_model
    from cgavit.testing import rel_err

    own = dict(mean=(0.5, 0.4, 0.3), std=(0.2, 0.3, 0.25))
    path = _teacher_file(tmp_path / f"teacher{suffix}", **own)
    teacher, _ = load_model(path)
    source = dict(teacher="efficientvit_m0", teacher_weights=str(path)) if named else dict(teacher=str(path))
    pixels = torch.rand(2, 3, 32, 32)
    as_student = (pixels - torch.tensor(STUDENT["mean"]).view(3, 1, 1)) / torch.tensor(STUDENT["std"]).view(3, 1, 1)
    as_teacher = (pixels - torch.tensor(own["mean"]).view(3, 1, 1)) / torch.tensor(own["std"]).view(3, 1, 1)
    cfg = tiny(data=str(tmp_path), distillation_type="soft", **source, **STUDENT)
    with caplog.at_level(logging.INFO, logger="cgavit"), torch.no_grad():
        seen = _logits_in_the_loss(cfg, as_student)
        assert rel_err(seen, teacher(as_teacher)) < 1e-5
        assert rel_err(seen, teacher(as_student)) > 0.05  # the images it used to see
    assert "the teacher gets the images renormalised as it was trained to see them: RGB, mean (0.5, 0.4, 0.3)" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="cgavit"), torch.no_grad():  # the same normalisation: fed as it is
        assert torch.equal(_logits_in_the_loss(tiny(data=str(tmp_path), distillation_type="soft", **source, **own),
                                               as_teacher), teacher(as_teacher))
    assert "the teacher takes the student's normalisation (mean (0.5, 0.4, 0.3)" in caplog.text


def test_a_greyscale_teacher_sees_grey_images_and_other_channels_are_refused(tmp_path):
    """A one-channel teacher was fed the student's RGB batch and failed at the first update; one of 4 channels
    too, after the run had started: the first now gets the pixels made grey (Pillow's 'L' weights, as cgavit reads
    images for such a network) and normalised its way, the second is refused before training."""
    from cgavit import load_model
    from cgavit.testing import rel_err

    path = _teacher_file(tmp_path / "grey.safetensors", in_chans=1)  # ImageNet's mean and std, averaged for grey
    teacher, _ = load_model(path)
    pixels = torch.rand(2, 3, 32, 32)
    as_student = (pixels - torch.tensor(STUDENT["mean"]).view(3, 1, 1)) / torch.tensor(STUDENT["std"]).view(3, 1, 1)
    grey = (pixels * torch.tensor([0.2989, 0.587, 0.114]).view(3, 1, 1)).sum(1, keepdim=True)  # Pillow's 'L', (B, 1, H, W)
    for source in (dict(teacher=str(path)), dict(teacher="m0", teacher_weights=str(path))):  # by name: refused before
        with torch.no_grad():
            seen = _logits_in_the_loss(tiny(data=str(tmp_path), distillation_type="hard", **source, **STUDENT), as_student)
            assert rel_err(seen, teacher((grey - 0.449) / 0.226)) < 1e-4
            assert rel_err(seen, teacher((pixels.mean(1, keepdim=True) - 0.449) / 0.226)) > 0.05  # not any grey
    four = _teacher_file(tmp_path / "four.safetensors", in_chans=4)
    with pytest.raises(ValueError, match=r"four.safetensors takes 4-channel images, and training feeds it the "
                                         r"student's RGB ones .*; give an RGB or greyscale teacher$"):
        _logits_in_the_loss(tiny(data=str(tmp_path), distillation_type="hard", teacher=str(four)), pixels)


def test_a_teacher_named_otherwise_than_its_file_records_is_the_files(tmp_path, caplog):
    """``--teacher M1 --teacher-weights`` an M0 file: the file's network, with a warning saying so; an official or timm
    file given as ``--teacher FILE`` is told to name its variant."""
    from cgavit import create_model
    from cgavit.train.recipe import build_teacher

    path = _teacher_file(tmp_path / "m0.safetensors")
    with caplog.at_level(logging.WARNING, logger="cgavit"):
        teacher = build_teacher(tiny(data=str(tmp_path), distillation_type="hard", teacher="efficientvit_m1",
                                     teacher_weights=str(path)), CLASSES, torch.device("cpu"))
    assert teacher.cfg == create_model("m0").cfg
    assert f"--teacher efficientvit_m1 differs from the efficientvit_m0 that {path} records; using the file's" in caplog.text
    bare = tmp_path / "bare.pth"
    torch.save(create_model("m0", num_classes=3, img_size=32).state_dict(), bare)
    with pytest.raises(ValueError, match=rf"^--teacher {bare} does not record its architecture .*: give its variant "
                                         rf"name with the file, --teacher NAME --teacher-weights {bare}$"):
        build_teacher(tiny(data=str(tmp_path), distillation_type="hard", teacher=str(bare)), CLASSES, torch.device("cpu"))


def test_distillation_with_timm_teacher_and_finetune(data, tmp_path):
    import timm

    teacher = timm.create_model("resnet10t", num_classes=3)
    torch.save(teacher.state_dict(), tmp_path / "teacher.pth")
    res = train(tiny(
        data=str(data), epochs=1, output=str(tmp_path / "distil"),
        distillation_type="hard", teacher="resnet10t", teacher_weights=str(tmp_path / "teacher.pth"),
    ))
    sd = _weights(tmp_path / "distil" / "last.pt")
    assert "head_dist.linear.weight" in sd and res.epochs == 1
    # soft distillation from a checkpoint trained here
    train(tiny(
        data=str(data), epochs=1, output=str(tmp_path / "soft"),
        distillation_type="soft", teacher=str(tmp_path / "distil" / "best.safetensors"),
    ))
    # fine-tune the distilled body onto a 2-class dataset
    two = make_folder(tmp_path / "two", classes=2, train=4, val=2)
    res = train(tiny(
        data=str(two), epochs=1, output=str(tmp_path / "ft"), lr=1e-9,
        warmup_lr=1e-9, finetune=str(tmp_path / "distil" / "best.pt"), model_ema=False,
    ))
    tuned = _weights(tmp_path / "ft" / "last.pt")
    assert tuned["head.linear.weight"].shape[0] == 2 and res.classes == ["class_0", "class_1"]
    w = "patch_embed.conv1.conv.weight"
    torch.testing.assert_close(tuned[w], sd[w], rtol=1e-4, atol=1e-5)  # body carried over (lr ~0)


def test_a_signal_as_the_last_epoch_ends_stops_nothing(data, tmp_path, sigterm_after, caplog):
    """A SIGTERM after the last update of the last epoch (or during its evaluation) let the run end in full, but it
    said "stopped after epoch 1 ... continue with --resume", returned interrupted, and `cgavit train` exited 143:
    a job scheduler would requeue a finished run, whose resume only says that nothing is left to train."""
    out = tmp_path / "run"
    with sigterm_after(4), caplog.at_level(logging.INFO, logger="cgavit"):  # 18 images, batch 4: 4 updates
        result = train(tiny(data=str(data), epochs=1, output=str(out)))
    assert not result.interrupted and result.signal is None and result.epochs == 1
    assert "continue with --resume" not in caplog.text
    ck = ckpt_io.load(out / "last.pt")
    assert (ck["next_epoch"], ck["next_step"]) == (1, 0) and (out / "curves.png").is_file()


@pytest.mark.parametrize("aa", ["v0", "rand-m9-mstd0.5-inc1", "rand-m9-mstd0.5", "augmix-m5"])
def test_every_op_of_the_offered_auto_augment_policies_runs_on_current_pillow(aa):
    """--aa v0 (offered by its own error message) stopped a run with Pillow's 'bits must be between or equal to 1 and 8':
    its Posterize at level 2 keeps 0 bits, and only RandAugment's and AugMix's posterize ops were patched."""
    from cgavit.train.data import build_transform

    transform = build_transform(32, True, auto_augment=aa)
    img = Image.fromarray(np.random.default_rng(0).integers(0, 255, (40, 40, 3), dtype=np.uint8))
    ops = [op for t in transform.transforms for op in [*getattr(t, "ops", []), *sum(getattr(t, "policy", []), [])]]
    assert ops, transform
    for op in ops:
        op.prob, op.magnitude_std = 1.0, 0.0  # each op applied, at its policy's magnitude and at the top one
        for magnitude in (op.magnitude, 10):
            op.magnitude = magnitude
            assert op(img).size == img.size, op


def test_a_missing_split_names_the_folders_the_dataset_holds(tmp_path, monkeypatch):
    """A dataset whose held-out split is 'validation' was told only that DIR/val does not exist (train), or that its
    class folders 'train' and 'validation' were not the checkpoint's classes (eval, which read DIR as the split)."""
    from cgavit.factory import create_model
    from cgavit.train import evaluate_checkpoint
    from cgavit.train.records import weights_meta
    from cgavit.weights import save_weights

    root = make_folder(tmp_path / "ds", classes=2, train=2, val=1)
    (root / "val").rename(root / "validation")
    with pytest.raises(DataError, match=r"--val-split 'val': .*/val does not exist \(.* holds the folders 'train', "
                                        r"'validation'\); give --data the dataset folder and --val-split"):
        check_layout(root)
    with pytest.raises(DataError, match=r"--train-split 'train': .*train/train does not exist \(.* holds the folders "
                                        r"'class_0', 'class_1'\)"):
        check_layout(root / "train")  # the split folder given as the dataset
    assert len(check_layout(root, val_split="validation")["val"]) == 2
    with monkeypatch.context() as m:  # a dataset folder that cannot be listed (root lists any): the line, no list
        m.setattr(Path, "iterdir", lambda self: (_ for _ in ()).throw(PermissionError(13, "Permission denied")))
        with pytest.raises(DataError, match=r"/val does not exist; give --data"):
            check_layout(root)
    cfg = tiny()
    model = create_model(cfg.model, num_classes=2, img_size=cfg.img_size, **cfg.dials)
    weights = save_weights(model, tmp_path / "w.safetensors", weights_meta(cfg, model, ["class_0", "class_1"], {}))
    with pytest.raises(DataError, match=r"has no val folder, and 'train', 'validation' hold folders of their own: if "
                                        r"they are splits, name the one to evaluate, e.g. --split validation"):
        evaluate_checkpoint(root, weights, workers=0, device="cpu")
    (root / "validation" / "class_1").rename(root / "validation" / "other")
    with pytest.raises(DataError, match=r"'other' is not among them; give the folder the model was trained on$"):
        evaluate_checkpoint(root / "validation", weights, workers=0, device="cpu")  # a split folder: no word of --split
    (root / "validation" / "other").rename(root / "validation" / "class_1")
    with pytest.raises(DataError, match=r"val does not exist; .* \(.* holds the folders 'train', 'validation'\)"):
        evaluate_checkpoint(root, weights, split="val", workers=0, device="cpu")
    assert evaluate_checkpoint(root, weights, split="validation", workers=0, device="cpu")["n"] == 2


def test_more_loader_workers_than_cores_is_one_warning_that_names_the_flag(monkeypatch):
    """``cgavit eval`` at the default ``--workers 4`` on a 2-core machine printed torch's two-line warning twice
    ('Our suggested max number of worker ...'), naming no flag; it is now one warning of cgavit's saying what to give."""
    import warnings

    from cgavit.train.data import make_loader

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0}, raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loader = make_loader(list(range(4)), 2, None, 2)
        loader.check_worker_number_rationality()
    texts = [str(w.message) for w in caught]
    assert texts and all("2 loader worker processes, where this process may use 1 CPU core(s)" in t and
                         "give --workers 1 or fewer" in t for t in texts), texts
