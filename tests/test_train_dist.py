"""Scale-out and signals: a 2-process torchrun (gloo) run, distributed eval == single-process eval,
SIGTERM leaves a valid checkpoint."""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import torch

from cgavit.train import checkpoint as ckpt_io
from cgavit.train import evaluate_checkpoint
from cgavit.train.distributed import DistEnv, main_rank_logs

from test_train import TINY_ARGV, make_folder


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.pop("PYTEST_XDIST_WORKER", None)
    return env


def _torchrun(*args: str, timeout: int = 240) -> subprocess.CompletedProcess:
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
        "--master_port", str(_free_port()), "-m", "cgavit", *args,
    ]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=_env())


def test_torchrun_two_processes_train_and_exact_eval(tmp_path):
    # 3 classes x 5 val images: 15 does not split evenly over 2 ranks, so padding must be dropped
    data = make_folder(tmp_path / "ds", classes=3, train=6, val=5)
    out = tmp_path / "run"
    proc = _torchrun("train", *TINY_ARGV, "--data", str(data), "--epochs", "1", "--output", str(out), "--device", "cpu",
                     "--model-ema-eval")
    assert proc.returncode == 0, proc.stderr[-3000:]
    for warning in ("--warmup-epochs 1 is not shorter than --epochs 1", "WARNING timm.scheduler"):  # TINY's, timm's
        assert proc.stderr.count(warning) == 1, proc.stderr[-3000:]  # by rank 0 (every rank said it)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 1  # written once, by rank 0
    ck = ckpt_io.load(out / "last.pt")
    assert ck["world_size"] == 2 and len(ck["rng"]) == 2 and ck["next_epoch"] == 1
    assert proc.stdout.count('"best_top1"') == 1  # only rank 0 prints the summary
    # lr follows the total batch: 1e-3 x (4 x 2) / 512 unless given; TINY gives 3e-3
    assert abs(ck["optimizer"]["param_groups"][0]["initial_lr"] - 3e-3) < 1e-12

    broken = data / "val" / "class_0" / "broken.png"
    broken.write_bytes(b"not an image")  # skipped, and warned about once
    proc = _torchrun("eval", "--checkpoint", str(out / "last.pt"), "--data", str(data), "--json", "--workers", "0", "-b", "4",
                     "--device", "cpu", "--reference", str(out / "best.safetensors"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stderr.count(f"skipped an image: cannot read image {broken}") == 1, proc.stderr[-3000:]
    dist_res = json.loads(proc.stdout.strip().splitlines()[-1])
    single = evaluate_checkpoint(data, out / "last.pt", batch_size=5, workers=0, device="cpu")
    assert dist_res["world_size"] == 2 and single["world_size"] == 1
    assert dist_res["n"] == single["n"] == 15
    assert (dist_res["agreement"], dist_res["changed"]) == (100.0, 0)  # the same weights: padding counted once
    assert dist_res["top1"] == single["top1"] and dist_res["top5"] == single["top5"]
    assert abs(dist_res["loss"] - single["loss"]) < 1e-6
    # and the metrics the run logged for its epoch are those of the weights it saved, EMA too: every rank evaluated
    # its share with rank 0's BatchNorm statistics (each rank had updated its own with its last batch)
    assert rows[0]["val_top1"] == single["top1"] and abs(rows[0]["val_loss"] - single["loss"]) < 1e-6
    ema = evaluate_checkpoint(data, out / "last.pt", batch_size=5, workers=0, device="cpu", use_ema=True)
    assert rows[0]["ema_top1"] == ema["top1"] and abs(rows[0]["ema_loss"] - ema["loss"]) < 1e-6


def test_ranks_other_than_zero_log_errors_only(caplog):
    """Under torchrun each rank logged every warning of a run (the options', timm's scheduler's, each unreadable
    image's, gathered to every rank): rank 0 now says it once; errors still come from every rank."""
    said, levels = {}, [logging.getLogger(name).level for name in ("cgavit", "timm")]
    for rank in (0, 1):
        caplog.clear()
        with caplog.at_level(logging.INFO), main_rank_logs(DistEnv(rank=rank, world=2)):
            for name in ("cgavit.train", "timm.scheduler.cosine_lr"):
                logging.getLogger(name).warning("a warning")
                logging.getLogger(name).error("an error")
        said[rank] = [(r.name, r.levelname) for r in caplog.records]
    assert said[0] == [("cgavit.train", "WARNING"), ("cgavit.train", "ERROR"),
                       ("timm.scheduler.cosine_lr", "WARNING"), ("timm.scheduler.cosine_lr", "ERROR")]
    assert said[1] == [("cgavit.train", "ERROR"), ("timm.scheduler.cosine_lr", "ERROR")]
    assert [logging.getLogger(name).level for name in ("cgavit", "timm")] == levels  # restored


def test_sigterm_saves_a_valid_checkpoint(tmp_path):
    data = make_folder(tmp_path / "ds", classes=2, train=8, val=2)
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "cgavit", "train", *TINY_ARGV, "--data", str(data), "--epochs", "500", "--output", str(out)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env())
    try:
        deadline = time.time() + 180
        while not (out / "metrics.jsonl").exists():  # training is under way once an epoch is recorded
            assert proc.poll() is None, proc.stderr.read()[-3000:]
            assert time.time() < deadline, "training did not start"
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, err[-3000:]
    assert "SIGTERM" in err and "--resume" in err
    ck = ckpt_io.load(out / "last.pt")
    assert 1 <= ck["next_epoch"] < 500
    from cgavit import load_model

    model, info = load_model(out / "last.pt")
    assert info.class_names == ["class_0", "class_1"]
    with torch.no_grad():
        assert model(torch.randn(2, 3, 32, 32)).shape == (2, 2)


def _rank_pids(parent: int) -> dict[int, int]:
    """``{rank: pid}`` of torchrun's worker processes (children of ``parent``), from their environment."""
    out = {}
    for pid in (int(p) for p in os.listdir("/proc") if p.isdigit()):
        try:
            stat = open(f"/proc/{pid}/stat").read()
            environ = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == parent:
            rank = next((int(e[5:]) for e in environ if e.startswith(b"RANK=")), None)
            if rank is not None:
                out[rank] = pid
    return out


def test_a_signal_to_one_rank_stops_every_rank_as_a_signal(tmp_path):
    """A SIGTERM to rank 1 alone stopped both ranks, but rank 0 printed "signal": null and exited 0; and every stop
    was logged once per rank, though only rank 0 logs."""
    data = make_folder(tmp_path / "ds", classes=2, train=8, val=2)
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(_free_port()), "-m", "cgavit", "train", *TINY_ARGV, "--data", str(data),
           "--epochs", "500", "--output", str(out), "--device", "cpu"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(),
                            start_new_session=True)
    try:
        deadline = time.time() + 180
        while not (out / "metrics.jsonl").exists():
            assert proc.poll() is None, proc.stderr.read()[-3000:]
            assert time.time() < deadline, "training did not start"
            time.sleep(0.2)
        os.kill(_rank_pids(proc.pid)[1], signal.SIGTERM)
        stdout, err = proc.communicate(timeout=120)  # the ranks used to hang when they disagreed at an epoch's end
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)  # torchrun and its ranks: the session this test started
    summary = json.loads(stdout[stdout.index("{"):stdout.rindex("}") + 1])  # rank 0's
    assert summary["interrupted"] and summary["signal"] == signal.SIGTERM, err[-3000:]
    assert err.count("(by SIGTERM); continue with --resume") == 1, err[-3000:]
    assert 1 <= ckpt_io.load(out / "last.pt")["next_epoch"] < 500


