"""The base of every inference form :func:`~cgavit.deploy.optimize` and the exporters return."""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import io
import logging
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from ..io import printable
from ..model import check_image_batch

log = logging.getLogger(__name__)


def image_batches(images: object, name: str) -> list[torch.Tensor]:
    """``images`` (``"calibration"``, ``"evaluation"``: ``name``) as a list of tensors: one ``(N, C, H, W)`` tensor is
    one batch (iterated, it would give single images), any other iterable (a list, a generator: read once) its items.
    Their shapes are the caller's to check.

    Raises:
        ValueError: not a tensor or an iterable of tensors; items that are ``(images, labels)`` pairs, as a
            ``DataLoader`` yields, are named as such.
    """
    if isinstance(images, torch.Tensor):
        return [images]
    if type(images).__module__ == "numpy":  # iterated, an array gives arrays: said as one, with torch.from_numpy
        check_image_batch(images, f"{name} images")
    if not isinstance(images, Iterable) or isinstance(images, (str, bytes)):
        raise ValueError(f"{name} must be image batches (N, C, H, W), or one such tensor, preprocessed like the input; "
                         f"got {type(images).__name__}")
    batches = list(images)
    pairs = next((b for b in batches if isinstance(b, (tuple, list)) and b and isinstance(b[0], torch.Tensor)), None)
    if pairs is not None:
        raise ValueError(f"{name} gave a {type(pairs).__name__} of {len(pairs)} where image batches go: a DataLoader of "
                         f"(images, labels)? give the images alone, e.g. [images for images, _ in loader]")
    wrong = next((b for b in batches if not isinstance(b, torch.Tensor)), None)
    if wrong is not None:
        raise ValueError(f"{name} must be image batches (N, C, H, W), or one such tensor, preprocessed like the input; "
                         f"got {type(images).__name__} of {type(wrong).__name__}")
    return batches


@dataclass(frozen=True)
class PathChoice:
    """Which path ``optimize(precision="auto")`` took, and why.

    Args:
        precision: ``"fp32"``, ``"bf16"`` or ``"int8"``.
        backend: ``"torch"``, ``"onnxruntime"`` or ``"openvino"``.
        cpu_class: the rule-table row used (:data:`cgavit.deploy.cpu.CPU_CLASSES`), or ``"cuda"``.
        reason: a sentence a user can read.
    """

    precision: str
    backend: str
    cpu_class: str
    reason: str

    def describe(self) -> str:
        return f"{self.precision} {self.backend}: {self.reason}"


