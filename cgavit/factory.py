"""The package's front door: ``create_model`` builds a network, ``load_model`` rebuilds one from any
checkpoint, ``list_models`` lists the variants.

``load_model`` takes a file through one road, each step in its own module, entered once::

    io (is it a readable file?) -> weights (read it, no code runs) -> schema (what it says: metadata,
    training record, tensors) -> model (build, first on the meta device) -> loading (check every tensor
    against the model, fit) -> the network, built for real, with its weights
"""

from __future__ import annotations

import fnmatch
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from .hub import download_release
from .imagenet import class_names
from .io import CheckpointError, require_flag
from .loading import adapt_first_conv, fit_state_dict, load_checkpoint
from .model import EfficientViT, FeatureMaps, convert_state_dict, floating_dtype, stage_indices
from .schema import (
    MEAN_RANGE,
    STD_RANGE,
    WeightsMeta,
    bounded_floats,
    check_finite,
    check_meta_against_shapes,
    check_training_checkpoint,
    crop_and_interpolation,
    is_training_checkpoint,
    is_weights_meta,
    parse_weights_meta,
    training_meta,
)
from .variants import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD, VARIANTS, channel_normalisation, resolve_name
from .weights import EMA_KEYS, WeightsFile, read_state_dict, read_weights_file, unwrap_state_dict

log = logging.getLogger(__name__)


def list_models(pattern: str = "", pretrained: bool = False) -> list[str]:
    """Names of the registered variants matching ``pattern``: a shell wildcard as timm takes it
    (``"efficientvit_m[0-2]"``, ``"*m4*"``), or text a name contains (all by default). Every variant has
    published weights, so ``pretrained=True`` (timm's filter) lists the same."""
    if not isinstance(pattern, str):
        raise ValueError(f"a model name pattern must be text, got {type(pattern).__name__}")
    if any(c in pattern for c in "*?["):
        return sorted(fnmatch.filter(VARIANTS, pattern))
    return sorted(n for n in VARIANTS if pattern in n)


def create_model(
    name: str,
    pretrained: bool = False,
    checkpoint_path: str | Path | None = None,
    num_classes: int = 1000,
    *,
    in_chans: int = 3,
    img_size: int | tuple[int, int] = 224,
    distillation: bool = False,
    drop_path_rate: float = 0.0,
    global_pool: str = "avg",
    drop_rate: float = 0.0,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    features_only: bool = False,
    out_indices: int | list[int] | tuple[int, ...] | None = None,
    pretrained_cfg_overlay: Mapping[str, object] | None = None,
    **dials,
) -> EfficientViT | FeatureMaps:
    """Build a registered EfficientViT, optionally with weights.

    Args:
        name: ``efficientvit_m0`` ... ``efficientvit_m5`` (``m4`` and timm tags accepted).
        pretrained: fetch the official ImageNet-1k release file into the torch hub cache and load it
            (:func:`load_pretrained`; for ``in_chans`` other than 3 the RGB first convolution is adapted, as timm does).
        checkpoint_path: load weights from this file (official, timm or cgavit format), or a state dict.
        num_classes: classifier outputs, 0 for none (pooled features, as in timm); a checkpoint of another count
            loads its body, its classifier dropped (warned of for ``checkpoint_path``, logged for ``pretrained``).
        in_chans: input channels.
        img_size: size the model is built for (sets the attention windows); any size >= 32 runs.
        distillation: add the distillation head.
        drop_path_rate: stochastic depth for training.
        global_pool: ``"avg"``, or ``""`` with ``num_classes=0``: ``forward`` gives the last stage's map (timm's).
        drop_rate: dropout before the classifier while training (timm's ``drop_rate``).
        device, dtype: where and in what floating-point type the model ends up; weights are loaded first, at
            the file's precision, then the model is moved (``device="meta"`` gives a model without data).
        features_only, out_indices: timm's: a :class:`~cgavit.model.FeatureMaps` of the weighted model (no classifier),
            giving the maps of the stages ``out_indices`` asks for, as ``forward_intermediates`` reads ``indices``.
        pretrained_cfg_overlay: timm's: ``pretrained_cfg`` entries, and a ``file`` read for ``pretrained`` (:func:`overlaid`).
        **dials: design dials of :class:`~cgavit.variants.EfficientViTConfig` (``cascade``, ``group_split``,
            ``ffn_per_side``, ``key_dim``, ``attn_ratio``, ``ffn_ratio``, ``allocation``) and its other fields
            (``num_heads``, ``embed_dim``, ``depth``, ``window_size``, ``kernels``).

    Raises:
        ValueError: unknown name, an argument of the wrong type, or a dial combination that cannot work.
        TypeError: ``pretrained`` that is not a bool, or ``checkpoint_path`` that is not a path or a state dict.
        CheckpointError: weights that cannot be loaded (see :func:`load_pretrained`, :func:`load_checkpoint`).
    """
    key = resolve_name(name)
    cfg = VARIANTS[key].cfg.with_dials(**dials) if dials else VARIANTS[key].cfg
    _check_weights_args(pretrained, checkpoint_path)
    stages = _feature_stages(features_only, out_indices, len(cfg.depth))  # refused before any download
    model = EfficientViT(cfg, num_classes=0 if features_only else num_classes, in_chans=in_chans, img_size=img_size,
                         distillation=distillation, drop_path_rate=drop_path_rate, name=key, global_pool=global_pool,
                         drop_rate=drop_rate)
    floating_dtype(dtype)  # refused before any download
    model.pretrained_cfg, file = overlaid(model, pretrained_cfg_overlay, pretrained)
    _load_weights(model, key, pretrained, file, checkpoint_path)
    model = FeatureMaps(model, stages) if features_only else model
    return model.to(device=device, dtype=dtype) if device is not None or dtype is not None else model


