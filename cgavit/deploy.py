"""Inference forms of a model: BatchNorm folding (``fuse``), the fast path (``optimize``), ONNX export,
bf16 and int8 CPU paths.

``fuse`` is the reference inference form; every faster form here is checked against it.

* :func:`optimize` -- fuse, swap in the inference attention of :mod:`cgavit.fast`, channels-last,
  ``torch.compile`` with weight freezing; ``precision="bf16"`` runs the same in bfloat16,
  ``precision="int8"`` exports to ONNX and quantises statically for ONNX Runtime.
* :func:`export_onnx` -- a fused model to an ONNX file (batch dynamic, image size fixed),
  written atomically; :class:`OnnxModule` runs such a file through ONNX Runtime like a module.
* :func:`quantize_onnx` -- int8 static quantisation (QDQ, per-channel weights) of an exported file.
"""

from __future__ import annotations

import argparse
import copy
import logging
import os
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path

import torch
from torch import nn

from .attention import CascadedGroupAttention
from .layers import BNLinear, ConvBN

log = logging.getLogger(__name__)

_FUSABLE = (ConvBN, BNLinear, CascadedGroupAttention)

#: Relative error (``||a-b|| / ||b||`` of the logits) each precision is held to by ``optimize(check=True)``.
#: fp32 is the issue's contract; bf16 (8-bit mantissa) and int8 are the reduced paths' stated tolerances,
#: their real test is top-1 agreement (BENCHMARKS.md).
TOLERANCE = {"fp32": 1e-5, "bf16": 0.1, "int8": 0.25}
PRECISIONS = tuple(TOLERANCE)


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
    left = [n for n, m in fused.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    if left:
        raise ValueError(f"these BatchNorm layers have no conv/linear to fold into: {left}")
    for p in fused.parameters():
        p.requires_grad_(False)
    return fused


# ------------------------------------------------------------------------------------- fast path
class OptimizedModel(nn.Module):
    """What :func:`optimize` returns: call it like the model, on float32 ``(B, 3, H, W)`` images.

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
) -> nn.Module:
    """The fastest inference form of ``model`` for inputs like ``example_input``: one call.

    Two backends. ``"torch"``: :func:`fuse`, then the inference attention of :mod:`cgavit.fast`
    (scale folded into the query conv, precomputed bias, ``scaled_dot_product_attention``,
    one-permute window partition, in-place ReLU), channels-last memory format, and
    ``torch.compile`` (inductor) with weight freezing, compiled here on ``example_input``; fp32 or
    bf16. ``"onnxruntime"``: the fused model exported to ONNX (batch dynamic, the example's image
    size) and run by ONNX Runtime on the CPU; fp32, or int8 statically quantised (QDQ, per-channel
    weights, calibrated on ``calibration`` or on ``example_input``). ``"auto"`` (default) picks
    ONNX Runtime on the CPU for fp32 and int8 when it is installed (it was the faster of the two in
    every same-run measurement in BENCHMARKS.md), torch otherwise.

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
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    if not isinstance(example_input, torch.Tensor) or example_input.ndim != 4:
        raise ValueError("example_input must be an image batch tensor (B, C, H, W), e.g. torch.randn(16, 3, 224, 224)")
    if backend == "auto":
        try:
            import onnxruntime  # noqa: F401

            has_ort = True
        except ImportError:
            has_ort = False
        on_cpu = example_input.device.type == "cpu"
        backend = "onnxruntime" if precision == "int8" or (precision == "fp32" and has_ort and on_cpu) else "torch"
    if backend not in ("torch", "onnxruntime"):
        raise ValueError(f"backend must be 'auto', 'torch' or 'onnxruntime', got {backend!r}")
    if (backend, precision) in (("torch", "int8"), ("onnxruntime", "bf16")):
        raise ValueError(f"precision {precision} is not offered by the {backend} backend; use backend='auto'")
    example_input = example_input.float()
    fused = fuse(model)
    if check:
        with torch.no_grad():
            ref = fused(example_input)  # before the fast path rewrites ``fused`` in place
    if backend == "onnxruntime":
        start = time.perf_counter()
        with tempfile.TemporaryDirectory() as tmp:
            path = export_onnx(fused, Path(tmp) / "model.onnx", tuple(example_input.shape[2:]))
            if precision == "int8":
                batches = list(calibration) if calibration is not None else [example_input]
                path = quantize_onnx(path, Path(tmp) / "model.int8.onnx", batches)
            result: nn.Module = OnnxModule(path)
        log.info("optimize: ONNX Runtime %s path ready in %.1f s", precision, time.perf_counter() - start)
    else:
        inner = fused
        if fast_attention:
            from .fast import swap_fast_modules

            inner = swap_fast_modules(inner)
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
    if check:
        with torch.no_grad():
            err = _rel_err(result(example_input), ref)
        result.rel_err = err
        log.info("optimize: relative error vs the fused model %.2e (tolerance %.0e)", err, TOLERANCE[precision])
        if err > TOLERANCE[precision]:
            raise RuntimeError(
                f"the {precision} path differs from the plain model by {err:.2e} (relative), above its "
                f"tolerance {TOLERANCE[precision]:.0e}; run optimize(..., check=False) to keep it anyway"
            )
    return result


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


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
    import warnings

    from .io import atomic_write

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
        import onnxruntime as ort

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


def quantize_onnx(
    src: str | os.PathLike, dst: str | os.PathLike, calibration: Iterable[torch.Tensor]
) -> Path:
    """int8 static quantisation of an exported ONNX file for ONNX Runtime (written atomically).

    Weights per channel, activations per tensor (QDQ format), ranges from ``calibration`` (image
    batches ``(B, C, H, W)`` preprocessed like the model's input; use real images).
    """
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static
    from onnxruntime.quantization.shape_inference import quant_pre_process

    from .io import atomic_write

    class Reader(CalibrationDataReader):
        def __init__(self, batches):
            self.it = iter([{"images": b.float().numpy()} for b in batches])

        def get_next(self):
            return next(self.it, None)

    batches = list(calibration)
    if not batches:
        raise ValueError("int8 calibration needs at least one image batch")
    with tempfile.TemporaryDirectory() as tmp:
        pre = Path(tmp) / "pre.onnx"
        quant_pre_process(str(src), str(pre), skip_symbolic_shape=True)

        def write(tmp_out: Path) -> None:
            quantize_static(
                str(pre), str(tmp_out), Reader(batches), quant_format=QuantFormat.QDQ, per_channel=True,
                activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8, op_types_to_quantize=["Conv"],
            )

        return atomic_write(dst, write)


# ------------------------------------------------------------------------------------------ CLI
def _export(args: argparse.Namespace) -> int:
    from .cli.common import dials_from_args
    from .factory import create_model
    from .testing import rel_err

    size = tuple(args.img_size) if len(args.img_size) == 2 else (args.img_size[0],) * 2
    if args.format != "onnx":
        raise ValueError(f"only --format onnx is supported, got {args.format}")
    model = create_model(args.model, checkpoint_path=args.checkpoint, img_size=size, **dials_from_args(args))
    if args.dynamic_size:
        raise ValueError(
            "--dynamic-size is not supported: the window attention pads and partitions each stage "
            "differently for different image sizes, so one ONNX graph cannot serve them all; export "
            "once per size with --img-size H W"
        )
    out = export_onnx(model, args.output, size)
    print(f"wrote {out} ({out.stat().st_size / 1e6:.1f} MB), batch dynamic, size {size[0]}x{size[1]} fixed")
    ort_model = OnnxModule(out)
    fused = fuse(model)
    for batch in (1, 16):
        x = torch.randn(batch, 3, *size)
        with torch.no_grad():
            err = rel_err(ort_model(x), fused(x))
        print(f"ONNX Runtime vs PyTorch, batch {batch}: relative error {err:.1e} {'ok' if err <= 1e-4 else 'TOO LARGE'}")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    from .cli.common import add_dial_args

    p = sub.add_parser(
        "export",
        help="export a model to ONNX (batch dynamic) and check ONNX Runtime against PyTorch",
        description="Fuse BatchNorm, export to ONNX with a dynamic batch dimension, then run ONNX Runtime "
        "at batch 1 and 16 and print its relative error against PyTorch (must be <= 1e-4).",
    )
    p.add_argument("--model", required=True, help="variant name, e.g. efficientvit_m0")
    p.add_argument("--checkpoint", help="weights file (official, timm or cgavit format); default random weights")
    p.add_argument("--format", default="onnx", choices=["onnx"], help="export format (default onnx)")
    p.add_argument("--output", required=True, help="output file, e.g. m0.onnx (written atomically)")
    p.add_argument("--img-size", type=int, nargs="+", default=[224], metavar="N", help="input size N or H W (default 224)")
    p.add_argument("--dynamic-size", action="store_true", help="not supported (explains why): export once per size")
    add_dial_args(p)
    p.set_defaults(func=_export)
