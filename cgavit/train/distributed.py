"""One process or many: the ``torchrun`` environment, DistributedDataParallel set-up, collectives.

The same command runs alone or under ``torchrun`` (which sets ``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``). Backend: NCCL when the process drives a GPU, gloo
on CPU. Only rank 0 writes files or logs below errors (:func:`main_rank_logs`); :class:`RunLock` keeps a second
run (training or detection) out of a folder a run is writing into.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import pickle
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import torch
import torch.distributed as dist

from ..lock import FileLock

log = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass
class DistEnv:
    """Where this process sits: ``rank`` of ``world`` processes, its ``device``, and whether this
    call created the process group (and so must destroy it)."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")
    owns_group: bool = False

    @property
    def distributed(self) -> bool:
        return self.world > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def resolve_device(device: str | torch.device, local_rank: int | None = None) -> torch.device:
    """The device ``device`` names: ``"auto"`` (a GPU when there is one, else the CPU), ``"cpu"``, ``"cuda"`` or
    ``"cuda:N"`` (or a ``torch.device``). A GPU without an index is ``local_rank``'s (torchrun's), or the first.

    Raises:
        ValueError: another kind of device, or a GPU asked for that is not here.
    """
    if isinstance(device, str) and device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        dev = None
    if dev is None or dev.type not in ("cpu", "cuda"):
        raise ValueError(f"--device must be auto, cpu or cuda (cuda:N for one GPU of several), got {str(device)!r}")
    if dev.type == "cpu":
        return dev
    if not torch.cuda.is_available():
        raise ValueError("--device cuda was given but no GPU is visible; use --device cpu")
    index = dev.index if dev.index is not None else (local_rank or 0)
    if index >= torch.cuda.device_count():
        raise ValueError(
            f"there is no GPU {index} ({torch.cuda.device_count()} visible)"
            + ("; start at most that many processes per node (torchrun --nproc_per_node)" if dev.index is None else "")
        )
    return torch.device("cuda", index)


