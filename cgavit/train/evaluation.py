"""Top-1, top-5 and loss of a model over a loader, alone or under ``torchrun`` with the same result."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from contextlib import AbstractContextManager

import torch
import torch.nn.functional as F
from torch import nn

from .data import Batch, BadImageError, until_unreadable
from .distributed import DistEnv, gather_objects


def top5_means_something(num_classes: int) -> bool:
    """Whether top-5 says anything: with five classes or fewer every image is within the top 5 (100 %)."""
    return num_classes > 5


def top5_text(top5: float, num_classes: int) -> str:
    """Top-5 as a log or result line shows it: "n/a" where it means nothing (:func:`top5_means_something`)."""
    return f"top-5 {top5:.2f}%" if top5_means_something(num_classes) else f"top-5 n/a ({num_classes} classes)"


@torch.no_grad()
def evaluate(
    model: nn.Module, loader: Iterable[Batch], env: DistEnv | None = None, autocast: AbstractContextManager | None = None,
    reference: nn.Module | None = None,
) -> dict:
    """Top-1, top-5 (percent) and mean cross-entropy of ``model`` over ``loader``'s dataset.

    Under several processes each rank evaluates its share; per-sample results are gathered and the
    padding duplicates dropped by dataset index, so the metrics equal a single process's (top-1/top-5
    exactly; the loss up to float summation order, summed in float64 in index order).

    Args:
        model: the network (its mode is restored afterwards).
        loader: batches of :class:`~cgavit.train.data.Batch` (as :func:`~cgavit.train.data.make_loader`).
        env: this process's place in the process group (default: a single process).
        autocast: a context to run the forward in (e.g. ``torch.autocast``).
        reference: a model to compare top-1 classes with on the same images (an int8 file's fp32 checkpoint).

    Returns:
        ``{"top1", "top5", "loss", "n", "skipped", "bad_paths", "bad_errors", "nonfinite"}``: ``bad_errors`` maps
        each skipped image's path to what was wrong with it (one line naming the file); ``nonfinite`` counts the images
        whose logits are not all finite (a diverged model); they count as misses, and make the loss NaN or inf.
        With ``reference`` also ``"agreement"`` (percent of images whose top-1 class is the reference's) and
        ``"changed"`` (the images whose is not; a non-finite output on either side counts as changed).

    Raises:
        BadImageError: a ``strict`` loader met an image it cannot read (on any rank: every rank raises the first's).
    """
    env = env or DistEnv()
    was_training = model.training
    model.eval()
    device = next(model.parameters(), torch.empty(0)).device  # an exported file's runtime has none: CPU
    idx, losses, hit1, hit5, bad, broken, same = [], [], [], [], [], [], []
    unreadable = None  # a strict loader's error: raised by every rank once the shares are gathered
    for batch, unreadable in until_unreadable(loader):
        bad.extend(zip(batch.bad, batch.errors))
        if batch.images is None:
            continue
        x = batch.images.to(device, non_blocking=True)
        y = batch.labels.to(device, non_blocking=True)
        with autocast if autocast is not None else contextlib.nullcontext():
            out = model(x)
        out = out.float()
        k = min(5, out.shape[1])
        top = out.topk(k, dim=1).indices  # (B, k)
        finite = torch.isfinite(out).all(dim=1)  # (B,): a NaN's top-k is no decision
        idx.append(batch.indices)
        losses.append(F.cross_entropy(out, y, reduction="none").double().cpu())
        hit1.append(((top[:, 0] == y) & finite).cpu())
        hit5.append(((top == y[:, None]).any(dim=1) & finite).cpu())
        broken.append((~finite).cpu())
        if reference is not None:
            ref = reference(x).float()
            # argmax on both sides, as quantize compares (topk may break a tie another way)
            same.append(((out.argmax(dim=1) == ref.argmax(dim=1)) & finite & torch.isfinite(ref).all(dim=1)).cpu())
    model.train(was_training)
    mine = (_cat(idx, torch.long), _cat(losses, torch.float64), _cat(hit1, torch.bool), _cat(hit5, torch.bool), bad,
            _cat(broken, torch.bool), _cat(same, torch.bool), unreadable)
    return _merge(_gathered(env, mine), compared=reference is not None)


def _gathered(env: DistEnv, mine: tuple) -> list[tuple]:
    """Every rank's share of :func:`evaluate`'s results (``mine``: this rank's); the error of a strict loader that met
    an image it cannot read, on any rank, raised on every rank (the first rank's)."""
    parts = gather_objects(env, mine)
    unreadable = next((p[7] for p in parts if p[7]), None)
    if unreadable:
        raise BadImageError(unreadable)
    return parts


def _cat(parts: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    return torch.cat(parts) if parts else torch.zeros(0, dtype=dtype)


def _merge(parts: list[tuple], compared: bool = False) -> dict:
    """Every rank's ``(indices, losses, top-1 hits, top-5 hits, (bad path, its error) pairs, non-finite outputs, top-1
    classes equal to the reference's, ...)`` as one set of metrics, each dataset index counted once (with ``compared``,
    the agreement too)."""
    all_idx = torch.cat([p[0] for p in parts])
    order = torch.argsort(all_idx, stable=True)
    all_idx = all_idx[order]
    keep = torch.ones_like(all_idx, dtype=torch.bool)
    keep[1:] = all_idx[1:] != all_idx[:-1]  # padding repeats some indices on the last ranks
    pick = order[keep]
    loss = torch.cat([p[1] for p in parts])[pick]
    h1 = torch.cat([p[2] for p in parts])[pick]
    h5 = torch.cat([p[3] for p in parts])[pick]
    bad_errors = dict(sorted(b for p in parts for b in p[4]))
    nonfinite = int(torch.cat([p[5] for p in parts])[pick].sum())
    n = int(pick.numel())
    res = {
        "top1": 100.0 * float(h1.double().sum()) / max(n, 1),
        "top5": 100.0 * float(h5.double().sum()) / max(n, 1),
        "loss": float(loss.sum()) / max(n, 1),
        "n": n,
        "skipped": len(bad_errors),
        "bad_paths": list(bad_errors),
        "bad_errors": bad_errors,
        "nonfinite": nonfinite,
    }
    if compared:
        kept = int(torch.cat([p[6] for p in parts])[pick].sum())
        res.update(agreement=100.0 * kept / max(n, 1), changed=n - kept)
    return res
