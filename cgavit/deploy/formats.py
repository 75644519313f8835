"""The export formats of ``cgavit export --format``: one table, one ``export_model`` and one
``load_exported`` over ONNX, OpenVINO, ExecuTorch and TFLite/LiteRT.

Each format is an optional extra of the package (``pip install 'cgavit[openvino]'`` ...), so the core
stays light; :func:`require_format` says which to install when one is missing.
"""

from __future__ import annotations

import math
import os
import tempfile
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from torch import nn

from ..bounds import check_threads, is_whole
from ..factory import ModelInfo
from ..io import check_readable_file
from ..model import check_image_batch, image_size_pair
from ..testing import rel_err
from .agreement import Agreement, batched_logits, compare_logits
from .executorch import ExecutorchModule, executorch_path, executorch_problem, export_executorch
from .onnx import OnnxModule, export_onnx, onnxruntime_path, onnxruntime_problem, quantize_onnx
from .openvino import OpenVinoModule, export_openvino, openvino_path, openvino_problem
from .fusion import check_one_output, example_batch, fuse, fused_fp32, named_output
from .cpu import architecture, cpu_features
from .int8 import Int8Options, architecture_warning, float_part_warning, weight_range_warning
from .metadata import ExportInfo, check_info_outputs, export_info
from .runtime import RuntimeModule
from .tflite import TfliteModule, export_tflite, tflite_path, tflite_problem


@dataclass(frozen=True)
class ExportFormat:
    """One export format, and the runtime that runs it: the one home of what cgavit knows about each.

    Args:
        name: the ``--format`` value.
        runtime: the runtime that runs it, for messages and row names (``"ONNX Runtime"``).
        backend: that runtime as ``optimize``, ``quantize`` and ``cgavit bench --runtimes`` name it (``"onnxruntime"``).
        extra: the package extra that installs it (``pip install 'cgavit[EXTRA]'``).
        suffix: the file name suffix it is written with.
        precisions: what it offers (``"fp32"``, ``"int8"``).
        fixed_batch: whether the batch size is fixed at export (else dynamic).
        metadata: whether its files carry cgavit's metadata (class names, preprocessing, how the int8 was made): the
            formats :func:`open_exported` reads, ``cgavit quantize`` writes and :class:`~cgavit.deploy.int8.Int8Options`
            tune.
        problem: why its runtime cannot be used here for a precision, or None (a package missing, or installed and
            failing to import).
        begins: whether a file's first 16 bytes are this format's: ONNX's protobuf with its IR version (field 1) then
            its producer (field 2); OpenVINO's XML; ExecuTorch's and LiteRT's flatbuffer identifiers at bytes 4-8.
    """

    name: str
    runtime: str
    backend: str
    extra: str
    suffix: str
    precisions: tuple[str, ...]
    fixed_batch: bool
    metadata: bool
    problem: Callable[[str], str | None]
    begins: Callable[[bytes], bool]

    def available(self, precision: str = "fp32") -> bool:
        """Whether its packages are installed and import (for ``precision``: OpenVINO's int8 needs NNCF too)."""
        return self.problem(precision) is None

    def install(self) -> str:
        """What to run to install it: ``pip install 'cgavit[EXTRA]'``."""
        return f"pip install 'cgavit[{self.extra}]'"


FORMATS: dict[str, ExportFormat] = {
    "onnx": ExportFormat("onnx", "ONNX Runtime", "onnxruntime", "deploy", ".onnx", ("fp32", "int8"), False, True,
                         lambda precision: onnxruntime_problem(),
                         lambda head: len(head) > 2 and head[0] == 0x08 and head[1] < 0x80 and head[2] == 0x12),
    "openvino": ExportFormat("openvino", "OpenVINO", "openvino", "openvino", ".xml", ("fp32", "int8"), False, True,
                             lambda precision: openvino_problem(int8=precision == "int8"),
                             lambda head: head.lstrip().startswith((b"<?xml", b"<net"))),
    "executorch": ExportFormat("executorch", "ExecuTorch (XNNPACK)", "executorch", "executorch", ".pte",
                               ("fp32", "int8"), True, False, lambda precision: executorch_problem(),
                               lambda head: head[4:6] == b"ET" and head[6:8].isdigit()),
    "tflite": ExportFormat("tflite", "LiteRT (XNNPACK)", "tflite", "tflite", ".tflite", ("fp32",), True, False,
                           lambda precision: tflite_problem(), lambda head: head[4:8] == b"TFL3"),
}

#: The format of each file suffix :func:`open_exported` reads (those that carry metadata).
SUFFIX_FORMATS = {fmt.suffix: name for name, fmt in FORMATS.items() if fmt.metadata}


