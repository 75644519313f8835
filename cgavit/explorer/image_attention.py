"""Real attention maps of an uploaded image in every sandwich block of a model: the explorer's
second panel.

:class:`ImageAttention` keeps a few uploads (preprocessed) and, for a chosen block, captures that
block's attention input with forward hooks and replays it through the block's own
``head_attention_maps``, a few windows at a time (within ``Limits.map_bytes``, see :mod:`.limits`).
Head similarity is the package's one definition, :func:`cgavit.analysis.heads.map_similarity`: the
cosine similarity of two heads' flattened maps in each window, averaged over the windows. Uploads
are opened by :mod:`.uploads`; the per-token grids the page draws come from :mod:`.grids`.
"""

from __future__ import annotations

import base64
import hashlib
import io
import threading
from collections import OrderedDict
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any, NamedTuple

import numpy as np
import torch
from PIL import Image

from ..analysis.heads import map_similarity, mean_off_diagonal
from ..attention import LocalWindowAttention
from ..bounds import MAX_UPLOAD_PIXELS
from ..factory import ModelInfo
from ..imagenet import class_names
from ..model import EfficientViT, stage_resolution
from .grids import Grid, empty_grid, fill_query, fill_received, query_window, window_boxes, window_layout
from .limits import (
    MAX_PREVIEW_SIDE,
    MAX_UPLOAD_BYTES,
    Budget,
    Busy,
    Limits,
    attention_reply_bytes,
    window_map_bytes,
)
from .uploads import model_view, open_upload


class Block(NamedTuple):
    """One sandwich block's attention, and how it splits its map into windows at the model's image size."""

    stage: int  # from 0
    index: int  # within the stage, from 0
    lwa: LocalWindowAttention
    hw: tuple[int, int]  # its map of H x W tokens
    windows: int  # how many windows it attends in
    win_hw: tuple[int, int]  # each window's tokens, zero padding included

    @property
    def heads(self) -> int:
        return self.lwa.attn.num_heads


def _blocks(model: EfficientViT, img_size: tuple[int, int]) -> list[Block]:
    rows = []
    for i, stage in enumerate(model.stages):
        hw = tuple(stage_resolution(s, i) for s in img_size)
        for j, block in enumerate(stage.blocks):
            rows.append(Block(i, j, block.mixer.m, hw, *window_layout(hw, block.mixer.m.window)))
    return rows


def _size(n: int) -> str:
    """Bytes for a message: exact below a MiB, in MiB above."""
    return f"{n:,} bytes" if n < 2**20 else f"{n / 2**20:,.1f} MiB"


