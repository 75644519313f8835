"""Image-folder samples as batches: the dataset, its collate function and the loader.

An image that cannot be decoded is reported by path and skipped (the paths travel with each batch,
so the count is exact across loader workers), or, with ``strict``, stops the iteration in the run's
own process with the image's one-line :class:`~cgavit.images.BadImageError`. So is an image that
declares more than :data:`~cgavit.bounds.MAX_IMAGE_PIXELS` pixels (a decompression bomb): its
header is read, never its pixels. Images are opened by :func:`cgavit.images.load_image`.

An iteration that ends early, by an exception from a worker or from ``strict``, shuts its worker processes
down at once: they ignore the stop signals (:func:`ignore_stop_signals`), so Python's exit would otherwise wait
for them forever.
"""

from __future__ import annotations

import os
import signal
import threading
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from ...images import BadImageError, load_image
from .transforms import load_transformed
from .samplers import seed_all


@dataclass(frozen=True)
class BadSample:
    """Placeholder a dataset returns for an unreadable image (filtered out by :func:`collate`)."""

    path: str
    error: str


class ImageFolderDataset(Dataset):
    """``(path, label)`` samples decoded with :func:`~cgavit.images.load_image` and transformed.

    ``__getitem__`` returns ``(image, label, index)``, or a :class:`BadSample` for a file that
    cannot be decoded (:func:`make_loader` skips it, or stops with ``strict``).

    Args:
        samples: ``(path, class index)`` pairs, e.g. from :func:`~cgavit.train.data.list_split`.
        classes: class names, index order.
        transform: PIL image -> tensor.
    """

    def __init__(
        self, samples: Sequence[tuple[str, int]], classes: Sequence[str], transform: Callable | None = None
    ) -> None:
        self.samples = list(samples)
        self.classes = list(classes)
        self.transform = transform

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, item: int | tuple[int, int]):
        """``item``: an index, or ``(index, seed)`` from :class:`~cgavit.train.data.SeededSampler`,
        which seeds python, numpy and torch first so the sample's augmentation depends on the seed
        alone (not on which loader worker draws it, nor on what that worker drew before)."""
        index, seed = item if isinstance(item, tuple) else (item, None)
        path, label = self.samples[index]
        if seed is not None:
            seed_all(seed)
        try:
            return (load_transformed(path, self.transform) if self.transform else load_image(path)), label, index
        except BadImageError as err:  # unreadable, or one the evaluation resize refuses (too thin)
            return BadSample(path, str(err))


@dataclass
class Batch:
    """A collated batch: images ``(B, 3, H, W)``, labels ``(B,)``, dataset indices ``(B,)``, the
    paths of the samples that were skipped because they could not be read, and what was wrong with each."""

    images: torch.Tensor | None
    labels: torch.Tensor | None
    indices: torch.Tensor | None
    bad: list[str]
    errors: list[str] = field(default_factory=list)  # one line per path of ``bad``, same order

    def __len__(self) -> int:
        return 0 if self.labels is None else len(self.labels)


def collate(items: list) -> Batch:
    """Stack the good samples and keep the paths of the bad ones."""
    good = [it for it in items if not isinstance(it, BadSample)]
    bad = [it for it in items if isinstance(it, BadSample)]
    paths, errors = [b.path for b in bad], [b.error for b in bad]
    if not good:
        return Batch(None, None, None, paths, errors)
    return Batch(
        torch.stack([g[0] for g in good]),
        torch.tensor([g[1] for g in good], dtype=torch.long),
        torch.tensor([g[2] for g in good], dtype=torch.long),
        paths,
        errors,
    )


def until_unreadable(batches: Iterable[Batch]) -> Iterator[tuple[Batch, str | None]]:
    """``batches``, each with None; where they raise a :class:`~cgavit.images.BadImageError` (a ``strict`` loader), an
    empty batch with that error's line, last.

    Under several processes one rank meets the image: raised there alone, it would leave the others waiting in their
    next collective, to fail with the process group's "connection closed" traceback (or its time-out). Its caller
    shares the line with the other ranks instead, and every rank raises it.
    """
    try:
        for batch in batches:
            yield batch, None
    except BadImageError as err:
        yield Batch(None, None, None, []), str(err)


def _worker_init(worker_id: int) -> None:
    # torch seeds python's random and itself per worker from the loader's generator; numpy too:
    np.random.seed(torch.initial_seed() % 2**32)
    ignore_stop_signals()


