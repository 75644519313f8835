"""Hostile input for ``cgavit train|eval|predict|demo|ablate`` (issue #13, classes 1-4).

A table of command lines, each given damaged, wrong, blocking or oversized files, or options out of
range. They all run in ONE child process (the package is imported once), each through
``cgavit.cli.main`` under an alarm (a pipe opened by mistake would block forever) and with its peak
memory measured (the high-water mark is reset before each line); the child also runs under an
address-space limit. Every line must exit non-zero with exactly one ``cgavit CMD: error: ...`` line on
stderr, no traceback, in bounded time and memory.

The cases where the commands used to do silent nonsense (class 4) follow as ordinary tests, and a
property test feeds random records to the reader of training checkpoints' options.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import fcntl
import io
import json
import logging
import multiprocessing
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import time
import traceback
from collections import defaultdict
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image

from cgavit.cli import main
from cgavit import factory, load_model
from cgavit.bounds import MAX_IMAGE_PIXELS
from cgavit.images import SKIPPED_NAMED, load_image
from cgavit.io import CheckpointError, DataError, WriteError, atomic_write, save_torch, write_text
from cgavit.train import TrainConfig, predict, train
from cgavit.train import checkpoint as ckpt_io
from cgavit.train import engine
from cgavit.train.config import BOUNDS
from cgavit.train.distributed import DistEnv, RunLock
from cgavit.variants import CONFIG_LIMITS
from cgavit.weights import read_weights_meta, save_weights

from test_train import TINY_ARGV, make_folder, tiny

ROOT_USER = os.geteuid() == 0  # root reads files whatever their mode: no "unreadable" case then
CASE_SECONDS = 60  # alarm per command line: far above any case, far below "hung"
CASE_MB = 300  # peak memory a command line may add (a decoded 144-megapixel bomb needs 430 MB)
CHILD_AS_BYTES = 10 * 2**30  # address-space cap of the child (torch alone maps ~4 GB)


# ------------------------------------------------------------------------------ the hostile files
class _Foreign:
    """Pickles as a call of a function (a harmless one): what a malicious checkpoint holds."""

    def __reduce__(self):
        return (os.getpid, ())


def _hostile_files(root: Path, best_pt: Path, best_st: Path) -> dict[str, Path]:
    """One file of each hostile kind, built from a good training checkpoint and weights file."""
    h = root / "hostile"
    h.mkdir()
    good_pt, good_st = best_pt.read_bytes(), best_st.read_bytes()
    files = {
        "empty": (h / "empty.pt", b""),
        "truncated": (h / "truncated.pt", good_pt[: len(good_pt) // 2]),
        "text": (h / "text.pt", b"not a checkpoint at all\n"),
        "truncated_st": (h / "truncated.safetensors", good_st[: len(good_st) // 2]),
    }
    out = {}
    for kind, (path, content) in files.items():
        path.write_bytes(content)
        out[kind] = path
    for kind, name in (("pickle", "pickle.pt"), ("pickle_as_st", "pickle.safetensors")):
        out[kind] = h / name  # a legacy pickle that calls a function when loaded unsafely
        torch.save({"model": _Foreign()}, out[kind], _use_new_zipfile_serialization=False)
    out["folder"] = h / "folder.pt"
    out["folder"].mkdir()
    out["fifo"] = h / "fifo.pt"
    os.mkfifo(out["fifo"])
    out["missing"] = h / "missing.pt"
    out["unreadable"] = h / "unreadable.pt"
    out["unreadable"].write_bytes(good_pt)
    out["unreadable"].chmod(0)
    return out


def _nan_checkpoints(root: Path, best_pt: Path, best_st: Path) -> dict[str, Path]:
    """The good files with one NaN weight each (what a diverged run or a flipped bit leaves)."""
    ck = torch.load(best_pt, weights_only=True)
    ck["model"]["head.linear.weight"][0, 0] = float("nan")
    ckpt_io.save(root / "nan.pt", ck)
    model, _ = load_model(best_st)
    with torch.no_grad():
        model.head.linear.bias[1] = float("inf")
    save_weights(model, root / "nan.safetensors", read_weights_meta(best_st))
    return {"nan_pt": root / "nan.pt", "nan_st": root / "nan.safetensors"}


def _record_checkpoints(root: Path, best_pt: Path) -> dict[str, Path]:
    """Training checkpoints whose recorded options (untrusted metadata) ask for too much."""
    good = torch.load(best_pt, weights_only=True)
    changes = {
        "rec_img_size": {"img_size": 100_000},
        "rec_crop_pct": {"crop_pct": 0.001},
        "rec_embed_dim": {"embed_dim": [4096, 4096, 4096]},
        "rec_ffn_ratio": {"ffn_ratio": 1000.0},
        "rec_wide": {"embed_dim": [64, 128, 192]},  # in bounds, but not what the tensors hold
        "rec_type": {"img_size": "224"},
        "rec_not_dict": None,
    }
    out = {}
    for name, change in changes.items():
        ck = dict(good, args={**good["args"], **change} if change is not None else ["img_size", 224])
        ckpt_io.save(root / f"{name}.pt", ck)
        out[name] = root / f"{name}.pt"
    many = dict(good, classes=[f"c{i}" for i in range(100_001)])  # more than any classifier may have
    ckpt_io.save(root / "rec_classes.pt", many)
    out["rec_classes"] = root / "rec_classes.pt"
    odd = dict(good, classes=["a", "b"])  # two names for three outputs
    ckpt_io.save(root / "rec_class_count.pt", odd)
    out["rec_class_count"] = root / "rec_class_count.pt"
    return out


def _bad_images(folder: Path, good_png: Path) -> dict[str, Path]:
    """One image of each hostile kind; ``bomb`` is a real PNG of 144 megapixels (17 kB on disk)."""
    folder.mkdir(parents=True, exist_ok=True)
    good = good_png.read_bytes()
    out = {
        "empty": folder / "empty.png",
        "truncated": folder / "truncated.png",
        "text": folder / "text.jpg",
        "folder": folder / "folder.png",
        "fifo": folder / "fifo.png",
        "missing": folder / "missing.png",
        "bomb": folder / "bomb.png",
        "unreadable": folder / "unreadable.png",
    }
    out["empty"].write_bytes(b"")
    out["truncated"].write_bytes(good[:60])
    out["text"].write_bytes(b"GIF89a? no, plain text")
    out["folder"].mkdir()
    os.mkfifo(out["fifo"])
    Image.new("1", (12_000, 12_000)).save(out["bomb"])
    out["unreadable"].write_bytes(good)
    out["unreadable"].chmod(0)
    return out


def _broken_dataset(root: Path) -> Path:
    """The image-folder layout where no image can be read."""
    kinds = [b"", b"\x89PNG\r\n\x1a\n cut short", b"just text"]
    for split, n in (("train", 2), ("val", 1)):
        for c in range(3):
            d = root / split / f"class_{c}"
            d.mkdir(parents=True)
            for i in range(n):
                (d / f"{i}.png").write_bytes(kinds[(c + i) % 3])
    return root


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> dict[str, Path]:
    """A tiny dataset, a run trained on it, and the hostile files derived from them."""
    root = tmp_path_factory.mktemp("hostile")
    data = make_folder(root / "ds", classes=3, train=4, val=1)
    train(tiny(data=str(data), epochs=1, output=str(root / "run")))
    best_pt, best_st = root / "run" / "best.pt", root / "run" / "best.safetensors"
    w = {"root": root, "data": data, "best_pt": best_pt, "best_st": best_st, "image": data / "val" / "class_0" / "0.png"}
    w["file"] = _hostile_files(root, best_pt, best_st)
    w.update(_nan_checkpoints(root, best_pt, best_st))
    w.update(_record_checkpoints(root, best_pt))
    w["img"] = _bad_images(root / "images", w["image"])
    w["broken_ds"] = _broken_dataset(root / "broken")
    w["empty_ds"] = root / "empty_ds"
    w["empty_ds"].mkdir()
    bomb_ds = make_folder(root / "bomb_ds", classes=3, train=4, val=1)
    (bomb_ds / "train" / "class_1" / "bomb.png").write_bytes(w["img"]["bomb"].read_bytes())
    w["bomb_ds"] = bomb_ds
    w["odd_target"] = root / "precious.txt"
    w["odd_target"].write_text("precious\n")
    w["odd"] = _odd_run_folders(root / "odd", w["odd_target"])
    for kind, line in DAMAGED_METRICS.items():  # the run, its metrics.jsonl edited by hand or by another program
        shutil.copytree(root / "run", root / f"metrics-{kind}")
        with open(root / f"metrics-{kind}" / "metrics.jsonl", "ab") as f:
            f.write(line)
    return w


def _odd_run_folders(root: Path, target: Path) -> dict[str, Path]:
    """Run folders whose ``run.lock`` or ``train.log`` (``"<file> <kind>"``) is a pipe (opening or
    reading it would block), a symbolic link to ``target`` (which must stay untouched), a folder."""
    out = {}
    for name in ("run.lock", "train.log"):
        for kind in ODD_KINDS:
            folder = out[f"{name} {kind}"] = root / f"{name}-{kind}"
            folder.mkdir(parents=True)
            {"fifo": os.mkfifo, "symlink": lambda p: p.symlink_to(target), "folder": Path.mkdir}[kind](folder / name)
    return out


# ------------------------------------------------------------------------------ the table
TINY_ABLATE = ["--embed-dim", "16,24,32", "--num-heads", "2,2,2", "--depth", "1,1,1", "--img-size", "32",
               "--batch-size", "4", "--epochs", "1", "--no-throughput", "--threads", "1"]
CKPT_KINDS = ("empty", "truncated", "text", "truncated_st", "pickle", "pickle_as_st", "folder", "fifo", "missing", "unreadable")
IMAGE_KINDS = ("empty", "truncated", "text", "folder", "fifo", "missing", "bomb", "unreadable")
DAMAGED_METRICS = {"not JSON": b"garbage\n", "not a record": b"[1]\n", "a text epoch": b'{"epoch": "x", "train_loss": 1}\n',
                   "a text figure": b'{"epoch": 0, "train_loss": 1, "lr": 1, "val_loss": 1, "val_top1": "y", "val_top5": 1}\n',
                   "not UTF-8": b"\xff\xfe\n"}
ODD_KINDS = ("fifo", "symlink", "folder")
ODD_SAYS = {"fifo": "is not a regular file", "symlink": "is a symbolic link", "folder": "is a folder"}
RECORD_KINDS = ("rec_img_size", "rec_crop_pct", "rec_embed_dim", "rec_ffn_ratio", "rec_wide", "rec_type",
                "rec_not_dict", "rec_classes", "rec_class_count")
#: what each kind's one line must mention
SAYS = {
    "empty": "empty", "truncated": "truncated|corrupt", "text": "first bytes|cannot identify|not a PyTorch",
    "truncated_st": "truncated|corrupt|weights file", "pickle": "pickled", "pickle_as_st": "pickled|not a PyTorch",
    "folder": "folder", "fifo": "not a regular file|not a folder", "missing": "does not exist", "unreadable": "not readable",
    "bomb": "MP", "nan_pt": "NaN/inf", "nan_st": "NaN/inf", "rec_img_size": "img-size", "rec_crop_pct": "crop-pct",
    "rec_embed_dim": "embed-dim", "rec_ffn_ratio": "ffn-ratio", "rec_wide": "disagrees", "rec_type": "img-size",
    "rec_not_dict": "dict", "rec_classes": "classes", "rec_class_count": "disagrees",
}


def _cases(w: dict) -> dict[str, tuple[list[str], str]]:
    """``{case: (argv, regex the error line must match)}``: every command that reads a file, with
    each hostile kind of that file, and the numeric options out of range."""
    d, img, out = str(w["data"]), str(w["image"]), w["root"] / "out"
    cases: dict[str, tuple[list[str], str]] = {}
    for kind in CKPT_KINDS + ("nan_pt", "nan_st") + RECORD_KINDS:
        f = str(w[kind] if kind in w else w["file"][kind])
        cases[f"predict --checkpoint {kind}"] = (["predict", img, "--checkpoint", f], SAYS[kind])
        cases[f"eval --checkpoint {kind}"] = (["eval", "--data", d, "--checkpoint", f, "-j", "0"], SAYS[kind])
    for kind in CKPT_KINDS + ("nan_pt",):
        f = str(w[kind] if kind in w else w["file"][kind])
        run = ["train", "--data", d, *TINY_ARGV, "--epochs", "1"]
        cases[f"train --finetune {kind}"] = ([*run, "--output", str(out / f"ft-{kind}"), "--finetune", f], SAYS[kind])
        teacher = ["--distillation-type", "hard", "--teacher", "m0", "--teacher-weights", f]
        if kind != "nan_pt":  # a NaN file of another architecture fails on its shapes first
            cases[f"train --teacher-weights {kind}"] = ([*run, "--output", str(out / f"t-{kind}"), *teacher], SAYS[kind])
    for kind in CKPT_KINDS + ("nan_pt", "rec_img_size", "rec_embed_dim", "rec_type", "rec_not_dict", "rec_classes"):
        f = str(w[kind] if kind in w else w["file"][kind])
        cases[f"train --resume {kind}"] = (["train", "--resume", f, "--workers", "0"], SAYS[kind])
    for kind in IMAGE_KINDS:
        cases[f"predict image {kind}"] = (["predict", str(w["img"][kind]), "--checkpoint", str(w["best_pt"])], SAYS[kind])
    data_kinds = {
        "missing": (w["root"] / "nowhere", "does not exist"), "file": (w["file"]["text"], "not a folder"),
        "fifo": (w["file"]["fifo"], "not a folder"),
        "empty folder": (w["empty_ds"], "no class folders|does not exist|needs train"),
        "no readable image": (w["broken_ds"], "could be read|made no update"),
    }
    for kind, (path, says) in data_kinds.items():
        p = str(path)
        cases[f"train --data {kind}"] = (["train", "--data", p, *TINY_ARGV, "--epochs", "1", "--output", str(out / f"d-{kind}")], says)
        cases[f"eval --data {kind}"] = (["eval", "--data", p, "--checkpoint", str(w["best_pt"]), "-j", "0"], says)
        cases[f"ablate --data {kind}"] = (["ablate", "--data", p, "--output", str(out / f"a-{kind}"), *TINY_ABLATE], says)
    for name in ("run.lock", "train.log"):  # files of the run folder this package did not make: refused, never
        for kind in ODD_KINDS:  # followed, nor opened in a way that blocks (the log was: even SIGTERM did not help)
            folder = w["root"] / "odd" / f"{name}-{kind}"
            cases[f"train --output with {name} a {kind}"] = (
                ["train", "--data", d, *TINY_ARGV, "--epochs", "1", "--output", str(folder)], f"{name} {ODD_SAYS[kind]}")
    for kind in DAMAGED_METRICS:  # used to be raw TypeError / AttributeError / KeyError tracebacks
        cases[f"train --resume with metrics.jsonl {kind}"] = (
            ["train", "--resume", str(w["root"] / f"metrics-{kind}" / "last.pt"), "-j", "0"], r"metrics\.jsonl.*(line 2|record 2|UTF-8)")
    last = str(w["root"] / "run" / "last.pt")
    cases["train --resume with another --model"] = (["train", "--resume", last, "--model", "m1", "-j", "0"], r"--model (efficientvit_)?m1 differs")
    cases["train --resume with another --embed-dim"] = (
        ["train", "--resume", last, "--embed-dim", "16,32,64", "-j", "0"], r"--embed-dim 16,32,64 \(the run has 16,32,48\)")
    ck = str(w["best_pt"])
    flags = {  # name: (argv, what the line must say)
        "predict --img-size 0": (["predict", img, "--checkpoint", ck, "--img-size", "0"], "--img-size"),
        "predict --img-size 100000": (["predict", img, "--checkpoint", ck, "--img-size", "100000"], "--img-size"),
        "predict --topk 0": (["predict", img, "--checkpoint", ck, "--topk", "0"], "--topk"),
        "predict --topk -3": (["predict", img, "--checkpoint", ck, "--topk", "-3"], "--topk"),
        "eval --img-size 0": (["eval", "--data", d, "--checkpoint", ck, "--img-size", "0"], "--img-size"),
        "eval --crop-pct 0.001": (["eval", "--data", d, "--checkpoint", ck, "--crop-pct", "0.001"], "--crop-pct"),
        "eval --batch-size 0": (["eval", "--data", d, "--checkpoint", ck, "--batch-size", "0"], "--batch-size"),
        "train --img-size 100000": (["train", "--data", d, "--img-size", "100000"], "--img-size"),
        "train --img-size 0": (["train", "--data", d, "--img-size", "0"], "--img-size"),
        "train --crop-pct 0.001": (["train", "--data", d, "--crop-pct", "0.001"], "--crop-pct"),
        "train --lr nan": (["train", "--data", d, "--lr", "nan"], "--lr"),
        "train --batch-size 1": (["train", "--data", d, "--batch-size", "1"], "--batch-size"),
        "train --embed-dim 4096": (["train", "--data", d, "--embed-dim", "4096,4096,4096"], "--embed-dim"),
        "train --workers 100000": (["train", "--data", d, "--workers", "100000"], "--workers"),
        "train --output a file": (["train", "--data", d, *TINY_ARGV, "--output", str(w["file"]["text"])], "--output"),
        "ablate --img-size 100000": (["ablate", "--data", d, "--output", str(out / "a-size"), *TINY_ABLATE, "--img-size", "100000"], "--img-size"),
        "ablate --train-args --crop-pct 0": (["ablate", "--data", d, "--output", str(out / "a-crop"), *TINY_ABLATE, "--train-args", "--crop-pct 0"], "--crop-pct"),
        "demo --epochs 0": (["demo", "--output", str(out / "demo"), "--epochs", "0"], "--epochs"),
        "demo --threads -1": (["demo", "--output", str(out / "demo"), "--threads", "-1"], "--threads"),
        "demo --output a file": (["demo", "--output", str(w["file"]["text"])], "--output"),
    }
    for name, (argv, says) in flags.items():
        cases[name] = (argv, re.escape(says))
    return cases


# ------------------------------------------------------------------------------ the child process
class _Hung(BaseException):
    """Raised by the alarm: a BaseException, so no ``except Exception`` in the code under test hides it."""


def _alarm(signum, frame):
    raise _Hung()


def _memory_mb(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    return float("nan")


def run_cases(cases: dict[str, list[str]], seconds: int) -> dict[str, dict]:
    """Run each command line through ``cgavit.cli.main`` in this process.

    Returns:
        ``{case: {"rc", "stderr", "seconds", "peak_mb"}}``; ``rc`` is ``"hung"`` when the alarm fired,
        ``"crash"`` when an exception escaped ``main`` (its traceback is in ``stderr``).
    """
    logging.basicConfig(level=logging.WARNING, stream=sys.__stderr__)  # log lines stay out of the capture
    signal.signal(signal.SIGALRM, _alarm)
    results = {}
    for name, argv in cases.items():
        err = io.StringIO()
        rss = _memory_mb("VmRSS")
        try:
            Path("/proc/self/clear_refs").write_text("5")  # reset the peak-memory mark
        except OSError:
            rss = None  # cannot reset it here: no memory figure
        t0 = time.perf_counter()
        signal.alarm(seconds)
        try:
            with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
                rc = main(argv)
        except _Hung:
            rc = "hung"
        except SystemExit as exc:  # argparse refusing an option
            rc = exc.code
        except BaseException:
            err.write(traceback.format_exc())
            rc = "crash"
        finally:
            signal.alarm(0)
        results[name] = {"rc": rc, "stderr": err.getvalue(), "seconds": time.perf_counter() - t0,
                         "peak_mb": None if rss is None else _memory_mb("VmHWM") - rss}
    return results


def _limit_memory() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (CHILD_AS_BYTES, CHILD_AS_BYTES))


@pytest.fixture(scope="module")
def table(world) -> dict[str, tuple[dict, str]]:
    """Run the whole table in one child process; ``{case: (result, regex)}``."""
    cases = _cases(world)
    spec = world["root"] / "cases.json"
    spec.write_text(json.dumps({name: argv for name, (argv, _) in cases.items()}))
    code = (
        "import json, sys; import test_hostile_train as t; "
        f"res = t.run_cases(json.load(open({str(spec)!r})), {CASE_SECONDS}); "
        f"json.dump(res, open({str(spec) + '.out'!r}, 'w'))"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=world["root"], env=env, capture_output=True, text=True,
        timeout=CASE_SECONDS * 4 + 10 * len(cases), preexec_fn=_limit_memory,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(Path(str(spec) + ".out").read_text())
    return {name: (results[name], says) for name, (_, says) in cases.items()}


def _case_names() -> list:
    """The table's case names, at collection time (from stand-in paths)."""
    nowhere = Path("/nonexistent")
    stub = {key: nowhere for key in ("root", "data", "image", "best_pt", "broken_ds", "empty_ds", "nan_pt", "nan_st", *RECORD_KINDS)}
    stub.update(file=dict.fromkeys(CKPT_KINDS, nowhere), img=dict.fromkeys(IMAGE_KINDS, nowhere))
    return [pytest.param(n, marks=pytest.mark.skipif(ROOT_USER, reason="root reads any file")) if "unreadable" in n else n
            for n in _cases(stub)]