def _torchrun_script(script: Path, *args: str, timeout: int = 240) -> subprocess.CompletedProcess:
    """The Python file ``script`` (which runs ``cgavit`` with ``args``) under a 2-process torchrun."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(_free_port()), str(script), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=_env())


def _no_rank_traceback(err: str) -> bool:
    """Whether no rank died of a traceback (torchrun prefixes a rank's with ``[rankN]:``), such as the process
    group's "connection closed by peer" of a rank left in a collective that a failed rank never joined."""
    return not any(text in err for text in ("[rank0]:", "[rank1]:", "by peer"))


def test_an_unreadable_image_under_strict_stops_every_rank_with_its_line(tmp_path):
    """Rank 1 met the image and stopped with its line; rank 0, left in the next update's collective, died of gloo's
    "Connection reset by peer" traceback (NCCL: waited for the time-out), and its train.log never said why."""
    data = make_folder(tmp_path / "ds", classes=3, train=4, val=2)
    (data / "train" / "class_1" / "0.png").unlink()
    (data / "train" / "class_1" / "bad.png").write_bytes(b"not an image")  # 12 images: 3 batches of 2 per rank
    proc = _torchrun("train", *TINY_ARGV, "--batch-size", "2", "--aug-repeats", "0", "--strict", "--data", str(data),
                     "--epochs", "1", "--output", str(tmp_path / "run"), "--device", "cpu")
    line = f"cgavit train: error: cannot read image {data / 'train' / 'class_1' / 'bad.png'}"
    assert proc.returncode != 0 and proc.stderr.count(line) == 2, proc.stderr[-3000:]  # each rank says it
    assert _no_rank_traceback(proc.stderr), proc.stderr[-3000:]


NAN_ON_RANK_1 = """
import os, sys
from cgavit.cli import main
from cgavit.train import recipe
forward = recipe.DistillationLoss.forward
if os.environ["RANK"] == "1":  # this rank's loss alone is NaN
    recipe.DistillationLoss.forward = lambda self, *args: forward(self, *args) * float("nan")
sys.exit(main(sys.argv[1:]))
"""


def test_a_loss_that_is_not_finite_on_one_rank_stops_every_rank_with_its_line(tmp_path):
    """Rank 1 raised before its backward; rank 0 died in the gradient all-reduce with gloo's traceback."""
    data = make_folder(tmp_path / "ds", classes=3, train=4, val=2)
    script = tmp_path / "nan_on_rank_1.py"
    script.write_text(NAN_ON_RANK_1)
    proc = _torchrun_script(script, "train", *TINY_ARGV, "--aug-repeats", "0", "--data", str(data),
                            "--epochs", "1", "--output", str(tmp_path / "run"), "--device", "cpu")
    line = "cgavit train: error: the loss became nan at epoch 1, update 1; lower --lr or check the data"
    assert proc.returncode != 0 and proc.stderr.count(line) == 2, proc.stderr[-3000:]
    assert _no_rank_traceback(proc.stderr), proc.stderr[-3000:]
    assert not (tmp_path / "run" / "last.pt").exists()


def test_a_checkpoint_rank_0_cannot_write_stops_every_rank_with_its_line(tmp_path, mount_tmpfs):
    """A full disk ended rank 0 with its line, and rank 1, gone on to its next collective, with a traceback."""
    data = make_folder(tmp_path / "ds", classes=3, train=4, val=2)
    out = mount_tmpfs(size="600k") / "run"  # room for the log and metrics, not for last.pt
    proc = _torchrun("train", *TINY_ARGV, "--aug-repeats", "0", "--data", str(data), "--epochs", "2", "--output", str(out),
                     "--device", "cpu")
    line = f"cgavit train: error: cannot write {out / 'last.pt'}: the disk is full"
    assert proc.returncode != 0 and proc.stderr.count(line) == 2, proc.stderr[-3000:]
    assert _no_rank_traceback(proc.stderr), proc.stderr[-3000:]
    assert not (out / "last.pt").exists() and not list(out.glob("*.tmp*"))


def test_a_folder_holding_a_run_is_refused_with_the_same_line_by_every_rank(tmp_path):
    """Rank 1, which looks at no files, said "{out} already holds a run (); choose another --output"."""
    data = make_folder(tmp_path / "ds", classes=2, train=4, val=1)
    out = tmp_path / "run"
    out.mkdir()
    (out / "last.pt").write_bytes(b"an earlier run's")
    proc = _torchrun("train", *TINY_ARGV, "--data", str(data), "--epochs", "1", "--output", str(out), "--device", "cpu")
    line = (f"cgavit train: error: {out} already holds a run (last.pt); continue it with --resume {out / 'last.pt'}, "
            "or choose another --output (nothing in it was changed)")
    assert proc.returncode != 0 and proc.stderr.count(line) == 2, proc.stderr[-3000:]
    assert sorted(p.name for p in out.iterdir()) == ["last.pt"]


def test_eval_under_strict_stops_every_rank_with_the_line_of_an_unreadable_image(tmp_path):
    """The rank that met the image stopped with its line; the other died in the gathering of results with gloo's
    "Connection closed by peer" traceback."""
    data = make_folder(tmp_path / "ds", classes=3, train=4, val=2)
    bad = data / "val" / "class_2" / "zz.png"
    bad.write_bytes(b"not an image")
    out = tmp_path / "run"
    proc = _torchrun("train", *TINY_ARGV, "--data", str(data), "--epochs", "1", "--output", str(out), "--device", "cpu")
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc = _torchrun("eval", "--checkpoint", str(out / "last.pt"), "--data", str(data), "--workers", "0", "-b", "2",
                     "--device", "cpu", "--strict")
    line = f"cgavit eval: error: cannot read image {bad}"
    assert proc.returncode != 0 and proc.stderr.count(line) == 2, proc.stderr[-3000:]
    assert _no_rank_traceback(proc.stderr), proc.stderr[-3000:]


# `cgavit` with its args; rank 0 sends itself SIGTERM right after its STOP_AT-th optimiser step (none when unset)
STOPPED_BY_RANK_0 = """
import os, signal, sys
from torch.optim.optimizer import register_optimizer_step_post_hook
from cgavit.cli import main

stop_at, steps = int(os.environ.get("STOP_AT", "0")), 0

def after_step(optimizer, args, kwargs):
    global steps
    steps += 1
    if steps == stop_at and os.environ["RANK"] == "0":
        os.kill(os.getpid(), signal.SIGTERM)

register_optimizer_step_post_hook(after_step)
sys.exit(main(sys.argv[1:]))
"""


def test_a_mid_epoch_resume_under_two_processes_keeps_the_epochs_training_loss(tmp_path, monkeypatch):
    """The epoch's running sums were saved as each rank's share, the image count rounded down: 7 images trained on
    (an unreadable one left a batch of 3) came back as 2 x 3, and the resumed epoch's train loss read 1.198 where the
    run uninterrupted read 1.118 (the weights were the same)."""
    data = make_folder(tmp_path / "ds", classes=3, train=7, val=5)
    (data / "train" / "class_1" / "zz_bad.png").write_bytes(b"not an image")  # in rank 1's first batch, seed 2
    script = tmp_path / "stopped_by_rank_0.py"
    script.write_text(STOPPED_BY_RANK_0)
    options = [*TINY_ARGV, "--seed", "2", "--mixup", "0", "--cutmix", "0", "--aug-repeats", "0", "--data", str(data),
               "--epochs", "1", "--device", "cpu"]
    assert _torchrun_script(script, "train", *options, "--output", str(tmp_path / "full")).returncode == 0
    monkeypatch.setenv("STOP_AT", "1")
    _torchrun_script(script, "train", *options, "--output", str(tmp_path / "resumed"))
    stopped = ckpt_io.load(tmp_path / "resumed" / "last.pt")
    assert stopped["next_step"] == 1 and stopped["progress"]["partial"]["seen"] * 2 == 7  # what the test is about
    monkeypatch.delenv("STOP_AT")
    proc = _torchrun_script(script, "train", "--resume", str(tmp_path / "resumed" / "last.pt"), "--workers", "0",
                            "--device", "cpu")
    assert proc.returncode == 0, proc.stderr[-3000:]
    full, resumed = (json.loads((tmp_path / run / "metrics.jsonl").read_text()) for run in ("full", "resumed"))
    assert abs(resumed["train_loss"] - full["train_loss"]) < 1e-6, (resumed, full)
