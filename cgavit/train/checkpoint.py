"""Training checkpoints: everything needed to continue a run exactly, written atomically and read
back with ``torch.load(weights_only=True)`` (no code in the file can run).

A checkpoint is a dict::

    format      "cgavit-train/1"
    model       state dict (without any DDP "module." prefix)
    model_ema   state dict or None
    optimizer, scheduler, scaler   their state dicts (scaler None without fp16 AMP)
    next_epoch  the epoch to run next; next_step: batches of it already done (0 at an epoch end)
    rng         per-rank list of {"torch", "cuda", "numpy", "python"} states at the save point
    progress    running sums of the unfinished epoch, best metrics so far
    args        the run's options as a plain dict
    classes     the dataset's class names
"""

from __future__ import annotations

import logging
import random
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import torch

from ..bounds import MAX_CLASSES
from ..io import CheckpointError, UnreadableFileError, check_readable_file, save_torch, sniff_format

log = logging.getLogger(__name__)

FORMAT = "cgavit-train/1"
_REQUIRED = ("model", "optimizer", "scheduler", "next_epoch", "args")


def rng_state(device: torch.device | None = None) -> dict:
    """This process's torch, CUDA, numpy and python RNG states, as plain tensors and tuples."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "torch": torch.get_rng_state(),
        "numpy": (str(kind), torch.from_numpy(np.asarray(keys, dtype=np.int64)), int(pos), int(has_gauss), float(cached)),
        "python": _to_lists(random.getstate()),
        "cuda": None,
    }
    if device is not None and device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device).cpu()
    return state


def _to_lists(obj):
    return [_to_lists(o) for o in obj] if isinstance(obj, (tuple, list)) else obj


def _to_tuples(obj):
    return tuple(_to_tuples(o) for o in obj) if isinstance(obj, (tuple, list)) else obj


def set_rng_state(state: dict, device: torch.device | None = None) -> None:
    """Restore what :func:`rng_state` returned."""
    torch.set_rng_state(state["torch"])
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    random.setstate(_to_tuples(state["python"]))
    if state.get("cuda") is not None and device is not None and device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"], device)


def save(path: str | Path, ckpt: dict) -> Path:
    """Write ``ckpt`` to ``path`` atomically (a temporary file in the same folder, then rename)."""
    ckpt = {"format": FORMAT, **ckpt}
    return save_torch(path, ckpt)


def readable(path: str | Path, what: str = "checkpoint") -> Path:
    """``path`` if it is a regular, readable, non-empty file (never opening a pipe or device);
    :class:`CheckpointError` saying what is wrong with it otherwise."""
    try:
        return check_readable_file(path, what)
    except UnreadableFileError as err:
        raise CheckpointError(str(err)) from None


def read_torch_file(path: str | Path) -> object:
    """``torch.load(weights_only=True)`` of ``path`` as the format its content says: given an open file,
    torch does not take a ``.safetensors`` name for safetensors content (the name is not trusted)."""
    with open(path, "rb") as f:
        return torch.load(f, map_location="cpu", weights_only=True)


def is_training_checkpoint(obj: object) -> bool:
    """Whether ``obj`` (what ``torch.load`` returned) is a checkpoint written by :func:`save`."""
    return isinstance(obj, Mapping) and str(obj.get("format", "")).startswith("cgavit-train")


def load(path: str | Path) -> dict:
    """Read a training checkpoint safely and check it is complete and well-formed.

    Raises:
        CheckpointError: missing, empty, unreadable, truncated, corrupt or unsafe file, not a
            training checkpoint, or one whose parts have the wrong types; nothing is written or changed.
    """
    path = readable(path)
    kind = sniff_format(path)
    if kind == "safetensors":
        raise CheckpointError(
            f"{path} is a weights file (safetensors), not a training checkpoint; to start from its weights "
            "use --finetune instead of --resume"
        )
    if kind == "unknown":
        raise CheckpointError(
            f"cannot resume from {path}: its first bytes are not those of a PyTorch checkpoint; is it the right "
            "file, or a truncated copy?"
        )
    try:
        ckpt = read_torch_file(path)
    except Exception as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        if "weights_only" in first or "Unsupported global" in first:
            raise CheckpointError(
                f"cannot resume from {path}: it holds pickled Python objects that could run code when loaded, so it "
                "was refused; a checkpoint written by cgavit train never does. Is it the right file?"
            ) from None
        raise CheckpointError(
            f"cannot resume from {path}: the file is truncated, corrupt or not a safe PyTorch checkpoint ({first}). "
            "Resume from another file (DIR/best.pt, or an earlier copy) or start afresh without --resume"
        ) from None
    check(ckpt, path)
    return ckpt


def check(ckpt: object, path: str | Path) -> None:
    """Raise :class:`CheckpointError` unless ``ckpt`` (as ``torch.load`` returned it) is a complete
    training checkpoint whose weights, class names and position have the right types."""
    if not is_training_checkpoint(ckpt) or ckpt.get("format") != FORMAT:
        raise CheckpointError(
            f"{path} is not a cgavit training checkpoint (no '{FORMAT}' marker); to start from its weights "
            "use --finetune instead of --resume"
        )
    missing = [k for k in _REQUIRED if k not in ckpt]
    if missing:
        raise CheckpointError(f"{path} lacks {missing}; it is incomplete and cannot be resumed")
    for key in ("model", "model_ema"):
        sd = ckpt.get(key)
        if key == "model_ema" and sd is None:
            continue
        if not isinstance(sd, Mapping) or not all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in sd.items()):
            raise CheckpointError(f"{path}: its '{key}' is not a state dict of named tensors; the file is damaged")
    classes = ckpt.get("classes")
    if classes is not None and not (
        isinstance(classes, list) and len(classes) <= MAX_CLASSES and all(isinstance(c, str) for c in classes)
    ):
        raise CheckpointError(f"{path}: its 'classes' must be a list of at most {MAX_CLASSES} names; the file is damaged")
    for key in ("next_epoch", "next_step", "global_step"):
        value = ckpt.get(key, 0)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise CheckpointError(f"{path}: its '{key}' must be a whole number >= 0, got {value!r}; the file is damaged")


def check_finite(state_dict: Mapping[str, torch.Tensor], source: str | Path) -> None:
    """Raise :class:`CheckpointError` when a floating-point tensor of ``state_dict`` holds NaN or inf
    (a run that diverged, or a damaged file): such weights predict nonsense."""
    for key, value in state_dict.items():
        if value.is_floating_point() and not bool(torch.isfinite(value).all()):
            raise CheckpointError(
                f"{source}: the checkpoint's weights contain NaN/inf (first in {key!r}); the training diverged or "
                "the file is damaged. Use an earlier checkpoint"
            )
