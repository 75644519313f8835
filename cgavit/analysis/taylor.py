"""First-order Taylor channel importance (design notes, chapter 6): which Q, K, V, FFN channels matter.

The importance of an output channel is ``sum |w * dL/dw|`` over the weights that produce it (the
weight row of a 1x1 / kxk convolution), with ``dL/dw`` the gradient of the mean cross-entropy over a
data sample, taken in eval mode (BatchNorm running statistics, as the model is used). Each term
``|w * dL/dw|`` is the first-order estimate of how much the loss would change if that one weight were
removed; their sum over the channel bounds the estimate for removing the whole channel, ``|sum w * dL/dw|``.
It is not the exact criterion of Molchanov et al. (2019), which squares each channel's sum per
mini-batch and averages those over the mini-batches: the gradient of the mean loss over the whole
sample taken here lets opposite gradients of different images cancel (on a converged model, more so).

Per attention block it reports, for every head, the Q, K and V channels (the head's qkv convolution
output split ``[key_dim, key_dim, value_dim]``) and the output projection channels; per block the
hidden channels of every FFN (its first 1x1 convolution). :func:`pruning_order` ranks channels
across the network for a pruning budget.

An importance of exactly 0 means no gradient reached the weights: a model whose every importance is 0
(random weights: the attention and FFN branches end in zero-initialised BatchNorm) is refused, and a kind of
channel that is all 0 in a block (Q and K in a window of one token, whose softmax is 1 whatever they
are) is reported as having no gradient (:attr:`BlockImportance.no_gradient`) and kept out of the
pruning ranking, where it would otherwise be pruned first in arbitrary order.

A model of one class is refused before anything runs (cross-entropy over one class is zero whatever the
weights), and so is a loss or an importance that is not finite: weights so large (or damaged) that the
forward pass overflows would otherwise give NaN means and a ranking of zeros.
"""

from __future__ import annotations

import math
import os
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ..attention import CascadedGroupAttention, CascadedHeads
from ..layers import FFN
from .plots import bar_chart, block_label, box_panels, stage_label

