"""int8 post-training quantisation: the choices both runtimes share, and the layers they name alike.

Both runtimes quantise the same thing, the export form's convolutions (weights per output channel,
symmetric int8; activations per tensor, asymmetric uint8, ranges from calibration images), and keep
the attention core (score -> softmax -> PV matmuls) and the residual adds in float. What differs
per CPU is the weight range:

* **x86 without VNNI** (AVX2, AVX-512 without VNNI): the uint8 x int8 kernels of ONNX Runtime (MLAS)
  and OpenVINO (oneDNN) add pairs of products into a 16-bit register (``vpmaddubsw``), which
  saturates when both products are large (255 x 127 x 2 > 32767): on the trained digits model this
  alone changed 8 % of the decisions. With 7-bit weights (ONNX Runtime's ``reduce_range``, NNCF's
  ``OverflowFix.ENABLE``) a pair sums to at most 255 x 63 x 2 = 32130 and nothing saturates.
* **VNNI, AMX and Arm** accumulate in 32 bits: the full 8-bit range is kept (on emulated Arm cores with and without
  dot products the 8-bit files kept their decisions; BENCHMARKS.md, int8 on emulated Arm cores).

The choice is written into an exported file's metadata, and a full-range file opened on a CPU that
would saturate it gets a warning (:func:`weight_range_warning`).

What int8 leaves in float (the layers kept float, the attention core, the residual adds) is the
*float part*. ONNX Runtime runs it in fp32. OpenVINO runs it in the inference precision it is compiled
with, and on a CPU with native bf16 (AMX, ``avx512_bf16``) its default is bf16: the same int8 file then
decides differently (on the CIFAR-10 96 px reference, an OpenVINO build judged at 99.50 % with an fp32
float part kept 99.25 % with a bf16 one) and runs faster (M4 at 224 px on an AMX Xeon, the references'
float layers: 2.93-2.95x fp32 ONNX Runtime against 2.15-2.16x; BENCHMARKS.md, int8 on AMX). So an OpenVINO build's float part is part of the build: it is
judged in it, written into the file's metadata (``float_part``), and compiled in it by cgavit's loader.

A third float part sits between them: ``"bf16-layers"`` runs the *float layers* in bf16 (the file's graph
converts their inputs and weights to bf16) and the attention core and residual adds in fp32 (the file is
compiled in fp32). The float layers are where an fp32 float part costs its speed (on the CIFAR-10 64 px
reference five of them took M4 from 2.75-2.78x fp32 ONNX Runtime every layer int8 to 2.12-2.14x on the AMX
Xeon), and the residual stream is where a bf16 one costs its decisions (on that reference no bf16-float-part
build met the target, even with every layer float: 99.3 %; BENCHMARKS.md, int8 on AMX).

An f16 float part (11 bits of mantissa where bf16 has 8; offered by OpenVINO where the CPU has ``avx512_fp16``) is
not offered: OpenVINO 2026.4.1 runs no int8 file with it (an empty output, or a convolution "not initialized"),
and f16 convolutions in the graph of an fp32 compile run in fp32 (docs/benchmarks-log.md, eighth AMX session).

One layer is rounded its own way: OpenVINO's builds round the first convolution's weights with GPTQ on the
calibration images (:mod:`cgavit.deploy.first_layer`; on a trained CIFAR-10 model on an AMX Xeon that layer alone int8 changed 5
decisions of 2,000 so, 26 with NNCF's rounding); ONNX Runtime's builds round it like any other.

A *layer* is named by the qualified name of its ``nn.Conv2d`` in the export form
(``stages.0.blocks.0.mixer.m.attn.k.0``), which both runtimes' node names carry.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..io import require_flag
from .cpu import CpuFeatures

#: Where activation ranges come from: the calibration images' min/max, a percentile of their
#: histogram (99.999 %), or the range that minimises the KL divergence of the quantised histogram.
CALIBRATION_METHODS = ("minmax", "percentile", "entropy")
#: OpenVINO (NNCF) bias correction: the full one (per layer, on the calibration images), the fast one, none.
BIAS_CORRECTIONS = ("full", "fast", "none")
#: ONNX Runtime's weight type: signed int8 (U8S8 kernels; 7-bit where they would saturate), or uint8
#: (U8U8 kernels: 8-bit weights that do not saturate on AVX2 either, slower; BENCHMARKS.md).
WEIGHT_TYPES = ("int8", "uint8")
#: The precision of an OpenVINO int8 build's float part (see the module notes); ONNX Runtime's is fp32.
#: ``"bf16-layers"``: the float layers in bf16 (bf16 convolutions in the graph), the rest of the float part in fp32.
FLOAT_PARTS = ("fp32", "bf16", "bf16-layers")


@dataclass(frozen=True)
class Int8Options:
    """How one int8 post-training quantisation is made.

    Args:
        calibration: one of :data:`CALIBRATION_METHODS` (default ``"percentile"``: on the CIFAR-10 reference it
            needed the fewest layers in float, BENCHMARKS.md).
        reduce_range: 7-bit weights; None (default): decided by the CPU (:func:`reduced_weight_range`).
        float_layers: layers (qualified conv names of the export form) kept in float.
        attention_float: keep the attention core (its matmuls and softmax) and the residual adds in
            float (default). ONNX Runtime quantises convolutions only, so this matters to OpenVINO;
            with ``False`` NNCF quantises its matmuls too.
        bias_correction: OpenVINO's, one of :data:`BIAS_CORRECTIONS` (default ``"full"``).
        weights: ONNX Runtime's weight type, one of :data:`WEIGHT_TYPES` (default ``"int8"``;
            ``reduce_range`` applies to int8 only). OpenVINO always uses int8.
        gptq_first_layer: OpenVINO's builds round the first convolution's weights with GPTQ on the calibration
            images (default; :mod:`cgavit.deploy.first_layer`); False: NNCF's rounding, as for every other layer.

    Raises:
        ValueError: a method or type not offered. TypeError: a switch not True or False (``"no"`` would turn it on),
            ``float_layers`` not a tuple (or list) of names.
    """

    calibration: str = "percentile"
    reduce_range: bool | None = None
    float_layers: tuple[str, ...] = ()
    attention_float: bool = True
    bias_correction: str = "full"
    weights: str = "int8"
    gptq_first_layer: bool = True

    def __post_init__(self) -> None:
        # a switch given as text ("no") is truthy, and a layer name given alone was read as its letters
        for name in ("attention_float", "gptq_first_layer", *(("reduce_range",) if self.reduce_range is not None else ())):
            require_flag(getattr(self, name), name)
        layers = self.float_layers
        if isinstance(layers, str) or not isinstance(layers, (tuple, list)) or not all(isinstance(n, str) for n in layers):
            raise TypeError(f"float_layers must be a tuple of layer names, e.g. ('blocks1.0.mixer.m.attn.proj.1',), got "
                            f"{layers!r}")
        object.__setattr__(self, "float_layers", tuple(layers))  # a list too, kept hashable
        if self.weights not in WEIGHT_TYPES:
            raise ValueError(f"weights must be one of {', '.join(WEIGHT_TYPES)}, got {self.weights!r}")
        if self.calibration not in CALIBRATION_METHODS:
            raise ValueError(f"calibration must be one of {', '.join(CALIBRATION_METHODS)}, got {self.calibration!r}")
        if self.bias_correction not in BIAS_CORRECTIONS:
            raise ValueError(f"bias_correction must be one of {', '.join(BIAS_CORRECTIONS)}, got {self.bias_correction!r}")

    def for_cpu(self, features: CpuFeatures) -> Int8Options:
        """These options with ``reduce_range`` decided for ``features`` when it was left to the CPU."""
        if self.reduce_range is not None:
            return self
        return replace(self, reduce_range=reduced_weight_range(features))

    def with_float(self, layers) -> Int8Options:
        """These options with ``layers`` (an iterable of layer names) kept in float instead."""
        return replace(self, float_layers=tuple(layers))


def reduced_weight_range(features: CpuFeatures) -> bool:
    """Whether int8 weights must use 7 bits on this CPU: x86 (AVX2 or AVX-512) without VNNI, where
    the uint8 x int8 kernels saturate (see the module notes)."""
    return (features.avx2 or features.avx512) and not features.vnni


def fastest_float_part(features: CpuFeatures) -> str:
    """The faster float part of OpenVINO's int8 on this CPU: bf16 where it computes bf16 natively, else fp32."""
    return "bf16" if features.native_bf16 else "fp32"