def _feature_stages(features_only: object, out_indices: object, stages: int) -> list[int]:
    """The stages a ``features_only`` model gives (:func:`~cgavit.model.stage_indices` of ``out_indices``, all by
    default); ``ValueError`` for a bad value, or ``out_indices`` without ``features_only``."""
    if not isinstance(features_only, bool):
        raise ValueError(f"features_only must be True or False, got {features_only!r}")
    if out_indices is not None and not features_only:
        raise ValueError("out_indices selects the stage maps of a features_only model; give features_only=True, "
                         "or call model.forward_intermediates(x, indices=...) on the whole model")
    return stage_indices(out_indices, stages)


def _load_weights(model: EfficientViT, key: str, pretrained: bool, file: object, checkpoint_path: object) -> None:
    """The weights :func:`create_model` was asked for, if any: the published ones, or ``file`` in their place (timm's
    ``pretrained_cfg_overlay=dict(file=...)``), or ``checkpoint_path``."""
    if pretrained and file is not None:
        load_pretrained_file(model, file)
    elif pretrained:
        load_pretrained(model, key)
    elif checkpoint_path is not None:
        load_checkpoint(model, checkpoint_path)


def overlaid(model: EfficientViT, given: object, pretrained: bool) -> tuple[dict, object]:
    """``(model.pretrained_cfg`` with timm's ``pretrained_cfg_overlay`` entries over it, its ``file`` entry``)``, each
    entry checked: where weights come from (``file`` only with ``pretrained``; no other download place), what the model
    is (``num_classes``, ``input_size``: only the model's own), and how it is fed (mean and std: 1 or ``in_chans``
    values in the schema's ranges; crop and interpolation within :mod:`cgavit.bounds`). ``ValueError`` naming the
    entry otherwise."""
    if given is not None and not isinstance(given, Mapping):
        raise ValueError(f"pretrained_cfg_overlay must be a dict of pretrained_cfg entries, e.g. dict(mean=..., std=...) "
                         f"or dict(file='weights.pth') with pretrained=True; got {given!r}")
    overlay = dict(given or {})
    file = overlay.pop("file", None)
    if file is not None and (not pretrained or not isinstance(file, (str, os.PathLike))):
        raise ValueError(f"pretrained_cfg_overlay's file ({file!r}) is where pretrained=True reads the weights from; give "
                         "it as a path with pretrained=True, or load the file with checkpoint_path=")
    remote = [k for k in ("url", "hf_hub_id", "hf_hub_filename") if overlay.get(k)]
    if remote:
        raise ValueError(f"pretrained_cfg_overlay's {remote[0]}: cgavit downloads the published release only "
                         "(CGAVIT_WEIGHTS_MIRROR names a mirror of it); give a downloaded file as "
                         "pretrained_cfg_overlay=dict(file=path) with pretrained=True, or checkpoint_path=path")
    cfg = model.pretrained_cfg
    for key, argument in (("num_classes", "num_classes"), ("input_size", "in_chans and img_size")):
        if key in overlay and tuple(_listed(overlay[key])) != tuple(_listed(cfg[key])):
            raise ValueError(f"pretrained_cfg_overlay's {key} {overlay[key]!r} is not the model's {cfg[key]!r}: it "
                             f"describes the network, which create_model builds from {argument}; give {argument} instead")
    checked = {}
    for key in ("mean", "std"):
        values = overlay.get(key, cfg[key])
        count = len(values) if isinstance(values, (list, tuple)) else 0
        if count not in (1, model.in_chans):
            raise ValueError(f"pretrained_cfg_overlay's {key} must hold 1 or {model.in_chans} numbers (one per input "
                             f"channel), got {values!r}")
        checked[key] = bounded_floats(values, f"pretrained_cfg_overlay's {key}", count,
                                      *(MEAN_RANGE if key == "mean" else STD_RANGE))
    checked["crop_pct"], checked["interpolation"] = crop_and_interpolation(
        overlay.get("crop_pct", cfg["crop_pct"]), overlay.get("interpolation", cfg["interpolation"]),
        "pretrained_cfg_overlay's crop_pct", "pretrained_cfg_overlay's interpolation")
    return {**cfg, **overlay, **checked}, file


