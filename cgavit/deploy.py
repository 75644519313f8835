"""Inference forms of a model: BatchNorm folding (``fuse``), the fast path (``optimize``), ONNX export,
bf16 and int8 CPU paths.

``fuse`` is the reference inference form; every faster form here is checked against it.

* :func:`optimize` -- fuse, swap in the inference attention of :mod:`cgavit.fast`, channels-last,
  ``torch.compile`` with weight freezing; ``precision="bf16"`` runs the same in bfloat16,
  ``precision="int8"`` exports to ONNX and quantises statically for ONNX Runtime.
* :func:`export_onnx` -- a fused model to an ONNX file (batch dynamic, image size fixed),
  written atomically; :class:`OnnxModule` runs such a file through ONNX Runtime like a module.
* :func:`quantize_onnx` -- int8 static quantisation (QDQ, per-channel weights) of an exported file.

ONNX Runtime (the ``cgavit[deploy]`` extra) is imported in one place, :func:`_onnxruntime`, on first
use: it is optional and slow to import, and ``import cgavit`` must not need it.
"""

from __future__ import annotations

import copy
import importlib.util
import logging
import os
import tempfile
import time
import warnings
from collections.abc import Iterable
from pathlib import Path
from types import ModuleType

import torch
from torch import nn

from .attention import CascadedGroupAttention
from .fast import swap_fast_modules
from .io import atomic_write
from .layers import BNLinear, ConvBN
from .testing import rel_err

log = logging.getLogger(__name__)

_FUSABLE = (ConvBN, BNLinear, CascadedGroupAttention)
_BATCHNORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)

#: Relative error (``||a-b|| / ||b||`` of the logits) each precision is held to by ``optimize(check=True)``.
#: fp32 is the issue's contract; bf16 (8-bit mantissa) and int8 are the reduced paths' stated tolerances,
#: their real test is top-1 agreement (BENCHMARKS.md).
TOLERANCE = {"fp32": 1e-5, "bf16": 0.1, "int8": 0.25}
PRECISIONS = tuple(TOLERANCE)
BACKENDS = ("auto", "torch", "onnxruntime")


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


def _swap_fused(module: nn.Module) -> None:
    for name, child in module.named_children():
        if isinstance(child, _FUSABLE):
            setattr(module, name, child.fuse())
        else:
            _swap_fused(child)


@torch.no_grad()
def fuse(model: nn.Module) -> nn.Module:
    """Return an eval-mode inference copy of ``model`` with every BatchNorm folded away.

    Conv-BN pairs become one ``nn.Conv2d``, BN+Linear heads one ``nn.Linear``, and each attention's
    relative-position bias is gathered once into a buffer. ``model`` itself is not modified;
    fusing an already fused model changes nothing.

    Raises:
        ValueError: if a BatchNorm remains that is not part of a Conv-BN or BN-Linear pair.
    """
    if not isinstance(model, nn.Module):
        raise ValueError(f"fuse expects an nn.Module, got {type(model).__name__}")
    fused = copy.deepcopy(model).eval()
    if isinstance(fused, _FUSABLE):
        fused = fused.fuse().eval()
    else:
        _swap_fused(fused)
    left = [n for n, m in fused.named_modules() if isinstance(m, _BATCHNORMS)]
    if left:
        raise ValueError(f"these BatchNorm layers have no conv/linear to fold into: {left}")
    for p in fused.parameters():
        p.requires_grad_(False)
    return fused


# ------------------------------------------------------------------------------------- fast path
class OptimizedModel(nn.Module):
    """What :func:`optimize` returns on the torch backend: call it like the model, on float32
    ``(B, 3, H, W)`` images.

    Converts the input to the inner module's memory format and dtype, runs it without autograd, and
    returns float32 logits. ``rel_err`` holds the check made at build time (``None`` if skipped).

    Args:
        inner: the (possibly compiled) inference module.
        dtype: dtype the inner module computes in.
        channels_last: feed the inner module channels-last tensors.
        precision: ``"fp32"``, ``"bf16"`` or ``"int8"`` (for display).
    """

    def __init__(self, inner: nn.Module, dtype: torch.dtype, channels_last: bool, precision: str) -> None:
        super().__init__()
        self.inner = inner
        self.dtype = dtype
        self.channels_last = channels_last
        self.precision = precision
        self.rel_err: float | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fmt = torch.channels_last if self.channels_last else torch.contiguous_format
        with torch.no_grad():
            out = self.inner(x.to(dtype=self.dtype, memory_format=fmt))
        return out.float()


