"""Object detection and instance segmentation with EfficientViT backbones (torchvision + pycocotools).

``retinanet(...)`` and ``maskrcnn(...)`` build the paper's detectors; ``cgavit detect`` trains,
evaluates and draws them. The names below are imported on first use, so ``import cgavit.detection``
(and the ``cgavit`` command) works without the ``detect`` extra installed.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "EfficientViTFPN": "backbone",
    "detection_body": "backbone",
    "freeze_batchnorm": "backbone",
    "build_detector": "models",
    "maskrcnn": "models",
    "retinanet": "models",
    "TrainConfig": "engine",
    "evaluate": "engine",
    "load_detector": "engine",
    "train": "engine",
    "CocoDetection": "data",
    "check_coco": "data",
    "draw_detections": "draw",
    "write_shapes_dataset": "shapes",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
