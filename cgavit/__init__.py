"""cgavit: EfficientViT (cascaded group attention, CVPR 2023) for PyTorch.

Where to start:

- :func:`create_model` builds a variant by name (``"efficientvit_m0"`` to ``"efficientvit_m5"``, :func:`list_models`),
  with the authors' ImageNet weights (``pretrained=True``) or with the paper's design dials changed
  (``cascade=False``, ``group_split=False``, ...: :class:`EfficientViTConfig`).
- :func:`load_model` rebuilds a model from a weights file, with what it records (class names, input size,
  preprocessing: :class:`ModelInfo`); :func:`save_weights` writes one.
- :func:`fuse` folds BatchNorm for inference (a copy); :func:`optimize` returns a faster inference form (ONNX Runtime
  on the CPU when installed, else torch.compile), checked against the fused model.
- Training, evaluation and prediction are :mod:`cgavit.train`; the ``cgavit`` command (``cgavit --help``;
  ``cgavit demo`` trains a small model on bundled digits) runs them and the rest from a shell.
"""

from .attention import CascadedGroupAttention, LocalWindowAttention
from .deploy import fuse, optimize
from .factory import ModelInfo, create_model, list_models, load_model
from .loading import load_checkpoint
from .model import EfficientViT
from .variants import VARIANTS, EfficientViTConfig
from .weights import save_weights

__version__ = "0.1.0"

__all__ = [
    "VARIANTS",
    "CascadedGroupAttention",
    "EfficientViT",
    "EfficientViTConfig",
    "LocalWindowAttention",
    "ModelInfo",
    "create_model",
    "fuse",
    "list_models",
    "load_checkpoint",
    "load_model",
    "optimize",
    "save_weights",
]
