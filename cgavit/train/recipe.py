"""The training options (named as in timm's ``train.py``) with the official EfficientViT recipe as
defaults, and the builders that turn them into timm's optimiser, scheduler, mixup, losses and EMA.

Official recipe (ImageNet-1k, 8 GPUs x 256): AdamW, lr 1e-3 x total batch / 512, weight decay 0.025
(none on attention biases, norms and biases), cosine over 300 epochs, 5 warm-up epochs from 1e-6, min
lr 1e-5, AGC clipping 0.02, RandAugment rand-m9-mstd0.5-inc1, bicubic, mixup 0.8, cutmix 1.0, label
smoothing 0.1, random erasing 0.25, repeated augmentation x3, model EMA 0.99996, seed 0.
"""

from __future__ import annotations

import argparse
import logging

import torch
import torch.nn.functional as F
from torch import nn

from ..cli.common import add_dial_args, dials_from_args

log = logging.getLogger(__name__)

# Options whose values are taken from the checkpoint on --resume unless given again.
# (flags, default, argparse keywords). Defaults are filled in by ``finalize_args`` so that the
# options a user actually typed can be told apart (they win over a resumed run's stored ones).
_OPTIONS: tuple[tuple[tuple[str, ...], object, dict], ...] = (
    # data
    (("--data",), None, dict(metavar="DIR", help="dataset root with train/<class>/ and val/<class>/ image folders")),
    (("--train-split",), "train", dict(help="training split folder name")),
    (("--val-split",), "val", dict(help="validation split folder name")),
    (("--img-size",), 224, dict(type=int, help="training and evaluation image size in pixels")),
    (("--crop-pct",), 0.875, dict(type=float, help="evaluation centre-crop fraction (resize to img_size/crop_pct first)")),
    (("--interpolation",), "bicubic", dict(choices=("bicubic", "bilinear", "nearest"), help="resize interpolation")),
    (("--mean",), None, dict(type=float, nargs=3, metavar=("R", "G", "B"), help="normalisation mean (ImageNet's)")),
    (("--std",), None, dict(type=float, nargs=3, metavar=("R", "G", "B"), help="normalisation std (ImageNet's)")),
    (("--workers", "-j"), 4, dict(type=int, help="data-loading worker processes per training process")),
    (("--strict",), False, dict(action="store_true", help="stop at the first unreadable image instead of skipping it")),
    # model
    (("--model",), "efficientvit_m0", dict(help="variant efficientvit_m0..m5 (dials below change it)")),
    (("--drop-path",), 0.0, dict(type=float, help="stochastic-depth rate")),
    (("--finetune",), None, dict(metavar="CKPT", help="start from these weights (official, timm or cgavit file); "
                                 "a classifier for another class count is replaced")),
    # optimisation
    (("--epochs",), 300, dict(type=int, help="epochs of the cosine schedule")),
    (("--cooldown-epochs",), 0, dict(type=int, help="extra epochs at --min-lr after the cosine (timm semantics). "
                                     "The official config names 10, but its DeiT loop stops at --epochs")),
    (("--batch-size", "-b"), 256, dict(type=int, help="batch size per process (official: 256 x 8 GPUs)")),
    (("--lr",), None, dict(type=float, help="peak learning rate (default: --lr-base x total batch / --lr-base-size)")),
    (("--lr-base",), 1e-3, dict(type=float, help="learning rate at the reference batch size")),
    (("--lr-base-size",), 512, dict(type=int, help="reference total batch size for --lr-base")),
    (("--opt",), "adamw", dict(help="timm optimiser name")),
    (("--opt-eps",), 1e-8, dict(type=float, help="optimiser epsilon")),
    (("--momentum",), 0.9, dict(type=float, help="momentum (SGD-type optimisers)")),
    (("--weight-decay",), 0.025, dict(type=float, help="weight decay (none on attention biases, norms, biases)")),
    (("--warmup-epochs",), 5, dict(type=int, help="linear warm-up epochs")),
    (("--warmup-lr",), 1e-6, dict(type=float, help="learning rate at the start of the warm-up")),
    (("--min-lr",), 1e-5, dict(type=float, help="learning rate at the end of the cosine")),
    (("--sched-on-updates",), False, dict(action="store_true", help="step the schedule every update instead of every epoch "
                                          "(smoother for short runs)")),
    (("--clip-grad",), 0.02, dict(type=float, help="gradient clipping value; 0 disables")),
    (("--clip-mode",), "agc", dict(choices=("agc", "norm", "value"), help="gradient clipping mode")),
    # augmentation and regularisation
    (("--aa",), "rand-m9-mstd0.5-inc1", dict(help="timm auto-augment policy; 'none' disables")),
    (("--reprob",), 0.25, dict(type=float, help="random-erasing probability")),
    (("--hflip",), 0.5, dict(type=float, help="horizontal-flip probability")),
    (("--scale",), (0.08, 1.0), dict(type=float, nargs=2, metavar=("MIN", "MAX"), help="random-resized-crop area range")),
    (("--color-jitter",), 0.4, dict(type=float, help="colour-jitter strength (ignored when --aa is set)")),
    (("--smoothing",), 0.1, dict(type=float, help="label smoothing")),
    (("--mixup",), 0.8, dict(type=float, help="mixup alpha; 0 disables")),
    (("--cutmix",), 1.0, dict(type=float, help="cutmix alpha; 0 disables")),
    (("--mixup-prob",), 1.0, dict(type=float, help="probability of applying mixup or cutmix to a batch")),
    (("--mixup-switch-prob",), 0.5, dict(type=float, help="probability of cutmix rather than mixup when both are on")),
    (("--aug-repeats",), 3, dict(type=int, help="repeated augmentation (DeiT) across processes; used when "
                                 "running several processes, 0 or 1 disables")),
    (("--model-ema",), True, dict(action=argparse.BooleanOptionalAction, help="keep an exponential moving average of the weights")),
    (("--model-ema-decay",), 0.99996, dict(type=float, help="EMA decay per update")),
    (("--model-ema-eval",), False, dict(action="store_true", help="also evaluate the EMA weights every epoch")),
    # distillation (DeiT)
    (("--distillation-type",), "none", dict(choices=("none", "soft", "hard"), help="DeiT distillation through the distillation head")),
    (("--distillation-alpha",), 0.5, dict(type=float, help="weight of the distillation loss")),
    (("--distillation-tau",), 1.0, dict(type=float, help="temperature of soft distillation")),
    (("--teacher",), None, dict(help="teacher: a timm or cgavit model name (with --teacher-weights), or a checkpoint "
                                "trained here")),
    (("--teacher-weights",), None, dict(metavar="FILE", help="local weights file for --teacher (never downloaded)")),
    # run
    (("--output",), None, dict(metavar="DIR", help="run folder for last.pt, best.pt, metrics.jsonl, curves.png "
                               "(default runs/<model>-<time>)")),
    (("--resume",), None, dict(metavar="CKPT", help="continue the run saved in CKPT (e.g. DIR/last.pt); options not "
                               "given again are taken from it")),
    (("--seed",), 0, dict(type=int, help="random seed")),
    (("--device",), "auto", dict(help="auto, cpu or cuda")),
    (("--amp",), False, dict(action="store_true", help="mixed precision on GPU (ignored on CPU)")),
    (("--amp-dtype",), "bfloat16", dict(choices=("bfloat16", "float16"), help="mixed-precision type")),
    (("--log-interval",), 50, dict(type=int, help="updates between log lines when not on a terminal")),
    (("--progress",), None, dict(action=argparse.BooleanOptionalAction, help="progress bar (default: when stderr is a terminal)")),
)

