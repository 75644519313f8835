"""The builders that turn a :class:`~cgavit.train.config.TrainConfig` into the run's parts: the
network, timm's optimiser, scheduler, mixup and losses, the distillation teacher, and the data loaders.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import timm
import torch
import torch.nn.functional as F
from timm.data import Mixup, resolve_model_data_config
from timm.loss import LabelSmoothingCrossEntropy, SoftTargetCrossEntropy
from timm.optim import create_optimizer_v2
from timm.scheduler import CosineLRScheduler
from torch import nn
from torch.utils.data import DataLoader
from torchvision.transforms.functional import rgb_to_grayscale

from ..classes import class_difference, same_classes
from ..factory import UnrecordedArchitecture, create_model, load_model, resolve_name
from ..loading import load_checkpoint
from ..schema import check_finite
from ..variants import channel_normalisation
from ..weights import read_state_dict
from .config import TrainConfig
from .data import ImageFolderDataset, build_transform, eval_sampler, make_loader, train_sampler
from .data.transforms import auto_augment_policy
from .distributed import DistEnv
from .inference import input_channels

log = logging.getLogger(__name__)


def peak_lr(cfg: TrainConfig, world: int) -> float:
    """``lr``, or the official linear scaling ``lr_base x total batch / lr_base_size``."""
    if cfg.lr is not None:
        return cfg.lr
    return cfg.lr_base * cfg.batch_size * world / cfg.lr_base_size


# ------------------------------------------------------------------------------------------ builders
def build_model(cfg: TrainConfig, num_classes: int) -> nn.Module:
    """The student network from ``model``, the dials, ``drop_path``, ``drop`` and ``distillation_type``."""
    return create_model(
        cfg.model,
        num_classes=num_classes,
        img_size=cfg.img_size,
        distillation=cfg.distillation_type != "none",
        drop_path_rate=cfg.drop_path,
        drop_rate=cfg.drop,
        **cfg.dials,
    )


def build_optimizer(model: nn.Module, cfg: TrainConfig, lr: float) -> torch.optim.Optimizer:
    """timm optimiser; weight decay skips 1-D parameters (norms, biases) and ``model.no_weight_decay()``
    (the attention bias tables)."""
    kw = {"eps": cfg.opt_eps} if "adam" in cfg.opt.lower() or "lamb" in cfg.opt.lower() else {}
    try:
        return create_optimizer_v2(
            model, opt=cfg.opt, lr=lr, weight_decay=cfg.weight_decay, momentum=cfg.momentum, filter_bias_and_bn=True, **kw
        )
    except (AssertionError, ImportError) as err:  # timm's fused* need NVIDIA APEX and a GPU, its bnb* bitsandbytes
        raise ValueError(f"--opt {cfg.opt} cannot be used here ({' '.join(str(err).split())[:200] or type(err).__name__}); "
                         "choose another, e.g. adamw or sgd") from None


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: TrainConfig, steps_per_epoch: int) -> CosineLRScheduler:
    """timm ``CosineLRScheduler``: warm-up from ``warmup_lr``, cosine to ``min_lr`` over ``epochs``
    (counted in epochs, or in updates with ``sched_on_updates``), then ``min_lr``."""
    unit = steps_per_epoch if cfg.sched_on_updates else 1
    return CosineLRScheduler(
        optimizer,
        t_initial=cfg.epochs * unit,
        lr_min=cfg.min_lr,
        warmup_t=cfg.warmup_epochs * unit,
        warmup_lr_init=cfg.warmup_lr,
        cycle_limit=1,
        t_in_epochs=not cfg.sched_on_updates,
    )


def schedule_problems(cfg: TrainConfig, lr: float) -> list[str]:
    """What is wrong with the schedule :func:`build_scheduler` would draw for peak ``lr``, one line each (the run
    still trains it): a peak below ``min_lr`` (the cosine rises), a warm-up as long as the run or longer (the
    learning rate never reaches its peak, and no epoch follows the cosine)."""
    problems = []
    if lr < cfg.min_lr:
        problems.append(f"peak lr {lr:.2e} (from the total batch) is below --min-lr {cfg.min_lr:.2e}: the cosine will "
                        "rise, not decay; give --lr or a lower --min-lr")
    if cfg.warmup_epochs >= cfg.epochs and lr > cfg.warmup_lr:
        problems.append(
            f"--warmup-epochs {cfg.warmup_epochs} is not shorter than --epochs {cfg.epochs}: every epoch trains in the "
            f"linear warm-up from --warmup-lr {cfg.warmup_lr:.2e}, so the learning rate never reaches its peak {lr:.2e} "
            "and no epoch follows the cosine; give --warmup-epochs below --epochs (0 for none)")
    return problems


def build_mixup(cfg: TrainConfig, num_classes: int) -> Mixup | None:
    """timm ``Mixup`` (with label smoothing folded in), or None when mixup and cutmix are off."""
    if not cfg.mixes:
        return None
    return Mixup(
        mixup_alpha=cfg.mixup,
        cutmix_alpha=cfg.cutmix,
        prob=cfg.mixup_prob,
        switch_prob=cfg.mixup_switch_prob,
        mode="batch",
        label_smoothing=cfg.smoothing,
        num_classes=num_classes,
    )


def build_base_loss(cfg: TrainConfig, mixup: Mixup | None) -> nn.Module:
    """timm's soft-target loss under mixup, label smoothing otherwise, plain cross-entropy at 0."""
    if mixup is not None:
        return SoftTargetCrossEntropy()
    if cfg.smoothing > 0:
        return LabelSmoothingCrossEntropy(smoothing=cfg.smoothing)
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