def format_of_head(head: bytes) -> ExportFormat | None:
    """The export format whose files begin with ``head`` (a file's first 16 bytes), or None."""
    return next((fmt for fmt in FORMATS.values() if fmt.begins(head)), None)


#: The formats whose files are made for one batch size (``batch=`` / ``--batch``).
FIXED_BATCH_FORMATS = tuple(name for name, fmt in FORMATS.items() if fmt.fixed_batch)
#: The runtimes whose int8 ``cgavit quantize`` builds, searches and writes.
QUANT_RUNTIMES = tuple(fmt.backend for fmt in FORMATS.values() if fmt.metadata)


def runtime_format(backend: str) -> ExportFormat:
    """The format a runtime (``"onnxruntime"``, ``"openvino"``, ``"executorch"``, ``"tflite"``) runs.

    Raises:
        ValueError: a name that is no runtime's.
    """
    found = next((fmt for fmt in FORMATS.values() if fmt.backend == backend), None)
    if found is None:
        raise ValueError(f"unknown runtime {backend!r}; choose from {', '.join(f.backend for f in FORMATS.values())}")
    return found


def require_format(name: str, precision: str = "fp32") -> ExportFormat:
    """The format ``name``, checked to be installed and to offer ``precision``.

    Raises:
        ValueError: unknown format, precision it does not offer, or its extra is not installed or fails to import
            (the message says why, and what to install).
    """
    if name not in FORMATS:
        raise ValueError(f"unknown format {name!r}; choose from {', '.join(FORMATS)}")
    fmt = FORMATS[name]
    if precision not in fmt.precisions:
        raise ValueError(f"the {name} format offers {', '.join(fmt.precisions)}, not {precision}")
    problem = fmt.problem(precision)
    if problem:  # named as a format, not a flag: eval and predict reach here from a file's suffix
        raise ValueError(f"{name} files need {fmt.runtime} ({problem}): {fmt.install()}")
    return fmt


def export_model(
    model: nn.Module,
    path: str | os.PathLike,
    format: str,
    img_size: tuple[int, int] = (224, 224),
    precision: str = "fp32",
    calibration: Iterable[torch.Tensor] | None = None,
    batch: int = 1,
    options: Int8Options | None = None,
    info: ExportInfo | None = None,
) -> Path:
    """Write ``model``'s inference form (:func:`~cgavit.deploy.fusion.export_form`) in ``format`` to
    ``path`` (atomically); returns the path written.

    Args:
        model: the model, fused by the exporter in float32 whatever its own dtype (every file takes float32 images).
        path: the output file, ``NAME`` or ``NAME`` with the format's suffix (:attr:`ExportFormat.suffix`, added
            where it is missing; OpenVINO writes ``NAME.bin`` beside ``NAME.xml``).
        format: a key of :data:`FORMATS`.
        img_size: ``(H, W)`` the file accepts, or one side for a square (fixed in every format: the window
            attention partitions each size differently).
        precision: ``"fp32"`` or ``"int8"`` (where the format offers it).
        calibration: int8: image batches, a few hundred training images preprocessed like the input.
        batch: the batch size, for the formats whose batch is fixed at export (ExecuTorch, TFLite).
        options: int8 in ONNX Runtime and OpenVINO: how to quantise (default: for this CPU,
            :class:`~cgavit.deploy.int8.Int8Options`).
        info: ONNX and OpenVINO: the metadata the file carries (class names, preprocessing;
            :class:`~cgavit.deploy.metadata.ExportInfo` or the ``ModelInfo`` of :func:`~cgavit.load_model`; default:
            the image size alone). Its image size becomes ``img_size``, its precision the file's: an int8
            ``ExportInfo``'s record of how that file was made and judged is not copied.

    Raises:
        ValueError: see :func:`require_format`; a bad size; int8 without calibration, or fp32 with it; ``options``
            or ``batch`` where they would be ignored (fp32; ExecuTorch; a batch in ONNX or OpenVINO), a ``batch`` that
            is not a whole number of at least 1; a missing output folder; a name ending in another format's suffix;
            ``info`` naming other than one class per model output, or holding a value cgavit would refuse when reading
            the file (:func:`export_metadata`); a ``features_only`` model (a list of maps).
    """
    fmt = require_format(format, precision)
    img_size = image_size_pair(img_size)
    _check_used(fmt, precision, batch, options)
    calibration = _checked_calibration(calibration, precision, img_size)
    if info is not None and not isinstance(info, (ExportInfo, ModelInfo)):
        raise ValueError(f"info must be an ExportInfo, or the ModelInfo load_model returns; got {type(info).__name__}")
    path = named_output(path, fmt.suffix, f"a file for {fmt.runtime}")
    check_one_output(model, "an export")
    check_info_outputs(info, model)  # checked before anything is written
    info = export_metadata(info, format, img_size, getattr(model, "in_chans", 3))
    model = fused_fp32(model)  # as optimize exports: a bf16 or fp16 model's graph in float32, the images' dtype
    if format == "openvino":
        return export_openvino(model, path, img_size, precision, calibration, options, info)
    if format == "executorch":
        return export_executorch(model, path, img_size, batch, precision, calibration)
    if format == "tflite":
        return export_tflite(model, path, img_size, batch)
    if precision == "fp32":
        return export_onnx(model, path, img_size, info=info)
    with tempfile.TemporaryDirectory() as tmp:
        fp32 = export_onnx(model, Path(tmp) / "model.onnx", img_size, fold_residuals=False)
        return quantize_onnx(fp32, path, calibration, options, info=info)


