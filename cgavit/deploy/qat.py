"""Quantisation-aware fine-tuning, for when post-training int8 falls short: the export form trained a few
epochs with fake quantisation in the loop, distilled from the fp32 model, then quantised and judged
by :func:`~cgavit.deploy.quantize.quantize` against the *original* fp32 model.

The fake quantisation is torch's PT2E QAT (``torchao.quantization.pt2e``: ``prepare_qat_pt2e``, its
``FakeQuantize`` modules and observers), maintained with PyTorch. It was chosen over NNCF's PyTorch
QAT because NNCF compiles a C++ extension on first use (its load timed out after 60 s on this
project's 2-core machine, and needs a compiler on the user's), while PT2E runs on torch's own ops.
The quantiser here annotates what the runtimes will quantise, and nothing else: every convolution's
input and output (uint8, per tensor, asymmetric) and weight (int8 per output channel, symmetric;
7-bit on CPUs that need it, :mod:`cgavit.deploy.int8`); the attention core and the residual adds
stay float. After training the fine-tuned float weights are quantised by each runtime's own recipe
(calibrated again on the calibration images), so the files are the same kind as post-training ones.

torchao comes with the ``cgavit[qat]`` extra and is imported in one place, :func:`_torchao`.
"""

from __future__ import annotations

import importlib.util
import logging
import time
import warnings
from collections.abc import Iterable
from dataclasses import dataclass, replace
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn

from .cpu import CpuFeatures, cpu_features
from .fusion import export_form, fuse
from .int8 import Int8Options
from .metadata import ExportInfo
from .quantize import QuantizeResult, QuantizeTarget, quantize

log = logging.getLogger(__name__)


def _torchao() -> SimpleNamespace:
    """The one place torchao's PT2E quantisation is imported (the ``cgavit[qat]`` extra)."""
    from torchao.quantization.pt2e import (
        FakeQuantize,
        MovingAverageMinMaxObserver,
        MovingAveragePerChannelMinMaxObserver,
        move_exported_model_to_eval,
        move_exported_model_to_train,
    )
    from torchao.quantization.pt2e.quantize_pt2e import prepare_qat_pt2e
    from torchao.quantization.pt2e.quantizer import QuantizationAnnotation, QuantizationSpec, Quantizer

    return SimpleNamespace(
        FakeQuantize=FakeQuantize, MovingAverageMinMaxObserver=MovingAverageMinMaxObserver,
        MovingAveragePerChannelMinMaxObserver=MovingAveragePerChannelMinMaxObserver, to_eval=move_exported_model_to_eval,
        to_train=move_exported_model_to_train, prepare_qat_pt2e=prepare_qat_pt2e,
        QuantizationAnnotation=QuantizationAnnotation, QuantizationSpec=QuantizationSpec, Quantizer=Quantizer,
    )


def qat_available() -> bool:
    """Whether torchao (PT2E QAT) is installed (checked without importing it)."""
    return importlib.util.find_spec("torchao") is not None


@dataclass(frozen=True)
class QatConfig:
    """How the fake-quantised model is fine-tuned.

    Args:
        epochs: passes over the training images (default 2).
        lr: AdamW learning rate (default 1e-5: the model is trained already).
        batch_size: images per step (default 64).
        temperature: distillation temperature (default 1.0).
        seed: the order of the images and the flips.

    Raises:
        ValueError: a value out of range.
    """

    epochs: int = 2
    lr: float = 1e-5
    batch_size: int = 64
    temperature: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.epochs < 1 or self.batch_size < 1 or not self.lr > 0 or not self.temperature > 0:
            raise ValueError(f"QAT needs epochs and batch_size >= 1, lr and temperature > 0; got {self}")