KINDS = ("q", "k", "v", "proj", "ffn")
#: The kinds a pruning budget removes, in the order every report lists them.
PRUNED_KINDS = ("q", "k", "v", "ffn")


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

    @property
    def label(self) -> str:
        """The block's name in the figures and printouts: ``s1.b1`` for ``stages.0.blocks.0`` (from 1, as the paper
        counts stages; ``stage`` and ``block`` count from 0, as the module path)."""
        return block_label(self.stage, self.block)

    @property
    def no_gradient(self) -> tuple[str, ...]:
        """The kinds (in :data:`KINDS` order) that have channels here, every one of importance exactly 0:
        no gradient reached them (e.g. Q and K in a window of one token)."""
        return tuple(k for k, t in self.channels().items() if t.numel() and not t.any())

    def to_dict(self) -> dict:
        """JSON-ready values: ``label`` (the figures' name of the block), per-kind means, ``no_gradient`` (see the
        property), every channel's importance."""
        r = lambda t: [float(f"{float(v):.6g}") for v in t]  # noqa: E731
        means = {k: float(t.mean()) if t.numel() else None for k, t in self.channels().items()}
        return dict(
            name=self.name,
            label=self.label,
            stage=self.stage,
            block=self.block,
            mean=means,
            no_gradient=list(self.no_gradient),
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
    if not any(isinstance(m, (CascadedGroupAttention, FFN)) for m in stages.modules()):
        raise ValueError(f"the model ({type(model).__module__}.{type(model).__name__}) has no cgavit attention or FFN "
                         "modules whose channels could be ranked; build it with cgavit.create_model (timm's weights "
                         "load into it: cgavit.load_checkpoint)")
    return [(i, j, blk) for i, st in enumerate(stages) for j, blk in enumerate(st.blocks)]


def taylor_importance(
    model: nn.Module,
    batches: Iterable[tuple[torch.Tensor, torch.Tensor | None]],
) -> list[BlockImportance]:
    """First-order Taylor importance of the Q/K/V, projection and FFN channels of every block.

    Args:
        model: an EfficientViT (any dials) of two classes or more, in its trainable form: not fused
            (:func:`cgavit.fuse` folds Q, K and V away), with weights that require gradients. Run in eval
            mode (restored after); its gradients are cleared before and after.
        batches: ``(images, targets)`` pairs; ``targets`` are class indices, or None to use the
            model's own arg-max predictions as targets. The loss is the mean cross-entropy over all
            images given (each batch weighted by its size).

    Returns:
        One :class:`BlockImportance` per sandwich block, in forward order.

    Raises:
        ValueError: a fused model, one with frozen weights or fewer than two classes (cross-entropy over one
            class is zero), no images, a loss or importances that are not finite (the model's outputs
            overflow), or gradients that are all zero (randomly initialised weights, or a zero loss), which
            would rank every channel alike.
    """
    blocks = _blocks(model)
    _check_trainable(model)
    classes = getattr(model, "num_classes", 2)
    if classes < 2:  # before any image is run: no gradient could ever come of it
        why = ("no classifier (a features_only or headless save), so no class scores to take the loss of; analyse the "
               "weights saved with their classifier" if classes == 0 else "its loss, cross-entropy over the classes, is "
               "zero for one class whatever the weights; analyse a model trained on two classes or more")
        raise ValueError(f"the Taylor importance needs a model of two classes or more, but this one has {classes}: {why}")
    batches = list(batches)
    n_all = sum(x.shape[0] for x, _ in batches)
    if not n_all:
        raise ValueError("no images given to taylor_importance")
    if torch.is_inference_mode_enabled():
        raise ValueError("taylor_importance needs gradients, which torch.inference_mode() turns off: call it outside")
    was_training = model.training
    model.eval()
    model.zero_grad(set_to_none=True)
    try:
        loss = _accumulate_gradients(model, batches, n_all)
        out = [_block_importance(stage, index, blk) for stage, index, blk in blocks]
    finally:
        model.zero_grad(set_to_none=True)
        model.train(was_training)
    _check_importances(out, loss)
    return out


def _accumulate_gradients(model: nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor | None]], n_all: int) -> float:
    """Back-propagate the mean cross-entropy over every image, batch by batch; returns that loss.

    Raises:
        ValueError: a batch's loss is not finite, naming the batch and the first part of the network whose
            output is not (:func:`first_overflow`).
    """
    total = 0.0
    with torch.enable_grad():  # inside torch.no_grad() too: the importance is made of gradients
        for i, (x, y) in enumerate(batches, 1):
            logits = model(x)
            target = logits.detach().argmax(1) if y is None else y
            # sum of per-image losses / all images = the mean over the whole sample
            loss = F.cross_entropy(logits, target, reduction="sum") / n_all
            if not torch.isfinite(loss):
                raise ValueError(f"the loss of image batch {i} of {len(batches)} is not finite: the model's outputs "
                                 f"overflow from {first_overflow(model, x)} on (its weights are too large or damaged); "
                                 "use another checkpoint")
            loss.backward()
            total += float(loss.detach())
    return total


def _check_importances(out: list[BlockImportance], loss: float) -> None:
    """Refuse importances that are not finite, or all zero (saying why: a zero loss, or zero BatchNorms)."""
    for b in out:
        if not all(torch.isfinite(t).all() for t in b.channels().values()):
            raise ValueError(f"the Taylor importances of {b.name} are not finite: its weights or their gradients "
                             "overflow (the weights are too large or damaged); use another checkpoint")
    if any(t.any() for b in out for t in b.channels().values()):
        return
    if loss == 0:
        raise ValueError("every Taylor importance is zero because the loss is zero on every image (the model gives "
                         "its targets a probability of 1, so no gradient flows); give images it is less sure of")
    raise ValueError("every Taylor importance is zero because the loss gradients are all zero (randomly "
                     "initialised weights end each attention and FFN branch in a zero BatchNorm); "
                     "give a trained --checkpoint")


