"""Triton kernels for GPU inference: the fused cascaded-group-attention kernel.

* :mod:`cgavit.kernels.cga` -- the kernel (every head of a window's attention on chip, output
  projection included) and its launcher :func:`~cgavit.kernels.cga.cga_forward`.
* :mod:`cgavit.kernels.module` -- :class:`~cgavit.kernels.module.TritonWindowAttention`, built from a
  fused local window attention, and :func:`~cgavit.kernels.module.swap_triton_modules`.

Triton is optional (it ships with PyTorch's CUDA wheels): :func:`load` is the one place it is
imported, on first use, so ``import cgavit`` never needs it. Kernels are defined when their module is
imported; set ``TRITON_INTERPRET=1`` before :func:`load` to run them on the CPU (slowly), as the
tests do.
"""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType


def triton_available() -> bool:
    """Whether Triton is installed (checked without importing it)."""
    return importlib.util.find_spec("triton") is not None


def load() -> ModuleType:
    """The kernels' module :mod:`cgavit.kernels.module` (``TritonWindowAttention``,
    ``swap_triton_modules``), importing Triton: the one place it is imported.

    Raises:
        ImportError: when Triton is not installed, saying how to get it.
    """
    if not triton_available():
        raise ImportError("the Triton kernels need triton: pip install triton (or a CUDA build of torch)")
    return importlib.import_module(f"{__name__}.module")


def interpreted() -> bool:
    """Whether the kernels (loaded here if needed) run in Triton's CPU interpreter, i.e.
    ``TRITON_INTERPRET=1`` was set when they were first loaded."""
    load()
    return importlib.import_module(f"{__name__}.cga").interpreted()
