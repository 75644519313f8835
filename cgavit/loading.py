"""Fitting a checkpoint's tensors into a model: names converted, every tensor checked against the
model by :mod:`cgavit.schema` before anything is copied, heads for another class count left as
initialised, official 2-D 1x1 weights reshaped, bias tables of another window resized.

:func:`fit_state_dict` does the checking and fitting against any model's state dict (the meta-device
one of a network not built yet, as :func:`cgavit.load_model` uses); :func:`load_checkpoint` is the
same for a model you have.
"""

from __future__ import annotations

import logging
import math
import os
import re
from collections.abc import Mapping
from pathlib import Path

import torch
from torch import nn

from .attention import resize_bias_table
from .io import CheckpointError, require_flag
from .model import convert_state_dict
from .schema import (check_finite, check_state_dict, check_tensor, check_training_checkpoint, is_training_checkpoint,
                     is_weights_meta, parse_weights_meta, shown, training_meta)
from .variants import EfficientViTConfig
from .weights import WeightsFile, is_fused, is_pruned, network_of, read_weights_file, unwrap_state_dict

log = logging.getLogger(__name__)


def fit_state_dict(
    sd: Mapping[str, torch.Tensor], target: Mapping[str, torch.Tensor], source: str, num_classes: object = "?",
    *, strict: bool = True,
) -> tuple[dict[str, torch.Tensor], dict[str, list[str]]]:
    """``sd`` (official, timm or cgavit names) made to fit ``target`` (a model's state dict, on any
    device, meta included), after checking every tensor.

    A classifier for another class count is dropped (left as initialised, as fine-tuning needs; all of it,
    BatchNorm included, for a model without one, ``num_classes=0``); a distillation head absent on one side
    is skipped; attention-bias tables for another window are resized bicubically; anything else that
    differs raises before anything is copied. With ``strict=False`` (timm's and ``load_state_dict``'s meaning),
    a file tensor the model has no name for is left out and a model tensor the file lacks is left as initialised,
    both reported; shapes are checked all the same, and a file of which no tensor fits is still refused.

    Returns:
        ``(fitted state dict, {"skipped": [...], "resized": [...], "missing": [...], "unexpected": [...]})``.

    Raises:
        CheckpointError: a tensor the schema refuses, a shape mismatch (naming the key and both shapes), and with
            ``strict`` (the default) an unknown key or a model tensor the file lacks.
    """
    sd = convert_state_dict(check_state_dict(sd, source))
    report: dict[str, list[str]] = {"skipped": [], "resized": [], "missing": [], "unexpected": []}
    _drop_foreign_heads(sd, target, report, num_classes)
    _refuse_fused(sd, target, source)
    for key, value in list(sd.items()):
        if key not in target and not strict:
            report["unexpected"].append(key)
            del sd[key]
            continue
        if key not in target:
            raise CheckpointError(
                f"{source}: key {shown(key)} (shape {tuple(value.shape)}) does not exist in the model; "
                "is it a checkpoint of another architecture? (strict=False leaves such keys out)"
            )
        fit = check_tensor(key, value, target[key], source)
        if fit == "reshape":
            sd[key] = value.reshape(target[key].shape)  # official files keep some 1x1 conv weights 2-D
        elif fit == "resize":
            sd[key] = resize_bias_table(value, math.isqrt(target[key].shape[1]))
            report["resized"].append(key)
    if not strict and not sd and report["unexpected"]:  # timm would load nothing, without a word
        raise CheckpointError(f"{source}: none of its {len(report['unexpected'])} tensors has a name the model has "
                              f"(the first: {shown(report['unexpected'][0])}); it is another architecture's checkpoint, "
                              "or its names carry a prefix to remove first")
    _check_complete(sd, target, report, source, strict)
    return sd, report


def _refuse_fused(sd: Mapping[str, torch.Tensor], target: Mapping[str, torch.Tensor], source: str) -> None:
    """Refuse a fused model's state dict for a model that is not fused, naming it as such (its first key was
    refused as another architecture's)."""
    fused = next((key for key in sd if key.endswith(FUSED_BIAS) and key not in target), None)
    if fused is not None:
        raise CheckpointError(f"{source} holds a fused model's tensors ({shown(fused)}: cgavit.fuse folded its "
                              "BatchNorms into the convs), which no model loads; save the model before fusing it "
                              "(torch.save(model.state_dict(), ...) or cgavit.save_weights), and fuse after loading")


