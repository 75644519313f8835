"""File writing that never leaves a half-written file where a good one was.

Every file the package writes (weights, training checkpoints, records, plots, exports) goes through
:func:`atomic_write`: the content is written to a temporary file in the destination folder and then
renamed over the destination, so a crash, a full disk or ``kill -9`` leaves either the old file or
the new one, never a torn one. A crash can leave the temporary file behind (``.NAME.*.tmp``);
:func:`remove_stale_temporaries` clears those at the next start. Files that only make sense together (an
OpenVINO ``.xml`` and its ``.bin``; an int8 file and its report) are written in a :func:`staging` folder and moved
into place by :func:`replace_together`, which a Ctrl-C cannot split; what a ``kill -9`` leaves of those two (the folder,
an old file moved aside) :func:`clear_interrupted` puts right at the next run that holds the files' lock.
"""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import re
import shutil
import signal
import stat
import tempfile
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TextIO

import torch

TMP_SUFFIX = ".tmp"


class WriteError(OSError):
    """A file could not be written (disk full, permission, ...); whatever stood at the path before is
    untouched. ``errno`` is the real cause (``ENOSPC``, ``EISDIR``, ``EROFS``, ...); the message (all
    that ``str()`` gives, without an ``[Errno N]`` prefix) says which file, why, and what to do; ``filename``,
    ``reason`` and ``advice`` are its parts."""

    reason: str = ""
    advice: str = ""

    def __str__(self) -> str:
        return self.strerror if isinstance(self.strerror, str) else super().__str__()


class DataError(ValueError):
    """A dataset, annotation file or image that cannot be used as given; the message names the file
    or item and says what to change."""


class CheckpointError(ValueError):
    """A file that is not a usable checkpoint for the model at hand: unreadable, unsafe, damaged, or for
    another architecture. The message names the file and what is wrong with it."""


class UnsafeCheckpointError(CheckpointError):
    """A checkpoint refused because loading it would unpickle arbitrary objects (code could run); the opt-in is
    ``trust=True`` (``--trust-checkpoint``)."""


class UnreadableFileError(ValueError):
    """A path that cannot be read as a file: missing, a folder, a FIFO or device, empty, or not
    permitted. The message names the path and says what to do."""


def check_readable_file(path: str | os.PathLike, what: str = "file", allow_empty: bool = False) -> Path:
    """Return ``path`` if it is a regular, readable, non-empty file; raise
    :class:`UnreadableFileError` otherwise, without ever opening a FIFO or device (which could block).
    """
    if not os.fspath(path).strip():  # Path("") is ".", the current folder
        raise UnreadableFileError(f"{what} path is empty; give the path of a file")
    path = Path(path)
    try:
        st = path.stat()
    except FileNotFoundError:
        raise UnreadableFileError(f"{what} {path} does not exist; check the path") from None
    except PermissionError:
        raise UnreadableFileError(f"{what} {path} cannot be reached: permission denied on a folder of its path") from None
    except OSError as err:
        raise UnreadableFileError(f"{what} {path} cannot be read ({err.strerror or err})") from None
    if stat.S_ISDIR(st.st_mode):
        raise UnreadableFileError(f"{what} {path} is a folder; give a file inside it")
    if not stat.S_ISREG(st.st_mode):
        raise UnreadableFileError(f"{what} {path} is not a regular file (a pipe, socket or device); give a file")
    if st.st_size == 0 and not allow_empty:
        raise UnreadableFileError(f"{what} {path} is empty (0 bytes): an interrupted copy or download? Copy it again")
    if not os.access(path, os.R_OK):
        raise UnreadableFileError(f"{what} {path} is not readable by this user (permission denied); fix its permissions")
    return path


def sniff_format(path: str | os.PathLike) -> str:
    """What a weights file is by its first bytes: ``"safetensors"``, ``"zip"`` (``torch.save``),
    ``"pickle"`` (the legacy ``torch.save`` format) or ``"unknown"``."""
    with open(path, "rb") as f:
        head = f.read(9)
    if len(head) == 9 and head[8:9] == b"{" and int.from_bytes(head[:8], "little") < 100_000_000:
        return "safetensors"  # 8-byte little-endian header length, then a JSON object
    if head[:4] == b"PK\x03\x04":
        return "zip"
    if head[:1] == b"\x80":
        return "pickle"
    return "unknown"


