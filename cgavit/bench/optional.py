"""The bench's heavy optional dependencies, on first use.

timm (its port of EfficientViT and the peer models) comes with ``cgavit[bench]`` and is imported here and only
here. So does matplotlib, for the plots (the bench's, and ``cgavit quantize``'s curve); it is imported where the
package's other figures import it (:func:`cgavit.analysis.plots.matplotlib_api`), and :func:`check_plotting` asks
for it before a bench measures. Both are imported lazily because ``cgavit`` builds every command's parser at
start-up, which imports this package: importing them at the top would add seconds to every command, ``cgavit
--help`` included. ONNX Runtime, OpenVINO, ExecuTorch and LiteRT have theirs in :mod:`cgavit.deploy`.
"""

from __future__ import annotations

from importlib import metadata

from torch import nn

from ..analysis.plots import matplotlib_api


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


def check_plotting() -> None:
    """Raise ``ValueError``, saying what to install, where matplotlib (the bench's plot) cannot be imported: before the
    measuring, not after it, with nothing written."""
    try:
        matplotlib_api()
    except ImportError as err:
        raise ValueError(f"the bench's plot needs matplotlib, which cannot be imported here ({err}); install it with "
                         "pip install 'cgavit[bench]', or give --output '' to write no files") from None
