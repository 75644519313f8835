"""``create_model`` and ``list_models``: the package's front door."""

from __future__ import annotations

import difflib
import logging
from pathlib import Path

from .model import EfficientViT
from .variants import VARIANTS
from .weights import download_release, load_checkpoint

log = logging.getLogger(__name__)


def list_models(pattern: str = "") -> list[str]:
    """Names of the registered variants containing ``pattern`` (all by default)."""
    return sorted(n for n in VARIANTS if pattern in n)


def resolve_name(name: str) -> str:
    """The registered variant for ``name`` (``m4``, timm tags accepted); ValueError with a suggestion."""
    key = name.split(".")[0].lower().replace("-", "_")  # accept timm tags: efficientvit_m0.r224_in1k
    if key not in VARIANTS and f"efficientvit_{key}" in VARIANTS:  # "m4"
        key = f"efficientvit_{key}"
    if key not in VARIANTS:
        close = difflib.get_close_matches(key, list(VARIANTS), n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ValueError(f"unknown model {name!r}.{hint} Available: {', '.join(list_models())}")
    return key


def create_model(
    name: str,
    pretrained: bool = False,
    checkpoint_path: str | Path | None = None,
    num_classes: int = 1000,
    *,
    in_chans: int = 3,
    img_size: int | tuple[int, int] = 224,
    distillation: bool = False,
    drop_path_rate: float = 0.0,
    **dials,
) -> EfficientViT:
    """Build a registered EfficientViT, optionally with weights.

    Args:
        name: ``efficientvit_m0`` ... ``efficientvit_m5`` (``m4`` and timm tags accepted).
        pretrained: fetch the official ImageNet-1k release file into the torch hub cache and load it.
        checkpoint_path: load weights from this file (official, timm or cgavit format).
        num_classes: classifier outputs; a loaded checkpoint with another count keeps its body and
            drops its classifier (logged), as fine-tuning needs.
        in_chans: input channels.
        img_size: size the model is built for (sets the attention windows); any size >= 32 runs.
        distillation: add the distillation head.
        drop_path_rate: stochastic depth for training.
        **dials: design dials of :class:`~cgavit.variants.EfficientViTConfig` (``cascade``,
            ``group_split``, ``ffn_per_side``, ``key_dim``, ``attn_ratio``, ``ffn_ratio``) and its
            other fields (``num_heads``, ``embed_dim``, ``depth``, ``window_size``, ``kernels``).

    Raises:
        ValueError: unknown name, or a dial combination that cannot work.
    """
    key = resolve_name(name)
    info = VARIANTS[key]
    cfg = info.cfg.with_dials(**dials) if dials else info.cfg
    model = EfficientViT(
        cfg,
        num_classes=num_classes,
        in_chans=in_chans,
        img_size=img_size,
        distillation=distillation,
        drop_path_rate=drop_path_rate,
        name=key,
    )
    if pretrained and checkpoint_path is not None:
        raise ValueError("give either pretrained=True or checkpoint_path, not both")
    if pretrained or checkpoint_path is not None:
        if pretrained:
            if dials:
                log.warning("loading published weights into a model with changed dials %s", sorted(dials))
            checkpoint_path = download_release(info.url)
        load_checkpoint(model, checkpoint_path)
    return model