# Options that only steer this invocation and are never taken from a resumed checkpoint.
_NOT_RESUMED = {"resume", "finetune", "device", "workers", "log_interval", "progress", "interrupt_after"}


def _dest(flags: tuple[str, ...]) -> str:
    return flags[0].lstrip("-").replace("-", "_")


def add_train_args(parser: argparse.ArgumentParser) -> None:
    """Add every training option and the design dials to ``parser``."""
    for flags, default, kw in _OPTIONS:
        kw = dict(kw)
        if default not in (None, False) and kw.get("action") != argparse.BooleanOptionalAction:
            kw["help"] = f"{kw['help']} (default: {default if not isinstance(default, tuple) else ' '.join(map(str, default))})"
        elif kw.get("action") == argparse.BooleanOptionalAction and default is not None:
            kw["help"] = f"{kw['help']} (default: {'on' if default else 'off'})"
        parser.add_argument(*flags, dest=_dest(flags), default=argparse.SUPPRESS, **kw)
    # a testing aid: behave as if SIGTERM arrived after this many updates (same code path)
    parser.add_argument("--interrupt-after", dest="interrupt_after", type=int, default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    add_dial_args(parser)


def finalize_args(args: argparse.Namespace) -> tuple[argparse.Namespace, set[str]]:
    """Fill the defaults of options not given; returns ``(args, names of the options given)``."""
    given = {_dest(flags) for flags, _, _ in _OPTIONS if hasattr(args, _dest(flags))}
    given |= {k for k in dials_from_args(args)}
    if hasattr(args, "interrupt_after"):
        given.add("interrupt_after")
    for flags, default, _ in _OPTIONS:
        if not hasattr(args, _dest(flags)):
            setattr(args, _dest(flags), default)
    if not hasattr(args, "interrupt_after"):
        args.interrupt_after = None
    return args, given


def args_to_dict(args: argparse.Namespace) -> dict:
    """The options as a plain dict of str/int/float/bool/None/list (safe for ``weights_only`` loading)."""
    out = {}
    for k, v in vars(args).items():
        if callable(v):
            continue
        out[k] = list(v) if isinstance(v, tuple) else v
    return out


def merge_resumed(args: argparse.Namespace, given: set[str], stored: dict) -> argparse.Namespace:
    """Take every option not given on this command line from the resumed run's stored options."""
    for key, value in stored.items():
        if key in given or key in _NOT_RESUMED or key == "func" or key == "command":
            continue
        setattr(args, key, tuple(value) if isinstance(value, list) else value)
    return args


def check_args(args: argparse.Namespace) -> None:
    """Raise ``ValueError`` for option values that cannot work, saying which to change."""
    if args.data is None:
        raise ValueError("give --data DIR (a folder with train/<class>/ and val/<class>/ image folders)")
    positive = {"epochs": args.epochs, "batch_size": args.batch_size, "img_size": args.img_size}
    for name, value in positive.items():
        if value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {value}")
    if args.img_size < 32:
        raise ValueError(f"--img-size must be at least 32 (the network downsamples 64x), got {args.img_size}")
    if args.workers < 0 or args.warmup_epochs < 0 or args.cooldown_epochs < 0:
        raise ValueError("--workers, --warmup-epochs and --cooldown-epochs must be >= 0")
    if not 0 < args.crop_pct <= 1:
        raise ValueError(f"--crop-pct must be in (0, 1], got {args.crop_pct}")
    if not 0 <= args.model_ema_decay < 1:
        raise ValueError(f"--model-ema-decay must be in [0, 1), got {args.model_ema_decay}")
    if args.distillation_type != "none" and not args.teacher:
        raise ValueError("--distillation-type needs --teacher (a model name with --teacher-weights, or a checkpoint)")
    if args.teacher and args.distillation_type == "none":
        raise ValueError("--teacher given without --distillation-type hard|soft")
    if args.finetune and args.resume:
        raise ValueError("give --finetune (start a new run from weights) or --resume (continue a run), not both")


def peak_lr(args: argparse.Namespace, world: int) -> float:
    """``--lr``, or the official linear scaling ``lr_base x total batch / lr_base_size``."""
    if args.lr is not None:
        return args.lr
    return args.lr_base * args.batch_size * world / args.lr_base_size


# ------------------------------------------------------------------------------------------ builders
def build_model(args: argparse.Namespace, num_classes: int) -> nn.Module:
    """The student network from ``--model``, the dials, ``--drop-path`` and ``--distillation-type``."""
    from ..factory import create_model

    return create_model(
        args.model,
        num_classes=num_classes,
        img_size=args.img_size,
        distillation=args.distillation_type != "none",
        drop_path_rate=args.drop_path,
        **dials_from_args(args),
    )


def build_optimizer(model: nn.Module, args: argparse.Namespace, lr: float) -> torch.optim.Optimizer:
    """timm optimiser; weight decay skips 1-D parameters (norms, biases) and ``model.no_weight_decay()``
    (the attention bias tables)."""
    from timm.optim import create_optimizer_v2

    kw = {"eps": args.opt_eps} if "adam" in args.opt.lower() or "lamb" in args.opt.lower() else {}
    return create_optimizer_v2(
        model, opt=args.opt, lr=lr, weight_decay=args.weight_decay, momentum=args.momentum, filter_bias_and_bn=True, **kw
    )


def build_scheduler(optimizer: torch.optim.Optimizer, args: argparse.Namespace, steps_per_epoch: int):
    """timm ``CosineLRScheduler``: warm-up from ``--warmup-lr``, cosine to ``--min-lr`` over
    ``--epochs`` (counted in epochs, or in updates with ``--sched-on-updates``), then ``--min-lr``."""
    from timm.scheduler import CosineLRScheduler

    unit = steps_per_epoch if args.sched_on_updates else 1
    return CosineLRScheduler(
        optimizer,
        t_initial=args.epochs * unit,
        lr_min=args.min_lr,
        warmup_t=args.warmup_epochs * unit,
        warmup_lr_init=args.warmup_lr,
        cycle_limit=1,
        t_in_epochs=not args.sched_on_updates,
    )


def build_mixup(args: argparse.Namespace, num_classes: int):
    """timm ``Mixup`` (with label smoothing folded in), or None when mixup and cutmix are off."""
    if args.mixup <= 0 and args.cutmix <= 0 or args.mixup_prob <= 0:
        return None
    from timm.data import Mixup

    return Mixup(
        mixup_alpha=args.mixup,
        cutmix_alpha=args.cutmix,
        prob=args.mixup_prob,
        switch_prob=args.mixup_switch_prob,
        mode="batch",
        label_smoothing=args.smoothing,
        num_classes=num_classes,
    )


def build_base_loss(args: argparse.Namespace, mixup) -> nn.Module:
    """timm's soft-target loss under mixup, label smoothing otherwise, plain cross-entropy at 0."""
    from timm.loss import LabelSmoothingCrossEntropy, SoftTargetCrossEntropy

    if mixup is not None:
        return SoftTargetCrossEntropy()
    if args.smoothing > 0:
        return LabelSmoothingCrossEntropy(smoothing=args.smoothing)
    return nn.CrossEntropyLoss()


class DistillationLoss(nn.Module):
    """DeiT's loss: ``(1 - alpha) * base(class head) + alpha * distill(distillation head, teacher)``.

    Args:
        base: loss of the class head against the (possibly mixed) targets.
        teacher: frozen teacher network, evaluated on the same (mixed) images; None when ``kind`` is
            ``"none"``.
        kind: ``"none"``, ``"soft"`` (KL at temperature ``tau``) or ``"hard"`` (cross-entropy against
            the teacher's arg-max).
        alpha: distillation weight.
        tau: soft-distillation temperature.
    """

    def __init__(self, base: nn.Module, teacher: nn.Module | None, kind: str = "none", alpha: float = 0.5, tau: float = 1.0):
        super().__init__()
        self.base, self.teacher, self.kind, self.alpha, self.tau = base, teacher, kind, alpha, tau

    def forward(self, images: torch.Tensor, outputs, targets: torch.Tensor) -> torch.Tensor:
        if self.kind == "none":
            out = outputs[0] if isinstance(outputs, tuple) else outputs
            return self.base(out, targets)
        if not isinstance(outputs, tuple):
            raise ValueError("distillation needs a model built with distillation=True, in train mode")
        out, out_dist = outputs
        base = self.base(out, targets)
        with torch.no_grad():
            t = self.teacher(images).float()
        if self.kind == "soft":
            T = self.tau
            dist = F.kl_div(
                F.log_softmax(out_dist.float() / T, dim=1), F.log_softmax(t / T, dim=1), reduction="sum", log_target=True
            ) * (T * T) / out_dist.numel()
        else:
            dist = F.cross_entropy(out_dist.float(), t.argmax(dim=1))
        return base * (1 - self.alpha) + dist * self.alpha


def build_teacher(args: argparse.Namespace, num_classes: int, device: torch.device) -> nn.Module:
    """The frozen teacher: a cgavit checkpoint trained here, or a cgavit/timm model name with
    ``--teacher-weights`` (read safely; nothing is downloaded)."""
    from pathlib import Path

    from ..factory import resolve_name
    from ..weights import load_checkpoint, read_state_dict

    if Path(args.teacher).is_file():
        from .inference import load_model

        teacher, _ = load_model(args.teacher)
    else:
        if not args.teacher_weights:
            raise ValueError(f"--teacher {args.teacher} needs --teacher-weights FILE (weights are never downloaded)")
        try:
            name = resolve_name(args.teacher)
        except ValueError:
            name = None
        if name is not None:
            from ..factory import create_model

            teacher = create_model(name, num_classes=num_classes, img_size=args.img_size)
            load_checkpoint(teacher, args.teacher_weights)
        else:
            import timm

            try:
                teacher = timm.create_model(args.teacher, pretrained=False, num_classes=num_classes)
            except RuntimeError as err:
                raise ValueError(f"--teacher {args.teacher!r} is neither a cgavit nor a timm model ({err})") from None
            sd = read_state_dict(args.teacher_weights)
            try:
                teacher.load_state_dict(sd)
            except RuntimeError as err:
                raise ValueError(f"--teacher-weights {args.teacher_weights} do not fit {args.teacher}: {str(err)[:300]}") from None
    out_classes = getattr(teacher, "num_classes", num_classes)
    if out_classes != num_classes:
        raise ValueError(f"the teacher predicts {out_classes} classes, the dataset has {num_classes}")
    teacher.eval().requires_grad_(False)
    return teacher.to(device)