FIRST_CONV = "patch_embed.conv1.conv.weight"
#: The key of a fused attention's expanded bias (:class:`~cgavit.attention.FusedCascadedGroupAttention`): only a
#: fused model's state dict has it.
FUSED_BIAS = ".attn.bias_full"


def adapt_first_conv(sd: Mapping[str, torch.Tensor], in_chans: int) -> dict[str, torch.Tensor]:
    """``sd`` (this package's key names) with an RGB first convolution adapted to ``in_chans`` inputs, by timm's
    rule: one channel takes the sum of the three filters, which is exact for a grey image repeated on three
    channels with one mean and std; more channels repeat R, G, B in turn, scaled by ``3 / in_chans`` so the
    response to the same value on every channel is kept. A file whose first convolution is not RGB is left as it
    is (the usual shape checks judge it)."""
    sd = dict(sd)
    weight = sd.get(FIRST_CONV)
    if in_chans == 3 or weight is None or weight.ndim != 4 or weight.shape[1] != 3:
        return sd
    if in_chans == 1:
        sd[FIRST_CONV] = weight.sum(dim=1, keepdim=True)
    else:
        sd[FIRST_CONV] = weight.repeat(1, math.ceil(in_chans / 3), 1, 1)[:, :in_chans] * (3 / in_chans)
    log.info("first convolution adapted from 3 input channels to %d", in_chans)
    return sd


def _drop_foreign_heads(sd: dict, target: Mapping, report: dict, num_classes: object) -> None:
    """Skip a distillation head the model lacks, and a classifier for another class count: its linear
    layer, or the whole classifier (its BatchNorm too) when the model has none (``num_classes=0``)."""
    for key in [k for k in sd if k.startswith("head_dist.") and k not in target]:
        report["skipped"].append(key)
        del sd[key]
    head_w = sd.get("head.linear.weight")
    want_w = target.get("head.linear.weight")
    if head_w is not None and (want_w is None or head_w.shape != want_w.shape):
        headless = not any(k.startswith("head.") for k in target)
        for key in [k for k in sd if re.match(r"head(_dist)?\." if headless else r"head(_dist)?\.linear\.", k)]:
            report["skipped"].append(key)
            del sd[key]
        if want_w is not None and head_w.shape[0] == want_w.shape[0]:  # another width: the rest of the file will not fit
            log.info("checkpoint classifier takes %d features, the model's %d: classifier left as initialised",
                     head_w.shape[1], want_w.shape[1])
        elif headless:
            log.info("checkpoint classifier (%d classes) dropped: the model has none (num_classes=0)", head_w.shape[0])
        else:
            log.info("checkpoint classifier has %d classes, the model %s: classifier left as initialised",
                     head_w.shape[0], num_classes)


def _check_complete(sd: Mapping, target: Mapping, report: dict, source: str, strict: bool = True) -> None:
    """Every model tensor must come from the file, except heads deliberately left as initialised (the classifier,
    BatchNorm included, where the file has none: a ``num_classes=0`` file) and BatchNorm's step counters
    (``num_batches_tracked``: ``load_state_dict`` does not ask for them either, and some converters drop them);
    without ``strict``, any other tensor the file lacks is reported missing too."""
    file_headless = not any(k.startswith("head.") for k in (*sd, *report["skipped"]))
    for key in target:
        if key in sd or key.endswith(".num_batches_tracked"):
            continue
        if (key.startswith("head_dist.") or (key.startswith("head.") and file_headless)
                or (key.startswith("head.linear.") and "head.linear.weight" in report["skipped"]) or not strict):
            report["missing"].append(key)
            continue
        raise CheckpointError(
            f"{source}: the model's {key!r} (shape {tuple(target[key].shape)}) is not in the checkpoint; "
            "it is incomplete or for another variant"
        )


def _distillation_head_from_class_head(sd: dict, report: dict, source: str) -> None:
    """A distillation head the file lacks starts as a copy of the file's class head, where that head is the
    file's own (not left as initialised for another class count): the model then predicts as the file's network
    did (both heads averaged give the one head), until training moves them apart. A head of random weights
    averaged in would change every output silently."""
    wanted = [k for k in report["missing"] if k.startswith("head_dist.")]
    pairs = {k: "head." + k[len("head_dist."):] for k in wanted}
    if not wanted or any(v not in sd for v in pairs.values()):
        return
    for dist, head in pairs.items():
        sd[dist] = sd[head].clone()
        report["missing"].remove(dist)
    log.info("%s has no distillation head: the model's starts as a copy of its class head", source)


