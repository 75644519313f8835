"""Reading and writing weight files, safely: ``torch.save`` files (official release, timm, training
checkpoints) and safetensors (this package's format).

Reading never runs code from a file (``torch.load(weights_only=True)``, or safetensors) unless the
caller trusts it; what a file holds is then checked by :mod:`cgavit.schema`. Key names are the model's
business (:func:`cgavit.model.convert_state_dict`), fitting tensors into a model is
:mod:`cgavit.loading`'s, and the pretrained download is :mod:`cgavit.hub`'s.
"""

from __future__ import annotations

import json
import logging
import os
import re
import warnings
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import SimpleNamespace

import torch
from torch import nn

from .io import CheckpointError, UnreadableFileError, UnsafeCheckpointError, atomic_write, check_readable_file, require_flag, sniff_format
from .layers import ConvBN
from .model import FeatureMaps
from .schema import WeightsMeta, check_meta_against_shapes, check_state_dict, is_weights_meta, parse_weights_meta

log = logging.getLogger(__name__)

#: Where a checkpoint keeps EMA weights (cgavit's and timm's training checkpoints).
EMA_KEYS = ("model_ema", "state_dict_ema")
_WRAPPER_KEYS = (*EMA_KEYS, "model", "state_dict", "module")
#: What a wrapped model's ``state_dict()`` puts before every name: DDP's ``module.`` and ``torch.compile``'s
#: ``_orig_mod.`` (the network has no child of either name), one inside the other in either order
_WRAPPER_PREFIXES = ("module.", "_orig_mod.")


class _OptionsRecord(SimpleNamespace):
    """Stands in for the ``argparse.Namespace`` of options that DeiT-style training checkpoints
    (the official code's among them) pickle beside the weights: read as plain data, never run."""


@dataclass
class WeightsFile:
    """What a weights file holds, read safely but not yet interpreted.

    Args:
        path: the file.
        kind: ``"safetensors"`` or ``"torch"`` (a ``torch.save`` file).
        content: the tensors of a safetensors file, or what ``torch.load`` returned.
        metadata: a safetensors file's string metadata ({} for torch files).
    """

    path: Path
    kind: str
    content: object
    metadata: dict[str, str] = field(default_factory=dict)


def checked_path(path: str | os.PathLike, what: str = "checkpoint") -> Path:
    """``path`` if it is a regular, readable, non-empty file (never opening a pipe or device);
    :class:`CheckpointError` saying what is wrong otherwise (``what`` names the file in the message)."""
    try:
        return check_readable_file(path, what)
    except UnreadableFileError as err:
        raise CheckpointError(str(err)) from None


def read_weights_file(path: str | os.PathLike, trust: bool = False) -> WeightsFile:
    """Read a checkpoint file without running code from it.

    Args:
        path: ``.safetensors`` or a ``torch.save`` file (the format is judged by the first bytes,
            never by the name).
        trust: allow arbitrary pickled objects (runs code from the file). Only for files you trust.

    Raises:
        CheckpointError: missing, empty, a folder or pipe, truncated, corrupt, unsafe, or neither format.
    """
    require_flag(trust, "trust")
    path = checked_path(path)
    kind = sniff_format(path)
    if kind == "safetensors":
        _safetensors()  # a missing package is said as such, not as a damaged file
        try:
            with _safetensors().safe_open(str(path), "pt") as f:
                metadata = dict(f.metadata() or {})
            return WeightsFile(path, "safetensors", _safetensors().torch.load_file(str(path)), metadata)
        except Exception as err:  # safetensors raises its own error types
            raise CheckpointError(f"cannot read {path} as safetensors (truncated or corrupt?): {_first_line(err)}") from None
    if kind == "unknown":
        if path.suffix.lower() in EXPORTED_SUFFIXES:
            raise CheckpointError(f"{path} is an exported model, not weights: give the checkpoint it was exported "
                                  "from (.safetensors or .pt)")
        raise CheckpointError(
            f"cannot read {path}: its first bytes are neither safetensors nor a PyTorch checkpoint "
            "(not a PyTorch checkpoint or safetensors file); is it the right file, or a truncated download?"
        )
    return WeightsFile(path, "torch", _torch_load(path, trust))


