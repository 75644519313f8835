"""What an exported file carries for its consumer, in the format's own metadata (ONNX ``metadata_props``,
OpenVINO ``rt_info``): class names, input size, mean/std, interpolation, crop, the cgavit version and,
for int8, how it was quantised and what it kept.

:class:`ExportInfo` is format-neutral: a flat ``{key: string}`` table (:meth:`ExportInfo.to_props`)
that the ONNX and OpenVINO modules write and read with their own APIs. Values are JSON text, so a
reader in any language parses them. A file's metadata is untrusted: reading it checks every value
(:meth:`ExportInfo.from_props`), and :func:`~cgavit.deploy.open_exported` checks it against the network
it came with (:meth:`ExportInfo.check_network`).
"""

from __future__ import annotations

import json
import math
import os
import re
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from importlib import metadata

from ..bounds import CROP_PCT_RANGE, IMG_SIZE_RANGE, INTERPOLATIONS
from ..schema import MEAN_RANGE, STD_RANGE, bounded_floats, bounded_json, check_class_names, check_name, shown
from ..variants import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD, channel_normalisation
from .int8 import FLOAT_PARTS, Int8Options, weight_range_label
from .runtime import runtime_reason

#: The prefix of every key cgavit writes (ONNX: ``cgavit.class_names``; OpenVINO: ``rt_info["cgavit"]``).
PREFIX = "cgavit"
#: The keys, in the order they are written.
KEYS = ("version", "class_names", "img_size", "mean", "std", "interpolation", "crop_pct", "precision", "int8")
#: The keys that say how images are fed (:meth:`ExportInfo.from_props` warns of each one missing: it assumes ImageNet's).
PREPROCESSING_KEYS = ("mean", "std", "interpolation", "crop_pct")


def cgavit_version() -> str:
    """The installed cgavit's version (its package metadata), ``"unknown"`` when it is not installed."""
    try:
        return metadata.version("cgavit")
    except metadata.PackageNotFoundError:
        return "unknown"


def release(version: str) -> tuple[int, int] | None:
    """The ``(major, minor)`` a version starts with (``"0.3.1.dev2"``: ``(0, 3)``); None for one that does not
    (``"unknown"``, ``""``)."""
    found = re.match(r"(\d+)\.(\d+)", version)
    return (int(found[1]), int(found[2])) if found else None


