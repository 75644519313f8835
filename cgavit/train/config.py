"""The options of one training run, with the official EfficientViT recipe as defaults, and its result.

Official recipe (ImageNet-1k, 8 GPUs x 256): AdamW, lr 1e-3 x total batch / 512, weight decay 0.025
(none on attention biases, norms and biases), cosine over 300 epochs, 5 warm-up epochs from 1e-6, min
lr 1e-5, AGC clipping 0.02, RandAugment rand-m9-mstd0.5-inc1, bicubic, mixup 0.8, cutmix 1.0, label
smoothing 0.1, random erasing 0.25, repeated augmentation x3, model EMA 0.99996, seed 0.

Field names are timm's ``train.py`` option names. Each is the ``cgavit train`` flag with dashes
(``batch_size`` is ``--batch-size``), and its ``help`` (:func:`cgavit.fields.option`) is that flag's
``--help`` text. The design dials are the :class:`~cgavit.EfficientViTConfig` field names
(``dials={"cascade": False}`` is ``--cascade off``).
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path

from ..factory import resolve_name
from ..variants import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD, VARIANTS, DialError, EfficientViTConfig
from ..bounds import CROP_PCT_RANGE, IMG_SIZE_RANGE, INTERPOLATIONS
from ..fields import option
from ..io import CheckpointError
from . import checkpoint
from .data.transforms import auto_augment_policy

#: The design dials a run may set: every :class:`~cgavit.EfficientViTConfig` field, and ``allocation``
#: (:mod:`cgavit.reallocation`).
DIAL_NAMES: tuple[str, ...] = (*(f.name for f in fields(EfficientViTConfig)), "allocation")

#: Options that only steer one invocation: never taken from a checkpoint on resume.
NOT_RESUMED = frozenset({"resume", "finetune", "device", "workers", "log_interval", "progress", "trust_checkpoint"})

CLIP_MODES = ("agc", "norm", "value")
#: timm optimisers that need a backward pass with ``create_graph`` (Hessian estimates), which training does not make.
SECOND_ORDER_OPTIMIZERS = ("adahessian",)
DISTILLATION_TYPES = ("none", "soft", "hard")
AMP_DTYPES = ("bfloat16", "float16")

_PATH_FIELDS = ("data", "finetune", "teacher", "teacher_weights", "output", "resume")
_READ_PATHS = ("data", "finetune", "teacher", "teacher_weights")  # recorded absolute (``teacher``: when a file)
_TUPLE_FIELDS = {"mean": 3, "std": 3, "scale": 2}  # field: length

_BIG = 1_000_000
#: Inclusive ``(low, high)`` bounds of every numeric option; :meth:`TrainConfig.check_values` holds
#: each option to them, whether it was typed or read from a checkpoint.
BOUNDS: dict[str, tuple[float, float]] = {
    "img_size": IMG_SIZE_RANGE, "crop_pct": CROP_PCT_RANGE, "workers": (0, 1024), "drop_path": (0.0, 1.0),
    "drop": (0.0, 1.0),
    "epochs": (1, _BIG), "cooldown_epochs": (0, _BIG), "batch_size": (2, 65536), "lr": (0.0, 10.0),
    "lr_base": (0.0, 10.0), "lr_base_size": (1, 2**31), "opt_eps": (0.0, 1.0), "momentum": (0.0, 1.0),
    "weight_decay": (0.0, 10.0), "warmup_epochs": (0, _BIG), "warmup_lr": (0.0, 10.0), "min_lr": (0.0, 10.0),
    "clip_grad": (0.0, 1e6), "reprob": (0.0, 1.0), "hflip": (0.0, 1.0), "color_jitter": (0.0, 10.0),
    "smoothing": (0.0, 1.0), "mixup": (0.0, 100.0), "cutmix": (0.0, 100.0), "mixup_prob": (0.0, 1.0),
    "mixup_switch_prob": (0.0, 1.0), "aug_repeats": (0, 64), "model_ema_decay": (0.0, 1.0),
    "distillation_alpha": (0.0, 1.0), "distillation_tau": (1e-3, 1e3), "seed": (0, 2**63 - 1),
    "log_interval": (1, 2**31),
    "mean": (0.0, 1.0), "std": (1e-3, 10.0), "scale": (1e-4, 1.0),
}
#: The options of :data:`BOUNDS` whose high bound is excluded: 1.0 drops every block's path, smooths every label to
#: uniform, or freezes the EMA.
BELOW_HIGH = frozenset({"drop_path", "drop", "smoothing", "model_ema_decay"})


@dataclass
class TrainConfig:
    """One training run. Defaults are the official recipe; see the module docstring.

    Build it directly (``TrainConfig(data="DIR", epochs=10)``) or, to continue a run, with
    :meth:`resume_from`. Paths may be ``str`` or ``Path`` (kept as ``str``); sequences become tuples.
    Each field is documented by its ``help`` text, the line ``cgavit train --help`` shows for it.
    """

    # --- data
    data: str | None = option(None, "dataset root with train/<class>/ and val/<class>/ image folders", metavar="DIR")
    train_split: str = option("train", "training split folder name")
    val_split: str = option("val", "validation split folder name")
    img_size: int = option(224, "training and evaluation image size in pixels")
    crop_pct: float = option(0.875, "evaluation centre-crop fraction (resize to img_size/crop_pct first)")
    interpolation: str = option("bicubic", "resize interpolation", choices=INTERPOLATIONS)
    mean: tuple[float, float, float] | None = option(None, "normalisation mean (ImageNet's)", metavar=("R", "G", "B"))
    std: tuple[float, float, float] | None = option(None, "normalisation std (ImageNet's)", metavar=("R", "G", "B"))
    workers: int = option(4, "data-loading worker processes per training process", flags=("--workers", "-j"))
    strict: bool = option(False, "stop at the first unreadable image instead of skipping it (every validation image is read "
                          "once before training starts)")
    # --- model
    model: str = option("efficientvit_m0", "variant efficientvit_m0..m5 (dials below change it)")
    dials: dict = field(default_factory=dict)  # design dials changing the variant, e.g. {"cascade": False}
    drop_path: float = option(0.0, "stochastic-depth rate")
    drop: float = option(0.0, "dropout before the classifier (timm's --drop; the official recipe has none)")
    finetune: str | None = option(
        None, "start from these weights (official, timm or cgavit file); a classifier for another class count is replaced",
        metavar="CKPT",
    )
    # --- optimisation
    epochs: int = option(300, "epochs of the cosine schedule")
    cooldown_epochs: int = option(
        0, "extra epochs at --min-lr after the cosine (timm semantics). The official config names 10, but its DeiT loop "
        "stops at --epochs",
    )
    batch_size: int = option(256, "batch size per process (official: 256 x 8 GPUs)", flags=("--batch-size", "-b"))
    lr: float | None = option(None, "peak learning rate (default: --lr-base x total batch / --lr-base-size)")
    lr_base: float = option(1e-3, "learning rate at the reference batch size")
    lr_base_size: int = option(512, "reference total batch size for --lr-base")
    opt: str = option("adamw", "timm optimiser name")
    opt_eps: float = option(1e-8, "optimiser epsilon")
    momentum: float = option(0.9, "momentum (SGD-type optimisers)")
    weight_decay: float = option(0.025, "weight decay (none on attention biases, norms, biases)")
    warmup_epochs: int = option(5, "linear warm-up epochs")
    warmup_lr: float = option(1e-6, "learning rate at the start of the warm-up")
    min_lr: float = option(1e-5, "learning rate at the end of the cosine")
    sched_on_updates: bool = option(
        False, "step the schedule every update instead of every epoch (smoother for short runs)"
    )
    clip_grad: float = option(0.02, "gradient clipping value; 0 disables")
    clip_mode: str = option("agc", "gradient clipping mode", choices=CLIP_MODES)
    # --- augmentation and regularisation
    aa: str = option("rand-m9-mstd0.5-inc1", "timm auto-augment policy; 'none' disables")
    reprob: float = option(0.25, "random-erasing probability")
    hflip: float = option(0.5, "horizontal-flip probability")
    scale: tuple[float, float] = option((0.08, 1.0), "random-resized-crop area range", metavar=("MIN", "MAX"))
    color_jitter: float = option(0.4, "colour-jitter strength (ignored when --aa is set, but for --aa 3a, which jitters too)")
    smoothing: float = option(0.1, "label smoothing")
    mixup: float = option(0.8, "mixup alpha; 0 disables")
    cutmix: float = option(1.0, "cutmix alpha; 0 disables")
    mixup_prob: float = option(1.0, "probability of applying mixup or cutmix to a batch")
    mixup_switch_prob: float = option(0.5, "probability of cutmix rather than mixup when both are on")
    aug_repeats: int = option(
        3, "repeated augmentation (DeiT) across processes; used when running several processes, 0 or 1 disables"
    )
    model_ema: bool = option(True, "keep an exponential moving average of the weights")
    model_ema_decay: float = option(0.99996, "EMA decay per update")
    model_ema_eval: bool = option(False, "also evaluate the EMA weights every epoch")
    # --- distillation (DeiT)
    distillation_type: str = option("none", "DeiT distillation through the distillation head", choices=DISTILLATION_TYPES)
    distillation_alpha: float = option(0.5, "weight of the distillation loss")
    distillation_tau: float = option(1.0, "temperature of soft distillation")
    teacher: str | None = option(
        None, "teacher: a timm or cgavit model name (with --teacher-weights), or a checkpoint trained here"
    )
    teacher_weights: str | None = option(None, "local weights file for --teacher (never downloaded)", metavar="FILE")
    trust_checkpoint: bool = option(
        False, "allow pickled objects in --finetune, --teacher and --teacher-weights files (runs their code; only "
        "for files you trust; never taken over by --resume)")
    # --- run
    output: str | None = option(
        None, "run folder for last.pt, best.pt, metrics.jsonl, curves.png (default runs/<model>-<time>)", metavar="DIR"
    )
    resume: str | None = option(
        None, "continue the run saved in CKPT (e.g. DIR/last.pt); options not given again are taken from it, except "
              "--device, --workers, --log-interval, --progress and --trust-checkpoint (this machine's: give them again)",
        metavar="CKPT",
    )
    seed: int = option(0, "random seed")
    device: str = option("auto", "auto, cpu or cuda")
    amp: bool = option(False, "mixed precision on GPU (ignored on CPU)")
    amp_dtype: str = option("bfloat16", "mixed-precision type", choices=AMP_DTYPES)
    log_interval: int = option(50, "updates between log lines when not on a terminal")
    progress: bool | None = option(None, "progress bar (default: when stderr is a terminal)")

    def __post_init__(self) -> None:
        for name in _PATH_FIELDS:
            value = getattr(self, name)
            if isinstance(value, os.PathLike):
                setattr(self, name, os.fspath(value))
        for name, n in _TUPLE_FIELDS.items():
            value = getattr(self, name)
            if value is not None:
                setattr(self, name, _numbers(value, name, n))
        if not isinstance(self.dials, Mapping):
            raise ValueError(f"dials must be a mapping of design dials, got {self.dials!r}")
        self.dials = normalize_dials(self.dials)

    @property
    def mixes(self) -> bool:
        """Whether the run mixes images (mixup or cutmix on, with a chance above 0)."""
        return (self.mixup > 0 or self.cutmix > 0) and self.mixup_prob > 0

    @property
    def normalisation(self) -> tuple[tuple[float, ...], tuple[float, ...]]:
        """The student's ``(mean, std)``, three values each: ``mean`` and ``std``, ImageNet's where not given."""
        return tuple(map(float, self.mean or IMAGENET_DEFAULT_MEAN)), tuple(map(float, self.std or IMAGENET_DEFAULT_STD))

    # ------------------------------------------------------------------------------ checks
    def validate(self) -> None:
        """Raise ``ValueError`` for values that cannot work, naming the option to change: every
        check of :meth:`check_values`, and the options a run needs (``data``, a teacher for
        distillation)."""
        if self.data is None:
            raise ValueError("give --data DIR (a folder with train/<class>/ and val/<class>/ image folders)")
        self.check_values()
        if self.distillation_type != "none" and not self.teacher:
            raise ValueError("--distillation-type needs --teacher (a model name with --teacher-weights, or a checkpoint)")
        if self.teacher and self.distillation_type == "none":
            raise ValueError("--teacher given without --distillation-type hard|soft")
        if self.model_ema_eval and not self.model_ema and not self.resume:  # a run recorded before the rule goes on
            raise ValueError("--model-ema-eval evaluates the EMA weights, which --no-model-ema does not keep; drop one")
        if self.finetune and self.resume:
            raise ValueError("give --finetune (start a new run from weights) or --resume (continue a run), not both")
        if not self.resume:  # a run from before the rule continues with the batch it recorded (engine.train)
            self.check_batch()

    def check_batch(self) -> None:
        """Raise ``ValueError`` for an odd ``batch_size`` while mixup or cutmix is on: they pair each image with
        another of its batch (timm's ``Mixup`` in batch mode), so one image of every batch would go untrained."""
        if self.mixes and self.batch_size % 2:
            raise ValueError(f"mixup and cutmix pair each image with another of its batch (timm's Mixup in batch mode), so "
                             f"--batch-size {self.batch_size} would leave one image of every batch untrained; give an "
                             "even --batch-size, or --mixup 0 --cutmix 0")

    def check_values(self) -> None:
        """Raise ``ValueError`` naming the option when a value has the wrong type, lies outside
        :data:`BOUNDS`, is no allowed choice, or the dials do not form a network (the model config's own
        check), or ``aa`` is no policy timm has. Cheap, and builds nothing but timm's auto-augment ops (no image,
        no code from the record): safe on a checkpoint's untrusted record."""
        for f in fields(self):
            _check_type(f.name, f.type, getattr(self, f.name))
        for name, (lo, hi) in BOUNDS.items():
            value = getattr(self, name)
            below = name in BELOW_HIGH
            for v in value if isinstance(value, tuple) else (value,):
                if v is not None and not (math.isfinite(v) and lo <= v <= hi and not (below and v == hi)):
                    within = f"{lo}..{hi}" + (f" (below {hi})" if below else "")
                    raise ValueError(f"--{_flag(name)} must be within {within}, got {v}")
        auto_augment_policy(self.aa)
        if self.opt.lower().removeprefix("lookahead_") in SECOND_ORDER_OPTIMIZERS:
            raise ValueError(f"--opt {self.opt} needs second-order gradients (a backward pass with create_graph), which "
                             "cgavit train does not make; choose another, e.g. adamw or sgd")
        if self.scale[0] > self.scale[1]:
            raise ValueError(f"--scale MIN MAX needs MIN <= MAX, got {self.scale[0]} {self.scale[1]}")
        for name, choices in (("interpolation", INTERPOLATIONS), ("clip_mode", CLIP_MODES),
                              ("distillation_type", DISTILLATION_TYPES), ("amp_dtype", AMP_DTYPES)):
            if getattr(self, name) not in choices:
                raise ValueError(f"--{_flag(name)} must be one of {', '.join(choices)}, got {getattr(self, name)!r}")
        try:  # the model config's own check, the one home of the dial rules
            VARIANTS[resolve_name(self.model)].cfg.with_dials(**self.dials)
        except DialError as err:
            raise ValueError(f"--{_flag(err.dial)}: {err}") from None

    # ------------------------------------------------------------------------------ resume
    @classmethod
    def resume_from(cls, path: str | os.PathLike, **overrides) -> TrainConfig:
        """The config of the run saved in the training checkpoint ``path``, to continue it.

        Every option comes from the checkpoint except those in ``overrides`` (which win; a
        ``dials`` override changes only the dials it names) and those that only steer one
        invocation (:data:`NOT_RESUMED`: device, workers, progress, ... take ``overrides`` or the
        defaults). The run folder is the checkpoint's folder, where it is now, unless ``output``
        is overridden.

        A resumed run continues as the network it is: a ``model`` or ``dials`` override that builds
        another network than the checkpoint's is refused (:func:`check_same_network`), as timm's
        ``--resume`` would fail on it, rather than training the old weights under a new name.

        Raises:
            CheckpointError: a missing, corrupt or non-training checkpoint, or one whose recorded
                options are malformed or out of bounds (nothing is written).
            ValueError: ``model`` or ``dials`` ask for another network than the checkpoint's.
        """
        stored = cls.from_checkpoint(checkpoint.load(path), path)
        values = {f.name: getattr(stored, f.name) for f in fields(cls) if f.name not in NOT_RESUMED}
        dials = {**stored.dials, **normalize_dials(overrides.pop("dials", {}))}
        values.update(overrides, dials=dials, resume=os.fspath(path))
        if "output" not in overrides:
            values["output"] = str(Path(path).parent)
        config = cls(**values)
        check_same_network(stored, config, path)
        return config

    def to_record(self) -> dict:
        """The options as a plain dict for a checkpoint's ``"args"`` (str/int/float/bool/None/list,
        safe for ``weights_only`` loading): every field, with each dial a top-level key (None when
        not set), as ``cgavit train`` has always stored them. The files the run reads (``data``,
        ``finetune``, ``teacher_weights``, a ``teacher`` checkpoint) are recorded as absolute paths, so that
        ``--resume`` finds them from any working directory."""
        out = {}
        for f in fields(self):
            if f.name != "dials":
                value = getattr(self, f.name)
                if f.name in _READ_PATHS and value and (f.name != "teacher" or Path(value).is_file()):
                    value = os.path.abspath(value)  # not resolved: a link the user gave stays that link
                out[f.name] = list(value) if isinstance(value, tuple) else value
        for name in DIAL_NAMES:
            value = self.dials.get(name)
            out[name] = list(value) if isinstance(value, tuple) else value
        return out

    @classmethod
    def from_record(cls, record: Mapping) -> TrainConfig:
        """The config stored in a checkpoint's ``"args"`` (:meth:`to_record`; keys it does not know,
        like an older command's ``"command"``, are ignored; missing ones take the defaults).

        Raises:
            ValueError: a value of the wrong type or out of bounds (:meth:`check_values`).
        """
        if not isinstance(record, Mapping):
            raise ValueError(f"the recorded options must be a dict, got {type(record).__name__}")
        names = {f.name for f in fields(cls)} - {"dials"}
        values = {k: v for k, v in record.items() if k in names}
        values["dials"] = {k: record[k] for k in DIAL_NAMES if record.get(k) is not None}
        config = cls(**values)
        config.check_values()
        return config

    @classmethod
    def from_checkpoint(cls, ckpt: Mapping, source: str | os.PathLike) -> TrainConfig:
        """The validated config of a training checkpoint read by :func:`checkpoint.load`.

        Raises:
            CheckpointError: its ``"args"`` are malformed or out of bounds; the message names ``source``.
        """
        try:
            return cls.from_record(ckpt["args"])
        except ValueError as err:
            raise CheckpointError(f"{source}: the recorded training options are invalid: {err}") from None

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


def check_same_network(run: TrainConfig, resumed: TrainConfig, source: str | os.PathLike) -> None:
    """Raise ``ValueError`` unless ``resumed`` names the model of ``run`` (the options a checkpoint
    ``source`` recorded) and its dials build the same network: a resumed run is what it was.

    A dial given with the value the run already had (explicitly or as the variant's default) is
    no change.
    """
    if resolve_name(resumed.model) != resolve_name(run.model):
        raise ValueError(
            f"--model {resumed.model} differs from the model of the run in {source} ({run.model}): a resumed run "
            "continues as the network it is; drop --model, or start a new run in another --output"
        )
    was, now = _network(run.model, run.dials), _network(run.model, resumed.dials)
    changed = [name for name in DIAL_NAMES if was.get(name) != now.get(name)]
    if changed:
        said = ", ".join(f"--{_flag(n)} {_dial_text(now.get(n))} (the run has {_dial_text(was.get(n))})" for n in changed)
        raise ValueError(
            f"{said}: the run in {source} was another network; a resumed run continues as the network it is, so "
            "drop these options, or start a new run in another --output"
        )


def changed_options(run: TrainConfig, resumed: TrainConfig) -> list[str]:
    """``--flag recorded -> now`` for each option of ``resumed`` other than what the run it continues recorded
    (``run``), but for the dials (:func:`check_same_network`), ``epochs``, ``output`` and those of one
    invocation (:data:`NOT_RESUMED`)."""
    changed = []
    for f in fields(TrainConfig):
        if f.name in NOT_RESUMED or f.name in ("dials", "epochs", "output"):
            continue
        was, now = getattr(run, f.name), getattr(resumed, f.name)
        if f.name in _READ_PATHS and was and now:
            was, now = os.path.abspath(was), os.path.abspath(now)
        if f.name == "model" and resolve_name(was) == resolve_name(now):  # the same variant, another accepted name
            continue
        if (tuple(was) if isinstance(was, list) else was) != (tuple(now) if isinstance(now, list) else now):
            changed.append(f"--{_flag(f.name)} {was} -> {now}")
    return changed


def _network(model: str, dials: Mapping) -> dict:
    """``{dial: value}`` of the network ``model`` with ``dials`` builds: every config field as
    :meth:`~cgavit.EfficientViTConfig.with_dials` resolves it, other dials as given."""
    arch = {f.name for f in fields(EfficientViTConfig)}
    cfg = VARIANTS[resolve_name(model)].cfg.with_dials(**{k: v for k, v in dials.items() if k in arch})
    return {**dials, **asdict(cfg)}


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


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _numbers(value, name: str, n: int) -> tuple[float, ...]:
    """``value`` as a tuple of ``n`` floats; ValueError naming the option otherwise."""
    if not isinstance(value, (list, tuple)) or len(value) != n or not all(_is_number(v) for v in value):
        finite = "" if not isinstance(value, (list, tuple)) or len(value) != n else " finite"
        raise ValueError(f"--{_flag(name)} takes {n}{finite} numbers, got {value!r}")
    return tuple(float(v) for v in value)


_KINDS = {
    "str": (lambda v: isinstance(v, str), "text"),
    "int": (_is_int, "a whole number"),
    "float": (lambda v: isinstance(v, (int, float)) and not isinstance(v, bool), "a number"),
    "bool": (lambda v: isinstance(v, bool), "true or false"),
    "tuple": (lambda v: isinstance(v, tuple), "a list of numbers"),
    "dict": (lambda v: isinstance(v, dict), "a mapping"),
}


def _check_type(name: str, annotation: str, value) -> None:
    """Raise ``ValueError`` unless ``value`` fits the field's annotation (``"int"``, ``"str | None"``, ...)."""
    if value is None and "None" in annotation:
        return
    ok, text = _KINDS[annotation.split("|")[0].split("[")[0].strip()]
    if not ok(value):
        raise ValueError(f"--{_flag(name)} must be {text}, got {value!r}")


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
            and curves (curves.png) are the files in it, each None when the run did not write it (stopped
            before its first epoch ended: no best.*, no curves).
        wall_s: seconds the call took.
        skipped_images: unreadable images skipped.
        interrupted: stopped before the last epoch (by SIGTERM or SIGINT).
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
    checkpoint: str | None
    last: str | None
    weights: str | None
    curves: str | None
    wall_s: float
    skipped_images: int
    interrupted: bool
    signal: int | None
    world_size: int
    classes: list[str]

    def to_dict(self) -> dict:
        """The fields as a dict, in field order (JSON-ready)."""
        return asdict(self)
