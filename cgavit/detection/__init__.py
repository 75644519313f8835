"""Object detection and instance segmentation with EfficientViT backbones (torchvision + pycocotools).

``retinanet(...)`` and ``maskrcnn(...)`` build the paper's detectors; :func:`train`,
:func:`evaluate_checkpoint` and :func:`predict_images` are what ``cgavit detect train|eval|predict``
run. Needs the ``detect`` extra (``pip install 'cgavit[detect]'``); pycocotools is imported on first
use, in :mod:`.coco`. Images are read by the package's one opener, :mod:`cgavit.images`.
"""

from .annotations import CocoCheck, check_coco
from .backbone import EfficientViTFPN, detection_body
from .checkpoint import load_detector
from .data import CocoDetection
from .draw import draw_detections
from .engine import DetectionTrainConfig, evaluate, evaluate_checkpoint, train
from .models import maskrcnn, retinanet
from .predict import Prediction, predict_images
from .shapes import write_shapes_dataset

__all__ = [
    "CocoCheck",
    "CocoDetection",
    "DetectionTrainConfig",
    "EfficientViTFPN",
    "Prediction",
    "check_coco",
    "detection_body",
    "draw_detections",
    "evaluate",
    "evaluate_checkpoint",
    "load_detector",
    "maskrcnn",
    "predict_images",
    "retinanet",
    "train",
    "write_shapes_dataset",
]
