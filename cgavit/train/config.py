"""The options of one training run, with the official EfficientViT recipe as defaults, and its result.

Official recipe (ImageNet-1k, 8 GPUs x 256): AdamW, lr 1e-3 x total batch / 512, weight decay 0.025
(none on attention biases, norms and biases), cosine over 300 epochs, 5 warm-up epochs from 1e-6, min
lr 1e-5, AGC clipping 0.02, RandAugment rand-m9-mstd0.5-inc1, bicubic, mixup 0.8, cutmix 1.0, label
smoothing 0.1, random erasing 0.25, repeated augmentation x3, model EMA 0.99996, seed 0.

Field names are timm's ``train.py`` option names, and each is the ``cgavit train`` flag with dashes
(``batch_size`` is ``--batch-size``); the design dials are the :class:`~cgavit.EfficientViTConfig`
field names (``dials={"cascade": False}`` is ``--cascade off``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path

from ..factory import resolve_name
from ..variants import VARIANTS, EfficientViTConfig
from . import checkpoint

#: The design dials a run may set: every :class:`~cgavit.EfficientViTConfig` field.
DIAL_NAMES: tuple[str, ...] = tuple(f.name for f in fields(EfficientViTConfig))

#: Options that only steer one invocation: never taken from a checkpoint on resume.
NOT_RESUMED = frozenset({"resume", "finetune", "device", "workers", "log_interval", "progress", "interrupt_after"})

INTERPOLATIONS = ("bicubic", "bilinear", "nearest")
CLIP_MODES = ("agc", "norm", "value")
DISTILLATION_TYPES = ("none", "soft", "hard")
AMP_DTYPES = ("bfloat16", "float16")

_PATH_FIELDS = ("data", "finetune", "teacher", "teacher_weights", "output", "resume")
_TUPLE_FIELDS = ("mean", "std", "scale")


@dataclass
class TrainConfig:
    """One training run. Defaults are the official recipe; see the module docstring.

    Build it directly (``TrainConfig(data="DIR", epochs=10)``) or, to continue a run, with
    :meth:`resume_from`. Paths may be ``str`` or ``Path`` (kept as ``str``); sequences become tuples.
    """

    # --- data
    data: str | None = None  # dataset root with train/<class>/ and val/<class>/ image folders
    train_split: str = "train"  # training split folder name
    val_split: str = "val"  # validation split folder name
    img_size: int = 224  # training and evaluation image size (pixels)
    crop_pct: float = 0.875  # evaluation centre-crop fraction (resize to img_size / crop_pct first)
    interpolation: str = "bicubic"  # resize interpolation: bicubic, bilinear or nearest
    mean: tuple[float, float, float] | None = None  # normalisation mean; None = ImageNet's
    std: tuple[float, float, float] | None = None  # normalisation std; None = ImageNet's
    workers: int = 4  # data-loading worker processes per training process
    strict: bool = False  # stop at the first unreadable image instead of skipping it
    # --- model
    model: str = "efficientvit_m0"  # variant efficientvit_m0..m5
    dials: dict = field(default_factory=dict)  # design dials changing the variant, e.g. {"cascade": False}
    drop_path: float = 0.0  # stochastic-depth rate
    finetune: str | None = None  # start from these weights; a classifier for another class count is replaced
    # --- optimisation
    epochs: int = 300  # epochs of the cosine schedule
    cooldown_epochs: int = 0  # extra epochs at min_lr after the cosine (the official DeiT loop runs none)
    batch_size: int = 256  # batch size per process (official: 256 x 8 GPUs)
    lr: float | None = None  # peak learning rate; None = lr_base x total batch / lr_base_size
    lr_base: float = 1e-3  # learning rate at the reference batch size
    lr_base_size: int = 512  # reference total batch size for lr_base
    opt: str = "adamw"  # timm optimiser name
    opt_eps: float = 1e-8  # optimiser epsilon
    momentum: float = 0.9  # momentum (SGD-type optimisers)
    weight_decay: float = 0.025  # weight decay (none on attention biases, norms, biases)
    warmup_epochs: int = 5  # linear warm-up epochs
    warmup_lr: float = 1e-6  # learning rate at the start of the warm-up
    min_lr: float = 1e-5  # learning rate at the end of the cosine
    sched_on_updates: bool = False  # step the schedule every update instead of every epoch
    clip_grad: float = 0.02  # gradient clipping value; 0 disables
    clip_mode: str = "agc"  # gradient clipping mode: agc, norm or value
    # --- augmentation and regularisation
    aa: str = "rand-m9-mstd0.5-inc1"  # timm auto-augment policy; "none" disables
    reprob: float = 0.25  # random-erasing probability
    hflip: float = 0.5  # horizontal-flip probability
    scale: tuple[float, float] = (0.08, 1.0)  # random-resized-crop area range
    color_jitter: float = 0.4  # colour-jitter strength (ignored when aa is set)
    smoothing: float = 0.1  # label smoothing
    mixup: float = 0.8  # mixup alpha; 0 disables
    cutmix: float = 1.0  # cutmix alpha; 0 disables
    mixup_prob: float = 1.0  # probability of applying mixup or cutmix to a batch
    mixup_switch_prob: float = 0.5  # probability of cutmix rather than mixup when both are on
    aug_repeats: int = 3  # repeated augmentation (DeiT) across processes; 0 or 1 disables
    model_ema: bool = True  # keep an exponential moving average of the weights
    model_ema_decay: float = 0.99996  # EMA decay per update
    model_ema_eval: bool = False  # also evaluate the EMA weights every epoch
    # --- distillation (DeiT)
    distillation_type: str = "none"  # none, soft or hard, through the distillation head
    distillation_alpha: float = 0.5  # weight of the distillation loss
    distillation_tau: float = 1.0  # temperature of soft distillation
    teacher: str | None = None  # a timm or cgavit model name (with teacher_weights), or a checkpoint
    teacher_weights: str | None = None  # local weights file for teacher (never downloaded)
    # --- run
    output: str | None = None  # run folder; None = runs/<model>-<time>
    resume: str | None = None  # continue the run saved in this checkpoint (see resume_from)
    seed: int = 0  # random seed
    device: str = "auto"  # auto, cpu or cuda
    amp: bool = False  # mixed precision on GPU (ignored on CPU)
    amp_dtype: str = "bfloat16"  # mixed-precision type: bfloat16 or float16
    log_interval: int = 50  # updates between log lines when not on a terminal
    progress: bool | None = None  # progress bar; None = when stderr is a terminal
    interrupt_after: int | None = None  # testing aid: stop as on SIGTERM after this many updates

    def __post_init__(self) -> None:
        for name in _PATH_FIELDS:
            value = getattr(self, name)
            if isinstance(value, os.PathLike):
                setattr(self, name, os.fspath(value))
        for name in _TUPLE_FIELDS:
            value = getattr(self, name)
            if value is not None:
                setattr(self, name, tuple(float(v) for v in value))
        self.dials = normalize_dials(self.dials)

    # ------------------------------------------------------------------------------ checks
    def validate(self) -> None:
        """Raise ``ValueError`` for values that cannot work, naming the option to change."""
        if self.data is None:
            raise ValueError("give --data DIR (a folder with train/<class>/ and val/<class>/ image folders)")
        for name in ("epochs", "batch_size", "img_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{_flag(name)} must be at least 1, got {getattr(self, name)}")
        if self.img_size < 32:
            raise ValueError(f"--img-size must be at least 32 (the network downsamples 64x), got {self.img_size}")
        if self.workers < 0 or self.warmup_epochs < 0 or self.cooldown_epochs < 0:
            raise ValueError("--workers, --warmup-epochs and --cooldown-epochs must be >= 0")
        if not 0 < self.crop_pct <= 1:
            raise ValueError(f"--crop-pct must be in (0, 1], got {self.crop_pct}")
        if not 0 <= self.model_ema_decay < 1:
            raise ValueError(f"--model-ema-decay must be in [0, 1), got {self.model_ema_decay}")
        for name, choices in (("interpolation", INTERPOLATIONS), ("clip_mode", CLIP_MODES),
                              ("distillation_type", DISTILLATION_TYPES), ("amp_dtype", AMP_DTYPES)):
            if getattr(self, name) not in choices:
                raise ValueError(f"--{_flag(name)} must be one of {', '.join(choices)}, got {getattr(self, name)!r}")
        if self.distillation_type != "none" and not self.teacher:
            raise ValueError("--distillation-type needs --teacher (a model name with --teacher-weights, or a checkpoint)")
        if self.teacher and self.distillation_type == "none":
            raise ValueError("--teacher given without --distillation-type hard|soft")
        if self.finetune and self.resume:
            raise ValueError("give --finetune (start a new run from weights) or --resume (continue a run), not both")
        VARIANTS[resolve_name(self.model)].cfg.with_dials(**self.dials)  # names the bad dial

    # ------------------------------------------------------------------------------ resume
    @classmethod
    def resume_from(cls, path: str | os.PathLike, **overrides) -> TrainConfig:
        """The config of the run saved in the training checkpoint ``path``, to continue it.

        Every option comes from the checkpoint except those in ``overrides`` (which win; a
        ``dials`` override changes only the dials it names) and those that only steer one
        invocation (:data:`NOT_RESUMED`: device, workers, progress, ... take ``overrides`` or the
        defaults). The run folder is the checkpoint's folder, where it is now, unless ``output``
        is overridden.

        Raises:
            CheckpointError: a missing, corrupt or non-training checkpoint (nothing is written).
        """
        stored = cls.from_record(checkpoint.load(path)["args"])
        values = {f.name: getattr(stored, f.name) for f in fields(cls) if f.name not in NOT_RESUMED}
        dials = {**stored.dials, **normalize_dials(overrides.pop("dials", {}))}
        values.update(overrides, dials=dials, resume=os.fspath(path))
        if "output" not in overrides:
            values["output"] = str(Path(path).parent)
        return cls(**values)

    def to_record(self) -> dict:
        """The options as a plain dict for a checkpoint's ``"args"`` (str/int/float/bool/None/list,
        safe for ``weights_only`` loading): every field, with each dial a top-level key (None when
        not set), as ``cgavit train`` has always stored them."""
        out = {}
        for f in fields(self):
            if f.name != "dials":
                value = getattr(self, f.name)
                out[f.name] = list(value) if isinstance(value, tuple) else value
        for name in DIAL_NAMES:
            value = self.dials.get(name)
            out[name] = list(value) if isinstance(value, tuple) else value
        return out

    @classmethod
    def from_record(cls, record: Mapping) -> TrainConfig:
        """The config stored in a checkpoint's ``"args"`` (:meth:`to_record`; keys it does not know,
        like an older command's ``"command"``, are ignored; missing ones take the defaults)."""
        names = {f.name for f in fields(cls)} - {"dials"}
        values = {k: v for k, v in record.items() if k in names}
        values["dials"] = {k: record[k] for k in DIAL_NAMES if record.get(k) is not None}
        return cls(**values)

    # ------------------------------------------------------------------------------ spelling
    def to_argv(self) -> list[str]:
        """The ``cgavit train`` options that give this config: a flag for each field that differs
        from its default, in field order (the dials where the ``dials`` field sits)."""
        argv: list[str] = []
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "dials":
                for name, dial in value.items():
                    argv += [f"--{_flag(name)}", _dial_text(dial)]
            elif value != _default(f):
                argv += _option_argv(f.name, value)
        return argv