def choose_backend(precision: str, backend: str = "auto", device: torch.device | str = "cpu") -> str:
    """The backend :func:`optimize` uses: ``"torch"`` or ``"onnxruntime"``.

    ``"auto"`` picks ONNX Runtime for int8, and for fp32 on the CPU when it is installed; torch
    otherwise.

    Raises:
        ValueError: unknown precision or backend, or a combination no backend offers.
    """
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be 'auto', 'torch' or 'onnxruntime', got {backend!r}")
    if backend == "auto":
        on_cpu = torch.device(device).type == "cpu"
        ort_fp32 = precision == "fp32" and on_cpu and onnxruntime_available()
        return "onnxruntime" if precision == "int8" or ort_fp32 else "torch"
    if (backend, precision) in (("torch", "int8"), ("onnxruntime", "bf16")):
        raise ValueError(f"precision {precision} is not offered by the {backend} backend; use backend='auto'")
    return backend


def optimize(
    model: nn.Module,
    example_input: torch.Tensor,
    precision: str = "fp32",
    *,
    backend: str = "auto",
    compile: bool = True,
    channels_last: bool = True,
    fast_attention: bool = True,
    check: bool = True,
    calibration: Iterable[torch.Tensor] | None = None,
) -> OptimizedModel | OnnxModule:
    """The fastest inference form of ``model`` for inputs like ``example_input``: one call.

    Two backends. ``"torch"``: :func:`fuse`, then the inference attention of :mod:`cgavit.fast`
    (scale folded into the query conv, precomputed bias, ``scaled_dot_product_attention``,
    one-permute window partition, in-place ReLU), channels-last memory format, and
    ``torch.compile`` (inductor) with weight freezing, compiled here on ``example_input``; fp32 or
    bf16. ``"onnxruntime"``: the fused model exported to ONNX (batch dynamic, the example's image
    size) and run by ONNX Runtime on the CPU; fp32, or int8 statically quantised (QDQ, per-channel
    weights, calibrated on ``calibration`` or on ``example_input``). ``"auto"`` (default) picks
    ONNX Runtime on the CPU for fp32 and int8 when it is installed (it was the faster of the two in
    every same-run measurement in BENCHMARKS.md), torch otherwise (:func:`choose_backend`).

    ``model`` is not modified. The result returns float32 logits for float32 images.

    Args:
        model: a cgavit model (any module works for ``fast_attention=False``).
        example_input: a batch ``(B, C, H, W)`` of the shape you will run; compiling specialises on
            it (another batch size or image size recompiles once, automatically).
        precision: ``"fp32"`` (default), ``"bf16"`` (torch backend) or ``"int8"`` (ONNX Runtime).
        backend: ``"auto"``, ``"torch"`` or ``"onnxruntime"`` (see above).
        compile: torch backend: use ``torch.compile``; False keeps the eager fast modules.
        channels_last: run convolutions channels-last (pays on CPU with oneDNN).
        fast_attention: swap in :mod:`cgavit.fast` modules.
        check: compare with the plain model on ``example_input`` and log the relative error; it
            is kept as ``result.rel_err`` and a value above ``TOLERANCE[precision]`` raises.
        calibration: int8 only: image batches for the activation ranges (use real images).

    Raises:
        ValueError: unknown precision or backend, a combination no backend offers, a bad example.
        RuntimeError: the check found a relative error above the precision's tolerance.
    """
    if not isinstance(example_input, torch.Tensor) or example_input.ndim != 4:
        raise ValueError("example_input must be an image batch tensor (B, C, H, W), e.g. torch.randn(16, 3, 224, 224)")
    backend = choose_backend(precision, backend, example_input.device)  # also checks the precision
    example_input = example_input.float()
    fused = fuse(model)
    if check:
        with torch.no_grad():
            reference = fused(example_input)  # before the fast path rewrites ``fused`` in place
    if backend == "onnxruntime":
        result = _onnxruntime_path(fused, example_input, precision, calibration)
    else:
        result = _torch_path(fused, example_input, precision, compile, channels_last, fast_attention)
    if check:
        result.rel_err = _check(result, example_input, reference, precision)
    return result


