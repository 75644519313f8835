"""TFLite / LiteRT: conversion with ``litert-torch``, the LiteRT interpreter (XNNPACK) as a module.

The ``cgavit[tflite]`` extra (``litert-torch``, which brings the ``ai-edge-litert`` interpreter and,
through its converter, JAX and transformers: about 0.9 GB). Both are imported in one place,
:func:`_litert`, on first use.

fp32 only here: the batch size is fixed at conversion like the image size (the interpreter's XNNPACK
delegate refused to resize the converted graph to another batch: "failed to reshape"), and
:class:`TfliteModule` runs any batch in pieces of the converted one.
"""

from __future__ import annotations

import importlib.util
import os
import tempfile
import warnings
from pathlib import Path
from types import SimpleNamespace

import torch
from torch import nn

from ..io import atomic_write
from .fusion import example_batch, export_form, output_path
from .metadata import unreadable_file
from .runtime import FixedBatchModule


def _litert() -> SimpleNamespace:
    """The one place litert-torch (converter) and ai-edge-litert (interpreter) are imported."""
    import litert_torch
    from ai_edge_litert.interpreter import Interpreter

    return SimpleNamespace(convert=litert_torch.convert, Interpreter=Interpreter)


def tflite_problem() -> str | None:
    """Why the LiteRT paths cannot be used here, or None (checked without importing them)."""
    missing = [name for name in ("litert_torch", "ai_edge_litert") if importlib.util.find_spec(name) is None]
    return f"{' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} not installed" if missing else None


def tflite_model(model: nn.Module, img_size: tuple[int, int], batch: int = 1) -> bytes:
    """The ``.tflite`` flatbuffer of ``fuse(model)`` for ``(batch, C, *img_size)`` float32 inputs.

    Raises:
        ValueError: batch below 1.
    """
    if batch < 1:
        raise ValueError(f"batch must be at least 1, got {batch}")
    lite = _litert()
    fused = export_form(model, img_size)
    x = example_batch(fused, img_size, batch)
    with warnings.catch_warnings(), tempfile.TemporaryDirectory() as tmp:
        warnings.simplefilter("ignore")  # export notices about shape-dependent branches: the size is fixed
        converted = lite.convert(fused, (x,))
        converted.export(str(Path(tmp) / "model.tflite"))
        return (Path(tmp) / "model.tflite").read_bytes()


def export_tflite(
    model: nn.Module, path: str | os.PathLike, img_size: tuple[int, int] = (224, 224), batch: int = 1
) -> Path:
    """Write ``fuse(model)`` as a ``.tflite`` file (fp32), atomically.

    Args:
        model: the model (fused here).
        path: output ``.tflite`` file.
        img_size: ``(H, W)`` the file accepts.
        batch: the batch size the file accepts (default 1).

    Raises:
        ValueError: a missing output folder, batch below 1.
    """
    path = output_path(path)
    data = tflite_model(model, img_size, batch)
    return atomic_write(path, lambda tmp: Path(tmp).write_bytes(data))


class TfliteModule(FixedBatchModule):
    """A ``.tflite`` model run by the LiteRT interpreter (XNNPACK delegate on the CPU), called like a module.

    Args:
        model: the ``.tflite`` file or its bytes.
        threads: interpreter threads (default: ``torch.get_num_threads()``, so ``--threads`` applies).

    Raises:
        ValueError: a file the interpreter cannot load (truncated, corrupt, not a ``.tflite`` model), naming it.
    """

    def __init__(self, model: str | os.PathLike | bytes, threads: int | None = None) -> None:
        super().__init__("fp32")
        data = model if isinstance(model, bytes) else Path(model).read_bytes()
        try:
            self.interpreter = _litert().Interpreter(model_content=data, num_threads=threads or torch.get_num_threads())
            self.interpreter.allocate_tensors()
        except (ValueError, RuntimeError) as err:
            if isinstance(model, bytes):  # built here, not read from a file: a defect of ours
                raise
            raise unreadable_file(model, "a LiteRT (.tflite) model", err) from None
        self.input = self.interpreter.get_input_details()[0]
        self.output = self.interpreter.get_output_details()[0]
        self.takes(self.input["shape"])

    def run_batch(self, x: torch.Tensor) -> torch.Tensor:
        self.interpreter.set_tensor(self.input["index"], x.numpy())
        self.interpreter.invoke()
        return torch.from_numpy(self.interpreter.get_tensor(self.output["index"]).copy())


def tflite_path(fused: nn.Module, example_input: torch.Tensor) -> TfliteModule:
    """``fused`` converted to LiteRT for the example's batch and image size, loaded in memory."""
    return TfliteModule(tflite_model(fused, tuple(example_input.shape[2:]), len(example_input)))
