"""The one schema for untrusted checkpoint files: what a file may contain, checked before anything is
built from it or loaded into a model.

A checkpoint is untrusted input. Everything read from one passes through here, once:

* **tensors** (:func:`check_state_dict`, :func:`check_tensor`): names are printable text; values are
  dense (strided), real, on the CPU; against the model (:func:`check_tensor`) each has the model's
  kind of dtype (floating point for weights, integers for counters) and rank, and a relative-position
  bias table has a square window no larger than the largest the config allows; :func:`check_finite`
  refuses NaN/inf weights;
* **metadata** of a cgavit weights file (:func:`parse_weights_meta`): every field typed and bounded,
  JSON bounded in size and nesting depth, every string that can reach a terminal printable;
* **training checkpoints** (:func:`check_training_checkpoint`, :func:`training_meta`): their structure
  and the recorded options that say how to rebuild and feed the network.

The bounds come from :mod:`cgavit.bounds` and the architecture's own
:meth:`cgavit.EfficientViTConfig.validate`. Everything raises :class:`~cgavit.io.CheckpointError`
naming the file and what is wrong.
"""

from __future__ import annotations

import json
import math
import reprlib
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields, replace

import torch

from .bounds import CROP_PCT_RANGE, IMG_SIZE_RANGE, IN_CHANS_RANGE, INTERPOLATIONS, MAX_CLASSES
from .io import CheckpointError
from .variants import CONFIG_LIMITS, IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD, VARIANTS, DialError, EfficientViTConfig, resolve_name

#: Most tensors a state dict may hold, and the longest tensor name.
MAX_TENSORS = 100_000
MAX_KEY_LENGTH = 1024
#: Largest metadata value (bytes of text) and deepest JSON nesting the parser accepts.
MAX_META_BYTES = 8 * 2**20
MAX_JSON_DEPTH = 8
#: Longest class name.
MAX_NAME_LENGTH = 1024
#: The normalisation a file may record: each channel's mean and std of ``[0, 1]`` pixels.
MEAN_RANGE = (0.0, 1.0)
STD_RANGE = (1e-3, 10.0)
#: The largest bias table side: the largest window a config allows.
MAX_BIAS_WINDOW = CONFIG_LIMITS["window_size"][1]

TRAINING_FORMAT = "cgavit-train/1"
_TRAINING_REQUIRED = ("model", "optimizer", "scheduler", "next_epoch", "args")


# ------------------------------------------------------------------------------------------ strings
def shown(value: object, limit: int = 80) -> str:
    """``value`` as it may be printed: its ``repr`` (which escapes control and format characters such
    as NUL, CR, ESC and U+202E), cut to ``limit`` characters. Containers are shown a few levels and items
    deep (:mod:`reprlib`): a pickle can nest them without end or share one object at every level, so that
    the whole ``repr`` would be endless or exponentially long."""
    short = reprlib.Repr()
    short.maxlevel, short.maxstring, short.maxother = 3, limit, limit
    short.maxlist = short.maxtuple = short.maxdict = short.maxset = short.maxfrozenset = short.maxdeque = 4
    text = short.repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def check_name(name: object, what: str) -> str:
    """``name`` if it is printable text of at most :data:`MAX_NAME_LENGTH` characters.

    Raises:
        ValueError: anything else (a control character, an ANSI escape, a bidirectional override...).
    """
    if not isinstance(name, str) or not 0 < len(name) <= MAX_NAME_LENGTH:
        raise ValueError(f"{what} must be text of 1 to {MAX_NAME_LENGTH} characters, got {shown(name)}")
    if not name.isprintable():
        raise ValueError(f"{what} {shown(name)} holds control or formatting characters, which could rewrite the terminal")
    return name


