"""``optimize``: the fastest inference form of a model in one call, on torch, ONNX Runtime or OpenVINO,
in fp32, bf16 or int8, or picked for this CPU with ``precision="auto"``."""

from __future__ import annotations

import logging
import math
import os
import time
import warnings
from collections.abc import Iterable

import torch
from torch import nn

from ..fast import swap_fast_modules
from ..io import require_flag
from ..kernels import interpreted, triton_available
from ..kernels import load as load_kernels
from ..model import check_image_batch
from ..testing import full_fp32, rel_err
from .agreement import Agreement, batched_logits, compare_logits
from .artifact import QuantizedArtifact, quantized_artifact
from .auto import auto_candidates, precision_warning, untried_paths
from .cpu import CpuFeatures, cpu_features
from .fusion import check_classifier, check_model, fused_fp32
from .int8 import fastest_float_part
from .metadata import model_classes
from .formats import runtime_format
from .onnx import onnxruntime_path
from .openvino import openvino_path
from .quantize import QuantizeResult
from .runtime import PathChoice, RuntimeModule, image_batches

log = logging.getLogger(__name__)

#: Relative error (``||a-b|| / ||b||`` of the logits) each precision is held to by ``optimize(check=True)``.
#: fp32 is the issue's contract; bf16 (8-bit mantissa) and int8 are the reduced paths' stated tolerances,
#: their real test is top-1 agreement on a trained model (:mod:`cgavit.deploy.agreement`).
TOLERANCE = {"fp32": 1e-5, "fp16": 2e-3, "bf16": 0.1, "int8": 0.25}
PRECISIONS = tuple(TOLERANCE)
BACKENDS = ("auto", "torch", "onnxruntime", "openvino", "triton")
#: The precisions each backend offers.
OFFERED = {
    "torch": ("fp32", "bf16"),
    "onnxruntime": ("fp32", "int8"),
    "openvino": ("fp32", "bf16", "int8"),
    "triton": ("fp32", "fp16", "bf16"),  # the fused CGA kernel (cgavit.kernels); fp16/bf16 on a GPU
}
_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


class OptimizedModel(RuntimeModule):
    """What :func:`optimize` returns on the torch backend: call it like the model, on float32
    ``(B, 3, H, W)`` images.

    Converts the input to the inner module's memory format and dtype, runs it without autograd, and
    returns float32 logits. ``rel_err`` holds the check made at build time (``None`` if skipped).

    Args:
        inner: the (possibly compiled) inference module.
        dtype: dtype the inner module computes in.
        channels_last: feed the inner module channels-last tensors.
        precision: ``"fp32"``, ``"fp16"`` (Triton), ``"bf16"`` or ``"int8"`` (for display).
    """

    def __init__(self, inner: nn.Module, dtype: torch.dtype, channels_last: bool, precision: str) -> None:
        super().__init__(precision)
        self.inner = inner
        self.dtype = dtype
        self.channels_last = channels_last

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fmt = torch.channels_last if self.channels_last else torch.contiguous_format
        with torch.no_grad():
            out = self.inner(x.to(dtype=self.dtype, memory_format=fmt))
        return out.float()

    def train(self, mode: bool = True) -> "OptimizedModel":
        """Sets this module's flag only: the inner module is an inference form and stays in eval mode (in training
        mode the model's stochastic depth would drop branches at random, and a distilled model return two heads'
        logits), so an optimized model held in a module being trained, a teacher, keeps giving its logits."""
        super().train(mode)
        self.inner.eval()
        return self

    def _apply(self, fn, recurse: bool = True):
        """``.to(dtype)``, ``.double()``, ``.half()``: the input is cast to what the weights are now (the Triton path's
        kernel takes no float64, and says so when called)."""
        super()._apply(fn, recurse)
        weight = next((t for t in self.inner.parameters() if t.is_floating_point()), None)
        self.dtype = self.dtype if weight is None else weight.dtype
        return self


def backend_available(backend: str, precision: str = "fp32") -> bool:
    """Whether ``backend`` (``"torch"``, ``"onnxruntime"``, ``"openvino"``, ``"triton"``) is installed and imports
    for ``precision`` (one that is present but broken counts as missing; OpenVINO's int8 needs NNCF too)."""
    if backend == "torch":
        return True
    if backend == "triton":
        return triton_available()
    return runtime_format(backend).available(precision)


