"""The bench's heavy optional dependencies, each imported here and only here, on first use.

timm (its port of EfficientViT and the peer models), matplotlib (the plot and one sample photo),
scikit-image (sample photos) and scikit-learn (the linear probe) all come with ``cgavit[bench]``.
They are imported lazily because ``cgavit`` builds every command's parser at start-up, which
imports this package: importing them at the top would add seconds to every command, ``cgavit
--help`` included. ONNX Runtime, OpenVINO, ExecuTorch and LiteRT have theirs in :mod:`cgavit.deploy`.
"""

from __future__ import annotations

from importlib import metadata
from types import ModuleType

import numpy as np
from PIL import Image
from torch import nn


def create_timm_model(name: str, **kwargs) -> nn.Module:
    """``timm.create_model(name, pretrained=False, **kwargs)`` in eval mode: random weights, no download."""
    import timm

    return timm.create_model(name, pretrained=False, **kwargs).eval()


def reparameterize(model: nn.Module) -> nn.Module:
    """timm's own inference form of ``model`` (its BatchNorm folding), via ``timm.utils.reparameterize_model``."""
    from timm.utils import reparameterize_model

    return reparameterize_model(model)


def timm_version() -> str:
    """The installed timm's version (read from its metadata, without importing it)."""
    return metadata.version("timm")


def matplotlib_agg() -> ModuleType:
    """matplotlib on the file-only Agg backend, with ``pyplot`` and ``ticker`` loaded."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot  # noqa: F401  (sets matplotlib.pyplot)
    import matplotlib.ticker  # noqa: F401

    return matplotlib


def matplotlib_sample_photo(name: str = "grace_hopper.jpg") -> np.ndarray:
    """One of the sample photos shipped with matplotlib, as a uint8 ``(H, W, 3)`` array."""
    import matplotlib.cbook

    with matplotlib.cbook.get_sample_data(name) as fh:
        return np.asarray(Image.open(fh).convert("RGB"))


def skimage_photo(name: str) -> np.ndarray:
    """``skimage.data.<name>()``: a sample image shipped with scikit-image (uint8, grey or colour)."""
    import skimage.data

    return getattr(skimage.data, name)()


def fit_logistic_regression(
    features: np.ndarray, labels: np.ndarray, C: float = 0.1, max_iter: int = 2000
) -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's multinomial logistic regression: ``(coef (classes, features), intercept (classes,))``."""
    from sklearn.linear_model import LogisticRegression

    clf = LogisticRegression(max_iter=max_iter, C=C).fit(features, labels)
    return clf.coef_, clf.intercept_