def launched_world() -> int:
    """The number of processes ``torchrun`` started for this command (its ``WORLD_SIZE``; 1 without torchrun)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def setup(device: str = "auto") -> DistEnv:
    """Read the ``torchrun`` environment, pick the device and join the process group.

    Args:
        device: ``"auto"`` (this process's GPU when there is one, else CPU), ``"cpu"``, ``"cuda"``.

    Raises:
        ValueError: ``cuda`` asked for without a GPU, or fewer GPUs than local processes.
    """
    world = launched_world()
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    dev = resolve_device(device, local_rank)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    env = DistEnv(rank=rank, world=world, local_rank=local_rank, device=dev)
    if world > 1 and not dist.is_initialized():
        backend = "nccl" if dev.type == "cuda" else "gloo"
        dist.init_process_group(backend=backend, timeout=datetime.timedelta(minutes=30))
        env.owns_group = True
        log.debug("rank %d/%d joined the %s process group", rank, world, backend)
    return env


#: The loggers a run's warnings come through: cgavit's own, and timm's (its scheduler and optimiser factories warn).
RUN_LOGGERS = ("cgavit", "timm")


@contextlib.contextmanager
def main_rank_logs(env: DistEnv) -> Iterator[None]:
    """For the block, ranks other than 0 log errors only (through :data:`RUN_LOGGERS`, their levels restored after).

    Every rank runs the same steps on the same options, data and checkpoints, and what one rank finds (an unreadable
    image) is gathered to every rank before it is reported, so each warning would come once per rank: rank 0 says
    it once. Errors are logged by every rank, as each raises its own.
    """
    if env.is_main:
        yield
        return
    loggers = [logging.getLogger(name) for name in RUN_LOGGERS]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


def teardown(env: DistEnv) -> None:
    """Leave the process group if :func:`setup` created it."""
    if env.owns_group and dist.is_initialized():
        dist.destroy_process_group()
        env.owns_group = False


@contextlib.contextmanager
def joined(device: str = "auto") -> Iterator[DistEnv]:
    """For the block: this process's :class:`DistEnv` (:func:`setup`), warnings logged by rank 0 alone
    (:func:`main_rank_logs`), and the process group left after (:func:`teardown`)."""
    env = setup(device)
    try:
        with main_rank_logs(env):
            yield env
    finally:
        teardown(env)


def any_true(env: DistEnv, flag: bool) -> bool:
    """True on every rank when ``flag`` is true on any rank (one tiny all-reduce)."""
    return any_each(env, [flag])[0]


def any_each(env: DistEnv, flags: Sequence[bool]) -> list[bool]:
    """For each of ``flags``: true on every rank when it is true on any rank (one tiny all-reduce for them all)."""
    if not env.distributed:
        return [bool(flag) for flag in flags]
    t = torch.tensor([1.0 if flag else 0.0 for flag in flags], device=env.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return [value > 0 for value in t.tolist()]


def first_message(env: DistEnv, message: str | None) -> str | None:
    """The ``message`` of the first rank (in rank order) that has one, on every rank (a collective), so that a failure
    one rank met (an image it could not read) is raised by every rank with the same line, and none waits for the
    others in a collective the failed one never joins."""
    return next((m for m in gather_objects(env, message) if m), None)


def on_main(env: DistEnv, action: Callable[[], T]) -> T | None:
    """``action()`` run by rank 0 alone (its result there, None on the others); an exception it raises is raised on
    every rank (a collective: every rank calls this).

    Rank 0 alone writes the run's files. Without this, a write that fails (a full disk) ends rank 0 with its error
    while the others go on into their next collective, where they fail with the process group's "connection
    closed by peer" traceback (gloo) or wait for its time-out (NCCL). An exception that cannot travel between
    processes reaches the other ranks as a ``RuntimeError`` of its message.
    """
    if not env.distributed:
        return action()
    result, error = None, None
    if env.is_main:
        try:
            result = action()
        except Exception as err:
            error = err
    shared = broadcast_object(env, _portable(error) if env.is_main else None)
    if error is not None:
        raise error
    if shared is not None:
        raise shared
    return result


def _portable(error: Exception | None) -> Exception | None:
    """``error``, or a ``RuntimeError`` of its message where it cannot be pickled and rebuilt (its class takes
    other arguments than it keeps): what :func:`on_main` can send to the other ranks."""
    if error is None:
        return None
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:
        return RuntimeError(f"{type(error).__name__}: {error}")


def reduce_sum(env: DistEnv, values: list[float]) -> list[float]:
    """Element-wise sum of ``values`` over ranks (float64)."""
    if not env.distributed:
        return list(values)
    t = torch.tensor(values, dtype=torch.float64, device=env.device)
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t.tolist()


def gather_objects(env: DistEnv, obj) -> list:
    """Every rank's ``obj``, in rank order (on every rank)."""
    if not env.distributed:
        return [obj]
    out = [None] * env.world
    dist.all_gather_object(out, obj)
    return out


def barrier(env: DistEnv) -> None:
    if env.distributed:
        dist.barrier()


def broadcast_object(env: DistEnv, obj):
    """Rank 0's ``obj`` on every rank."""
    if not env.distributed:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


class RunLock(FileLock):
    """``DIR/run.lock`` while a run writes into ``DIR``, so a second run started on the same folder
    stops with a clear error instead of interleaving checkpoints and records: a
    :class:`~cgavit.lock.FileLock` that rank 0 takes, its refusal raised on every rank."""

    def __init__(self, output: Path, env: DistEnv) -> None:
        super().__init__(Path(output) / "run.lock", f"is writing to {Path(output)}")
        self.env = env

    def __enter__(self) -> "RunLock":
        error = self.acquire() if self.env.is_main else None
        error = broadcast_object(self.env, error)
        if error is not None:
            raise error
        return self
