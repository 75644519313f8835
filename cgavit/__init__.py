"""cgavit: EfficientViT (cascaded group attention, CVPR 2023) for PyTorch."""

from .attention import CascadedGroupAttention, LocalWindowAttention
from .factory import create_model, list_models
from .deploy import fuse, optimize
from .model import EfficientViT
from .variants import VARIANTS, EfficientViTConfig
from .weights import load_checkpoint, save_weights

__version__ = "0.1.0"

__all__ = [
    "CascadedGroupAttention",
    "EfficientViT",
    "EfficientViTConfig",
    "LocalWindowAttention",
    "VARIANTS",
    "create_model",
    "fuse",
    "optimize",
    "load_checkpoint",
    "save_weights",
    "list_models",
]