def _onnxruntime_path(
    fused: nn.Module, example_input: torch.Tensor, precision: str, calibration: Iterable[torch.Tensor] | None
) -> OnnxModule:
    """``fused`` exported for the example's image size (int8: quantised) and loaded into ONNX Runtime."""
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        path = export_onnx(fused, Path(tmp) / "model.onnx", tuple(example_input.shape[2:]))
        if precision == "int8":
            batches = list(calibration) if calibration is not None else [example_input]
            path = quantize_onnx(path, Path(tmp) / "model.int8.onnx", batches)
        result = OnnxModule(path)  # reads the file into memory: the folder may go
    log.info("optimize: ONNX Runtime %s path ready in %.1f s", precision, time.perf_counter() - start)
    return result


def _torch_path(
    fused: nn.Module, example_input: torch.Tensor, precision: str, compile: bool, channels_last: bool,
    fast_attention: bool,
) -> OptimizedModel:
    """``fused`` with the fast modules, in the precision's dtype and memory format, compiled on the example."""
    inner = swap_fast_modules(fused) if fast_attention else fused
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    inner = inner.to(dtype=dtype)
    if channels_last:
        inner = inner.to(memory_format=torch.channels_last)
    if compile:
        inner = torch.compile(inner, options={"freezing": True})
    result = OptimizedModel(inner, dtype, channels_last, precision).eval()
    start = time.perf_counter()
    result(example_input)  # compiles now, not on the user's first call
    log.info("optimize: %s path ready in %.1f s", precision, time.perf_counter() - start)
    return result


def _check(result: nn.Module, example_input: torch.Tensor, reference: torch.Tensor, precision: str) -> float:
    """Relative error of ``result`` against the fused model's ``reference`` logits; raises above tolerance."""
    with torch.no_grad():
        err = rel_err(result(example_input), reference)
    log.info("optimize: relative error vs the fused model %.2e (tolerance %.0e)", err, TOLERANCE[precision])
    if err > TOLERANCE[precision]:
        raise RuntimeError(
            f"the {precision} path differs from the plain model by {err:.2e} (relative), above its "
            f"tolerance {TOLERANCE[precision]:.0e}; run optimize(..., check=False) to keep it anyway"
        )
    return err


# ------------------------------------------------------------------------------------------ ONNX
def export_onnx(
    model: nn.Module,
    path: str | os.PathLike,
    img_size: tuple[int, int] = (224, 224),
    opset: int = 17,
) -> Path:
    """Export ``fuse(model)`` to an ONNX file with a dynamic batch dimension, written atomically.

    The image size is fixed at ``img_size``: the local window attention pads and partitions
    differently depending on each stage's map size, so one graph cannot serve every size (export
    once per size you deploy). The TorchScript-based exporter is used: for this model it gives the
    same graph as the dynamo exporter in seconds instead of minutes.

    Args:
        model: the model (fused here; a fused model is fine too).
        path: output ``.onnx`` file.
        img_size: ``(H, W)`` the file will accept.
        opset: ONNX opset. Default 17.

    Returns:
        The path written.

    Raises:
        ValueError: when the parent folder does not exist.
    """
    path = Path(path)
    if not path.parent.exists():
        raise ValueError(f"output folder {path.parent} does not exist; create it first")
    fused = fuse(model)
    x = torch.randn(2, getattr(fused, "in_chans", 3), *img_size)

    def write(tmp: str) -> None:
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # tracer and deprecation notices, nothing actionable
            torch.onnx.export(
                fused, (x,), tmp, dynamo=False, input_names=["images"], output_names=["logits"],
                dynamic_axes={"images": {0: "batch"}, "logits": {0: "batch"}}, opset_version=opset,
            )

    return atomic_write(path, write)


class OnnxModule(nn.Module):
    """An ONNX file run by ONNX Runtime on the CPU, called like a module on torch tensors.

    Args:
        path: the ``.onnx`` file (read into memory, so the file may be deleted afterwards).
        threads: intra-op threads (default: ``torch.get_num_threads()``, so ``--threads`` applies).
    """

    def __init__(self, path: str | os.PathLike, threads: int | None = None) -> None:
        super().__init__()
        ort = _onnxruntime()
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = threads or torch.get_num_threads()
        opts.inter_op_num_threads = 1
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        self.session = ort.InferenceSession(Path(path).read_bytes(), opts, providers=["CPUExecutionProvider"])
        self.input_name = self.session.get_inputs()[0].name
        self.rel_err: float | None = None

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
    batches ``(B, C, H, W)`` preprocessed like the model's input; use real images).
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
