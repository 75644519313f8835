"""``fuse``: the reference inference form, every BatchNorm folded into its conv or linear layer."""

from __future__ import annotations

import copy
import os
from collections.abc import Mapping
from pathlib import Path

import torch
from torch import nn

from ..attention import CascadedGroupAttention, LocalWindowAttention
from ..fast import swap_fast_modules
from ..io import check_names_fit
from ..layers import BNLinear, ConvBN, Residual
from ..model import EfficientViT, FeatureMaps

FUSABLE = (ConvBN, BNLinear, CascadedGroupAttention)
BATCHNORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)


def _swap_fused(module: nn.Module) -> None:
    for name, child in module.named_children():
        if isinstance(child, FUSABLE):
            setattr(module, name, child.fuse())
        else:
            _swap_fused(child)


@torch.no_grad()
def fuse(model: nn.Module) -> nn.Module:
    """Return an eval-mode inference copy of ``model`` with every BatchNorm folded away (a 16-bit model's in float32,
    then cast back: the copy keeps the model's dtype).

    Conv-BN pairs become one ``nn.Conv2d``, BN+Linear heads one ``nn.Linear``, and each attention's
    relative-position bias is gathered once into a buffer. ``model`` itself is not modified;
    fusing an already fused model changes nothing. The copy is an inference form: its parameters are
    frozen (``requires_grad`` False), since training would need the BatchNorms it no longer has, and in training
    mode too it computes what it computes in eval mode (stochastic depth off, a distilled network's two heads averaged).

    Raises:
        ValueError: if a BatchNorm remains that is not part of a Conv-BN or BN-Linear pair.
    """
    if not isinstance(model, nn.Module):
        raise ValueError(f"fuse expects an nn.Module, got {type(model).__name__}")
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    fused = copy.deepcopy(model).eval()
    if dtype in (torch.float16, torch.bfloat16):  # folded in float32 and cast back once: a bf16 fold rounded each step
        fused.float()
    if isinstance(fused, FUSABLE):
        fused = fused.fuse().eval()
    else:
        _swap_fused(fused)
    left = [n for n, m in fused.named_modules() if isinstance(m, BATCHNORMS)]
    if left:
        raise ValueError(f"these BatchNorm layers have no conv/linear to fold into: {left}")
    for p in fused.parameters():
        p.requires_grad_(False)
    return _inference_only(fused).to(dtype)


def _inference_only(model: nn.Module) -> nn.Module:
    """Turn off, in place, what ``model`` does only in training mode: every residual's stochastic depth, and a
    distilled network's pair of logits (it gives their mean); returns ``model``. The head's dropout is already gone
    once folded, so a fused model set to train (a teacher inside a module being trained) kept dropping residual
    branches at random, and a distilled one gave two heads' logits."""
    for m in model.modules():
        if isinstance(m, Residual):
            m.drop = 0.0
        elif isinstance(m, EfficientViT):
            m.set_distilled_training(False)
    return model


def fused_fp32(model: nn.Module) -> nn.Module:
    """:func:`fuse`'s copy of ``model`` in float32, the dtype every path and export takes its images in and is judged
    against, whatever the model's own (a bf16, fp16 or float64 model)."""
    return fuse(model).float()


def export_form(model: nn.Module, img_size: tuple[int, int], fold_residuals: bool = True) -> nn.Module:
    """The graph every export writes: :func:`fuse`, then the inference modules of :mod:`cgavit.fast`
    specialised to ``img_size`` images (constant-size reshapes, precomputed biases, the attention
    scale in the query conv, depthwise residuals folded into their convs with ``fold_residuals``).
    A cgavit model's function is unchanged up to float rounding; any other module is only fused.

    Reduced-precision exports keep the residuals unfolded (``fold_residuals=False``): in int8 the
    folded centre tap would widen each channel's weight range, and so its quantisation step; in bf16
    ``1 + w`` would lose the low bits of ``w``.
    """
    fused = fuse(model)
    if any(isinstance(m, LocalWindowAttention) for m in fused.modules()):
        swap_fast_modules(fused, img_size=img_size, fold_residuals=fold_residuals)
    return fused


def check_one_output(model: nn.Module, what: str) -> None:
    """Refuse, for ``what`` (``"optimize"``, ``"an export"``), a ``features_only`` model: it returns a list of maps,
    one per stage, where every fast path and file gives one tensor (an ONNX file's runtime returned the first map
    alone, and optimize's check failed with an AttributeError).

    Raises:
        ValueError: ``model`` is a :class:`~cgavit.model.FeatureMaps`.
    """
    if isinstance(model, FeatureMaps):
        raise ValueError(f"{what} takes a model that returns one tensor, and a features_only model returns one map "
                         "per stage: build it with num_classes=0, global_pool='' for the last stage's map, or run "
                         "cgavit.fuse(model) for every map in PyTorch")


