"""The training loop: :func:`train`, which the ``cgavit train`` command and Python code share,
single-process or under ``torchrun``.

Read top to bottom: :func:`train` sets up (process group, run folder and its lock, data, network,
optimiser, schedule, mixup, losses, EMA) and runs the epochs; each epoch is
:func:`train_one_epoch` (the update loop), :func:`~cgavit.train.evaluation.evaluate`, a row in
``metrics.jsonl`` and the checkpoints (``last.pt``; ``best.pt`` and ``best.safetensors`` when top-1
improved). Only rank 0 writes files and logs below errors.

Reproducibility: randomness is keyed, not streamed. Each sample's augmentation is seeded from
``(seed, epoch, rank, position in the epoch)`` and each update's mixup and drop path from
``(seed, epoch, rank, update)``, so results do not depend on the number of loader workers, and a run
stopped at any update (SIGTERM, SIGINT) resumes by skipping the positions already trained on, ending
with the weights of an uninterrupted run."""

from __future__ import annotations

import contextlib
import logging
import math
import os
import shlex
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass, field, replace
from datetime import datetime
from pathlib import Path

import torch
from timm.data import Mixup
from timm.scheduler import CosineLRScheduler
from timm.utils import ModelEmaV3, dispatch_clip_grad, distribute_bn
from torch import nn

from ..classes import same_classes
from ..images import SkippedImages, skipped_text
from ..io import CheckpointError, DataError, make_folder, open_append, remove_stale_temporaries
from ..loading import load_checkpoint
from ..schema import check_finite
from ..weights import checked_path, read_weights_meta, save_weights
from . import checkpoint as ckpt_io
from . import records
from .config import TrainConfig, TrainResult, changed_options, check_same_network
from .data import (
    Batch, BadImageError, check_layout, epoch_seed, seed_all, split_fingerprint, unreadable_classes, until_unreadable,
)
from .distributed import (
    DistEnv, RunLock, any_each, any_true, barrier, broadcast_object, first_message, gather_objects, main_rank_logs,
    on_main, reduce_sum, setup, teardown,
)
from .evaluation import evaluate, top5_means_something, top5_text
from .recipe import (
    DistillationLoss,
    Loaders,
    build_base_loss,
    build_loaders,
    build_mixup,
    build_model,
    build_optimizer,
    build_scheduler,
    build_teacher,
    peak_lr,
    schedule_problems,
)

log = logging.getLogger("cgavit.train")

__all__ = ["Stopper", "train"]


def train(cfg: TrainConfig) -> TrainResult:
    """Run one training and return its summary (``cgavit train`` calls this).

    Safe to call repeatedly in one process: nothing global is left behind (signal handlers, log
    handlers and a process group it created are restored or removed; the global RNGs are re-seeded
    from ``cfg.seed``).

    Args:
        cfg: the options, e.g. ``TrainConfig(data="DIR", epochs=10, output="runs/a")``; to continue a
            stopped run, ``TrainConfig.resume_from("runs/a/last.pt")``.

    Raises:
        ValueError: bad options (the message says what to change).
        DataError: a bad data layout, or data that cannot train: a class of either split none of
            whose images can be read, an epoch in which no update could be made, or no validation
            image readable. No checkpoint is written.
        CheckpointError: an unreadable or damaged ``resume``, ``finetune``, ``teacher`` or
            ``teacher_weights`` file.
        BadImageError: ``strict``, and an unreadable image (one of the validation split before training starts).
    """
    cfg.validate()
    env = setup(cfg.device)
    stopper = Stopper(announce=env.is_main)
    try:
        stopper.install()
        t_start = time.perf_counter()
        resumed = ckpt_io.load(cfg.resume) if cfg.resume else None
        if resumed is not None:
            cfg = _resumed_config(cfg, resumed, env)
        _check_input_files(cfg)
        with main_rank_logs(env):  # each warning once, by rank 0
            layout = check_layout(cfg.data, cfg.train_split, cfg.val_split, order=(resumed or {}).get("classes"))
            if resumed is not None and resumed.get("classes") and not same_classes(resumed["classes"], layout["classes"]):
                raise ValueError(f"{cfg.data} has other classes than the run in {cfg.resume}; resume on the same dataset")
            existed = _existing_folders(Path(cfg.output or "runs")) if env.is_main else None
            output = _make_output(cfg, env, resumed is not None)
            cfg = replace(cfg, output=str(output))
            in_place = resumed is not None and _resumes_in_place(cfg, output)
            made = [p for p in (output, *output.parents) if p not in existed] if env.is_main else []
            fresh = output in made
            log_of = _RefusedRunLog(output, fresh)
            try:
                with RunLock(output, env), log_of, _run_log(output, env, in_place):
                    run = _checked_run(cfg, env, stopper, layout, output)
                    if resumed is not None:
                        _resume(run, resumed)
                    log_of.training = True
                    return _fit(run, t_start)
            except BaseException:
                if fresh and not log_of.training:
                    with contextlib.suppress(OSError):  # the refused run's own folders, emptied: else left as they are
                        for folder in made:  # the run folder, then each above it that the run made
                            folder.rmdir()
                raise
    finally:
        stopper.uninstall()
        teardown(env)


@dataclass
class TrainState:
    """Where the run is, and its best result so far: what a checkpoint records besides weights."""

    next_epoch: int = 0
    next_step: int = 0  # updates of next_epoch already made (0 at an epoch boundary)
    global_step: int = 0  # optimiser updates made in all
    best_top1: float = -1.0
    best_top5: float = 0.0
    best_epoch: int = -1
    partial: dict = field(default_factory=dict)  # running sums of an unfinished epoch
    rng: list | None = None  # per-rank RNG states at a mid-epoch save


@dataclass
class Run:
    """What one run trains with (built once, by :func:`_build_run`) and its :class:`TrainState`."""

    cfg: TrainConfig
    env: DistEnv
    output: Path
    classes: list[str]
    model: nn.Module  # the network itself
    net: nn.Module  # what the forward runs through: the model, or its DistributedDataParallel wrapper
    criterion: DistillationLoss
    optimizer: torch.optim.Optimizer
    scheduler: CosineLRScheduler
    scaler: torch.amp.GradScaler  # enabled for float16 AMP only; otherwise every call passes through
    ema: ModelEmaV3 | None
    mixup: Mixup | None
    loaders: Loaders
    lr: float  # peak learning rate
    stopper: Stopper
    state: TrainState = field(default_factory=TrainState)