class RuntimeModule(nn.Module):
    """An inference form called like the model: float32 images ``(B, C, H, W)`` in, float32 logits out.

    Attributes:
        precision: ``"fp32"``, ``"bf16"`` or ``"int8"``.
        rel_err: the relative error ``optimize(check=True)`` measured against the plain model, else None.
        choice: with ``precision="auto"``, the :class:`PathChoice` taken and its reason; else None.
        input_shape: the input ``(B, C, H, W)`` a runtime's graph declares (None for a dynamic dimension; None
            where unknown): a call with other images is refused before the runtime sees it.
    """

    input_shape: tuple[int | None, ...] | None = None
    #: the file it was opened from (:func:`~cgavit.deploy.open_exported`), and the class count it declares: its
    #: runtime's errors, and outputs other than ``(B, classes)``, are then the file's fault, one ValueError naming it
    source: str | None = None
    classes: int | None = None
    #: the exceptions its runtime raises when it cannot run a call (a runtime's own sets them)
    runtime_errors: tuple[type[BaseException], ...] = ()
    #: Whether it can be copied and pickled (``copy.deepcopy``, ``torch.save``): a torch module can; a runtime's
    #: compiled session cannot, and says so in one line instead of the runtime's TypeError.
    copyable: bool = True

    def __init__(self, precision: str = "fp32") -> None:
        super().__init__()
        self.precision = precision
        self.rel_err: float | None = None
        self.choice: PathChoice | None = None

    def __reduce_ex__(self, protocol):
        if not self.copyable:
            raise TypeError(f"this {type(self).__name__} holds a runtime's compiled model, which cannot be copied or "
                            "pickled: keep the file (cgavit export or quantize) and open it again with "
                            "cgavit.deploy.open_exported, or call optimize again")
        return super().__reduce_ex__(protocol)

    def __call__(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        check_image_batch(x)
        takes = self.input_shape
        if takes is not None and len(takes) == 4 and any(t is not None and t != n for t, n in zip(takes[1:], x.shape[1:])):
            shown = ", ".join("B" if t is None else str(t) for t in (None, *takes[1:]))
            if takes[1] is not None and takes[1] != x.shape[1]:  # the size may be right: the channels are not
                fix = (f"it takes {takes[1]}-channel images: convert them (grayscale or RGB), or export a model built "
                       f"with in_chans={x.shape[1]}")
            else:
                fix = "build it again for that size (optimize, or cgavit export --img-size)"
            raise ValueError(f"this {self.precision} {type(self).__name__} takes images ({shown}), got {tuple(x.shape)}: {fix}")
        if x.shape[0] == 0:
            # an empty batch: the runtimes' reshapes cannot infer a batch of 0; one image's logits give the shape
            return self._run(x.new_zeros(1, *x.shape[1:]), *args, **kwargs)[:0]
        return self._run(x, *args, **kwargs)

    def _run(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        """The call, for a file's module (:attr:`source`) with its runtime's errors and an output other than the
        logits it declares raised as one ValueError."""
        if self.source is None:
            return super().__call__(x, *args, **kwargs)
        try:
            out = super().__call__(x, *args, **kwargs)
        except self.runtime_errors as err:
            raise ValueError(f"{self.source}: its runtime could not run it on {tuple(x.shape)} images "
                             f"({runtime_reason(err)}); export it again") from None
        if out.ndim != 2 or out.shape[0] != len(x) or (self.classes is not None and out.shape[1] != self.classes):
            raise ValueError(f"{self.source}: it returned {tuple(out.shape)} for {len(x)} images, not the (batch, "
                             f"{self.classes}) logits it declares; export it again")
        return out


def runtime_reason(err: BaseException) -> str:
    """A runtime's error in a line: the last line of its message (OpenVINO's first lines name the place in its
    source that raised it), printable and at most 200 characters, without a final full stop."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()] or [type(err).__name__]
    return printable(lines[-1][:200]).rstrip(".")


def import_problem(module: str) -> str | None:
    """Why ``module`` cannot be used (not installed, or installed and failing to import: a missing shared library, a
    build for another Python or torch), or None. Imported to find out: a package that is present but broken counts
    as missing, with its reason (not a traceback when a path through it is built)."""
    if importlib.util.find_spec(module) is None:
        return f"{module} is not installed"
    try:
        importlib.import_module(module)
    except Exception as err:  # ImportError, or whatever the package's own start-up raises when broken
        return f"{module} is installed but cannot be imported ({type(err).__name__}: {str(err)[:200]}); reinstall it"
    return None


def pad_batch(x: torch.Tensor, batch: int) -> torch.Tensor:
    """``x`` ``(n, ...)`` with copies of its last item appended up to ``batch`` items (n <= batch)."""
    if len(x) == batch:
        return x
    return torch.cat([x, x[-1:].expand(batch - len(x), *x.shape[1:])])


class FixedBatchModule(RuntimeModule, ABC):
    """A runtime whose program accepts one batch size only (ExecuTorch, LiteRT), run on any batch:
    the input is split into pieces of :attr:`batch` images, the last piece padded, the padding's
    outputs dropped. Subclasses call :meth:`takes` with their program's input shape and implement
    :meth:`run_batch`."""

    batch: int = 1
    copyable = False

    def takes(self, shape: Sequence[int]) -> None:
        """Record the program's input ``(batch, C, H, W)``: its batch, and the images it takes in any batch (others
        are refused in one line before the runtime sees them)."""
        self.batch = int(shape[0])
        self.input_shape = (None, *(int(n) for n in shape[1:]))

    @abstractmethod
    def run_batch(self, x: torch.Tensor) -> torch.Tensor:
        """Logits ``(self.batch, classes)`` of exactly ``self.batch`` contiguous float32 images."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        outs = []
        for piece in x.detach().float().split(self.batch):
            out = self.run_batch(pad_batch(piece, self.batch).contiguous())
            outs.append(torch.as_tensor(out)[: len(piece)].clone())
        return torch.cat(outs)


def _warnings_and_above(record: logging.LogRecord) -> bool:
    return record.levelno >= logging.WARNING


@contextlib.contextmanager
def quiet_quantiser(name: str) -> Iterator[None]:
    """Run a runtime's quantiser with its chatter in cgavit's debug log rather than on stdout, where a command's
    results go: what it prints (ONNX Runtime's calibrator notes, NNCF's progress bars) is captured and logged at
    DEBUG, and NNCF's INFO lines (which it writes to stdout itself) and ONNX Runtime's (which it logs on the root
    logger: one "Created a copy of bias input" per shared bias) are dropped unless cgavit logs at DEBUG
    (``cgavit -v``). Its warnings and errors still show; cgavit's own lines, which reach the root logger's
    handlers from their own loggers, are untouched."""
    nncf, root = logging.getLogger("nncf"), logging.getLogger()
    level, quiet = nncf.level, not log.isEnabledFor(logging.DEBUG)
    if quiet:
        nncf.setLevel(logging.WARNING)
        root.addFilter(_warnings_and_above)  # a logger's filter sees only what is logged on it, not propagated lines
    text = io.StringIO()
    try:
        with contextlib.redirect_stdout(text):
            yield
    finally:
        nncf.setLevel(level)
        root.removeFilter(_warnings_and_above)
        for line in text.getvalue().splitlines():  # a record each: the log escapes a line break within a value
            if line.strip():
                log.debug("%s printed: %s", name, line.rstrip())
