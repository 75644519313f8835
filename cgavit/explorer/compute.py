"""The numbers behind the CGA Explorer, computed by the package's own attention modules.

Two sources:

* :class:`ToyCGA` -- the seed's six tokens (a 2x3 map, one window of side 3) through a freshly drawn
  :class:`~cgavit.attention.CascadedGroupAttention` of 24 channels, with the head count, cascade
  and channel groups chosen by the user.
* :class:`ImageAttention` -- an uploaded image through an :class:`~cgavit.model.EfficientViT`
  (a checkpoint, or a randomly initialised variant); the attention input of one block is captured
  with forward hooks and replayed through that block's own ``head_attention_maps``.

Head similarity is the package's one definition, :func:`cgavit.analysis.heads.map_similarity`:
the cosine similarity of two heads' flattened maps in each window, averaged over the windows (the
six tokens are one window). One head has no pairs: its ``mean_similarity`` is None.
"""

from __future__ import annotations

import base64
import hashlib
import io
import logging
import os
import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image, ImageOps

from ..analysis.heads import map_similarity, mean_off_diagonal
from ..attention import CascadedGroupAttention, LocalWindowAttention
from ..factory import create_model, load_model
from ..model import EfficientViT, stage_resolution
from ..testing import randomize_
from ..variants import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
from .limits import MAX_IMAGE_PIXELS, MAX_UPLOAD_BYTES, Budget, Limits, TooLarge

log = logging.getLogger(__name__)

#: What an upload may be: common raster formats only (no EPS, which Pillow hands to Ghostscript).
#: A camera's multi-picture JPEG opens as JPEG and reports format "MPO".
UPLOAD_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")


class ToyCGA:
    """Six tokens through one cascaded group attention, as in the seed's chapter 8.

    The six tokens form a 2x3 map (read row by row: t1 t2 t3 / t4 t5 t6) attended as one window of
    side 3, which is the module's ``(B, C, H, W)`` contract with ``H, W <= window``. A seed fixes
    the tokens and the weights: the tokens depend on the seed only, the weights on the seed and on
    the layout (channel groups change the projection shapes; the cascade does not, so toggling it
    keeps every weight and token and changes only what heads 2.. read).

    Args:
        channels: token width C. Default 24 (divisible by every head count offered).
        key_dim: query/key width per head. Default 8.
    """

    GRID = (2, 3)
    WINDOW = 3

    def __init__(self, channels: int = 24, key_dim: int = 8) -> None:
        self.channels = channels
        self.key_dim = key_dim
        self.head_choices = [h for h in (1, 2, 3, 4, 6, 8) if channels % h == 0]
        self._lock = threading.Lock()

    def tokens(self, seed: int) -> torch.Tensor:
        """The six tokens of ``seed`` as a ``(1, C, 2, 3)`` map."""
        g = torch.Generator().manual_seed(seed)
        return torch.randn(1, self.channels, *self.GRID, generator=g)

    def module(self, heads: int, cascade: bool, groups: bool, seed: int) -> CascadedGroupAttention:
        """A CGA in eval mode with weights drawn from ``seed`` and randomised BatchNorm statistics.

        Raises:
            ValueError: a head count not offered, or cascade without channel groups.
        """
        if heads not in self.head_choices:
            raise ValueError(f"heads must be one of {self.head_choices} (divisors of C={self.channels}), got {heads}")
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            attn = CascadedGroupAttention(
                self.channels,
                key_dim=self.key_dim,
                num_heads=heads,
                window=self.WINDOW,
                cascade=cascade,
                group_split=groups,
            )
        randomize_(attn, seed)  # default BN statistics would make every head's map look alike
        return attn.eval()

    def run(self, heads: int, cascade: bool, groups: bool, seed: int) -> dict[str, Any]:
        """Everything the page shows for one setting, as JSON-ready values.

        Returns:
            dict with ``maps`` ``[h][6][6]`` (row = query token, column = key token; rows sum to 1),
            ``similarity`` ``[h][h]``, ``mean_similarity`` (off-diagonal mean, None for one head),
            ``slices`` (each head's input channels ``[start, stop)`` and whether it also reads the
            previous head's output), and the layout.
        """
        with self._lock, torch.no_grad():  # fork_rng touches the global generator: one at a time
            attn = self.module(heads, cascade, groups, seed)
            maps = torch.stack([m[0] for m in attn.head_attention_maps(self.tokens(seed))])  # (h, 6, 6)
        sim = map_similarity(maps[:, None])  # one window
        width = self.channels // heads if groups else self.channels
        slices = [
            dict(
                head=j,
                start=j * width if groups else 0,
                stop=(j + 1) * width if groups else self.channels,
                reads_previous=bool(cascade and j > 0),
            )
            for j in range(heads)
        ]
        return dict(
            tokens=self.GRID[0] * self.GRID[1],
            grid=list(self.GRID),
            window=self.WINDOW,
            channels=self.channels,
            key_dim=self.key_dim,
            value_dim=attn.value_dim,
            heads=heads,
            cascade=cascade,
            groups=groups,
            seed=seed,
            head_choices=self.head_choices,
            module=(
                f"CascadedGroupAttention(dim={self.channels}, key_dim={self.key_dim}, num_heads={heads}, "
                f"window={self.WINDOW}, cascade={cascade}, group_split={groups})"
            ),
            maps=maps.double().tolist(),
            similarity=sim.tolist(),
            mean_similarity=mean_off_diagonal(sim),
            slices=slices,
        )