def float_parts_for_cpu(features: CpuFeatures, asked: str = "auto") -> tuple[str, ...]:
    """The float parts OpenVINO's int8 builds are searched in: ``asked`` (one of :data:`FLOAT_PARTS`) or, for
    ``"auto"``, fp32, and the bf16 ones too where the CPU computes bf16 natively (elsewhere it would be emulated).

    Raises:
        ValueError: an unknown value, or a bf16 one asked for on a CPU without native bf16.
    """
    if asked not in ("auto", *FLOAT_PARTS):
        raise ValueError(f"the float part must be auto or one of {', '.join(FLOAT_PARTS)}, got {asked!r}")
    if asked != "fp32" and asked != "auto" and not features.native_bf16:
        raise ValueError(f"a {asked} float part needs native bf16 (AMX or avx512_bf16), and this CPU has none "
                         f"({features.describe()}); use fp32 (or auto)")
    if asked != "auto":
        return (asked,)
    return FLOAT_PARTS if features.native_bf16 else ("fp32",)


def compile_precision(float_part: str) -> str:
    """The precision OpenVINO compiles an int8 file with a ``float_part`` float part in: bf16 for ``"bf16"``; fp32
    otherwise (``"bf16-layers"`` carries its bf16 in the graph)."""
    return "bf16" if float_part == "bf16" else "fp32"