def _checked_run(cfg: TrainConfig, env: DistEnv, stopper: Stopper, layout: dict, output: Path) -> Run:
    """The run (:func:`_build_run`) once its images are checked: a class of either split none of whose images can be
    read is refused (one decode per class and split: :func:`~cgavit.train.data.unreadable_classes`); with ``strict``,
    so is any unreadable validation image (:func:`_read_val_split`).

    Raises:
        DataError: a class with no readable image.
        BadImageError: ``strict``, and a validation image that cannot be read.
    """
    problem = unreadable_classes(layout, cfg.data, cfg.train_split, cfg.val_split) if env.is_main else None
    problem = broadcast_object(env, problem)  # every rank raises, so none waits for the others
    if problem:
        raise DataError(problem)
    run = _build_run(cfg, env, stopper, layout, output)
    if cfg.strict:
        _read_val_split(run)
    return run


def _read_val_split(run: Run) -> None:
    """Read every validation image once through the run's own loader (each rank its share, in its workers); raise
    the error of the first that cannot be read, the line the first evaluation would stop with.

    With ``strict`` this runs before training, so such an image stops the run before its first update, not at the
    first evaluation with an epoch trained and unsaved. It costs the loading half of one evaluation. The training
    split is not read ahead: it is as large as an epoch, and each image is read when it is trained on.
    """
    error = None
    try:
        for _ in run.loaders.val:
            if run.stopper.signum is not None:  # stopped meanwhile: training stops at its first update
                break
    except BadImageError as err:
        error = str(err)
    error = first_message(run.env, error)  # every rank raises, so none waits for the others
    if error:
        raise BadImageError(error)


def _build_run(cfg: TrainConfig, env: DistEnv, stopper: Stopper, layout: dict, output: Path) -> Run:
    """Seed, then build the network (fine-tuned weights loaded), data, optimiser, schedule, mixup,
    losses (with the distillation teacher), gradient scaler and EMA."""
    num_classes = len(layout["classes"])
    if cfg.amp and env.device.type != "cuda":
        log.warning("--amp works on GPU only; training in float32 on %s", env.device)
    seed_all(cfg.seed)
    model = build_model(cfg, num_classes)
    if cfg.finetune:
        report = load_checkpoint(model, cfg.finetune, trust=cfg.trust_checkpoint, expect_dropped_heads=True)
        check_finite(model.state_dict(), cfg.finetune)
        log.info("fine-tuning from %s (%d classifier tensors re-initialised)", cfg.finetune, len(report["skipped"]))
    model.to(env.device)
    loaders = build_loaders(cfg, env, layout)
    lr = peak_lr(cfg, env.world)
    for problem in schedule_problems(cfg, lr):
        log.warning("%s", problem)
    optimizer = build_optimizer(model, cfg, lr)
    scheduler = build_scheduler(optimizer, cfg, len(loaders.train))
    mixup = build_mixup(cfg, num_classes)
    teacher = build_teacher(cfg, layout["classes"], env.device) if cfg.distillation_type != "none" else None
    criterion = DistillationLoss(
        build_base_loss(cfg, mixup), teacher, cfg.distillation_type, cfg.distillation_alpha, cfg.distillation_tau
    )
    fp16 = cfg.amp and env.device.type == "cuda" and cfg.amp_dtype == "float16"
    return Run(
        cfg=cfg, env=env, output=output, classes=layout["classes"], model=model, net=model, criterion=criterion,
        optimizer=optimizer, scheduler=scheduler, scaler=torch.amp.GradScaler("cuda", enabled=fp16),
        ema=ModelEmaV3(model, decay=cfg.model_ema_decay) if cfg.model_ema else None,
        mixup=mixup, loaders=loaders, lr=lr, stopper=stopper,
    )


def _fit(run: Run, t_start: float) -> TrainResult:
    """The epochs: train one, evaluate, record, save; stop on a signal, saving where it stopped."""
    cfg, env, state, output = run.cfg, run.env, run.state, run.output
    if env.distributed:
        run.net = nn.parallel.DistributedDataParallel(run.model, device_ids=[env.local_rank] if env.device.type == "cuda" else None)
    total_epochs = cfg.epochs + cfg.cooldown_epochs
    log.info(
        "%s (%.2fM params), %d classes, %d train / %d val images, %d process(es) x batch %d, lr %.2e, %d epoch%s -> %s",
        cfg.model, sum(p.numel() for p in run.model.parameters()) / 1e6, len(run.classes), len(run.loaders.train.dataset),
        len(run.loaders.val.dataset), env.world, cfg.batch_size, run.lr, total_epochs, "" if total_epochs == 1 else "s",
        output,
    )
    rows = records.read_metrics(output / "metrics.jsonl") if env.is_main else []  # rank 0 keeps the record
    skipped = SkippedImages()  # unreadable images met so far, each warned about once
    val: dict = {}
    interrupted = False
    for epoch in range(state.next_epoch, total_epochs):
        start_step = state.next_step if epoch == state.next_epoch else 0
        stats = train_one_epoch(run, epoch, total_epochs, start_step)
        bad = dict(sorted(item for items in gather_objects(env, sorted(stats.bad.items())) for item in items))
        skipped.report(bad)
        # no update where there were batches (a resumed epoch on a smaller split may have none left)
        if stats.updates == 0 and not stats.interrupted and stats.next_step > start_step:
            raise DataError(_no_update(epoch, list(bad), len(run.loaders.train.dataset)))
        if stats.interrupted:
            _save(run, output / "last.pt", epoch, stats.next_step, mid=True)
            _report_stop(run, f"saved {output / 'last.pt'} at epoch {epoch + 1}, update {stats.next_step}")
            interrupted = True
            break
        _agree_batch_norm(run)  # every rank evaluates its share with the statistics rank 0 saves
        val = evaluate(run.model, run.loaders.val, env, autocast=_autocast(cfg, env))
        skipped.report(val["bad_errors"])
        if val["n"] == 0:
            raise DataError(
                f"none of the {len(run.loaders.val.dataset)} validation images could be read (e.g. {val['bad_paths'][0]}); "
                "fix or remove them (see the warnings) and run again"
            )
        if val["nonfinite"]:  # diverged: the epoch's weights are kept nowhere, last.pt and best.* stay as they were
            raise ValueError(
                f"after epoch {epoch + 1} the model's outputs are not finite on {val['nonfinite']} of {val['n']} "
                f"validation images (its weights diverged); lower --lr or check the data; {output / 'last.pt'} and "
                "best.* keep the epoch before, if any")
        row, is_best = _record(run, epoch, total_epochs, stats, val, len(skipped))
        if env.is_main:
            rows.append(row)
        _save(run, output / "last.pt", epoch + 1, 0, mid=False)
        if is_best:
            _save_best(run, epoch, val["top1"])
        # every rank stops where any rank was signalled; after the last epoch nothing is left to stop (or resume)
        if epoch + 1 < total_epochs and any_true(env, run.stopper.signum is not None):
            interrupted = True
            _report_stop(run, f"stopped after epoch {epoch + 1}")
            break
    barrier(env)
    on_main(env, lambda: records.plot_curves(  # rank 0's rows
        rows, output / "curves.png", title=f"{cfg.model} on {cfg.data}", top5=top5_means_something(len(run.classes))))
    return _result(run, rows, skipped, val, interrupted, t_start)