def first_overflow(model: nn.Module, x: torch.Tensor) -> str:
    """The first part of ``model`` (patch embedding, a stage's downsampling, a sandwich block, the head) whose
    output on ``x`` is not finite, in forward order; "the loss" when every part's output is finite."""
    parts = [(f"stages.{s}.blocks.{j}", blk) for s, j, blk in _blocks(model)]
    parts += [(n, m) for n, m in model.named_modules() if n == "patch_embed" or n == "head" or n.endswith(".downsample")]
    found: list[str] = []

    def hook(name: str):
        def fn(module: nn.Module, inputs, output) -> None:
            if isinstance(output, torch.Tensor) and not torch.isfinite(output).all():
                found.append(name)

        return fn

    handles = [m.register_forward_hook(hook(n)) for n, m in parts]
    try:
        with torch.no_grad():
            model(x)
    finally:
        for h in handles:
            h.remove()
    return found[0] if found else "the loss"


def _check_trainable(model: nn.Module) -> None:
    """Refuse a model whose channel gradients cannot be read: fused attention (Q, K and V folded into
    other weights) or weights that do not require gradients (as :func:`cgavit.fuse` leaves them)."""
    for name, m in model.named_modules():
        if isinstance(m, CascadedHeads) and not isinstance(m, CascadedGroupAttention):
            raise ValueError(f"taylor_importance needs the unfused, trainable model, but {name} is a "
                             f"{type(m).__name__}; analyse the model as loaded, before fuse() or optimize()")
    frozen = [n for n, w in model.stages.named_parameters() if not w.requires_grad]
    if frozen:
        raise ValueError(f"taylor_importance needs gradients, but {len(frozen)} weights of the model do not require "
                         f"them (stages.{frozen[0]}, ...); call model.requires_grad_(True) first, "
                         "or analyse it before fuse()")


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


def _ranked(b: BlockImportance, kinds: tuple[str, ...]) -> list[tuple[str, int, int, float]]:
    """``(kind, head, index, importance)`` of the block's channels of ``kinds``, leaving out the kinds
    with no gradient (:attr:`BlockImportance.no_gradient`); ``head`` is -1 for FFN and projection."""
    skip, channels = b.no_gradient, b.channels()
    items = []
    for kind in (k for k in kinds if k not in skip):
        if kind in ("q", "k", "v"):
            items += [(kind, h, i, float(s)) for h, t in enumerate(getattr(b, kind)) for i, s in enumerate(t)]
        else:
            items += [(kind, -1, i, float(s)) for i, s in enumerate(channels[kind])]
    return items


def pruning_order(blocks: list[BlockImportance], kinds: tuple[str, ...] = PRUNED_KINDS) -> list[dict]:
    """All channels of ``kinds`` ranked least important first, for a global pruning budget.

    Importances are divided by the mean importance of all ranked channels of their block, so blocks
    with larger gradients do not dominate; within a block Q, K, V and FFN channels compete directly.
    A kind with no gradient in a block (every importance 0) is not ranked: its zeros say nothing of
    which of its channels matter, and would fill the budget first.

    Returns:
        Dicts ``{block, stage, kind, head, index, score}`` (``head`` -1 for FFN, where ``index``
        counts across the block's FFNs), ascending by ``score``.
    """
    rows = []
    for b in blocks:
        items = _ranked(b, kinds)
        if not items:
            continue
        mean = sum(s for *_, s in items) / len(items)
        rows += [dict(block=b.name, stage=b.stage, kind=kind, head=h, index=i, score=s / mean if mean > 0 else 0.0)
                 for kind, h, i, s in items]
    rows.sort(key=lambda r: r["score"])
    return rows


