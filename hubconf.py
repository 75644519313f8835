"""torch.hub entry points: ``torch.hub.load("path/to/cgavit", "efficientvit_m4", source="local")``.

Each entry point takes the keyword arguments of :func:`cgavit.create_model` (``pretrained``,
``num_classes``, ``img_size``, the design dials, ...).
"""

from cgavit import create_model

dependencies = ["torch"]


def efficientvit_m0(**kwargs):
    """EfficientViT-M0 (2.3 M params, 79 M MACs, 63.2 % ImageNet-1k top-1)."""
    return create_model("efficientvit_m0", **kwargs)


def efficientvit_m1(**kwargs):
    """EfficientViT-M1 (3.0 M params, 167 M MACs, 68.4 % ImageNet-1k top-1)."""
    return create_model("efficientvit_m1", **kwargs)


def efficientvit_m2(**kwargs):
    """EfficientViT-M2 (4.2 M params, 201 M MACs, 70.8 % ImageNet-1k top-1)."""
    return create_model("efficientvit_m2", **kwargs)


def efficientvit_m3(**kwargs):
    """EfficientViT-M3 (6.9 M params, 263 M MACs, 73.4 % ImageNet-1k top-1)."""
    return create_model("efficientvit_m3", **kwargs)


def efficientvit_m4(**kwargs):
    """EfficientViT-M4 (8.8 M params, 299 M MACs, 74.3 % ImageNet-1k top-1)."""
    return create_model("efficientvit_m4", **kwargs)


def efficientvit_m5(**kwargs):
    """EfficientViT-M5 (12.4 M params, 522 M MACs, 77.1 % ImageNet-1k top-1)."""
    return create_model("efficientvit_m5", **kwargs)
