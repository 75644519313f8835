"""Analyses of the seed's claims: head similarity, Taylor channel importance, the ablation study.

Submodules are imported on first use, so ``import cgavit.analysis`` stays cheap:

- :func:`head_similarity` (``heads``): per-block cosine similarity of the heads' attention maps.
- :func:`taylor_importance` (``taylor``): first-order Taylor importance of Q/K/V/FFN/projection channels.
- ``ablation``: the sandwich / channel-group / cascade / reallocation ladder, trained and measured.
"""

from __future__ import annotations

import importlib

_LAZY = {
    "head_similarity": "heads",
    "BlockSimilarity": "heads",
    "cosine_similarity_matrix": "heads",
    "taylor_importance": "taylor",
    "BlockImportance": "taylor",
    "pruning_order": "taylor",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