def choose_backend(precision: str, backend: str = "auto", device: torch.device | str = "cpu") -> str:
    """The backend :func:`optimize` uses for a fixed precision: ``"torch"``, ``"onnxruntime"``, ``"openvino"`` or
    ``"triton"``.

    ``"auto"`` picks ONNX Runtime for int8, and for fp32 on the CPU when it is installed; Triton for fp16 (on a
    CUDA GPU: the only backend offering it); torch otherwise. OpenVINO is used when asked for by name (or by
    ``precision="auto"``'s rule table).

    Raises:
        ValueError: unknown precision or backend, a combination no backend offers, a runtime that is not
            installed or fails to import (int8's ONNX Runtime too: int8 runs in a runtime), or a runtime (they run on
            the CPU) for another ``device``.
    """
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of auto, {', '.join(PRECISIONS)}, got {precision!r}")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    if backend == "auto" and precision == "fp16":
        if torch.device(device).type != "cuda":
            raise ValueError("fp16 runs in the Triton kernel on a CUDA GPU only; on the CPU use fp32, bf16 or int8 "
                             "(or precision='auto')")
        return "triton"  # the only backend offering fp16
    if backend == "auto":
        on_cpu = torch.device(device).type == "cpu"
        ort_fp32 = precision == "fp32" and on_cpu and backend_available("onnxruntime")
        backend = "onnxruntime" if precision == "int8" or ort_fp32 else "torch"
    elif precision not in OFFERED[backend]:
        raise ValueError(f"precision {precision} is not offered by the {backend} backend (it offers "
                         f"{', '.join(OFFERED[backend])}); {_offered_by(precision)}, or backend='auto'")
    if backend in ("torch", "triton"):
        return backend
    if torch.device(device).type != "cpu":
        raise ValueError(f"the {backend} backend runs on the CPU, and example_input is on {torch.device(device)}: give "
                         "a CPU example (and model), or use backend='torch' on the GPU")
    fmt = runtime_format(backend)
    problem = fmt.problem(precision)
    if problem:
        raise ValueError(f"the {backend} backend cannot be used: {problem}; {fmt.install()}"
                         + (", or use precision='fp32'" if precision == "int8" else ", or use backend='torch'"))
    return backend


def _offered_by(precision: str) -> str:
    """Which backends offer ``precision``, and the first to ask for: ``"triton offers it (on a CUDA GPU): use ..."``."""
    names = [name for name, offered in OFFERED.items() if precision in offered]
    listed = " and ".join([", ".join(names[:-1]), names[-1]]) if len(names) > 1 else names[0]
    where = " (on a CUDA GPU)" if names == ["triton"] else ""
    return f"{listed} offer{'s' if len(names) == 1 else ''} it{where}: use backend={names[0]!r}"


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
    calibration: torch.Tensor | Iterable[torch.Tensor] | None = None,
    features: CpuFeatures | None = None,
    quantized: QuantizeResult | str | os.PathLike | None = None,
    evaluation: torch.Tensor | Iterable[torch.Tensor] | None = None,
) -> RuntimeModule:
    """The fastest inference form of ``model`` for inputs like ``example_input``: one call.

    Backends: ``"torch"`` (:func:`~cgavit.deploy.fusion.fuse`, :mod:`cgavit.fast`, channels-last, ``torch.compile`` with frozen
    weights; fp32, bf16), ``"onnxruntime"`` (fp32, int8 static QDQ), ``"openvino"`` (fp32, bf16, int8 by NNCF), ``"triton"``
    (:mod:`cgavit.kernels`, CUDA; fp32, fp16, bf16); ``"auto"``: ONNX Runtime on the CPU if installed, else torch (fp16: Triton).

    ``precision="auto"`` picks precision and backend by the rule table of :mod:`cgavit.deploy.auto`: the
    CPU class's fastest measured path first; bf16 only where native, int8 only with ``calibration`` or
    ``quantized``; a reduced path kept only with top-1 agreement >= 99.5 % on ``evaluation`` (else ``calibration``,
    else the example); where bf16 is native int8 OpenVINO runs its float part in bf16 (:mod:`cgavit.deploy.int8`).
    Nothing is timed; the choice and why: ``result.choice``. Slow paths warn. ``model`` is not modified.

    Args:
        model: a cgavit model (for ``fast_attention=False``, any module whose BatchNorms are cgavit's Conv-BN pairs).
        example_input: a batch ``(B, C, H, W)`` of the shape you will run, on the model's device (compiling specialises on it).
        precision: ``"fp32"`` (default), ``"fp16"`` (Triton, GPU), ``"bf16"``, ``"int8"`` or ``"auto"``.
        backend: ``"auto"``, ``"torch"``, ``"onnxruntime"``, ``"openvino"`` or ``"triton"``.
        compile, channels_last, fast_attention: torch: ``torch.compile`` (else eager), channels-last, :mod:`cgavit.fast`.
        check: compare with the fused float32 model on ``example_input`` (``result.rel_err``; above ``TOLERANCE`` raises).
        calibration, evaluation: image batches (or one tensor): int8's activation ranges are set on ``calibration``
            (training images); ``evaluation``, ``precision="auto"`` only, judges reduced paths (default: calibration).
        features: the CPU to decide for (default: this machine's, :func:`~cgavit.deploy.cpu.cpu_features`).
        quantized: ``precision="auto"`` only: this model's int8 artifact (a :func:`~cgavit.deploy.quantize` result or file).

    Raises:
        ValueError: not a model, a precision, backend or combination not offered, a bad example (or not on its device), empty calibration.
        TypeError: a switch not True or False (``compile="no"`` would compile), ``features`` not a ``CpuFeatures``.
        RuntimeError: the check found a relative error above the precision's tolerance.
    """
    opts = dict(compile=compile, channels_last=channels_last, fast_attention=fast_attention)
    _check_switches({**opts, "check": check}, features)
    example_input, batches, judged = _checked_inputs(model, example_input, calibration, precision, backend, quantized, evaluation)
    on_cpu = example_input.device.type == "cpu"
    if precision == "auto":
        artifact = None if quantized is None else quantized_artifact(quantized)
        cpu = (features or cpu_features()) if on_cpu else None
        return _optimize_auto(model, example_input, batches, cpu, check, opts, artifact, judged)
    backend = choose_backend(precision, backend, example_input.device)  # also checks the precision
    if on_cpu:
        _warn_if_slow(precision, features or cpu_features(), batches)
    fused = fused_fp32(model)
    reference = checked_logits(fused, example_input) if check else None  # before the fast path rewrites ``fused``
    result = _build(fused, example_input, precision, backend, batches, opts)
    result.rel_err = _check(result, example_input, reference, precision) if check else None
    return result


