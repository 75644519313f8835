"""Analyses of the design notes' claims: head similarity, Taylor channel importance, the ablation study.

- :func:`head_similarity` (``heads``): per-block cosine similarity of the heads' attention maps;
  :func:`map_similarity` is the same definition for maps already in hand (the explorer uses it).
- :func:`taylor_importance` (``taylor``): first-order Taylor importance of Q/K/V/FFN/projection channels.
- ``reports``: the ``cgavit analyze`` runs as library calls (model, image sample, JSON and figures).
- ``ablation``: the sandwich / channel-group / cascade / reallocation ladder, trained and measured.

Importing this package needs torch only; ``reports`` and ``ablation`` need the ``train`` extra and
are imported by name.
"""

from .heads import BlockSimilarity, cosine_similarity_matrix, head_similarity, map_similarity, mean_off_diagonal
from .taylor import BlockImportance, pruning_order, taylor_importance

__all__ = [
    "BlockImportance",
    "BlockSimilarity",
    "cosine_similarity_matrix",
    "head_similarity",
    "map_similarity",
    "mean_off_diagonal",
    "pruning_order",
    "taylor_importance",
]