def atomic_write(path: str | os.PathLike, write: Callable[[str], object]) -> Path:
    """Call ``write(tmp_path)`` then rename the result onto ``path``; returns ``path``.

    The parent folder is created if needed. The file gets the mode ``open()`` would give it. Its contents reach the
    disk before the rename, and the rename before this returns (:func:`_sync`), so a power cut leaves the old file
    or the new one, never an empty or partial file under ``path``.

    Raises:
        WriteError: the folder or file could not be written (the old file, if any, is kept); its
            ``errno`` is the cause and its message says what to do (:func:`write_reason`).
        ValueError: an empty path (``Path("")`` is the current folder).
    """
    if not os.fspath(path).strip():
        raise ValueError("the path to write is empty; give a file name")
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=TMP_SUFFIX)
    except OSError as err:
        raise write_error(path, err) from None
    os.close(fd)
    try:
        write(tmp)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes 0600; give the file open()'s usual mode
        _sync(tmp)
        os.replace(tmp, path)
        _sync(path.parent)
    except (OSError, RuntimeError) as err:  # torch.save reports a full disk as a RuntimeError
        _remove(tmp)
        raise write_error(path, err) from None
    except BaseException:
        _remove(tmp)
        raise
    return path


#: The signals that stop a command (Ctrl-C, ``kill``), held back while files are moved into place together.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


