"""The M0-M5 table, their published figures, and the seed's design dials, in one place."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from .attention import check_attention_dims

#: ImageNet normalisation, the same numbers as ``timm.data.IMAGENET_DEFAULT_MEAN/STD`` (a test checks);
#: kept here so the model core depends on torch alone.
IMAGENET_DEFAULT_MEAN = (0.485, 0.456, 0.406)
IMAGENET_DEFAULT_STD = (0.229, 0.224, 0.225)

#: Largest value of each architecture field (per entry). Far above any published or studied model;
#: they stop a typo or a hostile file from asking for gigabytes before anything is built.
CONFIG_LIMITS = {
    "embed_dim": 2048, "depth": 32, "num_heads": 64, "window_size": 64, "kernels": 31, "key_dim": 512,
    "ffn_per_side": 16,
}
MAX_FFN_RATIO = 16.0
MAX_ATTN_RATIO = 64.0

RELEASE_URL = "https://github.com/xinyuliu-jeffrey/EfficientViT_Model_Zoo/releases/download/v1.0/{name}.pth"


def _per_stage(name: str, value, cast) -> tuple:
    """Broadcast one value to the three stages, or check a 3-sequence."""
    if isinstance(value, (str, bytes)) or value is None:
        raise ValueError(f"{name} must be a number or three numbers (one per stage), got {value!r}")
    if isinstance(value, Sequence):
        if len(value) != 3:
            raise ValueError(f"{name} needs one value per stage (3), got {len(value)}: {list(value)}")
        return tuple(cast(v) for v in value)
    return (cast(value),) * 3


@dataclass(frozen=True)
class EfficientViTConfig:
    """Architecture of one EfficientViT, including the seed's design dials.

    The dial defaults are the paper's; every variant M0-M5 differs only in the first five fields.
    """

    embed_dim: tuple[int, int, int]  # channels per stage
    depth: tuple[int, int, int]  # sandwich blocks per stage
    num_heads: tuple[int, int, int]  # attention heads per stage
    window_size: tuple[int, int, int] = (7, 7, 7)  # local attention window (clamped to the map)
    kernels: tuple[int, ...] = (5, 5, 5, 5)  # depthwise kernel on each head's query
    # --- design dials (seed chapters 2, 4-6) ---
    key_dim: tuple[int, int, int] = (16, 16, 16)  # Q/K width per head (narrow: chapter 6)
    attn_ratio: tuple[float, float, float] | None = None  # V width = attn_ratio * key_dim;
    #   None = embed_dim / (key_dim * heads), so a head's output is as wide as the next head's group
    ffn_ratio: float = 2.0  # FFN expansion (paper 2, standard ViT 4)
    ffn_per_side: tuple[int, int] = (1, 1)  # sandwich N: dw+FFN pairs before / after attention
    cascade: bool = True  # add head j's output to head j+1's input (chapter 5)
    group_split: bool = True  # each head reads its own channel group (chapter 4)

    def value_dim(self, stage: int) -> int:
        """Value width per head in ``stage``."""
        if self.attn_ratio is None:
            return self.embed_dim[stage] // self.num_heads[stage]
        return int(self.attn_ratio[stage] * self.key_dim[stage])

    def validate(self) -> None:
        """Raise ``ValueError`` naming the dial to change when this layout cannot work."""
        for name in ("embed_dim", "depth", "num_heads", "window_size", "key_dim"):
            vals = getattr(self, name)
            if len(vals) != 3 or any(int(v) != v or v < 1 for v in vals):
                raise ValueError(f"{name} must be three positive integers, got {vals}")
        for name, hi in CONFIG_LIMITS.items():
            vals = getattr(self, name)
            if any(v > hi for v in vals):
                raise ValueError(f"{name} entries must be at most {hi}, got {list(vals)}")
        if self.ffn_ratio > MAX_FFN_RATIO or (self.attn_ratio is not None and max(self.attn_ratio) > MAX_ATTN_RATIO):
            raise ValueError(
                f"ffn_ratio must be at most {MAX_FFN_RATIO:g} and attn_ratio at most {MAX_ATTN_RATIO:g}, "
                f"got {self.ffn_ratio} and {self.attn_ratio}"
            )
        if self.embed_dim[0] % 8:
            raise ValueError(
                f"the stage-1 width must be a multiple of 8 (the patch embedding uses C/8, C/4, C/2), "
                f"got {self.embed_dim[0]}"
            )
        if not self.kernels or any(k < 1 or k % 2 == 0 for k in self.kernels):
            raise ValueError(f"kernels must be odd positive sizes, got {self.kernels}")
        if not self.ffn_ratio > 0:
            raise ValueError(f"ffn_ratio must be positive, got {self.ffn_ratio}")
        if len(self.ffn_per_side) != 2 or min(self.ffn_per_side) < 0:
            raise ValueError(f"ffn_per_side must be N >= 0 or a pair (before, after), got {self.ffn_per_side}")
        if self.attn_ratio is not None and any(not r > 0 for r in self.attn_ratio):
            raise ValueError(f"attn_ratio must be positive, got {self.attn_ratio}")
        for i in range(3):
            try:
                check_attention_dims(
                    self.embed_dim[i],
                    self.key_dim[i],
                    self.num_heads[i],
                    None if self.attn_ratio is None else self.value_dim(i),
                    self.cascade,
                    self.group_split,
                )
            except ValueError as err:
                raise ValueError(f"stage {i + 1}: {err}") from None

    def with_dials(self, **dials) -> "EfficientViTConfig":
        """A copy with dials / fields changed; scalars broadcast to the three stages."""
        unknown = set(dials) - set(self.__dataclass_fields__)
        if unknown:
            raise ValueError(
                f"unknown option(s) {sorted(unknown)}; valid: {sorted(self.__dataclass_fields__)}"
            )
        out = dict(dials)
        for name in ("embed_dim", "depth", "num_heads", "window_size", "key_dim"):
            if name in out:
                out[name] = _per_stage(name, out[name], int)
        if out.get("attn_ratio") is not None:
            out["attn_ratio"] = _per_stage("attn_ratio", out["attn_ratio"], float)
        if "ffn_per_side" in out:
            n = out["ffn_per_side"]
            out["ffn_per_side"] = (int(n), int(n)) if isinstance(n, (int, float)) else tuple(int(v) for v in n)
        if "kernels" in out:
            out["kernels"] = tuple(int(k) for k in out["kernels"])
        for flag in ("cascade", "group_split"):
            if flag in out and not isinstance(out[flag], bool):
                raise ValueError(f"{flag} must be True or False, got {out[flag]!r}")
        cfg = replace(self, **out)
        cfg.validate()
        return cfg


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
    ImageNet mean/std (the official evaluation uses crop_pct 0.875).
    """
    info = VARIANTS.get(name)
    return dict(
        url=info.url if info else "",
        architecture=name,
        tag="r224_in1k" if info else "",
        input_size=(in_chans, *img_size),
        fixed_input_size=False,
        interpolation="bicubic",
        crop_pct=0.875,
        crop_mode="center",
        mean=IMAGENET_DEFAULT_MEAN,
        std=IMAGENET_DEFAULT_STD,
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