def train_defaults() -> dict[str, object]:
    """``{field name: default}`` of :class:`TrainConfig` (the recipe in one dict)."""
    return {f.name: _default(f) for f in fields(TrainConfig)}


def normalize_dials(dials: Mapping) -> dict:
    """``dials`` with lists as tuples and a single ``kernels`` value as a 1-tuple.

    Raises:
        ValueError: a name that is no design dial.
    """
    unknown = set(dials) - set(DIAL_NAMES)
    if unknown:
        raise ValueError(f"unknown design dial(s) {sorted(unknown)}; valid: {', '.join(DIAL_NAMES)}")
    out = {}
    for name, value in dials.items():
        if isinstance(value, list):
            value = tuple(value)
        if name == "kernels" and not isinstance(value, tuple):
            value = (value,)
        out[name] = value
    return out


def _default(f) -> object:
    return f.default_factory() if f.default is MISSING else f.default


def _flag(name: str) -> str:
    return name.replace("_", "-")


def _option_argv(name: str, value) -> list[str]:
    if isinstance(value, bool):
        return [f"--{_flag(name)}" if value else f"--no-{_flag(name)}"]
    if value is None:
        raise ValueError(f"{name}=None cannot be spelled as a flag (its default is not None)")
    if isinstance(value, tuple):
        return [f"--{_flag(name)}", *map(str, value)]
    return [f"--{_flag(name)}", str(value)]


