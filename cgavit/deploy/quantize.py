"""``quantize``: the fastest int8 model that keeps a trained model's decisions, for the user's target.

For each runtime (ONNX Runtime, OpenVINO) the model is quantised with the recipe of
:mod:`cgavit.deploy.int8` (weights per channel, 7-bit on x86 without VNNI; the attention core and
residual adds in float) and judged on held-out images against fp32: top-1 agreement and accuracy
change (:class:`QuantizeTarget`, default agreement >= 99.5 % and accuracy within 0.3 point). Layers
whose int8 kernel is no faster than fp32 in the runtime's profiler on this CPU stay float in every
build (they cost no speed). When the rest in int8 misses, layers are kept in float, most sensitive
first in that runtime (:mod:`cgavit.deploy.sensitivity`), until the target is met; then each of them
goes back to int8 where the target holds without it, those int8 speeds up most first. On a CPU with native
bf16 OpenVINO is searched three times, with the float part (what int8 leaves in float) in fp32, in bf16
(OpenVINO's default there: faster, but it decides differently) and with only the float layers in bf16
(:mod:`cgavit.deploy.int8`); each search keeps layers float in the same order. Every build is timed round-robin beside
fp32 ONNX Runtime on this machine; the fastest build that meets the target is the result. When none
meets it, the result says so and names the best found, and :meth:`QuantizeResult.save` refuses it.

Calibration and evaluation images must differ (training images to calibrate, held-out ones to judge).
The evaluation images are then split in two at random, with a fixed seed (``holdout``, default half to
each): the sensitivity, the search and the pruning judge builds on the first part; the builds that meet
the target there are judged on the second, fewest float layers first, and the first that meets it there
too is the runtime's answer. When none does, the search goes on keeping more layers float (twice as many
each time, in the same order) until one meets it on both. The second part is consulted only in an order
fixed without it, to decide where to stop, so its figure is the one reported and written into the file. Pruning stops at the target's edge on the images it judges on (on the CIFAR-10
references every answer changed exactly the allowed number of decisions), so a figure from those
images is optimistic by construction.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import logging
import numbers
import os
import tempfile
import warnings
from typing import TYPE_CHECKING
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path

import torch
from torch import nn

from ..bounds import check_threads, is_whole
from ..io import atomic_write
from ..model import check_image_batch
from ..timing import other_load, round_robin
from .agreement import (
    AGREEMENT_TARGET, QUANTIZE_ACCURACY_TOLERANCE, Agreement, NoiseFloor, compare_logits, noise_floor,
)
from .cpu import CpuFeatures, architecture, cpu_features
from .formats import FORMATS, QUANT_RUNTIMES, runtime_format
from .fusion import check_classifier, check_model, fused_fp32, named_output
from .int8 import Int8Options, compile_precision, float_parts_for_cpu, weight_range_label
from .metadata import ExportInfo, check_info_classes, export_info, int8_info, model_classes
from .onnx import (
    OnnxInt8Builder, OnnxModule, export_onnx, onnxruntime_conv_times, with_onnx_metadata,
)
from .openvino import (
    OpenVinoInt8Builder, OpenVinoModule, ir_path, openvino_conv_times, openvino_from_onnx,
    save_openvino,
)
from .runtime import RuntimeModule, image_batches, import_problem, pad_batch
from .sensitivity import (
    CurvePoint, LayerSensitivity, LayerSpeed, fewest_meeting, layer_sensitivity, lowest_times, no_faster_in_int8,
    padded_logits, prune_float_layers, search_float_layers,
)

if TYPE_CHECKING:
    from ..factory import ModelInfo

log = logging.getLogger(__name__)

#: The share of the evaluation images held out of the search: the answer is judged on them (module notes).
HOLDOUT = 0.5

#: Cores' worth of other work during the runoff above which the report says its timings may not be this machine's.
DISTURBING_LOAD = 0.5

@dataclass(frozen=True)
class QuantizeTarget:
    """What the int8 model must keep of fp32's decisions on the evaluation images.

    Args:
        agreement: least top-1 agreement with fp32, a share in (0, 1] (default 0.995: 99.5 %).
        accuracy_tolerance: largest accuracy change in percentage points, in [0, 100] (default 0.3;
            checked only with labels).

    Raises:
        ValueError: a value out of range.
    """

    agreement: float = AGREEMENT_TARGET
    accuracy_tolerance: float = QUANTIZE_ACCURACY_TOLERANCE

    def __post_init__(self) -> None:
        for name in ("agreement", "accuracy_tolerance"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Real):  # True would be a 100 % target
                raise ValueError(f"the {name} target must be a number, got {value!r} ({type(value).__name__})")
        if not 0 < self.agreement <= 1:
            raise ValueError(f"the agreement target is a share in (0, 1], e.g. 0.995 for 99.5 %; got {self.agreement}")
        if not 0 <= self.accuracy_tolerance <= 100:
            raise ValueError(f"the accuracy tolerance is in points, in [0, 100]; got {self.accuracy_tolerance}")

    def met_by(self, agreement: Agreement) -> bool:
        """Whether ``agreement`` meets this target."""
        return agreement.meets(self.agreement, self.accuracy_tolerance)

    def describe(self) -> str:
        return (f"top-1 agreement >= {100 * self.agreement:g}% and accuracy within "
                f"{self.accuracy_tolerance:g} point{'s' if self.accuracy_tolerance > 1 else ''} of fp32")


@dataclass
class QuantizeResult:
    """What :func:`quantize` found.

    Args:
        target: the target asked for.
        meets_target: whether an int8 build met it; if not, the fields describe the best found.
        runtime: the chosen build's runtime (``"onnxruntime"`` or ``"openvino"``).
        point: the chosen build: its float layers and float part, agreement, images/s and speed-up over fp32
            ONNX Runtime.
        fp32_img_s: fp32 ONNX Runtime's images/s timed beside it.
        module: the build, called like the model (the runtime's default threads).
        artifact: the build's file content: ONNX bytes, or an ``openvino.Model``.
        info: the metadata :meth:`save` writes into the file.
        reasons: each float layer -> why it is float.
        sensitivity: runtime -> every layer quantised alone in it, most sensitive first (absent when not measured).
        curves: path (:attr:`CurvePoint.path`: the runtime, and ``+bf16`` or ``+bf16-layers`` for OpenVINO's other float
            parts) ->
            every build measured: the search's, then the pruning's.
        cpu: the CPU it was measured on.
        options: the int8 options used (weight range decided).
        calibration_images, evaluation_images, held_out_images: the image counts (the held-out ones are of the
            evaluation images: the search never judged on them).
        method: how the weights were made int8 (post-training, or after quantisation-aware fine-tuning).
        no_faster: runtime -> the layers its int8 kernel did not make faster here (kept float in its builds).
        runoff: when more than one path met the target, each one's answer timed again in one round-robin
            (what chose between them; ``point`` is the chosen one's).
        runoff_load: cores' worth of other work on the machine while the runoff was timed
            (:func:`cgavit.timing.other_load`; None without a runoff or a load average).
        noise_floor: for scale, the decisions the fp32 model itself changes on the images the answer was judged on
            when their pixels get noise of half a grey level (:func:`~cgavit.deploy.agreement.noise_floor`, normalised
            with ``info.std``).
        gptq_layer: the int8 layer whose weights GPTQ rounded rather than NNCF (OpenVINO's first convolution:
            ``options.gptq_first_layer``); None where there is none (ONNX Runtime, that layer float, or the option off).
    """

    target: QuantizeTarget
    meets_target: bool
    runtime: str
    point: CurvePoint
    fp32_img_s: float
    module: RuntimeModule
    artifact: object
    info: ExportInfo
    reasons: dict[str, str]
    sensitivity: dict[str, list[LayerSensitivity]]
    curves: dict[str, list[CurvePoint]]
    cpu: str
    options: Int8Options
    calibration_images: int
    evaluation_images: int
    method: str = "post-training"
    no_faster: dict[str, list[LayerSpeed]] = field(default_factory=dict)
    runoff: list[CurvePoint] = field(default_factory=list)
    held_out_images: int = 0
    runoff_load: float | None = None
    noise_floor: NoiseFloor | None = None
    gptq_layer: str | None = None

    @property
    def runoff_disturbed(self) -> bool:
        """Whether other work (half a core or more) ran while the runtimes' answers were timed side by side."""
        return self.runoff_load is not None and self.runoff_load >= DISTURBING_LOAD

    @property
    def agreement(self) -> Agreement:
        """The chosen build's agreement where it was finally judged: on the held-out images, when there were any."""
        return self.point.held_out or self.point.agreement

    @property
    def float_layers(self) -> tuple[str, ...]:
        return self.point.float_layers

    @property
    def held_out_misses(self) -> int:
        """How many builds of the chosen build's path met the target on the search's images and then missed it on the
        held-out ones (each path takes the first that meets it there: the module notes)."""
        return len({p.float_layers for p in self.curves.get(self.point.path, [])
                    if p.held_out is not None and not self.target.met_by(p.held_out)})

    @property
    def float_part(self) -> str:
        """The precision the chosen build's runtime runs its float part in (``"fp32"``; in OpenVINO also ``"bf16"`` or
        ``"bf16-layers"``)."""
        return self.point.float_part

    def save(self, path: str | os.PathLike) -> Path:
        """Write the int8 file (with its metadata), atomically: ONNX ``NAME.onnx``; OpenVINO ``NAME.xml`` +
        ``NAME.bin`` (``NAME`` alone gets the suffix).

        Raises:
            ValueError: the build does not meet the target (nothing is written), or a missing folder.
        """
        if not self.meets_target:
            raise ValueError(f"no int8 build met the target ({self.target.describe()}); the best found "
                             f"({self.describe_point()}) is not written")
        if self.runtime == "openvino":
            out = ir_path(path)
            save_openvino(self.artifact, out, self.info)
            return out
        out = named_output(path, ".onnx", "a file for ONNX Runtime")
        data = with_onnx_metadata(self.artifact, self.info)
        return atomic_write(out, lambda tmp: Path(tmp).write_bytes(data))

    def record(self) -> dict:
        """Everything measured, as JSON-ready values (``cgavit quantize`` writes it as the report's json)."""
        return dict(
            target=dict(agreement=self.target.agreement, accuracy_tolerance=self.target.accuracy_tolerance),
            meets_target=self.meets_target, method=self.method, runtime=self.runtime, float_part=self.float_part,
            chosen=_point_record(self.point, self.target),
            agreement_interval_95=list(self.agreement.interval()),
            fp32_onnxruntime_img_s=self.fp32_img_s, float_layers=self.reasons,
            kept_float_by_design="the attention core (score and PV matmuls, softmax) and the residual adds",
            cpu=self.cpu, weight_range=weight_range_label(bool(self.options.reduce_range), self.options.weights),
            calibration=self.options.calibration, calibration_images=self.calibration_images,
            evaluation_images=self.evaluation_images, held_out_images=self.held_out_images,
            held_out_misses=self.held_out_misses,
            sensitivity={rt: [dict(layer=s.layer, agreement=s.agreement, agreement_lost=s.agreement_lost,
                                   changed=s.changed, n=s.n, rel_err=s.rel_err) for s in rows]
                         for rt, rows in self.sensitivity.items()},
            curves={rt: [_point_record(p, self.target) for p in points] for rt, points in self.curves.items()},
            no_faster_in_int8={rt: [dict(layer=s.layer, fp32_ms=s.fp32_ms, int8_ms=s.int8_ms) for s in speeds]
                               for rt, speeds in self.no_faster.items()},
            runoff=[_point_record(p, self.target) for p in self.runoff], runoff_other_load=self.runoff_load,
            noise_floor=None if self.noise_floor is None else self.noise_floor.record(), gptq_rounded=self.gptq_layer,
        )

    def markdown(self, top: int = 15) -> str:
        """The report as Markdown: the verdict, the curve per runtime, the float layers and the
        ``top`` most sensitive layers."""
        verdict = "meets the target" if self.meets_target else "**no int8 build met the target**; the best found"
        held = (f" The search judged its builds on {self.evaluation_images - self.held_out_images} of them; the "
                f"answer was judged on the other {self.held_out_images}, which no search step judged on (the figure reported)."
                if self.held_out_images else " None was held out of the search (holdout 0): the answer was judged on the "
                "images the search chose it by, a flattering figure.")
        lines = [f"# cgavit quantize: {verdict}", "", f"Target: {self.target.describe()}, on "
                 f"{self.evaluation_images} evaluation images, none of them calibration images (int8 calibrated on "
                 f"{self.calibration_images} others).{held}",
                 f"CPU: {self.cpu}; weights {weight_range_label(bool(self.options.reduce_range), self.options.weights)}, "
                 f"calibration {self.options.calibration}; {self.method}.", "", f"Chosen: {self.describe_point()}.", "",
                 f"{self.uncertainty()}.", "",
                 *([f"For scale: on the images the answer was judged on, {self.noise_floor.describe()}: the rounding "
                    "an 8-bit image already carries. A decision that such noise changes is a near-tie of the model's own.",
                    ""] if self.noise_floor else []),
                 "| runtime | step | layers in float | agreement | accuracy (change) | img/s | x fp32 ONNX Runtime | target "
                 "| held out: agreement, accuracy change, target |", "|---|---|---:|---:|---:|---:|---:|---|---|"]
        for points in self.curves.values():
            for p in points:
                a, h = p.agreement, p.held_out
                acc = "" if a.accuracy is None else f"{100 * a.accuracy:.2f} % ({a.shown_change()})"
                held = "" if h is None else (f"{h.shown()} %, "
                                             + ("" if h.accuracy is None else f"{h.shown_change()}, ")
                                             + ("meets" if self.target.met_by(h) else "misses"))
                lines.append(f"| {path_name(p)} | {p.step} | {len(p.float_layers)} | {a.shown()} % | "
                             f"{acc} | {p.img_s:.0f} | {p.speedup:.2f} | {'meets' if p.meets else 'misses'} | {held} |")
        lines += ["", f"fp32 ONNX Runtime: {self.fp32_img_s:.0f} img/s (same round-robin timing)."]
        if self.runoff:
            timed = ", ".join(f"{path_name(p)} {p.speedup:.2f}x" for p in self.runoff)
            lines += ["", f"Each path's answer timed again side by side (one round-robin, twice the rounds): {timed} "
                      "fp32 ONNX Runtime; the faster is chosen."]
            if self.runoff_disturbed:
                lines += ["", f"**Other work ran meanwhile** (the load average showed {self.runoff_load:.1f} cores of it): "
                          "these timings, and so the runtime chosen, may not be this machine's; run cgavit quantize "
                          "with nothing else running."]
        lines += ["",
                  "Kept in float by design: the attention core (score and PV matmuls, softmax) and the residual adds."]
        if self.runtime == "openvino":
            lines += [f"The float part runs in {self.float_part}: cgavit's loader compiles the file so (its metadata's "
                      f"`float_part`); with OpenVINO alone, compile it with INFERENCE_PRECISION_HINT "
                      f"`{'bf16' if compile_precision(self.float_part) == 'bf16' else 'f32'}` (OpenVINO's default on a "
                      "CPU with native bf16 is bf16, which decides differently)."]
        if self.gptq_layer:
            lines += [f"`{self.gptq_layer}` is int8 with its weights rounded by GPTQ on the calibration images rather "
                      "than to nearest, and its bias set so that its mean output on them is fp32's (docs/deploy.md)."]
        lines += [f"Kept in float: `{layer}`: {why}" for layer, why in self.reasons.items()] or \
            ["No convolution kept in float."]
        for runtime, rows in self.sensitivity.items():
            lines += ["", f"Sensitivity in {runtime_format(runtime).runtime} (each layer int8 alone, the {min(top, len(rows))} "
                      f"most sensitive of {len(rows)}):", "",
                      "| layer | decisions changed | agreement | rel. logit error |", "|---|---:|---:|---:|"]
            lines += [f"| `{s.layer}` | {s.changed} of {s.n} | {100 * s.agreement:.2f} % | {s.rel_err:.1e} |"
                      for s in rows[:top]]
        return "\n".join(lines) + "\n"

    def uncertainty(self) -> str:
        """One line on how precisely the images pin the chosen build's agreement down (Wilson's 95 % interval,
        :meth:`Agreement.interval`), and, where the figure reaches the target but the interval reaches below it,
        that more images are needed to show the target holds beyond them."""
        a = self.agreement
        low, high = a.interval()
        text = (f"The agreement of {a.shown()} % on {a.n} images lies, with 95 % confidence, "
                f"between {100 * low:.2f} % and {100 * high:.2f} % on images like these (Wilson's interval)")
        if low < self.target.agreement - 1e-9 <= a.top1_agreement:
            text += (f": too few images to show that it keeps {100 * self.target.agreement:g} % beyond them; four times "
                     "the evaluation images halve the interval")
        misses = self.held_out_misses
        if self.meets_target and self.point.held_out is not None and misses:
            text += (f". {misses} smaller build{'s' if misses > 1 else ''} of this path missed the target on the held-out "
                     "images before this one met it there; taking the first that meets it favours a build those "
                     "images happen to suit, so the figure reads somewhat high")
        return text

    def describe_point(self, point: CurvePoint | None = None) -> str:
        """One line about a build (default: the chosen one)."""
        p = point or self.point
        a = p.held_out or p.agreement
        where = "" if p.held_out is None else (f" (held out of the search; on its {p.agreement.n} images "
                                               f"{p.agreement.shown()}%)")
        return (f"int8 {path_name(p)}, {len(p.float_layers)} layer(s) in float: "
                f"{a.describe(p.meets and self.target.met_by(a))}{where}; {p.img_s:.0f} img/s, "
                f"{p.speedup:.2f}x fp32 ONNX Runtime")


def path_name(point: CurvePoint) -> str:
    """A build's runtime, and its float part where that is not fp32: ``"OpenVINO (bf16 float part)"``."""
    name = runtime_format(point.runtime).runtime
    return name if point.float_part == "fp32" else f"{name} ({point.float_part} float part)"


def quantize(
    model: nn.Module,
    calibration: torch.Tensor | Iterable[torch.Tensor],
    evaluation: torch.Tensor | Iterable[torch.Tensor],
    target: QuantizeTarget = QuantizeTarget(),
    runtime: str | None = None,
    *,
    labels: torch.Tensor | None = None,
    options: Int8Options = Int8Options(),
    features: CpuFeatures | None = None,
    sensitivity: bool = True,
    max_float_layers: int | None = None,
    profile_layers: bool = True,
    prune: bool = True,
    float_part: str = "auto",
    holdout: float = HOLDOUT,
    info: ExportInfo | ModelInfo | None = None,
    reference: nn.Module | None = None,
    batch: int = 16,
    threads: int = 1,
    warmup: int = 3,
    repeats: int = 10,
) -> QuantizeResult:
    """The fastest int8 build of ``model`` that keeps its decisions on ``evaluation`` (read the module notes).

    Args:
        model: a trained model (fused and exported here; not modified).
        calibration: training images ``(N, C, H, W)`` (or batches of them), preprocessed like the input.
        evaluation, labels: held-out images ``(M, C, H, W)`` of the same size (or batches of them), never the
            calibration ones, and their ``(M,)`` class indices (for the accuracy part of the target).
        target, runtime: what the build must keep (:class:`QuantizeTarget`); ``"onnxruntime"``, ``"openvino"``, or None.
        options, features: the int8 recipe (default: :class:`~cgavit.deploy.int8.Int8Options`, weight range by
            CPU); the CPU to quantise for (default: this machine's).
        sensitivity, max_float_layers: measure each layer quantised alone even when all-int8 meets the target (else
            only when needed); keep at most this many layers in float (default: no cap; 0: every layer int8).
        profile_layers, prune: keep float the layers int8 makes no faster in the runtime's profiler; return each
            layer the search kept float to int8 where the target holds without it (both default).
        float_part: OpenVINO's, one of :data:`~cgavit.deploy.int8.FLOAT_PARTS` or ``"auto"``: :func:`~cgavit.deploy.int8.float_parts_for_cpu`.
        holdout: the share of ``evaluation`` held out of the search, in [0, 1) (module notes; 0: none).
        info: the file's metadata: the ``ModelInfo`` from :func:`~cgavit.load_model`, or an ``ExportInfo`` (None: ImageNet's, warned); reference: the fp32 model judged against and timed
            beside (default ``model``); batch, threads, warmup, repeats: the timing beside fp32 ONNX Runtime.

    Raises:
        ValueError: a bad model or reference, images, labels, runtime, target, holdout, ``info`` or float part.
    """
    fp32, reference = _checked_models(model, reference)
    runtimes, (cal, ev) = quant_runtimes(runtime), _checked_images(calibration, evaluation, labels, model_classes(model))
    timing = _check_settings(target, options, (batch, threads, warmup, repeats))
    if max_float_layers is not None and not is_whole(max_float_layers, 0):
        raise ValueError(f"max_float_layers must be a whole number, at least 0 (or None: no cap), got {max_float_layers!r}")
    features, size = features or cpu_features(), tuple(ev.shape[2:])
    parts, opts, made = _float_parts(features, float_part, runtimes), options.for_cpu(features), _file_info(info, size, model)
    search = _Search(fp32, reference, cal, *split_holdout(ev, labels, holdout), target, size, timing)
    with tempfile.TemporaryDirectory(prefix="cgavit-quantize-") as tmp, search.started(Path(tmp)):
        for name in runtimes:
            search.run(name, fp32, opts, sensitivity, max_float_layers, profile_layers, prune,
                       parts if name == "openvino" else ("fp32",))
    return search.result(features, opts, made)


def assess(
    reference: nn.Module,
    onnx_int8: bytes,
    calibration: torch.Tensor,
    evaluation: torch.Tensor,
    target: QuantizeTarget = QuantizeTarget(),
    runtime: str | None = None,
    *,
    labels: torch.Tensor | None = None,
    options: Int8Options = Int8Options(),
    features: CpuFeatures | None = None,
    info: ExportInfo | ModelInfo | None = None,
    method: str = "post-training",
    holdout: float = HOLDOUT,
    batch: int = 16,
    threads: int = 1,
    warmup: int = 3,
    repeats: int = 10,
) -> QuantizeResult:
    """An int8 ONNX file made elsewhere (quantisation-aware fine-tuning writes one) judged like
    :func:`quantize`'s builds: in ONNX Runtime and in OpenVINO (which reads the same file), against
    the fp32 ``reference`` on ``evaluation``, each timed beside fp32 ONNX Runtime; the faster that
    meets ``target`` is the result (else the one that keeps the most decisions).

    Args:
        reference: the fp32 model.
        onnx_int8: the int8 file's bytes (QDQ: ``QuantizeLinear``/``DequantizeLinear`` around its int8 operators).
        calibration: the images its ranges came from (their number goes in the report).
        method: how the file was made (for the report and the file's metadata).
        evaluation, target, runtime, labels, options, features, info, holdout, batch, threads, warmup, repeats: as
            for :func:`quantize` (``options.float_layers``: the layers the file keeps in float).

    Raises:
        ValueError: as :func:`quantize`.
    """
    fused = _checked_models(reference, None)[0]
    runtimes = quant_runtimes(runtime)
    cal, ev = _checked_images(calibration, evaluation, labels, model_classes(reference))
    timing = _check_settings(target, options, (batch, threads, warmup, repeats))
    features = features or cpu_features()
    opts = options.for_cpu(features)
    size = tuple(ev.shape[2:])
    made = _file_info(info, size, reference)
    search = _Search(fused, fused, cal, *split_holdout(ev, labels, holdout), target, size, timing,
                     asked=tuple(opts.float_layers))
    with tempfile.TemporaryDirectory(prefix="cgavit-assess-") as tmp, search.started(Path(tmp)):
        path = Path(tmp) / "int8.onnx"
        path.write_bytes(onnx_int8)
        for name in runtimes:
            artifact = onnx_int8 if name == "onnxruntime" else openvino_from_onnx(path)
            search.curves[name] = [search.judge(name, _Made(artifact), tuple(opts.float_layers))]
    result = search.result(features, opts, made)
    result.method = method
    result.info = replace(result.info, int8={**result.info.int8, "method": method})
    return result


def _checked_models(model: object, reference: object | None) -> tuple[nn.Module, nn.Module]:
    """``model`` and the fp32 ``reference`` it is judged against (None: ``model`` itself), checked (a model with weights,
    one output and a classifier: :func:`~cgavit.deploy.fusion.check_model`, :func:`~cgavit.deploy.fusion.check_classifier`;
    the reference of as many classes), each as a fused float32 copy on the CPU, where the runtimes run: a bf16 or
    GPU model was refused by its own forward on the float32 CPU images, saying to convert the images.

    Raises:
        ValueError: what is wrong with either, and what to give.
    """
    check_model(model, "quantize")
    check_classifier(model, "quantize")
    fp32 = fused_fp32(model).cpu()
    if reference is None:
        return fp32, fp32
    check_model(reference, "quantize (its reference)")
    check_classifier(reference, "quantize (its reference)")
    classes, theirs = model_classes(model), model_classes(reference)
    if None not in (classes, theirs) and classes != theirs:
        raise ValueError(f"the reference predicts {theirs} classes and the model {classes}: give as reference the fp32 "
                         "model this one was made from (or None: the model itself)")
    return fp32, fused_fp32(reference).cpu()


def _float_parts(features: CpuFeatures, float_part: str, runtimes: list[str]) -> tuple[str, ...]:
    """OpenVINO's float parts to search (:func:`~cgavit.deploy.int8.float_parts_for_cpu`); one asked for by a search
    without OpenVINO (``runtimes``), where it would be ignored, is a ValueError."""
    if float_part != "auto" and "openvino" not in runtimes:
        raise ValueError(f"float_part is how OpenVINO runs what int8 leaves float, and this search builds for "
                         f"{', '.join(runtimes)} alone; leave it 'auto', or give runtime='openvino' (or None)")
    return float_parts_for_cpu(features, float_part)


def _file_info(info: object | None, size: tuple[int, int], model: nn.Module) -> ExportInfo:
    """The metadata the answer's file will carry (:func:`~cgavit.deploy.metadata.export_info`), checked before any
    work against the images (``size``: their ``(H, W)``) and the model's classes; without ``info`` it can only be
    ImageNet's preprocessing and no class names, which is said.

    Raises:
        ValueError: ``info`` is for images of another size, names other than one class per model output, or holds a
            value cgavit would refuse when reading the file (:meth:`~cgavit.deploy.metadata.ExportInfo.to_props`).
    """
    if info is None:
        warnings.warn("quantize: no info= given, so the file will record ImageNet's mean, std and crop and no class "
                      "names; pass the ModelInfo that load_model returned (or an ExportInfo) so that it records the "
                      "model's own", RuntimeWarning, stacklevel=3)
    else:
        _check_info(info, size, model_classes(model))
    made = export_info(info, size, getattr(model, "in_chans", 3))
    made.to_props()  # refused before the search, not when its answer is saved
    return made


def _check_info(info: object, size: tuple[int, int], classes: int | None) -> None:
    """``info`` (a ``ModelInfo``: one side; an ``ExportInfo``: ``(H, W)``) is for images of ``size`` and names one
    class per model output (``classes``, where known), or ValueError."""
    side = getattr(info, "img_size", None)
    given = (side, side) if isinstance(side, int) else tuple(side or ())
    if given != tuple(size):
        raise ValueError(f"the images are {size[0]}x{size[1]} but info is for {'x'.join(map(str, given)) or 'no'} "
                         "images: preprocess them with the model's own transform, or give the info that fits them")
    check_info_classes(info, classes)


def quant_runtimes(runtime: str | None) -> list[str]:
    """The runtimes a search builds int8 for: ``runtime``, or (None) every one installed and importable.

    Raises:
        ValueError: an unknown runtime, ONNX Runtime or onnx missing or broken (every build is exported to ONNX and
            timed beside fp32 ONNX Runtime), or the runtime asked for not installed or broken (each message says
            what to install).
    """
    if runtime is not None and runtime not in QUANT_RUNTIMES:
        raise ValueError(f"runtime must be one of {', '.join(QUANT_RUNTIMES)} (or None: every one installed), got {runtime!r}")
    onnx = FORMATS["onnx"]
    problem = onnx.problem("int8")
    if problem:
        raise ValueError(f"quantize needs {onnx.runtime} (every build is exported to ONNX and timed beside fp32 ONNX "
                         f"Runtime): {problem}; {onnx.install()}")
    if runtime == "onnxruntime":
        return [runtime]
    openvino = FORMATS["openvino"]
    problem = openvino_int8_problem()
    if runtime == "openvino" and problem:
        raise ValueError(f"runtime openvino cannot be used: {problem}; {openvino.install()}")
    installed = all(importlib.util.find_spec(name) is not None for name in ("openvino", "nncf"))
    if problem and installed:  # installed but broken: said, not a traceback after the ONNX Runtime search
        log.warning("quantize: OpenVINO is installed but cannot be used (%s): searching ONNX Runtime alone", problem)
    return [runtime] if runtime else ["onnxruntime"] + ([] if problem else ["openvino"])


def openvino_int8_problem() -> str | None:
    """Why OpenVINO's int8 builds cannot be made here (openvino or nncf not installed, or installed and failing to
    import: said with its reason), or None."""
    return FORMATS["openvino"].problem("int8") or import_problem("nncf")  # imported here: the search would, later


def _checked_images(
    calibration: torch.Tensor | Iterable[torch.Tensor], evaluation: torch.Tensor | Iterable[torch.Tensor],
    labels: torch.Tensor | None, num_classes: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Calibration and evaluation images as float32 ``(N, C, H, W)`` of one shape, finite, and the labels class
    indices of the model's (``num_classes``, where known), checked."""
    cal, evaluation = _stacked(calibration, "calibration"), _stacked(evaluation, "evaluation")
    if not len(evaluation):
        raise ValueError("evaluation must be held-out images (M, C, H, W), or batches of them, and none was given")
    if not len(cal):
        raise ValueError("calibration must be training images (N, C, H, W), a few hundred, or batches of them")
    if cal.shape[1:] != evaluation.shape[1:]:
        raise ValueError(f"calibration images are {tuple(cal.shape[1:])} but evaluation images "
                         f"{tuple(evaluation.shape[1:])}: preprocess both like the model's input")
    # as values: images that require grad (made by a differentiable transform) or sit on a GPU are the same images
    cal, evaluation = (images.detach().cpu().float() for images in (cal, evaluation))
    for name, images in (("calibration", cal), ("evaluation", evaluation)):
        if not torch.isfinite(images).all():
            raise ValueError(f"the {name} images hold NaN or infinite values: preprocess real images")
    check_held_out(cal, evaluation, "calibration")
    if labels is not None:
        if not isinstance(labels, torch.Tensor) or tuple(labels.shape) != (len(evaluation),):
            raise ValueError(f"labels must be a tensor of shape ({len(evaluation)},), one class index per evaluation "
                             f"image (torch.tensor(labels) for a list); got "
                             f"{tuple(labels.shape) if isinstance(labels, torch.Tensor) else type(labels).__name__}")
        if labels.is_floating_point() or labels.is_complex() or labels.dtype == torch.bool:
            raise ValueError(f"labels must be whole class indices (an integer tensor), got {labels.dtype}")
        if labels.min() < 0 or (num_classes is not None and labels.max() >= num_classes):
            raise ValueError(f"labels must be class indices in 0..{num_classes - 1 if num_classes else 'N-1'}, got "
                             f"values from {int(labels.min())} to {int(labels.max())}")
    return cal, evaluation


def _stacked(images: object, name: str) -> torch.Tensor:
    """``images`` (``"calibration"``, ``"evaluation"``: ``name``), one tensor or batches of them
    (:func:`~cgavit.deploy.runtime.image_batches`), as one float tensor ``(N, C, H, W)``, each batch checked.

    Raises:
        ValueError: not image batches, or batches of images of different shapes.
    """
    batches = image_batches(images, name)
    for b in batches:
        check_image_batch(b, f"{name} images")
    shapes = sorted({tuple(b.shape[1:]) for b in batches})
    if len(shapes) > 1:
        raise ValueError(f"the {name} batches hold images of different shapes, {' and '.join(map(str, shapes[:2]))}: "
                         "preprocess them all like the model's input, to one size")
    return torch.cat([b.float() for b in batches]) if batches else torch.empty(0, 1, 1, 1)


def shared_images(images: torch.Tensor, evaluation: torch.Tensor) -> list[tuple[int, int]]:
    """``(index in images, index in evaluation)`` of each of ``evaluation``'s images that is, bit for bit, one of
    ``images`` (a digest per image)."""
    def digests(batch: torch.Tensor) -> list[bytes]:
        return [hashlib.blake2b(image.contiguous().numpy().tobytes(), digest_size=16).digest() for image in batch]

    seen = {d: i for i, d in enumerate(digests(images))}
    return [(seen[d], j) for j, d in enumerate(digests(evaluation)) if d in seen]


class SharedImagesError(ValueError):
    """Evaluation images that are also calibration or training images (:func:`check_held_out`).

    Attributes:
        pairs: ``(index among those images, index among the evaluation images)`` of each shared one, by which a
            caller that knows the files can name them (:meth:`describe`).
    """

    def __init__(self, pairs: list[tuple[int, int]], total: int, role: str) -> None:
        self.pairs, self.total, self.role = pairs, total, role
        super().__init__(self.describe())

    def describe(self, example: str = "") -> str:
        """The message, with ``example`` (e.g. ``", e.g. A is B"``) after the count."""
        return (f"{len(self.pairs)} of the {self.total} evaluation images are {self.role} images too{example}: int8 "
                f"judged on its own {self.role} images says nothing about other images; give held-out images to "
                "evaluate on")


def check_held_out(images: torch.Tensor, evaluation: torch.Tensor, role: str) -> None:
    """Refuse evaluation images that are also ``role`` images (calibration, training): int8 judged on images it was
    calibrated or fine-tuned on says nothing about other images.

    Raises:
        SharedImagesError: how many are shared, and which (a ``ValueError``).
    """
    shared = shared_images(images, evaluation)
    if shared:
        raise SharedImagesError(shared, len(evaluation), role)


def _check_settings(target: object, options: object, timing: tuple) -> tuple[int, int, int, int]:
    """The target and recipe are of their types, and the timing (batch, threads, warmup, repeats) in range, before any
    work; the timing as Python ints (NumPy's integers are taken).

    Raises:
        ValueError: what is wrong, and what to give.
    """
    if not isinstance(target, QuantizeTarget):
        raise ValueError(f"target must be a QuantizeTarget, e.g. QuantizeTarget(agreement=0.995); got {target!r}")
    if not isinstance(options, Int8Options):
        raise ValueError(f"options must be an Int8Options, e.g. Int8Options(calibration='percentile'); got {options!r}")
    batch, threads, warmup, repeats = timing
    if not all(is_whole(v) for v in (batch, threads, repeats)) or not is_whole(warmup, 0):
        raise ValueError(f"batch, threads and repeats must be whole numbers of at least 1 and warmup at least 0; got "
                         f"{batch!r}, {threads!r}, {repeats!r} and {warmup!r}")
    check_threads(int(threads), "threads")  # a million asked ONNX Runtime for memory no process has
    return int(batch), int(threads), int(warmup), int(repeats)


def split_holdout(images: torch.Tensor, labels: torch.Tensor | None, share: float
                  ) -> tuple[torch.Tensor, torch.Tensor | None, tuple[torch.Tensor, torch.Tensor | None] | None]:
    """``images`` and their ``labels`` split at random (a fixed seed, each part in its original order) into the
    images the search judges on and ``share`` of them held out: ``(images, labels, (held_images, held_labels))``,
    or ``(images, labels, None)`` when ``share`` is 0.

    Raises:
        ValueError: ``share`` outside [0, 1), or too few images for both parts to have one.
    """
    if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 <= share < 1:
        raise ValueError(f"holdout is the share of the evaluation images held out of the search, in [0, 1) "
                         f"(0: none), e.g. 0.5; got {share!r}")
    held = round(share * len(images))
    if share == 0:
        return images, labels, None
    if not 0 < held < len(images):
        raise ValueError(f"holding out {share:g} of {len(images)} evaluation images leaves a part empty: "
                         "give more evaluation images, or holdout=0 (--holdout 0 on the command line)")
    order = torch.randperm(len(images), generator=torch.Generator().manual_seed(0))
    kept, out = order[held:].sort().values, order[:held].sort().values
    return images[kept], None if labels is None else labels[kept], (images[out], None if labels is None else labels[out])


@dataclass
class _Build:
    point: CurvePoint
    artifact: object


class _Made:
    """A builder of one int8 file made elsewhere (:func:`assess`): its float layers are fixed."""

    def __init__(self, artifact: object) -> None:
        self.artifact = artifact

    def build(self, float_layers: tuple[str, ...], float_part: str = "fp32") -> object:
        return self.artifact


@dataclass
class _Search:
    """The state of one :func:`quantize` call: the images, the fp32 reference, every build measured."""

    fused: nn.Module
    fp32_model: nn.Module
    calibration: torch.Tensor
    evaluation: torch.Tensor
    labels: torch.Tensor | None
    held_out: tuple[torch.Tensor, torch.Tensor | None] | None  # images and labels no search step judges on
    target: QuantizeTarget
    size: tuple[int, int]
    timing: tuple[int, int, int, int]  # batch, threads, warm-up, repeats
    builds: dict[tuple[str, str, tuple[str, ...]], _Build] = field(default_factory=dict)  # runtime, float part, layers
    curves: dict[str, list[CurvePoint]] = field(default_factory=dict)
    sensitivity: dict[str, list[LayerSensitivity]] = field(default_factory=dict)
    no_faster: dict[str, list[LayerSpeed]] = field(default_factory=dict)
    runoff_load: float | None = None  # other work while the runoff was timed
    asked: tuple[str, ...] = ()  # float layers the caller gave (:func:`assess`), not chosen by the search
    gptq: dict[str, str] = field(default_factory=dict)  # runtime -> the layer GPTQ rounded in its builds

    @contextmanager
    def started(self, tmp: Path) -> Iterator[None]:
        """:meth:`start` in ``tmp``; on leaving, the builders' temporary files are released."""
        self.start(tmp)
        try:
            yield
        finally:
            self.close()

    def start(self, tmp: Path) -> None:
        """The fp32 reference logits and fp32 ONNX Runtime for timing."""
        self.tmp, self.onnx = tmp, None
        self.reference = padded_logits(self.fp32_model, self.evaluation)
        self.held_reference = None if self.held_out is None else padded_logits(self.fp32_model, self.held_out[0])
        batch, threads = self.timing[:2]
        self.example = pad_batch(self.evaluation[:batch], batch)
        self.fp32 = OnnxModule(export_onnx(self.fp32_model, tmp / "fp32.onnx", self.size), threads)

    def onnx_builder(self, opts: Int8Options) -> OnnxInt8Builder:
        """ONNX Runtime's int8 builder (made, and calibrated, on first use)."""
        if self.onnx is None:
            export_onnx(self.fused, self.tmp / "int8-source.onnx", self.size, fold_residuals=False)
            self.onnx = OnnxInt8Builder(self.tmp / "int8-source.onnx", [self.calibration], opts)
        return self.onnx

    def close(self) -> None:
        if self.onnx is not None:
            self.onnx.close()

    def run(self, runtime: str, model: nn.Module, opts: Int8Options, sensitivity: bool, most: int | None,
            profile: bool = True, prune: bool = True, float_parts: tuple[str, ...] = ("fp32",)) -> None:
        """Search ``runtime``'s builds for each of ``float_parts``: every layer int8 (but those int8 does not make
        faster, with ``profile``), then more layers kept in float as needed, at most ``most`` in all, most sensitive
        in this runtime first; then (``prune``) each of those returned to int8 where the target holds without it.
        The profile, the sensitivity (measured with an fp32 float part) and so the order are shared by the float parts."""
        if runtime == "onnxruntime":
            builder = self.onnx_builder(opts)
        else:
            builder = OpenVinoInt8Builder(model, self.size, [self.calibration], opts)
        slow, every_int8, gain = self.profile(runtime, builder) if profile and most != 0 else ([], None, {})
        slow = slow[:most]
        self.no_faster[runtime] = slow
        kept = tuple(s.layer for s in slow)
        for part in float_parts:
            def judge(float_layers: tuple[str, ...], part: str = part) -> CurvePoint:
                return self.judge(runtime, builder, kept + tuple(float_layers), part=part)

            # the profile's all-int8 build is the first point when nothing is kept float for speed
            start = self.judge(runtime, builder, kept, None if kept else every_int8, part)
            ranked = partial(self.ranked, runtime, builder, kept)
            needed = sensitivity or runtime in self.sensitivity or not (start.meets or most == 0)
            order = ranked() if needed else []  # else the search stops at the start
            curve = search_float_layers(order, judge, start, None if most is None else most - len(kept))
            found = fewest_meeting(curve)
            if prune and found is not None and len(found.float_layers) > len(kept):
                searched = found.float_layers[len(kept):]
                # the layers int8 speeds up most return first (without a profile: the least sensitive first)
                returns = sorted(searched, key=lambda layer: -gain[layer]) if gain else list(reversed(searched))
                curve += prune_float_layers(searched, judge, returns)
            self.curves[start.path] = curve
            self.extend_for_held_out(curve, judge, ranked, None if most is None else most - len(kept))
        if getattr(builder, "gptq_layer", None):  # known once a build was made
            self.gptq[runtime] = builder.gptq_layer

    def ranked(self, runtime: str, builder, kept: tuple[str, ...]) -> list[str]:
        """``runtime``'s layers but ``kept``, most sensitive first: its per-layer sensitivity, measured on the
        search's images (with an fp32 float part) the first time some layer must be kept in float."""
        if runtime not in self.sensitivity:
            log.info("quantize: per-layer sensitivity of %d layers (%s)", len(builder.layers), runtime_format(runtime).runtime)
            self.sensitivity[runtime] = layer_sensitivity(
                list(builder.layers), partial(self.module, runtime, builder), self.evaluation, self.reference)
        return [s.layer for s in self.sensitivity[runtime] if s.layer not in kept]

    def profile(self, runtime: str, builder) -> tuple[list[LayerSpeed], object, dict[str, float]]:
        """The layers whose int8 kernel is no faster than fp32 in ``runtime``'s profiler on the timing batch,
        the every-layer-int8 build that was profiled, and each layer's gain in int8 (fp32 minus int8 ms).

        Each layer's time is the lower of two profiles, fp32 and int8 taken in turn: a layer that another process
        slowed in one profile is not kept float for it (on the 2-core AMX Xeon, with a second search running,
        two FFN and attention convolutions of the 96 px reference once came out slower in int8 in OpenVINO)."""
        threads, layers = self.timing[1], list(builder.layers)
        every_int8 = builder.build([])
        if runtime == "onnxruntime":
            fp32_model, times = self.tmp / "int8-source.onnx", onnxruntime_conv_times
        else:
            fp32_model, times = builder.float_model, openvino_conv_times
        rounds = [(times(fp32_model, self.example, layers, threads), times(every_int8, self.example, layers, threads))
                  for _ in range(2)]
        fp32, int8 = (lowest_times([r[i] for r in rounds]) for i in (0, 1))
        slow = no_faster_in_int8(fp32, int8)
        log.info("quantize: %s: %d layer(s) no faster in int8 here, kept in float: %s", runtime, len(slow),
                 ", ".join(f"{s.layer} ({s.int8_ms:.2f} ms int8, {s.fp32_ms:.2f} fp32)" for s in slow) or "none")
        gain = {layer: fp32.get(layer, 0.0) - int8.get(layer, 0.0) for layer in layers}
        return slow, every_int8, gain

    def module(self, runtime: str, builder, float_layers: list[str]) -> RuntimeModule:
        """``runtime``'s int8 build with ``float_layers`` in float, as a module (the timing threads)."""
        return int8_module(runtime, builder.build(float_layers), self.timing[1])

    def judge(self, runtime: str, builder, float_layers: tuple[str, ...], artifact: object = None,
              part: str = "fp32") -> CurvePoint:
        """Build ``runtime``'s int8 model with ``float_layers`` in float (unless ``artifact`` is that build
        already), and measure and time it with its float part in ``part``; a build measured before is not made
        again (pruning the search's last float layer gives the search's previous point), and a model built for
        another float part of the same graph is reused."""
        if (runtime, part, float_layers) in self.builds:
            return self.builds[(runtime, part, float_layers)].point
        if artifact is None:  # fp32 and bf16 float parts compile one graph; bf16-layers has bf16 convolutions in its own
            made = [b.artifact for (rt, p, layers), b in self.builds.items() if (rt, layers) == (runtime, float_layers)
                    and (p == "bf16-layers") == (part == "bf16-layers")]
            artifact = made[0] if made else (
                builder.build(float_layers, part) if runtime == "openvino" else builder.build(float_layers))
        module = int8_module(runtime, artifact, self.timing[1], part)
        a = compare_logits(padded_logits(module, self.evaluation), self.reference, self.labels)
        img_s, fp32_img_s = self.time(module)
        point = CurvePoint(runtime, float_layers, a, img_s, img_s / fp32_img_s, self.target.met_by(a), float_part=part)
        self.builds[(runtime, part, float_layers)] = _Build(point, artifact)
        log.info("quantize: int8 %s with %d float layer(s): %s; %.2fx fp32 ONNX Runtime", point.path,
                 len(float_layers), a.describe(point.meets), point.speedup)
        return point

    def time(self, module: nn.Module) -> tuple[float, float]:
        """Images/s of ``module`` and of fp32 ONNX Runtime, round-robin on the example batch."""
        batch, _, warmup, repeats = self.timing
        with torch.no_grad():
            t = round_robin({"int8": partial(module, self.example), "fp32": partial(self.fp32, self.example)},
                            warmup, repeats)
        self.fp32_img_s = t["fp32"].median_rate(batch)
        return t["int8"].median_rate(batch), self.fp32_img_s

    def judge_held_out(self, point: CurvePoint) -> CurvePoint:
        """``point`` judged on the held-out images too (once per build; the curves then show it)."""
        key = (point.runtime, point.float_part, point.float_layers)
        build = self.builds[key]
        if self.held_out is None or build.point.held_out is not None:
            return build.point
        module = int8_module(point.runtime, build.artifact, self.timing[1], point.float_part)
        a = compare_logits(padded_logits(module, self.held_out[0]), self.held_reference, self.held_out[1])
        for curve in self.curves.values():
            curve[:] = [replace(p, held_out=a) if (p.runtime, p.float_part, p.float_layers) == key else p for p in curve]
        judged = build.point = replace(point, held_out=a)
        log.info("quantize: int8 %s with %d float layer(s) on the held-out images: %s", point.path,
                 len(point.float_layers), a.describe(self.target.met_by(a)))
        return judged

    def extend_for_held_out(self, curve: list[CurvePoint], judge: Callable[[tuple[str, ...]], CurvePoint],
                            ranked: Callable[[], list[str]], most: int | None) -> None:
        """When none of ``curve``'s builds that meet the target on the search's images meets it on the held-out ones,
        keep more layers of ``ranked()`` (the most sensitive first: :meth:`ranked`, measured now if the search did not
        need it) float, twice the search's answer's, then twice that, as the search does, until a build meets it on
        both or the search's limit is reached; these builds join the curve as search steps.

        The last step is not halved afterwards, as the search's own is: each halving is one more look at the held-out
        images, and the looks choose a build those images happen to suit. On the seed-1 CIFAR model (AMX Xeon) halving
        found 6 float layers meeting the target on its 1,000 held-out images, which kept 99.34 % of 8,000 test images
        no step had seen; the doubling's 9 kept 99.61 % of them (BENCHMARKS.md, tenth AMX session)."""
        found = fewest_meeting([p for p in curve if p.step == "search"])
        if self.held_out is None or found is None or most == 0 or self.answer(curve) is not None:
            return
        order = ranked()
        limit = len(order) - 1 if most is None else min(most, len(order) - 1)
        k = sum(layer in found.float_layers for layer in order)
        while k < limit:
            k = min(max(2 * k, 1), limit)
            point = judge(tuple(order[:k]))
            if all(p.float_layers != point.float_layers for p in curve):
                curve.append(point)
            if point.meets and self.answer([point]) is not None:
                return

    def answer(self, curve: list[CurvePoint]) -> CurvePoint | None:
        """A path's answer: of its builds that meet the target on the search's images, fewest float layers first
        (then the most decisions kept), the first that meets it on the held-out images too (None if none does)."""
        meeting = sorted({(p.float_layers, p.float_part): p for p in curve if p.meets}.values(),
                         key=lambda p: (len(p.float_layers), -p.agreement.top1_agreement))
        for point in meeting:
            point = self.judge_held_out(point)
            if point.held_out is None or self.target.met_by(point.held_out):
                return point
        return None

    def runoff(self, points: list[CurvePoint]) -> list[CurvePoint]:
        """``points`` (one per path) timed again in one round-robin beside fp32 ONNX Runtime, twice the rounds:
        each search timed its builds at its own moments, and the machine's load moves in between."""
        batch, threads, warmup, repeats = self.timing
        calls = {"fp32": partial(self.fp32, self.example)}
        for p in points:
            build = self.builds[(p.runtime, p.float_part, p.float_layers)]
            calls[p.path] = partial(int8_module(p.runtime, build.artifact, threads, p.float_part), self.example)
        with torch.no_grad():
            t = round_robin(calls, warmup, 2 * repeats)
        self.runoff_load = other_load(threads or torch.get_num_threads())
        fp32 = t["fp32"].median_rate(batch)
        return [replace(p, img_s=t[p.path].median_rate(batch), speedup=t[p.path].median_rate(batch) / fp32)
                for p in points]

    def result(self, features: CpuFeatures, opts: Int8Options, info: ExportInfo) -> QuantizeResult:
        """The fastest build that meets the target (the runtimes' answers timed side by side), or the best found."""
        winners = [p for p in (self.answer(c) for c in self.curves.values()) if p is not None]
        runoff = self.runoff(winners) if len(winners) > 1 else []
        if winners:
            point = max(runoff or winners, key=lambda p: p.speedup)
        else:  # the most decisions kept, then the closest accuracy, then the fastest
            every = [p for c in self.curves.values() for p in c]
            point = self.judge_held_out(max(every, key=lambda p: (
                p.agreement.top1_agreement, -abs(p.agreement.accuracy_change or 0), p.speedup)))
        build = self.builds[(point.runtime, point.float_part, point.float_layers)]
        held = 0 if self.held_out is None else len(self.held_out[0])
        judged_on, clean = (self.evaluation, self.reference) if self.held_out is None else \
            (self.held_out[0], self.held_reference)
        floor = noise_floor(self.fp32_model, judged_on, tuple(info.std), clean, batch=self.timing[0]) \
            if len(info.std) == judged_on.shape[1] else None
        return QuantizeResult(
            target=self.target, meets_target=bool(winners), runtime=point.runtime, point=point,
            fp32_img_s=point.img_s / point.speedup,
            module=int8_module(point.runtime, build.artifact, float_part=point.float_part),
            artifact=build.artifact,
            info=_verdict_info(info, opts.with_float(point.float_layers), point, self.target, features),
            reasons=self.reasons(point), sensitivity=self.sensitivity, curves=self.curves,
            cpu=features.describe(), options=opts, calibration_images=len(self.calibration),
            evaluation_images=len(self.evaluation) + held, held_out_images=held, no_faster=self.no_faster, runoff=runoff,
            runoff_load=self.runoff_load if runoff else None, noise_floor=floor,
            gptq_layer=None if self.gptq.get(point.runtime) in point.float_layers else self.gptq.get(point.runtime),
        )

    def reasons(self, point: CurvePoint) -> dict[str, str]:
        return float_reasons(self.sensitivity.get(point.runtime, []), point.float_layers,
                             self.no_faster.get(point.runtime, ()), self.timing[0], self.asked)


def int8_module(runtime: str, artifact: object, threads: int | None = None, float_part: str = "fp32") -> RuntimeModule:
    """An int8 build (ONNX bytes, or an ``openvino.Model``) in its runtime, called like a module (OpenVINO: with
    its float part in ``float_part``; ONNX Runtime's is fp32)."""
    if runtime == "onnxruntime":
        return OnnxModule(artifact, threads, "int8")
    return OpenVinoModule(artifact, threads, "int8", float_part)


def float_reasons(sensitivity: list[LayerSensitivity], float_layers: Iterable[str],
                  no_faster: Iterable[LayerSpeed] = (), batch: int = 16, asked: Iterable[str] = ()) -> dict[str, str]:
    """Why each float layer is float: int8 made it no faster (``no_faster``, per call of ``batch`` images), its
    rank and cost in the ``sensitivity`` table (most sensitive first), or the caller kept it float (``asked``)."""
    asked = set(asked)
    rank = {s.layer: (i + 1, s) for i, s in enumerate(sensitivity)}
    slow = {s.layer: s for s in no_faster}
    out = {}
    for layer in float_layers:
        if layer in slow:
            s = slow[layer]
            out[layer] = (f"no faster in int8 on this CPU: {s.int8_ms:.2f} ms against {s.fp32_ms:.2f} ms in fp32 "
                          f"per call of {batch} images (the runtime's profiler)")
            continue
        if layer not in rank:
            out[layer] = ("kept in float as asked" if layer in asked else "chosen by the search in graph order") + \
                " (no sensitivity measured for it)"
            continue
        i, s = rank[layer]
        out[layer] = (f"sensitivity rank {i} of {len(rank)}: int8 alone it changes {s.changed} of {s.n} "
                      f"decisions (relative logit error {s.rel_err:.1e})")
    return out


def _point_record(p: CurvePoint, target: QuantizeTarget) -> dict:
    a, h = p.agreement, p.held_out
    held = {} if h is None else dict(held_out=dict(agreement=h.top1_agreement, changed=h.changed, n=h.n,
                                                   accuracy=h.accuracy, accuracy_change=h.accuracy_change,
                                                   meets_target=target.met_by(h)))
    return dict(runtime=p.runtime, float_part=p.float_part, float_layers=list(p.float_layers),
                agreement=a.top1_agreement, changed=a.changed,
                n=a.n, accuracy=a.accuracy, accuracy_change=a.accuracy_change, max_rel_err=a.max_rel_err,
                img_s=p.img_s, speedup_over_fp32_onnxruntime=p.speedup, meets_target=p.meets, step=p.step, **held)


def _verdict_info(info: ExportInfo, opts: Int8Options, point: CurvePoint, target: QuantizeTarget,
                  features: CpuFeatures) -> ExportInfo:
    """``info`` with how the file was quantised and what it was measured to keep."""
    if point.runtime == "openvino":
        opts = replace(opts, weights="int8")  # NNCF has one weight type
    a = point.held_out or point.agreement
    verdict = dict(runtime=point.runtime, agreement=a.top1_agreement, accuracy=a.accuracy,
                   accuracy_change=a.accuracy_change, evaluation_images=a.n, held_out_of_search=point.held_out is not None,
                   meets_target=point.meets and target.met_by(a),
                   target_agreement=target.agreement, target_accuracy_tolerance=target.accuracy_tolerance,
                   cpu_class=features.cpu_class, measured_on=features.describe(), architecture=architecture())
    made = int8_info(info, opts, point.float_part)
    return replace(made, int8={**made.int8, **verdict})
