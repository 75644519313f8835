"""ONNX: export (batch dynamic, image size fixed), ONNX Runtime as a module, int8 static quantisation.

ONNX Runtime (the ``cgavit[deploy]`` extra) is imported in one place, :func:`_onnxruntime`, on first
use: it is optional and slow to import, and ``import cgavit`` must not need it.
"""

from __future__ import annotations

import importlib.util
import os
import tempfile
import warnings
from collections.abc import Iterable
from pathlib import Path
from types import ModuleType

import torch
from torch import nn

from ..io import atomic_write
from .fusion import example_batch, export_form, output_path
from .runtime import RuntimeModule


def _onnxruntime(quantization: bool = False) -> ModuleType:
    """The one place ONNX Runtime is imported (lazily: an optional extra, about a second to import).

    With ``quantization`` its ``quantization`` and ``quantization.shape_inference`` submodules are
    loaded too (they pull in ``onnx``).
    """
    import onnxruntime

    if quantization:
        import onnxruntime.quantization.shape_inference  # noqa: F401  (sets the submodule attributes)
    return onnxruntime


def onnxruntime_available() -> bool:
    """Whether ONNX Runtime is installed (checked without importing it)."""
    return importlib.util.find_spec("onnxruntime") is not None


def export_onnx(
    model: nn.Module,
    path: str | os.PathLike,
    img_size: tuple[int, int] = (224, 224),
    opset: int = 17,
    fold_residuals: bool = True,
) -> Path:
    """Export ``model``'s inference form (:func:`~cgavit.deploy.fusion.export_form`) to an ONNX file
    with a dynamic batch dimension, written atomically.

    The image size is fixed at ``img_size``: the local window attention pads and partitions
    differently depending on each stage's map size, so one graph cannot serve every size (export
    once per size you deploy). The TorchScript-based exporter is used: for this model it gives the
    same graph as the dynamo exporter in seconds instead of minutes.

    Args:
        model: the model (fused here; a fused model is fine too).
        path: output ``.onnx`` file.
        img_size: ``(H, W)`` the file will accept.
        opset: ONNX opset. Default 17.
        fold_residuals: fold depthwise residuals into their convs (default; int8 sources keep them).

    Returns:
        The path written.

    Raises:
        ValueError: when the parent folder does not exist.
    """
    path = output_path(path)
    fused = export_form(model, img_size, fold_residuals)
    x = example_batch(fused, img_size)

    def write(tmp: str) -> None:
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # tracer and deprecation notices, nothing actionable
            torch.onnx.export(
                fused, (x,), tmp, dynamo=False, input_names=["images"], output_names=["logits"],
                dynamic_axes={"images": {0: "batch"}, "logits": {0: "batch"}}, opset_version=opset,
            )

    return atomic_write(path, write)


class OnnxModule(RuntimeModule):
    """An ONNX file run by ONNX Runtime on the CPU, called like a module on torch tensors.

    Args:
        path: the ``.onnx`` file (read into memory, so the file may be deleted afterwards).
        threads: intra-op threads (default: ``torch.get_num_threads()``, so ``--threads`` applies).
        precision: what the file computes in, for display (``"fp32"`` or ``"int8"``).
    """

    def __init__(self, path: str | os.PathLike, threads: int | None = None, precision: str = "fp32") -> None:
        super().__init__(precision)
        ort = _onnxruntime()
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = threads or torch.get_num_threads()
        opts.inter_op_num_threads = 1
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        self.session = ort.InferenceSession(Path(path).read_bytes(), opts, providers=["CPUExecutionProvider"])
        self.input_name = self.session.get_inputs()[0].name

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.session.run(None, {self.input_name: x.detach().float().contiguous().numpy()})[0]
        return torch.from_numpy(out)


class _CalibrationReader:
    """Feeds image batches to ONNX Runtime's calibration (its ``CalibrationDataReader`` interface)."""

    def __init__(self, batches: list[torch.Tensor]) -> None:
        self.it = iter([{"images": b.float().numpy()} for b in batches])

    def get_next(self) -> dict | None:
        return next(self.it, None)


def quantize_onnx(
    src: str | os.PathLike, dst: str | os.PathLike, calibration: Iterable[torch.Tensor]
) -> Path:
    """int8 static quantisation of an exported ONNX file for ONNX Runtime (written atomically).

    Weights per channel, activations per tensor (QDQ format), ranges from ``calibration`` (image
    batches ``(B, C, H, W)`` preprocessed like the model's input; use real training images).

    Raises:
        ValueError: no calibration batch.
    """
    batches = list(calibration)
    if not batches:
        raise ValueError("int8 calibration needs at least one image batch")
    quant = _onnxruntime(quantization=True).quantization
    with tempfile.TemporaryDirectory() as tmp:
        pre = Path(tmp) / "pre.onnx"
        quant.shape_inference.quant_pre_process(str(src), str(pre), skip_symbolic_shape=True)

        def write(tmp_out: str) -> None:
            quant.quantize_static(
                str(pre), tmp_out, _CalibrationReader(batches), quant_format=quant.QuantFormat.QDQ,
                per_channel=True, activation_type=quant.QuantType.QUInt8, weight_type=quant.QuantType.QInt8,
                op_types_to_quantize=["Conv"],
            )

        return atomic_write(dst, write)


def onnxruntime_path(
    fused: nn.Module, example_input: torch.Tensor, precision: str, calibration: list[torch.Tensor] | None
) -> OnnxModule:
    """``fused`` exported for the example's image size (int8: quantised on ``calibration``, else on the
    example) and loaded into ONNX Runtime; the temporary files are gone when this returns."""
    with tempfile.TemporaryDirectory() as tmp:
        path = export_onnx(fused, Path(tmp) / "model.onnx", tuple(example_input.shape[2:]), fold_residuals=precision != "int8")
        if precision == "int8":
            path = quantize_onnx(path, Path(tmp) / "model.int8.onnx", calibration or [example_input])
        return OnnxModule(path, precision=precision)  # reads the file into memory: the folder may go