#: The suffixes of exported models (ONNX, OpenVINO IR and its weights, ExecuTorch, LiteRT): files a weights reader is
#: sometimes handed by mistake.
EXPORTED_SUFFIXES = (".onnx", ".xml", ".bin", ".pte", ".tflite")


def _torch_load(path: Path, trust: bool) -> object:
    try:
        with torch.serialization.safe_globals([(_OptionsRecord, "argparse.Namespace")]), warnings.catch_warnings():
            # torch's note on an old pickle protocol would stand before the one line that says what is wrong
            warnings.filterwarnings("ignore", message="Detected pickle protocol")
            with open(path, "rb") as fh:  # a file object: torch would pick its reader from a .safetensors name
                return torch.load(fh, map_location="cpu", weights_only=not trust)
    except Exception as err:
        text = str(err)
        if not trust and (opcode := re.search(r"Unsupported operand (\d+)", text)):
            raise UnsafeCheckpointError(
                f"{path} was written with a pickle instruction (opcode {opcode.group(1)}, of a newer pickle protocol) that "
                "torch's safe loader does not read, so it could not be checked for code and was refused. If you trust "
                "its source, opt in with load_checkpoint(..., trust=True) (command line: --trust-checkpoint), or save "
                "it again with torch.save's default protocol."
            ) from None
        if not trust and ("weights_only" in text or "Unsupported global" in text or "GLOBAL" in text):
            raise UnsafeCheckpointError(
                f"{path} holds pickled Python objects that could run code when loaded, so it was "
                "refused. If you trust its source, opt in with load_checkpoint(..., trust=True) "
                "(command line: --trust-checkpoint)."
            ) from None
        raise CheckpointError(f"cannot read {path}: truncated or not a PyTorch checkpoint ({_first_line(err)})") from None


def _safetensors():
    """The ``safetensors`` package, imported here and only here: the model core needs torch alone,
    safetensors comes with ``pip install 'cgavit[weights]'``."""
    try:
        import safetensors.torch
    except ImportError:
        raise CheckpointError("reading or writing .safetensors files needs pip install 'cgavit[weights]'") from None
    return safetensors


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0][:300] if text else type(err).__name__


#: how many dicts (``model``, ``state_dict``, ...) may wrap a state dict, one inside another
MAX_WRAPPERS = 8


def unwrap_state_dict(obj: object, source: object = "checkpoint", prefer_ema: bool = False) -> dict[str, torch.Tensor]:
    """The state dict inside ``obj`` (a state dict, or a dict wrapping one under ``model``,
    ``state_dict``, ``model_ema``, ...; DDP's ``module.`` and torch.compile's ``_orig_mod.`` prefixes are dropped),
    checked by :func:`cgavit.schema.check_state_dict`.

    Raises:
        CheckpointError: no state dict inside, or one that the schema refuses.
    """
    order = _WRAPPER_KEYS if prefer_ema else _WRAPPER_KEYS[2:] + _WRAPPER_KEYS[:2]
    for _ in range(MAX_WRAPPERS + 1):  # a file can nest wrappers without end
        if not isinstance(obj, Mapping):
            break
        inner = next((obj[key] for key in order if isinstance(obj.get(key), Mapping)), None)
        if inner is None:
            break
        obj = inner
    else:
        raise CheckpointError(f"{source} nests more than {MAX_WRAPPERS} wrapping dicts around its state dict: it is "
                              "damaged or not a checkpoint")
    if isinstance(obj, Mapping):
        tensors = {k: v for k, v in obj.items() if isinstance(v, torch.Tensor)}
        if tensors and len(tensors) >= len(obj) / 2:
            sd = check_state_dict(tensors, str(source))
            return {_unwrapped_name(k): v for k, v in sd.items()}
    raise CheckpointError(
        f"{source} holds no state dict (expected tensors, or a dict with one of {list(_WRAPPER_KEYS)}), "
        f"got {type(obj).__name__}"
    )


def _unwrapped_name(key: str) -> str:
    """``key`` without the prefixes of :data:`_WRAPPER_PREFIXES` (``_orig_mod.module.stages...`` -> ``stages...``)."""
    while key.startswith(_WRAPPER_PREFIXES):
        key = key.split(".", 1)[1]
    return key


