"""One process at a time: :class:`FileLock`, an exclusive ``flock`` held while a process writes a set of files (a
training run's folder, ``cgavit quantize``'s int8 file and report), so that a second process on the same files stops
at once with one line naming the first."""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import stat
import time
from pathlib import Path

from .io import WriteError, process_alive, stop_signals_deferred, write_reason

log = logging.getLogger(__name__)


class FileLock:
    """An exclusive lock on the file ``path`` while this process writes what it guards, so that a second process
    started on the same files stops with a clear error instead of interleaving its files with the first's.

    The lock is an exclusive ``flock`` on that file, held until exit; the file also holds the holder's pid, for the
    message a second process prints. Two processes can never both hold it, and the kernel releases it when its
    process ends however it ends (``kill -9`` included), so a lock file left by a process that is gone is simply
    taken over: no pid is trusted to decide. On a lock file this package did not make (a symbolic link, a folder, a
    pipe) or a folder that cannot be made or written (read-only, full, not permitted), entering raises a
    ``ValueError`` or :class:`~cgavit.io.WriteError` with one line saying what to do. POSIX only (``fcntl``).

    Args:
        path: the lock file (its folder is made if missing).
        doing: what the holder does, for the refusal: "another run (pid N) ``doing``; wait for it, ...".
    """

    def __init__(self, path: str | os.PathLike, doing: str) -> None:
        self.path, self.doing = Path(path), doing
        self.fd: int | None = None

    @property
    def held(self) -> bool:
        return self.fd is not None

    def __enter__(self) -> "FileLock":
        error = self.acquire()
        if error is not None:
            raise error
        return self

    def acquire(self) -> Exception | None:
        """Take the lock (making the folder first); the error to raise when it cannot be taken (on every rank, for
        :class:`~cgavit.train.distributed.RunLock`), else None. A Ctrl-C or SIGTERM while it is taken comes once the
        lock is either held or not (its file made but held by no one, it was left behind), and then lets it go."""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            return self._unusable(err)
        try:
            for _ in range(_LOCK_ATTEMPTS):
                with stop_signals_deferred():
                    outcome = self._attempt()
                if outcome is _TAKEN:
                    return ValueError(self._taken_message())
                if outcome is not _AGAIN:
                    return outcome
        except BaseException:  # the stop signal came while it was taken: not kept, nor its file left
            self.__exit__(None, None, None)
            raise
        return ValueError(f"could not take {self.path}: other processes keep removing it; is another run starting there?")

    def _attempt(self) -> Exception | object | None:
        """One try at the lock: None (held: :attr:`fd` set), the error, :data:`_TAKEN` (another process holds it) or
        :data:`_AGAIN` (removed by its holder since it was opened)."""
        try:
            fd = os.open(self.path, _LOCK_FLAGS, 0o644)
        except OSError as err:
            return self._unusable(err)
        outcome = self._lock(fd)
        if outcome is not None or not _names(self.path, fd):  # not ours, or removed by its holder since we opened it
            os.close(fd)
            return _AGAIN if outcome is None else outcome
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

    def _lock(self, fd: int) -> Exception | object | None:
        """``flock`` the open lock file ``fd`` without waiting; the error when it cannot be, :data:`_TAKEN` when
        another process holds it, else None."""
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return ValueError(f"{self.path} is not a regular file (a pipe, socket or device); remove it and run again")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return _TAKEN
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
        return f"{who} {self.doing}; wait for it, stop it, or use another --output"

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
        return WriteError(code, f"cannot write into {self.path.parent}: {reason}; give --output a folder you can write to")

    def __exit__(self, *exc) -> None:
        if self.fd is None:
            return
        try:
            with stop_signals_deferred():  # a Ctrl-C as the run ends: the lock still goes before it takes effect
                if _names(self.path, self.fd):  # removed while still held, so no one takes a file on its way out
                    self.path.unlink(missing_ok=True)
        except OSError as err:  # the folder went read-only (or unwritable) during the run: the run's own error stands
            log.warning("could not remove %s (%s); the next run there takes it over", self.path, err.strerror or err)
        finally:
            os.close(self.fd)
            self.fd = None




#: What :meth:`FileLock._attempt` says when another process holds the lock, and when its file was removed since it
#: was opened (try again).
_TAKEN, _AGAIN = object(), object()
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