def bounded_json(text: object, what: str) -> object:
    """``json.loads(text)``, refusing text over :data:`MAX_META_BYTES` or nested deeper than
    :data:`MAX_JSON_DEPTH` before the decoder sees it (deep nesting exhausts the stack).

    Raises:
        ValueError: not text, too large, too deep, not JSON, or holding an integer too long to read.
    """
    if not isinstance(text, str):
        raise ValueError(f"{what!r} must be JSON text, got {type(text).__name__}")
    if len(text) > MAX_META_BYTES:
        raise ValueError(f"{what!r} is {len(text):,} characters, more than the {MAX_META_BYTES:,} allowed")
    if _nesting(text) > MAX_JSON_DEPTH:
        raise ValueError(f"{what!r} is nested deeper than {MAX_JSON_DEPTH} levels")
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        raise ValueError(f"{what!r} is not valid JSON: {shown(text[:60])}") from None
    except ValueError:  # Python's own limit on an integer's digits (sys.get_int_max_str_digits): not the user's to raise
        raise ValueError(f"{what!r} holds an integer of more digits than Python reads; no valid value has so many") from None


def _nesting(text: str) -> int:
    """The deepest bracket nesting of JSON ``text`` (strings skipped); stops counting past the bound."""
    depth = peak = 0
    in_string = escaped = False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            peak = max(peak, depth)
            if peak > MAX_JSON_DEPTH:
                break
        elif ch in "]}":
            depth -= 1
    return peak


# ------------------------------------------------------------------------------------------ tensors
def check_state_dict(obj: object, source: str) -> dict[str, torch.Tensor]:
    """``obj`` as a state dict of dense real CPU tensors with printable names.

    Raises:
        CheckpointError: not a mapping, too many entries, a name that is not printable text, a value
            that is not a tensor, or a sparse, meta-device, non-CPU, complex or quantised tensor.
    """
    if not isinstance(obj, Mapping):
        raise CheckpointError(f"{source}: expected a state dict (names to tensors), got {type(obj).__name__}")
    if len(obj) > MAX_TENSORS:
        raise CheckpointError(f"{source}: {len(obj):,} entries, more than the {MAX_TENSORS:,} a checkpoint may hold")
    out = {}
    for key, value in obj.items():
        if not isinstance(key, str) or not 0 < len(key) <= MAX_KEY_LENGTH or not key.isprintable():
            raise CheckpointError(f"{source}: tensor names must be printable text, got the key {shown(key)}; the file is damaged")
        if not isinstance(value, torch.Tensor):
            raise CheckpointError(f"{source}: {shown(key)} is a {type(value).__name__}, not a tensor; the file is damaged")
        problem = _tensor_problem(value)
        if problem:
            raise CheckpointError(f"{source}: the tensor {shown(key)} is {problem}; only dense real CPU tensors are read")
        out[key] = value
    return out


def _tensor_problem(value: torch.Tensor) -> str | None:
    if value.layout != torch.strided:
        return f"stored in the {value.layout} layout (sparse)"
    if value.is_meta:
        return "on the meta device (it holds no values)"
    if value.device.type != "cpu":
        return f"on the {value.device.type} device"
    if value.is_complex():
        return f"complex ({value.dtype})"
    if value.is_quantized:
        return f"quantised ({value.dtype})"
    return None