def load_checkpoint(
    model: nn.Module,
    path: str | os.PathLike | Mapping[str, torch.Tensor],
    *,
    trust: bool = False,
    prefer_ema: bool = False,
    strict: bool = True,
    source: str | None = None,
    expect_dropped_heads: bool = False,
    use_ema: bool | None = None,
) -> dict[str, list[str]]:
    """Load official, timm or cgavit weights into ``model`` after checking every tensor
    (:func:`fit_state_dict`); weights holding NaN or inf are refused.

    Args:
        model: the network to load into (a ``features_only``, ``torch.compile``d or DDP model: the network inside).
        path: a checkpoint file, or what one holds (a state dict, or one wrapped as ``{"model": ...}``,
            ``{"state_dict": ...}``, with DDP's ``module.`` prefix or not), as ``torch.load`` returns it.
        trust: allow pickled objects in the file (runs code from it; only for files you trust). By keyword only,
            as ``prefer_ema``: timm's ``load_checkpoint(model, path, True)`` means its ``use_ema``, and read here as
            ``trust`` it would run the file's code.
        prefer_ema: take the EMA weights when the file holds both (timm's ``use_ema``).
        strict: as timm's and ``load_state_dict``'s: False loads what fits, leaving out the file's tensors the model
            has no name for and leaving as initialised the model's the file lacks (both warned of and returned);
            shapes are checked as ever (a mismatch raises), and a file of which nothing fits is refused.
        source: what messages call ``path`` (default: the path, or ``"state dict"`` for a mapping).
        expect_dropped_heads: the caller's model is not meant to reproduce the file's outputs (fine-tuning, where the
            heads are trained again; a teacher, whose class head is what distils): a distillation head it lacks, or a
            classifier for another class count, is noted at INFO, not warned about.
        use_ema: ``prefer_ema`` by timm's name (and :func:`~cgavit.load_model`'s), for code written for timm; by
            keyword only, and False unless given (timm's default is True).

    Returns:
        ``{"skipped": [...], "resized": [...], "missing": [...], "unexpected": [...]}`` key lists.

    Raises:
        CheckpointError: an unreadable or unsafe file, or one that does not fit (naming the first key
            and both shapes).
        ValueError: a fused model, a pruned one (``features_only`` without the last stage), or one on the meta device.
    """
    require_flag(trust, "trust")
    require_flag(strict, "strict")
    prefer_ema = _ema_asked(prefer_ema, use_ema)
    model = network_of(model)  # a features_only, compiled or DDP model loads into its network
    _check_loadable(model)
    source = source or ("state dict" if isinstance(path, Mapping) else str(path))
    wf = WeightsFile(Path(source), "torch", path) if isinstance(path, Mapping) else read_weights_file(path, trust)
    raw = unwrap_state_dict(wf.content, source, prefer_ema)  # a mapping as a file holding it
    try:
        recorded = recorded_config(wf, source)
    except CheckpointError as err:  # the tensors are checked on their own: a record is only compared
        log.warning("%s; its architecture is not compared with the model's", err)
        recorded = None
    check_recorded_architecture(model, recorded, source)
    sd, report = fit_state_dict(raw, model.state_dict(), source, getattr(model, "num_classes", "?"), strict=strict)
    check_finite(sd, source)
    _distillation_head_from_class_head(sd, report, source)
    model.load_state_dict(sd, strict=False)
    _log_report(report, source, expect_dropped_heads)
    return report


def _ema_asked(prefer_ema: bool, use_ema: bool | None) -> bool:
    """Whether :func:`load_checkpoint` takes the EMA weights: ``prefer_ema``, or ``use_ema``, timm's name for it."""
    require_flag(prefer_ema, "prefer_ema")
    if use_ema is None:
        return prefer_ema
    require_flag(use_ema, "use_ema")
    if prefer_ema and not use_ema:
        raise ValueError("prefer_ema=True and use_ema=False ask for both weights: use_ema is prefer_ema by timm's name; "
                         "give one of them")
    return use_ema


def _check_loadable(model: nn.Module) -> None:
    """Raise ``ValueError`` for a model no checkpoint can be loaded into: fused, pruned, or without data (meta)."""
    if is_fused(model):
        raise ValueError("the model is fused (BatchNorm folded), and checkpoints hold the unfused network's tensors; "
                         "load into the model before fusing it, and fuse after loading")
    if is_pruned(model):
        raise ValueError(f"the model was pruned to {len(model.stages)} of its {len(model.cfg.depth)} stages "
                         "(features_only with out_indices short of the last stage, or prune_intermediate_layers), and "
                         "checkpoints hold the whole network; load first: cgavit.create_model(name, features_only=True, "
                         "out_indices=..., checkpoint_path=path)")
    if any(t.is_meta for t in model.state_dict().values()):  # load_state_dict copies nothing into them, and says so
        raise ValueError("the model is on the meta device, with no data to copy the weights into; give it storage "
                         "first (model.to_empty(device='cpu')), then load")