def _check_switches(switches: dict[str, object], features: object) -> None:
    """Each of ``switches`` True or False, ``features`` None or a :class:`CpuFeatures`; TypeError otherwise."""
    for name, value in switches.items():
        require_flag(value, name)
    if features is not None and not isinstance(features, CpuFeatures):
        raise TypeError(f"features must be a CpuFeatures (cgavit.deploy.cpu_features() gives this machine's), got "
                        f"{type(features).__name__}")


def _check_same_device(model: nn.Module, example_input: torch.Tensor) -> None:
    """Refuse a model whose weights are on another device than the example's (a CPU model with a CUDA example): the
    fp32 reference it is checked against would be computed on neither, and the torch path would fail at its first
    call. One line, before anything is built."""
    weight = next(iter(model.parameters()), None)
    weight = next(iter(model.buffers()), None) if weight is None else weight
    if weight is not None and weight.device != example_input.device:
        raise ValueError(f"the model is on {weight.device} and example_input on {example_input.device}: put them on "
                         f"one device (model.to(example_input.device)); the result runs where the example is")


def _checked_inputs(
    model: nn.Module, example_input: torch.Tensor, calibration: Iterable[torch.Tensor] | None, precision: str, backend: str,
    quantized: object, evaluation: Iterable[torch.Tensor] | None = None,
) -> tuple[torch.Tensor, list[torch.Tensor] | None, list[torch.Tensor] | None]:
    """The example (on ``model``'s device), the calibration and the evaluation batches as float32, checked (and what
    only auto takes)."""
    check_model(model, "optimize")
    if precision == "auto" and backend != "auto":
        raise ValueError(f"precision='auto' picks the backend too; leave backend='auto' (got {backend!r})")
    if precision == "auto":
        check_classifier(model, "precision='auto'")
    if quantized is not None and precision != "auto":
        raise ValueError("quantized= is for precision='auto'; to run the artifact itself, use open_exported(path)")
    if not isinstance(example_input, torch.Tensor) or example_input.ndim != 4 or len(example_input) == 0:
        raise ValueError("example_input must be an image batch tensor (B, C, H, W) of at least one image, e.g. "
                         "torch.randn(16, 3, 224, 224); the result then runs any batch size, 0 included")
    _check_same_device(model, example_input)
    if calibration is not None and precision not in ("int8", "auto"):
        raise ValueError(f"calibration= is for int8 (and precision='auto'): the images int8's activation ranges are "
                         f"set on; precision={precision!r} does not use them, so leave it out")
    batches = None if calibration is None else image_batches(calibration, "calibration")
    if batches is not None and not batches:
        raise ValueError("calibration is empty: give image batches (a few hundred training images), or None")
    shape = tuple(example_input.shape[1:])
    if batches is not None and not all(isinstance(b, torch.Tensor) and b.ndim == 4 and tuple(b.shape[1:]) == shape
                                       for b in batches):
        raise ValueError(f"calibration must be image batches shaped like example_input, (B, {', '.join(map(str, shape))}), "
                         "preprocessed the same way")
    for images, name in [(example_input, "example_input images"), *((b, "calibration images") for b in batches or [])]:
        check_image_batch(images, name)  # uint8 pixels were cast and used as they were
    batches = None if batches is None else [b.float() for b in batches]
    return example_input.float(), batches, _checked_evaluation(evaluation, precision, shape)