def _report_stop(run: Run, what: str) -> None:
    """A stopped run: every rank's stopper gets the signal that stopped it (the first rank's that got one; a
    collective, so every rank calls it), so that each returns it, and exits with its status, though one rank alone
    got it; rank 0 logs ``what`` and how to go on."""
    run.stopper.agree(run.env)
    if run.env.is_main:
        by = f" (by {signal.Signals(run.stopper.signum).name})" if run.stopper.signum is not None else ""
        log.warning("%s%s; continue with --resume %s", what, by, shlex.quote(str(run.output / "last.pt")))


@dataclass
class EpochStats:
    """One epoch's (or its trained part's) training figures; the sums are over ranks once it ends."""

    loss_sum: float = 0.0  # loss x images of the epoch (a resumed epoch starts from the saved sums)
    seen: float = 0  # images trained on in the epoch (a resumed one's start: the ranks' mean, a fraction maybe)
    timed: int = 0  # images trained on in this invocation, for the speed
    updates: int = 0  # optimiser updates made in this invocation (the same on every rank)
    bad: dict[str, str] = field(default_factory=dict)  # unreadable images met, this rank: path -> what was wrong
    lr: float = 0.0  # the learning rate of the last update
    seconds: float = 0.0
    next_step: int = 0  # the update to continue from
    interrupted: bool = False

    def add(self, loss: float, n: int) -> None:
        """Count one update on ``n`` images whose mean loss was ``loss``."""
        self.loss_sum += loss * n
        self.seen += n
        self.timed += n
        self.updates += 1

    @property
    def loss(self) -> float:
        return self.loss_sum / max(self.seen, 1)

    @property
    def img_per_s(self) -> float:
        return self.timed / max(self.seconds, 1e-9)


def train_one_epoch(run: Run, epoch: int, total_epochs: int, start_step: int) -> EpochStats:
    """Train epoch ``epoch`` from update ``start_step`` (0, or where a stopped run left it), stopping
    early, after the update in progress, on SIGTERM or SIGINT.

    Each update: the batch -> :func:`_update` -> progress; a per-update schedule steps before it. What stops the run at
    one rank (an unreadable image under ``strict``, a loss that is not finite) is agreed at every update with the stop
    signals, and stops every rank with that rank's line: none is left in a collective the others never join.
    """
    cfg, env, state, loader = run.cfg, run.env, run.state, run.loaders.train
    _start_epoch(run, epoch, start_step)
    steps = start_step + len(loader)
    bar = records.Progress(steps, epoch, total_epochs, env.is_main, cfg.progress, cfg.log_interval)
    resumed = state.partial if start_step > 0 else {}
    stats = EpochStats(float(resumed.get("loss_sum", 0.0)), float(resumed.get("seen", 0)), next_step=steps)
    stats.lr = run.optimizer.param_groups[0]["lr"]
    t0 = time.perf_counter()
    for step, (batch, unreadable) in enumerate(until_unreadable(loader), start=start_step):
        seed_all(epoch_seed(cfg.seed, epoch, env.rank, stream=16 + step))  # mixup, drop path: keyed to the update
        stats.bad.update(zip(batch.bad, batch.errors))
        if cfg.sched_on_updates:  # counted in this run's batches, whatever batch the epochs before had
            run.scheduler.step_update(epoch * steps + step)
        stats.lr = run.optimizer.param_groups[0]["lr"]
        # timm's batch mixup pairs images: a batch made odd by unreadable images leaves one out (--batch-size is even)
        n = len(batch) - (len(batch) % 2 if run.mixup is not None else 0)
        empty, failed = any_each(env, [n < 2, unreadable is not None])
        if failed:  # strict, and an image this rank or another could not read
            raise BadImageError(first_message(env, unreadable))
        diverged = None
        if empty:  # a batch emptied by unreadable images: every rank skips the update
            bar.update(step, 0, None, stats.lr)
        else:
            value = _update(run, batch, n)
            if not math.isfinite(value):
                diverged = f"the loss became {value} at epoch {epoch + 1}, update {step + 1}; lower --lr or check the data"
            stats.add(value, n)
            bar.update(step, n * env.world, value, stats.lr)
        stop, failed = any_each(env, [run.stopper.signum is not None, diverged is not None])
        if failed:  # nothing of the epoch is saved: last.pt keeps the point before it
            raise ValueError(first_message(env, diverged))
        if stop and step + 1 < steps:
            stats.next_step, stats.interrupted = step + 1, True
            break
    loader.sampler.start = 0
    bar.close()
    if env.device.type == "cuda":
        torch.cuda.synchronize(env.device)
    stats.seconds = time.perf_counter() - t0
    stats.loss_sum, stats.seen, stats.timed = reduce_sum(env, [stats.loss_sum, stats.seen, stats.timed])
    # each rank of the resumed epoch starts from the mean, so that their sum is the total (not rounded: 7 images / 2)
    state.partial = {"loss_sum": stats.loss_sum / env.world, "seen": stats.seen / env.world} if stats.interrupted else {}
    return stats


