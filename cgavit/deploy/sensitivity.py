"""Which layers int8 may not touch: per-layer sensitivity, and the search for the fewest layers kept in
float that meet an agreement target.

* :func:`layer_sensitivity` quantises **one layer at a time** (every other layer float) in the
  runtime that will run the model (each runtime's int8 kernels and ranges differ: on the CIFAR-10
  96 px reference OpenVINO needed 14 float layers in ONNX Runtime's order and 6 in its own), and
  measures what that layer alone costs: the share of fp32's decisions it changes, and the relative
  logit error.
* :func:`search_float_layers` keeps layers in float in that order, most sensitive first: it tries
  1, 2, 4, ... layers until the target is met, then halves the last step until the fewest that met
  it is found (agreement grows with the layers kept in float, though not strictly, so this finds
  the fewest *in that order*, in a few builds rather than one per layer). Every build it makes is a
  point of the curve of agreement against speed.
* :func:`prune_float_layers` then returns the layers it kept float to int8 one at a time, those
  int8 speeds up most first, and keeps each return whose build still meets the target: a layer of
  the sensitivity prefix may not be needed once the others are float (sensitivities do not add up).

* :func:`no_faster_in_int8` names the layers int8 does not make faster on this CPU (from a
  runtime's per-layer profile, fp32 against int8): kept in float, they cost no speed and can only
  keep decisions (on AVX2, M4's first convolution, three input channels, ran 2.2-2.6x slower in
  int8 than in fp32 in ONNX Runtime, and 2.3x faster in OpenVINO; BENCHMARKS.md).

Both work on any runtime through two callables: ``build(float_layers) -> module`` and
``judge(module) -> Point``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch
from torch import nn

from ..timing import progress_bar
from .agreement import Agreement, compare_logits
from .runtime import pad_batch

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LayerSensitivity:
    """What quantising one layer alone (every other layer float) costs.

    Args:
        layer: the layer's name (the qualified name of its conv in the export form).
        agreement: top-1 agreement with fp32 on the evaluation images (0-1).
        changed: decisions changed, of ``n``.
        n: images.
        rel_err: relative logit error ``||a - b|| / ||b||`` over the whole set.
    """

    layer: str
    agreement: float
    changed: int
    n: int
    rel_err: float

    @property
    def agreement_lost(self) -> float:
        """Share of fp32's decisions this layer alone changes (0-1)."""
        return 1.0 - self.agreement


@dataclass(frozen=True)
class LayerSpeed:
    """One convolution's kernel time per call in fp32 and in int8, in one runtime on this CPU (its profiler).

    Args:
        layer: the layer's name.
        fp32_ms, int8_ms: milliseconds per call of the timing batch.
    """

    layer: str
    fp32_ms: float
    int8_ms: float


#: A layer is kept float for speed only when int8 is slower by at least this share of all the fp32
#: convolutions' time: smaller differences are profiler noise, and a float layer among int8 ones also
#: costs a quantise/dequantise pair.
LEAST_SHARE = 0.01


def no_faster_in_int8(fp32: dict[str, float], int8: dict[str, float], least_share: float = LEAST_SHARE) -> list[LayerSpeed]:
    """The layers whose int8 kernel is slower than fp32 (milliseconds per call, layer -> time, from one
    runtime's profiler) by at least ``least_share`` of the fp32 convolutions' time; the largest loss first."""
    total = sum(fp32.values())
    rows = [LayerSpeed(layer, fp32[layer], int8[layer]) for layer in fp32
            if layer in int8 and int8[layer] - fp32[layer] >= least_share * total]
    return sorted(rows, key=lambda r: r.fp32_ms - r.int8_ms)


def lowest_times(profiles: Sequence[dict[str, float]]) -> dict[str, float]:
    """Each layer's lowest time over ``profiles`` (layer -> ms, the same model profiled more than once), for the
    layers every profile timed: what another process added to one profile does not count."""
    return {layer: min(p[layer] for p in profiles) for layer in profiles[0] if all(layer in p for p in profiles)}


@dataclass(frozen=True)
class CurvePoint:
    """One int8 build of a search: how many layers it keeps in float, how it decides, how fast it runs.

    Args:
        runtime: ``"onnxruntime"`` or ``"openvino"``.
        float_layers: the layers kept in float.
        agreement: against fp32 on the evaluation images (and accuracy with labels).
        img_s: images/s at the timing batch and threads.
        speedup: ``img_s`` over fp32 ONNX Runtime's, timed in the same round-robin.
        meets: whether it meets the target.
        step: ``"search"`` (a prefix of the sensitivity order) or ``"prune"`` (a float layer of the search's
            answer returned to int8).
        float_part: the precision the runtime ran the float part in (:data:`~cgavit.deploy.int8.FLOAT_PARTS`;
            a bf16 one only in OpenVINO).
        held_out: against fp32 on the held-out images, which no search or pruning step saw (None: not judged
            there; :func:`cgavit.deploy.quantize.quantize` judges only the builds it considers answering with).
    """

    runtime: str
    float_layers: tuple[str, ...]
    agreement: Agreement
    img_s: float
    speedup: float
    meets: bool
    step: str = "search"
    float_part: str = "fp32"
    held_out: Agreement | None = None

    @property
    def path(self) -> str:
        """The runtime and float part as one key: ``"onnxruntime"``, ``"openvino"``, ``"openvino+bf16"``."""
        return self.runtime if self.float_part == "fp32" else f"{self.runtime}+{self.float_part}"