class ImageAttention:
    """Real attention maps of an uploaded image in every sandwich block of a model.

    Uploaded images are kept (preprocessed) in a small in-memory cache under the SHA-256 of their
    bytes, so picking another block or query token does not need the file again. Uploads are
    decoded and made the model's input by a few threads of their own (as many as maximal images fit
    the pixel budget): the memory allocator keeps what a thread freed for that thread, so doing it in
    every connection's thread would let the process grow well past the budget. Attention is computed
    for one request at a time (:meth:`computing`), within ``limits.map_bytes`` of maps (:mod:`.limits`).

    Args:
        model: an :class:`~cgavit.model.EfficientViT` (put in eval mode here).
        about: one sentence on where the weights came from, shown on the page.
        info: how images are fed to it: the normalisation (``mean``, ``std``) and resize ``interpolation`` its
            checkpoint records (:func:`~cgavit.load_model`). Default: ImageNet's, bicubic.
        cache_size: images kept, at most: fewer when they would take more than ``limits.cached_bytes``
            (large ``img_size``), at least one. Default 8.
        limits: the shared decoding budget (``decoded_pixels``, ``budget_wait``), the cache's bytes
            (``cached_bytes``), the memory of attention maps and replies (``map_bytes``, ``reply_bytes``), and how
            long a request waits for the model (``compute_wait``).
            Default :class:`~cgavit.explorer.limits.Limits`.

    Raises:
        ValueError: one window's maps of a block, or one reply, would take more memory than ``limits`` allows
            (:func:`~cgavit.explorer.limits.window_map_bytes`, :func:`~cgavit.explorer.limits.attention_reply_bytes`).
    """

    def __init__(self, model: EfficientViT, about: str, info: ModelInfo | None = None, cache_size: int = 8,
                 limits: Limits | None = None) -> None:
        self.model = model.eval()
        self.about = about
        self.feed = info or ModelInfo(class_names(model.num_classes))
        self._mean, self._std = (torch.tensor(v, dtype=torch.float32).reshape(1, -1, 1, 1)
                                 for v in (self.feed.mean, self.feed.std))
        self.img_size = tuple(model.img_size)
        self.limits = limits or Limits()
        self.pixels = Budget(self.limits.decoded_pixels, "pixels")
        self._decoder = ThreadPoolExecutor(
            max(1, self.limits.decoded_pixels // MAX_UPLOAD_PIXELS), thread_name_prefix="explorer-decode"
        )
        self._blocks = _blocks(model, self.img_size)
        self._check_memory()
        self._images: OrderedDict[str, torch.Tensor] = OrderedDict()
        one_image = 3 * self.img_size[0] * self.img_size[1] * 4  # a normalised float32 input
        self._cache_size = max(1, min(cache_size, self.limits.cached_bytes // one_image))
        self._lock = threading.Lock()  # the cache
        self._compute = threading.Lock()  # one request's forward pass and maps at a time

    def _check_memory(self) -> None:
        """Refuse a model of which one window's maps, or one reply, would exceed ``limits`` (:mod:`.limits`)."""
        for k, b in enumerate(self._blocks):
            (h, w), (wh, ww) = b.hw, b.win_hw
            where = f"block {k} (stage {b.stage + 1}, {b.heads} heads over {h}x{w} tokens"
            one = window_map_bytes(b.heads, wh * ww)
            if one > self.limits.map_bytes:
                raise ValueError(
                    f"{where} in {wh}x{ww} windows): one window's attention maps take {_size(one)}, more than the "
                    f"explorer holds at once ({_size(self.limits.map_bytes)}); use a smaller window or fewer heads "
                    "(--window-size, --num-heads)"
                )
            reply = attention_reply_bytes(b.heads, h * w, b.windows)
            if reply > self.limits.reply_bytes:
                size = "x".join(map(str, self.img_size))
                raise ValueError(
                    f"{where} at {size} px): one reply of its maps takes {_size(reply)}, more than the explorer holds "
                    f"in replies at once ({_size(self.limits.reply_bytes)}); use a smaller --img-size or fewer heads"
                )

    @contextmanager
    def computing(self) -> Iterator[None]:
        """Hold the model for one request's forward pass and maps, waiting up to ``limits.compute_wait`` seconds
        while another request holds it; given back when the block ends, however it ends.

        Raises:
            Busy: another request held it all that time (HTTP 503).
        """
        if not self._compute.acquire(timeout=self.limits.compute_wait):
            raise Busy(
                f"the explorer is still computing another request's attention maps after {self.limits.compute_wait:g} s "
                "of waiting; retry in a moment"
            )
        try:
            yield
        finally:
            self._compute.release()

    def reply_bytes(self, block: int) -> int:
        """The most memory a reply of :meth:`attention` for ``block`` takes while it is built and sent
        (:func:`~cgavit.explorer.limits.attention_reply_bytes`)."""
        b = self._blocks[block]
        return attention_reply_bytes(b.heads, b.hw[0] * b.hw[1], b.windows)

    def info(self) -> dict[str, Any]:
        """The model description and one entry per block (stage, width, heads, window, map size)."""
        rows = []
        for k, b in enumerate(self._blocks):
            rows.append(
                dict(
                    index=k,
                    stage=b.stage + 1,
                    block=b.index + 1,
                    channels=b.lwa.attn.dim,
                    heads=b.heads,
                    window=b.lwa.window,
                    grid=list(b.hw),
                    cascade=b.lwa.attn.cascade,
                    groups=b.lwa.attn.group_split,
                )
            )
        return dict(
            about=self.about,
            img_size=list(self.img_size),
            blocks=rows,
            max_upload_bytes=MAX_UPLOAD_BYTES,
            max_image_pixels=MAX_UPLOAD_PIXELS,
        )

    def add_image(self, data: bytes) -> dict[str, Any]:
        """Validate and preprocess an uploaded image; returns its id and the model's view of it.

        The image is resized (shorter side, with the checkpoint's interpolation) and centre-cropped to
        the model's size, then normalised with the checkpoint's mean and standard deviation (``info``).
        Its decoded size is checked from the header before any pixel is decoded, and decoding waits for
        room in the shared pixel budget. A JPEG is decoded at the smallest scale (1/2, 1/4, 1/8) that still covers the
        model's size. The preview is the model's view, made at most
        :data:`~cgavit.explorer.limits.MAX_PREVIEW_SIDE` pixels a side.

        Raises:
            BadImageError: not an image of an accepted format that PIL can decode (a ``ValueError``).
            TooLarge: it decodes to more than :data:`~cgavit.bounds.MAX_UPLOAD_PIXELS` pixels.
            Busy: other uploads hold the pixel budget for longer than ``limits.budget_wait``.
        """
        H, W = self.img_size
        img, orig = open_upload(data, max(H, W))
        with img, self.pixels.reserve(img.width * img.height, self.limits.budget_wait):
            x, preview, turned = self._decoder.submit(self._prepare, img).result()
        if turned:  # shown turned a quarter: the size as the user sees it
            orig = (orig[1], orig[0])
        image_id = hashlib.sha256(data).hexdigest()[:16]
        with self._lock:
            self._images[image_id] = x
            self._images.move_to_end(image_id)
            while len(self._images) > self._cache_size:
                self._images.popitem(last=False)
        return dict(image_id=image_id, original_size=[orig[1], orig[0]], size=[H, W], preview=preview)  # both (H, W)

    def _prepare(self, img: Image.Image) -> tuple[torch.Tensor, str, bool]:
        """In a decoding thread: the model's input ``(1, 3, H, W)`` (one float32 copy of the view, normalised in
        place), the preview as a PNG data URL, and whether the picture was turned (:func:`.uploads.model_view`)."""
        H, W = self.img_size
        view, turned = model_view(img, (W, H), self.feed.interpolation)
        x = torch.from_numpy(np.asarray(view, dtype=np.float32)).permute(2, 0, 1)[None]  # (1, 3, H, W)
        x.div_(255.0).sub_(self._mean).div_(self._std)
        view.thumbnail((MAX_PREVIEW_SIDE, MAX_PREVIEW_SIDE))  # the page draws it at 224 px
        buf = io.BytesIO()
        view.save(buf, format="PNG")
        return x, "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii"), turned

    def has_image(self, image_id: str) -> bool:
        with self._lock:
            return image_id in self._images

    def image(self, image_id: str) -> torch.Tensor:
        """The model input ``(1, 3, H, W)`` (normalised) of a kept upload.

        Raises:
            KeyError: unknown image id (never uploaded, or evicted by later uploads).
        """
        with self._lock:
            return self._images[image_id]

    def _capture(self, x: torch.Tensor, block: int) -> tuple[torch.Tensor, tuple[int, int]]:
        """The windows ``(n_windows, C, h, w)`` that block ``block``'s attention sees, and the map size."""
        lwa = self._blocks[block].lwa
        seen: dict = {}

        class _Stop(Exception):
            pass

        def grab_map(_, args) -> None:
            seen["hw"] = tuple(args[0].shape[-2:])

        def grab_windows(_, args) -> None:
            seen["windows"] = args[0].detach()
            raise _Stop  # nothing after this block is needed

        hooks = [lwa.register_forward_pre_hook(grab_map), lwa.attn.register_forward_pre_hook(grab_windows)]
        try:
            self.model.forward_features(x)
        except _Stop:
            pass
        finally:
            for hook in hooks:
                hook.remove()
        return seen["windows"], seen["hw"]

    def attention(self, image_id: str, block: int, query: int | None) -> dict[str, Any]:
        """Each head's attention over the image in one block.

        Args:
            image_id: from :meth:`add_image`.
            block: flat block index (see :meth:`info`).
            query: token index ``y * W + x`` in the block's ``H x W`` map: show what that token
                attends to inside its window. None: for every token, the mean attention it receives
                from the queries of its window.

        Returns:
            dict with ``maps`` ``[heads][H][W]`` (None outside the query's window), ``similarity``
            ``[heads][heads]`` (:func:`~cgavit.analysis.heads.map_similarity` of the block's maps
            over all its windows), the window boxes and the layout. Per window the values sum to 1
            up to the attention that falls on zero padding, which a map not divisible into windows
            gets at its bottom/right edge; for a query that share is ``padding_share`` per head.

        Raises:
            KeyError: unknown image id. ValueError: block or query out of range. Busy: another request held the
            model for ``limits.compute_wait`` seconds (:meth:`computing`).
        """
        if not 0 <= block < len(self._blocks):
            raise ValueError(f"block must be in 0..{len(self._blocks) - 1}, got {block}")
        b = self._blocks[block]
        H, W = b.hw
        if query is not None and not 0 <= query < H * W:
            raise ValueError(f"query must be a token index in 0..{H * W - 1} (y * {W} + x), got {query}")
        with self._lock:
            x = self._images[image_id]
            self._images.move_to_end(image_id)
        boxes = window_boxes(b.windows, b.hw, b.win_hw, b.lwa.window)
        grid = empty_grid(b.heads, b.hw)
        with self.computing(), torch.no_grad():
            windows, hw = self._capture(x, block)
            shape = (hw, windows.shape[0], tuple(windows.shape[-2:]))
            assert shape == (b.hw, b.windows, b.win_hw), f"{shape}: not the windows the memory bounds were computed for"
            sim = self._summarise(b, windows, boxes, grid, query)
        padding_share = qbox = None
        if query is not None:
            qbox = boxes[query_window(boxes, b.hw, b.win_hw, query)[0]]
            padding_share = [max(0.0, 1.0 - sum(v for row in g for v in row if v is not None)) for g in grid]
        return dict(
            block=block,
            stage=b.stage + 1,
            block_in_stage=b.index + 1,
            heads=b.heads,
            grid=[H, W],
            window=b.lwa.window,
            windows=boxes,
            query=query,
            query_window=qbox,
            padding_share=padding_share,
            maps=grid,
            similarity=sim.tolist(),
            mean_similarity=mean_off_diagonal(sim),
        )

    def _summarise(self, b: Block, windows: torch.Tensor, boxes: list[list[int]], grid: Grid,
                   query: int | None) -> torch.Tensor:
        """Fill ``grid`` from block ``b``'s maps of ``windows`` and return their head similarity, made as many
        windows at a time as ``limits.map_bytes`` holds (at least one: :meth:`_check_memory`)."""
        step = self.limits.map_bytes // window_map_bytes(b.heads, b.win_hw[0] * b.win_hw[1])
        target = None if query is None else query_window(boxes, b.hw, b.win_hw, query)  # (window, row)
        total = torch.zeros(b.heads, b.heads, dtype=torch.float64)
        for start in range(0, b.windows, step):
            maps = torch.stack(b.lwa.attn.head_attention_maps(windows[start : start + step])).double()  # (h, n, N, N)
            n = maps.shape[1]
            total += map_similarity(maps) * n  # summed here, the mean over all windows below
            if target is None:
                fill_received(grid, maps, boxes[start : start + n], b.win_hw)
            elif start <= target[0] < start + n:
                fill_query(grid, maps[:, target[0] - start, target[1]], boxes[target[0]], b.win_hw)
            del maps  # gone before the next windows' maps are made
        return total / b.windows
