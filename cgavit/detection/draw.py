"""Drawing detections on images (torchvision's ``draw_bounding_boxes`` / ``draw_segmentation_masks``)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torchvision.utils import draw_bounding_boxes, draw_segmentation_masks

from ..analysis.plots import label_font
from .models import foreground

PALETTE = (  # matplotlib's tab10
    "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf",
)


def draw_detections(
    image: torch.Tensor,
    output: Mapping[str, torch.Tensor],
    class_names: Sequence[str],
    score_threshold: float = 0.5,
    mask_threshold: float = 0.5,
) -> torch.Tensor:
    """Draw boxes labelled ``"name score"`` and, when present, translucent masks. Detections of label 0, the
    background (RetinaNet's, :func:`~.models.foreground`), are not drawn.

    Args:
        image: ``(3, H, W)`` uint8 image.
        output: one image's detector output (``boxes`` xyxy, ``labels``, ``scores``, optional ``masks``
            ``(N, 1, H, W)`` probabilities).
        class_names: name of each label; index 0 is the background.
        score_threshold: draw detections scoring at least this.
        mask_threshold: mask probability threshold.

    Returns:
        The drawn ``(3, H, W)`` uint8 image.
    """
    output = foreground(output)
    keep = output["scores"].detach().cpu() >= score_threshold
    labels = output["labels"].detach().cpu()[keep].tolist()
    if not labels:
        return image
    colors = [PALETTE[(label - 1) % len(PALETTE)] for label in labels]
    if "masks" in output:
        masks = output["masks"].detach().cpu()[keep][:, 0] > mask_threshold  # (N, H, W)
        image = draw_segmentation_masks(image, masks, alpha=0.45, colors=colors)
    scores = output["scores"].detach().cpu()[keep].tolist()
    text = [f"{class_names[l] if l < len(class_names) else l} {s:.2f}" for l, s in zip(labels, scores)]
    side = min(image.shape[-2:])
    return draw_bounding_boxes(
        image, output["boxes"].detach().cpu()[keep], labels=text, colors=colors,
        width=max(1, round(side / 200)), font=label_font(), font_size=max(10, round(side / 28)),
    )
