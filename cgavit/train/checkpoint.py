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
from pathlib import Path

import numpy as np
import torch

from ..io import CheckpointError, save_torch, sniff_format
from ..schema import TRAINING_FORMAT, check_training_checkpoint
from ..weights import checked_path, read_weights_file

log = logging.getLogger(__name__)

FORMAT = TRAINING_FORMAT


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


def load(path: str | Path) -> dict:
    """Read a training checkpoint safely and check it is complete and well-formed
    (:func:`cgavit.schema.check_training_checkpoint`).

    Raises:
        CheckpointError: missing, empty, unreadable, truncated, corrupt or unsafe file, not a
            training checkpoint, or one whose parts have the wrong types; nothing is written or changed.
    """
    path = checked_path(path)
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
        ckpt = read_weights_file(path).content
    except CheckpointError as err:
        if "pickled Python objects" in str(err):
            raise CheckpointError(
                f"cannot resume from {path}: it holds pickled Python objects that could run code when loaded, so it "
                "was refused; a checkpoint written by cgavit train never does. Is it the right file?"
            ) from None
        raise CheckpointError(
            f"cannot resume from {path}: the file is truncated, corrupt or not a safe PyTorch checkpoint ({err}). "
            "Resume from another file (DIR/best.pt, or an earlier copy) or start afresh without --resume"
        ) from None
    check_training_checkpoint(ckpt, str(path))
    return ckpt