def check_tensor(key: str, value: torch.Tensor, want: torch.Tensor, source: str) -> str:
    """How the file's ``value`` fits the model's tensor ``want`` (which may be on the meta device):
    ``"same"`` (same shape), ``"reshape"`` (an official release's 1x1 conv weight stored 2-D) or
    ``"resize"`` (an attention-bias table for another window).

    Raises:
        CheckpointError: a dtype of the wrong kind (bool or integer values for floating-point weights,
            floats for a counter), another rank or shape, or a bias table that is not a square window of
            at most :data:`MAX_BIAS_WINDOW` per side.
    """
    if want.is_floating_point() and not value.is_floating_point():
        raise CheckpointError(
            f"{source}: {shown(key)} holds {value.dtype} values where the model has floating-point weights; "
            "the file is damaged or not a checkpoint of this model"
        )
    if not want.is_floating_point() and (value.is_floating_point() or value.dtype == torch.bool):
        raise CheckpointError(f"{source}: {shown(key)} holds {value.dtype} values where the model keeps a count")
    if value.shape == want.shape:
        return "same"
    if key.endswith("attention_biases") and value.ndim == 2 and value.shape[0] == want.shape[0]:
        side = math.isqrt(value.shape[1])
        if value.shape[1] == 0 or side * side != value.shape[1] or side > MAX_BIAS_WINDOW:
            raise CheckpointError(
                f"{source}: the attention-bias table {shown(key)} has shape {tuple(value.shape)}: its second size must "
                f"be a window side squared (1 to {MAX_BIAS_WINDOW}**2); the file is damaged"
            )
        return "resize"
    if value.ndim == 2 and want.ndim == 4 and tuple(want.shape[2:]) == (1, 1) and tuple(value.shape) == tuple(want.shape[:2]):
        return "reshape"
    if key.startswith("patch_embed.conv1.") and value.ndim == want.ndim == 4 and value.shape[1] != want.shape[1] \
            and (value.shape[0], *value.shape[2:]) == (want.shape[0], *want.shape[2:]):
        raise CheckpointError(
            f"{source}: its first convolution takes {value.shape[1]} input channels and the model's {want.shape[1]} "
            f"(in_chans): build the model with in_chans={value.shape[1]}, or, for the published weights, "
            f"pretrained=True adapts their RGB filters to in_chans={want.shape[1]} (offline, with the release file in "
            "a folder named by CGAVIT_WEIGHTS_MIRROR=file:///FOLDER)")
    raise CheckpointError(
        f"{source}: shape mismatch at {shown(key)}: checkpoint {tuple(value.shape)}, model {tuple(want.shape)}; "
        "the file is probably for another variant or other dial settings"
    )


#: the floating-point types whose values ``torch.isfinite`` takes as they are
_FINITE_CHECKED = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def check_finite(state_dict: Mapping[str, torch.Tensor], source: object) -> None:
    """Raise :class:`CheckpointError` when a floating-point tensor holds NaN or inf (a run that diverged,
    or a damaged file), or a BatchNorm's running variance is negative (a damaged file: its square root is NaN in
    every output): such weights predict nonsense."""
    for key, value in state_dict.items():
        if value.is_floating_point() and value.dtype not in _FINITE_CHECKED:
            value = value.float()  # float8: torch has no isfinite for it
        if value.is_floating_point() and not bool(torch.isfinite(value).all()):
            raise CheckpointError(
                f"{source}: the checkpoint's weights contain NaN/inf (first in {shown(key)}); the training diverged or "
                "the file is damaged. Use an earlier checkpoint"
            )
        if key.endswith("running_var") and value.is_floating_point() and bool((value < 0).any()):
            raise CheckpointError(f"{source}: the BatchNorm variance {shown(key)} holds negative values, which no "
                                  "training writes; the file is damaged. Use an earlier checkpoint")


# ----------------------------------------------------------------------------------------- metadata
@dataclass(frozen=True)
class WeightsMeta:
    """What a cgavit weights file (or a training checkpoint's record) says about its network, so it
    can be rebuilt and fed correctly.

    Written by :func:`cgavit.save_weights`, read and validated by :func:`parse_weights_meta`.

    Args:
        model: registered variant name the network was built from (e.g. ``efficientvit_m0``).
        config: the full architecture, dials included.
        num_classes: classifier outputs.
        img_size: the training / evaluation image size (pixels).
        crop_pct: evaluation centre-crop fraction.
        interpolation: resize interpolation.
        mean, std: input normalisation.
        class_names: one printable name per class, or None.
        distillation: the network has a distillation head.
        extra: further notes, e.g. ``{"epoch": "14", "val_top1": "97.8"}``.
        in_chans: input channels of the network.
        input_size: ``(H, W)`` the network was built for when it is not square (its attention-bias tables
            follow it); None: ``img_size`` square.
        global_pool: ``"avg"``, or ``""``: a network without a classifier that gives its last stage's map.
    """

    model: str | None
    config: EfficientViTConfig
    num_classes: int
    img_size: int = 224
    crop_pct: float = 0.875
    interpolation: str = "bicubic"
    mean: tuple[float, ...] = IMAGENET_DEFAULT_MEAN
    std: tuple[float, ...] = IMAGENET_DEFAULT_STD
    class_names: tuple[str, ...] | None = None
    distillation: bool = False
    extra: dict = field(default_factory=dict)
    in_chans: int = 3
    input_size: tuple[int, int] | None = None
    global_pool: str = "avg"

    def to_strings(self) -> dict[str, str]:
        """The safetensors metadata (string to string) for this record."""
        out = {
            "format": "cgavit",
            "config": json.dumps(asdict(self.config)),
            "num_classes": str(self.num_classes),
            "img_size": str(self.img_size),
            "crop_pct": str(self.crop_pct),
            "interpolation": self.interpolation,
            "mean": json.dumps(list(self.mean)),
            "std": json.dumps(list(self.std)),
            "distillation": str(bool(self.distillation)),
        }
        if self.model:
            out["model"] = self.model
        if self.in_chans != 3:
            out["in_chans"] = str(self.in_chans)
        if self.input_size is not None:
            out["input_size"] = json.dumps(list(self.input_size))
        if self.global_pool != "avg":
            out["global_pool"] = self.global_pool
        if self.class_names is not None:
            out["class_names"] = json.dumps(list(self.class_names))
        out.update({str(k): str(v) for k, v in self.extra.items()})
        return out

    def dials(self) -> dict:
        """The config as keyword arguments for :func:`cgavit.create_model`."""
        return {f.name: getattr(self.config, f.name) for f in fields(self.config)}


