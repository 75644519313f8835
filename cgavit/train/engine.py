"""The training loop: one function, :func:`train`, that the ``cgavit train`` command and Python code
share, single-process or under ``torchrun``.

Reproducibility: randomness is keyed, not streamed. Each sample's augmentation is seeded from
``(seed, epoch, rank, position in the epoch)`` and each update's mixup and drop path from
``(seed, epoch, rank, update)``, so results do not depend on the number of loader workers, and a run
stopped at any update (SIGTERM, SIGINT) resumes by skipping the positions already trained on, ending
with the weights of an uninterrupted run."""

from __future__ import annotations

import argparse
import contextlib
import logging
import math
import os
import signal
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ..weights import CheckpointError, load_checkpoint, save_weights
from . import checkpoint as ckpt_io
from . import records
from .data import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    ImageFolderDataset,
    build_transform,
    check_layout,
    epoch_seed,
    eval_sampler,
    make_loader,
    seed_all,
    train_sampler,
)
from .distributed import DistEnv, any_true, barrier, broadcast_object, gather_objects, reduce_sum, setup, teardown
from .recipe import (
    DistillationLoss,
    add_train_args,
    args_to_dict,
    build_base_loss,
    build_mixup,
    build_model,
    build_optimizer,
    build_scheduler,
    build_teacher,
    check_args,
    finalize_args,
    merge_resumed,
    peak_lr,
)

log = logging.getLogger("cgavit.train")


def build_parser(prog: str = "cgavit train") -> argparse.ArgumentParser:
    """The ``cgavit train`` argument parser (also used by :func:`train`)."""
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Train an EfficientViT on an image-folder dataset with the official recipe (timm utilities). "
        "Runs alone or under torchrun.",
    )
    add_train_args(parser)
    return parser


def train(argv: list[str]) -> dict:
    """Run one training exactly as ``cgavit train ARGV...`` would, and return its summary.

    Safe to call repeatedly in one process: nothing global is left behind (signal handlers, log
    handlers and a process group it created are restored or removed; the global RNGs are re-seeded
    from ``--seed``).

    Args:
        argv: command-line options, e.g. ``["--data", "DIR", "--epochs", "10", "--output", "runs/a"]``.

    Returns:
        ``{"best_top1", "best_top5", "best_epoch", "final_top1", "final_top5", "final_loss",
        "epochs" (epochs completed), "output" (run folder), "checkpoint" (best.pt), "weights"
        (best.safetensors), "wall_s", "skipped_images", "interrupted", "world_size", "classes"}``.
        Metrics are percentages on the validation split, from rank 0's view (identical on all ranks).

    Raises:
        ValueError: bad options or data layout (the message says what to change).
        CheckpointError: an unreadable ``--resume`` or ``--finetune`` file.
    """
    args = build_parser().parse_args(argv)
    return run(args)


def run(args: argparse.Namespace) -> dict:
    """:func:`train` on parsed arguments (the ``cgavit train`` command calls this)."""
    args, given = finalize_args(args)
    env = setup(args.device)
    stopper = _Stopper()
    try:
        stopper.install()
        return _run(args, given, env, stopper)
    finally:
        stopper.uninstall()
        teardown(env)


