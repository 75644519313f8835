"""The EfficientViT network: patch embedding, subsample blocks, stages of sandwich blocks
(:mod:`cgavit.sandwich`), the head, and the checkpoint key names of the official release and of
timm's port (:func:`convert_state_dict`, this model's ``checkpoint_filter_fn``)."""

from __future__ import annotations

import math
import numbers
import operator
import re
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from contextlib import contextmanager

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from .bounds import IMG_SIZE_RANGE, IN_CHANS_RANGE, MAX_CLASSES, MIN_INPUT_SIZE
from .attention import LocalWindowAttention
from .layers import BNLinear, ConvBN, PatchMerging
from .sandwich import SandwichBlock, dw_ffn_pair
from .variants import EfficientViTConfig, pretrained_cfg

PATCH_SIZE = 16


class Stage(nn.Module):
    """Optional subsample block (dw+FFN, patch merging, dw+FFN) followed by sandwich blocks."""

    def __init__(
        self,
        in_dim: int,
        dim: int,
        depth: int,
        window: int,
        downsample: bool,
        ffn_ratio: float,
        drop_paths: list[float],
        **block_kwargs,
    ) -> None:
        super().__init__()
        if downsample:
            self.downsample = nn.Sequential(
                OrderedDict(
                    res1=nn.Sequential(*dw_ffn_pair(in_dim, ffn_ratio, 0.0, dw_bn_init=1.0)),
                    patchmerge=PatchMerging(in_dim, dim),
                    res2=nn.Sequential(*dw_ffn_pair(dim, ffn_ratio, 0.0, dw_bn_init=1.0)),
                )
            )
        else:
            self.downsample = nn.Identity()
        self.blocks = nn.Sequential(
            *[
                SandwichBlock(dim, window, ffn_ratio=ffn_ratio, drop_path=drop_paths[i], **block_kwargs)
                for i in range(depth)
            ]
        )
        self.grad_checkpointing = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.jit.is_scripting() or not (self.grad_checkpointing and torch.is_grad_enabled()
                                            and not torch.jit.is_tracing()):
            return self.blocks(self.downsample(x))
        return self._checkpointed(x)

    @torch.jit.unused  # TorchScript compiles no checkpoint (a scripted model runs the blocks as they are)
    def _checkpointed(self, x: torch.Tensor) -> torch.Tensor:
        """:meth:`forward` keeping only each part's input, the part recomputed in backward."""
        compiling = _compiling()  # dynamo takes no context_fn; its recompute mutates no buffer
        for part in (self.downsample, *self.blocks):
            # keep only this part's input; recompute its inside during backward
            x = (checkpoint(part, x, use_reentrant=False) if compiling else
                 checkpoint(part, x, use_reentrant=False, context_fn=lambda p=part: (_nothing(), _bn_stats_frozen(p))))
        return x


def _compiling() -> bool:
    """Whether torch.compile is tracing this call (``torch.compiler.is_compiling``, torch >= 2.3; dynamo's own before)."""
    check = getattr(torch.compiler, "is_compiling", None)
    if check is None:
        from torch import _dynamo  # torch 2.1-2.2

        check = _dynamo.is_compiling
    return check()


@contextmanager
def _nothing() -> Iterator[None]:
    yield


@contextmanager
def _bn_stats_frozen(module: nn.Module) -> Iterator[None]:
    """While a checkpointed part is recomputed for backward, its BatchNorms must not count the batch
    a second time: momentum 0 leaves the running statistics as the forward pass left them."""
    norms = [m for m in module.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.training]
    saved = [(m.momentum, None if m.num_batches_tracked is None else m.num_batches_tracked.clone()) for m in norms]
    for m in norms:
        m.momentum = 0.0
    try:
        yield
    finally:
        for m, (momentum, tracked) in zip(norms, saved):
            m.momentum = momentum
            if tracked is not None:
                m.num_batches_tracked.copy_(tracked)


def stage_resolution(size: int, stage: int) -> int:
    """Feature-map side after the patch embedding and ``stage`` stride-2 subsamples."""
    r = size
    for _ in range(4):  # four 3x3 stride-2 convs, padding 1
        r = (r - 1) // 2 + 1
    for _ in range(stage):
        r = (r - 1) // 2 + 1
    return r


def check_image_batch(x: object, name: str = "images") -> None:
    """Raise ``ValueError`` unless ``x`` is a float tensor ``(B, C, H, W)``: not a numpy array, a single image, or
    uint8 pixels straight from a decoder (``name`` says which images, for the message)."""
    if not isinstance(x, torch.Tensor):
        hint = ": torch.from_numpy(x)" if type(x).__module__ == "numpy" else ""
        raise ValueError(f"expected a torch.Tensor batch of {name}, got {type(x).__name__}{hint}")
    if x.ndim != 4:
        hint = "; add a batch dimension with x.unsqueeze(0)" if x.ndim == 3 else ""
        raise ValueError(f"expected a 4-D batch of {name} (B, C, H, W), got shape {tuple(x.shape)}{hint}")
    if not x.is_floating_point():
        raise ValueError(f"expected float {name} (normalised), got {x.dtype}; convert them, e.g. "
                         "x.float() / 255, then subtract the mean and divide by the std")


