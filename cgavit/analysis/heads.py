"""Head redundancy (design notes, chapter 3): cosine similarity between the heads' attention maps.

For every attention block, each head's softmax map ``(N, N)`` of a window is flattened and compared
with every other head's by cosine similarity; the ``h x h`` matrices are averaged over all images and
windows. Values near 1 mean heads that attend alike (redundant), lower values diverse heads. The maps
come from :meth:`~cgavit.attention.CascadedHeads.head_attention_maps`, the same arithmetic as the
forward pass, captured by a forward hook on each attention module (trainable or fused), so windows,
padding and every dial combination are exactly what the model computes.

This module holds the package's one head-similarity definition (the explorer uses it too):

* :func:`map_similarity` -- for maps ``(h, W, N, N)``: the cosine similarity of every pair of heads'
  flattened maps in each window, averaged over the windows. :func:`head_similarity` averages the
  same quantity over every window of every image it runs.
* :func:`mean_off_diagonal` -- the mean over head pairs. A single head has no pairs: the value is
  None (never NaN, so it survives strict JSON), and its matrix is ``[[1.0]]``.
* :func:`mean_similarity` -- the mean over the blocks whose value says something: two heads or more,
  windows of more than one token (one token gives every head the map ``[[1.0]]``, so a trivial 1).

Only torch is imported here; the figures (:func:`plot_similarity`) go through :mod:`.plots`, which
imports matplotlib when a figure is drawn.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ..attention import CascadedHeads
from .plots import bar_chart, block_label, heatmap_grid

log = logging.getLogger(__name__)


@dataclass
class BlockSimilarity:
    """Head similarity of one attention block.

    Attributes:
        name: module path of the attention, e.g. ``stages.1.blocks.0.mixer.m.attn``.
        stage: stage index (0-2), or -1 for a module outside ``stages``.
        block: block index within the stage.
        matrix: ``(h, h)`` mean cosine similarity between heads (1 on the diagonal).
        windows: how many (image, window) pairs were averaged.
        tokens: tokens per window (N).
    """

    name: str
    stage: int
    block: int
    matrix: torch.Tensor
    windows: int
    tokens: int

    @property
    def num_heads(self) -> int:
        return self.matrix.shape[0]

    @property
    def label(self) -> str:
        """The block's name in the figures and printouts: ``s2.b1`` for ``stages.1.blocks.0`` (stage and block
        counted from 1, as the paper counts stages), the module path outside ``stages``."""
        return block_label(self.stage, self.block) if self.stage >= 0 else self.name

    @property
    def mean_off_diagonal(self) -> float | None:
        """Mean similarity over head pairs; None with one head (see :func:`mean_off_diagonal`)."""
        return mean_off_diagonal(self.matrix)

    def to_dict(self) -> dict:
        """JSON-ready values (``mean_off_diagonal`` is null for one head; ``stage`` and ``block`` from 0, as the
        module path, ``label`` the figures' name of the block)."""
        return dict(
            name=self.name,
            label=self.label,
            stage=self.stage,
            block=self.block,
            num_heads=self.num_heads,
            tokens=self.tokens,
            windows=self.windows,
            mean_off_diagonal=self.mean_off_diagonal,
            matrix=[[round(float(v), 6) for v in row] for row in self.matrix],
        )


def cosine_similarity_matrix(maps: torch.Tensor) -> torch.Tensor:
    """Pairwise cosine similarity of heads, per window.

    Args:
        maps: ``(h, W, N, N)`` attention maps of ``h`` heads over ``W`` windows (or any trailing
            shape after the window axis: everything past dim 1 is flattened).

    Returns:
        ``(W, h, h)`` similarities; a head with an all-zero map has similarity 0 with every head.
    """
    h, w = maps.shape[:2]
    flat = maps.reshape(h, w, -1).transpose(0, 1).double()  # (W, h, N*N)
    flat = flat / flat.norm(dim=-1, keepdim=True).clamp_min(1e-30)
    return flat @ flat.transpose(1, 2)  # (W, h, h)


def map_similarity(maps: torch.Tensor) -> torch.Tensor:
    """The head similarity of one block's maps: per-window cosine similarity, averaged over windows.

    Args:
        maps: ``(h, W, N, N)`` attention maps of ``h`` heads over ``W`` windows (one window:
            ``maps[:, None]``); everything past dim 1 is flattened.

    Returns:
        ``(h, h)`` float64, ones on the diagonal (``[[1.0]]`` for one head).
    """
    return cosine_similarity_matrix(maps.detach()).mean(0)


def mean_off_diagonal(matrix: torch.Tensor) -> float | None:
    """Mean of an ``(h, h)`` similarity matrix over head pairs; None when ``h < 2`` (no pairs)."""
    h = matrix.shape[0]
    if h < 2:
        return None
    return float((matrix.sum() - matrix.diagonal().sum()) / (h * (h - 1)))


def _stage_block(name: str) -> tuple[int, int]:
    parts = name.split(".")
    try:
        if parts[0] == "stages" and parts[2] == "blocks":
            return int(parts[1]), int(parts[3])
    except (IndexError, ValueError):
        pass
    return -1, -1


def attention_modules(model: nn.Module) -> list[tuple[str, CascadedHeads]]:
    """``(name, module)`` of every cascaded group attention in ``model`` (trainable or fused), in forward order."""
    found = [(n, m) for n, m in model.named_modules() if isinstance(m, CascadedHeads)]
    if not found:
        raise ValueError("the model has no cascaded group attention (CascadedHeads) modules to analyse")
    return found


@torch.no_grad()
def head_similarity(model: nn.Module, images: torch.Tensor | Iterable[torch.Tensor]) -> list[BlockSimilarity]:
    """For every attention block, the ``h x h`` cosine similarity of its heads' attention maps.

    Args:
        model: an EfficientViT (any dials; fused or not) or any module containing
            :class:`~cgavit.attention.CascadedHeads` (:class:`~cgavit.attention.CascadedGroupAttention` or its
            fused form). Evaluated in eval mode (restored after).
        images: an image batch ``(B, 3, H, W)`` or an iterable of batches, already normalised.

    Returns:
        One :class:`BlockSimilarity` per attention module, in forward order, each averaged over every
        image and window.

    Raises:
        ValueError: no images, or attention maps that are not finite (the model's outputs overflow: weights
            too large or damaged), naming the first block and batch where they are not.
    """
    modules = attention_modules(model)
    sums: dict[str, torch.Tensor] = {}
    counts: dict[str, int] = {}
    tokens: dict[str, int] = {}
    overflow: list[str] = []

    def hook(name: str) -> Callable[..., None]:
        def fn(module: CascadedHeads, inputs, output) -> None:
            maps = torch.stack(module.head_attention_maps(inputs[0]))  # (h, B*windows, N, N)
            if not torch.isfinite(maps).all():
                overflow.append(name)
            sim = cosine_similarity_matrix(maps)  # (B*windows, h, h)
            sums[name] = sums.get(name, 0) + sim.sum(0)
            counts[name] = counts.get(name, 0) + sim.shape[0]
            tokens[name] = maps.shape[-1]

        return fn

    handles = [m.register_forward_hook(hook(n)) for n, m in modules]
    was_training = model.training
    model.eval()
    try:
        _run_batches(model, images, overflow)
    finally:
        for h in handles:
            h.remove()
        model.train(was_training)
    out = []
    for name, _ in modules:
        if name not in counts:
            log.warning("attention %s was not run by the forward pass; skipped", name)
            continue
        stage, block = _stage_block(name)
        out.append(
            BlockSimilarity(name, stage, block, (sums[name] / counts[name]).float(), counts[name], tokens[name])
        )
    return out


def _run_batches(model: nn.Module, images: torch.Tensor | Iterable[torch.Tensor], overflow: list[str]) -> None:
    """Run ``model`` on each batch of ``images``; refuse no images, or a batch after which ``overflow`` (filled by
    the hooks of :func:`head_similarity`) names a block whose attention maps were not finite."""
    batches = [images] if isinstance(images, torch.Tensor) else images
    seen = 0
    for i, x in enumerate(batches, 1):
        model(x)
        if overflow:
            raise ValueError(f"the attention maps of {overflow[0]} are not finite on image batch {i}: the model's outputs "
                             "overflow (its weights are too large or damaged); use another checkpoint")
        seen += x.shape[0]
    if not seen:
        raise ValueError("no images given to head_similarity")


def mean_similarity(blocks: list[BlockSimilarity]) -> float:
    """Mean off-diagonal similarity over all blocks with at least two heads and two tokens; NaN when no
    block qualifies (the ablation averages it over seeds; the ``analyze heads`` report writes null).

    Blocks whose window holds one token are left out: every head's map is then ``[[1.0]]``.
    """
    vals = [b.mean_off_diagonal for b in blocks if b.num_heads > 1 and b.tokens > 1]
    return float(sum(vals) / len(vals)) if vals else float("nan")


def plot_similarity(blocks: list[BlockSimilarity], out_dir: str | os.PathLike, title: str = "") -> list[Path]:
    """Write ``heads_matrices.png`` (one heatmap panel per block) and ``heads_mean.png``.

    In the bar chart a block whose window holds one token is drawn grey and hatched, noted as left out
    of the mean (its similarity is 1 whatever the heads learnt), and a one-head block has no bar and
    the note "n/a" (no pairs).

    Returns:
        Paths written.
    """
    out_dir = Path(out_dir)
    labels = [b.label for b in blocks]
    means = [_or_nan(b.mean_off_diagonal) for b in blocks]
    paths = [
        heatmap_grid(
            [b.matrix.numpy() for b in blocks],
            [f"{lab} ({b.tokens} tok)" for lab, b in zip(labels, blocks)],
            out_dir / "heads_matrices.png",
            title=f"head attention-map cosine similarity {title}".strip(),
            axis_label="head",
        ),
        bar_chart(
            {"mean off-diagonal": means},
            labels,
            out_dir / "heads_mean.png",
            ylabel="mean cosine similarity between heads",
            title=f"head similarity per block {title}".strip(),
            ylim=(0, 1.1),
            notes={"mean off-diagonal": ["n/a" if b.num_heads < 2 else "" for b in blocks]},
            marked=[b.tokens < 2 and b.num_heads > 1 for b in blocks],
            marked_label="1-token window: trivially 1, not in the mean",
        ),
    ]
    return paths


def _or_nan(value: float | None) -> float:
    return float("nan") if value is None else value