def _log_report(report: dict[str, list[str]], source: str, expect_dropped_heads: bool) -> None:
    """Say what loading resized and left as initialised; warn, unless the caller expects heads to differ, of the
    outputs that are not the file's network's (a classifier the file lacks or has for another class count, a
    distillation head the model lacks)."""
    level = logging.INFO if expect_dropped_heads else logging.WARNING
    if report["resized"]:
        log.info("resized %d attention-bias tables to the model's windows", len(report["resized"]))
    if report["missing"]:
        log.info("left as initialised: %s", ", ".join(report["missing"]))
    if "head.bn.weight" in report["missing"]:  # no classifier in the file at all
        log.log(level, "%s holds no classifier (a file saved with num_classes=0?): the model's is left as initialised, "
                "so its outputs mean nothing until it is trained", source)
    if not expect_dropped_heads and "head.linear.weight" in report["skipped"] and "head.bn.weight" not in report["skipped"]:
        log.warning("%s has a classifier for another class count than the model's (num_classes; logged above): the "
                    "model's is left as initialised, so its outputs mean nothing until it is trained; build it with the "
                    "file's count to use its classifier (cgavit.load_model reads it from the file)", source)
    if any(k.startswith("head_dist.") for k in report["skipped"]) and "head.linear.weight" not in report["skipped"]:
        log.log(level,  # (a new classifier is not the file's network anyway)
                "%s has a distillation head and the model none: the model's outputs are its class head's alone, where "
                "the checkpoint's network averaged both heads; build it with distillation=True to use both", source)
    _log_partial(report, source)


def _log_partial(report: dict[str, list[str]], source: str) -> None:
    """Warn of what a ``strict=False`` load left out: the file's tensors the model has no name for, and the model's
    tensors outside its heads that the file lacked (left as initialised: the model is not the file's network)."""
    body = [k for k in report["missing"] if not k.startswith(("head.", "head_dist."))]
    for keys, what in ((report["unexpected"], "of its tensors have no name in the model and were not loaded"),
                       (body, "of the model's tensors are not in it and were left as initialised")):
        if keys:
            shown_keys = ", ".join(keys[:5]) + (", ..." if len(keys) > 5 else "")
            log.warning("%s: %d %s (strict=False): %s", source, len(keys), what, shown_keys)


def recorded_config(wf: WeightsFile, source: str) -> EfficientViTConfig | None:
    """The architecture a cgavit file records (its safetensors metadata, or a training checkpoint's options, also as
    ``torch.load`` returns them); None for a file that records none (official, timm, a bare state dict).

    Raises:
        CheckpointError: a record that is malformed or out of bounds.
    """
    if wf.kind == "safetensors" and is_weights_meta(wf.metadata):
        return parse_weights_meta(wf.metadata, source).config
    if is_training_checkpoint(wf.content):
        check_training_checkpoint(wf.content, source)
        return training_meta(wf.content, source)[0].config
    return None


def check_recorded_architecture(model: nn.Module, recorded: EfficientViTConfig | None, source: str) -> None:
    """Refuse a file whose recorded architecture differs from ``model``'s in a dial no tensor shape shows (the
    cascade: a model built without it takes the tensors and computes another function); warn about other
    differences, which either do not fit (refused by the tensors' check) or are fitted (bias tables resized)."""
    built = getattr(model, "cfg", None)
    if recorded is None or not isinstance(built, EfficientViTConfig):
        return
    changed = built.differs_from(recorded)
    if "cascade" in changed:
        raise CheckpointError(
            f"{source} records cascade={recorded.cascade} and the model was built with cascade={built.cascade}: the "
            f"tensors fit either, but the outputs would be another network's; build it with cascade={recorded.cascade}, "
            "or open the file with cgavit.load_model, which builds the network it records")
    if changed:
        log.warning("%s records another architecture than the model's (%s): loading what fits; cgavit.load_model "
                    "builds the network it records", source,
                    ", ".join(f"{k}={getattr(recorded, k)!r} in the file, {getattr(built, k)!r} in the model" for k in changed))