@dataclass(frozen=True)
class ExportInfo:
    """How to feed an exported model and read its output.

    Args:
        class_names: one name per output logit (empty: unknown).
        img_size: ``(H, W)`` the file accepts.
        mean, std: per-channel normalisation of ``[0, 1]`` pixels.
        interpolation: the resize interpolation (``"bicubic"``, ``"bilinear"``, ``"nearest"``).
        crop_pct: evaluation centre-crop fraction (resize to ``img_size / crop_pct``, crop).
        precision: ``"fp32"`` or ``"int8"``.
        int8: for int8, how it was made and measured (weight range, float layers, agreement, CPU).
        version: the cgavit version that wrote the file.
    """

    class_names: tuple[str, ...] = ()
    img_size: tuple[int, int] = (224, 224)
    mean: tuple[float, ...] = (0.485, 0.456, 0.406)
    std: tuple[float, ...] = (0.229, 0.224, 0.225)
    interpolation: str = "bicubic"
    crop_pct: float = 0.875
    precision: str = "fp32"
    int8: Mapping[str, object] = field(default_factory=dict)
    version: str = field(default_factory=lambda: cgavit_version())

    def __post_init__(self) -> None:
        if isinstance(self.class_names, str):  # "abc" was taken as the three classes a, b and c
            raise ValueError(f"class_names must be a sequence of names, one per class, got the text "
                             f"{shown(self.class_names)}; give a list, e.g. [{shown(self.class_names)}] for one class")

    def to_props(self) -> dict[str, str]:
        """``{"cgavit.KEY": json text}`` for every key of :data:`KEYS`, checked by the rules :meth:`from_props` reads
        them with, so that no file is written that cgavit would then refuse to read.

        Raises:
            ValueError: a value the reader would refuse (the first one named), and what to change.
        """
        values = dict(version=self.version, class_names=list(self.class_names), img_size=list(self.img_size),
                      mean=list(self.mean), std=list(self.std), interpolation=self.interpolation,
                      crop_pct=self.crop_pct, precision=self.precision, int8=dict(self.int8))
        try:
            props = {f"{PREFIX}.{key}": _json_text(key, values[key]) for key in KEYS}
            _parsed(props)
        except ValueError as err:
            raise ValueError(f"this metadata would make a file cgavit cannot read back: {err}; change that value (in the "
                             "ExportInfo given, or the checkpoint's class names and preprocessing)") from None
        return props

    @classmethod
    def from_props(cls, props: Mapping[str, str], source: str = "the file") -> ExportInfo:
        """Read :meth:`to_props`'s table back (other keys are ignored), checking every value: JSON bounded in
        size and depth, class names as a checkpoint's (:func:`~cgavit.schema.check_class_names`), numbers
        finite and within :mod:`cgavit.bounds` and the schema's normalisation ranges.

        Warns:
            RuntimeWarning: a file missing part of its preprocessing (ImageNet's is assumed, named), or one written by
                a cgavit of a newer major or minor version than the installed one (both named).

        Raises:
            ValueError: no cgavit metadata, or a value that is malformed or out of range (the first one named).
        """
        if f"{PREFIX}.img_size" not in props:
            raise ValueError(f"{source} carries no cgavit metadata (written by cgavit export or cgavit quantize "
                             "0.1.0 or later); export it again, or give the preprocessing yourself")
        try:
            info = _parsed(props)
        except ValueError as err:
            raise ValueError(f"{source}: bad cgavit metadata: {err}; export the file again") from None
        missing = [key for key in PREPROCESSING_KEYS if f"{PREFIX}.{key}" not in props]
        if missing:  # cgavit writes them all: a file edited since, whose images would be fed ImageNet's way unsaid
            assumed = dict(mean=f"mean {info.mean}", std=f"std {info.std}", interpolation=info.interpolation,
                           crop_pct=f"crop {info.crop_pct:g}")
            warnings.warn(f"{source} records no {', '.join(missing)} in its cgavit metadata, so ImageNet's "
                          f"{', '.join(assumed[key] for key in missing)} are assumed, which fit only a model trained "
                          "with them; export the checkpoint again to record its own", RuntimeWarning, stacklevel=2)
        written, installed = release(info.version), release(cgavit_version())
        if written is not None and installed is not None and written > installed:
            warnings.warn(f"{source} was written by cgavit {info.version}, newer than the installed {cgavit_version()}: "
                          "its metadata may record what this version does not know, which is ignored; upgrade cgavit "
                          "(pip install -U cgavit) to read it as written", RuntimeWarning, stacklevel=2)
        return info

    def check_network(self, inputs: Sequence[int | None] | None, outputs: Sequence[int | None] | None,
                      source: str = "the file") -> None:
        """Refuse metadata that does not describe the network it came with. ``inputs`` and ``outputs`` are the
        network's image input ``(B, C, H, W)`` and logits ``(B, classes)`` as its file declares them (None for a
        dynamic dimension, or a shape not known): the image size must be the network's, mean and std one value
        or one per input channel, and the class names, where there are any, one per logit.

        Raises:
            ValueError: the first disagreement, naming ``source``.
        """
        def fail(what: str) -> ValueError:
            return ValueError(f"{source}: {what}; export it again")

        if inputs is not None and len(inputs) != 4:
            raise fail(f"its network takes a {len(inputs)}-dimensional input, not images (batch, channels, height, width)")
        if outputs is not None and len(outputs) != 2:
            raise fail(f"its network returns a {len(outputs)}-dimensional output, not logits (batch, classes)")
        _, channels, height, width = inputs or (None,) * 4
        h, w = self.img_size
        if height not in (None, h) or width not in (None, w):
            raise fail(f"its metadata says {h}x{w} images but the network takes {height or '?'}x{width or '?'}")
        if channels is not None and len(self.mean) not in (1, channels):
            raise fail(f"its metadata has {len(self.mean)} mean and std values but the network takes {channels}-channel "
                       f"images (1 or {channels} fit)")
        classes = outputs[1] if outputs is not None else None
        if classes is not None and self.class_names and len(self.class_names) != classes:
            raise fail(f"its metadata names {len(self.class_names)} classes but the network returns {classes} logits")