def float_part_warning(float_part: str, features: CpuFeatures) -> str | None:
    """Why an int8 OpenVINO file judged with a ``float_part`` float part will not run as judged on this CPU; None if fine."""
    if float_part != "fp32" and not features.native_bf16:
        return (f"this int8 file was judged with its float part in {float_part}, and this CPU ({features.describe()}) has "
                "no native bf16: OpenVINO does not run that part as it was judged (it falls back to fp32 or "
                "emulates bf16), so the recorded verdict does not hold here; quantize again on this CPU (cgavit quantize)")
    return None


def architecture_warning(recorded: str, here: str) -> str | None:
    """Why an int8 file's recorded verdict, measured on a ``recorded`` CPU (its instruction set), does not vouch for
    its decisions on this one (``here``); None where they are the same, or nothing was recorded."""
    if not recorded or recorded == here:
        return None
    return (f"this int8 file was judged on an {recorded} CPU, and this one is {here}: the two run different int8 "
            "kernels (the CIFAR-10 reference's int8 file decided 9 of 2,000 images differently on an x86 Xeon and on "
            "an emulated Arm core), so its recorded agreement does not carry over; judge it here (cgavit eval "
            "--checkpoint FILE), or quantize on this CPU (cgavit quantize)")


def weight_range_label(reduce_range: bool, weights: str = "int8") -> str:
    """How an exported file's metadata names its weights: ``"7-bit"``, ``"8-bit"`` (signed), or
    ``"8-bit unsigned"`` (ONNX Runtime's U8U8, which does not saturate)."""
    if weights == "uint8":
        return "8-bit unsigned"
    return "7-bit" if reduce_range else "8-bit"


def weight_range_warning(label: str, features: CpuFeatures) -> str | None:
    """Why a file with weights of ``label`` (``"7-bit"``/``"8-bit"``) may decide wrongly on this CPU; None if fine."""
    if label == "8-bit" and reduced_weight_range(features):
        return (f"this int8 file has full 8-bit weights, and this CPU ({features.describe()}) has no VNNI: its "
                "uint8 x int8 kernels saturate on such weights (on the digits model 8 % of decisions changed); "
                "quantize again on this CPU (cgavit quantize) to get 7-bit weights")
    return None


def layer_of_onnx_node(name: str) -> str:
    """The layer name of an ONNX node exported by torch's TorchScript exporter:
    ``/stages/stages.0/blocks/blocks.0/pre/pre.0/m/Conv`` -> ``stages.0.blocks.0.pre.0.m``.

    Each scope level is written as its attribute name, a list item's as ``list.index`` after the
    list's own level, which it replaces.
    """
    parts: list[str] = []
    for part in name.strip("/").split("/")[:-1]:  # the last part is the operator
        if parts and part.startswith(parts[-1] + "."):
            parts[-1] = part
        else:
            parts.append(part)
    return ".".join(parts)


def layer_of_openvino_node(name: str) -> str | None:
    """The layer name of an OpenVINO node converted from PyTorch
    (``__module.stages.0.blocks.0.pre.0.m/aten::_convolution/GroupConvolution`` -> ``stages.0.blocks.0.pre.0.m``);
    None for a node that is not a module's convolution."""
    head, sep, rest = name.partition("/aten::_convolution/")
    if not sep or not head.startswith("__module.") or "/" in rest:
        return None
    return head[len("__module."):]
