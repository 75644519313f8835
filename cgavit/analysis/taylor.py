"""First-order Taylor channel importance (design notes, chapter 6): which Q, K, V, FFN channels matter.

The importance of an output channel is ``sum |w * dL/dw|`` over the weights that produce it (the
weight row of a 1x1 / kxk convolution), with ``dL/dw`` the gradient of the mean cross-entropy over a
data sample, taken in eval mode (BatchNorm running statistics, as the model is used). This is the
first-order estimate of how much the loss would change if that channel's weights were removed
(Molchanov et al., 2019), per weight, summed over the channel.

Per attention block it reports, for every head, the Q, K and V channels (the head's qkv convolution
output split ``[key_dim, key_dim, value_dim]``) and the output projection channels; per block the
hidden channels of every FFN (its first 1x1 convolution). :func:`pruning_order` ranks channels
across the network for a pruning budget.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ..attention import CascadedGroupAttention
from ..layers import FFN
from .plots import bar_chart, box_panels

KINDS = ("q", "k", "v", "proj", "ffn")


def _weight(m: nn.Module) -> torch.Tensor:
    """The convolution weight of a Conv-BN (or of an already folded Conv2d)."""
    conv = getattr(m, "conv", m)
    if not isinstance(conv, nn.Conv2d):
        raise TypeError(f"expected a Conv-BN or Conv2d, got {type(m).__name__}")
    return conv.weight


def channel_importance(weight: torch.Tensor) -> torch.Tensor:
    """``sum |w * grad|`` over every dimension but the first (output channels): ``(out,)``."""
    if weight.grad is None:
        return torch.zeros(weight.shape[0])
    return (weight.detach() * weight.grad).abs().flatten(1).sum(1).double()


@dataclass
class BlockImportance:
    """Taylor importance of one block's channels.

    Attributes:
        name: module path of the block (``stages.i.blocks.j``).
        stage: stage index; ``block``: block index within the stage.
        q, k, v: per head, ``(key_dim,)``, ``(key_dim,)``, ``(value_dim,)`` importances.
        proj: ``(C,)`` importances of the attention's output projection.
        ffn: per FFN in the block (before and after the attention), ``(hidden,)`` importances.
    """

    name: str
    stage: int
    block: int
    q: list[torch.Tensor] = field(default_factory=list)
    k: list[torch.Tensor] = field(default_factory=list)
    v: list[torch.Tensor] = field(default_factory=list)
    proj: torch.Tensor | None = None
    ffn: list[torch.Tensor] = field(default_factory=list)

    def channels(self) -> dict[str, torch.Tensor]:
        """All importances of each kind concatenated (heads in order, FFNs in order)."""
        cat = lambda ts: torch.cat(ts) if ts else torch.zeros(0, dtype=torch.float64)  # noqa: E731
        return dict(
            q=cat(self.q),
            k=cat(self.k),
            v=cat(self.v),
            proj=self.proj if self.proj is not None else cat([]),
            ffn=cat(self.ffn),
        )

    def to_dict(self) -> dict:
        r = lambda t: [float(f"{float(v):.6g}") for v in t]  # noqa: E731
        means = {k: float(t.mean()) if t.numel() else None for k, t in self.channels().items()}
        return dict(
            name=self.name,
            stage=self.stage,
            block=self.block,
            mean=means,
            q=[r(t) for t in self.q],
            k=[r(t) for t in self.k],
            v=[r(t) for t in self.v],
            proj=r(self.proj) if self.proj is not None else [],
            ffn=[r(t) for t in self.ffn],
        )


def _blocks(model: nn.Module) -> list[tuple[int, int, nn.Module]]:
    """``(stage, block, module)`` of every sandwich block, in forward order."""
    stages = getattr(model, "stages", None)
    if stages is None:
        raise ValueError("taylor_importance needs an EfficientViT (a model with .stages[i].blocks)")
    return [(i, j, blk) for i, st in enumerate(stages) for j, blk in enumerate(st.blocks)]


def taylor_importance(
    model: nn.Module,
    batches: Iterable[tuple[torch.Tensor, torch.Tensor | None]],
) -> list[BlockImportance]:
    """First-order Taylor importance of the Q/K/V, projection and FFN channels of every block.

    Args:
        model: an EfficientViT (any dials). Run in eval mode (restored after); its gradients are
            cleared before and after.
        batches: ``(images, targets)`` pairs; ``targets`` are class indices, or None to use the
            model's own arg-max predictions as targets. The loss is the mean cross-entropy over all
            images given (each batch weighted by its size).

    Returns:
        One :class:`BlockImportance` per sandwich block, in forward order.
    """
    was_training = model.training
    model.eval()
    model.zero_grad(set_to_none=True)
    batches = list(batches)
    n_all = sum(x.shape[0] for x, _ in batches)
    if not n_all:
        raise ValueError("no images given to taylor_importance")
    try:
        for x, y in batches:
            logits = model(x)
            target = logits.detach().argmax(1) if y is None else y
            # sum of per-image losses / all images = the mean over the whole sample
            loss = F.cross_entropy(logits, target, reduction="sum") / n_all
            loss.backward()
        out = [_block_importance(stage, index, blk) for stage, index, blk in _blocks(model)]
    finally:
        model.zero_grad(set_to_none=True)
        model.train(was_training)
    return out


def _block_importance(stage: int, index: int, blk: nn.Module) -> BlockImportance:
    """The importances of one block's channels, read from the gradients already accumulated."""
    rec = BlockImportance(f"stages.{stage}.blocks.{index}", stage, index)
    for a in (m for m in blk.modules() if isinstance(m, CascadedGroupAttention)):
        for qkv in a.qkvs:
            q, k, v = channel_importance(_weight(qkv)).split([a.key_dim, a.key_dim, a.value_dim])
            rec.q.append(q)
            rec.k.append(k)
            rec.v.append(v)
        rec.proj = channel_importance(_weight(a.proj[-1]))
    for m in blk.modules():
        if isinstance(m, FFN):
            rec.ffn.append(channel_importance(_weight(m.pw1)))
    return rec


