"""The variant table measured from the models themselves (``cgavit info`` prints it)."""

from __future__ import annotations

import torch
from torch.utils.flop_counter import FlopCounterMode

from .factory import create_model, list_models
from .variants import VARIANTS, resolve_name


def count_macs(model: torch.nn.Module, img_size: tuple[int, int]) -> int:
    """Multiply-accumulates of one forward pass on one image (``torch.utils.flop_counter``)."""
    x = torch.randn(1, getattr(model, "in_chans", 3), *img_size)
    was_training = model.training
    model.eval()
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        model(x)
    model.train(was_training)
    return counter.get_total_flops() // 2


def variant_rows(img_size: tuple[int, int] = (224, 224), names: list[str] | None = None) -> list[dict]:
    """One dict per variant (``names`` as :func:`~cgavit.create_model` takes them, ``m4`` too; all by default): measured
    params/MACs beside the published figures.

    Raises:
        ValueError: an unknown name (naming the close one).
    """
    rows = []
    for name in [resolve_name(n) for n in names] if names else list_models():
        info = VARIANTS[name]
        model = create_model(name, img_size=img_size)  # built for that size, as create_model(img_size=) gives it
        cfg = info.cfg
        rows.append(
            dict(
                model=name,
                params_m=round(sum(p.numel() for p in model.parameters()) / 1e6, 3),
                macs_m=round(count_macs(model, img_size) / 1e6, 1),
                published_params_m=info.params_m,
                published_macs_m=info.macs_m,
                top1=info.top1,
                widths=list(cfg.embed_dim),
                depths=list(cfg.depth),
                heads=list(cfg.num_heads),
                img_size=list(img_size),
            )
        )
    return rows
