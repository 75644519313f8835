"""The model whose attention the explorer shows: a checkpoint (ours rebuilt from its metadata;
official or timm files loaded into a named variant), or a randomly initialised variant."""

from __future__ import annotations

import logging
import os
from pathlib import Path

from ..factory import create_model
from ..model import EfficientViT
from ..testing import randomize_
from ..weights import load_checkpoint, read_weights_meta

log = logging.getLogger(__name__)


def build_model(
    checkpoint: str | os.PathLike | None = None,
    model_name: str = "efficientvit_m0",
    img_size: int = 224,
    trust: bool = False,
    **dials,
) -> tuple[EfficientViT, str]:
    """The model whose attention the page shows, and an honest sentence about where it came from.

    A cgavit checkpoint rebuilds its own architecture from its metadata (read and validated by
    :func:`~cgavit.weights.read_weights_meta`); official and timm files are loaded into
    ``model_name`` (with ``dials``). Without a checkpoint the model is randomly initialised, with
    BatchNorm statistics and bias tables randomised (seed 0).

    Raises:
        ValueError: unknown model, impossible dials, or an unusable checkpoint (``CheckpointError``).
    """
    if checkpoint is None:
        model = create_model(model_name, img_size=img_size, **dials)
        randomize_(model, 0)
        about = (
            f"a randomly initialised {model_name} (no --checkpoint given; BatchNorm statistics and "
            "bias tables randomised with seed 0). Its maps show how the mechanism mixes tokens, "
            "not what a trained network looks at."
        )
        return model.eval(), about
    path = Path(checkpoint)
    meta = read_weights_meta(path)
    if meta is not None:
        if dials:
            raise ValueError(f"{path} records its own architecture; drop the dial options ({sorted(dials)})")
        model = EfficientViT(meta.config, num_classes=meta.num_classes, img_size=img_size, distillation=meta.distillation)
        arch = "the architecture recorded in its metadata"
    else:
        model = create_model(model_name, img_size=img_size, **dials)
        arch = model_name
    report = load_checkpoint(model, path, trust=trust)
    log.info("explorer: loaded %s (skipped %s, resized %s)", path, report["skipped"], report["resized"])
    return model.eval(), f"checkpoint {path.name} loaded into {arch}."
