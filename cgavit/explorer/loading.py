"""The model whose attention the explorer shows: a checkpoint, rebuilt by :func:`cgavit.load_model`,
or a randomly initialised variant."""

from __future__ import annotations

import os
from dataclasses import MISSING, fields
from pathlib import Path
from typing import NamedTuple

import torch

from ..factory import ModelInfo, create_model, load_model
from ..imagenet import class_names
from ..model import EfficientViT
from ..testing import randomize_
from ..variants import VARIANTS


class ExplorerModel(NamedTuple):
    """What :func:`build_model` returns: ``ImageAttention(*build_model(...))`` builds the page's image panel."""

    model: EfficientViT
    about: str
    info: ModelInfo  # how images are fed to it: the checkpoint's recorded normalisation and resize


def build_model(
    checkpoint: str | os.PathLike | None = None,
    model_name: str | None = None,
    img_size: int | None = None,
    trust: bool = False,
    **dials,
) -> ExplorerModel:
    """The model whose attention the page shows, an honest sentence about where it came from, and how
    images are fed to it.

    A checkpoint is rebuilt by :func:`cgavit.load_model`: a cgavit file from the architecture it
    records, an official or timm file as ``model_name`` (with ``dials``); images are then normalised
    and resized as the checkpoint records (its ``ModelInfo``). Without a checkpoint the model is a
    randomly initialised ``model_name`` (default ``efficientvit_m0``), its weights drawn, BatchNorm
    statistics and bias tables randomised with seed 0 (the same model at every start), fed as ImageNet
    models are; the sentence names the variant and any dials that differ from it. ``img_size`` (default: the size a
    checkpoint records, else 224) is the side images are resized to; a checkpoint built for another
    size gets its bias tables resized.

    Raises:
        ValueError: unknown model, impossible dials, an unusable checkpoint (``CheckpointError``), or one of
            another number of input channels than 3.
    """
    if checkpoint is None:
        model_name = model_name or "efficientvit_m0"
        with torch.random.fork_rng(devices=[]):  # the same weights at every start, the caller's generator untouched
            torch.manual_seed(0)
            model = create_model(model_name, img_size=img_size or 224, **dials)
        randomize_(model, 0)
        about = (
            f"a randomly initialised {_architecture(model)} (no --checkpoint given; weights, BatchNorm statistics and "
            "bias tables drawn with seed 0). Its maps show how the mechanism mixes tokens, "
            "not what a trained network looks at."
        )
        info = ModelInfo(class_names(model.num_classes), img_size=model.img_size[0], source=about)
        return ExplorerModel(model.eval(), about, info)
    model, info = load_model(checkpoint, model_name, dials or None, img_size=img_size, trust=trust)
    if model.in_chans != 3:
        raise ValueError(f"{checkpoint} is a model of {model.in_chans} input channel{'s' if model.in_chans != 1 else ''}; "
                         "the explorer shows what a model sees of an RGB image, so it takes 3-channel models only")
    return ExplorerModel(model, f"checkpoint {Path(checkpoint).name} loaded into {_architecture(model)}.", info)


def _architecture(model: EfficientViT) -> str:
    """The variant's name, and the design dials in which the network differs from it (a network that names
    no variant: its widths, depths and heads, and the dials off their defaults)."""
    c, name = model.cfg, model.pretrained_cfg.get("architecture") or ""
    variant = VARIANTS.get(name)
    if variant is not None:
        changed = [f for f in fields(c) if f.name in c.differs_from(variant.cfg)]
        return f"{name} with dials of its own ({_dials(c, changed)})" if changed else name
    own = [f for f in fields(c) if f.default is MISSING or getattr(c, f.name) != f.default]
    return f"an EfficientViT of its own ({_dials(c, own)})"


def _dials(cfg: object, chosen: list) -> str:
    """``name value`` for each of the ``chosen`` fields of ``cfg`` (a per-stage value as ``64,128,192``)."""
    def shown(value: object) -> str:
        return ",".join(map(str, value)) if isinstance(value, tuple) else str(value)

    return ", ".join(f"{f.name} {shown(getattr(cfg, f.name))}" for f in chosen)