_KNOWN_KEYS = {"format", "config", "dials", "model", "num_classes", "img_size", "crop_pct", "interpolation",
               "mean", "std", "class_names", "distillation", "in_chans", "input_size", "global_pool"}


def is_weights_meta(raw: Mapping[str, str]) -> bool:
    """Whether a safetensors file's metadata is cgavit's (else it is a plain tensor file)."""
    return raw.get("format") == "cgavit" and ("config" in raw or "model" in raw)


def parse_weights_meta(raw: Mapping[str, str], source: str) -> WeightsMeta:
    """The validated :class:`WeightsMeta` of a cgavit safetensors file's metadata strings.

    Raises:
        CheckpointError: a field that is malformed, of the wrong type, out of bounds, too large, too
            deeply nested, or (class names) not printable.
    """
    try:
        return _parse_meta(raw)
    except DialError as err:
        raise CheckpointError(f"{source}: bad metadata: its config does not describe a network: {err}") from None
    except (ValueError, TypeError, KeyError) as err:
        raise CheckpointError(f"{source}: bad metadata: {err}") from None


def _parse_meta(raw: Mapping[str, str]) -> WeightsMeta:
    model, config = _parse_config(raw)
    names = check_class_names(_json(raw, "class_names"))
    num_classes = bounded_int(raw.get("num_classes") or (len(names) if names else 1000), "num_classes", 0, MAX_CLASSES)
    if names is not None and len(names) != num_classes:
        raise ValueError(f"{len(names)} class names for {num_classes} classes")
    distillation = raw.get("distillation", "False")
    if distillation not in ("True", "False"):
        raise ValueError(f"distillation must be True or False, got {shown(distillation)}")
    feed = _feeding(raw.get("img_size", "224"), raw.get("crop_pct", "0.875"), raw.get("interpolation", "bicubic"),
                    _json(raw, "mean", list(IMAGENET_DEFAULT_MEAN)), _json(raw, "std", list(IMAGENET_DEFAULT_STD)), "")
    extra = {k: v for k, v in raw.items() if k not in _KNOWN_KEYS}
    in_chans = bounded_int(raw.get("in_chans", "3"), "in_chans", *IN_CHANS_RANGE)
    hw = _json(raw, "input_size")
    if hw is not None:
        if not isinstance(hw, list) or len(hw) != 2:
            raise ValueError(f"input_size must be a list [H, W], got {shown(hw)}")
        hw = tuple(bounded_int(v, "input_size", *IMG_SIZE_RANGE) for v in hw)
    pool = raw.get("global_pool", "avg")
    if pool not in ("avg", "") or (not pool and num_classes):
        raise ValueError(f"global_pool must be 'avg', or '' for a network without a classifier, got {shown(pool)} "
                         f"with {num_classes} classes")
    return WeightsMeta(model=model, config=config, num_classes=num_classes, class_names=names,
                       distillation=distillation == "True", extra=extra, in_chans=in_chans, input_size=hw,
                       global_pool=pool, **feed)