def kept_fraction(blocks: list[BlockImportance], ratio: float, kinds: tuple[str, ...] = PRUNED_KINDS) -> dict:
    """Per stage and kind, the fraction of channels kept when the lowest ``ratio`` of all ranked channels
    (:func:`pruning_order`) are pruned.

    Returns:
        ``{"kept": {stage: {kind: fraction}}, "pruned": rows}``: stages (int) ascending, kinds in the
        order of ``kinds``. A kind the stage has no channels of is left out; one with no gradient in
        every block of the stage (never ranked) is None; where only some blocks had none, the fraction
        is of the ranked channels.
    """
    if not 0.0 <= ratio < 1.0:
        raise ValueError(f"prune ratio must be in [0, 1), got {ratio}")
    order = pruning_order(blocks, kinds)
    pruned = order[: int(round(ratio * len(order)))]
    totals = Counter((r["stage"], r["kind"]) for r in order)
    removed = Counter((r["stage"], r["kind"]) for r in pruned)
    present = {(b.stage, k) for b in blocks for k, t in b.channels().items() if t.numel()}
    frac = {
        s: {k: 1.0 - removed[s, k] / totals[s, k] if totals[s, k] else None for k in kinds if (s, k) in present}
        for s in sorted({b.stage for b in blocks})
    }
    return {"kept": {s: fr for s, fr in frac.items() if fr}, "pruned": pruned}


def plot_importance(blocks: list[BlockImportance], ratio: float, out_dir: str | os.PathLike, title: str = "") -> list[Path]:
    """``taylor_spread.png`` (per stage: box plot of block-normalised Q, K, V, FFN importance) and
    ``taylor_pruning.png`` (per stage: fraction of Q/K/V/FFN channels kept at the pruning budget).

    In the pruning chart a kind drawn as no bar is noted: "0: all pruned", "no gradient" (not ranked,
    see :func:`pruning_order`) or "n/a" (the stage has no such channels).

    Returns:
        Paths written.
    """
    out_dir = Path(out_dir)
    stages = sorted({b.stage for b in blocks})
    names = [stage_label(s) for s in stages]
    spread = box_panels(
        [_normalised(blocks, s) for s in stages],
        names,
        out_dir / "taylor_spread.png",
        ylabel="channel importance / block mean",
        title=f"Taylor importance of Q, K, V and FFN channels {title}".strip(),
    )
    kept = kept_fraction(blocks, ratio)["kept"]
    fractions = {k: [kept.get(s, {}).get(k, float("nan")) for s in stages] for k in PRUNED_KINDS}
    prune = bar_chart(
        {k.upper(): [float("nan") if v is None else v for v in vals] for k, vals in fractions.items()},
        names,
        out_dir / "taylor_pruning.png",
        ylabel="fraction of channels kept",
        title=f"kept after pruning the least important {100 * ratio:g} % {title}".strip(),  # as given (.0% rounded)
        ylim=(0, 1.05),
        notes={k.upper(): [_kept_note(v) for v in vals] for k, vals in fractions.items()},
    )
    return [spread, prune]


def _normalised(blocks: list[BlockImportance], stage: int) -> dict[str, list[float]]:
    """Per kind (Q, K, V, FFN), a stage's channel importances divided by their block's mean, the scores
    :func:`pruning_order` ranks (a kind with no gradient keeps its zeros)."""
    data: dict[str, list[float]] = {k.upper(): [] for k in PRUNED_KINDS}
    for b in (b for b in blocks if b.stage == stage):
        ranked = [s for *_, s in _ranked(b, PRUNED_KINDS)]
        mean = sum(ranked) / len(ranked) if ranked else 0.0
        channels = b.channels()
        for k in PRUNED_KINDS:
            data[k.upper()] += [float(v) / mean if mean > 0 else 0.0 for v in channels[k]]
    return data


def _kept_note(fraction: float | None) -> str:
    """What a kept fraction drawn as no bar means (NaN: the stage has no such channels)."""
    if fraction is None:
        return "no gradient"
    if math.isnan(fraction):
        return "n/a"
    return "0: all pruned" if fraction == 0 else ""
