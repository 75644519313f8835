"""Inference forms of a model: BatchNorm folding, the fast path, reduced precision picked for the CPU,
and the runtimes people ship to.

``fuse`` is the reference inference form; every faster form here is checked against it.

* :func:`fuse` (``fusion``) -- every BatchNorm folded into its conv or linear layer;
  :func:`export_form` -- what every export writes: ``fuse``, then the inference modules of
  :mod:`cgavit.fast` specialised to one image size (no shape arithmetic left in the graph).
* :func:`optimize` (``fastpath``) -- the fastest form in one call: torch (``torch.compile`` with the
  inference attention of :mod:`cgavit.fast`), ONNX Runtime or OpenVINO; fp32, bf16, int8, or
  ``precision="auto"``: picked for this CPU by the rule table of ``auto`` from the features ``cpu``
  reads (AMX, avx512_bf16, VNNI, AVX2).
* ``agreement`` -- the target reduced precision is held to: top-1 agreement with fp32 >= 99.5 %,
  accuracy within 0.5 point.
* :func:`quantize` (``quantize``) -- the fastest int8 build that meets a user's target (default
  agreement >= 99.5 %, accuracy within 0.3 point), with the layers kept in float found by per-layer
  sensitivity (``sensitivity``); the int8 recipe per CPU (``int8``); quantisation-aware fine-tuning
  (``qat``, PT2E) when post-training falls short.
* ``metadata`` -- what an exported file carries (class names, preprocessing, version) and
  :func:`open_exported`, which opens a file as a callable model with it.
* ``formats`` -- ``cgavit export --format onnx|openvino|executorch|tflite``: :func:`export_model`,
  :func:`load_exported`; one module per runtime (``onnx``, ``openvino``, ``executorch``, ``tflite``),
  each importing its optional extra in one place, on first use. Every runtime is wrapped as a
  :class:`RuntimeModule`, called like the model.
"""

from .agreement import (
    ACCURACY_TOLERANCE,
    AGREEMENT_TARGET,
    QUANTIZE_ACCURACY_TOLERANCE,
    Agreement,
    NoiseFloor,
    compare_logits,
    noise_floor,
)
from .auto import AUTO_RULES
from .cpu import CpuFeatures, cpu_features
from .fastpath import BACKENDS, PRECISIONS, OptimizedModel, optimize
from .formats import (
    EXPORT_TOLERANCE,
    FORMATS,
    ParityCheck,
    check_parity,
    export_model,
    load_exported,
    open_exported,
)
from .fusion import export_form, fuse
from .int8 import Int8Options
from .metadata import ExportInfo
from .qat import QatConfig, quantize_aware
from .quantize import QuantizeResult, QuantizeTarget, quantize
from .runtime import PathChoice, RuntimeModule
from .sensitivity import CurvePoint, LayerSensitivity

__all__ = [
    "ACCURACY_TOLERANCE",
    "AGREEMENT_TARGET",
    "AUTO_RULES",
    "BACKENDS",
    "EXPORT_TOLERANCE",
    "FORMATS",
    "PRECISIONS",
    "QUANTIZE_ACCURACY_TOLERANCE",
    "Agreement",
    "CpuFeatures",
    "CurvePoint",
    "ExportInfo",
    "Int8Options",
    "LayerSensitivity",
    "NoiseFloor",
    "OptimizedModel",
    "ParityCheck",
    "PathChoice",
    "QatConfig",
    "QuantizeResult",
    "QuantizeTarget",
    "RuntimeModule",
    "check_parity",
    "compare_logits",
    "cpu_features",
    "export_form",
    "export_model",
    "fuse",
    "load_exported",
    "noise_floor",
    "open_exported",
    "optimize",
    "quantize",
    "quantize_aware",
]
