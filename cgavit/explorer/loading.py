"""The model whose attention the explorer shows: a checkpoint, rebuilt by :func:`cgavit.load_model`,
or a randomly initialised variant."""

from __future__ import annotations

import os
from pathlib import Path

from ..factory import create_model, load_model
from ..model import EfficientViT
from ..testing import randomize_


def build_model(
    checkpoint: str | os.PathLike | None = None,
    model_name: str | None = None,
    img_size: int | None = None,
    trust: bool = False,
    **dials,
) -> tuple[EfficientViT, str]:
    """The model whose attention the page shows, and an honest sentence about where it came from.

    A checkpoint is rebuilt by :func:`cgavit.load_model`: a cgavit file from the architecture it
    records, an official or timm file as ``model_name`` (with ``dials``). Without a checkpoint the
    model is a randomly initialised ``model_name`` (default ``efficientvit_m0``), with BatchNorm
    statistics and bias tables randomised (seed 0). ``img_size`` (default: the size a checkpoint records, else 224)
    is the side images are resized to; a checkpoint built for another size gets its bias tables resized.

    Raises:
        ValueError: unknown model, impossible dials, or an unusable checkpoint (``CheckpointError``).
    """
    if checkpoint is None:
        model_name = model_name or "efficientvit_m0"
        model = create_model(model_name, img_size=img_size or 224, **dials)
        randomize_(model, 0)
        about = (
            f"a randomly initialised {model_name} (no --checkpoint given; BatchNorm statistics and "
            "bias tables randomised with seed 0). Its maps show how the mechanism mixes tokens, "
            "not what a trained network looks at."
        )
        return model.eval(), about
    model, _ = load_model(checkpoint, model_name, dials or None, img_size=img_size, trust=trust)
    arch = model.pretrained_cfg["architecture"] or "the architecture it records"
    return model, f"checkpoint {Path(checkpoint).name} loaded into {arch}."