def _checked_evaluation(evaluation: Iterable[torch.Tensor] | None, precision: str,
                        shape: tuple[int, ...]) -> list[torch.Tensor] | None:
    """``evaluation``'s batches as float32, checked: for ``precision="auto"`` only, not empty, each batch shaped like
    the example input (``shape``: ``(C, H, W)``)."""
    if evaluation is None:
        return None
    if precision != "auto":
        raise ValueError("evaluation= is for precision='auto' (the images its reduced paths are judged on); to "
                         "judge a fixed precision, compare its logits with fp32 (cgavit.deploy.compare_logits)")
    batches = image_batches(evaluation, "evaluation")
    if not batches:
        raise ValueError("evaluation is empty: give image batches the model was not trained on, or None")
    if not all(isinstance(b, torch.Tensor) and b.ndim == 4 and tuple(b.shape[1:]) == shape for b in batches):
        raise ValueError(f"evaluation must be image batches shaped like example_input, (B, {', '.join(map(str, shape))}), "
                         "preprocessed the same way")
    for b in batches:
        check_image_batch(b, "evaluation images")
    return [b.float() for b in batches]


def _warn_if_slow(precision: str, features: CpuFeatures, calibration: list[torch.Tensor] | None) -> None:
    message = precision_warning(precision, features)
    if precision == "int8" and calibration is None:
        message = ((message + "; also: ") if message else "") + (
            "int8 is calibrated on the example input alone: give calibration= a few hundred real training images")
    if message:
        warnings.warn(f"optimize: {message}", RuntimeWarning, stacklevel=3)


def _build(
    fused: nn.Module, example_input: torch.Tensor, precision: str, backend: str,
    calibration: list[torch.Tensor] | None, opts: dict, float_part: str = "fp32",
) -> RuntimeModule:
    """The ``precision``/``backend`` form of ``fused`` (which the torch path rewrites in place); OpenVINO's int8
    with its float part in ``float_part``."""
    start = time.perf_counter()
    if backend == "onnxruntime":
        result = onnxruntime_path(fused, example_input, precision, calibration)
    elif backend == "openvino":
        result = openvino_path(fused, example_input, precision, calibration, float_part)
    elif backend == "triton":
        result = _triton_path(fused, example_input, precision, opts["compile"], opts["channels_last"])
    else:
        result = _torch_path(fused, example_input, precision, **opts)
    log.info("optimize: %s %s path ready in %.1f s", precision, backend, time.perf_counter() - start)
    return result


def _torch_path(
    fused: nn.Module, example_input: torch.Tensor, precision: str, compile: bool, channels_last: bool,
    fast_attention: bool,
) -> OptimizedModel:
    """``fused`` with the fast modules, in the precision's dtype and memory format, compiled on the example."""
    inner = swap_fast_modules(fused, fold_residuals=precision == "fp32") if fast_attention else fused
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    inner = inner.to(dtype=dtype)
    if channels_last:
        inner = inner.to(memory_format=torch.channels_last)
    if compile:
        inner = compiled(inner)
    result = OptimizedModel(inner, dtype, channels_last, precision).eval()
    result(example_input)  # compiles now, not on the user's first call
    return result


