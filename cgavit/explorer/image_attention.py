"""Real attention maps of an uploaded image in every sandwich block of a model: the explorer's
second panel.

:class:`ImageAttention` keeps a few uploads (preprocessed) and, for a chosen block, captures that
block's attention input with forward hooks and replays it through the block's own
``head_attention_maps``. Head similarity is the package's one definition,
:func:`cgavit.analysis.heads.map_similarity`: the cosine similarity of two heads' flattened maps in
each window, averaged over the windows. Uploads are opened by :mod:`.uploads`; the per-token grids
the page draws come from :mod:`.grids`.
"""

from __future__ import annotations

import base64
import hashlib
import io
import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch
from PIL import Image

from ..analysis.heads import map_similarity, mean_off_diagonal
from ..attention import LocalWindowAttention
from ..bounds import MAX_UPLOAD_PIXELS
from ..factory import ModelInfo
from ..imagenet import class_names
from ..model import EfficientViT, stage_resolution
from .grids import query_grid, received_grid, window_boxes
from .limits import MAX_PREVIEW_SIDE, MAX_UPLOAD_BYTES, Budget, Limits
from .uploads import model_view, open_upload


def _blocks(model: EfficientViT) -> list[tuple[int, int, LocalWindowAttention]]:
    return [
        (i, j, block.mixer.m)
        for i, stage in enumerate(model.stages)
        for j, block in enumerate(stage.blocks)
    ]


class ImageAttention:
    """Real attention maps of an uploaded image in every sandwich block of a model.

    Uploaded images are kept (preprocessed) in a small in-memory cache under the SHA-256 of their
    bytes, so picking another block or query token does not need the file again. Uploads are
    decoded and made the model's input by a few threads of their own (as many as maximal images fit
    the pixel budget): the memory allocator keeps what a thread freed for that thread, so doing it in
    every connection's thread would let the process grow well past the budget.

    Args:
        model: an :class:`~cgavit.model.EfficientViT` (put in eval mode here).
        about: one sentence on where the weights came from, shown on the page.
        info: how images are fed to it: the normalisation (``mean``, ``std``) and resize ``interpolation`` its
            checkpoint records (:func:`~cgavit.load_model`). Default: ImageNet's, bicubic.
        cache_size: images kept, at most: fewer when they would take more than ``limits.cached_bytes``
            (large ``img_size``), at least one. Default 8.
        limits: the shared decoding budget (``decoded_pixels``, ``budget_wait``) and the cache's bytes
            (``cached_bytes``). Default :class:`~cgavit.explorer.limits.Limits`.
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
        self._blocks = _blocks(model)
        self._images: OrderedDict[str, torch.Tensor] = OrderedDict()
        one_image = 3 * self.img_size[0] * self.img_size[1] * 4  # a normalised float32 input
        self._cache_size = max(1, min(cache_size, self.limits.cached_bytes // one_image))
        self._lock = threading.Lock()

    def info(self) -> dict[str, Any]:
        """The model description and one entry per block (stage, width, heads, window, map size)."""
        rows = []
        for k, (i, j, lwa) in enumerate(self._blocks):
            h, w = (stage_resolution(s, i) for s in self.img_size)
            rows.append(
                dict(
                    index=k,
                    stage=i + 1,
                    block=j + 1,
                    channels=lwa.attn.dim,
                    heads=lwa.attn.num_heads,
                    window=lwa.window,
                    grid=[h, w],
                    cascade=lwa.attn.cascade,
                    groups=lwa.attn.group_split,
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
        _, _, lwa = self._blocks[block]
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
            KeyError: unknown image id. ValueError: block or query out of range.
        """
        if not 0 <= block < len(self._blocks):
            raise ValueError(f"block must be in 0..{len(self._blocks) - 1}, got {block}")
        stage, idx, lwa = self._blocks[block]
        with self._lock:
            x = self._images[image_id]
            self._images.move_to_end(image_id)
            with torch.no_grad():
                windows, (H, W) = self._capture(x, block)
                maps = torch.stack(lwa.attn.head_attention_maps(windows)).double()  # (heads, nwin, N, N)
        if query is not None and not 0 <= query < H * W:
            raise ValueError(f"query must be a token index in 0..{H * W - 1} (y * {W} + x), got {query}")
        win_hw = tuple(windows.shape[-2:])
        boxes = window_boxes(windows.shape[0], (H, W), win_hw, lwa.window)
        padding_share = qbox = None
        if query is None:
            grid = received_grid(maps, boxes, (H, W), win_hw)
        else:
            grid, qbox = query_grid(maps, boxes, (H, W), win_hw, query)
            padding_share = [max(0.0, 1.0 - sum(v for row in g for v in row if v is not None)) for g in grid]
        sim = map_similarity(maps)
        return dict(
            block=block,
            stage=stage + 1,
            block_in_stage=idx + 1,
            heads=maps.shape[0],
            grid=[H, W],
            window=lwa.window,
            windows=boxes,
            query=query,
            query_window=qbox,
            padding_share=padding_share,
            maps=grid,
            similarity=sim.tolist(),
            mean_similarity=mean_off_diagonal(sim),
        )
