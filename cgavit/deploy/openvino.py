"""OpenVINO (Intel CPUs): conversion from PyTorch, the OpenVINO runtime as a module, int8 through NNCF.

The ``cgavit[openvino]`` extra (``openvino``, ``nncf``). Each is imported in one place, on first use:
OpenVINO in :func:`_openvino`, NNCF in :func:`_nncf`. Conversion goes straight from the fused PyTorch
model (``openvino.convert_model``), batch dynamic, image size fixed (as for ONNX).

On a CPU with native bf16 OpenVINO *computes in bf16 by default*; this module always asks for the
precision it was given (``INFERENCE_PRECISION_HINT``): ``f32`` for fp32 and int8 (the layers NNCF
leaves unquantised run in fp32), ``bf16`` only for bf16.
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

from .fusion import example_batch, export_form, output_path
from .runtime import RuntimeModule

#: OpenVINO's name of each precision this module offers (its ``INFERENCE_PRECISION_HINT``).
PRECISION_HINT = {"fp32": "f32", "int8": "f32", "bf16": "bf16"}


def _openvino() -> ModuleType:
    """The one place OpenVINO is imported (optional extra; about a second to import)."""
    import openvino

    return openvino


def _nncf() -> ModuleType:
    """The one place NNCF (OpenVINO's quantiser) is imported."""
    import nncf

    return nncf


def openvino_available() -> bool:
    """Whether OpenVINO and NNCF are installed (checked without importing them)."""
    return all(importlib.util.find_spec(name) is not None for name in ("openvino", "nncf"))


def convert_openvino(model: nn.Module, img_size: tuple[int, int], fold_residuals: bool = True):
    """``model``'s inference form (:func:`~cgavit.deploy.fusion.export_form`) as an OpenVINO model
    (``openvino.Model``), batch dynamic, image size fixed."""
    ov = _openvino()
    fused = export_form(model, img_size, fold_residuals)
    x = example_batch(fused, img_size)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # tracer notices about shape-dependent branches: the size is fixed
        return ov.convert_model(fused, example_input=x, input=[(-1, x.shape[1], *img_size)])


def quantize_openvino(ov_model, calibration: Iterable[torch.Tensor]):
    """int8 static quantisation of an OpenVINO model with NNCF, ranges from ``calibration`` (image batches
    preprocessed like the model's input; use training images).

    The ``MIXED`` preset (symmetric weights, asymmetric activations) with the full bias correction: on
    the trained digits model the fast bias correction kept fp32's decision on 99.4 % of the held-out
    images (2 of 360 changed, missing the 99.5 % target), the full one on 99.7 %.

    Raises:
        ValueError: no calibration batch.
    """
    batches = [b.float().numpy() for b in calibration]
    if not batches:
        raise ValueError("int8 calibration needs at least one image batch")
    nncf = _nncf()
    return nncf.quantize(ov_model, nncf.Dataset(batches), subset_size=len(batches),
                         preset=nncf.QuantizationPreset.MIXED, fast_bias_correction=False)


def export_openvino(
    model: nn.Module,
    path: str | os.PathLike,
    img_size: tuple[int, int] = (224, 224),
    precision: str = "fp32",
    calibration: Iterable[torch.Tensor] | None = None,
) -> Path:
    """Write ``model``'s inference form as OpenVINO IR: ``path`` (``.xml``, the graph) and the ``.bin`` beside it.

    Weights are kept in fp32 (OpenVINO's default would store them in fp16). The ``.bin`` is moved into
    place first and the ``.xml`` last, so a reader never finds an ``.xml`` without its weights.

    Args:
        model: the model (fused here).
        path: the ``.xml`` file to write.
        img_size: ``(H, W)`` the model will accept; the batch is dynamic.
        precision: ``"fp32"`` or ``"int8"`` (NNCF, calibrated on ``calibration``).
        calibration: int8 only: image batches, e.g. a few hundred training images.

    Raises:
        ValueError: unknown precision, int8 without calibration, a missing output folder.
    """
    path = output_path(path)
    if path.suffix != ".xml":
        raise ValueError(f"OpenVINO IR is written as NAME.xml (+ NAME.bin); got {path.name}")
    ov_model = openvino_model(model, img_size, precision, calibration)
    ov = _openvino()
    with tempfile.TemporaryDirectory(dir=path.parent, prefix=f".{path.name}.") as tmp:
        xml = Path(tmp) / path.name
        ov.save_model(ov_model, str(xml), compress_to_fp16=False)
        os.replace(xml.with_suffix(".bin"), path.with_suffix(".bin"))
        os.replace(xml, path)
    return path


def openvino_model(
    model: nn.Module, img_size: tuple[int, int], precision: str = "fp32",
    calibration: Iterable[torch.Tensor] | None = None,
):
    """The OpenVINO model of ``model`` in ``precision`` (``"fp32"``, ``"bf16"``: the same graph, or ``"int8"``).

    Raises:
        ValueError: unknown precision, or int8 without calibration.
    """
    if precision not in PRECISION_HINT:
        raise ValueError(f"OpenVINO precision must be one of {', '.join(PRECISION_HINT)}, got {precision!r}")
    if precision == "int8" and calibration is None:
        raise ValueError("int8 needs calibration images: give a few hundred training images (--data DIR)")
    ov_model = convert_openvino(model, img_size, fold_residuals=precision == "fp32")
    return quantize_openvino(ov_model, calibration) if precision == "int8" else ov_model


class OpenVinoModule(RuntimeModule):
    """An OpenVINO model (an ``.xml`` file or an ``openvino.Model``) compiled for the CPU, called like a module.

    The model is compiled once per batch size seen, with that batch fixed: with the batch left dynamic,
    an NNCF int8 model crashed the process (segmentation fault) at batches below 8 on an AMX CPU with
    OpenVINO 2026.4.1, and ran at the same batches when the shape was static.

    Args:
        model: the ``.xml`` path or an ``openvino.Model``.
        threads: inference threads (default: ``torch.get_num_threads()``, so ``--threads`` applies).
        precision: ``"fp32"``, ``"bf16"`` or ``"int8"``: sets the compute precision (see the module notes).
    """

    def __init__(self, model, threads: int | None = None, precision: str = "fp32") -> None:
        super().__init__(precision)
        if precision not in PRECISION_HINT:
            raise ValueError(f"OpenVINO precision must be one of {', '.join(PRECISION_HINT)}, got {precision!r}")
        self.core = _openvino().Core()
        self.model = self.core.read_model(str(model)) if isinstance(model, (str, os.PathLike)) else model
        self.config = {"INFERENCE_NUM_THREADS": threads or torch.get_num_threads(), "NUM_STREAMS": 1,
                       "PERFORMANCE_HINT": "LATENCY", "INFERENCE_PRECISION_HINT": PRECISION_HINT[precision]}
        self.compiled: dict[int, object] = {}  # batch size -> compiled model

    def compiled_for(self, batch: int):
        """The model compiled for inputs of ``batch`` images (compiled on first use)."""
        if batch not in self.compiled:
            shape = [dim.get_length() for dim in self.model.input(0).get_partial_shape()[1:]]  # (C, H, W)
            static = self.model.clone()
            static.reshape([batch, *shape])
            self.compiled[batch] = self.core.compile_model(static, "CPU", self.config)
        return self.compiled[batch]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.compiled_for(len(x))(x.detach().float().contiguous().numpy())[0]
        return torch.from_numpy(out.copy())


def openvino_path(
    fused: nn.Module, example_input: torch.Tensor, precision: str, calibration: list[torch.Tensor] | None
) -> OpenVinoModule:
    """``fused`` converted for the example's image size (int8: quantised on ``calibration``, else on the
    example) and compiled by OpenVINO for the CPU, all in memory."""
    size = tuple(example_input.shape[2:])
    batches = (calibration or [example_input]) if precision == "int8" else None
    return OpenVinoModule(openvino_model(fused, size, precision, batches), precision=precision)
