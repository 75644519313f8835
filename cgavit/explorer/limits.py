"""What the explorer takes on at once, and for how long: bytes, pixels, connections, seconds.

Two kinds of bound:

* Per item, fixed: an upload is at most :data:`MAX_UPLOAD_BYTES` and decodes to at most
  :data:`~cgavit.bounds.MAX_UPLOAD_PIXELS` (checked from the image header, before any pixel is
  decoded: a 5 KB PNG can declare 6300x6300). Over either is :class:`TooLarge` (HTTP 413).
* Shared, per server (:class:`Limits`): connections served at once, request bodies and decoded
  pixels held at once (each a :class:`Budget`), and how long a client may stay idle or take over
  one request. A request that finds a budget spent, or the model busy with another request's
  attention maps, waits a moment, then gets :class:`Busy` (HTTP 503, retry later).

Decoding costs about 4 bytes per pixel (8 for images that need a colour conversion), so the
default pixel budget of 32 megapixels bounds decoding memory at roughly 130-260 MB in all.

What grows with the model's image size, and what bounds it (numbers for efficientvit_m0 at 4096 px):

* An upload is made the model's input by the decoding threads (two by default), about 15 bytes per
  model pixel each: the RGB view and one float32 copy, normalised in place (250 MB at 4096 px). Its
  preview is at most :data:`MAX_PREVIEW_SIDE` pixels a side, about 1 MB as a data URL (the page draws
  it at 224 px; at the model's size a photograph's took 48 MB and 7 s).
* An attention request runs the model up to its block and computes that block's maps one request at
  a time, a few windows at once: ``heads x N x N`` values per window of ``N`` tokens,
  :data:`MAP_VALUE_BYTES` each (:func:`window_map_bytes`), at most ``Limits.map_bytes`` in all. The
  whole block at once was 13 million values at 4096 px (210 MB), in every request at once.
* Its reply shows ``heads x H x W`` numbers for the block's ``H x W`` tokens, :data:`SHOWN_VALUE_BYTES`
  each while it is built and sent (:func:`attention_reply_bytes`: 21 MB at 4096 px); replies share the budget
  ``Limits.reply_bytes``.

A model whose one window's maps, or one reply, would exceed its budget is refused when the explorer
starts (:class:`~cgavit.explorer.image_attention.ImageAttention`), saying which block and what to change.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from ..bounds import MAX_UPLOAD_PIXELS

MAX_UPLOAD_BYTES = 5 * 1024 * 1024

#: Longest side of an upload's preview, in pixels: the page draws it on a 224 px canvas.
MAX_PREVIEW_SIDE = 512

#: Bytes one attention weight takes at the peak of summarising a block's maps: the float64 copy the page's
#: numbers come from (8) and its normalised copy in the head similarity (8). The float32 maps the heads make
#: (4), and their stack (4), are gone by then.
MAP_VALUE_BYTES = 16

#: Bytes one number of an attention reply takes while the reply is built and sent: a Python float and its list
#: slot (32), its JSON text (at most 24 characters with the separator) as a string and as bytes.
SHOWN_VALUE_BYTES = 80


def window_map_bytes(heads: int, tokens: int) -> int:
    """The memory of one window's attention maps while they are summarised: ``heads x tokens x tokens`` weights
    of :data:`MAP_VALUE_BYTES` (``tokens``: the window's, zero padding included)."""
    return heads * tokens * tokens * MAP_VALUE_BYTES


def attention_reply_bytes(heads: int, tokens: int, windows: int) -> int:
    """The memory of one attention reply over a map of ``tokens`` tokens in ``windows`` windows, at most: a
    value per head and token, the ``heads x heads`` similarity, a padding share per head and four numbers per
    window box, :data:`SHOWN_VALUE_BYTES` each."""
    return SHOWN_VALUE_BYTES * (heads * tokens + heads * heads + heads + 4 * windows)


class TooLarge(ValueError):
    """One input is over a fixed size limit (HTTP 413): make it smaller."""


class Busy(Exception):
    """The server is at a shared limit right now (HTTP 503): retry in a moment."""


@dataclass(frozen=True)
class Limits:
    """How much the explorer serves at once, and for how long.

    The defaults suit one person's browser with room for bursts; tests shrink them.

    Args:
        max_connections: connections served at once, one thread each. Default 64. A further
            connection waits up to ``connection_wait`` seconds for a free one, then gets a 503.
        connection_wait: seconds the accept loop waits for a free connection slot. Default 1.0. Once
            a wait has run out, later connections get their 503 at once until a slot frees.
        listen_queue: connections the kernel holds before the server accepts them. Default 256.
        idle_timeout: seconds a connection may send nothing (before or between requests, or in
            the middle of one) before it is closed. Default 5.
        request_timeout: seconds one request may take in all, from waiting for its first line to
            the end of its reply (a client trickling bytes is cut off here). Default 30.
        upload_bytes: request bodies held in memory at once, in bytes. Default 4 uploads' worth.
        decoded_pixels: pixels being decoded at once, over all uploads. Default 2 maximal images.
        budget_wait: seconds an upload waits for room in the two budgets above before a 503.
            Default 5.
        cached_bytes: the preprocessed uploads kept for later requests, in bytes (the last one always
            kept, whatever its size). Default 256 MiB: eight images at 224 px take 5 MB, one at 4096 px 201 MB.
        map_bytes: attention maps held at once, in bytes, over all requests (:func:`window_map_bytes`): a
            request computes its block's maps as many windows at a time as fit, one request at a time. Default
            1 GiB: a window of 64x64 tokens with 4 heads; the paper's 7x7 windows take 154 KB with 4 heads.
        reply_bytes: attention replies held at once, in bytes, while built and sent (:func:`attention_reply_bytes`).
            Default 128 MiB: 2,000 replies of efficientvit_m0's first block at 224 px (66 KB), six at 4096 px
            (21 MB). A further reply waits up to ``budget_wait`` seconds, then gets a 503.
        compute_wait: seconds an attention request waits for the model while other requests' maps are computed
            (one at a time), before a 503. Default 10. Less than ``request_timeout``, so a request queued behind a
            slow one gets its 503 before it is cut off.
    """

    max_connections: int = 64
    connection_wait: float = 1.0
    listen_queue: int = 256
    idle_timeout: float = 5.0
    request_timeout: float = 30.0
    upload_bytes: int = 4 * MAX_UPLOAD_BYTES
    decoded_pixels: int = 2 * MAX_UPLOAD_PIXELS
    budget_wait: float = 5.0
    cached_bytes: int = 256 * 1024**2
    map_bytes: int = 1024**3
    reply_bytes: int = 128 * 1024**2
    compute_wait: float = 10.0

    def __post_init__(self) -> None:
        if self.max_connections < 1 or self.listen_queue < 1:
            raise ValueError("max_connections and listen_queue must be at least 1")
        if self.cached_bytes < 0:
            raise ValueError("cached_bytes must be >= 0")
        if self.map_bytes < 1 or self.reply_bytes < 1:
            raise ValueError("map_bytes and reply_bytes must be at least 1")
        if min(self.connection_wait, self.budget_wait, self.compute_wait) < 0 or min(self.idle_timeout, self.request_timeout) <= 0:
            raise ValueError("waits must be >= 0 seconds and timeouts > 0 seconds")
        if self.compute_wait >= self.request_timeout:
            raise ValueError(
                f"compute_wait ({self.compute_wait:g} s) must be less than request_timeout ({self.request_timeout:g} s): "
                "a request waiting for the model must get its 503 before it is cut off"
            )
        if self.upload_bytes < MAX_UPLOAD_BYTES or self.decoded_pixels < MAX_UPLOAD_PIXELS:
            raise ValueError(
                f"the shared budgets must hold at least one maximal upload ({MAX_UPLOAD_BYTES} bytes, "
                f"{MAX_UPLOAD_PIXELS} pixels)"
            )


class Budget:
    """An allowance (bytes, pixels) that concurrent requests reserve from and give back.

    Args:
        total: the allowance.
        unit: what is counted, for messages ("bytes", "pixels").
        users: what reserves it, for messages. Default "uploads".
    """

    def __init__(self, total: int, unit: str, users: str = "uploads") -> None:
        self.total = total
        self.unit = unit
        self.users = users
        self.used = 0
        self.peak = 0  # the most ever reserved at once: tests check it never passed ``total``
        self._cond = threading.Condition()

    @contextmanager
    def reserve(self, amount: int, wait: float) -> Iterator[None]:
        """Hold ``amount`` for the ``with`` block, waiting up to ``wait`` seconds for room.

        Raises:
            TooLarge: ``amount`` is more than the whole allowance.
            Busy: no room within ``wait`` seconds.
        """
        if amount > self.total:
            raise TooLarge(f"{amount:,} {self.unit} is more than the server ever holds at once ({self.total:,})")
        with self._cond:
            if not self._cond.wait_for(lambda: self.used + amount <= self.total, timeout=wait):
                raise Busy(
                    f"the server is busy with other {self.users} ({self.used:,} {self.unit} in use); retry in a moment"
                )
            self.used += amount
            self.peak = max(self.peak, self.used)
        try:
            yield
        finally:
            with self._cond:
                self.used -= amount
                self._cond.notify_all()