def pruning_order(blocks: list[BlockImportance], kinds: tuple[str, ...] = ("q", "k", "v", "ffn")) -> list[dict]:
    """All channels of ``kinds`` ranked least important first, for a global pruning budget.

    Importances are divided by the mean importance of all ranked channels of their block, so blocks
    with larger gradients do not dominate; within a block Q, K, V and FFN channels compete directly.

    Returns:
        Dicts ``{block, stage, kind, head, index, score}`` (``head`` -1 for FFN, where ``index``
        counts across the block's FFNs), ascending by ``score``.
    """
    rows = []
    for b in blocks:
        items = []
        for kind in kinds:
            if kind == "ffn":
                flat = torch.cat(b.ffn) if b.ffn else torch.zeros(0, dtype=torch.float64)
                items += [("ffn", -1, i, float(s)) for i, s in enumerate(flat)]
            elif kind == "proj":
                if b.proj is not None:
                    items += [("proj", -1, i, float(s)) for i, s in enumerate(b.proj)]
            else:
                for h, t in enumerate(getattr(b, kind)):
                    items += [(kind, h, i, float(s)) for i, s in enumerate(t)]
        if not items:
            continue
        mean = sum(s for *_, s in items) / len(items)
        for kind, h, i, s in items:
            rows.append(dict(block=b.name, stage=b.stage, kind=kind, head=h, index=i, score=s / mean if mean > 0 else 0.0))
    rows.sort(key=lambda r: r["score"])
    return rows


def kept_fraction(blocks: list[BlockImportance], ratio: float, kinds: tuple[str, ...] = ("q", "k", "v", "ffn")) -> dict:
    """Per stage and kind, the fraction of channels kept when the lowest ``ratio`` of all are pruned.

    Returns:
        ``{stage: {kind: fraction}}`` (stage as int) and the pruned rows under key ``"pruned"``.
    """
    if not 0.0 <= ratio < 1.0:
        raise ValueError(f"prune ratio must be in [0, 1), got {ratio}")
    order = pruning_order(blocks, kinds)
    cut = int(round(ratio * len(order)))
    pruned = order[:cut]
    totals: dict[int, dict[str, int]] = {}
    for r in order:
        totals.setdefault(r["stage"], {}).setdefault(r["kind"], 0)
        totals[r["stage"]][r["kind"]] += 1
    removed: dict[int, dict[str, int]] = {}
    for r in pruned:
        removed.setdefault(r["stage"], {}).setdefault(r["kind"], 0)
        removed[r["stage"]][r["kind"]] += 1
    frac = {
        s: {k: 1.0 - removed.get(s, {}).get(k, 0) / n for k, n in kinds_n.items()} for s, kinds_n in sorted(totals.items())
    }
    return {"kept": frac, "pruned": pruned}


def plot_importance(blocks: list[BlockImportance], ratio: float, out_dir: str | os.PathLike, title: str = "") -> list[Path]:
    """``taylor_spread.png`` (per stage: box plot of block-normalised Q, K, V, FFN importance) and
    ``taylor_pruning.png`` (per stage: fraction of Q/K/V/FFN channels kept at the pruning budget).

    Returns:
        Paths written.
    """
    out_dir = Path(out_dir)
    stages = sorted({b.stage for b in blocks})
    panels = []
    for s in stages:
        data: dict[str, list[float]] = {k: [] for k in ("q", "k", "v", "ffn")}
        for b in blocks:
            if b.stage != s:
                continue
            ch = b.channels()
            allv = torch.cat([ch[k] for k in data])
            mean = float(allv.mean()) if allv.numel() else 1.0
            for k in data:
                data[k] += [float(v) / mean if mean > 0 else 0.0 for v in ch[k]]
        panels.append({k.upper(): v for k, v in data.items()})
    spread = box_panels(
        panels,
        [f"stage {s + 1}" for s in stages],
        out_dir / "taylor_spread.png",
        ylabel="channel importance / block mean",
        title=f"Taylor importance of Q, K, V and FFN channels {title}".strip(),
    )
    kept = kept_fraction(blocks, ratio)["kept"]
    series = {k.upper(): [kept.get(s, {}).get(k, float("nan")) for s in stages] for k in ("q", "k", "v", "ffn")}
    prune = bar_chart(
        series,
        [f"stage {s + 1}" for s in stages],
        out_dir / "taylor_pruning.png",
        ylabel="fraction of channels kept",
        title=f"kept after pruning the least important {ratio:.0%} {title}".strip(),
        ylim=(0, 1.05),
    )
    return [spread, prune]
