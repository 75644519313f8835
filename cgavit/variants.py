"""The M0-M5 table, their published figures, and the design dials, in one place."""

from __future__ import annotations

import difflib
import math
import numbers
import operator
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from .attention import check_attention_dims, query_kernels
from .reallocation import allocation_dials, allocation_of, value_width

#: ImageNet normalisation, the same numbers as ``timm.data.IMAGENET_DEFAULT_MEAN/STD`` (a test checks);
#: kept here so the model core depends on torch alone.
IMAGENET_DEFAULT_MEAN = (0.485, 0.456, 0.406)
IMAGENET_DEFAULT_STD = (0.229, 0.224, 0.225)


def channel_normalisation(mean: Sequence[float], std: Sequence[float],
                          in_chans: int) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """``(mean, std)`` for a network of ``in_chans`` input channels: three values (RGB's, ImageNet's) become their
    averages, one value for every channel, where the network takes other than 3; any other values are kept."""
    if in_chans != 3 and len(mean) == 3 and len(std) == 3:
        return (sum(mean) / 3,), (sum(std) / 3,)
    return tuple(mean), tuple(std)


#: Inclusive ``(low, high)`` bounds of each entry of the integer architecture fields. The highs are
#: far above any published or studied model; they stop a typo or a hostile file from asking for
#: gigabytes before anything is built.
CONFIG_LIMITS: dict[str, tuple[int, int]] = {
    "embed_dim": (8, 2048), "depth": (1, 32), "num_heads": (1, 64), "window_size": (1, 64), "kernels": (1, 31),
    "key_dim": (1, 512), "ffn_per_side": (0, 16),
}
#: Largest value of each ratio dial (both must be above 0).
MAX_FFN_RATIO = 16.0
MAX_ATTN_RATIO = 64.0
#: Most query kernels a config may list (one per head is used; the last repeats for more heads).
MAX_KERNELS = CONFIG_LIMITS["num_heads"][1]

#: the tag timm gives the published weights (``efficientvit_m0.r224_in1k``): the only one a name may carry
WEIGHTS_TAG = "r224_in1k"
RELEASE_URL = "https://github.com/xinyuliu-jeffrey/EfficientViT_Model_Zoo/releases/download/v1.0/{name}.pth"

_PER_STAGE = ("embed_dim", "depth", "num_heads", "window_size", "key_dim")
_FLAGS = ("cascade", "group_split")


class DialError(ValueError):
    """A design dial or architecture field that cannot work; ``dial`` names it (``"key_dim"``), so a
    command line can name its own flag for it."""

    def __init__(self, dial: str, message: str) -> None:
        super().__init__(message)
        self.dial = dial


