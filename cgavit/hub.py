"""The pretrained download: the authors' release files, fetched once into the torch hub cache."""

from __future__ import annotations

import errno
import http.client
import logging
import os
import re
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

import torch

from .io import CheckpointError, UnsafeCheckpointError, WriteError, make_folder, process_alive, write_reason
from .weights import read_state_dict

try:
    from tqdm import tqdm  # the progress bar torch.hub shows; optional (the deploy extra has no tqdm)
except ImportError:
    tqdm = None

log = logging.getLogger(__name__)

#: Set to a folder URL to fetch the release file names from a mirror instead.
MIRROR_ENV = "CGAVIT_WEIGHTS_MIRROR"
#: Seconds a download waits for the server to answer, or for its next bytes, before it gives up.
STALL_TIMEOUT = 60.0
_CHUNK = 128 * 1024  # bytes read at a time (torch.hub's size)
#: The least a download must receive in each :data:`STALL_TIMEOUT` (about 1 KB/s): a server that trickles bytes in
#: slower than that is given up on as one that sends nothing (the 9.8 MB of M0's weights would take weeks).
MIN_BYTES_PER_WINDOW = 64 * 1024


class _TooSlow(TimeoutError):
    """Bytes come, but under :data:`MIN_BYTES_PER_WINDOW` in a :data:`STALL_TIMEOUT`."""
_MOVE_CACHE = "set TORCH_HOME=DIR (or call torch.hub.set_dir(DIR)) to keep the weights cache in a folder you can write"


def release_url(url: str) -> str:
    """``url``, with its directory replaced by ``$CGAVIT_WEIGHTS_MIRROR`` when that is set: a folder URL, or a plain
    folder path (``/srv/weights``, ``~/weights``), read as the ``file://`` URL of that folder."""
    mirror = os.environ.get(MIRROR_ENV, "").strip()
    if not mirror:
        return url
    if "://" not in mirror:  # a path: urllib would refuse it as an "unknown url type"
        mirror = Path(mirror).expanduser().absolute().as_uri()
    return f"{mirror.rstrip('/')}/{url.rsplit('/', 1)[-1]}"


def download_release(url: str, progress: bool = True, timeout: float | None = None,
                     check: Callable[[dict[str, torch.Tensor]], None] | None = None) -> Path:
    """Fetch a release file into ``<torch hub dir>/checkpoints`` (once) and return its path.

    The file is streamed into a temporary file of its own beside its place (so threads and processes
    downloading the same file at once do not meet) and moved there only once it reads as a weights file
    (a safe ``torch.load``) and passes ``check``: a download cut short, an error page a proxy served, or (with
    ``check``) another file a mirror serves under that name, is never cached.
    Temporary files of earlier downloads whose process has ended are removed first.

    Args:
        url: the release file's URL (its folder replaced by ``$CGAVIT_WEIGHTS_MIRROR`` when set; ``file://``
            works too).
        progress: show a progress bar on stderr (when tqdm is installed).
        timeout: seconds to wait for the server to answer, or for the next bytes, before giving up;
            default :data:`STALL_TIMEOUT`.
        check: called with the downloaded state dict before it is cached; raises :class:`CheckpointError` (saying
            what the file is not) to refuse it.

    Raises:
        CheckpointError: the download failed, stalled, is not a weights file or fails ``check`` (the message says
            how to get the file by hand).
        WriteError: the cache folder cannot be made or written (the message names it and how to move it).
    """
    url = release_url(url)
    folder = Path(torch.hub.get_dir()) / "checkpoints"
    dst = folder / url.rsplit("/", 1)[-1]
    if dst.is_file() and dst.stat().st_size > 0:
        return dst
    if dst.exists() and not dst.is_file():  # found before the download, not after it (which was then thrown away)
        raise WriteError(errno.EISDIR, f"the torch hub cache holds a folder (or other non-file) at {dst}, where the "
                                       f"weights go; remove it, or {_MOVE_CACHE}")
    try:
        make_folder(folder, "torch hub cache folder")
    except WriteError as err:
        raise WriteError(err.errno, f"{err}; or {_MOVE_CACHE}") from None
    timeout = STALL_TIMEOUT if timeout is None else timeout
    _remove_dead_downloads(folder, dst.name, timeout)
    log.info("downloading %s to %s", url, dst)
    part = dst.with_name(f".{dst.name}.{os.getpid()}.{uuid.uuid4().hex}.part")  # one per call: threads too
    try:
        _fetch(url, part, timeout, progress)
        _check_weights(part, url, check)
        try:
            os.replace(part, dst)
        except OSError as err:
            if not (dst.is_file() and dst.stat().st_size > 0):  # else another download put it there first
                raise _cache_error(folder, err) from None
    finally:
        _discard(part)
    return dst


def _discard(part: Path) -> None:
    """Remove the temporary ``part`` if it is there. Only if: in a read-only folder, removing a file that was never
    made fails too (EROFS, not ENOENT), and that error would stand in for the one saying why nothing was written.
    One that cannot be removed stays, for :func:`_remove_dead_downloads` to clear later."""
    try:
        if os.path.lexists(part):
            part.unlink()
    except OSError as err:
        log.warning("could not remove the unfinished download %s: %s", part, err.strerror or err)


def _by_hand() -> str:
    return (f"Download it by hand and give the file instead (--checkpoint, --finetune or --pretrained-backbone "
            f"FILE; in Python checkpoint_path= or pretrained_backbone=), or set {MIRROR_ENV} to a folder URL that serves it")


def _cache_error(folder: Path, err: OSError) -> WriteError:
    code, reason, advice = write_reason(err, folder)
    return WriteError(code, f"cannot write into the torch hub cache folder {folder}: {reason}; {advice}, or {_MOVE_CACHE}")


