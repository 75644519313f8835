"""Quantisation-aware fine-tuning, for when post-training int8 falls short: the export form trained a few
epochs with fake quantisation in the loop, distilled from the fp32 model, and written as an int8 ONNX
file that keeps the ranges it learnt, judged by :func:`~cgavit.deploy.quantize.assess` against the
*original* fp32 model in each runtime.

The fake quantisation is torch's PT2E QAT (``torchao.quantization.pt2e``: ``prepare_qat_pt2e``, its
``FakeQuantize`` modules and observers, ``convert_pt2e``), maintained with PyTorch. It was chosen over
NNCF's PyTorch QAT because NNCF compiles a C++ extension on first use (its load timed out after 60 s on
this project's 2-core machine, and needs a compiler on the user's), while PT2E runs on torch's own ops.
The quantiser here annotates what ONNX Runtime runs in int8, and nothing else: every convolution's
input and weight (uint8 per tensor, asymmetric; int8 per output channel, symmetric, 7-bit on CPUs
that need it, :mod:`cgavit.deploy.int8`) and its output, taken after the ReLU when the convolution
feeds one; the attention core and the residual adds stay float. The ranges start from the
calibration images and move with training.

The file is what was trained: ``convert_pt2e`` turns each fake quantiser into a quantise/dequantise
pair with its learnt scale and zero point, and torch's ONNX exporter writes them as
``QuantizeLinear``/``DequantizeLinear``, which ONNX Runtime fuses into int8 kernels and OpenVINO
reads as int8. (Quantising the fine-tuned float weights again with a runtime's own calibration
undid the training: on the 96 px CIFAR-10 reference it kept 95.5 % of decisions against 96.5 % for
post-training int8 of the original weights; BENCHMARKS.md.)

torchao comes with the ``cgavit[qat]`` extra and is imported in one place, :func:`_torchao`.
"""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import io
import logging
import tempfile
import time
import warnings
from collections.abc import Iterable
from dataclasses import dataclass, replace
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn

from ..timing import progress_bar
from .cpu import CpuFeatures, cpu_features
from .fusion import export_form, fuse
from .int8 import Int8Options
from .metadata import ExportInfo, export_info
from .onnx import with_onnx_metadata
from .quantize import QuantizeResult, QuantizeTarget, assess, check_held_out

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
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_qat_pt2e
    from torchao.quantization.pt2e.quantizer import QuantizationAnnotation, QuantizationSpec, Quantizer

    return SimpleNamespace(
        FakeQuantize=FakeQuantize, MovingAverageMinMaxObserver=MovingAverageMinMaxObserver,
        MovingAveragePerChannelMinMaxObserver=MovingAveragePerChannelMinMaxObserver, to_eval=move_exported_model_to_eval,
        to_train=move_exported_model_to_train, prepare_qat_pt2e=prepare_qat_pt2e, convert_pt2e=convert_pt2e,
        QuantizationAnnotation=QuantizationAnnotation, QuantizationSpec=QuantizationSpec, Quantizer=Quantizer,
    )


def require_qat() -> None:
    """Raise ``ValueError`` saying what to install when torchao is missing (:func:`qat_available`)."""
    if not qat_available():
        raise ValueError("--qat needs torchao (PT2E quantisation-aware training): pip install 'cgavit[qat]'")


def qat_available() -> bool:
    """Whether torchao (PT2E QAT) is installed (checked without importing it)."""
    return importlib.util.find_spec("torchao") is not None


