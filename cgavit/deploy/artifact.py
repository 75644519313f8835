"""A quantised artifact handed to ``optimize(precision="auto", quantized=...)``: a :class:`QuantizeResult`
or the file ``cgavit quantize`` wrote, with the verdict it was measured to.

``auto`` takes such an artifact on a CPU whose rule-table row uses int8 when its recorded verdict, on
the held-out images ``quantize`` judged it on, meets the general target of
:mod:`cgavit.deploy.agreement` (``quantize``'s default target is stricter, so its artifacts do) and
it still agrees with the model on the check images ``auto`` has (it is the model's artifact).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from .agreement import ACCURACY_TOLERANCE, AGREEMENT_TARGET, Agreement
from .cpu import CpuFeatures, architecture
from .int8 import architecture_warning, float_part_warning, weight_range_warning
from .formats import FORMATS, SUFFIX_FORMATS, open_exported
from .quantize import QuantizeResult, int8_module
from .runtime import RuntimeModule


@dataclass
class QuantizedArtifact:
    """An int8 build and what it was measured to keep.

    Args:
        module: the build, called like the model.
        runtime: ``"onnxruntime"`` or ``"openvino"``.
        img_size: ``(H, W)`` it accepts.
        verdict: what ``quantize`` recorded (``agreement``, ``accuracy_change``, ``evaluation_images``,
            ``meets_target``, ``measured_on``, ...).
        source: where it came from, for messages.
    """

    module: RuntimeModule
    runtime: str
    img_size: tuple[int, int]
    verdict: dict
    source: str

    @property
    def trusted(self) -> bool:
        """Its recorded verdict met ``quantize``'s target and the general one (agreement >= 99.5 %,
        accuracy within 0.5 point)."""
        return self.distrusted is None

    @property
    def distrusted(self) -> str | None:
        """Why ``auto`` may not take it on its record (None: :attr:`trusted`): it records no verdict (an int8 file
        ``cgavit export`` wrote), its recorded verdict misses ``quantize``'s target, or it met a looser target than the
        general one (what to run instead is said)."""
        v = self.verdict
        if "meets_target" not in v:
            return ("it records no verdict: written by cgavit export, not cgavit quantize; run cgavit quantize for a "
                    "file auto can use")
        agreement, change = v.get("agreement"), v.get("accuracy_change")
        if not v.get("meets_target") or not isinstance(agreement, (int, float)):
            return "its recorded verdict misses the target"
        looser = [f"top-1 agreement {self.agreement_shown()} (auto needs {100 * AGREEMENT_TARGET:g}% or more)"
                  ] if agreement < AGREEMENT_TARGET - 1e-9 else []
        if change is not None and abs(change) > ACCURACY_TOLERANCE + 1e-9:
            looser.append(f"accuracy change {change:+.2f} point (auto allows {ACCURACY_TOLERANCE:g})")
        if looser:
            return (f"it met a looser target than auto's: {' and '.join(looser)}; run cgavit quantize with --agreement "
                    f"{100 * AGREEMENT_TARGET:g} or more and --accuracy-tolerance {ACCURACY_TOLERANCE:g} or less")
        return None

    def distrusted_on(self, features: CpuFeatures) -> str | None:
        """Why ``auto`` deciding for ``features``' CPU may not take it on its record: :attr:`distrusted`, or its recorded
        verdict does not hold on that CPU (full 8-bit weights where the int8 kernels saturate, a bf16 float part without
        native bf16, or judged on another instruction set: the warnings :func:`~cgavit.deploy.formats.open_exported`
        gives). None: it may."""
        v = self.verdict
        unsuited = (weight_range_warning(str(v.get("weight_range", "")), features),
                    float_part_warning(str(v.get("float_part", "fp32")), features) if self.runtime == "openvino" else None,
                    architecture_warning(str(v.get("architecture", "")), architecture()))
        return self.distrusted or next((why for why in unsuited if why), None)

    def agreement_shown(self) -> str:
        """The recorded agreement as reports print it (:meth:`~cgavit.deploy.agreement.Agreement.shown`: rounded down
        to one image's resolution), e.g. ``"99.48%"``; ``"not recorded"``."""
        v = self.verdict
        agreement, n = v.get("agreement"), v.get("evaluation_images")
        if not isinstance(agreement, (int, float)):
            return "not recorded"
        n = n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else 10_000
        return f"{Agreement(n=n, top1_agreement=agreement, max_rel_err=0.0).shown()}%"

    def describe(self) -> str:
        v = self.verdict
        if "meets_target" not in v:  # distrusted says so
            return f"the int8 artifact {self.source}"
        shown = self.agreement_shown()
        which = "images held out of its search" if v.get("held_out_of_search") else "images its search was judged on"
        return (f"the int8 artifact {self.source} (cgavit quantize: top-1 agreement {shown} on "
                f"{v.get('evaluation_images', '?')} {which}, {len(v.get('float_layers', []))} layer(s) in "
                f"float, measured on {v.get('measured_on', 'an unrecorded CPU')})")


def quantized_artifact(quantized: QuantizeResult | str | os.PathLike) -> QuantizedArtifact:
    """The artifact of a :class:`QuantizeResult`, or of a file ``cgavit quantize`` wrote (``.onnx``/``.xml``).

    Raises:
        ValueError: not a result or such a file, not an int8 file, or no cgavit metadata.
    """
    if isinstance(quantized, QuantizeResult):  # a module of its own: optimize sets its choice and error
        module = int8_module(quantized.runtime, quantized.artifact, float_part=quantized.float_part)
        return QuantizedArtifact(module, quantized.runtime, quantized.info.img_size, dict(quantized.info.int8),
                                 "returned by quantize()")
    if not isinstance(quantized, (str, os.PathLike)):
        raise ValueError(f"quantized must be a QuantizeResult or the path of a file cgavit quantize wrote, "
                         f"got {type(quantized).__name__}")
    path = Path(quantized)
    module, info = open_exported(path)
    if info.precision != "int8":
        raise ValueError(f"{path.name} holds {info.precision}, not int8; quantized= takes an int8 file from cgavit quantize")
    runtime = FORMATS[SUFFIX_FORMATS[path.suffix.lower()]].backend
    return QuantizedArtifact(module, runtime, info.img_size, dict(info.int8), path.name)
