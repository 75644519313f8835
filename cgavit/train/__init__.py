"""Training and evaluation: the official EfficientViT recipe on image folders, one CPU to many GPUs.

Python entry points:

- :func:`train` ``(argv) -> dict``: one training run, exactly as ``cgavit train ARGV...``; safe to call
  repeatedly in one process.
- :func:`evaluate_checkpoint`: top-1 / top-5 / loss of a checkpoint on an image folder.
- :func:`predict`: top-k classes with names for image files.
- :func:`load_model`: rebuild a network from any checkpoint (trained here, official, timm).
"""

from .engine import evaluate, train
from .inference import evaluate_checkpoint, load_model, predict

__all__ = ["evaluate", "evaluate_checkpoint", "load_model", "predict", "train"]