def compiled(inner: nn.Module) -> nn.Module:
    """``inner`` under ``torch.compile`` with frozen weights, specialised to each input shape it meets (``dynamic=False``):
    a call of another batch or image size than the example compiles again, about as long as the first, where torch's
    default would compile a dynamic-shape graph at the second shape, many times longer (M0 met at 64 then 96 px, on a
    busy 2-core AMD EPYC Zen 4: 12 minutes for that graph, under 2 for the static one)."""
    return torch.compile(inner, dynamic=False, options={"freezing": True})


def _triton_path(
    fused: nn.Module, example_input: torch.Tensor, precision: str, compile: bool, channels_last: bool
) -> OptimizedModel:
    """``fused`` with every window attention run by the fused Triton kernel (:mod:`cgavit.kernels`),
    in the precision's dtype, channels-last, and inductor for the rest on a GPU.

    On the CPU the kernels run only in Triton's interpreter (``TRITON_INTERPRET=1`` set before cgavit
    loads them), in fp32 and without ``torch.compile``: that is how the tests check them."""
    if not triton_available():
        raise ValueError("backend='triton' needs triton (it comes with CUDA builds of torch, or pip install triton)")
    module = load_kernels()
    on_gpu = example_input.device.type == "cuda"
    if not on_gpu and not interpreted():
        raise ValueError(
            "backend='triton' runs on a CUDA GPU; on the CPU only in Triton's interpreter (set "
            "TRITON_INTERPRET=1 before importing cgavit, for testing); use backend='torch' or 'onnxruntime' here"
        )
    if not on_gpu and precision != "fp32":
        raise ValueError(f"backend='triton' on the CPU (interpreter) checks fp32 only, got precision {precision!r}")
    dtype = _DTYPES[precision]
    inner = module.swap_triton_modules(fused).to(device=example_input.device, dtype=dtype)
    if channels_last:
        inner = inner.to(memory_format=torch.channels_last)
    if compile and on_gpu:
        inner = compiled(inner)
    result = OptimizedModel(inner, dtype, channels_last, precision).eval()
    result(example_input)  # compiles now, not on the user's first call
    return result


def checked_logits(model: nn.Module, images: torch.Tensor) -> torch.Tensor:
    """``model(images)`` without autograd and, on a GPU, with TF32 off (:func:`~cgavit.testing.full_fp32`; torch's
    default rounds float32 convolutions to TF32, ~1e-3 relative): both sides of the fp32 check at 1e-5."""
    with torch.no_grad(), full_fp32():
        return model(images)


def _check(result: nn.Module, example_input: torch.Tensor, reference: torch.Tensor, precision: str) -> float:
    """Relative error of ``result`` against the fused model's ``reference`` logits, both :func:`checked_logits`;
    raises above tolerance, and where the error is not finite (a check that cannot fail is no check)."""
    err = rel_err(checked_logits(result, example_input), reference)
    log.info("optimize: relative error vs the fused model %.2e (tolerance %.0e)", err, TOLERANCE[precision])
    if not math.isfinite(err):
        raise _not_finite("example_input")
    if err > TOLERANCE[precision]:
        raise RuntimeError(
            f"the {precision} path differs from the fused fp32 model by {err:.2e} (relative), above its "
            f"tolerance {TOLERANCE[precision]:.0e}; run optimize(..., check=False) to keep it anyway"
        )
    return err


