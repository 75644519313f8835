"""What an exported file carries for its consumer, in the format's own metadata (ONNX ``metadata_props``,
OpenVINO ``rt_info``): class names, input size, mean/std, interpolation, crop, the cgavit version and,
for int8, how it was quantised and what it kept.

:class:`ExportInfo` is format-neutral: a flat ``{key: string}`` table (:meth:`ExportInfo.to_props`)
that the ONNX and OpenVINO modules write and read with their own APIs. Values are JSON text, so a
reader in any language parses them.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from importlib import metadata

from ..bounds import IMG_SIZE_RANGE, INTERPOLATIONS, MAX_CLASSES
from .int8 import Int8Options, weight_range_label

#: The prefix of every key cgavit writes (ONNX: ``cgavit.class_names``; OpenVINO: ``rt_info["cgavit"]``).
PREFIX = "cgavit"
#: The keys, in the order they are written.
KEYS = ("version", "class_names", "img_size", "mean", "std", "interpolation", "crop_pct", "precision", "int8")


def cgavit_version() -> str:
    """The installed cgavit's version (its package metadata), ``"unknown"`` when it is not installed."""
    try:
        return metadata.version("cgavit")
    except metadata.PackageNotFoundError:
        return "unknown"


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

    def to_props(self) -> dict[str, str]:
        """``{"cgavit.KEY": json text}`` for every key of :data:`KEYS`."""
        values = dict(version=self.version, class_names=list(self.class_names), img_size=list(self.img_size),
                      mean=list(self.mean), std=list(self.std), interpolation=self.interpolation,
                      crop_pct=self.crop_pct, precision=self.precision, int8=dict(self.int8))
        return {f"{PREFIX}.{key}": json.dumps(values[key]) for key in KEYS}

    @classmethod
    def from_props(cls, props: Mapping[str, str], source: str = "the file") -> ExportInfo:
        """Read :meth:`to_props`'s table back (other keys are ignored), checking every value.

        Raises:
            ValueError: no cgavit metadata, or a value that is malformed or out of range.
        """
        mine = {k[len(PREFIX) + 1:]: v for k, v in props.items() if k.startswith(PREFIX + ".")}
        if "img_size" not in mine:
            raise ValueError(f"{source} carries no cgavit metadata (written by cgavit export or cgavit quantize "
                             "0.1.0 or later); export it again, or give the preprocessing yourself")
        try:
            raw = {k: json.loads(v) for k, v in mine.items() if k in KEYS}
        except json.JSONDecodeError as err:
            raise ValueError(f"{source}: malformed cgavit metadata ({err})") from None
        return _checked(raw, source)


def int8_info(info: ExportInfo, options: Int8Options, float_part: str = "fp32") -> ExportInfo:
    """``info`` for an int8 file quantised with ``options`` and judged with its float part in ``float_part``
    (its weight range, calibration, float layers and float part recorded over what ``info.int8`` already holds)."""
    made = dict(weight_range=weight_range_label(bool(options.reduce_range), options.weights),
                calibration=options.calibration, float_layers=list(options.float_layers), float_part=float_part)
    return replace(info, precision="int8", int8={**dict(info.int8), **made})


def _checked(raw: dict, source: str) -> ExportInfo:
    """The :class:`ExportInfo` of parsed metadata values, each checked."""
    def fail(what: str) -> ValueError:
        return ValueError(f"{source}: cgavit metadata has {what}; export the file again")

    size, names = raw.get("img_size"), raw.get("class_names", [])
    if not (isinstance(size, list) and len(size) == 2 and all(isinstance(s, int) for s in size)
            and all(IMG_SIZE_RANGE[0] <= s <= IMG_SIZE_RANGE[1] for s in size)):
        raise fail(f"an image size {size!r} that is not two sides in {IMG_SIZE_RANGE}")
    if not (isinstance(names, list) and len(names) <= MAX_CLASSES and all(isinstance(n, str) for n in names)):
        raise fail("class names that are not a list of strings")
    mean, std = _floats(raw.get("mean", [0.485, 0.456, 0.406])), _floats(raw.get("std", [0.229, 0.224, 0.225]))
    if mean is None or std is None or len(mean) != len(std) or not all(s > 0 for s in std):
        raise fail("a mean/std that is not two lists of numbers of one length (std > 0)")
    interpolation, crop = raw.get("interpolation", "bicubic"), raw.get("crop_pct", 0.875)
    if interpolation not in INTERPOLATIONS:
        raise fail(f"interpolation {interpolation!r} (not one of {', '.join(INTERPOLATIONS)})")
    if not isinstance(crop, (int, float)) or not 0 < crop <= 1:
        raise fail(f"a crop fraction {crop!r} outside (0, 1]")
    precision, int8 = raw.get("precision", "fp32"), raw.get("int8", {})
    if precision not in ("fp32", "int8") or not isinstance(int8, dict):
        raise fail(f"precision {precision!r}")
    return ExportInfo(tuple(names), (size[0], size[1]), mean, std, interpolation, float(crop), precision, int8,
                      str(raw.get("version", "")))


def _floats(values: object) -> tuple[float, ...] | None:
    if isinstance(values, Sequence) and not isinstance(values, str) and values \
            and all(isinstance(v, (int, float)) for v in values):
        return tuple(float(v) for v in values)
    return None