def _listed(value: object) -> object:
    """``value`` as a list where it is a tuple or a list (an overlay's ``input_size`` compares as either)."""
    return list(value) if isinstance(value, (list, tuple)) else [value]


def load_pretrained_file(model: EfficientViT, path: str | os.PathLike) -> dict[str, list[str]]:
    """``pretrained=True`` with timm's ``pretrained_cfg_overlay=dict(file=path)``: the weights read from that local file,
    as the published ones are (EMA weights preferred where it holds both, as timm's loader does; a classifier for
    another class count dropped, logged; the RGB first convolution adapted to ``in_chans``).

    Raises:
        CheckpointError: an unreadable or unsafe file, or one that does not fit the model.
    """
    sd = read_state_dict(path, prefer_ema=True)
    if model.in_chans != 3:
        sd = adapt_first_conv(convert_state_dict(sd), model.in_chans)
    return load_checkpoint(model, sd, source=str(path), expect_dropped_heads=True)


def _check_weights_args(pretrained: object, checkpoint_path: object) -> None:
    if not isinstance(pretrained, bool):  # a path or "False" would fetch the published weights
        raise TypeError(f"pretrained must be True or False, got {pretrained!r}; to load a file, give checkpoint_path=")
    if pretrained and checkpoint_path is not None:
        raise ValueError("give either pretrained=True or checkpoint_path, not both")
    if checkpoint_path is not None and not isinstance(checkpoint_path, (str, os.PathLike, Mapping)):
        raise TypeError(f"checkpoint_path must be a file path (or a state dict), got {checkpoint_path!r} "
                        f"({type(checkpoint_path).__name__})")