@dataclass(frozen=True)
class QatConfig:
    """How the fake-quantised model is fine-tuned.

    Args:
        epochs: passes over the training images (default 2; 0: the ranges of the calibration images alone).
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
        if self.epochs < 0 or self.batch_size < 1 or not self.lr > 0 or not self.temperature > 0:
            raise ValueError(f"QAT needs epochs >= 0, batch_size >= 1, lr and temperature > 0; got {self}")


def conv_quantizer(ao: SimpleNamespace, reduce_range: bool, float_layers: Iterable[str] = ()):
    """A PT2E quantiser annotating every ``aten.conv2d`` as ONNX Runtime's int8 builds quantise it
    (:class:`~cgavit.deploy.onnx.OnnxInt8Builder`): uint8 per-tensor input, int8 (7-bit with
    ``reduce_range``) per-channel symmetric weight, uint8 output after the ReLU it feeds (if any).
    Convolutions of ``float_layers`` (qualified names in the export form) are left float."""
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
    keep = set(float_layers)
    relus = (torch.ops.aten.relu.default, torch.ops.aten.relu_.default)

    class ConvQuantizer(ao.Quantizer):
        def annotate(self, gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
            for node in gm.graph.nodes:
                if node.op != "call_function" or node.target != torch.ops.aten.conv2d.default:
                    continue
                if _module_path(node) in keep:
                    continue
                users = list(node.users)
                relu = users[0] if len(users) == 1 and users[0].target in relus else None
                node.meta["quantization_annotation"] = ao.QuantizationAnnotation(
                    input_qspec_map={node.args[0]: act, node.args[1]: weight},
                    output_qspec=None if relu is not None else act, _annotated=True)
                if relu is not None:
                    relu.meta["quantization_annotation"] = ao.QuantizationAnnotation(output_qspec=act, _annotated=True)
            return gm

        def validate(self, gm: torch.fx.GraphModule) -> None:
            pass

    return ConvQuantizer()


def _module_path(node: torch.fx.Node) -> str:
    """The qualified name of the module an exported node was traced in (``stages.0.blocks.0.pre.0.m``)."""
    stack = node.meta.get("nn_module_stack") or {}
    return list(stack.values())[-1][0] if stack else ""


def qat_finetune(
    model: nn.Module, images: torch.Tensor, reduce_range: bool, config: QatConfig = QatConfig(), *,
    calibration: torch.Tensor | None = None, float_layers: Iterable[str] = (),
) -> torch.fx.GraphModule:
    """``model``'s int8 export form fine-tuned with fake quantisation, distilled from the fp32 model.

    Args:
        model: the trained model (not modified).
        images: training images ``(N, C, H, W)``, preprocessed like the input (randomly flipped here).
        reduce_range: 7-bit weights (what the runtimes will use on this CPU).
        config: the schedule.
        calibration: images the ranges start from (default: the first 256 of ``images``).
        float_layers: convolutions left in float (qualified names in the export form).

    Returns:
        The fake-quantised graph (eval mode), called like the model; :func:`qat_onnx` writes it as int8.
    """
    ao = _torchao()
    size = tuple(images.shape[2:])
    teacher = fuse(model)
    student = export_form(model, size, fold_residuals=False)
    batch = torch.export.Dim("batch", min=1, max=1 << 16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        example = images[:2] if len(images) > 1 else images.expand(2, -1, -1, -1)  # a batch of 1 would fix the batch size
        graph = torch.export.export(student, (example,), dynamic_shapes=({0: batch},)).module()
        prepared = ao.prepare_qat_pt2e(graph, conv_quantizer(ao, reduce_range, float_layers))
    ao.to_train(prepared)
    with torch.no_grad():  # the observers' first ranges
        for piece in (images[:256] if calibration is None else calibration.float()).split(config.batch_size):
            prepared(piece)
    _train(ao, prepared, teacher, images, config)
    ao.to_eval(prepared)
    return prepared


def qat_onnx(prepared: torch.fx.GraphModule, example: torch.Tensor, info: ExportInfo | None = None) -> bytes:
    """The int8 ONNX file (bytes) of a fine-tuned :func:`qat_finetune` graph, with its learnt ranges:
    each fake quantiser becomes ``QuantizeLinear``/``DequantizeLinear`` (weights stored as int8), batch dynamic.

    Args:
        prepared: the graph :func:`qat_finetune` returned.
        example: an input batch ``(B, C, H, W)`` of the size it was trained at.
        info: metadata for the file's ``metadata_props`` (default: the image size alone).
    """
    ao = _torchao()
    batch = torch.export.Dim("batch", min=1, max=1 << 16)
    x = example[:2].float()
    with warnings.catch_warnings(), tempfile.TemporaryDirectory(prefix="cgavit-qat-") as tmp:
        warnings.simplefilter("ignore")
        converted = ao.convert_pt2e(copy.deepcopy(prepared), fold_quantize=True)
        program = torch.export.export(converted, (x,), dynamic_shapes=({0: batch},))
        out = Path(tmp) / "qat.onnx"
        with contextlib.redirect_stdout(io.StringIO()):  # the exporter's progress lines
            torch.onnx.export(program, (x,), str(out), dynamo=True, input_names=["images"], output_names=["logits"],
                              opset_version=18, external_data=False)
        data = out.read_bytes()
    return with_onnx_metadata(data, export_info(info, tuple(example.shape[2:]), example.shape[1]))


def _train(ao: SimpleNamespace, prepared: nn.Module, teacher: nn.Module, images: torch.Tensor, config: QatConfig) -> None:
    """Knowledge distillation: KL divergence between the softened fp32 and fake-quantised outputs."""
    if not config.epochs:
        return
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
        batches = torch.randperm(len(images), generator=g).split(config.batch_size)
        for idx in progress_bar(batches, f"qat epoch {epoch + 1}/{config.epochs}"):
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
    float_layers: Iterable[str] = (),
    **timing,
) -> QuantizeResult:
    """:func:`qat_finetune`, then the int8 file with the learnt ranges (:func:`qat_onnx`) judged in each
    runtime against ``model`` (the original fp32) on ``evaluation`` (:func:`~cgavit.deploy.quantize.assess`).

    Args:
        model: the trained model.
        calibration: images the ranges start from (training images).
        train_images: images to fine-tune on (training images; may include the calibration ones).
        evaluation, target, runtime, labels, options, features, info: as for :func:`~cgavit.deploy.quantize.quantize`.
        config: the fine-tuning schedule.
        float_layers: convolutions kept in float (e.g. the most sensitive of a post-training search).
        **timing: ``batch``, ``threads``, ``warmup``, ``repeats`` and ``holdout`` of :func:`~cgavit.deploy.quantize.quantize`.

    Raises:
        ValueError: torchao is not installed (``pip install 'cgavit[qat]'``), or as :func:`~cgavit.deploy.quantize.quantize`.
    """
    require_qat()
    if not isinstance(train_images, torch.Tensor) or train_images.ndim != 4 or not len(train_images):
        raise ValueError("QAT needs training images (N, C, H, W)")
    if isinstance(evaluation, torch.Tensor) and evaluation.shape[1:] == train_images.shape[1:]:
        check_held_out(train_images.float(), evaluation.float(), "training")
    features = features or cpu_features()
    # what the file holds, whatever the post-training recipe asked: signed weights (7-bit where the CPU needs it)
    # and ranges that start from moving-average min/max observers (conv_quantizer); the file records these
    opts = replace(options.for_cpu(features), weights="int8", calibration="minmax").with_float(float_layers)
    cal = calibration if isinstance(calibration, torch.Tensor) else torch.cat([b.float() for b in calibration])
    tuned = qat_finetune(model, train_images.float(), bool(opts.reduce_range), config, calibration=cal,
                         float_layers=opts.float_layers)
    method = f"quantization-aware fine-tuning ({config.epochs} epoch(s), PT2E), the learnt ranges in the file"
    return assess(model, qat_onnx(tuned, evaluation[:2]), cal, evaluation, target, runtime, labels=labels, options=opts,
                  features=features, info=info, method=method, **timing)