def _update(run: Run, batch: Batch, n: int) -> float:
    """One optimiser update on the first ``n`` images of ``batch``: mixup -> forward (AMP) -> loss (with distillation)
    -> backward -> clipping -> optimiser step -> EMA. Returns the loss, which the caller checks: under several
    processes a rank whose loss is not finite still joins the backward's gradient all-reduce, so that every rank
    reaches the check that stops them all."""
    cfg, env = run.cfg, run.env
    x = batch.images[:n].to(env.device, non_blocking=True)  # (n, 3, H, W)
    y = batch.labels[:n].to(env.device, non_blocking=True)  # (n,)
    if run.mixup is not None:
        x, y = run.mixup(x, y)  # y: (n, classes), mixed soft targets
    with _autocast(cfg, env):
        loss = run.criterion(x, run.net(x), y)  # DeiT's distillation loss when a teacher is set
    run.optimizer.zero_grad(set_to_none=True)
    run.scaler.scale(loss).backward()
    if cfg.clip_grad > 0:
        run.scaler.unscale_(run.optimizer)
        dispatch_clip_grad(run.model.parameters(), value=cfg.clip_grad, mode=cfg.clip_mode)
    run.scaler.step(run.optimizer)
    run.scaler.update()
    run.state.global_step += 1
    if run.ema is not None:
        run.ema.update(run.model, step=run.state.global_step)
    return float(loss.detach())


def _start_epoch(run: Run, epoch: int, start_step: int) -> None:
    """Key the epoch's data order and augmentation to ``(seed, epoch, rank)``; skip the updates a
    resumed epoch already trained on; step a per-epoch schedule."""
    cfg = run.cfg
    run.net.train()
    sampler = run.loaders.train.sampler  # a SeededSampler: per-sample seeds from (seed, epoch, rank, position)
    sampler.set_epoch(epoch)
    sampler.start = start_step * cfg.batch_size
    run.loaders.generator.manual_seed(epoch_seed(cfg.seed, epoch, run.env.rank, stream=3))
    if not cfg.sched_on_updates:
        run.scheduler.step(epoch)


def _agree_batch_norm(run: Run) -> None:
    """Give every rank rank 0's BatchNorm running statistics, the network's and its EMA's (timm's ``distribute_bn``,
    broadcast).

    DDP broadcasts rank 0's buffers at the start of each forward, and the forward then updates each rank's with its
    own batch: at an epoch's end every rank holds other statistics. Each rank evaluates its share of the validation
    split, so without this the epoch's figures (and the choice of ``best.pt``) would mix networks other than the one
    rank 0 saves. A collective: every rank calls it."""
    if run.env.distributed:
        distribute_bn(run.model, run.env.world, reduce=False)
        if run.ema is not None:
            distribute_bn(run.ema.module, run.env.world, reduce=False)


def _autocast(cfg: TrainConfig, env: DistEnv) -> AbstractContextManager:
    if cfg.amp and env.device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16 if cfg.amp_dtype == "bfloat16" else torch.float16)
    return contextlib.nullcontext()


def _record(run: Run, epoch: int, total_epochs: int, stats: EpochStats, val: dict, skipped: int) -> tuple[dict, bool]:
    """The epoch's metrics row (the EMA weights evaluated too when asked), logged and appended to
    ``metrics.jsonl``; whether its top-1 is the best so far (then recorded as such)."""
    cfg, state = run.cfg, run.state
    row = {
        "epoch": epoch,
        "train_loss": stats.loss,
        "lr": stats.lr,
        "val_loss": val["loss"],
        "val_top1": val["top1"],
        "val_top5": val["top5"],
        "img_per_s": stats.img_per_s,
        "epoch_s": stats.seconds,
        "skipped_images": skipped,
    }
    if run.ema is not None and cfg.model_ema_eval:
        ema_val = evaluate(run.ema.module, run.loaders.val, run.env, autocast=_autocast(cfg, run.env))
        row.update(ema_top1=ema_val["top1"], ema_top5=ema_val["top5"], ema_loss=ema_val["loss"])
    is_best = val["top1"] > state.best_top1
    if is_best:
        state.best_top1, state.best_top5, state.best_epoch = val["top1"], val["top5"], epoch
    log.info(
        "epoch %d/%d: train loss %.4f, val loss %.4f, top-1 %.2f%%, %s (best %.2f%% at %d), %.0f img/s%s",
        epoch + 1, total_epochs, stats.loss, val["loss"], val["top1"], top5_text(val["top5"], len(run.classes)), state.best_top1,
        state.best_epoch + 1, stats.img_per_s, f", {skipped_text(skipped)}" if skipped else "",
    )
    on_main(run.env, lambda: records.append_metrics(run.output / "metrics.jsonl", row))
    return row, is_best


def _no_update(epoch: int, bad: list[str], total: int) -> str:
    """What to say when an epoch trained on nothing."""
    if bad:
        return (
            f"epoch {epoch + 1} made no update: {len(bad)} of the {total} training images could not be read "
            f"(e.g. {bad[0]}), leaving no batch of two or more; fix or remove them (see the warnings) and run again"
        )
    return f"epoch {epoch + 1} made no update: no batch held two or more readable images; check --data and --batch-size"


