"""Checkpoint formats (official release, timm, cgavit), safe loading, and the pretrained download.

Every loader goes through :func:`read_state_dict` (no pickle code execution unless asked for) and
:func:`convert_state_dict` (official / timm names to this package's), then :func:`load_checkpoint`
checks every key and shape against the model before copying anything into it.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn

from .bounds import CROP_PCT_RANGE, IMG_SIZE_RANGE, INTERPOLATIONS, MAX_CLASSES
from .io import CheckpointError, UnreadableFileError, atomic_write, check_readable_file, sniff_format
from .variants import CONFIG_LIMITS, IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD, VARIANTS, EfficientViTConfig

log = logging.getLogger(__name__)

MIRROR_ENV = "CGAVIT_WEIGHTS_MIRROR"
_WRAPPER_KEYS = ("model_ema", "state_dict_ema", "model", "state_dict", "module")


class _OptionsRecord(SimpleNamespace):
    """Stands in for the ``argparse.Namespace`` of options that DeiT-style training checkpoints
    (the official code's among them) pickle beside the weights: read as plain data, never run."""


# ----------------------------------------------------------------------------------------- reading
def read_state_dict(path: str | os.PathLike, trust: bool = False, prefer_ema: bool = False) -> dict[str, torch.Tensor]:
    """Read the tensors of a checkpoint file, unwrapping ``{'model': ...}``-style dicts.

    Args:
        path: ``.safetensors`` or a ``torch.save`` file.
        trust: allow arbitrary pickled objects (runs code from the file). Only for files you trust.
        prefer_ema: take the EMA weights when the file holds both.

    Raises:
        CheckpointError: missing, truncated, unsafe or non-checkpoint file.
    """
    path = _checked(path)
    kind = sniff_format(path)
    if kind == "safetensors":
        try:
            return _safetensors().torch.load_file(str(path))
        except Exception as err:  # safetensors raises its own error types
            raise CheckpointError(f"cannot read {path} as safetensors (truncated or corrupt?): {_first_line(err)}") from None
    if kind == "unknown":
        raise CheckpointError(
            f"cannot read {path}: its first bytes are neither safetensors nor a PyTorch checkpoint "
            "(not a PyTorch checkpoint or safetensors file); is it the right file, or a truncated download?"
        )
    try:
        with torch.serialization.safe_globals([(_OptionsRecord, "argparse.Namespace")]):
            with open(path, "rb") as fh:  # a file object: torch would pick its reader from a .safetensors name
                obj = torch.load(fh, map_location="cpu", weights_only=not trust)
    except Exception as err:
        text = str(err)
        if not trust and ("weights_only" in text or "Unsupported global" in text or "GLOBAL" in text):
            raise CheckpointError(
                f"{path} holds pickled Python objects that could run code when loaded, so it was "
                "refused. If you trust its source, opt in with load_checkpoint(..., trust=True) "
                "(command line: --trust-checkpoint)."
            ) from None
        raise CheckpointError(f"cannot read {path}: truncated or not a PyTorch checkpoint ({_first_line(err)})") from None
    return unwrap_state_dict(obj, path, prefer_ema)


def _checked(path: str | os.PathLike) -> Path:
    try:
        return check_readable_file(path, "checkpoint")
    except UnreadableFileError as err:
        raise CheckpointError(str(err)) from None


def _safetensors():
    """The ``safetensors`` package, imported here and only here: the model core needs torch alone,
    safetensors comes with ``pip install 'cgavit[weights]'``."""
    try:
        import safetensors.torch
    except ImportError:
        raise CheckpointError("reading or writing .safetensors files needs pip install 'cgavit[weights]'") from None
    return safetensors


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0][:300] if text else type(err).__name__


def unwrap_state_dict(obj, source="checkpoint", prefer_ema: bool = False) -> dict[str, torch.Tensor]:
    """The tensor dict inside ``obj`` (a state dict, or a dict wrapping one)."""
    if isinstance(obj, Mapping):
        order = _WRAPPER_KEYS if prefer_ema else _WRAPPER_KEYS[2:] + _WRAPPER_KEYS[:2]
        for key in order:
            if isinstance(obj.get(key), Mapping):
                return unwrap_state_dict(obj[key], source, prefer_ema)
        tensors = {k: v for k, v in obj.items() if isinstance(v, torch.Tensor)}
        if tensors and len(tensors) >= len(obj) / 2:
            return {(k[7:] if k.startswith("module.") else k): v for k, v in tensors.items()}
    raise CheckpointError(
        f"{source} holds no state dict (expected tensors, or a dict with one of {list(_WRAPPER_KEYS)}), "
        f"got {type(obj).__name__}"
    )