def _autocast_on(device_type: str) -> bool:
    """Whether ``torch.autocast`` is on for ``device_type`` (False for a type autocast does not know, e.g. meta)."""
    try:
        return torch.is_autocast_enabled(device_type)
    except RuntimeError:  # "unknown device type for autocast"
        return False
    except TypeError:  # torch < 2.4 takes no device type
        return torch.is_autocast_cpu_enabled() if device_type == "cpu" else torch.is_autocast_enabled()


def _count(value: object, name: str, low: int, high: int | None = None) -> int:
    """``value`` as a whole number in ``low..high`` (ints and numpy integers; not bools, floats or text)."""
    if isinstance(value, bool):
        raise ValueError(f"{name} must be a whole number, got {value!r}")
    try:
        number = operator.index(value)
    except TypeError:
        raise ValueError(f"{name} must be a whole number, got {value!r} ({type(value).__name__})") from None
    if number < low:
        raise ValueError(f"{name} must be >= {low}, got {number}")
    if high is not None and number > high:  # what a saved file may record: a larger network could not be loaded
        raise ValueError(f"{name} must be <= {high}, got {number}")
    return number


def _check_build_args(
    cfg: EfficientViTConfig, num_classes: object, in_chans: object, img_size: object, drop_path_rate: object,
    distillation: object = False,
) -> tuple[int, int, tuple[int, int], float]:
    """``(num_classes, in_chans, (H, W), drop_path_rate)`` checked and normalised; ``ValueError``
    naming the argument otherwise (the config checks itself when it is made)."""
    if not isinstance(cfg, EfficientViTConfig):
        raise ValueError(f"cfg must be an EfficientViTConfig, got {type(cfg).__name__}")
    num_classes = _count(num_classes, "num_classes", 0, MAX_CLASSES)
    in_chans = _count(in_chans, "in_chans", *IN_CHANS_RANGE)
    img_hw = image_size_pair(img_size)
    if not isinstance(distillation, bool):  # a truthy "no" or "False" would add a head
        raise ValueError(f"distillation must be True or False, got {distillation!r}")
    return num_classes, in_chans, img_hw, _rate(drop_path_rate, "drop_path_rate")


def image_size_pair(img_size: object) -> tuple[int, int]:
    """``img_size``, one side or ``(H, W)``, as ``(H, W)`` of whole numbers in :data:`~cgavit.bounds.IMG_SIZE_RANGE`;
    ``ValueError`` otherwise."""
    sizes = [img_size, img_size] if not isinstance(img_size, (tuple, list)) else list(img_size)
    if len(sizes) != 2:
        raise ValueError(f"img_size must be an int or (H, W), got {img_size!r}")
    return tuple(_count(s, "img_size", *IMG_SIZE_RANGE) for s in sizes)


def _rate(value: object, name: str) -> float:
    """``value`` as a probability in [0, 1); ``ValueError`` naming ``name`` otherwise."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a number in [0, 1), got {value!r} ({type(value).__name__})")
    if not (math.isfinite(value) and 0.0 <= value < 1.0):
        raise ValueError(f"{name} must be in [0, 1), got {value!r}")
    return float(value)


def floating_dtype(dtype: object) -> torch.dtype | None:
    """``dtype`` if it is None or a floating-point ``torch.dtype``; ``ValueError`` otherwise."""
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise ValueError(f"dtype must be a floating-point torch.dtype such as torch.bfloat16, got {dtype!r}")
    return dtype


def _checked_pool(global_pool: object, num_classes: int) -> str:
    """``global_pool`` if it is ``"avg"``, or ``""`` for a model without a classifier; ValueError otherwise."""
    if global_pool not in ("avg", ""):
        raise ValueError(f"global_pool must be 'avg' (pooled) or '' (the last stage's map, no classifier), got "
                         f"{global_pool!r}")
    if not global_pool and num_classes:
        raise ValueError(f"a classifier needs pooled features: global_pool='' only with num_classes=0, got "
                         f"{num_classes} classes; give global_pool='avg' for a classifier")
    return global_pool


def _patch_embed(in_chans: int, dim: int) -> nn.Sequential:
    """Four 3x3 stride-2 Conv-BN (C/8, C/4, C/2, C) with ReLU between: 16x down."""
    return nn.Sequential(
        OrderedDict(
            conv1=ConvBN(in_chans, dim // 8, 3, 2, 1),
            relu1=nn.ReLU(),
            conv2=ConvBN(dim // 8, dim // 4, 3, 2, 1),
            relu2=nn.ReLU(),
            conv3=ConvBN(dim // 4, dim // 2, 3, 2, 1),
            relu3=nn.ReLU(),
            conv4=ConvBN(dim // 2, dim, 3, 2, 1),
        )
    )


def stage_window(cfg: EfficientViTConfig, i: int, img_hw: tuple[int, int]) -> int:
    """Stage ``i``'s attention window for a network built for ``img_hw`` images: the official
    ``min(window_size, stage resolution)``, the resolution being the smaller side's."""
    return min(cfg.window_size[i], *(stage_resolution(s, i) for s in img_hw))