def export_info(info: object | None, size: tuple[int, int], in_chans: int = 3) -> ExportInfo:
    """What a file exported at ``size`` carries: an :class:`ExportInfo` as it is, or a loaded model's class names and
    preprocessing (``info``: the :class:`~cgavit.factory.ModelInfo` that :func:`~cgavit.load_model` returns), or, for
    None, ImageNet's mean, std and crop (what timm's models assume) and no class names. Three mean and std values
    for a network of ``in_chans`` other than 3 become their averages, one value for every channel.

    Raises:
        ValueError: mean and std values that fit neither one value per channel nor one for all.
    """
    if isinstance(info, ExportInfo):
        made = replace(info, img_size=tuple(size))
    elif info is None:
        made = ExportInfo(img_size=tuple(size), mean=IMAGENET_DEFAULT_MEAN, std=IMAGENET_DEFAULT_STD)
    else:
        made = ExportInfo(class_names=tuple(info.class_names), img_size=tuple(size), mean=tuple(info.mean),
                          std=tuple(info.std), interpolation=info.interpolation, crop_pct=info.crop_pct)
    mean, std = channel_normalisation(made.mean, made.std, in_chans)
    made = replace(made, mean=mean, std=std)
    if len(made.mean) not in (1, in_chans) or len(made.std) != len(made.mean):
        raise ValueError(f"{len(made.mean)} mean and {len(made.std)} std values for a {in_chans}-channel network: give "
                         f"one value, or one per channel, of each")
    return made


def model_classes(model: object) -> int | None:
    """How many classes ``model`` predicts, where it says (cgavit's models and timm's do)."""
    count = getattr(model, "num_classes", None)
    return count if isinstance(count, int) and not isinstance(count, bool) and count > 0 else None


def check_info_classes(info: object, classes: int | None) -> None:
    """``info`` names no classes or one per model output (``classes``, where known); ValueError otherwise (a file
    recording other names could not be opened)."""
    names = tuple(getattr(info, "class_names", ()))
    if names and classes is not None and len(names) != classes:
        raise ValueError(f"info names {len(names)} classes but the model predicts {classes}: give this model's info "
                         "(the ModelInfo load_model returned with it)")


def check_info_outputs(info: object, model: object) -> None:
    """``info`` names no classes or one per value ``model`` returns for an image (ValueError otherwise: a file
    recording other names could not be opened): one per class (:func:`check_info_classes`), and for a model without a
    classifier (``num_classes=0``), which returns its pooled features, one per feature (``num_features``)."""
    names = tuple(getattr(info, "class_names", ()))
    features = getattr(model, "num_features", None)
    if names and getattr(model, "num_classes", None) == 0 and isinstance(features, int) and len(names) != features:
        raise ValueError(f"info names {len(names)} classes but the model has no classifier (num_classes=0): it returns "
                         f"{features} features per image, not one logit per class; give info without class names")
    check_info_classes(info, model_classes(model))


def unreadable_file(source: str | os.PathLike, kind: str, err: BaseException) -> ValueError:
    """The one line for an exported file that its runtime cannot read (cut short, or not such a file at all):
    ``kind`` (``"an ONNX model"``, ...) and the runtime's reason, the last line of its message (OpenVINO's first
    lines name the place in its source that raised it)."""
    return ValueError(f"cannot read {source} as {kind} (truncated or corrupt?): {runtime_reason(err)}; export it again")


def int8_info(info: ExportInfo, options: Int8Options, float_part: str = "fp32") -> ExportInfo:
    """``info`` for an int8 file quantised with ``options`` and judged with its float part in ``float_part``
    (its weight range, calibration, float layers and float part recorded over what ``info.int8`` already holds)."""
    made = dict(weight_range=weight_range_label(bool(options.reduce_range), options.weights),
                calibration=options.calibration, float_layers=list(options.float_layers), float_part=float_part)
    return replace(info, precision="int8", int8={**dict(info.int8), **made})


def _json_text(key: str, value: object) -> str:
    """``value`` as JSON text; ValueError naming ``key`` for a value JSON has no form for (a tensor, a numpy scalar)."""
    try:
        return json.dumps(value)
    except (TypeError, ValueError) as err:
        raise ValueError(f"its {key} holds what JSON cannot write ({err}): give Python numbers and text") from None