def load_pretrained(model: EfficientViT, name: str) -> dict[str, list[str]]:
    """Load the published ImageNet-1k weights of variant ``name`` into ``model``, downloading the release
    file once into the torch hub cache (:func:`cgavit.hub.download_release`). As :func:`load_checkpoint`:
    a classifier for another class count (or the whole classifier, for ``num_classes=0``) is dropped and
    attention-bias tables of other windows are resized. A model with ``in_chans`` other than 3 gets the RGB
    first convolution adapted as timm does (:func:`~cgavit.loading.adapt_first_conv`).

    Returns:
        ``{"skipped": [...], "resized": [...], "missing": [...], "unexpected": [...]}`` key lists.

    Raises:
        CheckpointError: ``model`` cannot take them (changed dials: the message names them); the download
            failed; or the cached file is damaged (the message says which file to delete).
        WriteError: the cache folder cannot be written.
    """
    key = resolve_name(name)
    published = f"the published {key} weights"
    changed = [f"{k}={getattr(model.cfg, k)!r}" for k in model.cfg.differs_from(VARIANTS[key].cfg)]
    if changed:
        log.warning("loading published weights into a model with changed dials %s", ", ".join(changed))
    cached = download_release(VARIANTS[key].url, check=lambda sd: _check_published(sd, key))
    try:
        sd = read_state_dict(cached)
    except CheckpointError as err:  # the file itself: damaged since, or cached unchecked by an older version
        raise CheckpointError(f"{err}; it is the download cache: delete {cached} to download it again") from None
    if model.in_chans != 3:
        sd = adapt_first_conv(convert_state_dict(sd), model.in_chans)
    try:
        return load_checkpoint(model, sd, source=str(cached), expect_dropped_heads=True)  # another count: a new task
    except CheckpointError as err:
        if changed:  # the caller's dials, not the file
            raise CheckpointError(f"{published} are for the paper's design; {', '.join(changed)} cannot load them: "
                                  f"{err}. Drop those options to use them, or train with them without pretrained=True") from None
        raise CheckpointError(f"{err}; it is not {published}: delete {cached} to download it again") from None


def _check_published(sd: Mapping[str, torch.Tensor], key: str) -> None:
    """Raise :class:`CheckpointError` unless ``sd`` fits variant ``key`` as the paper builds it (any class count)."""
    with torch.device("meta"):  # the architecture, allocating nothing
        target = EfficientViT(VARIANTS[key].cfg).state_dict()
    try:
        fit_state_dict(sd, target, "the file")
    except CheckpointError as err:
        raise CheckpointError(f"it is not the published {key} weights ({err})") from None


@dataclass
class ModelInfo:
    """How to feed a loaded model and read its outputs.

    Args:
        class_names: one name per output.
        img_size: the image size to feed it at (pixels): the one the file records (trained / evaluated at), or the
            size :func:`load_model` was asked to build it for (of an ``(H, W)``, the longer side: images are read square).
        crop_pct: evaluation centre-crop fraction.
        interpolation: resize interpolation.
        mean, std: input normalisation.
        source: where the weights came from, for messages.
        extra: further notes the file records (e.g. the epoch).
        names_recorded: whether ``class_names`` are the file's own (else ImageNet's or ``"class i"``).
    """

    class_names: list[str]
    img_size: int = 224
    crop_pct: float = 0.875
    interpolation: str = "bicubic"
    mean: tuple[float, ...] = IMAGENET_DEFAULT_MEAN
    std: tuple[float, ...] = IMAGENET_DEFAULT_STD
    source: str = ""
    extra: dict = field(default_factory=dict)
    names_recorded: bool = False


def _check_load_switches(path: object, model_name: object, pretrained: object, use_ema: object, trust: object) -> None:
    for flag, value in (("pretrained", pretrained), ("use_ema", use_ema), ("trust", trust)):
        require_flag(value, flag)
    if path is not None and pretrained:  # the file's weights would be loaded, the published ones silently not
        raise ValueError("give a checkpoint file or pretrained=True (--pretrained) for the published weights, not both")
    if path is None and not (pretrained and model_name):
        raise ValueError("give --checkpoint FILE, or --model NAME --pretrained for the published weights")
    if path is None and use_ema:  # the authors' release files hold one state dict, under 'model'
        log.warning("the published weights of %s hold no EMA weights; --ema changes nothing: using them", model_name)