def _stage(cfg: EfficientViTConfig, i: int, img_hw: tuple[int, int], drop_paths: list[float]) -> Stage:
    """Stage ``i`` with its window for ``img_hw`` (:func:`stage_window`)."""
    return Stage(
        in_dim=cfg.embed_dim[max(i - 1, 0)],
        dim=cfg.embed_dim[i],
        depth=cfg.depth[i],
        window=stage_window(cfg, i, img_hw),
        downsample=i > 0,
        ffn_ratio=cfg.ffn_ratio,
        drop_paths=drop_paths,
        ffn_per_side=cfg.ffn_per_side,
        key_dim=cfg.key_dim[i],
        num_heads=cfg.num_heads[i],
        value_dim=cfg.value_dim(i),
        kernels=cfg.kernels,
        cascade=cfg.cascade,
        group_split=cfg.group_split,
    )


def stage_indices(indices: int | list[int] | tuple[int, ...] | None, n: int) -> list[int]:
    """The stage numbers ``indices`` asks for among ``n`` stages, as :meth:`EfficientViT.forward_intermediates` reads
    it (None: all; an int k: the last k; a list: those, negative from the end), sorted and non-negative;
    ``ValueError`` otherwise."""
    if indices is None:
        return list(range(n))
    if isinstance(indices, int) and not isinstance(indices, bool):
        if not 1 <= indices <= n:
            raise ValueError(f"indices as an int means 'the last n stages', 1..{n}; got {indices}")
        return list(range(n - indices, n))
    given = [] if isinstance(indices, (str, bytes)) or not hasattr(indices, "__iter__") else list(indices)
    if not given or any(isinstance(i, bool) or not hasattr(i, "__index__") for i in given):
        raise ValueError(f"indices must be an int n (the last n stages) or a non-empty list of stage numbers "
                         f"{-n}..{n - 1}, got {indices!r}")
    given = [operator.index(i) for i in given]  # numpy's integers too, as timm takes them
    if any(not -n <= i < n for i in given):
        raise ValueError(f"stage indices must be in {-n}..{n - 1}, got {indices}")
    return sorted({i % n for i in given})


class DefaultCfgName:
    """``default_cfg``, timm's older name for a model's ``pretrained_cfg`` (the same dict; code written for timm < 0.9
    reads it, and timm's feature wrappers carry it too): one home for :class:`EfficientViT` and :class:`FeatureMaps`,
    each of which lists it in ``__jit_unused_properties__``."""

    @property
    def default_cfg(self) -> dict:
        return self.pretrained_cfg

    @default_cfg.setter
    def default_cfg(self, value: dict) -> None:
        self.pretrained_cfg = value