def build_teacher(cfg: TrainConfig, classes: list[str], device: torch.device) -> nn.Module:
    """The frozen teacher: a cgavit checkpoint trained here, or a cgavit/timm model name with
    ``teacher_weights`` (read safely; nothing is downloaded), fed the images as it was trained to see them: in a
    :class:`TeacherInput` where its normalisation (its file's record, or its ``pretrained_cfg``) or its channels
    differ from the student's.

    Raises:
        ValueError: the teacher predicts another number of classes than ``classes`` (the dataset's), records
            class names that are not ``classes`` in the same order (distillation pairs them index by index), or
            takes other than 1 or 3 channels.
    """
    num_classes = len(classes)
    teacher, source, recorded, own = _teacher_and_record(cfg, num_classes)
    if recorded is not None and not same_classes(recorded, classes):
        diff = class_difference(list(recorded), list(classes))
        raise ValueError(
            f"the teacher {source} was trained on other classes than {cfg.data} holds: "
            f"{'the same names in another order' if diff == 'the same names' else diff} (distillation pairs the "
            "classes index by index); give a teacher trained on these classes")
    out_classes = getattr(teacher, "num_classes", num_classes)
    if out_classes != num_classes:
        raise ValueError(f"the teacher {source} predicts {out_classes} classes and {cfg.data} holds {num_classes} "
                         "(distillation pairs the classes index by index); give a teacher trained on these classes")
    teacher.eval().requires_grad_(False)
    return _fed_as_trained(teacher, cfg, source, own).to(device)