def _dial_text(value) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, tuple):
        return ",".join(map(str, value))
    return str(value)


@dataclass
class TrainResult:
    """The summary of one run. Metrics are percentages on the validation split, from rank 0's view
    (identical on all ranks); None where no epoch finished.

    Args:
        best_top1, best_top5, best_epoch: the best epoch's metrics and its index (0-based).
        final_top1, final_top5, final_loss: the last finished epoch's metrics.
        epochs: epochs completed (on rank 0, which keeps the record; None elsewhere).
        output: the run folder; checkpoint (best.pt), last (last.pt), weights (best.safetensors)
            and curves (curves.png) are the files in it.
        wall_s: seconds the call took.
        skipped_images: unreadable images skipped.
        interrupted: stopped before the last epoch (a signal or ``interrupt_after``).
        signal: the signal number that stopped it, or None.
        world_size: processes that trained.
        classes: the dataset's class names, index order.
    """

    best_top1: float | None
    best_top5: float | None
    best_epoch: int | None
    final_top1: float | None
    final_top5: float | None
    final_loss: float | None
    epochs: int | None
    output: str
    checkpoint: str
    last: str
    weights: str
    curves: str
    wall_s: float
    skipped_images: int
    interrupted: bool
    signal: int | None
    world_size: int
    classes: list[str]

    def to_dict(self) -> dict:
        """The fields as a dict, in field order (JSON-ready)."""
        return asdict(self)