def _result(run: Run, rows: list[dict], skipped: SkippedImages, val: dict, interrupted: bool, t_start: float) -> TrainResult:
    state, output, found = run.state, run.output, run.state.best_epoch >= 0
    if not val and rows:  # no epoch ended in this invocation (a finished run resumed): the last one recorded
        val = dict(top1=rows[-1].get("val_top1"), top5=rows[-1].get("val_top5"), loss=rows[-1].get("val_loss"))
    # epochs: counted from the run's start, also when it was resumed into another folder (whose record starts there)
    done = int(rows[-1]["epoch"]) + 1 if rows else state.next_epoch
    return TrainResult(
        best_top1=state.best_top1 if found else None,
        best_top5=state.best_top5 if found else None,
        best_epoch=state.best_epoch if found else None,
        final_top1=val.get("top1"),
        final_top5=val.get("top5"),
        final_loss=val.get("loss"),
        epochs=done if run.env.is_main else None,  # rank 0 keeps the record
        output=str(output),
        checkpoint=_written(output / "best.pt", run.env),
        last=_written(output / "last.pt", run.env),
        weights=_written(output / "best.safetensors", run.env),
        curves=_written(output / "curves.png", run.env),
        wall_s=round(time.perf_counter() - t_start, 2),
        skipped_images=len(skipped),
        interrupted=interrupted,
        signal=run.stopper.signum if interrupted else None,  # one that came as the last epoch ended stopped nothing
        world_size=run.env.world,
        classes=run.classes,
    )


def _written(path: Path, env: DistEnv) -> str | None:
    """``path`` if the run wrote it (rank 0 writes; other ranks name it), else None."""
    return str(path) if path.is_file() or not env.is_main else None


# ---------------------------------------------------------------------------------- checkpoints
def _save(run: Run, path: Path, next_epoch: int, next_step: int, mid: bool) -> None:
    """Write a training checkpoint on rank 0 (RNG states of every rank gathered first; a collective,
    so every rank calls it, and every rank raises the error of a write that fails)."""
    rngs = gather_objects(run.env, ckpt_io.rng_state(run.env.device))
    on_main(run.env, lambda: ckpt_io.save(path, _checkpoint(run, rngs, next_epoch, next_step, mid)))


def _checkpoint(run: Run, rngs: list, next_epoch: int, next_step: int, mid: bool) -> dict:
    """What a training checkpoint holds (:mod:`~cgavit.train.checkpoint`), at update ``next_step`` of ``next_epoch``;
    ``rngs``: every rank's RNG states."""
    state = run.state
    return {
        "model": run.model.state_dict(),
        "model_ema": run.ema.module.state_dict() if run.ema is not None else None,
        "optimizer": run.optimizer.state_dict(),
        "scheduler": run.scheduler.state_dict(),
        "scaler": run.scaler.state_dict() if run.scaler.is_enabled() else None,
        "next_epoch": next_epoch,
        "next_step": next_step,
        "global_step": state.global_step,
        "rng": rngs,  # used on resume only mid-epoch: every epoch start re-seeds
        "progress": {
            "best_top1": state.best_top1,
            "best_top5": state.best_top5,
            "best_epoch": state.best_epoch,
            "partial": state.partial if mid else {},
        },
        "world_size": run.env.world,
        "train_split": _train_split(run) if mid else None,  # what the positions of the unfinished epoch index
        "args": run.cfg.to_record(),
        "classes": list(run.classes),
        "saved": datetime.now().isoformat(timespec="seconds"),
    }


def _save_best(run: Run, epoch: int, top1: float) -> None:
    """``best.pt`` and ``best.safetensors`` of the run as it stands at the end of ``epoch`` (0-based), whose validation
    top-1 was ``top1`` (a collective: every rank calls it)."""
    _save(run, run.output / "best.pt", epoch + 1, 0, mid=False)
    meta = records.weights_meta(run.cfg, run.model, run.classes, {"epoch": str(epoch), "val_top1": f"{top1:.4f}"})
    on_main(run.env, lambda: save_weights(run.model, run.output / "best.safetensors", meta))


def _restore_best(run: Run, ck: dict) -> None:
    """Resuming in place at the end of the best epoch so far (``ck`` then holds its weights), write ``best.pt`` and
    ``best.safetensors`` again where they do not hold it: the run stopped between ``last.pt`` and them (a full disk, a
    kill), and no later epoch that does not beat it would ever write them. A collective."""
    state = run.state
    if ck.get("next_step") or state.best_epoch != state.next_epoch - 1 or not _resumes_in_place(run.cfg, run.output):
        return
    stale = _stale_best(run.output, int(ck.get("global_step", 0)), state.best_epoch) if run.env.is_main else None
    stale = broadcast_object(run.env, stale)
    if stale:
        log.warning("%s did not hold epoch %d, the best so far, which %s holds (their write was stopped); written again",
                    " and ".join(stale), state.best_epoch + 1, run.cfg.resume)
        _save_best(run, state.best_epoch, state.best_top1)


def _stale_best(output: Path, global_step: int, epoch: int) -> list[str]:
    """Which of ``output``'s best.pt and best.safetensors are missing, unreadable, or of another point of the run than
    update ``global_step`` at the end of ``epoch``."""
    stale = []
    try:
        if int(ckpt_io.load(output / "best.pt").get("global_step", -1)) != global_step:
            stale.append("best.pt")
    except CheckpointError:
        stale.append("best.pt")
    try:
        meta = read_weights_meta(output / "best.safetensors")
        if meta is None or meta.extra.get("epoch") != str(epoch):
            stale.append("best.safetensors")
    except (CheckpointError, OSError):
        stale.append("best.safetensors")
    return stale


def _train_split(run: Run) -> dict:
    """The fingerprint of the run's training split (:func:`~cgavit.train.data.split_fingerprint`)."""
    return split_fingerprint(run.loaders.train.dataset.samples, Path(run.cfg.data) / run.cfg.train_split)


def _check_same_split(run: Run, ck: dict) -> None:
    """Warn when a run stopped mid-epoch resumes on a training split other than the one it stopped on (images added
    or removed since): the updates it skips were counted in the old split's order, so the rest of the epoch is not
    the rest of the images."""
    recorded = ck.get("train_split")
    if not ck.get("next_step") or not isinstance(recorded, dict):
        return
    now = _train_split(run)
    if recorded != now:
        log.warning(
            "%s stopped mid-epoch, after %d updates of epoch %d, on a training split of %s images; it now holds %d%s: "
            "the rest of that epoch is drawn from the new split's order, so some of its images are trained on twice "
            "in it and others not at all (the epochs after it are whole)", run.cfg.resume, ck["next_step"],
            ck["next_epoch"] + 1, recorded.get("images"), now["images"],
            " (other images)" if recorded.get("images") == now["images"] else "")