@pytest.mark.parametrize("case", _case_names())
def test_hostile_input_gives_one_line(table, case):
    result, says = table[case]
    stderr = result["stderr"]
    assert result["rc"] not in ("hung", "crash", 0, None), f"{case}: rc {result['rc']}\n{stderr}"
    assert "Traceback" not in stderr, stderr
    errors = [line for line in stderr.splitlines() if ": error:" in line]
    assert len(errors) == 1 and errors[0].startswith(f"cgavit {case.split()[0]}: error: "), stderr
    assert re.search(says, errors[0]), f"{case}: the line should say {says!r}: {errors[0]}"
    assert result["seconds"] < 30, result["seconds"]
    assert result["peak_mb"] is None or result["peak_mb"] < CASE_MB, f"{case}: used {result['peak_mb']:.0f} MB"


# ------------------------------------------------------------------------------ silent nonsense
def test_training_on_unreadable_images_stops_without_best(world, tmp_path):
    out = tmp_path / "run"
    with pytest.raises(DataError, match="3 class folder.s. in .* hold no image that could be read .class_0, class_1, class_2."):
        train(tiny(data=str(world["broken_ds"]), epochs=2, output=str(out)))
    assert not (out / "best.pt").exists() and not (out / "last.pt").exists()
    assert not (out / "best.safetensors").exists() and not (out / "run.lock").exists()