# ----------------------------------------------------------------------------------- real model
def build_model(
    checkpoint: str | os.PathLike | None = None,
    model_name: str | None = None,
    img_size: int = 224,
    trust: bool = False,
    **dials,
) -> tuple[EfficientViT, str]:
    """The model whose attention the page shows, and an honest sentence about where it came from.

    A checkpoint is rebuilt by :func:`cgavit.load_model`: a cgavit file from the architecture it
    records, an official or timm file as ``model_name`` (with ``dials``). Without a checkpoint the
    model is a randomly initialised ``model_name`` (default ``efficientvit_m0``), with BatchNorm
    statistics and bias tables randomised (seed 0).

    Raises:
        ValueError: unknown model, impossible dials, or an unusable checkpoint (``CheckpointError``).
    """
    if checkpoint is None:
        model_name = model_name or "efficientvit_m0"
        model = create_model(model_name, img_size=img_size, **dials)
        randomize_(model, 0)
        about = (
            f"a randomly initialised {model_name} (no --checkpoint given; BatchNorm statistics and "
            "bias tables randomised with seed 0). Its maps show how the mechanism mixes tokens, "
            "not what a trained network looks at."
        )
        return model.eval(), about
    model, _ = load_model(checkpoint, model_name, dials or None, img_size=img_size, trust=trust)
    arch = model.pretrained_cfg["architecture"] or "the architecture it records"
    return model, f"checkpoint {Path(checkpoint).name} loaded into {arch}."


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
    decoded by a few threads of their own (as many as maximal images fit the pixel budget): the
    memory allocator keeps what a thread freed for that thread, so decoding in every connection's
    thread would let the process grow well past the budget.

    Args:
        model: an :class:`~cgavit.model.EfficientViT` (put in eval mode here).
        about: one sentence on where the weights came from, shown on the page.
        cache_size: images kept. Default 8.
        limits: the shared decoding budget (``decoded_pixels``, ``budget_wait``). Default
            :class:`~cgavit.explorer.limits.Limits`.
    """

    def __init__(self, model: EfficientViT, about: str, cache_size: int = 8, limits: Limits | None = None) -> None:
        self.model = model.eval()
        self.about = about
        self.img_size = tuple(model.img_size)
        self.limits = limits or Limits()
        self.pixels = Budget(self.limits.decoded_pixels, "pixels")
        self._decoder = ThreadPoolExecutor(
            max(1, self.limits.decoded_pixels // MAX_IMAGE_PIXELS), thread_name_prefix="explorer-decode"
        )
        self._blocks = _blocks(model)
        self._images: OrderedDict[str, torch.Tensor] = OrderedDict()
        self._cache_size = cache_size
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
            max_image_pixels=MAX_IMAGE_PIXELS,
        )

    def add_image(self, data: bytes) -> dict[str, Any]:
        """Validate and preprocess an uploaded image; returns its id and the model's view of it.

        The image is resized (bicubic, shorter side) and centre-cropped to the model's size, then
        normalised with the ImageNet mean and standard deviation. Its decoded size is checked from
        the header before any pixel is decoded, and decoding waits for room in the shared pixel
        budget. A JPEG is decoded at the smallest scale (1/2, 1/4, 1/8) that still covers the
        model's size.

        Raises:
            ValueError: not an image of an accepted format that PIL can decode.
            TooLarge: it decodes to more than ``MAX_IMAGE_PIXELS`` pixels.
            Busy: other uploads hold the pixel budget for longer than ``limits.budget_wait``.
        """
        H, W = self.img_size
        img, orig = _open_upload(data, max(H, W))
        with img, self.pixels.reserve(img.width * img.height, self.limits.budget_wait):
            view = self._decoder.submit(_model_view, img, (W, H)).result()
        arr = torch.from_numpy(np.asarray(view, dtype=np.float32) / 255.0).permute(2, 0, 1)  # (3, H, W)
        mean = torch.tensor(IMAGENET_DEFAULT_MEAN)[:, None, None]
        std = torch.tensor(IMAGENET_DEFAULT_STD)[:, None, None]
        image_id = hashlib.sha256(data).hexdigest()[:16]
        with self._lock:
            self._images[image_id] = ((arr - mean) / std)[None]  # (1, 3, H, W)
            self._images.move_to_end(image_id)
            while len(self._images) > self._cache_size:
                self._images.popitem(last=False)
        buf = io.BytesIO()
        view.save(buf, format="PNG")
        preview = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")
        return dict(image_id=image_id, original_size=list(orig), size=[H, W], preview=preview)

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
        boxes = _window_boxes(windows.shape[0], (H, W), win_hw, lwa.window)
        padding_share = qbox = None
        if query is None:
            grid = _received_grid(maps, boxes, (H, W), win_hw)
        else:
            grid, qbox = _query_grid(maps, boxes, (H, W), win_hw, query)
            padding_share = [1.0 - sum(v for row in g for v in row if v is not None) for g in grid]
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


def _unreadable(err: Exception) -> ValueError:
    return ValueError(
        f"the upload is not an image PIL can read ({type(err).__name__}); use a JPEG, PNG or WebP file"
    )


def _open_upload(data: bytes, cover: int) -> tuple[Image.Image, tuple[int, int]]:
    """The upload opened from its header only (nothing decoded yet), and the size it declares.

    The image will decode at ``img.size``: the declared size, or for a JPEG the smallest DCT
    scale whose sides are still at least ``cover`` pixels.

    Raises:
        ValueError: not an accepted image format, or a broken file. TooLarge: over MAX_IMAGE_PIXELS.
    """
    try:
        with Image.open(io.BytesIO(data), formats=UPLOAD_FORMATS) as probe:
            probe.verify()  # structure check without decoding
        img = Image.open(io.BytesIO(data), formats=UPLOAD_FORMATS)
    except Image.DecompressionBombError:  # Pillow's own ceiling, far above ours
        raise TooLarge(f"the image declares far more than the limit of {MAX_IMAGE_PIXELS:,} pixels: scale it down") from None
    except Exception as err:  # PIL raises many types for broken files
        raise _unreadable(err) from None
    declared = img.size
    if img.format in ("JPEG", "MPO"):
        img.draft("RGB", (cover, cover))  # far fewer pixels decoded, the same view after the resize
    if img.width * img.height > MAX_IMAGE_PIXELS:
        img.close()
        raise TooLarge(
            f"the image is {declared[0]}x{declared[1]} pixels and decodes to {img.width * img.height:,}; "
            f"the limit is {MAX_IMAGE_PIXELS:,}: scale it down"
        )
    return img, declared


def _model_view(img: Image.Image, size: tuple[int, int]) -> Image.Image:
    """Decode ``img`` (EXIF orientation applied, RGB), resize its short side to cover ``size``
    ``(W, H)`` and crop the centre; ValueError for a file that breaks while decoding."""
    try:
        img = ImageOps.exif_transpose(img)
        rgb = img if img.mode == "RGB" else img.convert("RGB")
    except Exception as err:  # a truncated or corrupt body surfaces only now
        raise _unreadable(err) from None
    return ImageOps.fit(rgb, size, Image.BICUBIC)


Grid = list[list[list[float | None]]]  # [heads][H][W], None where nothing is shown


def _window_boxes(n_windows: int, hw: tuple[int, int], win_hw: tuple[int, int], window: int) -> list[list[int]]:
    """``[y0, x0, rows, cols]`` of each window in the ``H x W`` map, cropped to the map (padding cut)."""
    (H, W), (wh, ww) = hw, win_hw
    n_cols = 1 if (H <= window and W <= window) else -(-W // window)
    boxes = []
    for k in range(n_windows):
        y0, x0 = (k // n_cols) * wh, (k % n_cols) * ww
        boxes.append([y0, x0, min(wh, H - y0), min(ww, W - x0)])
    return boxes


def _received_grid(maps: torch.Tensor, boxes: list[list[int]], hw: tuple[int, int], win_hw: tuple[int, int]) -> Grid:
    """For every token, the mean attention it receives from the real (not padding) queries of its window."""
    heads, (H, W), ww = maps.shape[0], hw, win_hw[1]
    grid: Grid = [[[None] * W for _ in range(H)] for _ in range(heads)]
    for k, (y0, x0, bh, bw) in enumerate(boxes):
        real = [n for n in range(win_hw[0] * ww) if n // ww < bh and n % ww < bw]  # not zero padding
        received = maps[:, k, real].mean(dim=1)  # (heads, N): mean over the window's real queries
        for n in real:
            for hd in range(heads):
                grid[hd][y0 + n // ww][x0 + n % ww] = float(received[hd, n])
    return grid


def _query_grid(
    maps: torch.Tensor, boxes: list[list[int]], hw: tuple[int, int], win_hw: tuple[int, int], query: int
) -> tuple[Grid, list[int]]:
    """What token ``query`` attends to in its window (None elsewhere), and that window's box."""
    heads, (H, W), (wh, ww) = maps.shape[0], hw, win_hw
    grid: Grid = [[[None] * W for _ in range(H)] for _ in range(heads)]
    qy, qx = divmod(query, W)
    k = next(i for i, (y0, x0, bh, bw) in enumerate(boxes) if y0 <= qy < y0 + bh and x0 <= qx < x0 + bw)
    y0, x0, bh, bw = boxes[k]
    row = (qy - y0) * ww + (qx - x0)
    for n in range(wh * ww):
        ty, tx = n // ww, n % ww
        if ty < bh and tx < bw:
            for hd in range(heads):
                grid[hd][y0 + ty][x0 + tx] = float(maps[hd, k, row, n])
    return grid, boxes[k]