def _json(raw: Mapping[str, str], key: str, default=None):
    return default if key not in raw else bounded_json(raw[key], key)


def check_class_names(names: object) -> tuple[str, ...] | None:
    """A file's class names (None: none recorded): a list of at most :data:`MAX_CLASSES` names, each
    :func:`check_name`'s printable text.

    Raises:
        ValueError: anything else, naming the first bad name.
    """
    if names is None:
        return None
    if not isinstance(names, list) or len(names) > MAX_CLASSES:
        raise ValueError(f"'class_names' must be a list of at most {MAX_CLASSES} names")
    checked = tuple(check_name(n, f"class name {i}") for i, n in enumerate(names))
    seen: dict[str, int] = {}
    for i, name in enumerate(checked):
        if name in seen:  # a folder of that name would be scored against one of the two outputs only
            raise ValueError(f"'class_names' names {shown(name)} twice (classes {seen[name]} and {i}); every class "
                             "needs its own name")
        seen[name] = i
    return checked


def bounded_int(value: object, name: str, lo: int, hi: int) -> int:
    """``value`` (an int, or the digits of one) within ``lo..hi``; ValueError naming ``name`` otherwise."""
    if isinstance(value, bool) or not isinstance(value, (int, str)) or not str(value).strip().lstrip("-").isdigit():
        raise ValueError(f"{name} must be an integer, got {shown(value)}")
    if len(str(value)) > 20:
        raise ValueError(f"{name} must be in {lo}..{hi}, got a number of {len(str(value))} digits")
    v = int(value)
    if not lo <= v <= hi:
        raise ValueError(f"{name} must be in {lo}..{hi}, got {v}")
    return v


def bounded_floats(value: object, name: str, n: int, lo: float, hi: float) -> tuple[float, ...]:
    """``value`` as ``n`` finite numbers within ``[lo, hi]``; ValueError naming ``name`` otherwise."""
    if not isinstance(value, (list, tuple)) or len(value) != n or not all(
            isinstance(v, (int, float)) and not isinstance(v, bool) for v in value):
        raise ValueError(f"{name} must be a list of {n} numbers, got {shown(value)}")
    if not all(math.isfinite(v) and lo <= v <= hi for v in value):
        raise ValueError(f"{name} values must be in [{lo}, {hi}], got {list(value)}")
    return tuple(float(v) for v in value)


def crop_and_interpolation(crop_pct: object, interpolation: object, crop_name: str = "crop_pct",
                           interpolation_name: str = "interpolation") -> tuple[float, str]:
    """``(crop_pct as a float, interpolation)``, the crop within :data:`~cgavit.bounds.CROP_PCT_RANGE` (a number, or
    its text as metadata holds it) and the interpolation one of :data:`~cgavit.bounds.INTERPOLATIONS`; ValueError
    naming ``crop_name`` or ``interpolation_name`` otherwise."""
    try:
        pct = float(crop_pct) if not isinstance(crop_pct, bool) else math.nan
    except (TypeError, ValueError):
        raise ValueError(f"{crop_name} must be a number, got {shown(crop_pct)}") from None
    if not (math.isfinite(pct) and CROP_PCT_RANGE[0] <= pct <= CROP_PCT_RANGE[1]):
        raise ValueError(f"{crop_name} must be in [{CROP_PCT_RANGE[0]}, {CROP_PCT_RANGE[1]}], got {shown(crop_pct)}")
    if interpolation not in INTERPOLATIONS:
        raise ValueError(f"{interpolation_name} must be one of {INTERPOLATIONS}, got {shown(interpolation)}")
    return pct, interpolation


