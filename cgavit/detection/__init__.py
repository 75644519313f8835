"""Object detection and instance segmentation with EfficientViT backbones (torchvision + pycocotools).

``retinanet(...)`` and ``maskrcnn(...)`` build the paper's detectors; :func:`train`,
:func:`evaluate_checkpoint` and :func:`predict_images` are what ``cgavit detect train|eval|predict``
run. Needs the ``detect`` extra (``pip install 'cgavit[detect]'``); pycocotools is imported on first
use, in :mod:`.coco`.
"""

from timm.layers import freeze_batch_norm_2d as freeze_batchnorm  # timm's, under this package's older name

from .annotations import CocoCheck, check_coco
from .backbone import EfficientViTFPN, detection_body
from .checkpoint import load_detector, read_checkpoint
from .data import CocoDetection, open_image
from .draw import draw_detections
from .engine import DetectionTrainConfig, evaluate, evaluate_checkpoint, train
from .models import build_detector, maskrcnn, retinanet
from .predict import Prediction, predict_images
from .shapes import write_shapes_dataset

__all__ = [
    "CocoCheck",
    "CocoDetection",
    "DetectionTrainConfig",
    "EfficientViTFPN",
    "Prediction",
    "build_detector",
    "check_coco",
    "detection_body",
    "draw_detections",
    "evaluate",
    "evaluate_checkpoint",
    "freeze_batchnorm",
    "load_detector",
    "maskrcnn",
    "open_image",
    "predict_images",
    "read_checkpoint",
    "retinanet",
    "train",
    "write_shapes_dataset",
]