def _check_mid_epoch(ck: dict, cfg: TrainConfig, world: int) -> None:
    """A run stopped mid-epoch goes on from the image its updates reached, counted in its own batches of its own
    processes' shares of the epoch, in the order its ``--seed`` (and, under several processes, its ``--aug-repeats``)
    drew: another ``--batch-size``, number of processes, seed or repeated augmentation would skip the wrong images (or
    run out of them), and the processes' random states would not fit. An epoch's end may change any of them."""
    step, recorded = int(ck.get("next_step", 0)), TrainConfig.from_checkpoint(ck, cfg.resume)
    if step > 0 and recorded.batch_size != cfg.batch_size:
        raise ValueError(f"{cfg.resume} stopped mid-epoch, after {step} updates of batch {recorded.batch_size}: resume it "
                         f"with --batch-size {recorded.batch_size} (a new batch size can start at an epoch's end)")
    was = ck.get("world_size", 1)
    if step > 0 and isinstance(was, int) and was != world:
        raise ValueError(f"{cfg.resume} stopped mid-epoch, after {step} updates of {was} process(es): resume it with "
                         f"{was} process(es) (torchrun --nproc_per_node {was}, or none for 1), not {world}; another "
                         "number of processes can start at an epoch's end")
    for name in ("seed", "aug_repeats") if world > 1 else ("seed",):  # repeated augmentation: several processes only
        saved, flag = getattr(recorded, name), f"--{name.replace('_', '-')}"
        if step > 0 and getattr(cfg, name) != saved:
            raise ValueError(f"{cfg.resume} stopped mid-epoch, after {step} updates of an order drawn with {flag} {saved}: "
                             f"resume it with {flag} {saved} (another can start at an epoch's end)")


def _resume(run: Run, ck: dict) -> None:
    """Load a checkpoint's weights, optimiser state and progress into ``run``; drop metric rows written after
    it. The learning-rate schedule is the one ``run`` was built with (this invocation's ``--epochs``, ``--lr``,
    ``--min-lr``, warm-up, process count): the checkpoint's ``"scheduler"`` is a record, never loaded, and the
    schedule goes on from the epoch and update the checkpoint reached. With the options unchanged that is the
    schedule of the run uninterrupted."""
    check_finite(ck["model"], run.cfg.resume)
    if ck.get("model_ema") is not None:
        check_finite(ck["model_ema"], f"{run.cfg.resume} (its EMA weights)")
    state, env = run.state, run.env
    typed = [{k: group[k] for k in OPTIMIZER_SETTINGS if k in group} for group in run.optimizer.param_groups]
    try:
        run.model.load_state_dict(ck["model"])
        if run.ema is not None:
            run.ema.module.load_state_dict(ck["model_ema"] if ck.get("model_ema") is not None else ck["model"])
        run.optimizer.load_state_dict(ck["optimizer"])
        for group, settings, peak in zip(run.optimizer.param_groups, typed, run.scheduler.base_values):
            group.update(settings)  # this invocation's, as the record says (counters such as Lookahead's stay)
            group["initial_lr"] = peak  # the schedule is this invocation's: the checkpoint gives only where it stands
        if run.scaler.is_enabled() and ck.get("scaler"):
            run.scaler.load_state_dict(ck["scaler"])
        saved = ck.get("progress") or {}
        state.next_epoch = int(ck["next_epoch"])
        state.next_step = int(ck.get("next_step", 0))
        state.global_step = int(ck.get("global_step", 0))
        state.best_top1 = float(saved.get("best_top1", -1.0))
        state.best_top5 = float(saved.get("best_top5", 0.0))
        state.best_epoch = int(saved.get("best_epoch", -1))
        state.partial = dict(saved.get("partial") or {})
        state.rng = ck.get("rng")
        if state.rng and len(state.rng) == env.world:
            ckpt_io.set_rng_state(state.rng[env.rank], env.device)
    except (RuntimeError, ValueError, KeyError, TypeError, IndexError, AttributeError) as err:
        raise CheckpointError(f"{run.cfg.resume} does not fit this model or options: {' '.join(str(err).split())[:400]}") from None
    check_optimizer_state(run.optimizer, run.cfg.resume)
    _check_same_split(run, ck)
    _restore_best(run, ck)
    on_main(env, lambda: records.truncate_metrics(run.output / "metrics.jsonl", state.next_epoch))
    log.info("resumed %s at epoch %d, update %d of it", run.cfg.resume, state.next_epoch + 1, state.next_step)


#: The optimiser settings a resumed run takes from its own options (the param groups' keys the options set); the rest
#: of a group (Lookahead's step counter, ...) is the checkpoint's.
OPTIMIZER_SETTINGS = ("weight_decay", "eps", "momentum", "betas")
#: The state every update reads as a tensor of its parameter's shape (Adam's moments, SGD's momentum); others, such
#: as Adafactor's factored row and column statistics, have shapes of their own.
PARAMETER_SHAPED_STATE = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer")


def check_optimizer_state(optimizer: torch.optim.Optimizer, source: object) -> None:
    """Refuse an optimiser state (loaded from ``source``) holding NaN or inf, or whose moments
    (:data:`PARAMETER_SHAPED_STATE`) do not have their parameter's shape: the first would make every update NaN, the
    second fail at the first update.

    Raises:
        CheckpointError: naming the file and what is wrong.
    """
    for group in optimizer.param_groups:
        for p in group["params"]:
            for key, value in optimizer.state.get(p, {}).items():
                if not torch.is_tensor(value) or value.dim() == 0:  # a step count
                    continue
                if key in PARAMETER_SHAPED_STATE and value.shape != p.shape:
                    raise CheckpointError(f"{source}: its optimiser state {key!r} is {tuple(value.shape)} for a parameter "
                                          f"of {tuple(p.shape)}; the file is damaged (resume from another checkpoint)")
                if not torch.isfinite(value).all():
                    raise CheckpointError(f"{source}: its optimiser state {key!r} holds NaN or inf; the file is damaged "
                                          "or the run had diverged (resume from an earlier checkpoint)")