class _Stopper:
    """SIGTERM / SIGINT set a flag the loop checks after every update (then it saves and exits)."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._old: dict[int, object] = {}

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # signal handlers can only be set from the main thread
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._old[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        if self.signum is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C stops at once
        self.signum = signum
        log.warning("received %s: stopping after this update and saving a checkpoint", signal.Signals(signum).name)

    def uninstall(self) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)
        self._old.clear()


@dataclass
class _State:
    """Mutable run state that goes into checkpoints."""

    next_epoch: int = 0
    next_step: int = 0
    global_step: int = 0
    best_top1: float = -1.0
    best_top5: float = 0.0
    best_epoch: int = -1
    partial: dict = field(default_factory=dict)  # running sums of an unfinished epoch
    rng: list | None = None  # per-rank RNG states at a mid-epoch save


def seed_everything(seed: int) -> None:
    """Seed python, numpy and torch (all devices)."""
    seed_all(seed)


def _file_log(output: Path) -> logging.Handler:
    handler = logging.FileHandler(output / "train.log")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.getLogger("cgavit").addHandler(handler)
    return handler


def _run(args, given, env: DistEnv, stopper: _Stopper) -> dict:
    t_start = time.perf_counter()
    resumed = None
    if args.resume:
        resumed = ckpt_io.load(args.resume)
        args = merge_resumed(args, given, resumed["args"])
        if "output" not in given:  # the run folder is where the checkpoint is now, even if moved
            args.output = str(Path(args.resume).parent)
    check_args(args)
    if not env.is_main:
        # only rank 0 logs below warnings
        quiet = logging.getLogger("cgavit")
        old_level = quiet.level
        quiet.setLevel(logging.WARNING)
    else:
        old_level = None
    handler = None
    try:
        layout = check_layout(args.data, args.train_split, args.val_split)
        classes = layout["classes"]
        if resumed is not None and resumed.get("classes") and list(resumed["classes"]) != classes:
            raise ValueError(f"{args.data} has other classes than the run in {args.resume}; resume on the same dataset")
        output = _choose_output(args, env, resumed is not None)
        args.output = str(output)
        if env.is_main:
            output.mkdir(parents=True, exist_ok=True)
        with _RunLock(output, env):
            if env.is_main:
                handler = _file_log(output)
            return _train(args, env, stopper, layout, output, resumed, t_start)
    finally:
        if handler is not None:
            logging.getLogger("cgavit").removeHandler(handler)
            handler.close()
        if old_level is not None:
            logging.getLogger("cgavit").setLevel(old_level)


class _RunLock:
    """``DIR/run.lock`` (holding the pid) while a run writes into ``DIR``, so a second run started
    on the same folder stops with a clear error instead of interleaving checkpoints and records. A
    lock left by a process that no longer exists is taken over."""

    def __init__(self, output: Path, env: DistEnv) -> None:
        self.path, self.env, self.held = output / "run.lock", env, False

    def __enter__(self) -> "_RunLock":
        error = None
        if self.env.is_main:
            error = self._acquire()
        error = broadcast_object(self.env, error)
        if error:
            raise ValueError(error)
        return self

    def _acquire(self) -> str | None:
        for _ in range(2):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            except FileExistsError:
                try:
                    pid = int(self.path.read_text().strip() or 0)
                except (OSError, ValueError):
                    pid = 0
                if pid and _alive(pid):
                    return f"another run (pid {pid}) is writing to {self.path.parent}; wait for it, stop it, or use another --output"
                self.path.unlink(missing_ok=True)  # stale: its process is gone
                continue
            with os.fdopen(fd, "w") as f:
                f.write(str(os.getpid()))
            self.held = True
            return None
        return f"could not create {self.path}"

    def __exit__(self, *exc) -> None:
        if self.held:
            self.path.unlink(missing_ok=True)
            self.held = False


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _choose_output(args, env: DistEnv, resuming: bool) -> Path:
    if args.output:
        out = Path(args.output)
    else:
        stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
        out = Path("runs") / f"{args.model}-{stamp}"
    out = Path(broadcast_object(env, str(out)))
    taken = not resuming and env.is_main and (out / "last.pt").exists()
    if broadcast_object(env, taken):  # every rank raises, so none waits for the others
        raise ValueError(
            f"{out} already holds a run (last.pt); continue it with --resume {out / 'last.pt'}, or choose another --output"
        )
    return out


def _build_data(args, env: DistEnv, layout: dict):
    """Datasets, samplers and loaders for a run."""
    mean = tuple(args.mean) if args.mean else IMAGENET_MEAN
    std = tuple(args.std) if args.std else IMAGENET_STD
    aa = None if str(args.aa).lower() in ("", "none", "off") else args.aa
    t_train = build_transform(
        args.img_size,
        True,
        auto_augment=aa,
        interpolation=args.interpolation,
        re_prob=args.reprob,
        hflip=args.hflip,
        scale=tuple(args.scale),
        color_jitter=args.color_jitter,
        mean=mean,
        std=std,
    )
    t_eval = build_transform(args.img_size, False, interpolation=args.interpolation, crop_pct=args.crop_pct, mean=mean, std=std)
    classes = layout["classes"]
    ds_train = ImageFolderDataset(layout["train"], classes, t_train, strict=args.strict)
    ds_val = ImageFolderDataset(layout["val"], classes, t_eval, strict=args.strict)
    if len(ds_train) < args.batch_size * env.world:
        raise ValueError(
            f"the train split has {len(ds_train)} images, fewer than one batch of {args.batch_size} x {env.world} "
            "process(es); lower --batch-size"
        )
    sampler = train_sampler(ds_train, env.world, env.rank, args.seed, args.aug_repeats)
    generator = torch.Generator()
    pin = env.device.type == "cuda"
    loader_train = make_loader(ds_train, args.batch_size, sampler, args.workers, drop_last=True, pin_memory=pin, generator=generator)
    loader_val = make_loader(ds_val, args.batch_size, eval_sampler(ds_val, env.world, env.rank), args.workers, pin_memory=pin)
    return loader_train, loader_val, generator


def _autocast(args, env: DistEnv):
    if args.amp and env.device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16 if args.amp_dtype == "bfloat16" else torch.float16)
    return contextlib.nullcontext()


def _train(args, env: DistEnv, stopper: _Stopper, layout: dict, output: Path, resumed: dict | None, t_start: float) -> dict:
    from timm.utils import ModelEmaV3, dispatch_clip_grad

    classes = layout["classes"]
    num_classes = len(classes)
    if args.amp and env.device.type != "cuda":
        log.warning("--amp works on GPU only; training in float32 on %s", env.device)
    seed_everything(args.seed)
    model = build_model(args, num_classes)
    if args.finetune:
        report = load_checkpoint(model, args.finetune)
        log.info("fine-tuning from %s (%d classifier tensors re-initialised)", args.finetune, len(report["skipped"]))
    model.to(env.device)
    loader_train, loader_val, generator = _build_data(args, env, layout)
    steps_per_epoch = len(loader_train)
    lr = peak_lr(args, env.world)
    if lr < args.min_lr:
        log.warning("peak lr %.2e (from the total batch) is below --min-lr %.2e: the cosine will rise, not decay; "
                    "give --lr or a lower --min-lr", lr, args.min_lr)
    optimizer = build_optimizer(model, args, lr)
    scheduler = build_scheduler(optimizer, args, steps_per_epoch)
    mixup = build_mixup(args, num_classes)
    teacher = build_teacher(args, num_classes, env.device) if args.distillation_type != "none" else None
    criterion = DistillationLoss(build_base_loss(args, mixup), teacher, args.distillation_type, args.distillation_alpha, args.distillation_tau)
    use_scaler = args.amp and env.device.type == "cuda" and args.amp_dtype == "float16"
    scaler = torch.amp.GradScaler("cuda") if use_scaler else None
    ema = ModelEmaV3(model, decay=args.model_ema_decay) if args.model_ema else None

    state = _State()
    if resumed is not None:
        _restore(resumed, model, ema, optimizer, scheduler, scaler, state)
        if state.rng and len(state.rng) == env.world:
            ckpt_io.set_rng_state(state.rng[env.rank], env.device)
        if env.is_main:
            records.truncate_metrics(output / "metrics.jsonl", state.next_epoch)
        log.info("resumed %s at epoch %d, update %d of it", args.resume, state.next_epoch + 1, state.next_step)
    net: nn.Module = model
    if env.distributed:
        net = nn.parallel.DistributedDataParallel(model, device_ids=[env.local_rank] if env.device.type == "cuda" else None)

    total_epochs = args.epochs + args.cooldown_epochs
    if env.is_main:
        n_params = sum(p.numel() for p in model.parameters())
        log.info(
            "%s (%.2fM params), %d classes, %d train / %d val images, %d process(es) x batch %d, lr %.2e, %d epochs -> %s",
            args.model, n_params / 1e6, num_classes, len(loader_train.dataset), len(loader_val.dataset), env.world,
            args.batch_size, lr, total_epochs, output,
        )
    skipped_paths: set[str] = set()
    interrupted = False
    last_val: dict = {}
    rows = records.read_metrics(output / "metrics.jsonl") if env.is_main else []
    for epoch in range(state.next_epoch, total_epochs):
        start_step = state.next_step if epoch == state.next_epoch else 0
        stats = _train_one_epoch(
            args, env, net, model, criterion, optimizer, scheduler, scaler, ema, mixup, loader_train, generator,
            epoch, total_epochs, start_step, state, stopper, dispatch_clip_grad,
        )
        bad = gather_objects(env, sorted(stats.pop("bad")))
        _report_bad({p for paths in bad for p in paths}, skipped_paths)
        if stats["interrupted"]:
            _save(output / "last.pt", env, args, classes, model, ema, optimizer, scheduler, scaler, state, epoch, stats["next_step"], mid=True)
            interrupted = True
            log.warning("saved %s at epoch %d, update %d; continue with --resume %s", output / "last.pt", epoch + 1, stats["next_step"], output / "last.pt")
            break
        val = evaluate(model, loader_val, env, autocast=_autocast(args, env))
        last_val = val
        _report_bad(val["bad_paths"], skipped_paths)
        row = {
            "epoch": epoch,
            "train_loss": stats["loss"],
            "lr": stats["lr"],
            "val_loss": val["loss"],
            "val_top1": val["top1"],
            "val_top5": val["top5"],
            "img_per_s": stats["img_per_s"],
            "epoch_s": stats["epoch_s"],
            "skipped_images": len(skipped_paths),
        }
        if ema is not None and args.model_ema_eval:
            ema_val = evaluate(ema.module, loader_val, env, autocast=_autocast(args, env))
            row.update(ema_top1=ema_val["top1"], ema_top5=ema_val["top5"], ema_loss=ema_val["loss"])
        is_best = val["top1"] > state.best_top1
        if is_best:
            state.best_top1, state.best_top5, state.best_epoch = val["top1"], val["top5"], epoch
        log.info(
            "epoch %d/%d: train loss %.4f, val loss %.4f, top-1 %.2f%%, top-5 %.2f%% (best %.2f%% at %d), %.0f img/s%s",
            epoch + 1, total_epochs, stats["loss"], val["loss"], val["top1"], val["top5"], state.best_top1,
            state.best_epoch + 1, stats["img_per_s"], f", {len(skipped_paths)} unreadable images skipped" if skipped_paths else "",
        )
        if env.is_main:
            records.append_metrics(output / "metrics.jsonl", row)
            rows.append(row)
        _save(output / "last.pt", env, args, classes, model, ema, optimizer, scheduler, scaler, state, epoch + 1, 0, mid=False)
        if is_best:
            _save(output / "best.pt", env, args, classes, model, ema, optimizer, scheduler, scaler, state, epoch + 1, 0, mid=False)
            if env.is_main:
                save_weights(model, output / "best.safetensors", _weights_metadata(args, classes, epoch, val))
        if stopper.signum is not None or _forced_stop(args, state):
            interrupted = True
            log.warning("stopped after epoch %d; continue with --resume %s", epoch + 1, output / "last.pt")
            break
    barrier(env)
    if env.is_main and rows:
        records.plot_curves(rows, output / "curves.png", title=f"{args.model} on {args.data}")
    result = {
        "best_top1": state.best_top1 if state.best_epoch >= 0 else None,
        "best_top5": state.best_top5 if state.best_epoch >= 0 else None,
        "best_epoch": state.best_epoch if state.best_epoch >= 0 else None,
        "final_top1": last_val.get("top1"),
        "final_top5": last_val.get("top5"),
        "final_loss": last_val.get("loss"),
        "epochs": len(rows) if env.is_main else None,  # rank 0 keeps the record
        "output": str(output),
        "checkpoint": str(output / "best.pt"),
        "last": str(output / "last.pt"),
        "weights": str(output / "best.safetensors"),
        "curves": str(output / "curves.png"),
        "wall_s": round(time.perf_counter() - t_start, 2),
        "skipped_images": len(skipped_paths),
        "interrupted": interrupted,
        "signal": stopper.signum,
        "world_size": env.world,
        "classes": classes,
    }
    return result


def _report_bad(paths, seen: set[str]) -> None:
    """Log each unreadable image once per run and add it to ``seen``."""
    for path in sorted(set(paths) - seen):
        log.warning("skipped unreadable image %s", path)
        seen.add(path)


def _forced_stop(args, state: _State) -> bool:
    return args.interrupt_after is not None and state.global_step >= args.interrupt_after


def _weights_metadata(args, classes: list[str], epoch: int, val: dict | None) -> dict:
    import json

    from ..cli.common import dials_from_args

    meta = {
        "model": args.model,
        "dials": json.dumps({k: list(v) if isinstance(v, tuple) else v for k, v in dials_from_args(args).items()}),
        "class_names": json.dumps(classes),
        "img_size": str(args.img_size),
        "crop_pct": str(args.crop_pct),
        "interpolation": args.interpolation,
        "mean": json.dumps(list(args.mean) if args.mean else list(IMAGENET_MEAN)),
        "std": json.dumps(list(args.std) if args.std else list(IMAGENET_STD)),
        "distillation": str(args.distillation_type != "none"),
        "epoch": str(epoch),
    }
    if val is not None:
        meta["val_top1"] = f"{val['top1']:.4f}"
    return meta


def _save(path, env, args, classes, model, ema, optimizer, scheduler, scaler, state: _State, next_epoch, next_step, mid):
    """Write a training checkpoint on rank 0 (RNG states of every rank gathered first; a collective,
    so every rank calls it)."""
    rngs = gather_objects(env, ckpt_io.rng_state(env.device))
    if not env.is_main:
        return
    ckpt_io.save(
        path,
        {
            "model": model.state_dict(),
            "model_ema": ema.module.state_dict() if ema is not None else None,
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(),
            "scaler": scaler.state_dict() if scaler is not None else None,
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
            "world_size": env.world,
            "args": args_to_dict(args),
            "classes": list(classes),
            "saved": datetime.now().isoformat(timespec="seconds"),
        },
    )


def _restore(ck: dict, model, ema, optimizer, scheduler, scaler, state: _State) -> None:
    try:
        model.load_state_dict(ck["model"])
        if ema is not None:
            if ck.get("model_ema") is not None:
                ema.module.load_state_dict(ck["model_ema"])
            else:
                ema.module.load_state_dict(ck["model"])
        optimizer.load_state_dict(ck["optimizer"])
        scheduler.load_state_dict(ck["scheduler"])
        if scaler is not None and ck.get("scaler"):
            scaler.load_state_dict(ck["scaler"])
    except (RuntimeError, ValueError, KeyError) as err:
        raise CheckpointError(f"the checkpoint does not fit this model or options: {str(err)[:400]}") from None
    progress = ck.get("progress") or {}
    state.next_epoch = int(ck["next_epoch"])
    state.next_step = int(ck.get("next_step", 0))
    state.global_step = int(ck.get("global_step", 0))
    state.best_top1 = float(progress.get("best_top1", -1.0))
    state.best_top5 = float(progress.get("best_top5", 0.0))
    state.best_epoch = int(progress.get("best_epoch", -1))
    state.partial = dict(progress.get("partial") or {})
    state.rng = ck.get("rng")


def _train_one_epoch(
    args, env, net, model, criterion, optimizer, scheduler, scaler, ema, mixup, loader, generator,
    epoch, total_epochs, start_step, state: _State, stopper: _Stopper, clip_fn,
) -> dict:
    net.train()
    sampler = loader.sampler  # a SeededSampler: per-sample augmentation seeds from (seed, epoch, rank, position)
    sampler.set_epoch(epoch)
    sampler.start = start_step * args.batch_size  # resume mid-epoch: skip what was already trained on
    generator.manual_seed(epoch_seed(args.seed, epoch, env.rank, stream=3))
    if not args.sched_on_updates:
        scheduler.step(epoch)
    steps = start_step + len(loader)
    progress = records.Progress(steps, epoch, total_epochs, env.is_main, args.progress, args.log_interval)
    partial = state.partial if start_step > 0 else {}
    loss_sum, seen, bad = float(partial.get("loss_sum", 0.0)), int(partial.get("seen", 0)), set()
    t0 = time.perf_counter()
    images_timed = 0
    lr = optimizer.param_groups[0]["lr"]
    next_step = steps
    interrupted = False
    for step, batch in enumerate(loader, start=start_step):
        # mixup and drop path draw from (seed, epoch, rank, update): independent of loader workers
        seed_everything(epoch_seed(args.seed, epoch, env.rank, stream=16 + step))
        bad.update(batch.bad)
        if args.sched_on_updates:
            scheduler.step_update(state.global_step)
        lr = optimizer.param_groups[0]["lr"]
        n = len(batch)
        if mixup is not None and n % 2:
            n -= 1  # timm's batch mixup pairs images: drop one after a skipped unreadable image
        if any_true(env, n < 2):  # a batch emptied by unreadable images: every rank skips the update
            progress.update(step, 0, None, lr)
        else:
            x = batch.images[:n].to(env.device, non_blocking=True)
            y = batch.labels[:n].to(env.device, non_blocking=True)
            if mixup is not None:
                x, y = mixup(x, y)
            with _autocast(args, env):
                out = net(x)
                loss = criterion(x, out, y)
            value = float(loss.detach())
            if not math.isfinite(value):
                raise ValueError(f"the loss became {value} at epoch {epoch + 1}, update {step + 1}; lower --lr or check the data")
            optimizer.zero_grad(set_to_none=True)
            if scaler is not None:
                scaler.scale(loss).backward()
                if args.clip_grad > 0:
                    scaler.unscale_(optimizer)
                    clip_fn(model.parameters(), value=args.clip_grad, mode=args.clip_mode)
                scaler.step(optimizer)
                scaler.update()
            else:
                loss.backward()
                if args.clip_grad > 0:
                    clip_fn(model.parameters(), value=args.clip_grad, mode=args.clip_mode)
                optimizer.step()
            state.global_step += 1
            if ema is not None:
                ema.update(model, step=state.global_step)
            loss_sum += value * n
            seen += n
            images_timed += n
            progress.update(step, n * env.world, value, lr)
        stop = stopper.signum is not None or _forced_stop(args, state)
        if any_true(env, stop) and step + 1 < steps:
            next_step, interrupted = step + 1, True
            break
    sampler.start = 0
    progress.close()
    if env.device.type == "cuda":
        torch.cuda.synchronize(env.device)
    elapsed = time.perf_counter() - t0
    loss_sum, seen, images_timed = reduce_sum(env, [loss_sum, seen, images_timed])
    state.partial = {"loss_sum": loss_sum / env.world, "seen": int(seen / env.world)} if interrupted else {}
    return {
        "loss": loss_sum / max(seen, 1),
        "lr": lr,
        "img_per_s": images_timed / max(elapsed, 1e-9),
        "epoch_s": elapsed,
        "bad": bad,
        "interrupted": interrupted,
        "next_step": next_step,
    }


@torch.no_grad()
def evaluate(model: nn.Module, loader, env: DistEnv | None = None, autocast=None) -> dict:
    """Top-1, top-5 (percent) and mean cross-entropy of ``model`` over ``loader``'s dataset.

    Under several processes each rank evaluates its share; per-sample results are gathered and the
    padding duplicates dropped by dataset index, so the metrics equal a single process's (top-1/top-5
    exactly; the loss up to float summation order, summed in float64 in index order).

    Returns:
        ``{"top1", "top5", "loss", "n", "skipped", "bad_paths"}``.
    """
    env = env or DistEnv()
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    idx, losses, hit1, hit5, bad = [], [], [], [], []
    for batch in loader:
        bad.extend(batch.bad)
        if batch.images is None:
            continue
        x = batch.images.to(device, non_blocking=True)
        y = batch.labels.to(device, non_blocking=True)
        with autocast if autocast is not None else contextlib.nullcontext():
            out = model(x)
        out = out.float()
        k = min(5, out.shape[1])
        top = out.topk(k, dim=1).indices  # (B, k)
        idx.append(batch.indices)
        losses.append(F.cross_entropy(out, y, reduction="none").double().cpu())
        hit1.append((top[:, 0] == y).cpu())
        hit5.append((top == y[:, None]).any(dim=1).cpu())
    model.train(was_training)
    cat = lambda xs, dtype: torch.cat(xs) if xs else torch.zeros(0, dtype=dtype)  # noqa: E731
    mine = (cat(idx, torch.long), cat(losses, torch.float64), cat(hit1, torch.bool), cat(hit5, torch.bool), bad)
    parts = gather_objects(env, mine)
    all_idx = torch.cat([p[0] for p in parts])
    order = torch.argsort(all_idx, stable=True)
    all_idx = all_idx[order]
    keep = torch.ones_like(all_idx, dtype=torch.bool)
    keep[1:] = all_idx[1:] != all_idx[:-1]  # padding repeats some indices on the last ranks
    pick = order[keep]
    loss = torch.cat([p[1] for p in parts])[pick]
    h1 = torch.cat([p[2] for p in parts])[pick]
    h5 = torch.cat([p[3] for p in parts])[pick]
    bad_paths = sorted({b for p in parts for b in p[4]})
    n = int(pick.numel())
    return {
        "top1": 100.0 * float(h1.double().sum()) / max(n, 1),
        "top5": 100.0 * float(h5.double().sum()) / max(n, 1),
        "loss": float(loss.sum()) / max(n, 1),
        "n": n,
        "skipped": len(bad_paths),
        "bad_paths": bad_paths,
    }
