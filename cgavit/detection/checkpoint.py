"""Detection checkpoints: reading them safely and believing nothing in them until it is checked.

A checkpoint written by ``cgavit detect train`` is a ``torch.save`` dict: ``format``, ``config`` (the
plain dict :func:`~.models.build_detector` takes) and ``model`` (the state dict), plus the optimizer
state in ``checkpoint.pth``. It is read with ``weights_only=True``, and its ``config`` is untrusted
input: every field is checked for type and bounds, and the detector it describes is first built on
the ``meta`` device (no memory) and compared shape by shape with the stored tensors, before the real
one is allocated.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import fields
from typing import Any

import torch
from torch import nn

from ..factory import resolve_name
from ..io import CheckpointError, UnsafeCheckpointError, sniff_format
from ..schema import check_finite, check_name, check_state_dict, check_tensor, shown
from ..variants import VARIANTS, DialError, EfficientViTConfig
from ..weights import checked_path, read_weights_file
from .backbone import BACKBONE_LAYERS, check_trainable_layers
from .models import KINDS, build_detector, check_detector_args
from .schema import is_int, is_number

CHECKPOINT_FORMAT = "cgavit-detection/1"
MAX_SETTING = 10**6  # largest number a torchvision detector setting (model_kwargs) may hold
#: Memory a detector may need beyond its stored tensors (buffers that are not saved, such as the
#: attention-bias index tables, whose size grows with the fourth power of the window).
MAX_UNSTORED_BYTES = 256 * 2**20


def read_checkpoint(path: str | os.PathLike) -> dict[str, Any]:
    """A detection checkpoint written by ``cgavit detect train``, loaded with ``weights_only=True``.

    Only the file's form is checked here (``format``, a ``config`` dict and a ``model`` state dict);
    :func:`load_detector` checks what the config asks for.

    Raises:
        CheckpointError: missing, empty, a folder or pipe, unreadable, truncated, or not a cgavit
            detection checkpoint.
    """
    path = checked_path(path)
    kind = sniff_format(path)
    if kind not in ("zip", "pickle"):
        what = "a safetensors file" if kind == "safetensors" else "not a PyTorch checkpoint (truncated, or another kind of file?)"
        raise CheckpointError(f"{path} is {what}: expected model.pth or checkpoint.pth written by `cgavit detect train`")
    try:
        ckpt = read_weights_file(path).content
    except UnsafeCheckpointError:
        raise CheckpointError(f"{path} holds pickled Python objects that could run code when loaded, which `cgavit "
                              "detect train` never writes: refused; is it the right file?") from None
    except CheckpointError as err:  # truncated files, other formats
        raise CheckpointError(f"cannot read {path} as a detection checkpoint (truncated or damaged?): {err}") from None
    if not isinstance(ckpt, dict) or ckpt.get("format") != CHECKPOINT_FORMAT:
        raise CheckpointError(
            f"{path} is not a cgavit detection checkpoint (written by `cgavit detect train`); "
            "for ImageNet backbone weights use --pretrained-backbone"
        )
    if not isinstance(ckpt.get("config"), dict) or not isinstance(ckpt.get("model"), dict):
        raise CheckpointError(f"{path} is damaged: it needs a 'config' dict and a 'model' dict of tensors")
    ckpt["model"] = check_state_dict(ckpt["model"], str(path))
    return ckpt


def check_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """The detector config of a checkpoint, every field checked for type and bounds.

    Returns:
        A copy with the keys :func:`~.models.build_detector` reads.

    Raises:
        ValueError: naming the field, what it holds and what it may hold.
    """
    kind = config.get("kind")
    if kind not in KINDS:
        raise ValueError(f"'kind' must be one of {', '.join(KINDS)}, got {shown(kind)}")
    backbone = config.get("backbone", "efficientvit_m4")
    if not isinstance(backbone, str):
        raise ValueError(f"'backbone' must be a variant name, got {shown(backbone)}")
    backbone_config(backbone, config.get("dials") or {})
    num_classes = config.get("num_classes")
    check_detector_args(num_classes, config.get("min_size", 800), config.get("max_size", 1333), several_min_sizes=False)
    cats = config.get("categories")
    if not (isinstance(cats, list) and len(cats) == num_classes - 1 and all(
        isinstance(c, (list, tuple)) and len(c) == 2 and is_int(c[0]) and isinstance(c[1], str) for c in cats
    )):
        raise ValueError(f"'categories' must list {num_classes - 1} [category id, name] pairs, got {shown(cats)}")
    for i, (_, name) in enumerate(cats):
        check_name(name, f"category name {i}")
    if not isinstance(config.get("freeze_bn", True), bool):
        raise ValueError(f"'freeze_bn' must be true or false, got {shown(config['freeze_bn'])}")
    check_trainable_layers(config.get("trainable_backbone_layers", BACKBONE_LAYERS))  # files before it: all trained
    check_model_kwargs(config.get("model_kwargs") or {})
    return {**config, "backbone": backbone, "categories": [list(c) for c in cats]}


def backbone_config(backbone: str, dials: Any) -> EfficientViTConfig:
    """The EfficientViT layout a config's ``backbone`` and ``dials`` describe, checked by the model
    config itself (ValueError naming the dial otherwise)."""
    names = {f.name for f in fields(EfficientViTConfig)}
    if not isinstance(dials, dict) or not set(dials) <= names:
        raise ValueError(f"'dials' must be a dict with keys among {sorted(names)}, got {shown(dials)}")
    try:
        return VARIANTS[resolve_name(backbone)].cfg.with_dials(**{k: tuple(v) if isinstance(v, list) else v
                                                                 for k, v in dials.items()})
    except DialError as err:
        raise ValueError(f"'dials' {shown(dials)} do not describe a network: {err}") from None


def check_model_kwargs(kwargs: Any) -> dict[str, Any]:
    """torchvision detector settings (``--model-arg``): names to numbers, booleans, text or None, or
    short lists of numbers, each number within +-:data:`MAX_SETTING`."""
    if not isinstance(kwargs, dict) or not all(isinstance(k, str) and k.isidentifier() for k in kwargs):
        raise ValueError(f"detector settings (--model-arg) must map names to values, got {shown(kwargs)}")
    for key, value in kwargs.items():
        values = value if isinstance(value, list) else [value]
        plain = isinstance(value, (bool, str, type(None))) or (
            len(values) <= 64 and all(is_number(v) and abs(v) <= MAX_SETTING for v in values)
        )
        if not plain:
            raise ValueError(
                f"detector setting (--model-arg) {key}={shown(value)}: expected a number within +-{MAX_SETTING}, true/false, "
                "text, null or a short list of numbers"
            )
    return dict(kwargs)


def check_against_tensors(config: Mapping[str, Any], state: Mapping[str, torch.Tensor], source: Any) -> None:
    """Build the detector ``config`` describes on the ``meta`` device (no memory) and compare its
    parameter names and shapes with ``state``; its buffers that are not stored may need at most
    :data:`MAX_UNSTORED_BYTES`.

    Raises:
        CheckpointError: a name or shape differs (the file's config and weights disagree), or the
            detector would need far more memory than the file holds.
    """
    body = backbone_config(config["backbone"], config.get("dials") or {})
    parts = sum(d * (h + 2 * sum(body.ffn_per_side)) for d, h in zip(body.depth, body.num_heads))
    if parts > len(state):  # every head and FFN owns tensors: more parts than tensors cannot match
        raise CheckpointError(f"{source}: its config describes {parts} attention heads and FFNs but the file holds {len(state)} tensors; the file is damaged")
    try:
        with torch.device("meta"):
            model = build_detector(config)
    except (RuntimeError, ValueError, TypeError, OverflowError) as err:
        raise CheckpointError(f"{source}: its config describes a detector that cannot be built ({err}); the file is damaged") from None
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    stored = {k: tuple(v.shape) for k, v in state.items()}
    wrong = sorted(k for k in expected.keys() & stored.keys() if expected[k] != stored[k])
    missing, extra = sorted(expected.keys() - stored.keys()), sorted(stored.keys() - expected.keys())
    if wrong or missing or extra:
        detail = [f"{k}: {stored[k]} stored, {expected[k]} expected" for k in wrong[:3]]
        detail += [f"{len(missing)} missing, e.g. {missing[0]}"] if missing else []
        detail += [f"{len(extra)} unexpected, e.g. {extra[0]}"] if extra else []
        raise CheckpointError(f"{source}: its config and its weights disagree ({'; '.join(detail)}); the file is damaged")
    meta_state = model.state_dict()
    for key, value in state.items():
        check_tensor(key, value, meta_state[key], str(source))
    unstored = sum(b.numel() * b.element_size() for name, b in model.named_buffers() if name not in stored)
    if unstored > MAX_UNSTORED_BYTES:
        raise CheckpointError(
            f"{source}: its config asks for {unstored / 2**20:.0f} MiB of attention tables beyond its weights "
            f"(at most {MAX_UNSTORED_BYTES // 2**20} MiB; a window of {max(body.window_size)}?); the file is damaged"
        )


def load_detector(path: str | os.PathLike, device: str | torch.device = "cpu") -> tuple[nn.Module, dict[str, Any]]:
    """Rebuild a trained detector from its checkpoint, in eval mode.

    The config is checked (:func:`check_config`) and compared with the stored tensors
    (:func:`check_against_tensors`) before the detector is allocated; weights that are not finite
    are refused.

    Returns:
        ``(model, config)``; ``config["categories"]`` lists ``[category_id, name]`` for labels 1..K.

    Raises:
        CheckpointError: the file cannot be read, or its config is malformed, out of bounds, or
            disagrees with its weights.
    """
    ckpt = read_checkpoint(path)
    try:
        config = check_config(ckpt["config"])
    except ValueError as err:
        raise CheckpointError(f"{path}: bad detector config: {err}") from None
    check_against_tensors(config, ckpt["model"], path)
    check_finite(ckpt["model"], path)
    model = build_detector(config)
    model.load_state_dict(ckpt["model"])
    return model.to(device).eval(), config