# ------------------------------------------------------------------------ run folder, logs, signals
def _resumed_config(cfg: TrainConfig, resumed: dict, env: DistEnv) -> TrainConfig:
    """``cfg`` for continuing the run of the training checkpoint ``resumed``, checked against its record: the same
    network (whatever cfg says), a batch it can go on with, the options it changes named; its folder unless
    ``cfg.output`` names another."""
    recorded = TrainConfig.from_checkpoint(resumed, cfg.resume)
    check_same_network(recorded, cfg, cfg.resume)
    _check_same_state(recorded, cfg)
    _check_mid_epoch(resumed, cfg, env.world)
    changed = changed_options(recorded, cfg)
    if changed and env.is_main:  # asked for on the command line, or a TrainConfig built without resume_from
        log.warning("resuming %s with options other than the run recorded: %s (given again; in Python, "
                    "TrainConfig.resume_from takes every option not given from the checkpoint)",
                    cfg.resume, ", ".join(changed))
    if cfg.batch_size != recorded.batch_size:
        cfg.check_batch()
    elif cfg.mixes and cfg.batch_size % 2 and env.is_main:
        log.warning("the run recorded an odd --batch-size %d under mixup, which leaves one image of every "
                    "batch untrained; it continues so (give an even --batch-size when it resumes at an epoch's end)", cfg.batch_size)
    before = Path(cfg.resume).parent
    if not cfg.output:  # the run goes on in its own folder
        cfg = replace(cfg, output=str(before))
    elif env.is_main and Path(cfg.output).resolve() != before.resolve() and (before / "best.pt").exists():
        log.warning("resuming into %s: the best checkpoint of the epochs before (best.pt, best.safetensors) "
                    "stays in %s, and this folder's gets one only if a later epoch beats it", cfg.output, before)
    _check_epochs_left(resumed, cfg, env)
    _check_no_later_checkpoint(resumed, cfg)
    return cfg


def _check_same_state(recorded: TrainConfig, cfg: TrainConfig) -> None:
    """Refuse options a resumed run's state cannot take: another optimiser (its state is the recorded one's), another
    image size (the attention bias tables and the schedule's images are the recorded one's)."""
    for name, flag in (("opt", "--opt"), ("img_size", "--img-size")):
        old, new = getattr(recorded, name), getattr(cfg, name)
        if (old.lower() if isinstance(old, str) else old) != (new.lower() if isinstance(new, str) else new):
            raise ValueError(f"{flag} {new}: {cfg.resume} was trained with {flag} {old}, which its state holds; resume with "
                             f"{flag} {old}, or start a new run from its weights (--finetune {cfg.resume} {flag} {new})")


def _check_no_later_checkpoint(resumed: dict, cfg: TrainConfig) -> None:
    """Refuse to resume an earlier checkpoint (``best.pt``) in its own folder, whose ``last.pt`` is a later point of the
    run: that file and the later records would be replaced. An unreadable ``last.pt`` (the reason to resume another
    file) does not stop it."""
    last = Path(cfg.resume).parent / "last.pt"
    if Path(cfg.output).resolve() != last.parent.resolve() or Path(cfg.resume).resolve() == last.resolve() or not last.is_file():
        return
    try:
        later = ckpt_io.load(last)
    except CheckpointError:
        return
    here, there = (int(c.get("global_step", 0)) for c in (resumed, later))
    if there > here:
        raise ValueError(f"{last} is a later point of this run (update {there}) than {cfg.resume} (update {here}); "
                         f"resuming it here would replace last.pt and the records after it: resume from {last}, or "
                         "continue it in another folder (--output DIR; nothing was changed)")


def _check_epochs_left(resumed: dict, cfg: TrainConfig, env: DistEnv) -> None:
    """A finished run resumed with no epoch left: in its own folder the run is reported as it stands (said); into
    another folder, which would get a log and nothing else, refused."""
    done, total = resumed.get("next_epoch"), cfg.epochs + cfg.cooldown_epochs
    if not isinstance(done, int) or isinstance(done, bool) or done < total:
        return
    what = (f"{cfg.resume} is a run that has trained its {done} epoch{'s' if done != 1 else ''}, and --epochs {cfg.epochs}"
            f"{f' + --cooldown-epochs {cfg.cooldown_epochs}' if cfg.cooldown_epochs else ''} leaves nothing to train")
    if Path(cfg.output).resolve() != Path(cfg.resume).resolve().parent:
        raise ValueError(f"{what}; give a larger --epochs (e.g. --epochs {done + 10}) to train on (nothing was written)")
    if env.is_main:
        log.warning("%s: the run is reported as it stands; give a larger --epochs to train on", what)


def _check_input_files(cfg: TrainConfig) -> None:
    """Every file the run will read is a readable, non-empty regular file (never opening a pipe):
    checked before the run folder is made."""
    for flag, path in (("--finetune", cfg.finetune), ("--teacher-weights", cfg.teacher_weights)):
        if path:
            checked_path(path, f"{flag} file")
    if cfg.teacher and Path(cfg.teacher).exists():
        checked_path(cfg.teacher, "--teacher checkpoint")


#: The checkpoints a new run would replace: a folder holding any of them holds a run (records without
#: them are set aside instead, :func:`_run_log`).
RUN_FILES = ("last.pt", "best.pt", "best.safetensors")


