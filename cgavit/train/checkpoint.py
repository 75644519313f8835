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

from ..io import save_torch
from ..weights import CheckpointError

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


def load(path: str | Path) -> dict:
    """Read a training checkpoint safely and check it is complete.

    Raises:
        CheckpointError: missing, truncated, corrupt or unsafe file, or not a training checkpoint;
            nothing is written or changed.
    """
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"cannot resume: {path} does not exist")
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise CheckpointError(
            f"cannot resume from {path}: the file is truncated, corrupt or not a safe PyTorch checkpoint ({first}). "
            "Resume from another file (DIR/best.pt, or an earlier copy) or start afresh without --resume"
        ) from None
    if not isinstance(ckpt, dict) or ckpt.get("format") != FORMAT:
        raise CheckpointError(
            f"{path} is not a cgavit training checkpoint (no '{FORMAT}' marker); to start from its weights "
            "use --finetune instead of --resume"
        )
    missing = [k for k in _REQUIRED if k not in ckpt]
    if missing:
        raise CheckpointError(f"{path} lacks {missing}; it is incomplete and cannot be resumed")
    return ckpt