def _optimize_auto(
    model: nn.Module, example_input: torch.Tensor, calibration: list[torch.Tensor] | None,
    features: CpuFeatures | None, check: bool, opts: dict, artifact: QuantizedArtifact | None = None,
    evaluation: list[torch.Tensor] | None = None,
) -> RuntimeModule:
    """``precision="auto"``: the first path of the CPU's rule-table row that meets the agreement target on the
    ``evaluation`` images (else the calibration images, else the example); its reason names the paths passed over."""
    _check_artifact_fits(model, example_input, artifact)
    if features is None:  # a GPU
        candidates, passed = [PathChoice("fp32", "torch", "cuda", "on a GPU auto runs fp32 torch")], []
    else:
        row = (features, calibration is not None, backend_available, artifact.runtime if artifact else None)
        candidates, passed = auto_candidates(*row), untried_paths(*row)
    where = "the evaluation images" if evaluation else "the calibration images" if calibration else "the example input"
    images = torch.cat(evaluation or calibration or [example_input])
    reference = batched_logits(fused_fp32(model), images)
    if not torch.isfinite(reference).all():
        raise _not_finite(where)
    in_row = artifact is not None and ("int8", artifact.runtime) in [(c.precision, c.backend) for c in candidates]
    unused = "this CPU's rule-table row does not run it" if artifact is not None and not in_row else None
    for cand in candidates:
        given = artifact is not None and (cand.precision, cand.backend) == ("int8", artifact.runtime)
        if given and (why := artifact.distrusted_on(features)):
            unused = why
            passed.append(f"{artifact.describe()} ({unused})")
            continue
        # where bf16 is native, int8 OpenVINO runs what it leaves float in bf16: faster, and judged like any path
        openvino_int8 = features is not None and (cand.precision, cand.backend) == ("int8", "openvino")
        part = fastest_float_part(features) if openvino_int8 else "fp32"
        result = artifact.module if given else _build(fused_fp32(model), example_input, cand.precision, cand.backend,
                                                       calibration, opts, part)
        agreement = None if cand.precision == "fp32" else compare_logits(batched_logits(result, images), reference)
        if agreement is None or agreement.meets_target:
            cand = PathChoice(cand.precision, cand.backend, cand.cpu_class, f"{cand.reason}; {artifact.describe()}") \
                if given else cand
            result.choice = _with_measurement(cand, agreement, where, passed)
            break
        log.info("optimize auto: %s %s skipped, %s", cand.precision, cand.backend, agreement.describe())
        passed.append(f"{cand.precision} {cand.backend} ({agreement.describe()})")
        if given:
            unused = f"on {where} {agreement.describe()}"
    log.info("optimize auto: chose %s", result.choice.describe())
    _warn_if_artifact_unused(artifact, result, unused)
    if check:
        with full_fp32():  # as checked_logits: not TF32 on a GPU
            result.rel_err = rel_err(checked_logits(result, example_input), batched_logits(fused_fp32(model), example_input))
    return result


def _check_artifact_fits(model: nn.Module, example_input: torch.Tensor, artifact: QuantizedArtifact | None) -> None:
    """Refuse an artifact made for another image size or another model (its image channels, its number of logits)."""
    if artifact is None:
        return
    if tuple(example_input.shape[2:]) != tuple(artifact.img_size):
        h, w = artifact.img_size
        raise ValueError(f"the quantized artifact takes {h}x{w} images, the example input is {example_input.shape[2]}x"
                         f"{example_input.shape[3]}: give an example of {h}x{w} images, or quantize the model again at "
                         f"this size (cgavit quantize --img-size)")
    inputs, channels = getattr(artifact.module, "input_shape", None), getattr(model, "in_chans", None)
    if inputs and len(inputs) == 4 and None not in (inputs[1], channels) and inputs[1] != channels:
        raise ValueError(f"the quantized artifact takes {inputs[1]}-channel images and the model {channels}-channel "
                         "ones: it is another model's file; give the one cgavit quantize wrote for this model")
    outputs = getattr(artifact.module, "output_shape", None)
    classes = model_classes(model)
    if outputs and outputs[-1] is not None and classes is not None and outputs[-1] != classes:
        raise ValueError(f"the quantized artifact returns {outputs[-1]} logits and the model {classes}: it is another "
                         "model's file; give the one cgavit quantize wrote for this model")


def _warn_if_artifact_unused(artifact: QuantizedArtifact | None, result: RuntimeModule, unused: str | None) -> None:
    """The artifact was asked for by name: when ``auto`` took another path, say why."""
    if artifact is None or result is artifact.module:
        return
    if unused is None:  # a path before it was taken
        unused = (f"{result.choice.precision} {result.choice.backend} comes before it in this CPU's rule-table row "
                  "and met the target")
    warnings.warn(f"optimize: the quantized artifact was not used ({unused}); chose {result.choice.precision} "
                  f"{result.choice.backend}", RuntimeWarning, stacklevel=4)


def _not_finite(where: str) -> ValueError:
    return ValueError(f"the model's logits on {where} are not finite (NaN or inf), so no path can be checked against "
                      "them: check the weights and the images")


def _with_measurement(choice: PathChoice, agreement: Agreement | None, where: str, passed: list[str]) -> PathChoice:
    """``choice`` with its measurement on ``where`` and the paths passed over before it added to its reason."""
    reason = choice.reason if agreement is None else f"{choice.reason}; measured on {where}: {agreement.describe()}"
    if passed:
        reason += f"; passed over: {'; '.join(passed)}"
    return PathChoice(choice.precision, choice.backend, choice.cpu_class, reason)
