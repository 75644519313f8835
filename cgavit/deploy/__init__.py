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
    batched_logits,
    compare_logits,
)
from .auto import AUTO_RULES, RULE_EVIDENCE, auto_candidates, precision_warning
from .cpu import CPU_CLASSES, CpuFeatures, cpu_features, parse_cpuinfo
from .executorch import ExecutorchModule, executorch_available, export_executorch
from .fastpath import BACKENDS, OFFERED, PRECISIONS, TOLERANCE, OptimizedModel, backend_available, choose_backend, optimize
from .formats import (
    EXPORT_TOLERANCE,
    FORMATS,
    ExportFormat,
    ParityCheck,
    check_parity,
    export_model,
    load_exported,
    open_exported,
    require_format,
    runtime_path,
)
from .fusion import export_form, fuse
from .int8 import CALIBRATION_METHODS, Int8Options, reduced_weight_range
from .metadata import ExportInfo
from .onnx import OnnxInt8Builder, OnnxModule, export_onnx, onnxruntime_available, quantize_onnx
from .openvino import OpenVinoInt8Builder, OpenVinoModule, export_openvino, openvino_available
from .qat import QatConfig, qat_available, qat_finetune, quantize_aware
from .quantize import QUANT_RUNTIMES, QuantizeResult, QuantizeTarget, quantize
from .runtime import FixedBatchModule, PathChoice, RuntimeModule
from .sensitivity import CurvePoint, LayerSensitivity
from .tflite import TfliteModule, export_tflite, tflite_available

__all__ = [
    "ACCURACY_TOLERANCE",
    "AGREEMENT_TARGET",
    "AUTO_RULES",
    "BACKENDS",
    "CALIBRATION_METHODS",
    "CPU_CLASSES",
    "EXPORT_TOLERANCE",
    "FORMATS",
    "OFFERED",
    "PRECISIONS",
    "QUANTIZE_ACCURACY_TOLERANCE",
    "QUANT_RUNTIMES",
    "RULE_EVIDENCE",
    "TOLERANCE",
    "Agreement",
    "CpuFeatures",
    "CurvePoint",
    "ExecutorchModule",
    "ExportFormat",
    "ExportInfo",
    "FixedBatchModule",
    "Int8Options",
    "LayerSensitivity",
    "OnnxInt8Builder",
    "OnnxModule",
    "OpenVinoInt8Builder",
    "OpenVinoModule",
    "OptimizedModel",
    "ParityCheck",
    "PathChoice",
    "QatConfig",
    "QuantizeResult",
    "QuantizeTarget",
    "RuntimeModule",
    "TfliteModule",
    "auto_candidates",
    "backend_available",
    "batched_logits",
    "check_parity",
    "choose_backend",
    "compare_logits",
    "cpu_features",
    "executorch_available",
    "export_executorch",
    "export_form",
    "export_model",
    "export_onnx",
    "export_openvino",
    "export_tflite",
    "fuse",
    "load_exported",
    "onnxruntime_available",
    "open_exported",
    "openvino_available",
    "optimize",
    "parse_cpuinfo",
    "precision_warning",
    "qat_available",
    "qat_finetune",
    "quantize",
    "quantize_aware",
    "quantize_onnx",
    "reduced_weight_range",
    "require_format",
    "runtime_path",
    "tflite_available",
]