def read_state_dict(path: str | os.PathLike, trust: bool = False, prefer_ema: bool = False) -> dict[str, torch.Tensor]:
    """The checked tensors of any checkpoint file (:func:`read_weights_file` + :func:`unwrap_state_dict`).

    Raises:
        CheckpointError: see those two.
    """
    wf = read_weights_file(path, trust)
    return unwrap_state_dict(wf.content, wf.path, prefer_ema)


def read_metadata(path: str | os.PathLike) -> dict[str, str]:
    """The raw string metadata of a safetensors file ({} for other files), read from its header."""
    path = checked_path(path)
    if sniff_format(path) != "safetensors":
        return {}
    _safetensors()  # a missing package is said as such
    try:
        with _safetensors().safe_open(str(path), "pt") as f:
            return dict(f.metadata() or {})
    except Exception as err:  # safetensors raises its own error types
        raise CheckpointError(f"cannot read {path} as safetensors (truncated or corrupt?): {_first_line(err)}") from None


def read_weights_meta(path: str | os.PathLike) -> WeightsMeta | None:
    """The validated :class:`~cgavit.schema.WeightsMeta` of a cgavit safetensors file, read from its
    header alone (no tensor is read); None for any other file.

    Raises:
        CheckpointError: metadata that is malformed, out of bounds, or disagrees with the tensor shapes.
    """
    raw = read_metadata(path)
    if not is_weights_meta(raw):
        return None
    meta = parse_weights_meta(raw, str(path))
    with _safetensors().safe_open(str(path), "pt") as f:
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    check_meta_against_shapes(meta, shapes, str(path))
    return meta


def _architecture(model: nn.Module, feed_size: str | None, record: object) -> dict[str, str]:
    """The metadata that says what ``model``'s tensors are (config, classes, distillation head, input channels, the
    size its attention-bias tables were built for); ``feed_size``: the ``img_size`` a record gives, the size images are
    fed at. The build size goes in ``input_size`` wherever it is not that size (a model built at 512 px and fed
    at 224 comes back built at 512).

    Raises:
        ValueError: a record whose class names are not one per class of the model.
    """
    names = record.class_names if isinstance(record, WeightsMeta) else None
    if names is not None and len(names) != model.num_classes:
        raise ValueError(f"the record names {len(names)} classes and the model has {model.num_classes}: give one "
                         "class name per output")
    size = tuple(getattr(model, "img_size", ()))
    arch = {"config": json.dumps(asdict(model.cfg)), "num_classes": str(model.num_classes),
            "distillation": str(bool(getattr(model, "distillation", False))),
            "in_chans": str(getattr(model, "in_chans", 3))}
    if getattr(model, "global_pool", "avg") != "avg":  # the last stage's map, unpooled (timm's global_pool="")
        arch["global_pool"] = model.global_pool
    if len(size) == 2:
        arch["img_size"] = feed_size or str(max(size))  # a record's own, else the side the network was built for
        if size[0] != size[1] or arch["img_size"] != str(size[0]):  # else img_size says it
            arch["input_size"] = json.dumps(list(size))
    return arch


def is_fused(model: nn.Module) -> bool:
    """Whether ``model`` is a fused cgavit network (:func:`cgavit.deploy.fuse`): no Conv-BN pair left (a BatchNorm
    alone is no sign: ``reset_classifier`` gives a fused model a BatchNorm head again). Its tensors are not a
    checkpoint's: nothing loads into it or from it."""
    return hasattr(model, "cfg") and not any(isinstance(m, ConvBN) for m in model.modules())


def is_pruned(model: nn.Module) -> bool:
    """Whether ``model`` is a cgavit network with stages removed (:meth:`~cgavit.model.EfficientViT.prune_intermediate_layers`,
    as ``features_only`` with ``out_indices`` short of the last stage does). Its tensors are not a whole network's:
    nothing loads into it or from it."""
    return hasattr(model, "cfg") and hasattr(model, "stages") and len(model.stages) < len(model.cfg.depth)