def conv_quantizer(ao: SimpleNamespace, reduce_range: bool):
    """A PT2E quantiser annotating every ``aten.conv2d``: uint8 per-tensor input and output, int8 (7-bit
    with ``reduce_range``) per-channel symmetric weight, as the runtimes quantise them."""
    qmax = 63 if reduce_range else 127
    act = ao.QuantizationSpec(
        dtype=torch.uint8, quant_min=0, quant_max=255, qscheme=torch.per_tensor_affine,
        observer_or_fake_quant_ctr=ao.FakeQuantize.with_args(
            observer=ao.MovingAverageMinMaxObserver, quant_min=0, quant_max=255, dtype=torch.quint8,
            qscheme=torch.per_tensor_affine))
    weight = ao.QuantizationSpec(
        dtype=torch.int8, quant_min=-qmax, quant_max=qmax, qscheme=torch.per_channel_symmetric, ch_axis=0,
        observer_or_fake_quant_ctr=ao.FakeQuantize.with_args(
            observer=ao.MovingAveragePerChannelMinMaxObserver, quant_min=-qmax, quant_max=qmax, dtype=torch.qint8,
            qscheme=torch.per_channel_symmetric, ch_axis=0))

    class ConvQuantizer(ao.Quantizer):
        def annotate(self, gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
            for node in gm.graph.nodes:
                if node.op == "call_function" and node.target == torch.ops.aten.conv2d.default:
                    node.meta["quantization_annotation"] = ao.QuantizationAnnotation(
                        input_qspec_map={node.args[0]: act, node.args[1]: weight}, output_qspec=act, _annotated=True)
            return gm

        def validate(self, gm: torch.fx.GraphModule) -> None:
            pass

    return ConvQuantizer()


def qat_finetune(
    model: nn.Module, images: torch.Tensor, reduce_range: bool, config: QatConfig = QatConfig(),
) -> nn.Module:
    """``model``'s int8 export form fine-tuned with fake quantisation, distilled from the fp32 model.

    Args:
        model: the trained model (not modified).
        images: training images ``(N, C, H, W)``, preprocessed like the input (randomly flipped here).
        reduce_range: 7-bit weights (what the runtimes will use on this CPU).
        config: the schedule.

    Returns:
        The export form (unfolded residuals) with the fine-tuned float weights, in eval mode.
    """
    ao = _torchao()
    size = tuple(images.shape[2:])
    teacher = fuse(model)
    student = export_form(model, size, fold_residuals=False)
    batch = torch.export.Dim("batch", min=1, max=1 << 16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        graph = torch.export.export(student, (images[:2],), dynamic_shapes=({0: batch},)).module()
        prepared = ao.prepare_qat_pt2e(graph, conv_quantizer(ao, reduce_range))
    _train(ao, prepared, teacher, images, config)
    ao.to_eval(prepared)
    tuned = {k: v for k, v in prepared.state_dict().items() if k in student.state_dict()}
    student.load_state_dict(tuned)
    return student.eval()


def _train(ao: SimpleNamespace, prepared: nn.Module, teacher: nn.Module, images: torch.Tensor, config: QatConfig) -> None:
    """Knowledge distillation: KL divergence between the softened fp32 and fake-quantised outputs."""
    g = torch.Generator().manual_seed(config.seed)
    ao.to_train(prepared)
    for p in prepared.parameters():
        p.requires_grad_(True)
    opt = torch.optim.AdamW(prepared.parameters(), lr=config.lr, weight_decay=0.0)
    steps = config.epochs * -(-len(images) // config.batch_size)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, steps)
    t, start = config.temperature, time.perf_counter()
    for epoch in range(config.epochs):
        total = 0.0
        for idx in torch.randperm(len(images), generator=g).split(config.batch_size):
            x = images[idx]
            flip = torch.rand(len(x), generator=g) < 0.5
            x = torch.where(flip[:, None, None, None], x.flip(3), x)
            with torch.no_grad():
                target = F.log_softmax(teacher(x) / t, dim=1)
            loss = F.kl_div(F.log_softmax(prepared(x) / t, dim=1), target, log_target=True, reduction="batchmean")
            opt.zero_grad()
            (loss * t * t).backward()
            opt.step()
            sched.step()
            total += float(loss.detach()) * len(x)
        log.info("qat: epoch %d/%d, distillation loss %.4g, %.0f s", epoch + 1, config.epochs, total / len(images),
                 time.perf_counter() - start)


def quantize_aware(
    model: nn.Module,
    calibration: torch.Tensor | Iterable[torch.Tensor],
    train_images: torch.Tensor,
    evaluation: torch.Tensor,
    target: QuantizeTarget = QuantizeTarget(),
    runtime: str | None = None,
    *,
    labels: torch.Tensor | None = None,
    config: QatConfig = QatConfig(),
    options: Int8Options = Int8Options(),
    features: CpuFeatures | None = None,
    info: ExportInfo | None = None,
    max_float_layers: int | None = None,
    **timing,
) -> QuantizeResult:
    """:func:`qat_finetune`, then :func:`~cgavit.deploy.quantize.quantize` of the fine-tuned weights,
    judged against ``model`` (the original fp32) on ``evaluation``.

    Args:
        model: the trained model.
        calibration: images the runtimes calibrate on (training images).
        train_images: images to fine-tune on (training images; may include the calibration ones).
        evaluation, target, runtime, labels, options, features, info, max_float_layers: as for
            :func:`quantize` (the search for float layers runs on the fine-tuned weights).
        config: the fine-tuning schedule.
        **timing: ``batch``, ``threads``, ``warmup``, ``repeats`` of :func:`quantize`.

    Raises:
        ValueError: torchao is not installed (``pip install 'cgavit[qat]'``), or as :func:`quantize`.
    """
    if not qat_available():
        raise ValueError("--qat needs torchao (PT2E quantisation-aware training): pip install 'cgavit[qat]'")
    if not isinstance(train_images, torch.Tensor) or train_images.ndim != 4 or not len(train_images):
        raise ValueError("QAT needs training images (N, C, H, W)")
    features = features or cpu_features()
    opts = options.for_cpu(features)
    tuned = qat_finetune(model, train_images.float(), bool(opts.reduce_range), config)
    result = quantize(tuned, calibration, evaluation, target, runtime, labels=labels, options=opts, features=features,
                      info=info, reference=model, sensitivity=False, max_float_layers=max_float_layers, **timing)
    result.method = f"quantization-aware fine-tuning ({config.epochs} epoch(s), PT2E), then post-training"
    result.info = replace(result.info, int8={**result.info.int8, "method": result.method})
    return result
