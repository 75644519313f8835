"""Triton kernels for GPU inference: the fused cascaded-group-attention kernel.

* :mod:`cgavit.kernels.cga` -- the kernel (every head of a window's attention on chip, output
  projection included) and its launcher :func:`~cgavit.kernels.cga.cga_forward`.
* :mod:`cgavit.kernels.module` -- :class:`~cgavit.kernels.module.TritonWindowAttention`, built from a
  fused local window attention, and :func:`~cgavit.kernels.module.swap_triton_modules`.

Triton is optional (it ships with PyTorch's CUDA wheels) and :mod:`.cga` imports it at its top, so
:func:`load` is the one place those modules are imported, on first use: ``import cgavit`` never needs
Triton. Kernels are defined when their module is imported; set ``TRITON_INTERPRET=1`` before
:func:`load` to run them on the CPU (slowly), as the tests do.
"""

from __future__ import annotations

import importlib.util
from types import ModuleType

__all__ = ["interpreted", "load", "triton_available"]


def triton_available() -> bool:
    """Whether Triton is installed (checked without importing it)."""
    return importlib.util.find_spec("triton") is not None


def load() -> ModuleType:
    """The kernels' module :mod:`cgavit.kernels.module` (``TritonWindowAttention``,
    ``swap_triton_modules``, ``interpreted``), importing Triton: the one place it is imported.

    Raises:
        ImportError: when Triton is not installed, saying how to get it.
    """
    if not triton_available():
        raise ImportError("the Triton kernels need triton: pip install triton (or a CUDA build of torch)")
    # deferred, unlike every other import of our modules: .module imports .cga, which imports triton
    import cgavit.kernels.module

    return cgavit.kernels.module


def interpreted() -> bool:
    """Whether the kernels (loaded here if needed) run in Triton's CPU interpreter, i.e.
    ``TRITON_INTERPRET=1`` was set when they were first loaded."""
    return load().interpreted()
