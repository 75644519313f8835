"""ExecuTorch (mobile and embedded): a ``.pte`` program with the XNNPACK delegate, fp32 or int8
(PT2E quantisation with the XNNPACK quantiser: the convolutions int8, the residual adds float), and the
ExecuTorch runtime as a module.

The ``cgavit[executorch]`` extra. ExecuTorch and the PT2E quantiser (torchao) are imported in one
place, :func:`_executorch`, on first use (several seconds).

The batch size is fixed at export, like the image size: ExecuTorch plans its memory from the
example input, and a program exported with a dynamic batch refused a larger batch at run time
("Attempted to resize a bounded tensor"). :class:`ExecutorchModule` runs any batch by splitting it
into the exported one (padding the last piece).
"""

from __future__ import annotations

import importlib.util
import os
import warnings
from collections.abc import Iterable
from pathlib import Path
from types import SimpleNamespace

import torch
from torch import nn

from ..io import atomic_write
from .fusion import example_batch, export_form, output_path
from .metadata import unreadable_file
from .runtime import FixedBatchModule, pad_batch

PRECISIONS = ("fp32", "int8")


def _executorch() -> SimpleNamespace:
    """The one place ExecuTorch and its PT2E quantisation are imported; the pieces used here."""
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.backends.xnnpack.quantizer.xnnpack_quantizer import (
        XNNPACKQuantizer,
        get_symmetric_quantization_config,
    )
    from executorch.exir import to_edge_transform_and_lower
    from executorch.extension.pybindings import portable_lib
    from executorch.runtime import Runtime
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

    return SimpleNamespace(
        XnnpackPartitioner=XnnpackPartitioner, XNNPACKQuantizer=XNNPACKQuantizer,
        get_symmetric_quantization_config=get_symmetric_quantization_config,
        to_edge_transform_and_lower=to_edge_transform_and_lower, Runtime=Runtime,
        prepare_pt2e=prepare_pt2e, convert_pt2e=convert_pt2e,
        # the runtime's one process-wide threadpool (XNNPACK runs on it); it starts with a thread per core
        thread_count=portable_lib._threadpool_get_thread_count,
        reset_threadpool=portable_lib._unsafe_reset_threadpool,
    )


def executorch_problem() -> str | None:
    """Why the ExecuTorch paths cannot be used here, or None (checked without importing it: the import takes
    seconds)."""
    return None if importlib.util.find_spec("executorch") is not None else "executorch is not installed"


def _not_elementwise(node: torch.fx.Node) -> bool:
    """The XNNPACK quantiser's filter: every pattern but the elementwise adds and multiplies (the residual adds
    and the squeeze-excitation gates), which stay float as in ONNX Runtime's and OpenVINO's recipe
    (:mod:`cgavit.deploy.int8`). With them int8 the trained digits model kept 99.4 % of its decisions on an
    AVX-512 EPYC (2 of 360 changed, the target allows 1); without, all of them."""
    return node.target not in (torch.ops.aten.add.Tensor, torch.ops.aten.add_.Tensor,
                               torch.ops.aten.mul.Tensor, torch.ops.aten.mul_.Tensor)


def _quantized_graph(et: SimpleNamespace, fused: nn.Module, x: torch.Tensor, calibration: list[torch.Tensor]) -> nn.Module:
    """``fused`` quantised by PT2E for XNNPACK: per-channel symmetric int8 weights, int8 activations
    with ranges observed on ``calibration`` (each batch cut or padded to the export batch); the
    convolutions int8, the elementwise adds and multiplies float (:func:`_not_elementwise`)."""
    graph = torch.export.export(fused, (x,)).module()
    quantizer = et.XNNPACKQuantizer().set_global(et.get_symmetric_quantization_config(is_per_channel=True))
    quantizer.set_filter_function(_not_elementwise)
    prepared = et.prepare_pt2e(graph, quantizer)
    with torch.no_grad():
        for images in torch.cat(calibration).split(len(x)):
            prepared(pad_batch(images.float(), len(x)))
    return et.convert_pt2e(prepared)