@contextmanager
def stop_signals_deferred() -> Iterator[None]:
    """Run the block to its end before a Ctrl-C or SIGTERM that arrives during it takes effect (the first one is
    handed to the handler it would have reached, once the block is done). Only the main thread receives Python's
    signals, so elsewhere the block runs as it is."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[tuple[int, object]] = []
    old = {s: signal.getsignal(s) for s in STOP_SIGNALS}
    held = [s for s, handler in old.items() if handler is not None]  # None: set outside Python, left alone
    for s in held:
        signal.signal(s, lambda signum, frame: caught.append((signum, frame)))
    try:
        yield
    finally:
        for s in held:
            signal.signal(s, old[s])
        for signum, frame in caught[:1]:
            handler = old[signum]
            if callable(handler):
                handler(signum, frame)
            elif handler == signal.SIG_DFL:
                signal.raise_signal(signum)


def replace_together(moves: Sequence[tuple[str | os.PathLike | None, str | os.PathLike]]) -> None:
    """Move each finished temporary file onto its destination (a destination with None for its temporary file is
    removed: a file the new set no longer has), as one step for anyone reading them: a Ctrl-C or SIGTERM waits
    until all are in place (:func:`stop_signals_deferred`), and its ``KeyboardInterrupt`` then carries a note of
    what was written and removed (:func:`stop_notes`: the command's "interrupted" line says it); when a move fails,
    the new files already moved are removed and the old ones put back.

    Raises:
        WriteError: a move failed (every destination is as it was).
    """
    for _, dest in moves:  # a folder is never moved aside (nor removed): refused before anything moves
        if Path(dest).is_dir() and not Path(dest).is_symlink():
            raise write_error(Path(dest), IsADirectoryError(errno.EISDIR, "Is a directory"))
    try:
        for tmp, _ in moves:
            if tmp is not None:
                _sync(tmp)
    except OSError as err:
        raise write_error(Path(moves[0][1]), err) from None
    done = False
    try:
        with stop_signals_deferred():
            _move_all(moves)
            done = True
            for folder in {Path(dest).parent for _, dest in moves}:
                _sync(folder)
    except OSError as err:
        raise write_error(Path(moves[0][1]), err) from None
    except KeyboardInterrupt as stop:  # it came during the moves, and waited for them: what is on disk is this set
        if done:
            _add_note(stop, f"the files being moved into place were all moved first: {moved(moves)}")
        raise


def moved(moves: Sequence[tuple[str | os.PathLike | None, str | os.PathLike]]) -> str:
    """What :func:`replace_together` did with ``moves``, for a note: "wrote A, B; removed C"."""
    wrote, removed = ([str(dest) for tmp, dest in moves if (tmp is None) == gone] for gone in (False, True))
    return f"wrote {', '.join(wrote)}" + (f"; removed {', '.join(removed)}" if removed else "")


def _move_all(moves: Sequence[tuple[str | os.PathLike | None, str | os.PathLike]]) -> None:
    """:func:`replace_together`'s moves: each destination's old file moved aside, the new one moved there; on a failed
    move the new files are removed and the old ones put back (``OSError``), else the old ones removed."""
    aside: list[tuple[Path, Path]] = []  # (destination, its old file, moved aside until the end)
    placed: list[Path] = []
    try:
        for tmp, dest in moves:
            dest = Path(dest)
            if dest.exists() or dest.is_symlink():
                kept = moved_aside(dest, os.getpid())
                os.replace(dest, kept)
                aside.append((dest, kept))
            if tmp is not None:
                os.replace(tmp, dest)
                placed.append(dest)
    except OSError:
        for dest in placed:
            _remove(str(dest))
        for dest, kept in aside:
            os.replace(kept, dest)
        raise
    for _, kept in aside:
        _remove(str(kept))


#: How the name of an old file :func:`moved_aside` ends, as a pattern: the pid (its one group), ``.old.tmp``.
MOVED_ASIDE_END = r"(\d+)\.old" + re.escape(TMP_SUFFIX)


def moved_aside(dest: str | os.PathLike, pid: int) -> Path:
    """Where :func:`replace_together` in process ``pid`` keeps ``dest``'s old file while the new one moves in:
    ``.NAME.PID.old.tmp`` beside it."""
    dest = Path(dest)
    return dest.with_name(f".{dest.name}.{pid}.old{TMP_SUFFIX}")


def staging_prefix(dest: str | os.PathLike, pid: int) -> str:
    """The start of the name of a :func:`staging` folder for ``dest`` made by process ``pid``: ``.NAME.PID.``, followed
    by :mod:`tempfile`'s 8 random characters."""
    return f".{Path(dest).name}.{pid}."


def clear_interrupted(dests: Iterable[str | os.PathLike], staged: str | os.PathLike) -> tuple[list[Path], list[Path]]:
    """Put right what processes killed (``kill -9``, a power cut) while writing ``dests`` left beside them: the names
    they made alone, of processes that are gone. An old file :func:`replace_together` had moved aside
    (:func:`moved_aside`) goes back to its destination where that is empty (it is the only copy: the kill came between
    moving it aside and moving the new file in), and where its process's :func:`staging` folder for ``staged`` still
    holds files (the kill came before the whole set was in place, so the new files there beside old ones, an OpenVINO
    ``.bin`` beside another ``.xml``, are taken back); otherwise it is removed (the set it was replaced by is whole).
    Where one destination has several, the newest alone may go back. Then the staging folders for ``staged`` are
    removed. Call it only while holding the lock that keeps other runs from writing these files
    (:class:`~cgavit.lock.FileLock`).

    Returns:
        The destinations restored and the leftovers removed.

    Raises:
        OSError: a leftover could not be moved or removed (a read-only folder).
    """
    staged = Path(staged)
    folders = {pid: path for path, pid in _left_by_the_gone(staged.parent, re.escape(f".{staged.name}.") +
                                                            r"(\d+)\.[a-z0-9_]{8}") if path.is_dir() and not path.is_symlink()}
    unfinished = {pid for pid, folder in folders.items() if any(folder.iterdir())}
    restored, removed = [], []
    for dest in map(Path, dests):
        found = _left_by_the_gone(dest.parent, re.escape(f".{dest.name}.") + MOVED_ASIDE_END)
        for n, (kept, pid) in enumerate(sorted(found, key=lambda k: k[0].lstat().st_mtime, reverse=True)):
            if n == 0 and (pid in unfinished or not os.path.lexists(dest)):
                os.replace(kept, dest)
                restored.append(dest)
            else:
                kept.unlink()
                removed.append(kept)
    for folder in folders.values():
        shutil.rmtree(folder)
        removed.append(folder)
    if restored or removed:
        _sync(staged.parent)
    return restored, removed


def _left_by_the_gone(folder: Path, pattern: str) -> list[tuple[Path, int]]:
    """The entries of ``folder`` whose whole name matches ``pattern``, its one group a process id, of processes that
    are gone, each with that id."""
    try:
        names = os.listdir(folder)
    except OSError:  # no folder: nothing left there
        return []
    found = [(folder / name, re.fullmatch(pattern, name)) for name in names]
    pids = [(path, int(m.group(1))) for path, m in found if m]
    return [(path, pid) for path, pid in pids if pid != os.getpid() and not process_alive(pid)]


def _add_note(err: BaseException, note: str) -> None:
    """``err.add_note(note)``, on Python 3.10 too (which has no ``add_note``, and shows no notes)."""
    err.__notes__ = [*getattr(err, "__notes__", []), note]


def stop_notes(err: BaseException) -> list[str]:
    """The notes a stop signal's ``KeyboardInterrupt`` carries (:func:`replace_together`: the files it was let finish
    moving), for the command's "interrupted" line."""
    return [note for note in getattr(err, "__notes__", []) if isinstance(note, str)]


class StopNote:
    """A ``with`` block whose stop signal's ``KeyboardInterrupt`` (Ctrl-C, SIGTERM) says :attr:`note`, which the block
    sets as its work gets done, in place of the notes its steps gave it (:func:`stop_notes`): a command sets it once
    its files are all in place, so that a Ctrl-C during its last lines, or as its lock goes, says the work was done
    rather than only "interrupted"; ``""`` says nothing, for a step whose moves were into a temporary folder (a note
    naming those files would tell of files that are never written). None (the default) leaves the notes as they are.
    """

    def __init__(self, note: str | None = None) -> None:
        self.note = note

    def __enter__(self) -> "StopNote":
        return self

    def __exit__(self, kind, err, tb) -> None:
        if isinstance(err, KeyboardInterrupt) and self.note is not None:
            err.__notes__ = [n for n in getattr(err, "__notes__", []) if not isinstance(n, str)]
            if self.note:
                _add_note(err, self.note)


@contextmanager
def staging(dest: str | os.PathLike) -> Iterator[Path]:
    """A temporary folder in ``dest``'s folder (``.NAME.PID.`` and 8 random characters: :func:`staging_prefix`), where
    a set of files is written before :func:`replace_together` moves them into place; removed on leaving (after a
    ``kill -9``, by :func:`clear_interrupted`). A :class:`WriteError` for a file written in it is raised again for the
    file of that name beside it, the one the user asked for (not the temporary one).

    Raises:
        WriteError: the folder cannot be made (``dest``'s folder named in the message), or a file in it could not be
            written.
    """
    dest = Path(dest)
    folder = dest.parent
    try:
        scratch = tempfile.TemporaryDirectory(dir=folder, prefix=staging_prefix(dest, os.getpid()))
    except OSError as err:  # the folder, not dest: a caller's dest may be a stem its files are named from
        code, reason, advice = write_reason(err, folder)
        raise WriteError(code, f"cannot write into {folder}: {reason} (nothing was written); {advice}",
                         str(folder)) from None
    with scratch as tmp:
        try:
            yield Path(tmp)
        except WriteError as err:
            inside = err.filename is not None and Path(tmp) in Path(err.filename).parents
            if not inside:
                raise
            meant = folder / Path(err.filename).relative_to(tmp)
            reason = err.reason or os.strerror(err.errno or errno.EIO)
            raise _described(meant, err.errno, reason, err.advice or "check the disk and run again") from None


def _sync(path: str | os.PathLike) -> None:
    """Flush a file's contents, or a folder's entries (a rename), to the disk. A folder that cannot be opened or
    flushed (Windows; some network and FUSE file systems) is left to the file system's own guarantee."""
    if not os.path.isdir(path):
        fd = os.open(path, os.O_RDWR if os.name == "nt" else os.O_RDONLY)  # Windows flushes writable handles only
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        return
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError as err:
        if err.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF, errno.EACCES):
            raise
    finally:
        os.close(fd)


