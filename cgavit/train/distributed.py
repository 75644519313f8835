"""One process or many: the ``torchrun`` environment, DistributedDataParallel set-up, collectives.

The same command runs alone or under ``torchrun`` (which sets ``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``). Backend: NCCL when the process drives a GPU, gloo
on CPU. Only rank 0 writes files or logs below errors (:func:`main_rank_logs`); :class:`RunLock` keeps a second
run (training or detection) out of a folder a run is writing into.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import fcntl
import logging
import os
import stat
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from ..io import WriteError, process_alive, write_reason

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
    """``DIR/run.lock`` while a run writes into ``DIR``, so a second run started on the same folder
    stops with a clear error instead of interleaving checkpoints and records.

    The lock is an exclusive ``flock`` on that file, held for the whole run; the file also holds the
    holder's pid, for the message a second run prints. Two processes can never both hold it, and the
    kernel releases it when its process ends however it ends (``kill -9`` included), so a lock file
    left by a process that is gone is simply taken over: no pid is trusted to decide. On a lock
    file this package did not make (a symbolic link, a folder, a pipe) or a folder that cannot be
    made or written (read-only, full, not permitted), entering raises a ``ValueError`` or
    :class:`~cgavit.io.WriteError` with one line saying what to do. POSIX only (``fcntl``).
    """

    def __init__(self, output: Path, env: DistEnv) -> None:
        self.path, self.env = Path(output) / "run.lock", env
        self.fd: int | None = None

    @property
    def held(self) -> bool:
        return self.fd is not None

    def __enter__(self) -> "RunLock":
        error = None
        if self.env.is_main:
            error = self._acquire()
        error = broadcast_object(self.env, error)
        if error is not None:
            raise error
        return self

    def _acquire(self) -> Exception | None:
        """Take the lock (making the folder first); the error to raise on every rank when it cannot
        be taken, else None."""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            return self._unusable(err)
        for _ in range(_LOCK_ATTEMPTS):
            try:
                fd = os.open(self.path, _LOCK_FLAGS, 0o644)
            except OSError as err:
                return self._unusable(err)
            error = self._lock(fd)
            if error is not None or not _names(self.path, fd):  # not ours, or removed by its holder since we opened it
                os.close(fd)
                if error is not None:
                    return error
                continue
            gone = _read_pid(fd)
            try:
                os.ftruncate(fd, 0)
                os.pwrite(fd, str(os.getpid()).encode(), 0)
            except OSError as err:  # a full disk: the lock holds all the same, only the pid is missing
                log.warning("could not write this process's pid into %s (%s)", self.path, err.strerror or err)
            if gone is not None:
                log.info("took over %s from pid %d, which is gone", self.path, gone)
            self.fd = fd
            return None
        return ValueError(f"could not take {self.path}: other processes keep removing it; is another run starting there?")

    def _lock(self, fd: int) -> Exception | None:
        """``flock`` the open lock file ``fd`` without waiting; the error when it cannot be, else None."""
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return ValueError(f"{self.path} is not a regular file (a pipe, socket or device); remove it and run again")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return ValueError(self._taken_message())
        except OSError as err:
            return self._unusable(err)
        return None

    def _taken_message(self) -> str:
        """What a second run says: the holder's pid, waited for if the holder has not written it yet."""
        deadline = time.monotonic() + _PID_WAIT_S
        pid = _read_pid_at(self.path)
        while (pid is None or not process_alive(pid)) and time.monotonic() < deadline:  # a dead pid: its successor's is coming
            time.sleep(0.01)
            pid = _read_pid_at(self.path)
        if pid is None:
            who = "another run (its pid is not recorded)"
        elif process_alive(pid):
            who = f"another run (pid {pid})"
        else:
            who = f"another run (pid {pid}, not a process of this machine: another machine or container?)"
        return f"{who} is writing to {self.path.parent}; wait for it, stop it, or use another --output"

    def _unusable(self, err: OSError) -> Exception:
        """The error for a lock file that cannot be opened or locked."""
        if err.errno == errno.ELOOP:
            return ValueError(f"{self.path} is a symbolic link, not a lock this package made; remove it and run again")
        if err.errno == errno.EISDIR:
            return ValueError(f"{self.path} is a folder, not a lock file; remove it and run again")
        if err.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
            return ValueError(
                f"cannot lock {self.path}: its file system does not support file locks (flock), so a second run could "
                "not be kept out of the folder; give --output a folder on a local disk"
            )
        code, reason, _ = write_reason(err, self.path.parent)
        return WriteError(code, f"cannot write into the run folder {self.path.parent}: {reason}; give --output a folder you can write to")

    def __exit__(self, *exc) -> None:
        if self.fd is not None:
            if _names(self.path, self.fd):  # removed while still held, so no one takes a file on its way out
                self.path.unlink(missing_ok=True)
            os.close(self.fd)
            self.fd = None


_LOCK_FLAGS = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_LOCK_ATTEMPTS = 100
_PID_WAIT_S = 2.0  # how long a second run waits for the holder to write its pid (microseconds, normally)


def _names(path: Path, fd: int) -> bool:
    """Whether ``path`` is still the file open as ``fd``."""
    try:
        st = os.stat(path, follow_symlinks=False)
    except OSError:
        return False
    mine = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino)


def _read_pid(fd: int) -> int | None:
    text = os.pread(fd, 32, 0).strip()
    return int(text) if text.isdigit() and 0 < int(text) < 2**31 else None


def _read_pid_at(path: Path) -> int | None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        return _read_pid(fd) if stat.S_ISREG(os.fstat(fd).st_mode) else None
    finally:
        os.close(fd)