def load_model(
    path: str | os.PathLike | None,
    model_name: str | None = None,
    dials: dict | None = None,
    *,
    img_size: int | tuple[int, int] | None = None,
    pretrained: bool = False,
    use_ema: bool = False,
    trust: bool = False,
    device: str | torch.device = "cpu",
) -> tuple[EfficientViT, ModelInfo]:
    """Rebuild a network from a checkpoint and return it in eval mode with its :class:`ModelInfo`.

    Args:
        path: a weights file written here (``*.safetensors``), a training checkpoint (``best.pt``,
            ``last.pt``), or an official / timm file (then ``model_name`` is needed). None with ``pretrained``.
        model_name: variant name for files that do not record it; for files that do, the file wins
            (a different name is logged).
        dials: design dials for files that do not record them.
        img_size: build for this image size, not the recorded one (bias tables resized); ``ModelInfo.img_size`` says it (of ``(H, W)``, the longer side: export at ``model.img_size``).
        pretrained: load the published ImageNet-1k weights of ``model_name`` (downloads once).
        use_ema: take the EMA weights of a training checkpoint.
        trust: allow pickled objects in third-party files (runs code from the file).
        device: where to put the model.

    Raises:
        CheckpointError: an unreadable, unsafe or damaged file (NaN/inf weights included), or one that
            does not fit the architecture it records or that was named.
        ValueError: not enough information to build the model.
        TypeError: ``dials`` that is not a mapping.
    """
    _check_load_switches(path, model_name, pretrained, use_ema, trust)
    if path is None:
        model = create_model(model_name, pretrained=True, **({"img_size": img_size} if img_size is not None else {}), **(dials or {}))
        return model.eval().to(device), ModelInfo(class_names(model.num_classes), img_size=max(model.img_size),
                                                   source=f"{model_name} (published)")
    wf = read_weights_file(path, trust)
    if use_ema and not (isinstance(wf.content, dict) and any(wf.content.get(k) is not None for k in EMA_KEYS)):
        log.warning("%s holds no EMA weights (only a training checkpoint that kept them does); --ema changes nothing: "
                    "using its weights", wf.path)
    meta, sd, recorded = _what_it_holds(wf, model_name, dials, use_ema)
    if recorded and dials:
        raise ValueError(f"{wf.path} records its own architecture; drop the dial options ({sorted(dials)})")
    if model_name and meta.model and resolve_name(model_name) != meta.model:
        log.warning("--model %s differs from the checkpoint's %s; using the checkpoint's", model_name, meta.model)
    size = img_size if img_size is not None else meta.input_size or meta.img_size
    with torch.device("meta"):  # the architecture, allocating nothing, to check the tensors against
        shape = _build(meta, size)
    fitted, report = fit_state_dict(sd, shape.state_dict(), str(wf.path), meta.num_classes)
    _check_recorded_heads(meta, report, wf.path, recorded)
    check_finite(fitted, wf.path)
    model = _build(meta, size)
    model.load_state_dict(fitted, strict=False)
    if report["resized"]:
        log.info("resized %d attention-bias tables to the model's windows", len(report["resized"]))
    fed = meta.img_size if img_size is None else max(model.img_size)  # the size asked for, as the model is built
    info = ModelInfo(class_names(meta.num_classes, meta.class_names), img_size=fed, crop_pct=meta.crop_pct,
                     interpolation=meta.interpolation, mean=meta.mean, std=meta.std, source=str(wf.path),
                     extra=dict(meta.extra), names_recorded=meta.class_names is not None)
    return model.eval().to(device), info


class UnrecordedArchitecture(ValueError):
    """A file that does not record its network (a bare state dict, an official or timm file) loaded without a
    variant name."""


def _check_recorded_heads(meta: WeightsMeta, report: dict[str, list[str]], source: object, recorded: bool) -> None:
    """Refuse a file that records a classifier or a distillation head (its metadata's own) and holds none of its
    tensors: its logits would be, or average in, a head of random weights."""
    if recorded and meta.num_classes and any(k.startswith("head.") for k in report["missing"]):
        raise CheckpointError(f"{source} records a classifier of {meta.num_classes} classes but holds no head tensors: it "
                              "is incomplete (its logits would come from a head of random weights); save the model again")
    if recorded and meta.distillation and any(k.startswith("head_dist.") for k in report["missing"]):
        raise CheckpointError(f"{source} records a distillation head but holds no head_dist tensors: it is incomplete "
                              "(its logits would average in a head of random weights); save the model again")