def _remove(tmp: str) -> None:
    if os.path.lexists(tmp):
        os.unlink(tmp)


#: errno -> (what happened, what to do), for the messages of :class:`WriteError`
_WRITE_REASONS = {
    errno.ENOSPC: ("the disk is full", "free some space and run again"),
    errno.EDQUOT: ("the disk quota is used up", "free some space and run again"),
    errno.EISDIR: ("it is a folder", "give the path of a file (a name inside that folder)"),
    errno.EROFS: ("the file system is read-only", "write to a folder on a writable disk"),
    errno.EACCES: ("permission denied", "fix the folder's permissions or write somewhere else"),
    errno.EPERM: ("permission denied", "fix the folder's permissions or write somewhere else"),
    errno.ENOTDIR: ("a part of its path is a file, not a folder", "give a path whose parents are folders"),
    errno.ENAMETOOLONG: ("its name is too long", "choose a shorter path"),
}
_LOW_SPACE = 64 * 2**20  # bytes: a write failing with less than this left is taken for a full disk


def require_flag(value: object, name: str) -> bool:
    """``value`` if it is True or False; ``TypeError`` naming ``name`` otherwise. A switch such as ``trust`` read as
    text from a config file ("no", "False") is truthy: it would turn on what it was meant to turn off."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {value!r} ({type(value).__name__})")
    return value


def write_reason(err: BaseException, folder: str | os.PathLike) -> tuple[int, str, str]:
    """``(errno, what happened, what to do)`` for a write into ``folder`` that failed with ``err``.

    ``err`` is an ``OSError`` (its ``errno`` is the cause) or the ``RuntimeError`` that ``torch.save``
    raises, which carries none: that one counts as a full disk when ``folder`` has under 64 MiB
    free, else as an I/O error (``EIO``).
    """
    code = getattr(err, "errno", None)
    if code is None or code == errno.EIO:
        try:
            low = shutil.disk_usage(folder).free < _LOW_SPACE
        except OSError:
            low = False
        code = errno.ENOSPC if low else errno.EIO
    if code in _WRITE_REASONS:
        return (code, *_WRITE_REASONS[code])
    text = getattr(err, "strerror", None) or (str(err).strip().splitlines() or [type(err).__name__])[0][:200]
    return code, text, "check the disk and run again"


def open_append(path: str | os.PathLike, what: str = "file") -> TextIO:
    """Open the regular file ``path`` for appending text (created if missing), never following a
    symbolic link there (which would append to whatever it points at) nor waiting on a pipe.

    Raises:
        ValueError: ``path`` is a symbolic link, a folder, a pipe, socket or device.
        WriteError: it cannot be written (read-only, full, not permitted).
    """
    path = Path(path)
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        fd = os.open(path, flags, 0o666)
    except OSError as err:
        if err.errno == errno.ELOOP:
            raise ValueError(f"the {what} {path} is a symbolic link; remove it (nothing is written through a link)") from None
        if err.errno == errno.EISDIR:
            raise ValueError(f"the {what} {path} is a folder; remove or rename it") from None
        if err.errno == errno.ENXIO:  # a pipe nobody reads
            raise ValueError(f"the {what} {path} is not a regular file (a pipe); remove it") from None
        code, reason, advice = write_reason(err, path.parent)
        raise WriteError(code, f"cannot write {path}: {reason}; {advice}") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise ValueError(f"the {what} {path} is not a regular file (a pipe, socket or device); remove it")
    os.set_blocking(fd, True)
    return os.fdopen(fd, "a", encoding="utf-8")


#: The most bytes a temporary name adds to its file's name. :func:`atomic_write` writes ``.NAME.`` then 8 random
#: characters then ``.tmp``; :func:`replace_together` moves the old file aside as ``.NAME.PID.old.tmp`` (a pid of up to
#: 7 digits); :func:`staging` makes the folder ``.NAME.PID.`` then 8 random characters, the longest of the three.
TEMPORARY_NAME_EXTRA = len(".." + "1234567" + "." + "r" * 8)


def check_names_fit(paths: Iterable[str | os.PathLike], what: str) -> None:
    """Refuse, before any work, file names longer than their folder's file system allows (``NAME_MAX``: 255 bytes on
    most, where the folder does not say), with their temporaries' :data:`TEMPORARY_NAME_EXTRA`: a name too long
    failed as a traceback in the first look at it, or as a write error after the work.

    Raises:
        ValueError: ``what`` (the option or output) is too long, by how much, for which name.
    """
    for path in sorted(map(Path, paths), key=lambda p: -len(os.fsencode(p.name))):  # the longest said
        try:
            limit = os.pathconf(path.parent, "PC_NAME_MAX")
        except (OSError, ValueError):  # a folder that is missing (said by the caller's own check) or will not say
            limit = 255
        size = len(os.fsencode(path.name))
        if size + TEMPORARY_NAME_EXTRA > limit:
            name = path.name if len(path.name) <= 48 else f"{path.name[:16]}...{path.name[-28:]}"
            raise ValueError(f"{what} is too long: it writes {printable_line(name)} ({size} bytes), and a file name "
                             f"there may have {limit - TEMPORARY_NAME_EXTRA} (the file system's {limit}, less "
                             f"{TEMPORARY_NAME_EXTRA} for its temporary name); give a name "
                             f"{size + TEMPORARY_NAME_EXTRA - limit} byte(s) shorter")


def file_in_the_way(folder: str | os.PathLike) -> Path | None:
    """The file that stops ``folder`` from being (or being made) a folder: ``folder`` itself, or the nearest of its
    parents that exists, when that is not a folder; None when nothing is in the way. Commands refuse such an
    ``--output`` before their work, not when they write its result."""
    folder = Path(folder)
    nearest = next(p for p in (folder, *folder.absolute().parents) if p.exists() or p == p.parent)
    return None if nearest.is_dir() else nearest


def is_inside(path: str | os.PathLike, folder: str | os.PathLike) -> bool:
    """Whether ``path`` is ``folder`` or lies under it, links resolved: commands refuse an ``--output`` inside the
    folder they read images from, whose next reading would take the files written there for images."""
    return Path(path).resolve().is_relative_to(Path(folder).resolve())


def make_folder(path: str | os.PathLike, what: str = "folder") -> Path:
    """Create folder ``path`` and its parents (nothing happens when it exists); returns it.

    Raises:
        WriteError: it cannot be made (read-only, full, not permitted, a file in the way); the
            message names ``what`` and the path, says why and what to do.
    """
    path = Path(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        blocker = next((p for p in (path, *path.parents) if p.exists()), None)
        if blocker is not None and not blocker.is_dir():
            raise WriteError(errno.ENOTDIR, f"cannot create the {what} {path}: {blocker} is a file, not a folder; choose another path") from None
        code, reason, advice = write_reason(err, blocker or path.parent)
        raise WriteError(code, f"cannot create the {what} {path}: {reason}; {advice}") from None
    return path


@contextmanager
def folders_kept_if_used(path: str | os.PathLike) -> Iterator[None]:
    """A ``with`` block that may make folder ``path`` (and its parents): if it ends in an error (a Ctrl-C, a failed
    measurement) the folders it made are removed where they are still empty, innermost first, so a run that wrote
    nothing leaves no empty output folder behind; folders that were there before, or hold anything, are kept."""
    path = Path(path).absolute()
    made = [p for p in (path, *path.parents) if not p.exists()]
    try:
        yield
    except BaseException:
        with contextlib.suppress(OSError):  # the first folder that is not empty (or not ours) stops the walk
            for folder in made:
                folder.rmdir()
        raise


def write_error(path: Path, err: BaseException) -> WriteError:
    """The :class:`WriteError` for a failed write of ``path`` (:func:`atomic_write`, or a writer of several files)."""
    parent = next((p for p in path.parents if p.exists()), path.parent)
    if getattr(err, "errno", None) == errno.EEXIST and not parent.is_dir():  # mkdir(exist_ok) on a file
        return WriteError(errno.ENOTDIR, f"cannot write {path}: {parent} is a file, not a folder; give a path under a "
                          "folder", str(path))
    return _described(path, *write_reason(err, parent))


def _described(path: Path, code: int, reason: str, advice: str) -> WriteError:
    """The :class:`WriteError` saying that ``path`` could not be written, why and what to do (kept on it as
    ``reason`` and ``advice``, for :func:`staging` to say of another path)."""
    kept = "the previous file is untouched" if path.is_file() else "nothing was written"
    err = WriteError(code, f"cannot write {path}: {reason} ({kept}); {advice}", str(path))
    err.reason, err.advice = reason, advice
    return err


def write_text(path: str | os.PathLike, text: str) -> Path:
    """Write ``text`` to ``path`` atomically."""
    return atomic_write(path, lambda tmp: Path(tmp).write_text(text))


def json_ready(value):
    """``value`` with every float that is not finite (NaN, inf: "no value") replaced by None, so that it is strict
    JSON, which every parser reads (Python's ``json`` writes ``NaN``, which most refuse)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: json_ready(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_ready(v) for v in value]
    return value


def write_json(path: str | os.PathLike, obj, indent: int | None = 1) -> Path:
    """Write ``obj`` as strict JSON (:func:`json_ready`: a float that is not finite as null) to ``path`` atomically."""
    return write_text(path, json.dumps(json_ready(obj), indent=indent, allow_nan=False) + "\n")


def save_torch(path: str | os.PathLike, obj) -> Path:
    """``torch.save(obj)`` to ``path`` atomically."""
    return atomic_write(path, lambda tmp: torch.save(obj, tmp))


def read_json_record(path: str | os.PathLike, keys: Iterable[str] = ()) -> dict:
    """The JSON object a command of this package wrote to ``path``, holding at least ``keys``.

    Raises:
        DataError: the file is not UTF-8 JSON, not an object, or lacks one of ``keys`` (file and keys named): not a
            record this package wrote, or one cut short.
    """
    path = Path(path)
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except OSError as err:  # a folder, or unreadable
        raise DataError(f"{path} cannot be read as a record ({err.strerror or err}); move it away, or use another "
                        "--output") from None
    except (UnicodeDecodeError, ValueError, RecursionError) as err:
        raise DataError(f"{path} is not a JSON record ({' '.join(str(err).split())[:80]}); move it away, or use "
                        "another --output") from None
    missing = [k for k in keys if not isinstance(record, dict) or k not in record]
    if not isinstance(record, dict) or missing:
        raise DataError(f"{path} is not a record this command wrote (" + (f"no {', '.join(missing)}" if isinstance(
            record, dict) else f"a JSON {type(record).__name__}") + "); move it away, or use another --output")
    return record


def read_jsonl(path: str | os.PathLike) -> list[dict]:
    """The rows (JSON objects) of a JSON-lines file ([] when it does not exist).

    Raises:
        DataError: the file is not UTF-8 text, or a line is not a JSON object (file and line named).
    """
    path = Path(path)
    if not path.is_file():
        return []
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError:
        raise DataError(f"{path} is not UTF-8 text, so not a file of records this package wrote; move it away") from None
    rows = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except (ValueError, RecursionError):
            row = None
        if not isinstance(row, dict):
            raise DataError(f"{path} line {n} is not a JSON record ({line[:60]!r}); fix or delete that line")
        rows.append(row)
    return rows


def write_jsonl(path: str | os.PathLike, rows: Iterable[dict]) -> Path:
    """Write ``rows`` as JSON lines, atomically."""
    return write_text(path, "".join(json.dumps(r) + "\n" for r in rows))


def append_jsonl(path: str | os.PathLike, row: dict) -> Path:
    """Append one JSON line; the file is rewritten atomically, so a crash never leaves half a line."""
    path = Path(path)
    old = path.read_text() if path.is_file() else ""
    return write_text(path, old + json.dumps(row) + "\n")


def remove_stale_temporaries(folder: str | os.PathLike) -> list[Path]:
    """Delete temporary files that an interrupted :func:`atomic_write` left in ``folder``. An old file that
    :func:`replace_together` had moved aside (:func:`moved_aside`) is kept: it may be the only copy of a file whose new
    one never arrived, which the command that wrote it puts back (:func:`clear_interrupted`).

    Only call this on a folder no other process is writing into (e.g. under a run lock).
    """
    folder = Path(folder)
    if not folder.is_dir():
        return []
    gone = []
    for p in folder.glob(f".*{TMP_SUFFIX}"):
        if re.fullmatch(r"\..+\." + MOVED_ASIDE_END, p.name):
            continue
        if p.is_file():
            p.unlink(missing_ok=True)
            gone.append(p)
    return gone


def printable(text: str) -> str:
    """``text`` as it may go to a terminal: control characters (ESC, CR, NUL, the C1 range) and
    formatting ones (U+202E, ...) written as Python escapes, so a file or folder name cannot rewrite
    the screen; printable text is returned unchanged. Newlines are kept (multi-line messages)."""
    if text.isprintable():
        return text
    return "\n".join(line if line.isprintable() else repr(line)[1:-1] for line in text.split("\n"))


def printable_line(text: str) -> str:
    """``text`` as one line of a terminal: :func:`printable` with line breaks escaped too (``\\n``), so that a file
    or folder name holding one cannot print a line of its own, such as a forged result under another name."""
    return text if text.isprintable() else repr(text)[1:-1]


def process_alive(pid: int) -> bool:
    """Whether a process with this pid exists (one we may not signal counts as alive; POSIX)."""
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):  # OverflowError: no process id at all
        return False
    except PermissionError:
        return True
    return True