def _make_output(cfg: TrainConfig, env: DistEnv, resuming: bool) -> Path:
    """The run folder (``--output``, or a new ``runs/<model>-<time>``), made by rank 0; refused when it
    is a file, or holds a run's files (:data:`RUN_FILES`: ``best.*`` without ``last.pt`` too) and this
    run does not resume that one (``--resume`` of a checkpoint in the same folder)."""
    if cfg.output:
        out = Path(cfg.output)
    else:  # made now by rank 0, so two runs started in the same second get a folder each
        out = _new_run_folder(Path("runs") / f"{cfg.model}-{datetime.now():%Y%m%d-%H%M%S}") if env.is_main else None
    out = Path(broadcast_object(env, str(out)))
    if out.exists() and not out.is_dir():
        raise ValueError(f"--output {out} is not a folder; give a folder for the run's files")
    held = [name for name in RUN_FILES if (out / name).exists()] if env.is_main else []
    taken = bool(held) and not (resuming and _resumes_in_place(cfg, out))
    held, taken = broadcast_object(env, (held, taken))  # rank 0's folder: every rank raises with its line
    if taken:
        again = (f"continue it with --resume {out / 'last.pt'}, or " if "last.pt" in held and not resuming else "")
        raise ValueError(f"{out} already holds a run ({', '.join(held)}); {again}choose another --output "
                         "(nothing in it was changed)")
    if env.is_main:
        make_folder(out, "run folder")
    return out


def _resumes_in_place(cfg: TrainConfig, output: Path) -> bool:
    """Whether the run resumes in the folder of its checkpoint (whose records it continues)."""
    return bool(cfg.resume) and output.is_dir() and Path(cfg.resume).resolve().parent == output.resolve()


class _RefusedRunLog:
    """For the block, under the run lock and around the run log: when a run that made its folder (``fresh``) is
    refused before training begins (``training`` still False: fewer images than a batch, a teacher of other
    classes), the ``train.log`` that is all it wrote there is removed, its lines having gone to the terminal too;
    the caller then removes the emptied folder, once the lock is released. Each refusal would otherwise leave a
    folder behind (and the folders above it that the run made), and a new ``runs/<model>-<time>`` one each time. A
    run that began training keeps its log."""

    def __init__(self, output: Path, fresh: bool) -> None:
        self.output, self.fresh, self.training = output, fresh, False

    def __enter__(self) -> "_RefusedRunLog":
        return self

    def __exit__(self, kind, *exc) -> None:
        if kind is None or not self.fresh or self.training:
            return
        with contextlib.suppress(OSError):  # not ours to remove after all: left as it is
            if sorted(p.name for p in self.output.iterdir()) == ["run.lock", "train.log"]:
                (self.output / "train.log").unlink()


def _existing_folders(path: Path) -> set[Path]:
    """``path`` and the folders above it, those that exist now: the run's own are the others."""
    return {p for p in (path, *path.parents) if p.exists()}


def _new_run_folder(base: Path) -> Path:
    """``base`` or, when that exists, ``base-2``, ``base-3``, ...: the first that did not, made now."""
    make_folder(base.parent, "runs folder")
    for n in range(1, 1000):
        out = base if n == 1 else base.with_name(f"{base.name}-{n}")
        try:
            out.mkdir()
            return out
        except FileExistsError:
            continue
        except OSError:
            make_folder(out, "run folder")  # raises the WriteError that says why
    raise ValueError(f"{base} and {base.name}-2 .. -999 all exist; give --output")


@contextlib.contextmanager
def _run_log(output: Path, env: DistEnv, in_place: bool) -> Iterator[None]:
    """For the block, under the run lock: on rank 0 ``train.log`` in the run folder gets the package's
    log lines (opened never through a link, never blocking on a pipe), temporaries left by an
    interrupted write are removed, and a run that does not continue this folder's records (``in_place``: it
    resumes the checkpoint in this folder) sets aside those of an earlier one that left no ``last.pt``. An error
    is raised on every rank, so none waits for the others."""
    handler, error = None, None
    if env.is_main:
        try:
            handler = logging.FileHandler(output / "train.log", delay=True)
            handler.stream = open_append(output / "train.log", "run log")
            handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
            logging.getLogger("cgavit").addHandler(handler)
            _tidy_run_folder(output, in_place)
        except (ValueError, OSError) as err:  # DataError, a link or pipe as the log, WriteError
            error = err
    error = broadcast_object(env, error)
    try:
        if error is not None:
            raise error
        yield
    finally:
        if handler is not None:
            logging.getLogger("cgavit").removeHandler(handler)
            handler.close()


def _tidy_run_folder(output: Path, in_place: bool) -> None:
    for tmp in remove_stale_temporaries(output):
        log.info("removed %s, left by an interrupted write", tmp)
    metrics = output / "metrics.jsonl"
    if records.read_metrics(metrics) and not in_place:
        aside = metrics.with_name(f"metrics-before-{datetime.now():%Y%m%d-%H%M%S}.jsonl")
        os.replace(metrics, aside)
        log.warning("%s held the records of an earlier run that left no last.pt; moved them to %s", metrics, aside.name)


class Stopper:
    """SIGTERM / SIGINT / SIGHUP set a flag the loop checks after every update (then it saves and exits);
    one the process ignores already (``nohup``) is left ignored; a second Ctrl-C raises ``KeyboardInterrupt`` at once.
    ``cgavit train`` and ``cgavit detect train`` stop so.

    Args:
        announce: log the signal as it comes (rank 0 only: a signal to the process group reaches every rank, and
            the run logs once).
    """

    def __init__(self, announce: bool = True) -> None:
        self.signum: int | None = None
        self.announce = announce
        self._old: dict[int, object] = {}

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # signal handlers can only be set from the main thread
        # SIGHUP: the terminal the run was started from closed (where the platform has it). A signal
        # ignored when the run starts stays ignored: ``nohup cgavit train`` asked to outlive the terminal.
        for sig in (signal.SIGTERM, signal.SIGINT, getattr(signal, "SIGHUP", None)):
            if sig is not None and signal.getsignal(sig) is not signal.SIG_IGN:
                self._old[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        if self.signum is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C stops at once
        self.signum = signum
        if self.announce:
            log.warning("received %s: stopping after this update and saving a checkpoint", signal.Signals(signum).name)

    def uninstall(self) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)
        self._old.clear()

    def agree(self, env: DistEnv) -> None:
        """Take the signal of the first rank that got one, on every rank (a collective: every rank calls it), so
        that each stops with it though one rank alone was signalled."""
        self.signum = next((s for s in gather_objects(env, self.signum) if s is not None), None)
