"""``precision="auto"``: the rule table that picks a path per CPU class, and the warnings for paths
that are slow or unsupported on this CPU.

How "the fastest path that meets the target" is decided: not by timing inside ``optimize`` (that
would cost seconds per call and be at the mercy of the machine's load) but by a **rule table per
CPU class** (:data:`AUTO_RULES`), ordered by the throughput measured in BENCHMARKS.md ("deploy").
A class that was not measured gets the conservative order noted in :data:`RULE_EVIDENCE`.
``optimize`` then walks the class's list: a path is skipped when its backend is not installed or,
for int8, when no calibration images are given; a reduced-precision path is built and kept only if
its top-1 agreement with fp32 on the check images (the calibration images, else the example input)
meets :data:`~cgavit.deploy.agreement.AGREEMENT_TARGET`; fp32 always qualifies.
"""

from __future__ import annotations

from collections.abc import Callable

from .agreement import AGREEMENT_TARGET
from .cpu import CpuFeatures
from .runtime import PathChoice

#: For each CPU class (:data:`cgavit.deploy.cpu.CPU_CLASSES`, one row each): the ``(precision, backend)`` paths
#: ``precision="auto"`` tries, fastest first.
AUTO_RULES: dict[str, tuple[tuple[str, str], ...]] = {
    "amx": (("int8", "openvino"), ("bf16", "openvino"), ("int8", "onnxruntime"), ("bf16", "torch"),
            ("fp32", "onnxruntime"), ("fp32", "openvino"), ("fp32", "torch")),
    "avx512_bf16": (("int8", "openvino"), ("int8", "onnxruntime"), ("bf16", "openvino"), ("bf16", "torch"),
                    ("fp32", "onnxruntime"), ("fp32", "openvino"), ("fp32", "torch")),
    "avx512": (("int8", "onnxruntime"), ("fp32", "onnxruntime"), ("fp32", "torch")),
    "avx2": (("int8", "openvino"), ("int8", "onnxruntime"), ("fp32", "onnxruntime"), ("fp32", "openvino"),
             ("fp32", "torch")),
    "other": (("fp32", "onnxruntime"), ("fp32", "torch")),
}

#: Where each row's order comes from.
RULE_EVIDENCE: dict[str, str] = {
    "amx": "order measured on an Intel Xeon with AMX, M4 at 224 px (BENCHMARKS.md, int8 on AMX): int8 OpenVINO "
           "with its float part in bf16 3.0-3.1x fp32 ONNX Runtime, bf16 OpenVINO 2.8x, int8 ONNX Runtime 1.8x, "
           "fp32 OpenVINO 1.0x (deploy: bf16 torch.compile 1.8x fp32 torch.compile, fp32 ONNX Runtime 1.5x)",
    "avx512_bf16": "order measured on two AMD EPYCs with avx512_bf16 and VNNI, no AMX (Zen 5, Zen 4), M4 at 224 px, "
                   "8-bit int8 weights (BENCHMARKS.md, int8 on AVX-512 with bf16): int8 OpenVINO 2.4-2.7x fp32 ONNX Runtime "
                   "(its float part in bf16 2.5-2.8x), int8 ONNX Runtime 2.1-2.3x, bf16 OpenVINO 1.7-1.9x, bf16 torch.compile "
                   "1.1-1.35x, fp32 OpenVINO 0.9-1.0x",
    "avx512": "not measured on this class: int8 (VNNI) then fp32; no native bf16",
    "avx2": "order measured on an AVX2-only AMD EPYC, M4 at 224 px, 7-bit int8 weights (BENCHMARKS.md, int8 on "
            "AVX2): int8 OpenVINO 2.1x timm's traced port, int8 ONNX Runtime 1.9x, fp32 ONNX Runtime 1.5x, fp32 "
            "OpenVINO 1.3x; bf16 12x slower than fp32",
    "other": "no measurement for this CPU: fp32 only",
}