def _teacher_and_record(cfg: TrainConfig, num_classes: int) -> tuple[nn.Module, str, tuple | None, tuple | None]:
    """The teacher, the file it was read from, the class names that file records (None: none) and its own
    ``(mean, std)`` (None: read its ``pretrained_cfg``). A cgavit variant named with ``teacher_weights`` that
    record their network (a cgavit ``.safetensors`` or training checkpoint) is that file's network, as ``--teacher
    FILE`` gives it: its channels, dials, classes and normalisation; other weights fill the named network."""
    if Path(cfg.teacher).is_file():
        path = cfg.teacher
    elif not cfg.teacher_weights:
        raise ValueError(f"--teacher {cfg.teacher} needs --teacher-weights FILE (weights are never downloaded)")
    else:
        path = cfg.teacher_weights if _variant(cfg.teacher) else None
    if path is not None:
        try:
            teacher, info = load_model(path, trust=cfg.trust_checkpoint)
        except UnrecordedArchitecture:
            if path == cfg.teacher:
                raise ValueError(f"--teacher {path} does not record its architecture (an official or timm file?): give "
                                 f"its variant name with the file, --teacher NAME --teacher-weights {path}") from None
        else:
            named = teacher.pretrained_cfg.get("architecture")
            if path != cfg.teacher and named and named != _variant(cfg.teacher):
                log.warning("--teacher %s differs from the %s that %s records; using the file's", cfg.teacher, named, path)
            return teacher, path, info.class_names if info.names_recorded else None, (info.mean, info.std)
    teacher = _named_teacher(cfg.teacher, cfg.teacher_weights, num_classes, cfg.img_size, cfg.trust_checkpoint)
    check_finite(teacher.state_dict(), cfg.teacher_weights)
    return teacher, cfg.teacher_weights, None, None  # its pretrained_cfg's normalisation (timm's, ImageNet's)


def _variant(name: str) -> str | None:
    """The cgavit variant ``name`` names, None for any other (a timm model's)."""
    try:
        return resolve_name(name)
    except ValueError:
        return None