def executorch_program(
    model: nn.Module, img_size: tuple[int, int], batch: int = 1, precision: str = "fp32",
    calibration: Iterable[torch.Tensor] | None = None,
) -> bytes:
    """The ExecuTorch program (``.pte`` bytes) of ``fuse(model)`` for ``(batch, C, *img_size)`` inputs.

    Raises:
        ValueError: unknown precision, int8 without calibration, batch below 1.
    """
    if precision not in PRECISIONS:
        raise ValueError(f"ExecuTorch precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    if precision == "int8" and calibration is None:
        raise ValueError("int8 needs calibration images: give a few hundred training images (--data DIR)")
    if batch < 1:
        raise ValueError(f"batch must be at least 1, got {batch}")
    et = _executorch()
    fused = export_form(model, img_size, fold_residuals=precision != "int8")
    x = example_batch(fused, img_size, batch)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # export notices about shape-dependent branches: the size is fixed
        graph = _quantized_graph(et, fused, x, list(calibration)) if precision == "int8" else fused
        program = torch.export.export(graph, (x,))
        lowered = et.to_edge_transform_and_lower(program, partitioner=[et.XnnpackPartitioner()])
        return lowered.to_executorch().buffer


def export_executorch(
    model: nn.Module,
    path: str | os.PathLike,
    img_size: tuple[int, int] = (224, 224),
    batch: int = 1,
    precision: str = "fp32",
    calibration: Iterable[torch.Tensor] | None = None,
) -> Path:
    """Write ``fuse(model)`` as an ExecuTorch ``.pte`` program (XNNPACK delegate), atomically.

    Args:
        model: the model (fused here).
        path: output ``.pte`` file.
        img_size: ``(H, W)`` the program accepts.
        batch: the batch size the program accepts (default 1, the mobile case).
        precision: ``"fp32"`` or ``"int8"`` (PT2E, calibrated on ``calibration``).
        calibration: int8 only: image batches, e.g. a few hundred training images.

    Raises:
        ValueError: see :func:`executorch_program`; a missing output folder.
    """
    path = output_path(path)
    data = executorch_program(model, img_size, batch, precision, calibration)
    return atomic_write(path, lambda tmp: Path(tmp).write_bytes(data))


class ExecutorchModule(FixedBatchModule):
    """An ExecuTorch program run by the ExecuTorch runtime (XNNPACK on the CPU), called like a module.

    Any batch works: it is run in pieces of the exported batch size, the last one padded.

    Args:
        program: the ``.pte`` file or its bytes.
        precision: what the program computes in, for display (``"fp32"`` or ``"int8"``).
        threads: threads of ExecuTorch's threadpool (default: ``torch.get_num_threads()``, so
            ``--threads`` applies; the runtime's own default is one per core). The pool is shared by
            every program in the process: the last module built sets it.

    Raises:
        ValueError: a file the runtime cannot load (truncated, corrupt, not a ``.pte`` program), naming it.
    """

    def __init__(self, program: str | os.PathLike | bytes, precision: str = "fp32", threads: int | None = None) -> None:
        super().__init__(precision)
        data = program if isinstance(program, bytes) else Path(program).read_bytes()
        et = _executorch()
        threads = threads or torch.get_num_threads()
        if et.thread_count() != threads:
            et.reset_threadpool(threads)
        try:
            self.program = et.Runtime.get().load_program(data)  # owns the method's memory: keep it
            self.method = self.program.load_method("forward")
            self.takes(self.method.metadata.input_tensor_meta(0).sizes())
        except RuntimeError as err:
            if isinstance(program, bytes):  # built here, not read from a file: a defect of ours
                raise
            raise unreadable_file(program, "an ExecuTorch program", err) from None

    def run_batch(self, x: torch.Tensor) -> torch.Tensor:
        return self.method.execute([x])[0]


def executorch_path(
    fused: nn.Module, example_input: torch.Tensor, precision: str, calibration: list[torch.Tensor] | None
) -> ExecutorchModule:
    """``fused`` as an ExecuTorch program for the example's batch and image size, loaded in memory."""
    batches = (calibration or [example_input]) if precision == "int8" else None
    size, batch = tuple(example_input.shape[2:]), len(example_input)
    return ExecutorchModule(executorch_program(fused, size, batch, precision, batches), precision=precision)