@torch.no_grad()
def padded_logits(module: nn.Module, images: torch.Tensor, batch: int = 16) -> torch.Tensor:
    """``module`` over ``images`` ``(N, C, H, W)`` in batches of exactly ``batch`` (the last one padded,
    so that runtimes compiled per batch size compile once); float32 logits ``(N, classes)``."""
    outs = []
    for piece in images.split(batch):
        out = torch.as_tensor(module(pad_batch(piece, batch))).float()
        outs.append(out[: len(piece)])
    return torch.cat(outs)


def layer_sensitivity(
    layers: Sequence[str], build: Callable[[list[str]], nn.Module], images: torch.Tensor, reference: torch.Tensor,
) -> list[LayerSensitivity]:
    """Each layer quantised alone: ``build(float_layers)`` with every other layer in float, run on ``images``
    and compared with the fp32 ``reference`` logits; most sensitive first (agreement, then logit error)."""
    rows = []
    for i, layer in enumerate(progress_bar(layers, "sensitivity, one layer int8 at a time")):
        module = build([other for other in layers if other != layer])
        out = padded_logits(module, images)
        a = compare_logits(out, reference)
        rel = float((out.double() - reference.double()).norm() / reference.double().norm())
        rows.append(LayerSensitivity(layer, a.top1_agreement, round(a.n * (1 - a.top1_agreement)), a.n, rel))
        log.debug("sensitivity %d/%d %s: agreement %.4f, rel err %.2e", i + 1, len(layers), layer, a.top1_agreement, rel)
    return sorted(rows, key=lambda r: (r.agreement, -r.rel_err))


def search_float_layers(
    order: Sequence[str], judge: Callable[[tuple[str, ...]], CurvePoint], start: CurvePoint | None = None,
    most: int | None = None,
) -> list[CurvePoint]:
    """Keep the first k layers of ``order`` in float for the fewest k whose build meets the target.

    Args:
        order: layers, most sensitive first.
        judge: builds the int8 model with those layers in float and measures it (a :class:`CurvePoint`).
        start: the all-int8 point when already measured (k = 0).
        most: the largest k tried (default and at most ``len(order) - 1``: something stays int8).

    Returns:
        Every point measured, in increasing k; the first that meets is the answer (none: nothing met).
    """
    limit = len(order) - 1 if most is None else min(most, len(order) - 1)
    points = {0: start or judge(())}
    if points[0].meets or limit < 1:
        return [points[0]]
    k, last_missed = 1, 0
    while True:  # 1, 2, 4, ... until one meets, or the limit is reached
        points[k] = judge(tuple(order[:k]))
        if points[k].meets or k == limit:
            break
        last_missed, k = k, min(2 * k, limit)
    if points[k].meets:  # halve the last step: the fewest in (last_missed, k] that meets
        low, high = last_missed, k
        while high - low > 1:
            mid = (low + high) // 2
            points[mid] = judge(tuple(order[:mid]))
            low, high = (low, mid) if points[mid].meets else (mid, high)
    return [points[i] for i in sorted(points)]


def prune_float_layers(
    found: Sequence[str], judge: Callable[[tuple[str, ...]], CurvePoint], order: Sequence[str],
) -> list[CurvePoint]:
    """Return the float layers ``found`` (a build that meets the target) to int8 one at a time, in ``order``
    (layers not in ``found`` are skipped), keeping each return whose build still meets the target.

    Args:
        found: the float layers of a build that meets the target.
        judge: builds and measures the int8 model with those layers in float (a :class:`CurvePoint`).
        order: the order to try them in (e.g. the layers int8 speeds up most first).

    Returns:
        Every point measured (``step="prune"``); the last that meets has the fewest float layers (none
        meets: no layer could return).
    """
    keep = list(found)
    points = []
    for layer in [name for name in order if name in found]:
        trial = tuple(name for name in keep if name != layer)
        point = replace(judge(trial), step="prune")
        points.append(point)
        if point.meets:
            keep = list(trial)
    return points


def fewest_meeting(points: Sequence[CurvePoint]) -> CurvePoint | None:
    """The point with the fewest float layers that meets the target (None if none meets)."""
    meeting = [p for p in points if p.meets]
    return min(meeting, key=lambda p: len(p.float_layers)) if meeting else None