#: The signals that stop a run: its process handles them; its loader workers ignore them.
STOP_SIGNALS = tuple(sig for sig in (signal.SIGTERM, signal.SIGINT, getattr(signal, "SIGHUP", None)) if sig is not None)


def ignore_stop_signals(worker_id: int = 0) -> None:
    """A loader worker's ``worker_init_fn`` (with :class:`StopSafeLoader`): :data:`STOP_SIGNALS` ignored, so the
    run's process alone stops the run.

    ``timeout``, a job scheduler or Ctrl-C signal the whole process group. A worker left as torch sets it
    dies of a SIGTERM that its parent did not send, and torch then raises in the main process ("DataLoader
    worker ... killed by signal") while the run saves where it stopped; a worker that inherited the run's
    handler logged the signal once more. The main process ends its workers itself when it stops (and a
    worker whose parent is gone exits on its own). A signal that arrived while the worker started (held
    back by :class:`StopSafeLoader`) is dropped here.
    """
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)


class StopSafeLoader(DataLoader):
    """A DataLoader of :class:`Batch` es whose workers ignore the stop signals, and are stopped by its iteration.

    Its worker processes start with :data:`STOP_SIGNALS` held back, so that none reaches a worker before its
    ``worker_init_fn`` (:func:`ignore_stop_signals`) ignores them; the run's process gets a signal sent
    meanwhile as soon as the workers are started. Since they ignore SIGTERM, Python's exit cannot end them: an
    iteration that ends by an exception (from a worker, or ``strict``) shuts them down before it raises.

    Args:
        strict: raise the :class:`~cgavit.images.BadImageError` of the first unreadable image (in this process,
            as one line) instead of skipping it.
        args, kwargs: as ``DataLoader``'s.
    """

    def __init__(self, *args, strict: bool = False, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.strict = strict

    def __iter__(self):
        return self._checked(self._started())

    def check_worker_number_rationality(self) -> None:
        """torch's check that the workers do not outnumber the cores this process may use, said as what to do, and
        once (a warning of cgavit's, shown once per process): torch's own came twice per loader, of two lines each,
        on every eval and train run of a 2-core machine at the default ``--workers 4``."""
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        if self.num_workers > cores:
            warnings.warn(f"{self.num_workers} loader worker processes, where this process may use {cores} CPU "
                          f"core(s): batches may come slower; give --workers {cores} or fewer", RuntimeWarning)

    def _started(self):
        if self.num_workers == 0 or threading.current_thread() is not threading.main_thread():
            return super().__iter__()
        held = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
        try:
            return super().__iter__()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, held)

    def _checked(self, batches):
        """``batches`` (torch's iterator), stopped at the first unreadable image when ``strict``. When an exception
        ends it, its workers are shut down before it propagates (``_shutdown_workers`` is torch's own, what the
        iterator's ``__del__`` calls: too late when the exception keeps it alive until Python's exit), and a
        persistent loader starts new ones next time. A consumer that stops early (``break``) leaves them to torch,
        which ends them when it drops the iterator (or keeps them, for ``persistent_workers``)."""
        try:
            for batch in batches:
                if self.strict and batch.bad:
                    raise BadImageError(f"{batch.errors[0]} (run without --strict to skip unreadable images)")
                yield batch
        except GeneratorExit:
            raise
        except BaseException:
            shutdown = getattr(batches, "_shutdown_workers", None)  # a single-process iterator has no workers
            if shutdown is not None:
                shutdown()
                self._iterator = None
            raise


def make_loader(
    dataset: Dataset,
    batch_size: int,
    sampler: Sampler,
    workers: int,
    *,
    drop_last: bool = False,
    pin_memory: bool = False,
    generator: torch.Generator | None = None,
    strict: bool = False,
) -> DataLoader:
    """A :class:`StopSafeLoader` with :func:`collate` and per-worker numpy seeding; ``strict``: the first
    unreadable image stops the iteration (raising its :class:`~cgavit.images.BadImageError`) instead of being
    skipped."""
    return StopSafeLoader(
        dataset,
        strict=strict,
        batch_size=batch_size,
        sampler=sampler,
        num_workers=workers,
        collate_fn=collate,
        drop_last=drop_last,
        pin_memory=pin_memory,
        worker_init_fn=_worker_init if workers > 0 else None,
        generator=generator,
        persistent_workers=False,
    )
