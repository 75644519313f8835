"""The pretrained download: the authors' release files, fetched once into the torch hub cache."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

from .io import CheckpointError

log = logging.getLogger(__name__)

#: Set to a folder URL to fetch the release file names from a mirror instead.
MIRROR_ENV = "CGAVIT_WEIGHTS_MIRROR"


def release_url(url: str) -> str:
    """``url``, with its directory replaced by ``$CGAVIT_WEIGHTS_MIRROR`` when that is set."""
    mirror = os.environ.get(MIRROR_ENV)
    return f"{mirror.rstrip('/')}/{url.rsplit('/', 1)[-1]}" if mirror else url


def download_release(url: str, progress: bool = True) -> Path:
    """Fetch a release file into ``<torch hub dir>/checkpoints`` (once) and return its path.

    The file is downloaded beside its place and moved there only once it reads as a weights file (a safe
    ``torch.load``): a download cut short, or an error page a proxy served, is never cached.

    Raises:
        CheckpointError: the download failed or is not a weights file (the message says how to get the file
            by hand).
    """
    url = release_url(url)
    dst = Path(torch.hub.get_dir()) / "checkpoints" / url.rsplit("/", 1)[-1]
    if dst.is_file() and dst.stat().st_size > 0:
        return dst
    dst.parent.mkdir(parents=True, exist_ok=True)
    log.info("downloading %s to %s", url, dst)
    by_hand = f"Download it by hand and pass checkpoint_path=, or set {MIRROR_ENV} to a folder URL that serves it"
    part = dst.with_name(f".{dst.name}.{os.getpid()}.part")
    try:
        try:
            torch.hub.download_url_to_file(url, str(part), progress=progress)
        except Exception as err:
            raise CheckpointError(f"could not download {url} ({err}). {by_hand}") from None
        try:
            torch.load(part, map_location="cpu", weights_only=True)
        except Exception as err:
            raise CheckpointError(f"the download of {url} is not a weights file (cut short, or an error page: "
                                  f"{' '.join(str(err).split())[:200]}); nothing was cached. {by_hand}") from None
        os.replace(part, dst)
    finally:
        part.unlink(missing_ok=True)
    return dst