# -------------------------------------------------------------------------------------- key naming
_BLOCK_PARTS = {"dw0": "pre.0", "ffn0": "pre.1", "dw1": "post.0", "ffn1": "post.1"}
_DOWN_PARTS = {0: "downsample.res1", 1: "downsample.patchmerge", 2: "downsample.res2"}


def detect_format(sd: Mapping[str, torch.Tensor]) -> str:
    """``'official'``, ``'timm'`` or ``'cgavit'``, judged by the key names."""
    keys = list(sd)
    if any(k.startswith(("blocks1.", "patch_embed.0.")) for k in keys):
        return "official"
    if any(re.search(r"\.(dw0|ffn0|dw1|ffn1)\.", k) for k in keys):
        return "timm"
    return "cgavit"


def _rename_parts(key: str) -> str:
    parts = key.split(".")
    parts = [{"c": "conv", "l": "linear"}.get(p, p) if i < len(parts) - 1 else p for i, p in enumerate(parts)]
    return ".".join(_BLOCK_PARTS.get(p, p) for p in parts)


def convert_state_dict(sd: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Rename an official or timm state dict to this package's names (own format: unchanged)."""
    fmt = detect_format(sd)
    out: dict[str, torch.Tensor] = {}
    for key, value in sd.items():
        if key.endswith("attention_bias_idxs"):
            continue  # derived from the window; rebuilt by the model
        if fmt == "official":
            m = re.match(r"patch_embed\.(\d+)\.(.*)", key)
            if m:
                key = f"patch_embed.conv{int(m.group(1)) // 2 + 1}.{m.group(2)}"
            m = re.match(r"blocks(\d)\.(\d+)\.(.*)", key)
            if m:
                stage, idx, rest = int(m.group(1)) - 1, int(m.group(2)), m.group(3)
                if stage == 0:
                    key = f"stages.0.blocks.{idx}.{rest}"
                elif idx < 3:
                    key = f"stages.{stage}.{_DOWN_PARTS[idx]}.{rest}"
                else:
                    key = f"stages.{stage}.blocks.{idx - 3}.{rest}"
            key = _rename_parts(key)
        elif fmt == "timm":
            key = _rename_parts(key)
        out[key] = value
    return out


def to_timm_state_dict(sd: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """This package's names to timm's ``efficientvit_msra`` names: the inverse of
    :func:`convert_state_dict` on a timm file (only the sandwich parts are named differently)."""
    theirs = {ours: name for name, ours in _BLOCK_PARTS.items()}
    out = {}
    for key, value in sd.items():
        for ours, name in theirs.items():
            key = key.replace(f".{ours}.", f".{name}.")
        out[key] = value
    return out


# ------------------------------------------------------------------------------------------ loading
def resize_bias_table(table: torch.Tensor, window: int) -> torch.Tensor:
    """Resize a ``(heads, w*w)`` relative-position bias table to ``(heads, window*window)`` (bicubic)."""
    heads, n = table.shape
    w = int(round(n**0.5))
    grid = table.reshape(1, heads, w, w).float()
    out = F.interpolate(grid, size=(window, window), mode="bicubic", align_corners=False)
    return out.reshape(heads, window * window).to(table.dtype)


def load_checkpoint(
    model: nn.Module,
    path: str | os.PathLike | Mapping[str, torch.Tensor],
    trust: bool = False,
    prefer_ema: bool = False,
) -> dict[str, list[str]]:
    """Load official, timm or cgavit weights into ``model`` after checking every key and shape.

    A classifier with another number of classes is left as initialised (logged), as fine-tuning
    needs; a distillation head absent on one side is skipped (logged); attention-bias tables for
    another window size are resized bicubically. Any other difference raises before anything is
    copied.

    Returns:
        ``{"skipped": [...], "resized": [...], "missing": [...]}`` key lists.

    Raises:
        CheckpointError: unreadable file, or a mismatch naming the first key and both shapes.
    """
    source = str(path) if not isinstance(path, Mapping) else "state dict"
    raw = dict(path) if isinstance(path, Mapping) else read_state_dict(path, trust=trust, prefer_ema=prefer_ema)
    sd = convert_state_dict(raw)
    target = model.state_dict()
    report: dict[str, list[str]] = {"skipped": [], "resized": [], "missing": []}
    _drop_foreign_heads(sd, target, report, getattr(model, "num_classes", "?"))
    _fit_shapes(sd, target, report, source)
    _check_complete(sd, target, report, source)
    model.load_state_dict(sd, strict=False)
    if report["resized"]:
        log.info("resized %d attention-bias tables to the model's windows", len(report["resized"]))
    if report["missing"]:
        log.info("left as initialised: %s", ", ".join(report["missing"]))
    return report


def _drop_foreign_heads(sd: dict, target: dict, report: dict, num_classes) -> None:
    """Skip a distillation head the model lacks, and a classifier for another class count."""
    for key in [k for k in sd if k.startswith("head_dist.") and k not in target]:
        report["skipped"].append(key)
        del sd[key]
    head_w = sd.get("head.linear.weight")
    want_w = target.get("head.linear.weight")
    if head_w is not None and (want_w is None or head_w.shape != want_w.shape):
        for key in [k for k in sd if re.match(r"head(_dist)?\.linear\.", k)]:
            report["skipped"].append(key)
            del sd[key]
        log.info(
            "checkpoint classifier has %d classes, the model %s: classifier left as initialised",
            head_w.shape[0], num_classes,
        )


def _fit_shapes(sd: dict, target: dict, report: dict, source: str) -> None:
    """Every key must exist in the model with its shape, up to the official files' 2-D 1x1 conv
    weights (reshaped) and bias tables of another window (resized); raise before copying anything."""
    for key, value in list(sd.items()):
        if key not in target:
            raise CheckpointError(
                f"{source}: key {key!r} (shape {tuple(value.shape)}) does not exist in the model; "
                "is it a checkpoint of another architecture?"
            )
        want = target[key].shape
        if value.shape == want:
            continue
        if value.numel() == target[key].numel() and tuple(value.shape) + (1,) * (len(want) - value.ndim) == tuple(want):
            sd[key] = value.reshape(want)  # official files keep some 1x1 conv weights 2-D
        elif key.endswith("attention_biases") and value.ndim == 2 and value.shape[0] == want[0]:
            sd[key] = resize_bias_table(value, int(round(want[1] ** 0.5)))
            report["resized"].append(key)
        else:
            raise CheckpointError(
                f"{source}: shape mismatch at {key!r}: checkpoint {tuple(value.shape)}, model {tuple(want)}; "
                "the file is probably for another variant or other dial settings"
            )


def _check_complete(sd: dict, target: dict, report: dict, source: str) -> None:
    """Every model tensor must come from the file, except heads deliberately left as initialised."""
    for key in target:
        if key in sd:
            continue
        if key.startswith("head_dist.") or (key.startswith("head.linear.") and "head.linear.weight" in report["skipped"]):
            report["missing"].append(key)
            continue
        raise CheckpointError(
            f"{source}: the model's {key!r} (shape {tuple(target[key].shape)}) is not in the checkpoint; "
            "it is incomplete or for another variant"
        )


# ------------------------------------------------------------------------------------------- saving
def save_weights(
    model: nn.Module, path: str | os.PathLike, metadata: "WeightsMeta | Mapping[str, str] | None" = None
) -> Path:
    """Save ``model``'s tensors in this package's format (safetensors), atomically.

    The model's config and class count always go into the metadata; a :class:`WeightsMeta` adds
    the preprocessing and class names that :func:`read_weights_meta` gives back. A plain mapping of
    strings is stored as given, for notes of your own.
    """
    meta = {"format": "cgavit"}
    cfg = getattr(model, "cfg", None)
    if cfg is not None:
        meta["config"] = json.dumps(asdict(cfg))
        meta["num_classes"] = str(getattr(model, "num_classes", ""))
    if isinstance(metadata, WeightsMeta):
        meta.update(metadata.to_strings())
    else:
        meta.update({k: str(v) for k, v in (metadata or {}).items()})
    tensors = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    return atomic_write(path, lambda tmp: _safetensors().torch.save_file(tensors, tmp, metadata=meta))


def read_metadata(path: str | os.PathLike) -> dict[str, str]:
    """The raw string metadata of a safetensors file ({} for other files)."""
    path = _checked(path)
    if sniff_format(path) != "safetensors":
        return {}
    try:
        with _safetensors().safe_open(str(path), "pt") as f:
            return dict(f.metadata() or {})
    except Exception as err:  # safetensors raises its own error types
        raise CheckpointError(f"cannot read {path} as safetensors (truncated or corrupt?): {_first_line(err)}") from None


# ------------------------------------------------------------------------------------ metadata
#: Bounds on what a file's metadata may ask for, checked before anything is allocated.


@dataclass(frozen=True)
class WeightsMeta:
    """What a weights file records beside its tensors, so it can be rebuilt and fed correctly.

    Written by :func:`save_weights`, read and validated by :func:`read_weights_meta`.

    Args:
        model: registered variant name the network was built from (e.g. ``efficientvit_m0``).
        config: the full architecture, dials included.
        num_classes: classifier outputs.
        img_size: the training / evaluation image size (pixels).
        crop_pct: evaluation centre-crop fraction.
        interpolation: resize interpolation.
        mean, std: input normalisation.
        class_names: one name per class, or None.
        distillation: the network has a distillation head.
        extra: further notes, e.g. ``{"epoch": "14", "val_top1": "97.8"}``.
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
        if self.class_names is not None:
            out["class_names"] = json.dumps(list(self.class_names))
        out.update({str(k): str(v) for k, v in self.extra.items()})
        return out

    def dials(self) -> dict:
        """The config as keyword arguments for :func:`cgavit.create_model`."""
        return {f.name: getattr(self.config, f.name) for f in fields(self.config)}


_KNOWN_KEYS = {"format", "config", "dials", "model", "num_classes", "img_size", "crop_pct", "interpolation",
               "mean", "std", "class_names", "distillation"}


def read_weights_meta(path: str | os.PathLike) -> WeightsMeta | None:
    """The validated :class:`WeightsMeta` of a cgavit safetensors file; None for any other file.

    Every field is checked for type and bounds, and the architecture against the file's tensor
    shapes, before anything is built from it.

    Raises:
        CheckpointError: metadata that is malformed, out of bounds, or disagrees with the tensors.
    """
    raw = read_metadata(path)
    if raw.get("format") != "cgavit" or not ("config" in raw or "model" in raw):
        return None
    try:
        meta = _parse_meta(raw)
    except (ValueError, TypeError, KeyError) as err:
        raise CheckpointError(f"{path}: bad metadata: {err}") from None
    _check_meta_against_tensors(meta, path)
    return meta


def _json(raw: dict, key: str, default=None):
    if key not in raw:
        return default
    try:
        return json.loads(raw[key])
    except json.JSONDecodeError:
        raise ValueError(f"{key!r} is not valid JSON: {raw[key][:80]!r}") from None


def _bounded_int(value, name: str, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, str)) or not str(value).strip().lstrip("-").isdigit():
        raise ValueError(f"{name} must be an integer, got {value!r}")
    v = int(value)
    if not lo <= v <= hi:
        raise ValueError(f"{name} must be in {lo}..{hi}, got {v}")
    return v


def _floats(value, name: str, n: int, lo: float, hi: float) -> tuple[float, ...]:
    if not isinstance(value, list) or len(value) != n or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value):
        raise ValueError(f"{name} must be a list of {n} numbers, got {value!r}")
    if not all(math.isfinite(v) and lo <= v <= hi for v in value):
        raise ValueError(f"{name} values must be in [{lo}, {hi}], got {value}")
    return tuple(float(v) for v in value)


def _parse_config(raw: dict) -> EfficientViTConfig:
    names = {f.name for f in fields(EfficientViTConfig)}
    if "config" in raw:
        cfg = _json(raw, "config")
        if not isinstance(cfg, dict):
            raise ValueError("'config' must be a JSON object")
        unknown = set(cfg) - names
        if unknown:
            raise ValueError(f"'config' has unknown keys {sorted(unknown)}; allowed: {sorted(names)}")
        base = None
    else:  # the older training layout: a variant name plus the dials that changed it
        cfg = _json(raw, "dials", {})
        if not isinstance(cfg, dict):
            raise ValueError("'dials' must be a JSON object")
        unknown = set(cfg) - names
        if unknown:
            raise ValueError(f"'dials' has unknown keys {sorted(unknown)}; allowed: {sorted(names)}")
        model = raw.get("model", "")
        key = model if model in VARIANTS else f"efficientvit_{model}"
        if key not in VARIANTS:
            raise ValueError(f"unknown model {model!r}")
        base = VARIANTS[key].cfg
    for key, hi in CONFIG_LIMITS.items():
        vals = cfg.get(key)
        if vals is None:
            continue
        vals = vals if isinstance(vals, list) else [vals]
        if not all(isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= hi for v in vals):
            raise ValueError(f"config {key} must be integers in 1..{hi}, got {cfg[key]!r}")
    cfg = {k: tuple(v) if isinstance(v, list) else v for k, v in cfg.items()}
    if base is not None:
        return base.with_dials(**cfg) if cfg else base
    missing = {"embed_dim", "depth", "num_heads"} - set(cfg)
    if missing:
        raise ValueError(f"'config' lacks {sorted(missing)}")
    defaults = EfficientViTConfig(cfg["embed_dim"], cfg["depth"], cfg["num_heads"])
    return defaults.with_dials(**{k: v for k, v in cfg.items() if k not in ("embed_dim", "depth", "num_heads")})


def _parse_meta(raw: dict) -> WeightsMeta:
    config = _parse_config(raw)
    names = _json(raw, "class_names")
    if names is not None and (not isinstance(names, list) or not all(isinstance(n, str) for n in names)):
        raise ValueError("'class_names' must be a list of strings")
    num_classes = _bounded_int(raw.get("num_classes") or (len(names) if names else 1000), "num_classes", 0, MAX_CLASSES)
    if names is not None and len(names) != num_classes:
        raise ValueError(f"{len(names)} class names for {num_classes} classes")
    img = raw.get("img_size", "224")
    img_size = _bounded_int(img, "img_size", *IMG_SIZE_RANGE)
    try:
        crop_pct = float(raw.get("crop_pct", 0.875))
    except ValueError:
        raise ValueError(f"crop_pct must be a number, got {raw.get('crop_pct')!r}") from None
    if not (math.isfinite(crop_pct) and CROP_PCT_RANGE[0] <= crop_pct <= CROP_PCT_RANGE[1]):
        raise ValueError(f"crop_pct must be in [{CROP_PCT_RANGE[0]}, {CROP_PCT_RANGE[1]}], got {crop_pct}")
    interpolation = raw.get("interpolation", "bicubic")
    if interpolation not in INTERPOLATIONS:
        raise ValueError(f"interpolation must be one of {INTERPOLATIONS}, got {interpolation!r}")
    mean = _floats(_json(raw, "mean", list(IMAGENET_DEFAULT_MEAN)), "mean", 3, 0.0, 1.0)
    std = _floats(_json(raw, "std", list(IMAGENET_DEFAULT_STD)), "std", 3, 1e-3, 10.0)
    distillation = raw.get("distillation", "False")
    if distillation not in ("True", "False"):
        raise ValueError(f"distillation must be True or False, got {distillation!r}")
    extra = {k: v for k, v in raw.items() if k not in _KNOWN_KEYS}
    return WeightsMeta(
        model=raw.get("model") or None, config=config, num_classes=num_classes, img_size=img_size,
        crop_pct=crop_pct, interpolation=interpolation, mean=mean, std=std,
        class_names=tuple(names) if names is not None else None, distillation=distillation == "True", extra=extra,
    )


def _check_meta_against_tensors(meta: WeightsMeta, path) -> None:
    """The recorded architecture must match the stored tensor shapes (read from the header only)."""
    c = meta.config
    expect = {
        "patch_embed.conv4.conv.weight": lambda s: s[0] == c.embed_dim[0],
        "head.linear.weight": lambda s: tuple(s) == (meta.num_classes, c.embed_dim[-1]),
    }
    with _safetensors().safe_open(str(path), "pt") as f:
        keys = set(f.keys())
        for key, ok in expect.items():
            if key in keys and not ok(f.get_slice(key).get_shape()):
                raise CheckpointError(
                    f"{path}: the metadata (num_classes={meta.num_classes}, embed_dim={list(c.embed_dim)}) "
                    f"disagrees with the tensor {key!r} of shape {f.get_slice(key).get_shape()}; the file is damaged"
                )


# ----------------------------------------------------------------------------------------- download
def release_url(url: str) -> str:
    """``url``, with its directory replaced by ``$CGAVIT_WEIGHTS_MIRROR`` when that is set."""
    mirror = os.environ.get(MIRROR_ENV)
    return f"{mirror.rstrip('/')}/{url.rsplit('/', 1)[-1]}" if mirror else url


def download_release(url: str, progress: bool = True) -> Path:
    """Fetch a release file into ``<torch hub dir>/checkpoints`` (once) and return its path."""
    url = release_url(url)
    dst = Path(torch.hub.get_dir()) / "checkpoints" / url.rsplit("/", 1)[-1]
    if dst.is_file() and dst.stat().st_size > 0:
        return dst
    dst.parent.mkdir(parents=True, exist_ok=True)
    log.info("downloading %s to %s", url, dst)
    try:
        torch.hub.download_url_to_file(url, str(dst), progress=progress)  # writes a temp file, then renames
    except Exception as err:
        raise CheckpointError(
            f"could not download {url} ({err}). Download it by hand and pass checkpoint_path=, or set "
            f"{MIRROR_ENV} to a folder URL that serves it"
        ) from None
    return dst