def check_model(model: object, what: str) -> None:
    """Refuse, for ``what`` (``"optimize"``, ``"quantize"``), what is not a model instance (a variant's name, a class,
    a state dict), a model of several outputs (:func:`check_one_output`) or one whose weights hold no values (built on
    the ``meta`` device), in one line, not an error from deep inside the first step that reads its weights or logits.

    Raises:
        ValueError: what is wrong, and what to give instead.
    """
    if isinstance(model, nn.Module):
        check_one_output(model, what)
        if any(t.device.type == "meta" for t in (*model.parameters(), *model.buffers())):
            raise ValueError(f"{what} takes a model with weights, and this one's are on the meta device (no values: "
                             "built under torch.device('meta')?); load them first, e.g. "
                             "cgavit.create_model(name, checkpoint_path=path), or model.to_empty(device='cpu') and "
                             "model.load_state_dict(weights)")
        return
    if isinstance(model, str):
        hint = f": a name; build the model first, e.g. cgavit.create_model({model!r}, pretrained=True)"
    elif isinstance(model, type):
        hint = f" (the class {model.__name__}): build an instance first"
    elif isinstance(model, Mapping):
        hint = " (a state dict?): build the model with its weights, e.g. cgavit.create_model(name, checkpoint_path=path)"
    else:
        hint = ""
    raise ValueError(f"{what} takes a model, an nn.Module instance; got {type(model).__name__}{hint}")


def check_classifier(model: nn.Module, what: str) -> None:
    """Refuse, for ``what``, a model without a classifier (``num_classes=0``: it returns pooled features or a map),
    where reduced precision is judged by whether it keeps fp32's top-1 decisions: the largest feature is no decision,
    and its agreement would be a figure about nothing.

    Raises:
        ValueError: ``model.num_classes`` is 0.
    """
    if getattr(model, "num_classes", None) == 0:
        raise ValueError(f"{what} judges reduced precision by whether it keeps fp32's top-1 class, and this model has "
                         "no classifier (num_classes=0: it returns features): give the model with its classifier head, "
                         "or pick a precision, checked by relative error: optimize(model, x, 'int8', calibration=...)")


def example_batch(model: nn.Module, img_size: tuple[int, int], batch: int = 2) -> torch.Tensor:
    """A random image batch ``(batch, in_chans, H, W)`` for tracing or exporting ``model``, drawn from a generator
    of its own (the caller's random number stream is left where it was)."""
    return torch.randn(batch, getattr(model, "in_chans", 3), *img_size, generator=torch.Generator().manual_seed(0))


def output_path(path: str | os.PathLike) -> Path:
    """``path`` as a Path, after checking that the folder an export writes into exists.

    Raises:
        ValueError: the parent folder does not exist.
    """
    path = Path(path)
    if not path.parent.exists():
        raise ValueError(f"output folder {path.parent} does not exist; create it first")
    return path


def file_name(path: str | os.PathLike, example: str) -> Path:
    """``path`` as a Path when it names a file that can be written in a folder that exists (:func:`output_path`).

    Raises:
        ValueError: an empty name, one ending in a separator or in ``.``/``..``, one too long for its file system,
            or the name of a folder (a file written beside it under another name would surprise); ``example`` shows
            a good name.
    """
    raw = os.fspath(path)
    if not raw.strip() or raw.endswith(("/", os.sep)) or Path(raw).name in ("", ".", ".."):
        raise ValueError(f"the output is a file name, e.g. {example}; got {raw!r}")
    check_names_fit([raw], "the output name")  # one too long failed in is_dir, as a traceback
    if Path(raw).is_dir():
        raise ValueError(f"the output {raw} is a folder; give a file name inside it, e.g. {Path(raw) / 'm0'}")
    return output_path(raw)


#: The suffixes of the files cgavit writes: an output name ending in one of them names that kind of file.
WRITTEN_SUFFIXES = (".onnx", ".xml", ".bin", ".pte", ".tflite", ".pt", ".safetensors")


def named_output(path: str | os.PathLike, suffix: str, what: str) -> Path:
    """Where a file of one format named ``path`` goes: ``NAME{suffix}`` as given, ``NAME`` (or a name whose
    suffix is none of :data:`WRITTEN_SUFFIXES`, ``m0.v2``) with ``suffix`` added, so that the file is
    recognised by what it is.

    Args:
        path: the name given.
        suffix: the format's suffix, e.g. ``".onnx"``.
        what: the kind of file, for the message.

    Raises:
        ValueError: no file name, the folder does not exist, the name ends in another format's suffix, or the file
            to write is a folder.
    """
    path = file_name(path, f"m0 or m0{suffix}")
    if path.suffix.lower() != suffix:
        if path.suffix.lower() in WRITTEN_SUFFIXES:
            raise ValueError(f"{what} is written as NAME{suffix}: give NAME or NAME{suffix}, not {path.name}")
        path = path.with_name(path.name + suffix)
    elif path.suffix != suffix:  # NAME.XML: OpenVINO writes only .xml (and reads its .bin by that name)
        path = path.with_suffix(suffix)
    if path.is_dir():
        raise ValueError(f"cannot write {path}: it is a folder (nothing was written); give the path of a file")
    return path