def network_of(model: nn.Module) -> nn.Module:
    """The network inside ``model``'s wrappers, one inside another in any order: a ``features_only`` model's (a
    :class:`~cgavit.model.FeatureMaps`), ``torch.compile``'s (the module it compiles, which shares its parameters),
    ``DistributedDataParallel``'s or ``DataParallel``'s; ``model`` itself when it is none of them."""
    while True:
        if isinstance(model, FeatureMaps):
            model = model.model
        elif isinstance(model, (nn.DataParallel, nn.parallel.DistributedDataParallel)):
            model = model.module
        elif isinstance(getattr(model, "_orig_mod", None), nn.Module):  # torch.compile's OptimizedModule
            model = model._orig_mod
        else:
            return model


def save_weights(model: nn.Module, path: str | os.PathLike, metadata: WeightsMeta | Mapping[str, str] | None = None) -> Path:
    """Save ``model``'s tensors in this package's format (safetensors), atomically.

    The model's architecture always goes into the metadata (config, class count, input channels, image size,
    non-square too, distillation head, and pooling where it is not the average), so :func:`cgavit.load_model` rebuilds the same network; a
    :class:`~cgavit.schema.WeightsMeta` adds the preprocessing and class names that it gives back. A plain
    mapping of strings is stored as given, for notes of your own. A ``features_only`` model is saved as its network,
    which has no classifier: ``create_model(name, features_only=True, out_indices=..., checkpoint_path=path)`` gives it
    back as it was (``load_model``, as the network, whose ``forward`` gives the last stage's map).

    Returns:
        The path written.

    Raises:
        ValueError: a fused model (:func:`cgavit.deploy.fuse`) or a pruned one (``prune_intermediate_layers``, or a
            ``features_only`` model without the last stage), whose
            tensors no model built here takes: save the model before fusing or pruning it; a record whose class names
            are not one per class, or any record load_model would refuse (nothing is written).
        TypeError: ``model`` that is not a module (a state dict).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"save_weights takes the model (an nn.Module), got {type(model).__name__}; for a state dict, "
                        "load it into its model first (cgavit.create_model(name, checkpoint_path=sd))")
    model = network_of(model)  # a features_only, compiled or DDP model's tensors are its network's, by its names
    if is_fused(model):
        raise ValueError("this is a fused model (BatchNorm folded), which cannot be loaded back; save the model "
                         "before fusing it, and fuse after loading")
    if is_pruned(model):
        raise ValueError(f"this model was pruned to {len(model.stages)} of its {len(model.cfg.depth)} stages "
                         "(prune_intermediate_layers, or features_only with out_indices short of the last stage), "
                         "which cannot be loaded back; save the whole model, and prune after loading")
    meta = {"format": "cgavit"}
    name = (getattr(model, "pretrained_cfg", None) or {}).get("architecture")
    if name:  # the variant it was built as (a record's own name, below, wins)
        meta["model"] = str(name)
    if isinstance(metadata, WeightsMeta):
        meta.update(metadata.to_strings())
    else:
        meta.update({str(k): str(v) for k, v in (metadata or {}).items()})
    if getattr(model, "cfg", None) is not None:  # what the tensors are, whatever a record says
        meta.pop("input_size", None)
        meta.update(_architecture(model, meta.get("img_size"), metadata))
    if is_weights_meta(meta):  # what load_model will read back, read now: a record it refuses is never written
        try:
            parse_weights_meta(meta, str(path))
        except CheckpointError as err:
            raise ValueError(f"not saved: load_model would refuse this record ({str(err).split('bad metadata: ')[-1]}); "
                             "give values it takes") from None
    tensors = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    return atomic_write(path, lambda tmp: _write_safetensors(tensors, tmp, meta))


def _write_safetensors(tensors: dict[str, torch.Tensor], path: str, metadata: dict[str, str]) -> None:
    """safetensors' ``save_file``, with a failed write raised as the ``OSError`` it is: safetensors reports one (a full
    disk) as its own error type, the errno only in its text (``... (os error 28)``), which
    :func:`~cgavit.io.atomic_write` would let through as it is, a traceback in place of its message."""
    try:
        _safetensors().torch.save_file(tensors, path, metadata=metadata)
    except Exception as err:
        found = re.search(r"\(os error (\d+)\)", str(err))
        if found is None:
            raise
        code = int(found.group(1))
        raise OSError(code, os.strerror(code)) from None