def _build(meta: WeightsMeta, img_size: int | tuple[int, int]) -> EfficientViT:
    """The network ``meta`` records, built for ``img_size``, its ``pretrained_cfg`` holding the record's preprocessing
    (where timm's ``resolve_data_config({}, model=m)`` reads it, as :class:`ModelInfo` gives it)."""
    model = EfficientViT(meta.config, num_classes=meta.num_classes, img_size=img_size, in_chans=meta.in_chans,
                         distillation=meta.distillation, name=meta.model or "", global_pool=meta.global_pool)
    mean, std = channel_normalisation(meta.mean, meta.std, meta.in_chans)  # three would not fit its images
    model.pretrained_cfg = dict(model.pretrained_cfg, mean=mean, std=std, crop_pct=meta.crop_pct,
                                interpolation=meta.interpolation)
    return model


def _what_it_holds(
    wf: WeightsFile, model_name: str | None, dials: dict | None, use_ema: bool
) -> tuple[WeightsMeta, dict[str, torch.Tensor], bool]:
    """The network a file describes (its metadata, its training record, or the name and dials given
    for a bare state dict), its tensors, and whether the file itself recorded the architecture."""
    source = str(wf.path)
    if dials is not None and not isinstance(dials, Mapping):
        raise TypeError(f"dials must be a mapping of dial names to values, e.g. {{'cascade': False}}; got {dials!r}")
    if wf.kind == "safetensors" and is_weights_meta(wf.metadata):
        meta = parse_weights_meta(wf.metadata, source)
        sd = unwrap_state_dict(wf.content, source)
        check_meta_against_shapes(meta, {k: tuple(v.shape) for k, v in sd.items()}, source)
        if meta.model is None:
            meta = _named(meta, model_name, source)
        return meta, sd, True
    if is_training_checkpoint(wf.content):
        check_training_checkpoint(wf.content, source)
        return (*training_meta(wf.content, source, use_ema), True)
    sd = unwrap_state_dict(wf.content, source, prefer_ema=use_ema)
    if not model_name:
        raise UnrecordedArchitecture(f"{source} does not record its architecture; name its variant (--model NAME, or load_model(path, 'efficientvit_m4')) and the dials it was trained with")
    key = resolve_name(model_name)
    cfg = VARIANTS[key].cfg.with_dials(**dials) if dials else VARIANTS[key].cfg
    ours = convert_state_dict(sd)  # official and timm names as this package's, to read the shapes by one name
    head = ours.get("head.linear.weight")
    headless = not any(k.startswith("head.") for k in ours)  # saved with num_classes=0 (timm's headless form)
    num_classes = 0 if headless else int(head.shape[0]) if head is not None and head.ndim == 2 else 1000
    stem = ours.get("patch_embed.conv1.conv.weight")
    in_chans = int(stem.shape[1]) if stem is not None and stem.ndim == 4 else 3
    distillation = any(k.startswith("head_dist.") and k.endswith("weight") and v.ndim == 2 for k, v in ours.items())
    meta = WeightsMeta(model=key, config=cfg, num_classes=num_classes, distillation=distillation, in_chans=in_chans)
    return meta, ours, False  # renamed once: fitting takes this package's names as they are


def _named(meta: WeightsMeta, model_name: str | None, source: str) -> WeightsMeta:
    """A file whose metadata records an architecture but no variant name: the name given, if any."""
    if not model_name:
        return meta
    try:
        key = resolve_name(model_name)
    except ValueError as err:
        raise CheckpointError(f"{source}: {err}") from None
    differ = [f"{k}={getattr(meta.config, k)!r}" for k in meta.config.differs_from(VARIANTS[key].cfg)]
    if differ:  # the file's own architecture is what is built: the name only labels it
        log.warning("%s records an architecture that is not %s's (%s); it is built as the file records it, "
                    "named %s", source, key, ", ".join(differ), key)
    return replace(meta, model=key)
