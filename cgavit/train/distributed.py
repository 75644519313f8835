"""One process or many: the ``torchrun`` environment, DistributedDataParallel set-up, collectives.

The same command runs alone or under ``torchrun`` (which sets ``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``). Backend: NCCL when the process drives a GPU, gloo
on CPU. Only rank 0 writes files or logs progress; :class:`RunLock` keeps a second run (training or
detection) out of a folder a run is writing into.
"""

from __future__ import annotations

import datetime
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)


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


def setup(device: str = "auto") -> DistEnv:
    """Read the ``torchrun`` environment, pick the device and join the process group.

    Args:
        device: ``"auto"`` (this process's GPU when there is one, else CPU), ``"cpu"``, ``"cuda"``.

    Raises:
        ValueError: ``cuda`` asked for without a GPU, or fewer GPUs than local processes.
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ValueError("--device cuda was given but no GPU is visible; use --device cpu")
        if local_rank >= torch.cuda.device_count():
            raise ValueError(
                f"local rank {local_rank} has no GPU ({torch.cuda.device_count()} visible); start at most "
                "that many processes per node (torchrun --nproc_per_node)"
            )
        torch.cuda.set_device(local_rank)
        dev = torch.device("cuda", local_rank)
    elif device == "cpu":
        dev = torch.device("cpu")
    else:
        raise ValueError(f"--device must be auto, cpu or cuda, got {device!r}")
    env = DistEnv(rank=rank, world=world, local_rank=local_rank, device=dev)
    if world > 1 and not dist.is_initialized():
        backend = "nccl" if dev.type == "cuda" else "gloo"
        dist.init_process_group(backend=backend, timeout=datetime.timedelta(minutes=30))
        env.owns_group = True
        log.debug("rank %d/%d joined the %s process group", rank, world, backend)
    return env


def teardown(env: DistEnv) -> None:
    """Leave the process group if :func:`setup` created it."""
    if env.owns_group and dist.is_initialized():
        dist.destroy_process_group()
        env.owns_group = False


def any_true(env: DistEnv, flag: bool) -> bool:
    """True on every rank when ``flag`` is true on any rank (one tiny all-reduce)."""
    if not env.distributed:
        return flag
    t = torch.tensor([1.0 if flag else 0.0], device=env.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item() > 0)


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


class RunLock:
    """``DIR/run.lock`` (holding the pid) while a run writes into ``DIR``, so a second run started
    on the same folder stops with a clear error instead of interleaving checkpoints and records. A
    lock left by a process that no longer exists is taken over."""

    def __init__(self, output: Path, env: DistEnv) -> None:
        self.path, self.env, self.held = output / "run.lock", env, False

    def __enter__(self) -> "RunLock":
        error = None
        if self.env.is_main:
            error = self._acquire()
        error = broadcast_object(self.env, error)
        if error:
            raise ValueError(error)
        return self

    def _acquire(self) -> str | None:
        for _ in range(2):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            except FileExistsError:
                try:
                    pid = int(self.path.read_text().strip() or 0)
                except (OSError, ValueError):
                    pid = 0
                if pid and alive(pid):
                    return f"another run (pid {pid}) is writing to {self.path.parent}; wait for it, stop it, or use another --output"
                self.path.unlink(missing_ok=True)  # stale: its process is gone
                continue
            with os.fdopen(fd, "w") as f:
                f.write(str(os.getpid()))
            self.held = True
            return None
        return f"could not create {self.path}"

    def __exit__(self, *exc) -> None:
        if self.held:
            self.path.unlink(missing_ok=True)
            self.held = False


def alive(pid: int) -> bool:
    """Whether a process with this pid exists (one we may not signal counts as alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