def export_metadata(info: ExportInfo | ModelInfo | None, format: str, img_size: tuple[int, int],
                    in_chans: int = 3) -> ExportInfo:
    """What a ``format`` file exported at ``img_size`` from ``info`` records (:func:`export_info`), in fp32, the
    file's own precision until an int8 build records how it was made (no verdict carries over from another file);
    where the format carries metadata (ONNX, OpenVINO), checked by the rules cgavit reads it with
    (:meth:`ExportInfo.to_props`), so that a file its reader would refuse is refused before anything is written.

    Raises:
        ValueError: see :func:`export_info`; a value the reader would refuse, named, with what to change.
    """
    if isinstance(info, ExportInfo):
        info = replace(info, precision="fp32", int8={})
    made = export_info(info, img_size, in_chans)
    if FORMATS[format].metadata:  # the formats open_exported reads
        made.to_props()
    return made


def _check_used(fmt: ExportFormat, precision: str, batch: object, options: Int8Options | None) -> None:
    """Refuse what ``fmt`` in ``precision`` would ignore: ``options`` outside int8 in ONNX Runtime and OpenVINO (fp32
    quantises nothing; ExecuTorch's int8 is XNNPACK's one recipe), a batch other than 1 where the batch is dynamic,
    and a batch that is not a whole number of images where it is fixed."""
    if options is not None and (precision != "int8" or not fmt.metadata):
        what = "quantises nothing" if precision != "int8" else "is XNNPACK's own recipe, which takes no options"
        tuned = " and ".join(name for name, f in FORMATS.items() if f.metadata)
        raise ValueError(f"options are read for int8 in {tuned} only ({fmt.name} {precision} {what}): leave "
                         "options out")
    if not is_whole(batch):
        raise ValueError(f"batch must be a whole number of images, at least 1, got {batch!r}")
    if batch != 1 and not fmt.fixed_batch:
        raise ValueError(f"batch is fixed in {' and '.join(FIXED_BATCH_FORMATS)} files only ({fmt.name} files take any batch): leave "
                         f"batch out, not {batch!r}")


def _checked_calibration(calibration: Iterable[torch.Tensor] | None, precision: str,
                         img_size: tuple[int, int]) -> list[torch.Tensor] | None:
    """The calibration batches int8 needs (None for another precision, which has nothing to calibrate), checked."""
    if precision == "int8" and calibration is None:
        raise ValueError("int8 needs calibration images: give a few hundred training images (--data DIR)")
    if precision != "int8" and calibration is not None:
        raise ValueError(f"calibration images are read for int8 only ({precision} has nothing to calibrate): "
                         "leave calibration out")
    if calibration is None:
        return None
    calibration = list(calibration)
    if not all(isinstance(b, torch.Tensor) and b.ndim == 4 and tuple(b.shape[2:]) == img_size for b in calibration):
        raise ValueError(f"calibration must be image batches (B, C, {img_size[0]}, {img_size[1]}), preprocessed like "
                         "the input the file takes")
    for batch in calibration:
        check_image_batch(batch, "calibration images")  # uint8 pixels would calibrate ranges the input never has
    return calibration