def _fetch(url: str, part: Path, timeout: float, progress: bool) -> None:
    """Stream ``url`` into the new file ``part``, giving up when no byte comes for ``timeout`` seconds."""
    try:
        out = open(part, "xb")
    except OSError as err:
        raise _cache_error(part.parent, err) from None
    try:
        with out, urllib.request.urlopen(urllib.request.Request(url, headers={"User-Agent": "cgavit"}),
                                         timeout=timeout) as response:
            length = (response.headers.get("Content-Length") or "").strip()
            size = (int(length) or None) if length.isdigit() else None  # as http.client, a bad one is no length
            got = _copy(response, out, size, progress, timeout)
    except WriteError:
        raise
    except (OSError, ValueError, http.client.HTTPException) as err:  # URLError and socket timeouts are OSErrors
        if isinstance(err, urllib.error.HTTPError):
            err.close()  # it holds the error page's connection
        if isinstance(err, TimeoutError) or isinstance(getattr(err, "reason", None), TimeoutError):
            slow = f"under {MIN_BYTES_PER_WINDOW // 1024} KiB" if isinstance(err, _TooSlow) else "no data"
            raise CheckpointError(f"could not download {url}: {slow} for {timeout:g} s (the server or mirror does "
                                  f"not answer, or too slowly); nothing was cached. {_by_hand()}") from None
        if isinstance(err, http.client.IncompleteRead):  # a chunked body cut short; its text: "IncompleteRead(0 bytes read)"
            raise CheckpointError(f"could not download {url}: the connection closed before the end of the file; "
                                  f"nothing was cached. Try again. {_by_hand()}") from None
        raise CheckpointError(f"could not download {url} ({err}). {_by_hand()}") from None
    if size is not None and got < size:
        raise CheckpointError(f"could not download {url}: the connection closed after {got} of {size} bytes; "
                              f"nothing was cached. Try again. {_by_hand()}")


def _copy(response: BinaryIO, out: BinaryIO, size: int | None, progress: bool, timeout: float) -> int:
    """Copy ``response`` into ``out`` (a progress bar on stderr when asked and tqdm is installed); bytes copied.
    ``TimeoutError`` when fewer than :data:`MIN_BYTES_PER_WINDOW` come in ``timeout`` seconds."""
    bar = tqdm(total=size, unit="B", unit_scale=True, unit_divisor=1024, disable=not progress) if tqdm else None
    read = getattr(response, "read1", response.read)  # what has come, not a whole chunk's wait
    got, window_start, window_got = 0, time.monotonic(), 0
    try:
        while chunk := read(_CHUNK):
            window_got += len(chunk)
            if time.monotonic() - window_start >= timeout:
                if window_got < MIN_BYTES_PER_WINDOW:
                    raise _TooSlow()
                window_start, window_got = time.monotonic(), 0
            try:
                out.write(chunk)
            except OSError as err:  # a full disk: the cache's problem, not the server's
                raise _cache_error(Path(out.name).parent, err) from None
            got += len(chunk)
            if bar is not None:
                bar.update(len(chunk))
    finally:
        if bar is not None:
            bar.close()
    return got


def _check_weights(part: Path, url: str, check: Callable[[dict[str, torch.Tensor]], None] | None) -> None:
    """Raise unless the downloaded ``part`` reads as a weights file as ``--checkpoint`` reads one (safely: no code
    runs; a state dict of tensors, unwrapped from the dict around it) and passes ``check``."""
    try:
        sd = read_state_dict(part)
    except UnsafeCheckpointError:  # not damage: guessing "cut short" would mislead, and pretrained=True has no opt-in
        raise CheckpointError(f"the download of {url} holds pickled Python objects that could run code when loaded, "
                              f"so it was refused and nothing was cached. If you trust its source, download it by hand "
                              f"and load it with trust=True (--trust-checkpoint). {_by_hand()}") from None
    except CheckpointError as err:
        reason = " ".join(str(err).replace(str(part), "it").split())[:200]
        raise CheckpointError(f"the download of {url} is not a weights file (cut short, or an error page: {reason}); "
                              f"nothing was cached. {_by_hand()}") from None
    if check is None:
        return
    try:
        check(sd)
    except CheckpointError as err:
        raise CheckpointError(f"the download of {url} was refused: {err}; nothing was cached (does the mirror serve "
                              f"another file under that name?). {_by_hand()}") from None


def _remove_dead_downloads(folder: Path, name: str, timeout: float) -> None:
    """Remove the temporary files of earlier downloads of ``name`` that a killed process left in ``folder``.

    A temporary's name holds its process id (``.NAME.PID.*.part``, and ``.NAME.PID.part.*.partial`` of
    earlier versions); one is stale when that process has ended and the file has not changed for ``timeout``
    seconds. (:func:`cgavit.io.remove_stale_temporaries` clears every temporary of a folder nobody else writes
    to; other processes may be downloading into this one.)
    """
    if os.name != "posix":  # os.kill(pid, 0) tests a process only there
        return
    pattern = re.compile(rf"\.{re.escape(name)}\.(\d+)\.(?:.+\.)?part(?:ial)?")
    for path in folder.glob(f".{name}.*"):
        match = pattern.fullmatch(path.name)
        if match is None or int(match.group(1)) == os.getpid() or process_alive(int(match.group(1))):
            continue
        try:
            if time.time() - path.stat().st_mtime > timeout:
                path.unlink()
                log.info("removed %s, left by a download that was stopped", path)
        except OSError:
            pass  # gone already, or not ours to remove: it only costs space