class TeacherInput(nn.Module):
    """A frozen teacher fed the student's batch as it was trained to see images: the student's normalisation undone
    (``x * std_s + mean_s``, pixels in ``[0, 1]``), the RGB pixels made grey for a teacher of one channel (Pillow's
    ``'L'`` weights, as cgavit's commands read images for such a network), then the teacher's own normalisation.

    Args:
        teacher: the frozen network.
        student: the student's ``(mean, std)``, three values each (training reads images as RGB).
        own: the teacher's ``(mean, std)``, one value per channel it takes (1 or 3).
    """

    def __init__(self, teacher: nn.Module, student: tuple[tuple[float, ...], tuple[float, ...]],
                 own: tuple[tuple[float, ...], tuple[float, ...]]):
        super().__init__()
        self.teacher, self.grey = teacher, len(own[0]) == 1
        for name, values in zip(("mean_s", "std_s", "mean_t", "std_t"), (*student, *own)):
            self.register_buffer(name, torch.tensor(values, dtype=torch.float32).view(1, -1, 1, 1), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x * self.std_s + self.mean_s  # (B, 3, H, W), pixels in [0, 1]
        if self.grey:
            x = rgb_to_grayscale(x)  # (B, 1, H, W)
        return self.teacher((x - self.mean_t) / self.std_t)


def _fed_as_trained(teacher: nn.Module, cfg: TrainConfig, source: str, own: tuple | None) -> nn.Module:
    """``teacher`` as it is where it takes the student's images and normalisation, else in a :class:`TeacherInput`.
    ``own``: the ``(mean, std)`` its file records (three values each), None to read its ``pretrained_cfg``.

    Raises:
        ValueError: a teacher of other than 1 or 3 input channels (training feeds RGB images).
    """
    channels = input_channels(teacher)
    if channels not in (1, 3):
        raise ValueError(f"the teacher {source} takes {channels}-channel images, and training feeds it the student's "
                         "RGB ones (a greyscale teacher gets them made grey); give an RGB or greyscale teacher")
    if own is None:
        data = resolve_model_data_config(teacher)
        own = data["mean"], data["std"]
    mean, std = channel_normalisation(own[0], own[1], channels)
    own = tuple(map(float, mean)), tuple(map(float, std))
    student = cfg.normalisation
    if own == student:
        log.info("the teacher takes the student's normalisation (mean %s, std %s)", *own)
        return teacher
    log.info("the teacher gets the images renormalised as it was trained to see them: %s, mean %s, std %s (the "
             "student's: mean %s, std %s)", "made grey" if channels == 1 else "RGB", *own, *student)
    return TeacherInput(teacher, student, own)


def _named_teacher(name: str, weights: str, num_classes: int, img_size: int, trust: bool = False) -> nn.Module:
    """A cgavit variant or a timm model by name, with the weights in the local file ``weights`` (pickled objects
    in it only with ``trust``)."""
    ours = _variant(name)
    if ours is not None:
        teacher = create_model(ours, num_classes=num_classes, img_size=img_size)
        missing = load_checkpoint(teacher, weights, trust=trust, expect_dropped_heads=True)["missing"]
        if missing:  # a classifier for another number of classes, left as initialised: it would distil noise
            raise ValueError(f"--teacher-weights {weights} leaves {name}'s {', '.join(missing[:2])} as initialised (a "
                             f"classifier for another number of classes than the dataset's {num_classes}?); give a teacher "
                             "trained on these classes")
        return teacher
    try:
        teacher = timm.create_model(name, pretrained=False, num_classes=num_classes)
    except RuntimeError as err:
        raise ValueError(f"--teacher {name!r} is neither a cgavit nor a timm model ({err})") from None
    try:
        teacher.load_state_dict(read_state_dict(weights, trust=trust))
    except RuntimeError as err:
        raise ValueError(f"--teacher-weights {weights} do not fit {name}: {str(err)[:300]}") from None
    return teacher


@dataclass
class Loaders:
    """The run's data: the training loader (a seeded, resumable sampler), the validation loader,
    and the generator the training loader draws worker seeds from (re-seeded every epoch)."""

    train: DataLoader
    val: DataLoader
    generator: torch.Generator


def build_loaders(cfg: TrainConfig, env: DistEnv, layout: dict) -> Loaders:
    """Datasets, samplers and loaders for a run on ``layout`` (from :func:`~cgavit.train.data.check_layout`).

    Raises:
        ValueError: the training split holds less than one batch for every process (under repeated augmentation,
            each process's share of an epoch does).
    """
    mean, std = cfg.normalisation
    t_train = build_transform(
        cfg.img_size, True, auto_augment=auto_augment_policy(cfg.aa), interpolation=cfg.interpolation,
        re_prob=cfg.reprob, hflip=cfg.hflip, scale=cfg.scale, color_jitter=cfg.color_jitter, mean=mean, std=std,
    )
    t_eval = build_transform(cfg.img_size, False, interpolation=cfg.interpolation, crop_pct=cfg.crop_pct, mean=mean, std=std)
    classes = layout["classes"]
    ds_train = ImageFolderDataset(layout["train"], classes, t_train)
    ds_val = ImageFolderDataset(layout["val"], classes, t_eval)
    if len(ds_train) < cfg.batch_size * env.world:
        raise ValueError(
            f"the train split has {len(ds_train)} images, fewer than one batch of {cfg.batch_size} x {env.world} "
            "process(es); lower --batch-size"
        )
    sampler = train_sampler(ds_train, env.world, env.rank, cfg.seed, cfg.aug_repeats)
    if len(sampler) < cfg.batch_size:  # repeated augmentation: shares of a multiple of 256 images
        raise ValueError(
            f"under repeated augmentation each of the {env.world} processes trains on {len(sampler)} of the "
            f"{len(ds_train)} images an epoch, fewer than one batch of {cfg.batch_size}; lower --batch-size, or give "
            "--aug-repeats 0"
        )
    generator = torch.Generator()
    pin = env.device.type == "cuda"
    return Loaders(
        train=make_loader(ds_train, cfg.batch_size, sampler, cfg.workers, drop_last=True, pin_memory=pin, generator=generator,
                          strict=cfg.strict),
        val=make_loader(ds_val, cfg.batch_size, eval_sampler(ds_val, env.world, env.rank), cfg.workers, pin_memory=pin,
                        strict=cfg.strict),
        generator=generator,
    )