def load_exported(path: str | os.PathLike, format: str, precision: str = "fp32", threads: int | None = None) -> RuntimeModule:
    """An exported file run by its format's own runtime on the CPU, called like a module.

    Args:
        path: the file :func:`export_model` wrote.
        format: a key of :data:`FORMATS`.
        precision: what the file computes in (OpenVINO compiles fp32 files for this precision).
        threads: runtime threads (default: ``torch.get_num_threads()``).

    Raises:
        ValueError: see :func:`require_format`; ``threads`` not a whole number within
            :data:`~cgavit.bounds.THREADS_RANGE`; a file its runtime cannot read (truncated, corrupt, another
            format's), named.
        UnreadableFileError: the file is missing, a folder, empty or unreadable.
    """
    require_format(format)
    if threads is not None:
        check_threads(threads, "threads")
    path = check_readable_file(path, "exported model")
    if format == "openvino":
        return OpenVinoModule(path, threads, precision)
    if format == "executorch":
        return ExecutorchModule(path, precision, threads)
    if format == "tflite":
        return TfliteModule(path, threads)
    return OnnxModule(path, threads, precision)


def runtime_path(
    fused: nn.Module, example_input: torch.Tensor, format: str, precision: str = "fp32",
    calibration: list[torch.Tensor] | None = None,
) -> RuntimeModule:
    """``fused`` in ``format`` for the example's image size (and batch, where fixed), run by the
    format's runtime, built in memory (what ``cgavit bench`` times)."""
    require_format(format, precision)
    if format == "openvino":
        return openvino_path(fused, example_input, precision, calibration)
    if format == "executorch":
        return executorch_path(fused, example_input, precision, calibration)
    if format == "tflite":
        return tflite_path(fused, example_input)
    return onnxruntime_path(fused, example_input, precision, calibration)


#: Largest relative error of an exported fp32 file's logits against PyTorch's that the parity check calls ok.
EXPORT_TOLERANCE = 1e-4


@dataclass
class ParityCheck:
    """An exported file, run in its own runtime, against the fused PyTorch model.

    Args:
        runtime: the runtime's name.
        precision: what the file computes in.
        rel_err: batch size -> relative error of the logits on random images of that batch.
        agreement: with check images: top-1 agreement, accuracy change and logit error (int8's test).
    """

    runtime: str
    precision: str
    rel_err: dict[int, float]
    agreement: Agreement | None = None

    @property
    def ok(self) -> bool:
        """fp32: every error <= :data:`EXPORT_TOLERANCE`; int8: the agreement target (needs check images)."""
        if self.precision == "fp32":
            return all(e <= EXPORT_TOLERANCE for e in self.rel_err.values())
        return self.agreement is not None and self.agreement.meets_target

    def lines(self) -> list[str]:
        """What ``cgavit export`` prints, one line per check."""
        out = []
        for batch, err in self.rel_err.items():
            if self.precision == "fp32":
                verdict = " ok" if err <= EXPORT_TOLERANCE else " TOO LARGE" if math.isfinite(err) else \
                    " NOT FINITE (the logits hold NaN or inf)"
            else:
                verdict = f" ({self.precision}: judged by top-1 agreement on real images)"
            out.append(f"{self.runtime} vs PyTorch, batch {batch}: relative error {err:.1e}{verdict}")
        if self.agreement is not None:
            out.append(f"{self.runtime} {self.precision} vs PyTorch fp32: {self.agreement.describe()} (95% interval of "
                       f"the agreement: {self.agreement.shown_interval()}; more --data DIR/val images narrow it)")
        elif self.precision != "fp32":
            out.append(f"{self.precision} not checked on real images: give --data DIR (DIR/val) for the agreement target")
        return out


@torch.no_grad()
def check_parity(
    module: nn.Module, model: nn.Module, img_size: tuple[int, int], precision: str = "fp32", runtime: str = "",
    images: torch.Tensor | None = None, labels: torch.Tensor | None = None, batches: tuple[int, ...] = (1, 16),
) -> ParityCheck:
    """Compare ``module`` (an exported file in its runtime) with ``fuse(model)``: relative error on random
    images at each batch size of ``batches``, and with ``images`` top-1 agreement (and accuracy with ``labels``)."""
    fused = fuse(model)
    errors = {}
    for batch in batches:
        x = example_batch(fused, img_size, batch)
        errors[batch] = rel_err(module(x), fused(x))
    agreement = None
    if images is not None:
        agreement = compare_logits(batched_logits(module, images), batched_logits(fused, images), labels)
    return ParityCheck(runtime, precision, errors, agreement)