def _whole(name: str, value) -> int:
    """``value`` as an int (ints and numpy integers; not bools, floats or text)."""
    if isinstance(value, bool) or isinstance(value, (str, bytes)):
        raise DialError(name, f"{name} must be whole numbers, got {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise DialError(name, f"{name} must be whole numbers, got {value!r}") from None


def _real(name: str, value) -> float:
    """``value`` as a finite float (ints, floats, numpy reals; not bools or text)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise DialError(name, f"{name} must be a finite number, got {value!r}")
    return float(value)


def _entries(name: str, value, count: int | None, cast) -> tuple:
    """One value broadcast to ``count`` entries, or a sequence of exactly ``count`` (any length with
    ``count=None``), each cast."""
    if isinstance(value, (str, bytes)) or value is None or isinstance(value, Mapping):
        raise DialError(name, f"{name} must be a number or a list of numbers (one per stage), got {value!r}")
    if isinstance(value, (Sequence, Iterable)) and not isinstance(value, numbers.Number):
        try:
            values = tuple(value)
        except TypeError:  # iterable by type only, as a 0-d tensor or array: one value
            return (cast(name, value),) * (count or 1)
        if count is not None and len(values) != count:
            raise DialError(name, f"{name} needs one value per stage ({count}), got {len(values)}: {list(values)}")
        if not values or len(values) > MAX_KERNELS:
            raise DialError(name, f"{name} needs 1 to {MAX_KERNELS} values, got {len(values)}")
        return tuple(cast(name, v) for v in values)
    return (cast(name, value),) * (count or 1)


def _bounded(name: str, values: tuple[int, ...]) -> None:
    lo, hi = CONFIG_LIMITS[name]
    if any(not lo <= v <= hi for v in values):
        raise DialError(name, f"{name} entries must be at most {hi} (and at least {lo}), got {list(values)}")


@dataclass(frozen=True)
class EfficientViTConfig:
    """Architecture of one EfficientViT, including the design dials.

    The dial defaults are the paper's; every variant M0-M5 differs only in the first five fields.
    Every config is checked when it is made (:meth:`validate`, the one home of these rules):
    numbers are normalised to tuples of ints / floats, and a layout that cannot work raises
    :class:`DialError` (a ``ValueError``) naming the dial to change.
    """

    embed_dim: tuple[int, int, int]  # channels per stage
    depth: tuple[int, int, int]  # sandwich blocks per stage
    num_heads: tuple[int, int, int]  # attention heads per stage
    window_size: tuple[int, int, int] = (7, 7, 7)  # local attention window (clamped to the map)
    kernels: tuple[int, ...] = (5, 5, 5, 5)  # depthwise kernel on each head's query
    # --- design dials (design notes, chapters 2, 4-6) ---
    key_dim: tuple[int, int, int] = (16, 16, 16)  # Q/K width per head (narrow: chapter 6)
    attn_ratio: tuple[float, float, float] | None = None  # V width = attn_ratio * key_dim;
    #   None = embed_dim / heads, so a head's output is as wide as the next head's group
    ffn_ratio: float = 2.0  # FFN expansion (paper 2, standard ViT 4)
    ffn_per_side: tuple[int, int] = (1, 1)  # sandwich N: dw+FFN pairs before / after attention
    cascade: bool = True  # add head j's output to head j+1's input (chapter 5)
    group_split: bool = True  # each head reads its own channel group (chapter 4)

    def __post_init__(self) -> None:
        for name in _PER_STAGE:
            object.__setattr__(self, name, _entries(name, getattr(self, name), 3, _whole))
        object.__setattr__(self, "kernels", _entries("kernels", self.kernels, None, _whole))
        object.__setattr__(self, "ffn_per_side", _entries("ffn_per_side", self.ffn_per_side, 2, _whole))
        if self.attn_ratio is not None:
            object.__setattr__(self, "attn_ratio", _entries("attn_ratio", self.attn_ratio, 3, _real))
        object.__setattr__(self, "ffn_ratio", _real("ffn_ratio", self.ffn_ratio))
        for flag in _FLAGS:
            if not isinstance(getattr(self, flag), bool):
                raise DialError(flag, f"{flag} must be True or False, got {getattr(self, flag)!r}")
        self.validate()

    def value_dim(self, stage: int) -> int:
        """Value width per head in ``stage`` (:func:`cgavit.reallocation.value_width`)."""
        ratio = None if self.attn_ratio is None else self.attn_ratio[stage]
        return value_width(self.embed_dim[stage], self.num_heads[stage], self.key_dim[stage], ratio)

    @property
    def allocation(self) -> str:
        """The parameter allocation these widths follow: ``"paper"``, ``"uniform"`` or ``"custom"``
        (:mod:`cgavit.reallocation`)."""
        return allocation_of(self.embed_dim, self.num_heads, self.key_dim, self.attn_ratio, self.ffn_ratio)

    def validate(self) -> None:
        """Raise :class:`DialError` naming the dial to change when this layout cannot work."""
        for name in (*_PER_STAGE, "kernels", "ffn_per_side"):
            _bounded(name, getattr(self, name))
        if any(k % 2 == 0 for k in self.kernels):
            raise DialError("kernels", f"kernels must be odd positive sizes, got {self.kernels}")
        if not 0 < self.ffn_ratio <= MAX_FFN_RATIO:
            raise DialError("ffn_ratio", f"ffn_ratio must be within (0, {MAX_FFN_RATIO:g}], got {self.ffn_ratio}")
        if self.attn_ratio is not None and not all(0 < r <= MAX_ATTN_RATIO for r in self.attn_ratio):
            raise DialError("attn_ratio", f"attn_ratio must be within (0, {MAX_ATTN_RATIO:g}], got {self.attn_ratio}")
        if self.embed_dim[0] % 8:
            raise DialError(
                "embed_dim", "the stage-1 width must be a multiple of 8 (the patch embedding uses C/8, C/4, "
                f"C/2), got {self.embed_dim[0]}"
            )
        for i in range(3):
            if int(self.embed_dim[i] * self.ffn_ratio) < 1:
                raise DialError("ffn_ratio", f"ffn_ratio {self.ffn_ratio} leaves the stage-{i + 1} FFN of width "
                                f"{self.embed_dim[i]} no hidden channel; raise it")
            try:
                check_attention_dims(
                    self.embed_dim[i], self.key_dim[i], self.num_heads[i],
                    None if self.attn_ratio is None else self.value_dim(i), self.cascade, self.group_split,
                )
            except ValueError as err:
                dial = "attn_ratio" if "value width" in str(err) else "num_heads"
                dial = "group_split" if "group_split" in str(err) else dial
                raise DialError(dial, f"stage {i + 1}: {err}") from None

    def differs_from(self, other: "EfficientViTConfig") -> list[str]:
        """The fields (dials, widths, depths, ...) whose value here is not ``other``'s, in declaration order.
        ``kernels`` differ only where a head's kernel does (``(5,)`` and ``(5, 5, 5, 5)`` build the same network)."""
        heads = max(*self.num_heads, *other.num_heads)
        return [name for name in self.__dataclass_fields__ if
                (query_kernels(self.kernels, heads) != query_kernels(other.kernels, heads) if name == "kernels"
                 else getattr(self, name) != getattr(other, name))]

    def with_dials(self, **dials) -> "EfficientViTConfig":
        """A copy with dials / fields changed; scalars broadcast to the three stages.

        ``allocation="paper"|"uniform"`` sets ``key_dim``, ``attn_ratio`` and ``ffn_ratio`` by the
        scheme of :mod:`cgavit.reallocation` (for the widths and heads of this call); any of those
        three given explicitly too wins. A ``key_dim`` given with ``"uniform"`` changes the Q/K width alone:
        the value width stays the scheme's C/h (not 1 x the new ``key_dim``).

        Raises:
            DialError: an unknown name, or a value or layout that cannot work.
        """
        names = set(self.__dataclass_fields__)
        unknown = set(dials) - names - {"allocation"}
        if unknown:
            raise DialError(sorted(unknown)[0], f"unknown option(s) {sorted(unknown)}: no design dial; the dials are "
                                                f"{sorted(names | {'allocation'})}")
        if "allocation" in dials:
            scheme = dials.pop("allocation")
            probe = replace(self, **{k: v for k, v in dials.items() if k in ("embed_dim", "num_heads")})
            try:
                scheme_dials = allocation_dials(scheme, probe.embed_dim, probe.num_heads)
            except ValueError as err:
                raise DialError("allocation", str(err)) from None
            if "key_dim" in dials and "attn_ratio" not in dials:  # the scheme's V width (C/h), not its ratio to Q/K
                scheme_dials["attn_ratio"] = None
            dials = {**scheme_dials, **dials}
        return replace(self, **dials)


@dataclass(frozen=True)
class VariantInfo:
    """Published figures of one variant (ImageNet-1k, 224x224), kept beside its config."""

    cfg: EfficientViTConfig
    params_m: float  # parameters, millions (1000 classes, no distillation head)
    macs_m: float  # multiply-accumulates at 224x224, millions
    top1: float
    top5: float
    v100_img_s: int  # V100, batch 2048, AMP
    url: str = field(default="")


def pretrained_cfg(name: str, num_classes: int = 1000, img_size: tuple[int, int] = (224, 224), in_chans: int = 3) -> dict:
    """timm-style ``pretrained_cfg`` of a model: how its weights expect to be fed.

    The keys are timm's, so ``timm.data.resolve_data_config({}, model=m)`` and ``create_transform``
    give this package's preprocessing: bicubic resize to ``img_size / crop_pct``, centre crop,
    ImageNet mean/std (the official evaluation uses crop_pct 0.875), averaged to one value for every channel for
    ``in_chans`` other than 3 (:func:`channel_normalisation`: three values would not fit its images).
    """
    info = VARIANTS.get(name)
    mean, std = channel_normalisation(IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD, in_chans)
    return dict(
        url=info.url if info else "",
        architecture=name,
        tag=WEIGHTS_TAG if info else "",
        input_size=(in_chans, *img_size),
        fixed_input_size=False,
        interpolation="bicubic",
        crop_pct=0.875,
        crop_mode="center",
        mean=mean,
        std=std,
        num_classes=num_classes,
        first_conv="patch_embed.conv1.conv",
        classifier="head.linear",
        license="mit",
    )


def _variant(name, embed_dim, depth, num_heads, kernels, params, macs, top1, top5, v100) -> VariantInfo:
    cfg = EfficientViTConfig(tuple(embed_dim), tuple(depth), tuple(num_heads), kernels=tuple(kernels))
    return VariantInfo(cfg, params, macs, top1, top5, v100, RELEASE_URL.format(name=name))


VARIANTS: dict[str, VariantInfo] = {
    "efficientvit_m0": _variant("efficientvit_m0", (64, 128, 192), (1, 2, 3), (4, 4, 4), (5, 5, 5, 5), 2.3, 79, 63.2, 85.2, 27644),
    "efficientvit_m1": _variant("efficientvit_m1", (128, 144, 192), (1, 2, 3), (2, 3, 3), (7, 5, 3, 3), 3.0, 167, 68.4, 88.7, 20093),
    "efficientvit_m2": _variant("efficientvit_m2", (128, 192, 224), (1, 2, 3), (4, 3, 2), (7, 5, 3, 3), 4.2, 201, 70.8, 90.2, 18218),
    "efficientvit_m3": _variant("efficientvit_m3", (128, 240, 320), (1, 2, 3), (4, 3, 4), (5, 5, 5, 5), 6.9, 263, 73.4, 91.4, 16644),
    "efficientvit_m4": _variant("efficientvit_m4", (128, 256, 384), (1, 2, 3), (4, 4, 4), (7, 5, 3, 3), 8.8, 299, 74.3, 91.8, 15914),
    "efficientvit_m5": _variant("efficientvit_m5", (192, 288, 384), (1, 3, 4), (3, 3, 4), (7, 5, 3, 3), 12.4, 522, 77.1, 93.4, 10621),
}


def resolve_name(name: str) -> str:
    """The registered variant for ``name`` (``m4``, timm tags accepted); ValueError with a suggestion."""
    if not isinstance(name, str):
        raise ValueError(f"a model name must be text, got {type(name).__name__}")
    key, dot, tag = name.partition(".")  # timm's tag: efficientvit_m0.r224_in1k
    key = key.lower().replace("-", "_")
    if key not in VARIANTS and f"efficientvit_{key}" in VARIANTS:  # "m4"
        key = f"efficientvit_{key}"
    if key not in VARIANTS:
        close = difflib.get_close_matches(key, list(VARIANTS), n=1) if len(key) <= 64 else []
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ValueError(f"unknown model {_cut(name)}.{hint} Available: {', '.join(sorted(VARIANTS))}")
    if dot and tag.lower() != WEIGHTS_TAG:
        raise ValueError(f"unknown weights tag {_cut(tag)} in {_cut(name)}: {key}'s published weights are tagged "
                         f"{WEIGHTS_TAG!r}; give {key!r} or '{key}.{WEIGHTS_TAG}'")
    return key


def _cut(text: str, most: int = 80) -> str:
    """``text``'s repr, cut to about ``most`` characters: a name read from a file may be a megabyte long."""
    return repr(text) if len(text) <= most else repr(text[:most]) + f"... ({len(text):,} characters)"
