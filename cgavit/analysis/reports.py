"""The ``cgavit analyze`` runs as library calls: build the model and the image sample, run an
analysis, write its JSON report and figures.

:class:`AnalysisConfig` holds what both analyses share (its field names are the command's options);
:func:`run_heads` and :func:`run_taylor` return what they computed and wrote, and print nothing.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..bounds import CROP_PCT_RANGE, IMG_SIZE_RANGE, MAX_CLASSES
from ..factory import ModelInfo, create_model, load_model
from ..fields import option
from ..imagenet import class_names
from ..io import file_in_the_way, is_inside, json_ready, replace_together, staging, write_error, write_json, write_text
from ..classes import check_classes, class_difference, model_indices
from ..train.inference import input_channels
from .data import list_images, load_images
from .heads import BlockSimilarity, head_similarity, mean_similarity, plot_similarity
from .taylor import BlockImportance, kept_fraction, plot_importance, taylor_importance

log = logging.getLogger(__name__)

TARGETS = ("auto", "labels", "predictions")
#: Most pixels the image sample may hold (images x side x side): 3 GiB as fp32 RGB, e.g. 5000 x 224 x 224.
MAX_SAMPLE_PIXELS = 2**28
#: Most pixels one forward pass may take (batch x side x side), e.g. 1024 x 256 x 256.
MAX_BATCH_PIXELS = 2**26


@dataclass
class AnalysisConfig:
    """The model to analyse and the images to run it on. Each field is documented by its ``help``
    text, the line ``cgavit analyze heads --help`` shows for it.

    Attributes:
        dials: design dials for ``create_model`` (random models, or files without an architecture).
    """

    output: str = option(help="folder for the JSON and PNG files")
    model: str | None = option(None, "variant (default: the checkpoint's, else efficientvit_m0)")
    checkpoint: str | None = option(
        None, "weights: best.pt/last.pt/*.safetensors trained here (architecture and preprocessing read from the file), "
        "or an official/timm file (give --model and dials)",
    )
    pretrained: bool = option(
        False, "use the published ImageNet-1k weights of --model (downloaded once to the torch hub cache)"
    )
    trust_checkpoint: bool = option(False, "allow pickled objects in --checkpoint (runs code from it: only for files you trust)")
    data: str | None = option(None, "image folder: DIR/<class>/<img> (labelled) or DIR/<img>")
    images: tuple[str, ...] = option((), "image files (instead of --data)", flags=("images",), nargs="*")
    img_size: int | None = option(None, "input size (default: the checkpoint's, else 224)")
    crop_pct: float | None = option(None, "centre-crop fraction after resizing (default: the checkpoint's, else 0.875)")
    num_images: int = option(64, "images to use, balanced over classes (0 = all)")
    num_classes: int | None = option(None, "classifier size (default: the checkpoint's, else 1000)")
    batch_size: int = option(32, "images per forward pass")
    seed: int = option(0, "seed for the image sample and random weights")
    dials: dict[str, Any] = field(default_factory=dict)

    def image_folders(self) -> list[tuple[Path, str]]:
        """The folders the images are read from, each with how to name it: ``--data``, or the folder of each image file
        (a folder given as the one image source is read as ``--data``)."""
        if self.data:
            return [(Path(self.data), f"--data {self.data}")]
        said = {Path(f).parent: f"{Path(f).parent}, the folder of {f}" for f in self.images if not Path(f).is_dir()}
        return [*((Path(f), f"the image folder {f}") for f in self.images if Path(f).is_dir()), *said.items()]

    def validate(self) -> None:
        """Raise ``ValueError`` naming the option (its command-line flag) that is out of bounds."""
        if not str(self.output).strip():  # Path("") is the current folder: the files would land where the command ran
            raise ValueError(f"--output must name a folder for the report and figures, got {self.output!r}; give e.g. --output out/analysis")
        blocker = file_in_the_way(self.output)
        if blocker:  # known now, not after the model has run on every image
            raise ValueError(f"--output {self.output} cannot be a folder: {blocker} is a file; give a folder for the report "
                             "and figures, e.g. --output out/analysis")
        inside = next((said for folder, said in self.image_folders() if is_inside(self.output, folder)), None)
        if inside:  # the figures are PNG files: the next run on that folder would read them as images (or a class of them)
            raise ValueError(f"--output {self.output} is inside {inside}: the figures written there would be read as images "
                             "by the next analysis of that folder; give an --output outside it")
        lo, hi = IMG_SIZE_RANGE
        if self.img_size is not None and not lo <= self.img_size <= hi:
            raise ValueError(f"--img-size must be between {lo} and {hi} pixels, got {self.img_size}")
        if self.crop_pct is not None and not CROP_PCT_RANGE[0] <= self.crop_pct <= CROP_PCT_RANGE[1]:
            raise ValueError(f"--crop-pct must be in [{CROP_PCT_RANGE[0]}, {CROP_PCT_RANGE[1]}], got {self.crop_pct}")
        bounds = (("num_images", 0, 100_000), ("batch_size", 1, 4096), ("seed", 0, 2**32 - 1))
        for name, lo, hi in bounds + ((("num_classes", 1, MAX_CLASSES),) if self.num_classes is not None else ()):
            if not lo <= getattr(self, name) <= hi:
                raise ValueError(f"--{name.replace('_', '-')} must be in {lo}..{hi}, got {getattr(self, name)}")


@dataclass
class AnalysisSample:
    """A model and the image batches it is analysed on.

    Attributes:
        model: the network.
        img_size: input side in pixels.
        batches: ``(images (b, 3, S, S), labels (b,) or None)`` in near-equal batches.
        labels: all labels ``(B,)`` (the folder's: its classes in sorted order), or None for unlabelled images.
        classes: class names of a labelled folder, or None.
        info: the model's preprocessing and class names (:func:`load_analysis_model`).
    """

    model: nn.Module
    img_size: int
    batches: list[tuple[torch.Tensor, torch.Tensor | None]]
    labels: torch.Tensor | None
    classes: list[str] | None
    info: ModelInfo

    @property
    def num_images(self) -> int:
        return sum(x.shape[0] for x, _ in self.batches)


@dataclass
class HeadsRun:
    """What :func:`run_heads` computed and wrote (``report`` is the content of ``json_path``)."""

    blocks: list[BlockSimilarity]
    report: dict[str, Any]
    json_path: Path
    plots: list[Path]


@dataclass
class TaylorRun:
    """What :func:`run_taylor` computed and wrote.

    Attributes:
        blocks: per-block importances. kept: :func:`~cgavit.analysis.taylor.kept_fraction`'s result.
        targets: ``"labels"`` (folder labels) or ``"predictions"`` (the model's own arg-max); why is in the
            report's ``loss_targets_reason``.
        report: the content of ``json_path``. plots: figures written.
    """

    blocks: list[BlockImportance]
    kept: dict[str, Any]
    targets: str
    report: dict[str, Any]
    json_path: Path
    plots: list[Path]


def load_analysis_model(cfg: AnalysisConfig) -> tuple[nn.Module, ModelInfo]:
    """The model to analyse and how to feed it and read its classes, with ``cfg``'s image size and crop.

    With ``checkpoint`` / ``pretrained`` the model is rebuilt as :func:`cgavit.load_model`
    does (files trained here record their architecture, image size, preprocessing and class names);
    otherwise a randomly initialised ``model`` with the given dials is built (ImageNet's mean and std,
    no class names).
    """
    if cfg.checkpoint or cfg.pretrained:
        if cfg.checkpoint and cfg.pretrained:
            raise ValueError("give --checkpoint FILE or --pretrained, not both")
        if cfg.num_classes is not None:
            raise ValueError("--num-classes is for randomly initialised models; a checkpoint sets its own class count")
        # built for --img-size as eval, predict and load_model build it (windows and bias tables for that size)
        model, info = load_model(cfg.checkpoint, cfg.model, cfg.dials or None, pretrained=cfg.pretrained,
                                 trust=cfg.trust_checkpoint, img_size=cfg.img_size)
        return model, replace(info, crop_pct=cfg.crop_pct or info.crop_pct)  # info.img_size: the size built for
    log.warning("no --checkpoint: analysing randomly initialised weights")
    size = cfg.img_size or 224
    model = create_model(cfg.model or "efficientvit_m0", num_classes=cfg.num_classes or 1000, img_size=size, **cfg.dials)
    return model, ModelInfo(class_names(model.num_classes), img_size=size, crop_pct=cfg.crop_pct or 0.875,
                            source="random weights")


def _sources(cfg: AnalysisConfig) -> list[str]:
    if cfg.data and cfg.images:
        raise ValueError("give either --data DIR or image files, not both")
    if not cfg.data and not cfg.images:
        raise ValueError("give --data DIR (class sub-folders or images) or image files")
    return [cfg.data] if cfg.data else list(cfg.images)


def load_sample(cfg: AnalysisConfig) -> AnalysisSample:
    """List the images, seed, build the model, read up to ``num_images`` images and split them into batches.

    Raises:
        ValueError: an option out of bounds (:meth:`AnalysisConfig.validate`), no images (found before the model is
            built or its weights read), or a sample that
            would not fit :data:`MAX_SAMPLE_PIXELS` at the model's image size.
    """
    cfg.validate()
    # the images first: no --data, a folder that is missing or holds no images is said before the weights are read
    # (--pretrained downloads them), not after, nor hidden behind a failed download
    available = len(list_images(_sources(cfg))[0])
    torch.manual_seed(cfg.seed)
    model, info = load_analysis_model(cfg)
    img_size = info.img_size
    count = min(cfg.num_images, available) if cfg.num_images else available
    if count * img_size**2 > MAX_SAMPLE_PIXELS:
        raise ValueError(f"{count} images at {img_size} px are too many to analyse at once; give --num-images "
                         f"{MAX_SAMPLE_PIXELS // img_size**2} or fewer (or a smaller --img-size)")
    if min(count, cfg.batch_size) * img_size**2 > MAX_BATCH_PIXELS:
        raise ValueError(f"--batch-size {cfg.batch_size} at {img_size} px is too large a forward pass; give "
                         f"--batch-size {MAX_BATCH_PIXELS // img_size**2} or fewer")
    x, y, classes = load_images(_sources(cfg), img_size, cfg.num_images, info.crop_pct, cfg.seed, info.mean, info.std,
                                info.interpolation, input_channels(model))  # greyscale for a 1-channel model, as eval
    n = max(1, -(-x.shape[0] // max(cfg.batch_size, 1)))  # near-equal batches (no trailing batch of one)
    batches = list(zip(x.tensor_split(n), y.tensor_split(n) if y is not None else [None] * n))
    return AnalysisSample(model, img_size, batches, y, classes, info)


def plot_title(cfg: AnalysisConfig) -> str:
    """What was analysed, for figure titles: the checkpoint's last path parts, or the variant."""
    if cfg.checkpoint:
        return "(" + "/".join(Path(cfg.checkpoint).parts[-3:]) + ")"
    return f"({cfg.model or 'efficientvit_m0'}{', published' if cfg.pretrained else ', random weights'})"


def report_header(cfg: AnalysisConfig, sample: AnalysisSample) -> dict[str, Any]:
    """The fields every report starts with: model, architecture, weights, image size and count, dials, seed.

    ``model`` is the variant analysed (the name a checkpoint records, which wins over ``--model``), None
    for a file that records none and was given none.
    """
    return dict(
        model=getattr(sample.model, "pretrained_cfg", {}).get("architecture") or None,
        config=asdict(sample.model.cfg),
        checkpoint=cfg.checkpoint or ("published" if cfg.pretrained else None),
        img_size=sample.img_size,
        num_images=sample.num_images,
        dials={k: list(v) if isinstance(v, tuple) else v for k, v in cfg.dials.items()},
        seed=cfg.seed,
    )


#: The figures each analysis (and the ablation study's summary) draws: a previous run's that a run did not draw
#: again are removed, and no other file.
FIGURES = {
    "heads": ("heads_matrices.png", "heads_mean.png"),
    "taylor": ("taylor_spread.png", "taylor_pruning.png"),
    "ablation": ("ablation_top1.png", "ablation_heads.png", "ablation_speed_accuracy.png"),
}


def write_outputs(
    out: Path, name: str, report: dict[str, Any], draw: Callable[[Path], list[Path]], texts: dict[str, str] | None = None
) -> tuple[Path, list[Path]]:
    """Write one analysis's figures, its report ``NAME.json`` and ``texts`` (file name -> text) into ``out`` as one
    set; returns the report's and the figures' paths.

    ``draw(folder)`` draws the figures into a temporary folder inside ``out``, the report and texts are written
    beside them, and all are moved into place together (:func:`~cgavit.io.replace_together`), a previous run's
    figures that this run did not draw (:data:`FIGURES`) removed in the same step: an error or an
    interruption leaves the previous run's set as it was, and a report always describes the figures
    beside it.

    Raises:
        WriteError: ``out`` or a file in it could not be written.
    """
    report_path = out / f"{name}.json"
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise write_error(report_path, err) from None
    with staging(report_path) as tmp:
        drawn = draw(tmp)
        plots = [out / p.name for p in drawn]
        stale = [out / f for f in FIGURES[name] if out / f not in plots and (out / f).exists()]
        written = [(write_json(tmp / report_path.name, json_ready(report)), report_path)]
        written += [(write_text(tmp / file, text), out / file) for file, text in (texts or {}).items()]
        replace_together([*zip(drawn, plots), *written, *((None, p) for p in stale)])
    return report_path, plots


def run_heads(cfg: AnalysisConfig) -> HeadsRun:
    """Head similarity of every block; writes ``heads.json``, ``heads_matrices.png`` and ``heads_mean.png``.

    The report's ``mean_similarity`` (over blocks of two heads or more and windows of more than one token)
    is None when no block qualifies.
    """
    sample = load_sample(cfg)
    blocks = head_similarity(sample.model, [x for x, _ in sample.batches])
    report = report_header(cfg, sample)
    report.update(mean_similarity=mean_similarity(blocks), blocks=[b.to_dict() for b in blocks])
    report = json_ready(report)
    json_path, plots = write_outputs(Path(cfg.output), "heads", report,
                                     lambda folder: plot_similarity(blocks, folder, title=plot_title(cfg)))
    return HeadsRun(blocks, report, json_path, plots)


def loss_targets(cfg: AnalysisConfig, sample: AnalysisSample, targets: str) -> tuple[torch.Tensor | None, str]:
    """The loss target of each image in the model's class indices (None: its own predictions), and why.

    Folder labels are used (``labels``, or ``auto`` when they fit) in the model's order: by name where
    the weights record class names (every class folder must be one of them: :func:`check_classes` with
    ``subset``; each is mapped to the checkpoint's index of that name), else by index (``auto``: the folder
    must have as many classes as the model; ``labels`` takes fewer as the model's first ones, with a warning: a
    folder of others would be mislabelled). ``auto`` falls back to the predictions, and says why.

    Raises:
        ValueError: ``labels`` for unlabelled images or a folder whose classes the model does not have.
    """
    y, classes, info, n = sample.labels, sample.classes, sample.info, sample.model.num_classes
    if targets == "predictions":
        return None, "--targets predictions"
    if y is None:
        if targets == "labels":
            raise ValueError("--targets labels needs --data DIR with one sub-folder per class")
        return None, "the images have no labels"
    if info.names_recorded:
        try:
            check_classes(cfg.data, classes, info, n, subset=True)
        except ValueError:
            if targets == "labels":
                raise
            named = [c for c in info.class_names if c in classes]
            return None, f"the folder's classes are not the checkpoint's ({class_difference(classes, named)})"
        return model_indices(classes, info)[y], "the folder's class names matched to the checkpoint's"
    if targets == "labels" and len(classes) > n:
        raise ValueError(f"the data has {len(classes)} classes but the model {n}; use --targets predictions or --num-classes")
    if targets == "auto" and len(classes) != n:
        return None, f"the folder has {len(classes)} classes, the model {n}"
    if len(classes) < n:  # --targets labels: the folder's classes can only be taken as the model's first ones
        k, shown = len(classes), ", ".join(classes[:5]) + (", ..." if len(classes) > 5 else "")
        log.warning("the weights record no class names: the folder's %d classes (%s) are taken as the model's classes "
                    "0-%d of %d in sorted order; a folder of other classes is mislabelled: use --targets predictions "
                    "unless these are the model's first %d", k, shown, k - 1, n, k)
        return y, f"by index, as the model's first {len(classes)} of {n} classes: the weights record no class names"
    return y, "by index: the weights record no class names"


def run_taylor(cfg: AnalysisConfig, targets: str = "auto", prune_ratio: float = 0.3, list_pruned: int = 50) -> TaylorRun:
    """Taylor importance of every block's channels; writes ``taylor.json``, ``taylor_spread.png`` and
    ``taylor_pruning.png``.

    Args:
        cfg: model and images.
        targets: loss targets: ``labels`` (the folder's), ``predictions`` (the model's own), or
            ``auto``: labels when they are the model's classes (:func:`loss_targets`).
        prune_ratio: pruning budget, the fraction of Q/K/V/FFN channels removed (least important first).
        list_pruned: how many first-pruned channels the JSON lists.

    Raises:
        ValueError: bad options (no checkpoint or published weights: random weights have no importance), labels
            the model has no classes for, or importances that are all zero
            (:func:`~cgavit.analysis.taylor.taylor_importance`).
    """
    if targets not in TARGETS:
        raise ValueError(f"targets must be one of {TARGETS}, got {targets!r}")
    if not 0.0 <= prune_ratio < 1.0:
        raise ValueError(f"--prune-ratio must be in [0, 1), got {prune_ratio}")
    if list_pruned < 0:
        raise ValueError(f"--list-pruned must be >= 0, got {list_pruned}")
    if not (cfg.checkpoint or cfg.pretrained):  # known before the images are read and the passes run
        raise ValueError("randomly initialised weights have no Taylor importance: the loss gradients are all zero "
                         "(each attention and FFN branch ends in a zero-initialised BatchNorm); give a trained --checkpoint "
                         "or --pretrained")
    sample = load_sample(cfg)
    y, why = loss_targets(cfg, sample, targets)
    parts = y.tensor_split(len(sample.batches)) if y is not None else [None] * len(sample.batches)
    blocks = taylor_importance(sample.model, [(x, t) for (x, _), t in zip(sample.batches, parts)])
    kept = kept_fraction(blocks, prune_ratio)
    report = report_header(cfg, sample)
    report.update(
        loss_targets="labels" if y is not None else "predictions",
        loss_targets_reason=why,
        prune_ratio=prune_ratio,
        kept_fraction={str(s): v for s, v in kept["kept"].items()},  # stages from 0, as every stage field
        no_gradient={b.name: list(b.no_gradient) for b in blocks if b.no_gradient},
        pruned_first=kept["pruned"][:list_pruned],
        pruned_count=len(kept["pruned"]),
        blocks=[b.to_dict() for b in blocks],
    )
    report = json_ready(report)
    json_path, plots = write_outputs(Path(cfg.output), "taylor", report,
                                     lambda folder: plot_importance(blocks, prune_ratio, folder, title=plot_title(cfg)))
    return TaylorRun(blocks, kept, report["loss_targets"], report, json_path, plots)