def _check_runnable(module: RuntimeModule, format: str, source: str) -> None:
    """Refuse a network that cgavit cannot feed as its exports are fed: one float32 input of images
    ``(B, C, H, W)`` of a fixed channel count and size (and, in ONNX, any batch), and ``(B, classes)`` logits out.

    Raises:
        ValueError: the first way the network differs, naming ``source``.
    """
    def fail(what: str) -> ValueError:
        return ValueError(f"{source}: {what}; cgavit reads what cgavit export writes (one float32 image input of a fixed "
                          "size, logits out): export it again")

    inputs, outputs = module.input_shape, module.output_shape
    if module.inputs != 1:
        raise fail(f"its network takes {module.inputs} inputs, not one batch of images")
    if not module.input_float32:
        raise fail("its input is not float32")
    if inputs is None or len(inputs) != 4 or None in inputs[1:]:
        raise fail(f"its input's shape is not a fixed (batch, channels, height, width): {inputs or 'not declared'}")
    if format == "onnx" and inputs[0] is not None:
        raise fail(f"its batch is fixed at {inputs[0]}")
    if outputs is not None and len(outputs) == 4:  # as cgavit export writes a model without a classifier
        raise ValueError(f"{source}: its network returns feature maps {outputs}, not (batch, classes) logits: it was "
                         "exported from a model without a classifier (global_pool=''), which open_exported, cgavit eval "
                         "and predict do not run; run it with cgavit.deploy.load_exported(path, format)")
    if outputs is None or len(outputs) != 2 or outputs[1] is None:
        raise fail(f"its output is not declared as (batch, classes) logits: {outputs or 'not declared'}")


def open_exported(path: str | os.PathLike, threads: int | None = None) -> tuple[RuntimeModule, ExportInfo]:
    """An exported ``.onnx`` or OpenVINO ``.xml`` file as a callable model, with the metadata it carries.

    The model takes float32 images ``(B, C, H, W)`` preprocessed as ``info`` says (its size,
    interpolation, crop, mean and std) and returns logits ``(B, classes)``, one per
    ``info.class_names``. An int8 file with full 8-bit weights opened on a CPU whose int8 kernels
    saturate on them (x86 without VNNI; for OpenVINO also oneDNN's ISA cap below VNNI, :mod:`cgavit.deploy.cpu`)
    warns (``RuntimeWarning``): quantise it again there. An int8
    OpenVINO file is compiled with the float part it was judged in (its metadata's ``float_part``), and
    one judged with a bf16 float part warns on a CPU without native bf16. A file ``cgavit quantize`` judged on
    another instruction set (x86 and Arm) warns that its recorded agreement does not carry over.

    Args:
        path: a file written by ``cgavit export`` or ``cgavit quantize`` (OpenVINO: the ``.xml``, its
            ``.bin`` beside it).
        threads: runtime threads (default: ``torch.get_num_threads()``).

    Returns:
        ``(model, info)``.

    Raises:
        ValueError: ``threads`` not a whole number within :data:`~cgavit.bounds.THREADS_RANGE`; not an
            ``.onnx``/``.xml`` file, a missing ``.bin``, one other than the ``.xml`` records, its runtime not installed, a file its
            runtime cannot read (truncated, corrupt), no (or malformed) cgavit metadata, a network cgavit cannot feed
            (not one float32 input of a fixed channel count and size, an ONNX batch fixed, logits not ``(B, classes)``),
            or metadata that does not fit the network (image size, channels, class count:
            :meth:`ExportInfo.check_network`). The model's calls raise ValueError too, naming the file, where its
            runtime cannot run it or it returns other than ``(B, classes)`` logits.
        UnreadableFileError: the file is missing or unreadable.
    """
    if threads is not None:
        check_threads(threads, "threads")
    path = check_readable_file(path, "exported model")
    format = SUFFIX_FORMATS.get(path.suffix.lower())
    if format is None:
        raise ValueError(f"{path.name}: give an exported .onnx or OpenVINO .xml file (got {path.suffix or 'no suffix'})")
    require_format(format)
    module = OpenVinoModule(path, threads) if format == "openvino" else OnnxModule(path, threads)
    info = ExportInfo.from_props(module.metadata, str(path))
    _check_runnable(module, format, str(path))
    info.check_network(module.input_shape, module.output_shape, str(path))
    module.precision = info.precision
    float_part = info.int8.get("float_part", "fp32")
    if format == "openvino" and info.precision != "fp32":
        module = OpenVinoModule(module.model, threads, info.precision, float_part)
    module.source, module.classes = str(path), module.output_shape[1]
    features = cpu_features() if format == "openvino" else cpu_features(environ={})  # MLAS ignores oneDNN's ISA cap
    for warning in (weight_range_warning(str(info.int8.get("weight_range", "")), features),
                    float_part_warning(float_part, features) if format == "openvino" else None,
                    architecture_warning(str(info.int8.get("architecture", "")), architecture())):
        if info.precision == "int8" and warning:
            warnings.warn(f"{path.name}: {warning}", RuntimeWarning, stacklevel=2)
    return module, info