def _parsed(props: Mapping[str, str]) -> ExportInfo:
    """The :class:`ExportInfo` of a ``{"cgavit.KEY": json text}`` table (other keys ignored), each value checked:
    the one set of rules for reading a file's metadata and for writing it (ValueError: the first bad value)."""
    mine = {k[len(PREFIX) + 1:]: v for k, v in props.items() if k.startswith(PREFIX + ".")}
    return _checked({k: bounded_json(v, f"{PREFIX}.{k}") for k, v in mine.items() if k in KEYS})


def _checked(raw: dict) -> ExportInfo:
    """The :class:`ExportInfo` of parsed metadata values, each checked (ValueError: the first bad one)."""
    size, (lo, hi) = raw.get("img_size"), IMG_SIZE_RANGE
    if not (isinstance(size, list) and len(size) == 2 and all(type(s) is int and lo <= s <= hi for s in size)):
        raise ValueError(f"its image size must be two sides of {lo} to {hi} pixels, got {shown(size)}")
    names = check_class_names(raw.get("class_names", [])) or ()
    mean = _per_channel(raw.get("mean", list(ExportInfo.mean)), "mean", MEAN_RANGE)
    std = _per_channel(raw.get("std", list(ExportInfo.std)), "std", STD_RANGE)
    if len(mean) != len(std):
        raise ValueError(f"its mean and std must have one length, got {len(mean)} and {len(std)} values")
    interpolation, crop, (lo, hi) = raw.get("interpolation", "bicubic"), raw.get("crop_pct", 0.875), CROP_PCT_RANGE
    if interpolation not in INTERPOLATIONS:
        raise ValueError(f"its interpolation must be one of {', '.join(INTERPOLATIONS)}, got {shown(interpolation)}")
    if type(crop) not in (int, float) or not lo <= crop <= hi:
        raise ValueError(f"its crop fraction must be within {lo}..{hi}, got {shown(crop)}")
    precision = raw.get("precision", "fp32")
    if precision not in ("fp32", "int8"):
        raise ValueError(f"its precision must be fp32 or int8, got {shown(precision)}")
    version = raw.get("version", "")
    if version != "":
        check_name(version, "its cgavit version")  # text that reaches a terminal, as the class names do
    return ExportInfo(names, (size[0], size[1]), mean, std, interpolation, float(crop), precision,
                      _int8_record(raw.get("int8", {})), version)


def _per_channel(values: object, name: str, bounds: tuple[float, float]) -> tuple[float, ...]:
    """A mean or std: a list of one number, or of one per input channel (:meth:`ExportInfo.check_network` counts
    them against the network's), each within ``bounds``."""
    if not isinstance(values, list) or not values:
        raise ValueError(f"its {name} must be a list of numbers, one or one per channel, got {shown(values)}")
    return bounded_floats(values, f"its {name}", len(values), *bounds)


def _int8_record(int8: object) -> dict:
    """How an int8 file was made and judged: an object whose float part is one of
    :data:`~cgavit.deploy.int8.FLOAT_PARTS`, whose float layers are a list of names, whose verdict
    (``meets_target``, ``agreement``, ``accuracy_change``) has its types and ranges, and whose other text is
    printable and numbers finite."""
    if not isinstance(int8, dict):
        raise ValueError(f"its int8 record must be an object, got {shown(int8)}")
    if int8.get("float_part", "fp32") not in FLOAT_PARTS:
        raise ValueError(f"its int8 float part must be one of {', '.join(FLOAT_PARTS)}, got {shown(int8['float_part'])}")
    layers = int8.get("float_layers", [])
    if not isinstance(layers, list):
        raise ValueError(f"its int8 float layers must be a list of layer names, got {shown(layers)}")
    for layer in layers:
        check_name(layer, "its int8 float layer")
    if not isinstance(int8.get("meets_target", False), bool):
        raise ValueError(f"its int8 meets_target must be true or false, got {shown(int8['meets_target'])}")
    for key, low, high in (("agreement", 0, 1), ("accuracy_change", -100, 100)):
        value = int8.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high):
            raise ValueError(f"its int8 {key} must be a number from {low} to {high}, got {shown(value)}")
    for key, value in int8.items():
        if isinstance(value, str) and value:
            check_name(value, f"its int8 {key}")
        elif isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"its int8 {key} must be a finite number, got {value}")
    return int8