def test_stale_temporaries_of_a_killed_run_are_removed(world, tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    stale = [out / ".last.pt.k9x2a.tmp", out / ".metrics.jsonl.q1w2.tmp"]  # what kill -9 mid-write leaves
    for p in stale:
        p.write_bytes(b"")
    keep = out / "notes.tmp"  # not one of ours: kept
    keep.write_text("mine")
    aside = out / ".int8.onnx.4194399.old.tmp"  # a quantize --output run/int8 killed mid-move: maybe the only copy
    aside.write_text("an earlier int8 file")
    with pytest.raises(DataError):  # the run itself fails fast here; the clean-up came first, under the lock
        train(tiny(data=str(world["broken_ds"]), epochs=1, output=str(out)))
    assert not any(p.exists() for p in stale) and keep.exists() and aside.read_text() == "an earlier int8 file"


def test_nan_weights_are_refused_by_predict_and_eval(world, capsys):
    for ckpt in (world["nan_pt"], world["nan_st"]):
        with pytest.raises(CheckpointError, match="NaN/inf"):
            predict([world["image"]], ckpt)
        assert main(["eval", "--data", str(world["data"]), "--checkpoint", str(ckpt), "-j", "0"]) == 2
        assert "NaN/inf" in capsys.readouterr().err


def test_image_sizes_and_topk_out_of_range_are_errors(world, capsys):
    ck = str(world["best_pt"])
    for argv in (["--img-size", "0"], ["--img-size", "5000"], ["--topk", "0"], ["--topk", "-3"]):
        assert main(["predict", str(world["image"]), "--checkpoint", ck, *argv]) == 2, argv
        err = capsys.readouterr().err
        assert argv[0] in err and len(err.strip().splitlines()) == 1, err
    rows = predict([world["image"]], ck, topk=99)  # more than the 3 classes: all of them, with a note
    assert len(rows[0]["top"]) == 3
    with pytest.raises(ValueError, match="--img-size"):
        TrainConfig(data="d", img_size=0).validate()


def test_one_bad_image_among_three_keeps_the_others(world, capsys):
    good = [world["data"] / "val" / f"class_{c}" / "0.png" for c in (0, 1)]
    images = [good[0], world["img"]["truncated"], good[1]]
    ck = str(world["best_pt"])
    assert main(["predict", *map(str, images), "--checkpoint", ck]) == 1
    captured = capsys.readouterr()
    assert str(good[0]) in captured.out and str(good[1]) in captured.out
    assert captured.err.strip().splitlines() == [f"cgavit predict: error: cannot read image {images[1]}: image file is truncated"]
    assert main(["predict", *map(str, images), "--checkpoint", ck, "--json"]) == 1
    rows = json.loads(capsys.readouterr().out)
    assert [r["image"] for r in rows] == [str(good[0]), str(good[1])] and all(len(r["top"]) == 3 for r in rows)
    assert main(["predict", str(world["img"]["truncated"]), "--checkpoint", ck]) == 2  # none readable
    rows = predict(images, ck)  # the library keeps every row, in order
    assert [("error" in r, "top" in r) for r in rows] == [(False, True), (True, False), (False, True)]


def test_decompression_bomb_is_skipped_in_training_with_bounded_memory(world, tmp_path):
    bomb = world["img"]["bomb"]
    with Image.open(bomb) as im:
        assert im.size[0] * im.size[1] > MAX_IMAGE_PIXELS and bomb.stat().st_size < 100_000
    with pytest.raises(DataError, match="MP"):
        load_image(bomb)
    res = train(tiny(data=str(world["bomb_ds"]), epochs=1, output=str(tmp_path / "run"), mixup=0, cutmix=0))
    assert res.skipped_images == 1 and res.epochs == 1


def test_recorded_options_are_checked_before_a_network_is_built(world, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a network was built from an untrusted record")

    monkeypatch.setattr(factory, "EfficientViT", refuse)
    for kind in RECORD_KINDS:
        with pytest.raises(CheckpointError):
            load_model(world[kind])


def test_recorded_keys_that_are_no_dial_are_never_used(world, tmp_path):
    # a record naming create_model's checkpoint_path (a pipe: reading it would block) and pretrained
    # (a download): neither is a design dial, so neither reaches the model factory
    ck = torch.load(world["best_pt"], weights_only=True)
    ck["args"].update(checkpoint_path=str(world["file"]["fifo"]), pretrained=True)
    ckpt_io.save(tmp_path / "keys.pt", ck)
    model, info = load_model(tmp_path / "keys.pt")
    assert model.num_classes == 3 and info.img_size == 32


# ------------------------------------------------------------------------------ the record schema
_VALUES = st.one_of(
    st.none(), st.booleans(), st.integers(-10, 10**7), st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=8), st.lists(st.integers(-5, 5000), max_size=4), st.lists(st.floats(-2, 2), max_size=4),
)
_KEYS = st.sampled_from(sorted(set(TrainConfig().to_record()) | {"checkpoint_path", "pretrained", "command"}))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(base=st.sampled_from([TrainConfig(data="d"), TrainConfig(data="d", img_size=32, dials={"embed_dim": (16, 32, 48)})]),
       changes=st.dictionaries(_KEYS, _VALUES, max_size=4))
def test_any_record_is_read_within_bounds_or_refused_with_a_value_error(base, changes):
    record = {**base.to_record(), **changes}
    try:
        cfg = TrainConfig.from_record(record)
    except ValueError:
        return  # refused, with a message: fine (TypeError, KeyError, ... would fail the test)
    for name, (lo, hi) in BOUNDS.items():
        value = getattr(cfg, name)
        assert all(v is None or lo <= v <= hi for v in (value if isinstance(value, tuple) else (value,))), name
    for name, (lo, hi) in CONFIG_LIMITS.items():
        value = cfg.dials.get(name)
        assert value is None or all(lo <= v <= hi for v in (value if isinstance(value, tuple) else (value,))), name
    assert set(cfg.dials) <= set(f for f in record if record[f] is not None)


# ------------------------------------------------------------------------------ the run folder
RACE_CONTENDERS = 8
RACE_ROUNDS = 250  # per case; the lock before flock had two holders in about 4 % of such rounds


def _contend(root: str, rounds: int, barrier, results) -> None:
    """One racing process: each round, take folder ROUND's lock together with the others and hold it
    until every contender has tried; report ``(round, pid, "won" or the error's message)``."""
    env = DistEnv()
    for r in range(rounds):
        barrier.wait()
        lock = RunLock(Path(root) / str(r), env)
        try:
            lock.__enter__()
            outcome = "won"
        except Exception as err:  # noqa: BLE001 - reported to the test, which names it
            outcome = f"{type(err).__name__}: {err}"
        barrier.wait()  # every contender has tried: only now may the holder let go
        if outcome == "won":
            lock.__exit__(None, None, None)
        results.put((r, os.getpid(), outcome))


@pytest.mark.parametrize("left", ["nothing", "a dead run's lock"])
def test_racing_processes_never_both_take_a_run_folder(tmp_path, left):
    """Issue 19: two `cgavit train` on one new folder both ran. 8 processes x 250 rounds, each round
    on a fresh folder (empty, or holding the lock file of a run that is gone): exactly one holder,
    and every other process names the holder's pid."""
    for r in range(RACE_ROUNDS):
        (tmp_path / str(r)).mkdir()
        if left != "nothing":
            (tmp_path / str(r) / "run.lock").write_text("999999999")  # no such process
    ctx = multiprocessing.get_context("fork")  # the package is imported already: the contenders start at once
    barrier, results = ctx.Barrier(RACE_CONTENDERS, timeout=60), ctx.Queue()
    procs = [ctx.Process(target=_contend, args=(str(tmp_path), RACE_ROUNDS, barrier, results)) for _ in range(RACE_CONTENDERS)]
    for p in procs:
        p.start()
    try:
        rows = [results.get(timeout=60) for _ in range(RACE_ROUNDS * RACE_CONTENDERS)]
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    tries = defaultdict(list)
    for r, pid, outcome in rows:
        tries[r].append((pid, outcome))
    for r in range(RACE_ROUNDS):
        holders = [pid for pid, outcome in tries[r] if outcome == "won"]
        assert len(holders) == 1, f"round {r}: {len(holders)} processes took the lock: {tries[r]}"
        for pid, outcome in tries[r]:
            assert outcome == "won" or f"another run (pid {holders[0]}) is writing to" in outcome, outcome
        assert not (tmp_path / str(r) / "run.lock").exists()  # the holder's exit removed it


def _hold_lock(folder: str, ready) -> None:
    with RunLock(Path(folder), DistEnv()):
        ready.set()
        time.sleep(120)  # killed long before


def test_lock_of_a_killed_run_is_taken_over_and_its_temporaries_removed(world, tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    ctx = multiprocessing.get_context("fork")
    ready = ctx.Event()
    holder = ctx.Process(target=_hold_lock, args=(str(out), ready))
    holder.start()
    try:
        assert ready.wait(30)
        with pytest.raises(ValueError, match=rf"another run \(pid {holder.pid}\)"):
            train(tiny(data=str(world["broken_ds"]), epochs=1, output=str(out)))
    finally:
        os.kill(holder.pid, signal.SIGKILL)  # what the OOM killer or kill -9 does: no clean-up ran
        holder.join()
    assert (out / "run.lock").read_text() == str(holder.pid)  # left behind, but the kernel released its lock
    stale = out / ".last.pt.k9x2a.tmp"
    stale.write_bytes(b"half")
    with pytest.raises(DataError, match="could be read|made no update"):  # the run takes the folder, then fails on its data
        train(tiny(data=str(world["broken_ds"]), epochs=1, output=str(out)))
    assert not stale.exists() and not (out / "run.lock").exists()


def test_symlinks_in_a_run_folder_are_never_written_through(world, tmp_path, caplog):
    """A run folder from elsewhere whose train.log links to a file of the user's: every log line of
    the run used to be appended to that file."""
    target = tmp_path / "precious.txt"
    target.write_text("precious\n")
    for name in ("run.lock", "train.log"):
        out = tmp_path / name
        out.mkdir()
        (out / name).symlink_to(target)
        (out / ".last.pt.k9x2a.tmp").write_bytes(b"")  # its removal is logged at INFO, into train.log
        with caplog.at_level(logging.INFO, logger="cgavit"), pytest.raises(ValueError, match=f"{name} is a symbolic link"):
            train(tiny(data=str(world["broken_ds"]), epochs=1, output=str(out)))
        assert target.read_text() == "precious\n" and (out / name).is_symlink()
        assert name == "run.lock" or not (out / "run.lock").exists()  # the lock was let go


def test_read_only_output_is_one_line(world, mount_tmpfs, capsys):
    """Issue 19: `--output` on a read-only file system gave an OSError traceback from run.lock."""
    ro = mount_tmpfs(folders=("run",), read_only=True)
    run = ["train", "--data", str(world["data"]), *TINY_ARGV, "--epochs", "1"]
    for argv in ([*run, "--output", str(ro / "run")], [*run, "--output", str(ro / "new")],
                 ["demo", "--output", str(ro / "run"), "--epochs", "1"]):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
        assert re.search(rf"cgavit {argv[0]}: error: cannot .*{ro}.*: the file system is read-only; ", err), err
    with pytest.raises(WriteError) as info:
        RunLock(ro / "run", DistEnv()).__enter__()
    assert info.value.errno == errno.EROFS


def test_write_errors_keep_their_cause_and_say_what_to_do(tmp_path, mount_tmpfs):
    """Issue 19: "is a directory" and "disk full" both read `[Errno 5] ...`."""
    folder = tmp_path / "weights.pt"
    folder.mkdir()
    with pytest.raises(WriteError) as info:
        write_text(folder, "x")
    assert info.value.errno == errno.EISDIR and str(info.value).startswith(f"cannot write {folder}: it is a folder")
    assert "give the path of a file" in str(info.value) and "Errno" not in str(info.value)

    def full(tmp: str) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")
    with pytest.raises(WriteError, match="the disk is full .*free some space") as info:
        atomic_write(tmp_path / "a.txt", full)
    assert info.value.errno == errno.ENOSPC and not list(tmp_path.glob(".a.txt.*"))

    disk = mount_tmpfs(size="256k")  # a real full disk, for a plain write and for torch.save
    write_text(disk / "old.txt", "kept")
    for name, write in (("old.txt", lambda p: write_text(p, "x" * 2**20)),
                        ("t.pt", lambda p: save_torch(p, torch.randn(2**18)))):  # 1 MiB each
        with pytest.raises(WriteError) as info:
            write(disk / name)
        assert info.value.errno == errno.ENOSPC, str(info.value)
        assert re.match(rf"cannot write {disk / name}: the disk is full \((the previous file is untouched|nothing was written)\); "
                        "free some space and run again$", str(info.value)), str(info.value)
    assert (disk / "old.txt").read_text() == "kept" and sorted(p.name for p in disk.iterdir()) == ["old.txt"]


def test_a_file_staged_beside_its_destination_is_named_as_the_destination_when_it_fails(tmp_path):
    """Export, quantize and the reports write a set of files in a temporary folder first: a full disk there said
    "cannot write .../.m0.xml.scrtpuke/m0.xml", a name the user never gave."""
    from cgavit.io import replace_together, staging, write_error

    (tmp_path / "m0.xml").write_text("kept")
    with pytest.raises(WriteError) as info:
        with staging(tmp_path / "m0.xml") as tmp:
            write_text(tmp / "m0.bin", "x")
            atomic_write(tmp / "m0.xml", lambda t: (_ for _ in ()).throw(OSError(errno.ENOSPC, "No space left")))
    assert str(info.value) == (f"cannot write {tmp_path / 'm0.xml'}: the disk is full (the previous file is untouched); "
                               "free some space and run again")
    assert info.value.errno == errno.ENOSPC and sorted(p.name for p in tmp_path.iterdir()) == ["m0.xml"]
    # a runtime's own words for the failure are kept, said of the destination
    with pytest.raises(WriteError) as info:
        with staging(tmp_path / "m0.xml") as tmp:
            raise write_error(tmp / "m0.xml", RuntimeError("serialize.cpp:1290: Failed to write: No space left"))
    assert str(info.value).startswith(f"cannot write {tmp_path / 'm0.xml'}: serialize.cpp:1290: Failed to write")
    # a folder where a file of the set goes is refused before anything moves (it was moved aside, then unlinked)
    (tmp_path / "m0.bin").mkdir()
    with pytest.raises(WriteError, match="m0.bin: it is a folder"):
        with staging(tmp_path / "m0.xml") as tmp:
            replace_together([(write_text(tmp / "m0.bin", "w"), tmp_path / "m0.bin"),
                              (write_text(tmp / "m0.xml", "x"), tmp_path / "m0.xml")])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m0.bin", "m0.xml"] and (tmp_path / "m0.xml").read_text() == "kept"


def test_resume_continues_as_the_network_it_is(world, tmp_path):
    """Issue 19: resuming with another --model ran the checkpoint's M0 weights labelled M1."""
    run = tmp_path / "run"
    shutil.copytree(world["root"] / "run", run, ignore=shutil.ignore_patterns("run.lock"))
    last = run / "last.pt"
    before = {p.name: p.stat().st_mtime_ns for p in run.iterdir()}
    for overrides, says in ((dict(model="efficientvit_m1"), "--model efficientvit_m1 differs"),
                            (dict(dials={"embed_dim": (16, 32, 64)}), "--embed-dim 16,32,64"),
                            (dict(dials={"cascade": False}), "--cascade off")):
        with pytest.raises(ValueError, match=says):
            TrainConfig.resume_from(last, epochs=2, **overrides)
    stored = TrainConfig.resume_from(last)
    with pytest.raises(ValueError, match="--model efficientvit_m1 differs"):  # a config built by hand is held to it too
        train(replace(stored, model="efficientvit_m1", epochs=2))
    assert {p.name: p.stat().st_mtime_ns for p in run.iterdir()} == before  # nothing written
    same = TrainConfig.resume_from(last, model="m0", dials={"cascade": True, "embed_dim": [16, 32, 48]}, epochs=2)
    assert same.model == "m0" and same.dials["embed_dim"] == (16, 32, 48)  # the same network, spelled out: fine


def test_a_resumed_run_takes_the_options_it_records_and_refuses_what_its_state_cannot_take(world, tmp_path):
    """Resuming with --weight-decay 0.5 --opt-eps 1e-3 recorded them and trained with the old ones (the optimiser's
    state brought its groups' settings back); another --opt was a KeyError traceback at the first update, another
    --img-size a state-dict dump; a damaged optimiser state failed mid-step or trained on NaN; and resuming best.pt
    in its own folder replaced the later last.pt without a word."""
    run = tmp_path / "run"
    shutil.copytree(world["root"] / "run", run, ignore=shutil.ignore_patterns("run.lock"))
    first = run.parent / "first.pt"
    shutil.copy(run / "last.pt", first)
    train(TrainConfig.resume_from(run / "last.pt", epochs=2, weight_decay=0.5, opt_eps=1e-3))
    groups = ckpt_io.load(run / "last.pt")["optimizer"]["param_groups"]
    assert sorted(g["weight_decay"] for g in groups) == [0.0, 0.5] and {g["eps"] for g in groups} == {1e-3}
    for option, says in ((dict(opt="sgd"), "--opt sgd: .* was trained with --opt adamw"),
                         (dict(img_size=48), "--img-size 48: .* was trained with --img-size 32")):
        with pytest.raises(ValueError, match=says):
            train(TrainConfig.resume_from(run / "last.pt", epochs=3, **option))
    shutil.copy(first, run / "best.pt")  # an earlier point than last.pt, in its folder
    kept = (run / "last.pt").read_bytes()
    with pytest.raises(ValueError, match="last.pt is a later point of this run"):
        train(TrainConfig.resume_from(run / "best.pt", epochs=3))
    assert (run / "last.pt").read_bytes() == kept
    for damage, says in ((lambda st: st.update(exp_avg=st["exp_avg"][..., :1].clone()), "is .* for a parameter of"),
                         (lambda st: st["exp_avg_sq"].fill_(float("nan")), "holds NaN or inf")):
        ck = ckpt_io.load(first)
        damage(next(iter(ck["optimizer"]["state"].values())))
        folder = tmp_path / f"damaged{len(says)}"
        folder.mkdir()
        ckpt_io.save(folder / "last.pt", ck)
        with pytest.raises(CheckpointError, match=f"its optimiser state .*{says}"):
            train(TrainConfig.resume_from(folder / "last.pt", epochs=2))


def test_optimisers_with_state_of_their_own_resume(world, tmp_path):
    """The state check took Adafactor's factored statistics for damage (every such run was refused on resume), and
    the settings put back after loading restarted Lookahead's step counter, which its groups keep."""
    from cgavit import create_model
    from cgavit.train.recipe import build_optimizer

    model = create_model("m0", num_classes=3, img_size=32)
    optimizer = build_optimizer(model, tiny(opt="adafactor"), 0.01)
    model(torch.randn(2, 3, 32, 32)).sum().backward()
    optimizer.step()
    engine.check_optimizer_state(optimizer, "adafactor")  # row and column statistics of their own shapes
    run = tmp_path / "la"
    train(tiny(data=str(world["data"]), epochs=1, opt="lookahead_adamw", output=str(run)))
    train(TrainConfig.resume_from(run / "last.pt", epochs=2))
    ck = ckpt_io.load(run / "last.pt")
    assert {g["lookahead_step"] for g in ck["optimizer"]["param_groups"]} == {ck["global_step"]}


def test_optimisers_and_teachers_that_cannot_work_are_refused(world, tmp_path):
    """--opt adahessian or fusedsgd on a CPU were tracebacks (the first at the first update); a teacher named with
    --teacher-weights of another number of classes distilled from a classifier left as initialised."""
    from cgavit import create_model
    from cgavit.train.recipe import build_optimizer

    with pytest.raises(ValueError, match="--opt adahessian needs second-order gradients"):
        tiny(data=str(world["data"]), opt="adahessian").validate()
    with pytest.raises(ValueError, match="--model-ema-eval evaluates the EMA weights, which --no-model-ema"):
        tiny(data=str(world["data"]), model_ema=False, model_ema_eval=True).validate()  # was ignored
    with pytest.raises(ValueError, match="--opt fusedsgd cannot be used here .*CUDA"):
        build_optimizer(create_model("m0", num_classes=3, img_size=32), tiny(opt="fusedsgd"), 0.1)
    four = save_weights(create_model("m0", num_classes=4, img_size=32), tmp_path / "four.safetensors")
    with pytest.raises(ValueError, match=r"four.safetensors predicts 4 classes and .* holds 3 \(distillation pairs "
                                         r"the classes index by index\); give a teacher trained on these classes$"):
        train(tiny(data=str(world["data"]), epochs=1, output=str(tmp_path / "t"), distillation_type="hard",
                   teacher="efficientvit_m0", teacher_weights=str(four)))


# ------------------------------------------------------------------------------ names reaching the terminal
ESCAPES = "\x1b]0;owned\x07\x1b[2J\r\u202e"  # set the title, clear the screen, return, reverse the text


def _terminal_safe(text: str) -> bool:
    return all(line.isprintable() for line in text.splitlines())


def test_file_names_reach_the_terminal_escaped(world, tmp_path, capsys, monkeypatch):
    """A file or folder name is the dataset's, not the user's: `predict` and `eval` printed them raw,
    so a name could clear the screen, set the title or reverse the line."""
    good = tmp_path / f"{ESCAPES}.png"
    shutil.copy(world["image"], good)
    missing = tmp_path / f"gone{ESCAPES}.png"
    assert main(["predict", str(good), str(missing), "--checkpoint", str(world["best_pt"])]) == 1
    out, err = capsys.readouterr()
    assert _terminal_safe(out) and _terminal_safe(err), (out, err)
    assert "\\x1b]0;owned\\x07" in out and "gone\\x1b]0;owned" in err  # still named, as Python escapes
    undecodable = tmp_path / os.fsdecode(b"\xff\xfe.png")  # not UTF-8: a strict stdout could not print it at all
    shutil.copy(world["image"], undecodable)
    assert main(["predict", str(undecodable), "--checkpoint", str(world["best_pt"])]) == 0
    out = capsys.readouterr().out
    assert _terminal_safe(out) and "\\udcff\\udcfe.png" in out and out.encode("utf-8"), out
    data = tmp_path / "ds"
    shutil.copytree(world["data"], data)
    (data / "val" / "class_0" / f"{ESCAPES}.png").write_bytes(b"not an image")
    monkeypatch.setattr(logging.root, "handlers", [])  # as in a fresh process: the command sets up its own log output
    monkeypatch.setattr(logging.root, "level", logging.root.level)
    assert main(["eval", "--data", str(data), "--checkpoint", str(world["best_pt"]), "-j", "0"]) == 0
    out, err = capsys.readouterr()
    assert "skipped an image: cannot read image" in err and "\\x1b[2J" in err, err  # the log line, escaped
    assert _terminal_safe(out) and _terminal_safe(err), err


def test_a_name_with_a_newline_cannot_forge_a_line_of_output(world, tmp_path, capsys):
    """`predict` printed an image name holding a newline as two lines, so a file named
    "a.png<newline>  1. 100.00%  class_2  (class 2)<newline>b.png" added a prediction of its own; `eval` printed its
    data folder and checkpoint raw (escape sequences included)."""
    forged = "  1. 100.00%  class_2  (class 2)"
    image = tmp_path / f"a.png\n{forged}\nb.png"
    shutil.copy(world["image"], image)
    assert main(["predict", str(image), "--checkpoint", str(world["best_pt"]), "--topk", "1"]) == 0
    out = capsys.readouterr().out
    assert len(out.splitlines()) == 2 and forged not in out.splitlines(), out
    assert out.splitlines()[0] == str(image).replace("\n", "\\n")  # still named, as a Python escape
    data = tmp_path / f"ds\n{ESCAPES}"
    shutil.copytree(world["data"], data)
    assert main(["eval", "--data", str(data), "--checkpoint", str(world["best_pt"]), "-j", "0"]) == 0
    out = capsys.readouterr().out
    assert len(out.splitlines()) == 1 and _terminal_safe(out) and "ds\\n\\x1b]0;owned" in out, out


def test_a_newline_in_a_file_name_cannot_forge_a_log_line(world, tmp_path, capsys, monkeypatch):
    """The log escaped control characters but kept line breaks, so an unreadable image named
    "x.png<newline>INFO cgavit: ..." logged a line of its own beside 'skipped an image'."""
    data = tmp_path / "ds"
    shutil.copytree(world["data"], data)
    forged = "INFO cgavit.train: all images read"
    (data / "val" / "class_0" / f"x.png\n{forged}\ny.png").write_bytes(b"not an image")
    monkeypatch.setattr(logging.root, "handlers", [])  # as in a fresh process: the command sets up its own log output
    monkeypatch.setattr(logging.root, "level", logging.root.level)
    assert main(["eval", "--data", str(data), "--checkpoint", str(world["best_pt"]), "-j", "0"]) == 0
    out, err = capsys.readouterr()
    skipped = [line for line in err.splitlines() if "skipped an image" in line]
    assert len(skipped) == 1 and "x.png\\nINFO" in skipped[0] and forged not in err.splitlines(), err
    assert "(1 unreadable image skipped)" in out, out  # it said '1 unreadable images'


def test_a_folder_of_many_unreadable_images_names_the_first_and_counts_the_rest(world, tmp_path, capsys, monkeypatch):
    """Every unreadable image had a warning line of its own, so a folder holding thousands buried the run's output
    (and its result) under them; a run now names the first SKIPPED_NAMED and counts the rest in one line."""
    data = tmp_path / "ds"
    shutil.copytree(world["data"], data)
    broken = SKIPPED_NAMED + 7
    for i in range(broken):
        (data / "val" / "class_0" / f"broken_{i:03d}.png").write_bytes(b"not an image")
    monkeypatch.setattr(logging.root, "handlers", [])  # as in a fresh process: the command sets up its own log output
    monkeypatch.setattr(logging.root, "level", logging.root.level)
    assert main(["eval", "--data", str(data), "--checkpoint", str(world["best_pt"]), "-j", "0"]) == 0
    err = capsys.readouterr().err
    named = [line for line in err.splitlines() if "skipped an image" in line]
    assert len(named) == SKIPPED_NAMED and "broken_000.png" in named[0], err
    assert f"skipped 7 more images that could not be read ({broken} in all" in err, err
    logging.root.handlers = []  # a second fresh process, with debug logging
    assert main(["-v", "eval", "--data", str(data), "--checkpoint", str(world["best_pt"]), "-j", "0"]) == 0
    err = capsys.readouterr().err
    assert len([line for line in err.splitlines() if "skipped an image" in line]) == broken, err


def test_a_new_run_sets_aside_the_records_of_one_that_left_no_checkpoint(world, tmp_path):
    """A run whose first last.pt could not be written (a full disk) left metrics.jsonl behind; the
    next run in that folder appended to it, so epoch 1 was recorded twice and the curves mixed runs."""
    out = tmp_path / "run"
    out.mkdir()
    earlier = '{"epoch": 0, "train_loss": 9.0, "lr": 0.1, "val_loss": 9.0, "val_top1": 1.0, "val_top5": 2.0}\n'
    (out / "metrics.jsonl").write_text(earlier)
    with pytest.raises(DataError, match="could be read|made no update"):  # the new run takes the folder, then fails on its data
        train(tiny(data=str(world["broken_ds"]), epochs=1, output=str(out)))
    assert not (out / "metrics.jsonl").exists()  # the new run's records start afresh
    (aside,) = out.glob("metrics-before-*.jsonl")
    assert aside.read_text() == earlier  # kept, not lost


def test_runs_started_in_the_same_second_get_a_folder_each(world, tmp_path, monkeypatch):
    """Without --output the folder is runs/<model>-<second>: two runs started together shared it."""
    class Frozen(datetime.datetime):
        @classmethod
        def now(cls, tz=None):
            return cls(2026, 12, 1, 12, 0, 0)

    monkeypatch.setattr(engine, "datetime", Frozen)
    monkeypatch.chdir(tmp_path)
    left = []  # a refused run removes the folder it made: here each is kept, as a run still going keeps its own
    monkeypatch.setattr(engine._RefusedRunLog, "__exit__", lambda self, *exc: left.append(self.output))
    for _ in range(3):  # each fails on its unreadable data after taking its folder
        with pytest.raises(DataError, match="could be read|made no update"):
            train(tiny(data=str(world["broken_ds"]), epochs=1, output=None))
    base = "efficientvit_m0-20261201-120000"
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == [base, f"{base}-2", f"{base}-3"]
    assert [p.name for p in left] == [base, f"{base}-2", f"{base}-3"]


def test_a_file_system_without_locks_is_named(tmp_path, monkeypatch):
    def unsupported(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", unsupported)  # what some network and FUSE file systems answer
    with pytest.raises(ValueError, match="does not support file locks .*give --output a folder on a local disk"):
        RunLock(tmp_path, DistEnv()).__enter__()


def test_a_second_demo_on_a_folder_in_use_touches_nothing(tmp_path, capsys):
    """A second `cgavit demo --output D` while one runs in D deleted the running demo's checkpoints, metrics and log,
    then stopped at the run folder's lock; it now stops at the demo folder's lock, before anything."""
    out = tmp_path / "demo"
    (out / "run").mkdir(parents=True)
    files = {out / "run" / "last.pt": b"running", out / "run" / "metrics.jsonl": b"{}\n", out / "report.json": b"{}"}
    for path, data in files.items():
        path.write_bytes(data)
    with RunLock(out, DistEnv()):  # the running demo
        assert main(["demo", "--output", str(out), "--epochs", "1"]) == 2
    assert f"another run (pid {os.getpid()}) is writing to {out}; wait for it" in capsys.readouterr().err
    assert {path: path.read_bytes() for path in files} == files and not (out / "data").exists()


def test_a_demo_under_torchrun_is_refused_as_one_process(tmp_path, capsys, monkeypatch):
    """Under `torchrun --nproc_per_node 2`, each process took the demo's folder for itself: rank 1 stopped with
    "another run (pid N) is writing to runs/demo", N being its sibling rank 0, which torchrun then killed."""
    monkeypatch.setenv("WORLD_SIZE", "2")  # as torchrun sets it, in every process
    out = tmp_path / "demo"
    assert main(["demo", "--output", str(out), "--epochs", "1"]) == 2
    err = capsys.readouterr().err
    assert "cgavit demo runs as one process, and torchrun started 2: run it without torchrun" in err, err
    assert f"-m cgavit train --data {out / 'data'}" in err and not out.exists()


def test_a_stopped_demo_exits_as_a_stopped_train(monkeypatch, capsys):
    """`cgavit demo` stopped by Ctrl-C or SIGTERM exited 0, where `cgavit train` exits 130 or 143."""
    import cgavit.cli.train as cli_train

    for signum, code in ((signal.SIGINT, 130), (signal.SIGTERM, 143)):
        monkeypatch.setattr(cli_train, "run_demo", lambda *a, signum=signum, **k: {
            "interrupted": True, "signal": int(signum), "last": "runs/demo/run/last.pt"})
        assert main(["demo", "--epochs", "1"]) == code
        assert "continue it with: cgavit train --resume runs/demo/run/last.pt" in capsys.readouterr().out


def test_a_diverged_model_is_no_result(world, tmp_path, capsys, monkeypatch):
    """A run whose weights diverged (finite weights, NaN outputs: weights blown up until the forward pass
    overflows) was logged as "val loss nan, top-1 33.33 %", marked best and saved as best.*, with bare NaN in
    metrics.jsonl; `eval` printed that top-1 with exit 0 and `predict` printed nan% for arbitrary classes."""
    ck = torch.load(world["best_pt"], weights_only=True)
    for part in ("model", "model_ema"):
        if ck.get(part):
            key = next(k for k in ck[part] if k.endswith("qkvs.0.conv.weight"))
            ck[part][key] = ck[part][key] * 1e37  # finite, and the outputs overflow
    diverged = tmp_path / "diverged.pt"
    torch.save(ck, diverged)
    assert main(["eval", "--data", str(world["data"]), "--checkpoint", str(diverged), "-j", "0"]) == 2
    assert "not finite on" in capsys.readouterr().err
    image = str(world["data"] / "val" / "class_0" / "0.png")
    assert main(["predict", image, "--checkpoint", str(diverged)]) == 2
    assert "outputs on" in capsys.readouterr().err
    # in training: the epoch whose validation outputs are not finite stops the run, and nothing of it is kept
    real = engine.evaluate
    calls = []

    def diverging(*args, **kwargs):
        calls.append(1)
        return {**real(*args, **kwargs), "nonfinite": 1} if len(calls) == 2 else real(*args, **kwargs)

    monkeypatch.setattr(engine, "evaluate", diverging)
    out = tmp_path / "run"
    with pytest.raises(ValueError, match="after epoch 2 the model's outputs are not finite on 1 of"):
        train(tiny(data=str(world["data"]), epochs=3, output=str(out), model_ema=False))
    assert ckpt_io.load(out / "last.pt")["next_epoch"] == 1 and len(engine.records.read_metrics(out / "metrics.jsonl")) == 1


def test_validation_on_the_training_split_is_refused(world, tmp_path, capsys):
    """`--val-split train` (or ./train, or a link to it) trained and validated on the same images without a word,
    and chose best.* on them."""
    data = tmp_path / "data"
    shutil.copytree(world["data"], data)
    (data / "same").symlink_to(data / "train")
    for split in ("train", "./train", "same"):
        out = tmp_path / f"run-{split.strip('./')}"
        assert main(["train", "--data", str(data), *TINY_ARGV, "--epochs", "1", "--val-split", split,
                     "--output", str(out)]) == 2
        assert "are the same folder" in capsys.readouterr().err and not out.exists()


def test_a_run_stopped_mid_epoch_resumes_with_its_own_batch_size(world, tmp_path, sigterm_after):
    """Resumed mid-epoch with another --batch-size, a run skipped updates x the new batch images: some never
    trained on, without a word (or, with a larger batch, "made no update")."""
    out = tmp_path / "run"
    with sigterm_after(2):
        stopped = train(tiny(data=str(world["data"]), epochs=1, batch_size=4, output=str(out)))
    assert stopped.interrupted and ckpt_io.load(out / "last.pt")["next_step"] == 2
    # its summary names the files it wrote, and no others (it named best.pt, best.safetensors and curves.png)
    assert (stopped.last, stopped.checkpoint, stopped.weights, stopped.curves) == (str(out / "last.pt"), None, None, None)
    with pytest.raises(ValueError, match="after 2 updates of batch 4: resume it with --batch-size 4"):
        train(TrainConfig.resume_from(out / "last.pt", batch_size=6))
    assert train(TrainConfig.resume_from(out / "last.pt")).epochs == 1


def test_train_offers_the_trust_opt_in_it_names(world, tmp_path, capsys):
    """A pickled --finetune file was refused with a message naming --trust-checkpoint, which `cgavit train` lacked."""
    weights = torch.load(world["best_pt"], weights_only=True)["model"]
    pickled = tmp_path / "official.pth"  # weights beside a pickled object (here a harmless call), as old files hold
    torch.save({"model": weights, "args": _Foreign()}, pickled)
    run = ["train", "--data", str(world["data"]), *TINY_ARGV, "--epochs", "1", "--finetune", str(pickled)]
    assert main([*run, "--output", str(tmp_path / "a")]) == 2
    assert "--trust-checkpoint" in capsys.readouterr().err
    assert main([*run, "--output", str(tmp_path / "b"), "--trust-checkpoint"]) == 0
    assert ckpt_io.load(tmp_path / "b" / "last.pt")["args"]["trust_checkpoint"] is True
    resumed = TrainConfig.resume_from(tmp_path / "b" / "last.pt")
    assert resumed.trust_checkpoint is False  # one invocation's choice, never taken over


def test_ema_asked_of_a_file_without_it_says_so(world, caplog):
    """`eval --ema` / `predict --ema` on a file without EMA weights used the plain ones without a word."""
    with caplog.at_level(logging.WARNING, logger="cgavit"):
        load_model(world["best_st"], use_ema=True)
    assert "holds no EMA weights" in caplog.text and "--ema changes nothing" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="cgavit"):
        load_model(world["best_pt"], use_ema=True)  # a training checkpoint that kept them
        load_model(world["best_st"])
    assert "EMA" not in caplog.text


def test_files_left_out_of_a_split_are_named(world, tmp_path, caplog):
    """A .jfif or .avif photo, or an image saved without a suffix, was left out of training without a word."""
    from cgavit.train.data import list_split

    data = tmp_path / "data"
    shutil.copytree(world["data"], data)
    photo = (data / "train" / "class_0" / "0.png").read_bytes()
    (data / "train" / "class_0" / "phone.jfif").write_bytes(photo)
    (data / "train" / "class_1" / "scan").write_bytes(photo)
    (data / "train" / "class_1" / ".DS_Store").write_bytes(b"\0")  # hidden: not the user's images
    with caplog.at_level(logging.WARNING, logger="cgavit"):
        _, samples = list_split(data, "train")
    assert "2 file(s) in" in caplog.text and "phone.jfif" in caplog.text and "scan" in caplog.text
    assert ".DS_Store" not in caplog.text and not any("phone" in path for path, _ in samples)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="cgavit"):
        list_split(world["data"], "train")
    assert "left out" not in caplog.text


# ------------------------------------------------------------------------------ review 4, the training side
def _cgavit(*argv: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """``cgavit ARGV`` in a process of its own (one thread), under ``timeout``: a hang fails, never stalls the suite."""
    return subprocess.run([sys.executable, "-m", "cgavit", *argv], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})


def test_strict_with_loader_workers_stops_with_one_line(tmp_path):
    """`--strict` with loader workers printed the error (torch's worker traceback flattened into one line), then
    hung for ever: the workers ignore SIGTERM, and Python's exit joined them."""
    data = make_folder(tmp_path / "ds", classes=2, train=4, val=2)
    broken = data / "val" / "class_0" / "broken.png"
    broken.write_bytes(b"\x89PNG\r\n\x1a\nxxxx")
    train(tiny(data=str(data), epochs=1, output=str(tmp_path / "run"), mixup=0, cutmix=0))  # skips it
    says = f"cannot read image {broken}: cannot identify an image format in it (run without --strict to skip unreadable images)"
    runs = {
        "eval": ["eval", "--data", str(data), "--checkpoint", str(tmp_path / "run" / "best.pt"), "--strict", "-j", "1"],
        "train": ["train", "--data", str(data), *TINY_ARGV, "--epochs", "1", "--strict", "--workers", "1",
                  "--output", str(tmp_path / "strict")],
    }
    for command, argv in runs.items():
        proc = _cgavit(*argv, timeout=90)
        assert proc.returncode == 2, proc.stderr[-3000:]
        assert [line for line in proc.stderr.splitlines() if "error" in line] == [f"cgavit {command}: error: {says}"]


_RAISING_WORKER_CHILD = """
from torch.utils.data import Dataset
from cgavit.train.data import make_loader

class Broken(Dataset):
    def __len__(self):
        return 4

    def __getitem__(self, index):
        raise RuntimeError("a bug in the dataset")

try:
    for batch in make_loader(Broken(), 2, range(4), 1):
        pass
except RuntimeError as err:
    print("raised", "a bug in the dataset" in str(err))
"""


def test_an_exception_in_a_loader_worker_leaves_no_worker_behind():
    """Any exception from a worker kept the loader's iterator, and so its workers (which ignore SIGTERM), alive
    until Python's exit, which then waited on them for ever."""
    proc = subprocess.run([sys.executable, "-c", _RAISING_WORKER_CHILD], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0 and proc.stdout.split() == ["raised", "True"], proc.stderr[-3000:]


def _lrs(run: Path) -> list[float]:
    return [row["lr"] for row in engine.records.read_metrics(run / "metrics.jsonl")]


@pytest.mark.parametrize("per_update", [False, True])
def test_a_resume_trains_the_schedule_it_asks_for(tmp_path, per_update):
    """`--resume last.pt --epochs 4 --lr 0.05 --min-lr 0.001` logged and recorded the new options, but the checkpoint's
    scheduler replaced the one they built: the cosine kept its old length and values, and every epoch past the old
    end trained at the old --min-lr. Per update, the schedule was counted in the batches of the run before."""
    data = make_folder(tmp_path / "ds", classes=2, train=8, val=1)
    common = dict(data=str(data), warmup_epochs=1, model_ema=False, sched_on_updates=per_update)
    train(tiny(**common, epochs=2, lr=0.01, output=str(tmp_path / "short")))
    new = dict(epochs=4, lr=0.05, min_lr=1e-3, batch_size=8 if per_update else 4)
    train(TrainConfig.resume_from(tmp_path / "short" / "last.pt", **new, workers=0))
    train(tiny(**common, **new, output=str(tmp_path / "long")))
    resumed, fresh = _lrs(tmp_path / "short"), _lrs(tmp_path / "long")
    assert len(resumed) == 4 and resumed[2:] == pytest.approx(fresh[2:], rel=1e-9), (resumed, fresh)
    assert resumed[3] > 1e-3  # on the new cosine, not at its end


def test_a_demo_with_another_seed_replaces_the_split(tmp_path):
    """A second demo into the same folder with another --seed wrote its split over the first one's images without
    removing them: it trained on 1729 images and reported 652 "held-out" ones, 584 of which it had trained on."""
    from cgavit.train.demo import write_digits

    root = tmp_path / "data"
    write_digits(root, seed=0)
    (root / "train" / "3" / "mine.png").write_bytes(b"not the demo's")  # not a name the demo writes: kept, refused
    with pytest.raises(ValueError, match=r"holds what the demo did not write \(3/mine.png\)"):
        write_digits(root, seed=1)
    (root / "train" / "3" / "mine.png").rename(tmp_path / "mine.png")
    split = write_digits(root, seed=1)
    files = {s: {p.relative_to(root / s) for p in (root / s).rglob("[0-9]*.png")} for s in ("train", "val")}
    assert (len(files["train"]), len(files["val"])) == (split["train"], split["val"]) == (1437, 360)
    assert not files["train"] & files["val"]
    assert json.loads((root / "SPLIT.json").read_text())["seed"] == 1
    # any --seed that cgavit train takes: one above 2**32 stopped with scikit-learn's 'random_state' message
    assert write_digits(root, seed=2**32 + 1)["train"] == 1437 and not files["train"] ^ {
        p.relative_to(root / "train") for p in (root / "train").rglob("[0-9]*.png")}  # seed 1's split: the same images


def test_a_demo_checks_its_data_folder_holds_its_split(tmp_path):
    """An 11th class folder was trained on while the report said 10 classes; a removed class folder stopped every
    later demo ("name different classes") after the earlier report was deleted."""
    from cgavit.train.demo import write_digits

    root = tmp_path / "data"
    write_digits(root)
    shutil.copytree(root / "val" / "7", root / "val" / "x")
    with pytest.raises(ValueError, match=r"holds what the demo did not write \(x\)"):
        write_digits(root)
    shutil.rmtree(root / "val" / "x")
    shutil.rmtree(root / "val" / "7")
    split = write_digits(root)  # the split written again, whole
    assert len(list((root / "val" / "7").iterdir())) == 36 and split["val"] == len(list((root / "val").rglob("*.png")))
    removed = sorted((root / "train" / "2").iterdir())[0]
    removed.unlink()  # one image alone
    assert write_digits(root) == split and removed.exists()
    for damaged in (b'{"train": 14', b"\xff\xfe"):  # a hand's edit cut short: 'Expecting ...' stopped every demo
        (root / "SPLIT.json").write_bytes(damaged)
        assert write_digits(root) == split and json.loads((root / "SPLIT.json").read_text()) == split


def test_a_demo_data_folder_in_the_way_is_named(tmp_path):
    """A file where the demo's data folder goes stopped it with NotADirectoryError's traceback (SPLIT.json's unlink),
    and a folder named SPLIT.json with '[Errno 21] Is a directory'."""
    from cgavit.io import WriteError
    from cgavit.train.demo import write_digits

    (tmp_path / "data").write_text("mine")
    with pytest.raises(WriteError, match="cannot create the demo data folder .*data is a file, not a folder"):
        write_digits(tmp_path / "data")
    assert (tmp_path / "data").read_text() == "mine"
    (tmp_path / "other" / "SPLIT.json").mkdir(parents=True)
    with pytest.raises(ValueError, match="holds a SPLIT.json that is no file .*; move it away"):
        write_digits(tmp_path / "other")
    assert sorted(p.name for p in (tmp_path / "other").iterdir()) == ["SPLIT.json"]


def test_a_warm_up_as_long_as_the_run_is_warned_about(tmp_path, caplog):
    """With the default 5 warm-up epochs, a run of 5 epochs or fewer never reached its peak lr (an --epochs 1 run
    trained entirely at --warmup-lr 1e-6), while the log said "lr 1.00e-02"; nothing said so."""
    data = make_folder(tmp_path / "ds", classes=2, train=4, val=1)
    with caplog.at_level(logging.WARNING, logger="cgavit"):
        train(tiny(data=str(data), epochs=2, warmup_epochs=2, lr=0.01, output=str(tmp_path / "a"), model_ema=False))
    assert "--warmup-epochs 2 is not shorter than --epochs 2" in caplog.text and "never reaches its peak 1.00e-02" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="cgavit"):
        train(tiny(data=str(data), epochs=2, warmup_epochs=1, lr=0.01, output=str(tmp_path / "b"), model_ema=False))
    assert "warm-up" not in caplog.text


@pytest.mark.parametrize("argv, says", [
    (["--aa", "randaugment"], "--aa 'randaugment' is no timm auto-augment policy"),
    (["--aa", "rand-q9"], "--aa 'rand-q9' is no timm auto-augment policy (Unknown RandAugment config section)"),
    (["--aa", "rand-m9-mstd0.5-incl"], "--aa 'rand-m9-mstd0.5-incl': timm skips its section 'incl' without a word"),
    (["--aa", "rand-m9-tfoo"], "--aa 'rand-m9-tfoo': timm skips its section 'tfoo' without a word"),
    (["--smoothing", "1"], "--smoothing must be within 0.0..1.0 (below 1.0), got 1.0"),
    (["--smoothing", "1", "--mixup", "0", "--cutmix", "0"], "--smoothing must be within"),
    (["--drop-path", "1.0"], "--drop-path must be within 0.0..1.0 (below 1.0), got 1.0"),
])
def test_options_timm_would_assert_on_are_one_line_before_anything_is_written(tmp_path, capsys, argv, says):
    """An unknown --aa policy and --smoothing 1 passed the option checks, made the run folder, then ended in timm's
    AssertionError traceback (exit 1); with mixup on, --smoothing 1 trained towards uniform targets without a word.
    A policy section timm reads as nothing (``incl`` for ``inc1``, an unknown op set) was dropped without a word, and
    the run trained another policy than the one it recorded.
    --drop-path 1.0 was refused by the model under another name than the flag."""
    data = make_folder(tmp_path / "ds", classes=2, train=2, val=1)
    out = tmp_path / "run"
    assert main(["train", "--data", str(data), *TINY_ARGV, "--epochs", "1", "--output", str(out), *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"cgavit train: error: {says}"), err
    assert not out.exists()


def test_a_dataset_of_one_class_is_refused(tmp_path, capsys):
    """With a single class folder a run reported "train loss 0.0000, top-1 100.00%" and saved best.* as a model."""
    data = make_folder(tmp_path / "ds", classes=1, train=4, val=1)
    out = tmp_path / "run"
    assert main(["train", "--data", str(data), *TINY_ARGV, "--epochs", "1", "--output", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"cgavit train: error: {data / 'train'} has one class folder (class_0): a classifier of one class has "
                   "nothing to learn and scores 100 %; add a folder of images for each other class (DIR/train/<class>/)"]
    assert not out.exists()


def test_a_run_started_with_relative_paths_resumes_from_any_folder(tmp_path, monkeypatch):
    """`--data small` was recorded as typed, so `--resume` from another working directory said "data folder small
    does not exist" (the run folder is found from the checkpoint's place, the data was not)."""
    make_folder(tmp_path / "ds", classes=2, train=4, val=1)
    teacher = tmp_path / "teacher.safetensors"
    monkeypatch.chdir(tmp_path)
    assert TrainConfig(data="ds", teacher="teacher.safetensors").to_record()["teacher"] == "teacher.safetensors"  # a name
    teacher.write_bytes(b"")
    assert TrainConfig(data="ds", teacher="teacher.safetensors").to_record()["teacher"] == str(teacher)  # a file
    train(tiny(data="ds", epochs=1, output="run", model_ema=False))
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    assert train(TrainConfig.resume_from(tmp_path / "run" / "last.pt", epochs=2, workers=0)).epochs == 2
    assert ckpt_io.load(tmp_path / "run" / "last.pt")["args"]["data"] == str(tmp_path / "ds")


def test_a_run_stopped_mid_epoch_resumes_with_its_own_number_of_processes(tmp_path, sigterm_after):
    """A run stopped mid-epoch under 2 processes resumed in 1 (or the other way) without a word: the updates
    already made were skipped from another sampler order, and the processes' random states were dropped."""
    data = make_folder(tmp_path / "ds", classes=2, train=8, val=1)
    out = tmp_path / "run"
    with sigterm_after(2):
        assert train(tiny(data=str(data), epochs=1, output=str(out))).interrupted
    ck = ckpt_io.load(out / "last.pt")
    ckpt_io.save(out / "last.pt", {**ck, "world_size": 2})  # as a run of two processes leaves it
    with pytest.raises(ValueError, match=r"after 2 updates of 2 process\(es\): resume it with 2 process\(es\)"):
        train(TrainConfig.resume_from(out / "last.pt", workers=0))
    ckpt_io.save(out / "last.pt", ck)
    assert train(TrainConfig.resume_from(out / "last.pt", workers=0)).epochs == 1


def test_a_teacher_of_other_classes_is_refused(tmp_path):
    """A teacher trained here on other classes (the same count) was distilled from index by index without a word."""
    data = make_folder(tmp_path / "ds", classes=2, train=4, val=1)
    other = make_folder(tmp_path / "other", classes=2, train=4, val=1)
    for split in ("train", "val"):
        (other / split / "class_1").rename(other / split / "cat")
    train(tiny(data=str(other), epochs=1, output=str(tmp_path / "teacher"), model_ema=False))
    teacher = tmp_path / "teacher" / "best.safetensors"
    out = tmp_path / "run"
    with pytest.raises(ValueError, match=r"was trained on other classes than .*'cat' is not among them; 'class_1' is missing"):
        train(tiny(data=str(data), epochs=1, output=str(out), distillation_type="hard", teacher=str(teacher)))
    assert not out.exists()  # the refused run's folder, made by it and left empty, is gone


def test_a_run_refused_before_training_leaves_no_folder_of_its_own(tmp_path, monkeypatch):
    """A run refused before training (here fewer images than a batch) left its folder with an empty train.log, and
    each retry a new runs/<model>-<time> one; the folders above its own that it made stayed too. A folder the user
    made is kept, with whatever it held."""
    data = make_folder(tmp_path / "ds", classes=2, train=2, val=1)
    monkeypatch.chdir(tmp_path)
    for _ in range(2):
        with pytest.raises(ValueError, match="fewer than one batch"):
            train(tiny(data=str(data), epochs=1, batch_size=8, output=""))
    assert not (tmp_path / "runs").exists()
    (tmp_path / "runs").mkdir()
    with pytest.raises(ValueError, match="fewer than one batch"):
        train(tiny(data=str(data), epochs=1, batch_size=8, output=""))
    assert list((tmp_path / "runs").iterdir()) == []  # the user's runs folder stays
    (tmp_path / "a").mkdir()
    with pytest.raises(ValueError, match="fewer than one batch"):
        train(tiny(data=str(data), epochs=1, batch_size=8, output=str(tmp_path / "a" / "b" / "c" / "run")))
    assert list((tmp_path / "a").iterdir()) == []
    mine = tmp_path / "mine"
    mine.mkdir()
    with pytest.raises(ValueError, match="fewer than one batch"):
        train(tiny(data=str(data), epochs=1, batch_size=8, output=str(mine)))
    assert mine.is_dir()
    (mine / "train.log").write_text("notes\n")
    with pytest.raises(ValueError, match="fewer than one batch"):
        train(tiny(data=str(data), epochs=1, batch_size=8, output=str(mine)))
    assert (mine / "train.log").read_text() == "notes\n"
    with pytest.raises(ValueError, match="fewer than one batch"):
        train(tiny(data=str(data), epochs=1, batch_size=8, output=str(tmp_path / "new")))
    assert not (tmp_path / "new").exists()


def test_repeated_augmentation_that_leaves_a_process_less_than_a_batch_is_refused(tmp_path):
    """Under torchrun, repeated augmentation trains each process on a share of a multiple of 256 images (DeiT's
    sampler): 260 images, 2 processes and --batch-size 130 passed the one-batch-per-process check, then every epoch
    made no update (each process's 128 images are less than a batch) and the run stopped after building everything,
    blaming unreadable images."""
    from cgavit.train.data import check_layout
    from cgavit.train.recipe import build_loaders

    data = make_folder(tmp_path / "ds", classes=2, train=130, val=1, size=8)
    layout, two = check_layout(str(data), "train", "val"), DistEnv(rank=0, world=2)
    with pytest.raises(ValueError, match="each of the 2 processes trains on 128 of the 260 images an epoch, fewer than one "
                                         "batch of 130; lower --batch-size, or give --aug-repeats 0"):
        build_loaders(tiny(data=str(data), batch_size=130), two, layout)
    assert len(build_loaders(tiny(data=str(data), batch_size=130, aug_repeats=0), two, layout).train) == 1
    assert len(build_loaders(tiny(data=str(data), batch_size=64), two, layout).train) == 2


def test_a_run_that_fails_once_training_began_keeps_its_folder_and_log(tmp_path, monkeypatch):
    """The clean-up of a refused run's folder also deleted the log of a run that failed during its first epoch
    (out of memory, a loader crash, a diverged model), the log that says what it did before."""
    data = make_folder(tmp_path / "ds", classes=2, train=4, val=1)

    def crash(run, epoch, *args):
        engine.log.warning("epoch %d under way", epoch + 1)
        raise RuntimeError("out of memory (simulated)")

    monkeypatch.setattr(engine, "train_one_epoch", crash)
    out = tmp_path / "new" / "run"
    with pytest.raises(RuntimeError, match="simulated"):
        train(tiny(data=str(data), epochs=1, output=str(out)))
    assert "epoch 1 under way" in (out / "train.log").read_text()


def test_commands_the_demo_prints_can_be_pasted_into_a_shell(tmp_path, monkeypatch, capsys):
    """With `--output "demo dir"` the demo printed `cgavit predict demo dir/data/val/7/0017.png --checkpoint demo
    dir/run/model.safetensors` (and `--resume demo dir/...` when stopped): pasted, the shell splits the paths."""
    import shlex

    import cgavit.cli.train as cli_train
    from cgavit.train.demo import summary_lines

    out = tmp_path / "demo dir"
    (out / "data" / "val" / "7").mkdir(parents=True)
    (out / "data" / "val" / "7" / "0017.png").write_bytes(b"")
    weights = str(out / "run" / "model.safetensors")
    report = {"held_out_top1": 90.0, "held_out_images": 360, "held_out_top5": 99.0, "epochs": 1, "train_wall_s": 1.0,
              "total_cpu_s": 1.0, "curves": "c", "checkpoint": "k", "weights": weights}
    line = next(line for line in summary_lines(report, out) if line.startswith("try:"))
    assert shlex.split(line[len("try:"):]) == ["cgavit", "predict", str(out / "data/val/7/0017.png"), "--checkpoint", weights]
    last = str(out / "run" / "last.pt")
    monkeypatch.setattr(cli_train, "run_demo", lambda *a, **k: {"interrupted": True, "signal": 15, "last": last})
    assert main(["demo", "--epochs", "1"]) == 143
    said = capsys.readouterr().out.strip().split("continue it with: ")[1]
    assert shlex.split(said) == ["cgavit", "train", "--resume", last]


# ------------------------------------------------------------------------------ review 8, the training side
def test_linked_folders_count_and_hidden_folders_do_not(world, tmp_path, caplog):
    """A linked sub-folder of a class folder was left out without a word (torchvision's ImageFolder follows it), and
    the images of a hidden sub-folder were counted, though hidden files are not."""
    from cgavit.analysis.data import list_images
    from cgavit.train.data import list_split

    data = tmp_path / "data"
    shutil.copytree(world["data"], data)
    extra, hidden = tmp_path / "extra", data / "train" / "class_0" / ".thumbs"
    extra.mkdir()
    hidden.mkdir()
    photo = world["image"].read_bytes()
    for i in range(2):
        (extra / f"more{i}.png").write_bytes(photo)
        (hidden / f"thumb{i}.png").write_bytes(photo)
    (data / "train" / "class_0" / "linked").symlink_to(extra, target_is_directory=True)
    (extra / "loop").symlink_to(data / "train" / "class_0", target_is_directory=True)  # a link loop ends
    _, samples = list_split(data, "train")
    class_0 = sorted(Path(path).name for path, label in samples if label == 0)
    assert class_0 == sorted(["0.png", "1.png", "2.png", "3.png", "more0.png", "more1.png"])
    files, labels, _ = list_images([data / "train"])  # the analyses find the same images
    assert sorted(p.name for p, label in zip(files, labels) if label == 0) == class_0


def test_an_odd_batch_under_mixup_is_refused(tmp_path):
    """timm's batch mixup pairs images: --batch-size 3 trained on two images of every three, without a word."""
    with pytest.raises(ValueError, match="--batch-size 3 would leave one image of every batch untrained"):
        TrainConfig(data=str(tmp_path), batch_size=3).validate()
    TrainConfig(data=str(tmp_path), batch_size=3, mixup=0.0, cutmix=0.0).validate()
    TrainConfig(data=str(tmp_path), batch_size=3, mixup_prob=0.0).validate()


def test_a_config_built_with_resume_continues_in_its_folder_and_names_what_differs(world, tmp_path, caplog):
    """``train(TrainConfig(resume=...))`` went on with the recipe's defaults (lr, warm-up, mixup ...) in a new
    runs/<model>-<time> folder, without a word."""
    run = tmp_path / "run"
    shutil.copytree(world["root"] / "run", run, ignore=shutil.ignore_patterns("run.lock"))
    cfg = TrainConfig(data=str(world["data"]), resume=str(run / "last.pt"), epochs=2, img_size=32, batch_size=4, workers=0,
                      progress=False, dials=tiny().dials)
    with caplog.at_level(logging.WARNING, logger="cgavit"):
        result = train(cfg)
    assert Path(result.output) == run  # not a new runs/<model>-<time>
    assert "with options other than the run recorded" in caplog.text and "--warmup-epochs 1 -> 5" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="cgavit"):  # resume_from takes the rest from the checkpoint: no word
        train(TrainConfig.resume_from(run / "last.pt", epochs=3, workers=0, model="efficientvit_m0.r224_in1k"))
    assert "options other than" not in caplog.text  # the same variant under another accepted name is no change


def test_a_run_recorded_with_an_odd_batch_under_mixup_resumes_with_it(world, tmp_path, monkeypatch, caplog):
    """A run started before odd batches were refused could not be resumed at all (and a mid-epoch one was told both
    'give an even --batch-size' and 'resume it with --batch-size 3')."""
    data = make_folder(tmp_path / "ds", classes=2, train=6, val=1)
    with monkeypatch.context() as old_version:
        old_version.setattr(TrainConfig, "check_batch", lambda self: None)
        train(tiny(data=str(data), batch_size=3, mixup=0.8, epochs=1, output=str(tmp_path / "run")))
    with caplog.at_level(logging.WARNING, logger="cgavit"):
        result = train(TrainConfig.resume_from(tmp_path / "run" / "last.pt", epochs=2, workers=0))
    assert result.epochs == 2 and "recorded an odd --batch-size 3 under mixup" in caplog.text
    with pytest.raises(ValueError, match="--batch-size 5 would leave one image"):  # a new odd batch is a new choice
        train(TrainConfig.resume_from(tmp_path / "run" / "last.pt", epochs=3, workers=0, batch_size=5))


@pytest.mark.parametrize("device", ["gpu", "mps", "cuda"])
def test_predict_on_a_device_that_is_not_here_is_one_line(world, device, capsys):
    if device == "cuda" and torch.cuda.is_available():
        pytest.skip("a GPU is visible")
    assert main(["predict", str(world["image"]), "--checkpoint", str(world["best_pt"]), "--device", device]) == 2
    assert capsys.readouterr().err.strip().startswith("cgavit predict: error: --device")


def test_devices_are_named_as_torch_names_them(world, monkeypatch):
    """predict took torch.device objects, 'cpu:0' and 'cuda:1' before it checked its device: keep them."""
    from cgavit.train.distributed import resolve_device

    for device in (torch.device("cpu"), "cpu:0"):
        assert "top" in predict([str(world["image"])], str(world["best_pt"]), device=device)[0]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert resolve_device("cuda:1") == torch.device("cuda", 1) and resolve_device(torch.device("cuda", 1)).index == 1
    assert resolve_device("cuda", local_rank=1) == torch.device("cuda", 1) and resolve_device("auto").type == "cuda"
    with pytest.raises(ValueError, match="there is no GPU 2"):
        resolve_device("cuda:2")


def test_an_image_too_thin_for_the_evaluation_resize_is_an_unreadable_image(world, tmp_path):
    """A 1 x 100,000 px PNG (hundreds of bytes) was resized to 256 x 25,600,000 px: 20 GB, the command's memory."""
    from cgavit.train.data import ImageFolderDataset, build_transform

    thin = tmp_path / "thin.png"
    Image.new("RGB", (100_000, 1), (120, 30, 200)).save(thin)
    assert thin.stat().st_size < 2000
    rows = predict([str(world["image"]), str(thin)], str(world["best_pt"]))
    assert "top" in rows[0] and f"image {thin}: a 100000x1 px image is too thin for the evaluation resize" in rows[1]["error"]
    ds = ImageFolderDataset([(str(thin), 0)], ["a"], build_transform(224, False))
    assert f"image {thin}: a 100000x1 px image is too thin" in ds[0].error  # the file named, as unreadable ones are
    assert build_transform(224, False).transforms[0].size == 256  # still timm's Compose, steps and all


def test_a_classifier_of_another_width_is_not_called_another_class_count(caplog):
    """"checkpoint classifier has 3 classes, the model 3: classifier left as initialised": the width differed."""
    import cgavit

    narrow = cgavit.create_model("m0", num_classes=3, embed_dim=(16, 32, 48), num_heads=(2, 2, 2))
    with caplog.at_level(logging.INFO, logger="cgavit"), pytest.raises(CheckpointError):
        cgavit.load_checkpoint(cgavit.create_model("m0", num_classes=3), narrow.state_dict())
    assert "checkpoint classifier takes 48 features, the model's 192" in caplog.text and "3 classes" not in caplog.text


def test_a_resume_into_another_folder_sets_aside_the_records_there(world, tmp_path, caplog):
    """--resume with --output another run's folder (one that left no checkpoint) cut that run's metrics.jsonl to
    the resumed epochs and presented its first row as this run's."""
    other = tmp_path / "other"
    other.mkdir()
    rows = "".join(json.dumps({"epoch": e, "train_loss": 9.0, "lr": 1e-3, "val_loss": 9.0, "val_top1": 11.0 * e,
                               "val_top5": 50.0, "img_per_s": 1.0, "epoch_s": 1.0, "skipped_images": 0}) + "\n"
                   for e in range(3))
    (other / "metrics.jsonl").write_text(rows)
    with caplog.at_level(logging.WARNING, logger="cgavit"):
        train(TrainConfig.resume_from(world["root"] / "run" / "last.pt", epochs=2, workers=0, output=str(other)))
    assert "held the records of an earlier run that left no last.pt" in caplog.text
    aside = list(other.glob("metrics-before-*.jsonl"))
    assert len(aside) == 1 and aside[0].read_text() == rows
    assert [r["epoch"] for r in engine.records.read_metrics(other / "metrics.jsonl")] == [1]


def test_a_run_resumed_elsewhere_or_finished_reports_the_whole_run(world, tmp_path, caplog):
    """Resumed into another --output, the result said 'epochs: 1' after 2 and named no best checkpoint without a
    word; a finished run resumed said final_top1 null."""
    run = tmp_path / "run"
    shutil.copytree(world["root"] / "run", run, ignore=shutil.ignore_patterns("run.lock"))
    recorded = engine.records.read_metrics(run / "metrics.jsonl")[-1]
    with caplog.at_level(logging.WARNING, logger="cgavit"):
        again = train(TrainConfig.resume_from(run / "last.pt", workers=0))  # finished: nothing to train
    assert again.epochs == 1 and again.final_top1 == recorded["val_top1"] and again.final_loss == recorded["val_loss"]
    assert "leaves nothing to train: the run is reported as it stands; give a larger --epochs" in caplog.text
    # into another folder it made one holding a log and nothing else, and said "resumed"
    with pytest.raises(ValueError, match=r"has trained its 1 epoch, and --epochs 1 leaves nothing to train; give a "
                       r"larger --epochs \(e.g. --epochs 11\) to train on \(nothing was written\)"):
        train(TrainConfig.resume_from(run / "last.pt", workers=0, output=str(tmp_path / "nothing")))
    assert not (tmp_path / "nothing").exists()
    with caplog.at_level(logging.WARNING, logger="cgavit"):
        moved = train(TrainConfig.resume_from(run / "last.pt", epochs=2, workers=0, output=str(tmp_path / "elsewhere")))
    assert moved.epochs == 2 and "the best checkpoint of the epochs before" in caplog.text


def test_eval_of_a_model_of_five_classes_or_fewer_says_top5_means_nothing(world, capsys):
    """eval printed "top-5 100.00%" beside "top-1 0.00%" for a 3-class model; --split "" evaluated val."""
    assert main(["eval", "--checkpoint", str(world["best_st"]), "--data", str(world["data"]), "--workers", "0"]) == 0
    out = capsys.readouterr().out
    assert "top-5 n/a (3 classes)" in out and "top-5 100" not in out
    assert main(["eval", "--checkpoint", str(world["best_st"]), "--data", str(world["data"]), "--split", ""]) == 2
    assert "--split must name a folder" in capsys.readouterr().err


def test_an_empty_path_is_named_as_empty(world, capsys):
    """predict "" said "image . is a folder", and save_weights(model, "") "cannot write .: Device or resource busy"."""
    assert main(["predict", "", "--checkpoint", str(world["best_st"])]) in (1, 2)
    assert "path is empty" in capsys.readouterr().err
    with pytest.raises(ValueError, match="the path to write is empty"):
        write_text("", "x")


def test_a_run_stopped_mid_epoch_says_when_its_training_split_changed(tmp_path, sigterm_after, caplog):
    """Images removed between a mid-epoch stop and its resume: the skipped positions were counted in the old split's
    order, without a word; where fewer batches remained than were skipped, the resumed epoch stopped with "epoch 1
    made no update: no batch held two or more readable images; check --data and --batch-size"."""
    data = make_folder(tmp_path / "ds", classes=2, train=8, val=1)  # 16 images, batch 4: 4 updates an epoch
    out = tmp_path / "run"
    with sigterm_after(3):
        assert train(tiny(data=str(data), epochs=2, output=str(out))).interrupted
    saved = out / "last.pt"
    stopped = saved.read_bytes()
    with caplog.at_level(logging.WARNING, logger="cgavit"):  # the same split: nothing said
        assert train(TrainConfig.resume_from(saved, workers=0)).epochs == 2
    assert "stopped mid-epoch" not in caplog.text
    saved.write_bytes(stopped)
    (out / "metrics.jsonl").unlink(missing_ok=True)
    for name in ("0.png", "1.png"):  # as many images, but others
        for c in (0, 1):
            (data / "train" / f"class_{c}" / name).rename(data / "train" / f"class_{c}" / f"renamed_{name}")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="cgavit"):
        assert train(TrainConfig.resume_from(saved, workers=0)).epochs == 2
    assert "on a training split of 16 images; it now holds 16 (other images): the rest of that epoch" in caplog.text
    saved.write_bytes(stopped)
    for path in sorted((data / "train").glob("*/*.png"))[::2]:  # half of them gone: 2 batches, 3 already made
        path.unlink()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="cgavit"):
        result = train(TrainConfig.resume_from(saved, workers=0))
    assert result.epochs == 2 and not result.interrupted
    assert "after 3 updates of epoch 1, on a training split of 16 images; it now holds 8:" in caplog.text