def auto_candidates(
    features: CpuFeatures, calibration_given: bool, available: Callable[[str, str], bool],
    quantized_runtime: str | None = None,
) -> list[PathChoice]:
    """The paths ``auto`` may take on this CPU, in the order it tries them, each with its reason.

    Args:
        features: the CPU (:func:`cgavit.deploy.cpu.cpu_features`).
        calibration_given: whether calibration images were given (int8 needs them, unless quantized).
        available: whether a backend (``"torch"``, ``"onnxruntime"``, ``"openvino"``) is installed and imports for a
            precision, called ``available(backend, precision)`` (OpenVINO's int8 needs NNCF, its fp32 and bf16 do not).
        quantized_runtime: the runtime of a quantised artifact given to ``auto`` (``cgavit quantize``'s):
            on a class whose row uses int8 its int8 path is tried with the artifact, in its row's place
            (or before the first non-int8 path when the row lacks it), calibration or not.
    """
    cls = features.cpu_class
    out = []
    for precision, backend, why_not in _row(features, calibration_given, available, quantized_runtime):
        if why_not:
            continue
        reason = f"CPU {features.describe()}; {RULE_EVIDENCE[cls]}"
        if precision == "int8" and backend == quantized_runtime:
            reason += "; the quantized artifact given, kept if its recorded verdict meets the target"
        if precision != "fp32":
            reason += f"; kept only with top-1 agreement >= {100 * AGREEMENT_TARGET:.1f}% against fp32"
        out.append(PathChoice(precision, backend, cls, reason))
    return out


def untried_paths(
    features: CpuFeatures, calibration_given: bool, available: Callable[[str, str], bool],
    quantized_runtime: str | None = None,
) -> list[str]:
    """The paths of this CPU's row that :func:`auto_candidates` leaves out, each with why (same arguments)."""
    return [f"{precision} {backend} ({why_not})"
            for precision, backend, why_not in _row(features, calibration_given, available, quantized_runtime) if why_not]


def _row(
    features: CpuFeatures, calibration_given: bool, available: Callable[[str, str], bool], quantized_runtime: str | None,
) -> list[tuple[str, str, str | None]]:
    """The CPU's row as ``(precision, backend, why it is not tried or None)``."""
    out = []
    for precision, backend in _with_artifact(AUTO_RULES[features.cpu_class], quantized_runtime):
        artifact = precision == "int8" and backend == quantized_runtime
        why_not = None
        if precision == "int8" and not calibration_given and not artifact:
            why_not = "not tried: int8 needs calibration= images or a quantized= file" + (
                f" of this runtime (the one given is {quantized_runtime}'s)" if quantized_runtime else "")
        elif not available(backend, precision):
            why_not = f"not tried: {backend} is not installed or fails to import"
        out.append((precision, backend, why_not))
    return out


def _with_artifact(row: tuple[tuple[str, str], ...], runtime: str | None) -> list[tuple[str, str]]:
    """``row`` with ``("int8", runtime)`` in it when the row uses int8 at all (else unchanged)."""
    paths = list(row)
    if runtime is None or ("int8", runtime) in paths or not any(p == "int8" for p, _ in paths):
        return paths
    first_other = next(i for i, (p, _) in enumerate(paths) if p != "int8")
    return paths[:first_other] + [("int8", runtime)] + paths[first_other:]


def precision_warning(precision: str, features: CpuFeatures) -> str | None:
    """Why ``precision``, asked for explicitly, is slow or unsupported on this CPU; None when it is fine."""
    if precision == "bf16" and not features.native_bf16:
        return (f"bf16 asked for on a CPU without native bf16 ({features.describe()}: no avx512_bf16 or AMX): "
                "every bf16 operation converts to and from fp32, and on an AVX2-only AMD EPYC this path ran 12x "
                "slower than fp32; use precision='fp32', or 'auto' to pick by CPU")
    if precision == "int8" and not (features.vnni or features.avx2):
        return (f"int8 asked for on a CPU without int8 dot products or AVX2 ({features.describe()}): the "
                "quantised kernels fall back to slow generic code; use precision='fp32'")
    return None