class EfficientViT(DefaultCfgName, nn.Module):
    """EfficientViT (Liu et al., CVPR 2023): a three-stage cascaded-group-attention network.

    Args:
        cfg: architecture and design dials (see :class:`~cgavit.variants.EfficientViTConfig`).
        num_classes: classifier outputs; 0 gives a feature extractor with an identity head.
        in_chans: input image channels. Default 3.
        img_size: the size the model is built for, an int or ``(H, W)``; it sets each stage's
            attention window to ``min(window, stage resolution)`` as the official code does.
            Any other size >= 32 px also runs. Default 224.
        distillation: add a DeiT-style distillation head (outputs averaged in eval mode).
        drop_path_rate: stochastic depth, rising linearly over the sandwich blocks. Default 0.
        name: the registered variant it was built from (recorded in ``pretrained_cfg``).
        global_pool: ``"avg"`` (default), or ``""`` (no pooling: :meth:`forward_head` and ``forward`` give the last
            stage's map ``(B, C3, h, w)``, as in timm; only without a classifier, ``num_classes=0``).
        drop_rate: dropout before the classifier's linear layer while training, as timm's ``drop_rate``. Default 0
            (the paper's recipe has none).
        device, dtype: where and in what floating-point type the parameters live, as in timm and torch's
            layers (the model is built, then moved). Default: torch's defaults.

    Attributes:
        pretrained_cfg: timm's per-model preprocessing record (input size, mean, std, crop_pct,
            interpolation, classes), so ``timm.data.resolve_data_config({}, model=m)`` works; ``default_cfg`` is
            the same dict, by timm's older name.
        feature_info: channels and stride of each stage, for feature extraction.
    """

    #: ``"avg"`` or ``""`` (see ``global_pool`` above); a class default too, for a model pickled whole before it existed
    global_pool = "avg"  # not annotated: TorchScript would read the annotation, a string here, as the type
    #: the classifier's dropout (``drop_rate`` above); a class default for the same reason
    drop_rate = 0.0
    #: with a distillation head, whether training-mode outputs are the pair of heads' logits (the official code's, the
    #: default) or their mean, as eval mode gives (timm's ``set_distilled_training``); a class default for old pickles
    distilled_training = True
    #: properties TorchScript leaves out of a scripted model (timm's records, not part of the computation)
    __jit_unused_properties__ = ["default_cfg"]

    def __init__(
        self,
        cfg: EfficientViTConfig,
        num_classes: int = 1000,
        in_chans: int = 3,
        img_size: int | tuple[int, int] = 224,
        distillation: bool = False,
        drop_path_rate: float = 0.0,
        name: str = "",
        global_pool: str = "avg",
        drop_rate: float = 0.0,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        num_classes, in_chans, img_hw, drop_path_rate = _check_build_args(
            cfg, num_classes, in_chans, img_size, drop_path_rate, distillation
        )
        self.global_pool = _checked_pool(global_pool, num_classes)
        self.drop_rate = _rate(drop_rate, "drop_rate")
        dtype = floating_dtype(dtype)
        self.cfg = cfg
        self.img_size = img_hw
        self.in_chans = in_chans
        self.num_classes = num_classes
        self.num_features = self.head_hidden_size = cfg.embed_dim[-1]
        self.patch_embed = _patch_embed(in_chans, cfg.embed_dim[0])
        total_blocks = sum(cfg.depth)
        rates = [drop_path_rate * i / max(total_blocks - 1, 1) for i in range(total_blocks)]
        stages = [_stage(cfg, i, img_hw, rates[sum(cfg.depth[:i]) : sum(cfg.depth[: i + 1])]) for i in range(3)]
        self.feature_info = [
            dict(num_chs=cfg.embed_dim[i], reduction=PATCH_SIZE * 2**i, module=f"stages.{i}") for i in range(3)
        ]
        self.stages = nn.Sequential(*stages)
        self.distillation = distillation
        self.distilled_training = True  # an instance attribute too: TorchScript reads no class attribute
        self.head = BNLinear(self.num_features, num_classes, drop=self.drop_rate) if num_classes > 0 else nn.Identity()
        self.head_dist = (
            BNLinear(self.num_features, num_classes, drop=self.drop_rate) if distillation and num_classes > 0 else None
        )
        self.pretrained_cfg = pretrained_cfg(name, num_classes, img_hw, in_chans)
        if device is not None or dtype is not None:
            self.to(device=device, dtype=dtype)

    # ----------------------------------------------------------------------------- interface
    def check_input(self, x: torch.Tensor) -> None:
        """Raise ``ValueError`` unless ``x`` is a float image batch ``(B, in_chans, H>=32, W>=32)`` of the weights'
        dtype (any float dtype under ``torch.autocast``; a symbolic
        trace's ``torch.fx.Proxy`` passes: its shape is not known yet)."""
        if isinstance(x, torch.fx.Proxy):
            return
        check_image_batch(x)
        if x.shape[1] != self.in_chans:
            raise ValueError(
                f"expected {self.in_chans} input channels, got {x.shape[1]} (shape {tuple(x.shape)}); "
                "convert the images (e.g. PIL .convert('RGB')) or build with in_chans="
                f"{x.shape[1]}"
            )
        if x.shape[2] < MIN_INPUT_SIZE or x.shape[3] < MIN_INPUT_SIZE:
            raise ValueError(
                f"images must be at least {MIN_INPUT_SIZE}x{MIN_INPUT_SIZE} pixels, got "
                f"{x.shape[2]}x{x.shape[3]}; resize them up first"
            )
        weight = next(self.parameters(), None)
        if weight is not None and x.dtype != weight.dtype and not _autocast_on(x.device.type):
            raise ValueError(f"the images are {x.dtype} and the model's weights {weight.dtype}; convert one to the "
                             f"other (x.to({weight.dtype}) or model.to({x.dtype})), or run under torch.autocast")

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        """Image batch ``(B, 3, H, W)`` to the last stage's map: ``(B, C3, ~H/64, ~W/64)`` (fewer stages once
        :meth:`prune_intermediate_layers` removed some)."""
        if not torch.jit.is_scripting():  # TorchScript compiles no Python check
            self.check_input(x)
            self._check_trainable_batch(x, len(self.stages))
        return self.stages(self.patch_embed(x))

    def forward_intermediates(
        self,
        x: torch.Tensor,
        indices: int | list[int] | tuple[int, ...] | None = None,
        norm: bool = False,
        stop_early: bool = False,
        output_fmt: str = "NCHW",
        intermediates_only: bool = False,
    ) -> list[torch.Tensor] | tuple[torch.Tensor, list[torch.Tensor]]:
        """The stage maps at strides 16/32/64 (``indices`` selects; an int n = the last n), with timm's signature.

        Returns ``(final features, maps)``, as timm's models do, or the list of maps alone with
        ``intermediates_only=True``. ``stop_early`` stops after the last stage asked for (the final features are
        then that stage's map). ``norm`` and ``output_fmt`` are timm's keywords, so its feature wrappers
        (``FeatureGetterNet``) take the model: the network has no final norm to apply (``norm`` changes nothing,
        as in timm's port), and its maps are NCHW.
        """
        if output_fmt != "NCHW":
            raise ValueError(f"output_fmt must be 'NCHW' (the maps are convolutional), got {output_fmt!r}")
        self.check_input(x)
        take = self._stage_indices(indices)
        last = max(take) if stop_early else len(self.stages) - 1
        self._check_trainable_batch(x, last + 1)
        x = self.patch_embed(x)
        maps = []
        for i, stage in enumerate(self.stages):
            if i > last:
                break
            x = stage(x)
            if i in take:
                maps.append(x)
        return maps if intermediates_only else (x, maps)

    def _one_training_image(self, x: torch.Tensor) -> bool:
        """Whether ``x`` is a batch of one image run eagerly in training mode, the case the two checks below look at."""
        return self.training and not isinstance(x, torch.fx.Proxy) and not _compiling() and x.shape[0] == 1

    def _check_trainable_batch(self, x: torch.Tensor, stages: int) -> None:
        """Raise ``ValueError`` for one image that the first ``stages`` stages cannot train on: in training mode a
        BatchNorm normalises each channel over the batch and the map, and a lone image small enough (up to 64 px a
        side) gives the last of them a 1x1 map, one value (torch's error named a shape the caller never gave)."""
        if not self._one_training_image(x):
            return
        side = [stage_resolution(int(n), stages - 1) for n in x.shape[2:]]
        norms = [m for m in self.stages[:stages].modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
        if side == [1, 1] and any(m.training for m in norms):
            raise ValueError(f"one {x.shape[2]}x{x.shape[3]} image cannot be trained on alone: stage {stages - 1}'s "
                             "map is 1x1, one value per channel for its BatchNorm to normalise; train on batches of 2 "
                             "or more, or on larger images, or call model.eval() to run it")

    def _check_trainable_head(self, x: torch.Tensor) -> None:
        """Raise ``ValueError`` for features of one image that the classifier cannot train on: its BatchNorm1d
        normalises each feature over the batch, and one image gives one value (torch's error named a (1, C) shape)."""
        if not self._one_training_image(x):
            return
        if isinstance(self.head, BNLinear) and self.head.bn.training:
            raise ValueError("a batch of one image cannot train the classifier: its BatchNorm1d normalises each "
                             "feature over the batch; train on batches of 2 or more (a DataLoader's drop_last=True "
                             "drops a last batch of one), or call model.eval() to run it")

    def _pooled_already(self, x: torch.Tensor) -> bool:
        """Whether ``x``, given to :meth:`forward_head`, is pooled features ``(B, C3)`` rather than the map
        ``(B, C3, h, w)`` (a symbolic trace's ``torch.fx.Proxy``: the map); ``ValueError`` for anything else (torch
        raised an IndexError, or a BatchNorm's 'running_mean should contain ... elements')."""
        if isinstance(x, torch.fx.Proxy):
            return False
        c = self.num_features
        if not isinstance(x, torch.Tensor) or x.dim() not in (2, 4) or x.shape[1] != c:
            got = f"shape {tuple(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"forward_head takes the last stage's map (B, {c}, h, w), as forward_features gives it, "
                             f"or its pooled features (B, {c}); got {got}")
        return x.dim() == 2

    def _stage_indices(self, indices: int | list[int] | tuple[int, ...] | None) -> list[int]:
        """The stage numbers ``indices`` asks for (:meth:`forward_intermediates`), sorted and non-negative."""
        return stage_indices(indices, len(self.stages))

    def prune_intermediate_layers(
        self, indices: int | list[int] | tuple[int, ...] = 1, prune_norm: bool = False, prune_head: bool = True
    ) -> list[int]:
        """Make the model a feature extractor for the stages ``indices`` asks for (as :meth:`forward_intermediates`
        reads it), with timm's signature and behaviour (its ``FeatureGetterNet`` calls it): the stages after the last
        of them are removed (``feature_info`` and ``num_features`` follow), and with ``prune_head``, or when stages
        were removed (the classifier read the last one), the classifier and the pooling too (``forward`` then
        gives the last stage's map, as timm's models do). The network has no final norm, so
        ``prune_norm`` changes nothing. Returns those stage numbers, non-negative and sorted.

        Raises:
            ValueError: bad ``indices``.
        """
        take = self._stage_indices(indices)
        last = max(take)
        pruned = last < len(self.stages) - 1
        if pruned:
            self.stages = self.stages[: last + 1]
            self.feature_info = self.feature_info[: last + 1]
            self.num_features = self.head_hidden_size = self.cfg.embed_dim[last]
        if prune_head or pruned:
            self.reset_classifier(0, "")
        return take

    def forward_head(
        self, x: torch.Tensor, pre_logits: bool = False
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Pool a stage-3 map ``(B, C3, h, w)`` and classify; features pooled already, ``(B, C3)`` (what
        ``pre_logits`` gives), are classified as they are.

        Returns the logits ``(B, classes)``; ``(B, C3)`` pooled features with ``pre_logits``; the input itself
        with ``global_pool=""``; and,
        for a model with a distillation head in training mode, the pair ``(class logits,
        distillation logits)`` (averaged into one tensor in eval mode, or after ``set_distilled_training(False)``).

        Raises:
            ValueError: a tensor of another shape.
        """
        if not torch.jit.is_scripting():  # TorchScript compiles no Python check
            pooled = self._pooled_already(x)
        else:
            pooled = x.dim() == 2
        if not self.global_pool:  # no pooling, no classifier: the map
            return x
        if not pooled:
            x = x.mean((2, 3))  # (B, C3)
        if pre_logits:
            return x
        if not torch.jit.is_scripting():  # TorchScript compiles no Python check
            self._check_trainable_head(x)
        if self.head_dist is None:
            return self.head(x)
        out, out_dist = self.head(x), self.head_dist(x)
        if self.training and self.distilled_training and not torch.jit.is_tracing():
            return out, out_dist
        return (out + out_dist) / 2

    def forward(self, x: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Logits ``(B, classes)``; the pair of heads' logits when distilling in training mode (unless
        :meth:`set_distilled_training` turned it off)."""
        return self.forward_head(self.forward_features(x))

    def get_classifier(self) -> nn.Module:
        """The classifier's ``nn.Linear`` (as in timm: ``.in_features``, ``.weight``), or Identity without classes.
        The whole head, BatchNorm1d + Linear, is ``model.head``."""
        return self.head.linear if isinstance(self.head, BNLinear) else self.head

    @torch.jit.ignore
    def group_matcher(self, coarse: bool = False) -> dict:
        """Parameter-name patterns grouping the network into stem and blocks, as timm's layer-wise
        learning-rate decay expects (coarse: one group per stage; fine: each stage's subsample block,
        then each sandwich block)."""
        if coarse:
            return dict(stem=r"^patch_embed", blocks=r"^stages\.(\d+)")
        return dict(
            stem=r"^patch_embed",
            blocks=[(r"^stages\.(\d+)\.downsample", (0,)), (r"^stages\.(\d+)\.blocks\.(\d+)", None)],
        )

    @torch.jit.ignore
    def set_distilled_training(self, enable: bool = True) -> None:
        """timm's switch for distilled models: ``False`` makes a model with a distillation head give the mean of its
        two heads' logits in training mode too (one tensor, for a loss that takes no pair; the distillation head then
        learns the class labels as the class head does); ``True`` (the default) gives the pair, as the official code
        does. No effect on a model without a distillation head."""
        if not isinstance(enable, bool):
            raise ValueError(f"enable must be True or False, got {enable!r}")
        self.distilled_training = enable

    @torch.jit.ignore
    def set_grad_checkpointing(self, enable: bool = True) -> None:
        """Activation checkpointing: keep only each subsample and sandwich block's input during the
        forward pass and recompute the block in backward. Same gradients and BatchNorm statistics,
        less memory, about one more forward pass of compute."""
        for stage in self.stages:
            stage.grad_checkpointing = enable

    def reset_classifier(self, num_classes: int, global_pool: str | None = None) -> None:
        """Replace the classifier (and distillation head) with fresh ones for ``num_classes``; ``global_pool``
        ``"avg"`` or ``""`` (timm's ``reset_classifier(0, "")``: no pooling, the last stage's map), None: as it was.

        Raises:
            ValueError: a bad class count, another pooling, or ``""`` with a classifier.
        """
        num_classes = _count(num_classes, "num_classes", 0, MAX_CLASSES)
        self.global_pool = _checked_pool(self.global_pool if global_pool is None else global_pool, num_classes)
        self.num_classes = num_classes
        self.pretrained_cfg = dict(self.pretrained_cfg, num_classes=num_classes)
        ref = next(self.parameters())

        def fresh() -> nn.Module:  # the model's device, dtype and mode (an eval-mode model gets an eval-mode head)
            head = BNLinear(self.num_features, num_classes, drop=self.drop_rate)
            return head.to(device=ref.device, dtype=ref.dtype).train(self.training)

        self.head = fresh() if num_classes > 0 else nn.Identity()
        self.head_dist = fresh() if self.distillation and num_classes > 0 else None

    def set_input_size(self, img_size: int | tuple[int, int] | None = None) -> None:
        """Make this the model built for ``img_size`` images, as timm's ``set_input_size``: each stage's window
        becomes ``min(window_size, stage resolution)`` for that size, and the attention-bias tables whose window
        changes are resized (bicubic). The result equals :func:`~cgavit.create_model` with ``img_size`` given
        these weights (None, as in timm: the size it is built for now). Works on the model as built or fused (:func:`cgavit.deploy.fuse`); call it before a fast
        path converts the model and before an optimizer is made (a resized table is a new parameter).

        Raises:
            ValueError: a bad size, or a model whose attention modules a fast path replaced.
        """
        img_size = self.img_size if img_size is None else img_size
        _, _, img_hw, _ = _check_build_args(self.cfg, self.num_classes, self.in_chans, img_size, 0.0)
        stages = [[m for m in stage.modules() if isinstance(m, LocalWindowAttention)] for stage in self.stages]
        if [len(attentions) for attentions in stages] != list(self.cfg.depth[: len(stages)]):
            raise ValueError("set_input_size needs the model's attention modules as built or fused; call it before "
                             "a fast path (cgavit.fast, optimize) converts them")
        for i, attentions in enumerate(stages):
            for attention in attentions:
                attention.set_window(stage_window(self.cfg, i, img_hw))
        self.img_size = img_hw
        self.pretrained_cfg = dict(self.pretrained_cfg, input_size=(self.in_chans, *img_hw))

    @torch.jit.ignore
    def no_weight_decay(self) -> set[str]:
        """Parameter names exempt from weight decay (the attention bias tables)."""
        return {n for n, _ in self.named_parameters() if n.endswith("attention_biases")}


class FeatureInfo(list):
    """The stages a :class:`FeatureMaps` gives, one dict each (``num_chs``, ``reduction``, ``module``), with the
    accessors of timm's ``FeatureInfo`` that necks read, as timm reads them: ``channels()``, ``reduction()``,
    ``module_name()``, ``get(key)`` and ``get_dicts()`` give the stages given; with ``idx`` (a stage number, or a list
    of them) they give those stages of the whole network whatever ``out_indices`` is, as timm's do (with
    ``out_indices=(1, 2)``, ``channels(0)`` is stage 0's). The list itself holds the stages given.

    Args:
        stages: the network's stages' dicts, all of them (``info``).
        out_indices: the stage numbers given, non-negative and sorted.
    """

    def __init__(self, stages: list[dict], out_indices: list[int]) -> None:
        super().__init__(stages[i] for i in out_indices)
        self.info = list(stages)
        self.out_indices = tuple(out_indices)

    def channels(self, idx: int | list[int] | None = None) -> list[int] | int:
        return self.get("num_chs", idx)

    def reduction(self, idx: int | list[int] | None = None) -> list[int] | int:
        return self.get("reduction", idx)

    def module_name(self, idx: int | list[int] | None = None) -> list[str] | str:
        return self.get("module", idx)

    def get(self, key: str, idx: int | list[int] | None = None) -> list | int | str:
        """``key`` of each stage given (``idx`` None), or of stage ``idx`` of the network (a list: of each)."""
        if idx is None:
            return [info[key] for info in self]
        if isinstance(idx, (list, tuple)):
            return [self.info[i][key] for i in idx]
        return self.info[idx][key]

    def get_dicts(self, keys: list[str] | None = None, idx: int | list[int] | None = None) -> list[dict] | dict:
        """The dicts of the stages given (``idx`` None) or of stage(s) ``idx`` of the network, cut to ``keys``."""
        def cut(info: dict) -> dict:
            return dict(info) if keys is None else {k: info[k] for k in keys}

        if idx is None:
            return [cut(info) for info in self]
        if isinstance(idx, (list, tuple)):
            return [cut(self.info[i]) for i in idx]
        return cut(self.info[idx])


class FeatureMaps(DefaultCfgName, nn.Module):
    """timm's ``features_only`` form of a model (``create_model(..., features_only=True)``): ``forward`` gives the
    list of the maps of the stages ``out_indices`` asks for (as :meth:`EfficientViT.forward_intermediates` reads
    it), finest first, as timm's ``FeatureGetterNet`` does; the stages after the last of them and the classifier are
    removed from ``model`` (:meth:`EfficientViT.prune_intermediate_layers`).

    Attributes:
        model: the pruned network (its state dict keys are this module's, under ``model.``, as in timm).
        feature_info: a :class:`FeatureInfo` of the stages given.
        out_indices: those stage numbers, non-negative and sorted.
    """

    __jit_unused_properties__ = ["pretrained_cfg", "default_cfg"]

    def __init__(self, model: EfficientViT, out_indices: int | list[int] | tuple[int, ...] = (0, 1, 2)) -> None:
        super().__init__()
        if not isinstance(model, EfficientViT):
            raise ValueError(f"FeatureMaps takes an EfficientViT, got {type(model).__name__}")
        stages = list(model.feature_info)  # the whole network's, before pruning cuts them
        self.out_indices = model.prune_intermediate_layers(out_indices)
        self.model = model
        self.feature_info = FeatureInfo(stages, self.out_indices)
        self.in_chans = model.in_chans

    @property
    def pretrained_cfg(self) -> dict:
        """The network's own :attr:`EfficientViT.pretrained_cfg` (read by timm's ``resolve_data_config({}, model=m)``),
        current after ``model.set_input_size`` or any other change to it, not a copy taken at creation."""
        return self.model.pretrained_cfg

    @pretrained_cfg.setter
    def pretrained_cfg(self, value: dict) -> None:
        self.model.pretrained_cfg = value

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        if not torch.jit.is_scripting():  # TorchScript compiles no Python check: the stages below, as they are
            return self.model.forward_intermediates(x, indices=self.out_indices, intermediates_only=True)
        x = self.model.patch_embed(x)
        maps: list[torch.Tensor] = []
        for i, stage in enumerate(self.model.stages):
            x = stage(x)
            if i in self.out_indices:
                maps.append(x)
        return maps


# ---------------------------------------------------------------------------- checkpoint key names
_BLOCK_PARTS = {"dw0": "pre.0", "ffn0": "pre.1", "dw1": "post.0", "ffn1": "post.1"}
_DOWN_PARTS = {0: "downsample.res1", 1: "downsample.patchmerge", 2: "downsample.res2"}


def detect_format(sd: Mapping[str, torch.Tensor]) -> str:
    """``'official'``, ``'timm'`` or ``'cgavit'``, judged by the key names."""
    keys = list(sd)
    if any(k.startswith(("blocks1.", "patch_embed.0.")) for k in keys):
        return "official"
    if any(re.search(r"\.(dw0|ffn0|dw1|ffn1)\.", k) for k in keys):
        return "timm"
    return "cgavit"


def _rename_parts(key: str) -> str:
    parts = key.split(".")
    parts = [{"c": "conv", "l": "linear"}.get(p, p) if i < len(parts) - 1 else p for i, p in enumerate(parts)]
    return ".".join(_BLOCK_PARTS.get(p, p) for p in parts)


def convert_state_dict(sd: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Rename an official or timm state dict to this package's names (own format: unchanged)."""
    fmt = detect_format(sd)
    out: dict[str, torch.Tensor] = {}
    for key, value in sd.items():
        if key.endswith("attention_bias_idxs"):
            continue  # derived from the window; rebuilt by the model
        if fmt == "official":
            m = re.match(r"patch_embed\.(\d+)\.(.*)", key)
            if m:
                key = f"patch_embed.conv{int(m.group(1)) // 2 + 1}.{m.group(2)}"
            m = re.match(r"blocks(\d)\.(\d+)\.(.*)", key)
            if m:
                stage, idx, rest = int(m.group(1)) - 1, int(m.group(2)), m.group(3)
                if stage == 0:
                    key = f"stages.0.blocks.{idx}.{rest}"
                elif idx < 3:
                    key = f"stages.{stage}.{_DOWN_PARTS[idx]}.{rest}"
                else:
                    key = f"stages.{stage}.blocks.{idx - 3}.{rest}"
            key = _rename_parts(key)
        elif fmt == "timm":
            key = _rename_parts(key)
        out[key] = value
    return out


def to_timm_state_dict(sd: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """This package's names to timm's ``efficientvit_msra`` names: the inverse of
    :func:`convert_state_dict` on a timm file (only the sandwich parts are named differently)."""
    theirs = {ours: name for name, ours in _BLOCK_PARTS.items()}
    out = {}
    for key, value in sd.items():
        for ours, name in theirs.items():
            key = key.replace(f".{ours}.", f".{name}.")
        out[key] = value
    return out
