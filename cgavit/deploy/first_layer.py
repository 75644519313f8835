"""The model's first convolution in int8: its weights rounded with GPTQ.

The first convolution is the layer int8 loses most in: on the CIFAR-10 model trained with ``--seed 1``
(BENCHMARKS.md), that layer alone int8, the rest fp32, changed 26 of 2,000 decisions in OpenVINO (measured on an AMX Xeon). The loss is not
its input's. Quantised on the pixels' own 8-bit grid, which holds an 8-bit image exactly, the input lost nothing
and the layer still changed 26 (35 without a bias correction). The loss is the rounding of its weights:
27 for each output (3 channels x 3 x 3), applied to image patches whose pixels move together. So an output's
rounding errors add up instead of averaging out. GPTQ (Frantar et al., 2023) rounds the weights one at a time and
moves each one's error onto those not yet rounded, weighted by the calibration patches' covariance, which says what
the output will least notice. With NNCF's own input quantiser, the layer then changed 5.

So OpenVINO's int8 builds round the first convolution's weights with GPTQ on the calibration images and set its
bias so that its mean output on them is fp32's (:func:`gptq_convolution`); its input keeps the runtime's quantiser.
ONNX Runtime's builds keep its quantiser's rounding.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F


def gptq_round(weights: torch.Tensor, covariance: torch.Tensor, half: int, damp: float = 0.01) -> tuple[torch.Tensor, torch.Tensor]:
    """``weights`` ``(O, D)`` rounded to integers in ``[-half, half]`` of a per-row step ``max |w| / half``, column by
    column, each column's rounding error moved onto the columns not yet rounded so that ``inputs @ weights.T`` moves
    least for inputs of ``covariance`` ``(D, D)`` (GPTQ; ``damp`` times its mean diagonal is added to it, for inputs
    that never vary). Returns the integers (int8) and the steps ``(O,)``."""
    w = weights.double().clone()
    scale = covariance.diagonal().mean().double().clamp_min(1e-12)
    h = covariance.double() + damp * scale * torch.eye(len(covariance), dtype=torch.float64)
    # the upper Cholesky factor of H's inverse: row i says how column i's error spreads over the later columns
    spread = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)
    step = w.abs().amax(1).clamp_min(1e-12) / half
    q = torch.zeros_like(w)
    for i in range(w.shape[1]):
        q[:, i] = torch.clamp(torch.round(w[:, i] / step), -half, half)
        error = (w[:, i] - q[:, i] * step) / spread[i, i]
        w[:, i:] -= error[:, None] * spread[i, i:][None, :]
    return q.to(torch.int8), step


@dataclass(frozen=True)
class GptqConvolution:
    """A convolution's int8 form: ``conv(quantised input, weights * scale) + bias``.

    Attributes:
        weights: int8 ``(O, C, kh, kw)``.
        scale: each output's step ``(O,)``.
        bias: ``(O,)``.
    """

    weights: torch.Tensor
    scale: torch.Tensor
    bias: torch.Tensor


def gptq_convolution(
    weight: torch.Tensor, bias: torch.Tensor | None, batches: Iterable[torch.Tensor],
    quantise_input: Callable[[torch.Tensor], torch.Tensor], stride: Sequence[int], padding: Sequence[int],
    half: int = 127,
) -> GptqConvolution:
    """The int8 form of ``conv(x, weight, bias, stride, padding)`` (``padding``: top, left, bottom, right; zeros) for the
    calibration ``batches``: the weights rounded by :func:`gptq_round` to ``half`` steps a side (127: 8-bit; 63:
    7-bit) for the covariance of the batches' patches, and the bias set so that the mean output on the batches, their
    input through ``quantise_input`` (the runtime's input quantiser), is fp32's.

    Raises:
        ValueError: no calibration batch.
    """
    # 16 images' patches at a time (at 224 px, 256 images' would take gigabytes)
    batches, d = [chunk for batch in batches for chunk in batch.split(16)], weight[0].numel()
    pad = (padding[1], padding[3], padding[0], padding[2])

    def patches(x: torch.Tensor) -> torch.Tensor:
        return F.unfold(F.pad(x, pad), weight.shape[2:], stride=tuple(stride)).transpose(1, 2).reshape(-1, d)

    count, total, outer = 0, torch.zeros(d, dtype=torch.float64), torch.zeros(d, d, dtype=torch.float64)
    for batch in batches:
        exact = patches(batch.double())
        count, total, outer = count + len(exact), total + exact.sum(0), outer + exact.T @ exact
    if not count:
        raise ValueError("the first layer's int8 needs at least one calibration batch")
    mean = total / count
    w = weight.double().reshape(len(weight), -1)
    q, step = gptq_round(w, outer / count - torch.outer(mean, mean), half)
    rounded, moved = q.double() * step[:, None], torch.zeros(len(w), dtype=torch.float64)
    for batch in batches:  # the mean error of the rounded layer on its quantised input
        x = batch.double()
        moved += (patches(x) @ w.T - patches(quantise_input(x)) @ rounded.T).sum(0)
    base = torch.zeros(len(w), dtype=torch.float64) if bias is None else bias.double()
    return GptqConvolution(q.reshape(weight.shape), step.float(), (base + moved / count).float())