def _feeding(img_size: object, crop_pct: object, interpolation: object, mean: object, std: object, prefix: str) -> dict:
    """How a network is fed (image size, crop, interpolation, mean, std), each checked against the
    bounds. ``prefix`` ``"--"`` marks a training record: its fields are named as the options they
    were, and hold numbers, not their text (a weights file's metadata is all text)."""
    def name(field_name: str) -> str:
        return prefix + field_name.replace("_", "-") if prefix else field_name

    if prefix and (isinstance(img_size, (bool, str)) or isinstance(crop_pct, (bool, str))):
        raise ValueError(f"{name('img_size')} and {name('crop_pct')} must be numbers, got {shown(img_size)} and {shown(crop_pct)}")
    size = bounded_int(img_size, name("img_size"), *IMG_SIZE_RANGE)
    pct, interpolation = crop_and_interpolation(crop_pct, interpolation, name("crop_pct"), name("interpolation"))
    return dict(img_size=size, crop_pct=pct, interpolation=interpolation,
                mean=bounded_floats(mean, name("mean"), 3, *MEAN_RANGE),
                std=bounded_floats(std, name("std"), 3, *STD_RANGE))


def _parse_config(raw: Mapping[str, str]) -> tuple[str | None, EfficientViTConfig]:
    """The variant name (None when not recorded) and the architecture of a file's metadata."""
    names = {f.name for f in fields(EfficientViTConfig)}
    model = raw.get("model") or None
    if model is not None:
        model = variant_name(model)
    if "config" in raw:
        cfg = _json(raw, "config")
        if not isinstance(cfg, dict):
            raise ValueError("'config' must be a JSON object")
        if set(cfg) - names:
            raise ValueError(f"'config' has unknown keys {shown(sorted(set(cfg) - names))}; allowed: {sorted(names)}")
        missing = {"embed_dim", "depth", "num_heads"} - set(cfg)
        if missing:
            raise ValueError(f"'config' lacks {sorted(missing)}")
        return model, EfficientViTConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in cfg.items()})
    dials = _json(raw, "dials", {})  # the older training layout: a variant name plus the dials that changed it
    if not isinstance(dials, dict):
        raise ValueError("'dials' must be a JSON object")
    if set(dials) - names:
        raise ValueError(f"'dials' has unknown keys {shown(sorted(set(dials) - names))}; allowed: {sorted(names)}")
    if model is None:
        raise ValueError("the metadata names neither a 'config' nor a 'model'")
    base = VARIANTS[model].cfg
    return model, base.with_dials(**{k: tuple(v) if isinstance(v, list) else v for k, v in dials.items()})


def variant_name(name: object) -> str:
    """The registered variant a file names, spelt in any way a command takes it (:func:`~cgavit.variants.resolve_name`:
    ``efficientvit_m0``, ``m0``, ``EfficientViT-M0``, ``efficientvit_m0.r224_in1k``): a training checkpoint records
    its ``--model`` as given.

    Raises:
        ValueError: anything else.
    """
    if not isinstance(name, str):
        raise ValueError(f"unknown model {shown(name)}; known: {', '.join(sorted(VARIANTS))}")
    return resolve_name(name)


def check_meta_against_shapes(meta: WeightsMeta, shapes: Mapping[str, tuple[int, ...]], source: str) -> None:
    """The recorded architecture must agree with the stored classifier and stem (read from a
    safetensors header, before any tensor is read)."""
    c = meta.config
    expect = {
        "patch_embed.conv4.conv.weight": lambda s: len(s) > 0 and s[0] == c.embed_dim[0],
        "head.linear.weight": lambda s: tuple(s) == (meta.num_classes, c.embed_dim[-1]),
    }
    for key, ok in expect.items():
        if key in shapes and not ok(shapes[key]):
            raise CheckpointError(
                f"{source}: the metadata (num_classes={meta.num_classes}, embed_dim={list(c.embed_dim)}) disagrees "
                f"with the tensor {key!r} of shape {tuple(shapes[key])}; the file is damaged"
            )


# ------------------------------------------------------------------------------ training checkpoints
def is_training_checkpoint(obj: object) -> bool:
    """Whether ``obj`` (what ``torch.load`` returned) is a checkpoint written by ``cgavit train``."""
    return isinstance(obj, Mapping) and isinstance(mark := obj.get("format"), str) and mark.startswith("cgavit-train")


