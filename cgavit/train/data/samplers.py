"""Samplers whose order and augmentation are reproducible per epoch, and the keyed seeds behind them.

Randomness is keyed, not streamed: each epoch's shuffle comes from ``(seed, epoch)``, and each
sample's augmentation from ``(seed, epoch, rank, position in the epoch)`` (:class:`SeededSampler`),
so results do not depend on the number of loader workers, and a stopped epoch resumes at any
position without replaying the batches before it.
"""

from __future__ import annotations

import math
import random

import numpy as np
import torch
from timm.data.distributed_sampler import RepeatAugSampler
from torch.utils.data import DistributedSampler, Sampler, SequentialSampler


def epoch_seed(seed: int, epoch: int, rank: int = 0, stream: int = 0) -> int:
    """A 63-bit seed derived from ``(seed, epoch, rank, stream)``, so each epoch's data order and
    augmentation can be replayed exactly after a resume."""
    return int(np.random.SeedSequence([seed, epoch, rank, stream]).generate_state(2, np.uint64)[0] >> 1)


def seed_all(seed: int) -> None:
    """Seed python's ``random``, numpy's global generator and torch's (CPU, and CUDA once started).

    Cheap enough to call per sample: unlike ``torch.manual_seed`` it does not queue a CUDA seeding
    call (with a captured stack trace) while CUDA is not initialised.
    """
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.default_generator.manual_seed(seed)
    if torch.cuda.is_initialized():
        torch.cuda.manual_seed_all(seed)


class SeededSampler(Sampler[tuple[int, int]]):
    """Wraps a training sampler to yield ``(index, seed)``: the seed of the sample at position ``p``
    of epoch ``e`` on rank ``r`` is a function of ``(seed, e, r, p)``, so augmentation does not depend
    on the worker count, and a resumed epoch can start at any position (``start``) without replaying
    the batches before it.

    Args:
        inner: the sampler that chooses the indices (``set_epoch`` is forwarded).
        seed: the run's seed.
        rank: this process's rank.
    """

    def __init__(self, inner: Sampler[int], seed: int, rank: int = 0) -> None:
        self.inner, self.seed, self.rank = inner, seed, rank
        self.epoch = 0
        self.start = 0  # positions of this epoch already trained on

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        if hasattr(self.inner, "set_epoch"):
            self.inner.set_epoch(epoch)

    def __iter__(self):
        base = epoch_seed(self.seed, self.epoch, self.rank, stream=4)
        for pos, index in enumerate(self.inner):
            if pos >= self.start:
                yield index, (base + pos) % 2**63

    def __len__(self) -> int:
        return max(len(self.inner) - self.start, 0)


class EpochRandomSampler(Sampler[int]):
    """A shuffle of the whole dataset drawn from ``(seed, epoch)``; ``set_epoch`` like
    ``DistributedSampler``."""

    def __init__(self, n: int, seed: int = 0) -> None:
        self.n, self.seed, self.epoch = n, seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        g = torch.Generator().manual_seed(epoch_seed(self.seed, self.epoch, stream=1))
        return iter(torch.randperm(self.n, generator=g).tolist())

    def __len__(self) -> int:
        return self.n


class _SeededRepeatAug(Sampler[int]):
    """timm's ``RepeatAugSampler`` (DeiT's repeated augmentation), whose own shuffle is seeded by
    the epoch alone, re-keyed here by the run's seed too."""

    def __init__(self, dataset, world: int, rank: int, repeats: int, seed: int) -> None:
        self.inner = RepeatAugSampler(dataset, num_replicas=world, rank=rank, shuffle=True, num_repeats=repeats)
        self.seed = seed

    def set_epoch(self, epoch: int) -> None:
        self.inner.set_epoch(epoch_seed(self.seed, epoch, stream=2))

    def __iter__(self):
        return iter(self.inner)

    def __len__(self) -> int:
        return len(self.inner)


def train_sampler(dataset, world: int, rank: int, seed: int, aug_repeats: int) -> SeededSampler:
    """Repeated augmentation across processes when ``aug_repeats > 1`` and ``world > 1`` (DeiT),
    ``DistributedSampler`` for several processes, a seeded shuffle for one; wrapped in
    :class:`SeededSampler`."""
    if world > 1 and aug_repeats > 1:
        inner = _SeededRepeatAug(dataset, world, rank, aug_repeats, seed)
    elif world > 1:
        inner = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=seed, drop_last=False)
    else:
        inner = EpochRandomSampler(len(dataset), seed)
    return SeededSampler(inner, seed, rank)


class PaddedEvalSampler(Sampler[int]):
    """Rank ``rank``'s share of ``0..n-1`` in order, padded with repeats so every rank gets the same
    count (as ``DistributedSampler``); the padding is dropped again by index after gathering."""

    def __init__(self, n: int, world: int, rank: int) -> None:
        self.n, self.world, self.rank = n, world, rank
        self.per_rank = math.ceil(n / world) if n else 0

    def __iter__(self):
        total = self.per_rank * self.world
        idx = [i % self.n for i in range(total)] if self.n else []
        return iter(idx[self.rank : total : self.world])

    def __len__(self) -> int:
        return self.per_rank


def eval_sampler(dataset, world: int, rank: int) -> Sampler:
    """In-order sampler for evaluation: plain for one process, padded shares for several."""
    return PaddedEvalSampler(len(dataset), world, rank) if world > 1 else SequentialSampler(dataset)
