"""cgavit: EfficientViT (cascaded group attention, CVPR 2023) for PyTorch."""

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