def test_a_run_stopped_mid_epoch_resumes_with_its_own_seed(tmp_path, sigterm_after):
    """Resumed mid-epoch with another --seed, a run skipped the positions already trained on in an order the new seed
    drew: other images than it had trained on, with only the warning that names changed options."""
    data = make_folder(tmp_path / "ds", classes=2, train=8, val=1)
    out = tmp_path / "run"
    with sigterm_after(2):
        assert train(tiny(data=str(data), epochs=1, output=str(out))).interrupted
    with pytest.raises(ValueError, match=r"after 2 updates of an order drawn with --seed 0: resume it with --seed 0 "):
        train(TrainConfig.resume_from(out / "last.pt", seed=5, workers=0))
    # one process draws no repeated augmentation: another --aug-repeats changes nothing of the order
    assert train(TrainConfig.resume_from(out / "last.pt", aug_repeats=0, workers=0)).epochs == 1


def test_a_run_stopped_before_its_best_files_were_written_writes_them_on_resume(tmp_path, monkeypatch, caplog):
    """A full disk at best.safetensors, after last.pt and best.pt of the run's best epoch: resumed, the run never wrote
    it again (no later epoch beat the one recorded as best), and ended without best.safetensors, its summary saying
    weights None."""
    from cgavit.train import engine

    data = make_folder(tmp_path / "ds", classes=2, train=4, val=1)
    out = tmp_path / "run"

    def full_disk(model, path, meta):
        raise WriteError(errno.ENOSPC, f"cannot write {path}: the disk is full (nothing was written)")

    with monkeypatch.context() as m:
        m.setattr(engine, "save_weights", full_disk)
        with pytest.raises(WriteError, match="the disk is full"):
            train(tiny(data=str(data), epochs=2, output=str(out)))
    assert sorted(p.name for p in out.glob("best*")) == ["best.pt"]
    with caplog.at_level(logging.WARNING, logger="cgavit"):
        result = train(TrainConfig.resume_from(out / "last.pt", workers=0))
    assert "best.safetensors did not hold epoch 1, the best so far" in caplog.text
    assert result.weights == str(out / "best.safetensors")
    assert read_weights_meta(out / "best.safetensors").extra["epoch"] == str(result.best_epoch)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="cgavit"):  # all in place: nothing written again
        train(TrainConfig.resume_from(out / "last.pt", workers=0))
    assert "did not hold" not in caplog.text


def test_a_demo_says_it_replaces_an_earlier_demos_results(tmp_path, monkeypatch):
    """A second `cgavit demo` removed the first one's checkpoints, report and curves without a word (its --help did
    not say so either): it now says so before they go, and a first demo says nothing of the kind."""
    from cgavit.train import demo

    def stop(cfg):
        raise KeyboardInterrupt  # the training itself is not what is checked here

    monkeypatch.setattr(demo, "train", stop)
    out = tmp_path / "demo"
    for first in (True, False):
        if not first:  # what the first demo would have left
            (out / "run").mkdir(exist_ok=True)
            (out / "run" / "last.pt").write_bytes(b"the first demo's")
            (out / "report.md").write_text("# the first demo's")
        said = []
        with pytest.raises(KeyboardInterrupt):
            demo.run_demo(out, epochs=1, say=said.append)
        assert any("replacing the earlier demo's results in" in line for line in said) is not first, said
    assert not (out / "run" / "last.pt").exists() and not (out / "report.md").exists()