def check_training_checkpoint(ckpt: object, source: str) -> None:
    """Raise :class:`CheckpointError` unless ``ckpt`` is a complete training checkpoint whose weights,
    class names and position have the right types (its recorded options are checked by whoever uses
    them: :func:`training_meta` to rebuild the network, the training config to resume)."""
    if not is_training_checkpoint(ckpt) or ckpt.get("format") != TRAINING_FORMAT:
        raise CheckpointError(
            f"{source} is not a cgavit training checkpoint (no '{TRAINING_FORMAT}' marker); to start from its "
            "weights use --finetune instead of --resume"
        )
    missing = [k for k in _TRAINING_REQUIRED if k not in ckpt]
    if missing:
        raise CheckpointError(f"{source} lacks {missing}; it is incomplete and cannot be resumed")
    for key in ("model", "model_ema"):
        if key == "model_ema" and ckpt.get(key) is None:
            continue
        check_state_dict(ckpt.get(key), f"{source} ({key})")
    classes = ckpt.get("classes")
    if classes is not None:
        try:
            check_class_names(classes)
        except ValueError as err:
            raise CheckpointError(f"{source}: its 'classes': {err}; the file is damaged") from None
    for key in ("next_epoch", "next_step", "global_step"):
        value = ckpt.get(key, 0)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise CheckpointError(f"{source}: its '{key}' must be a whole number >= 0, got {shown(value)}; the file is damaged")


def training_meta(ckpt: Mapping, source: str, use_ema: bool = False) -> tuple[WeightsMeta, dict[str, torch.Tensor]]:
    """The network a checked training checkpoint (:func:`check_training_checkpoint`) holds: its
    :class:`WeightsMeta`, from the recorded options (``args``: model, dials, image size, crop,
    interpolation, mean, std, distillation) and classes, and its state dict (the EMA one with
    ``use_ema`` when there is one). Fields are named as the ``cgavit train`` options they were.

    Raises:
        CheckpointError: recorded options that are malformed or out of bounds, or that disagree with
            the classifier the file holds.
    """
    sd = ckpt["model_ema"] if use_ema and ckpt.get("model_ema") is not None else ckpt["model"]
    try:
        meta = _training_record(ckpt["args"], ckpt.get("classes"))
    except DialError as err:
        raise CheckpointError(f"{source}: the recorded training options are invalid: --{err.dial.replace('_', '-')}: {err}") from None
    except (ValueError, TypeError) as err:
        raise CheckpointError(f"{source}: the recorded training options are invalid: {err}") from None
    head = sd.get("head.linear.weight")
    if head is None or head.ndim != 2:
        raise CheckpointError(f"{source}: its weights have no classifier 'head.linear.weight'; the file is damaged")
    names = meta.class_names
    if head.shape[1] != meta.config.embed_dim[-1] or (names and len(names) != head.shape[0]):
        raise CheckpointError(
            f"{source}: its record ({len(names or ())} classes, last width {meta.config.embed_dim[-1]}) disagrees with "
            f"its classifier of shape {tuple(head.shape)}; the file is damaged"
        )
    num_classes = int(head.shape[0])
    if not 0 < num_classes <= MAX_CLASSES:
        raise CheckpointError(f"{source}: its classifier has {num_classes} classes, outside 1..{MAX_CLASSES}")
    return replace(meta, num_classes=num_classes), sd


def _training_record(args: object, classes: object) -> WeightsMeta:
    if not isinstance(args, Mapping):
        raise ValueError(f"the recorded options must be a dict, got {type(args).__name__}")
    names = {f.name for f in fields(EfficientViTConfig)} | {"allocation"}
    dials = {k: tuple(v) if isinstance(v, list) else v for k, v in args.items() if k in names and v is not None}
    model = variant_name(args.get("model", "efficientvit_m0"))
    feed = _feeding(args.get("img_size", 224), args.get("crop_pct", 0.875), args.get("interpolation", "bicubic"),
                    args.get("mean") or list(IMAGENET_DEFAULT_MEAN), args.get("std") or list(IMAGENET_DEFAULT_STD), "--")
    distillation = args.get("distillation_type", "none")
    if distillation not in ("none", "soft", "hard"):
        raise ValueError(f"--distillation-type must be none, soft or hard, got {shown(distillation)}")
    return WeightsMeta(model=model, config=VARIANTS[model].cfg.with_dials(**dials), num_classes=0,
                       class_names=check_class_names(classes) or None, distillation=distillation != "none", **feed)
