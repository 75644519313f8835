"""Training and evaluation: the official EfficientViT recipe on image folders, one CPU to many GPUs.

Python entry points:

- :func:`train` ``(TrainConfig) -> TrainResult``: one training run, as ``cgavit train``; safe to call
  repeatedly in one process. :meth:`TrainConfig.resume_from` continues a stopped run.
- :func:`evaluate_checkpoint`: top-1 / top-5 / loss of a checkpoint on an image folder.
- :func:`evaluate`: the same metrics of a model over a loader (exact under ``torchrun``).
- :func:`predict`: top-k classes with names for image files.
"""

from .config import TrainConfig, TrainResult
from .engine import train
from .evaluation import evaluate
from .inference import evaluate_checkpoint, predict

__all__ = ["TrainConfig", "TrainResult", "evaluate", "evaluate_checkpoint", "predict", "train"]
