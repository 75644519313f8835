"""Grid maths of the image panel: how a block's ``H x W`` map is split into attention windows, where
each window lies, and the per-token values the page draws (what one query attends to, or the mean
attention each token receives).

``maps`` are attention weights ``(heads, n, N, N)`` of ``n`` consecutive windows of ``win_hw`` =
``(wh, ww)`` tokens (``N = wh * ww``, zero padding included at the bottom/right edge of a map that
does not divide into windows), with ``boxes`` the boxes of those ``n`` windows: a block's maps are
filled in a few windows at a time.
"""

from __future__ import annotations

import torch

Grid = list[list[list[float | None]]]  # [heads][H][W], None where nothing is shown


def window_layout(hw: tuple[int, int], window: int) -> tuple[int, tuple[int, int]]:
    """How :class:`~cgavit.attention.LocalWindowAttention` splits an ``H x W`` map: the number of windows and
    each one's ``(wh, ww)`` tokens, zero padding included (a map no larger than the window is one window)."""
    H, W = hw
    if H <= window and W <= window:
        return 1, (H, W)
    return -(-H // window) * -(-W // window), (window, window)


def window_boxes(n_windows: int, hw: tuple[int, int], win_hw: tuple[int, int], window: int) -> list[list[int]]:
    """``[y0, x0, rows, cols]`` of each window in the ``H x W`` map, cropped to the map (padding cut)."""
    (H, W), (wh, ww) = hw, win_hw
    n_cols = 1 if (H <= window and W <= window) else -(-W // window)
    boxes = []
    for k in range(n_windows):
        y0, x0 = (k // n_cols) * wh, (k % n_cols) * ww
        boxes.append([y0, x0, min(wh, H - y0), min(ww, W - x0)])
    return boxes


def empty_grid(heads: int, hw: tuple[int, int]) -> Grid:
    """``[heads][H][W]`` of None, for :func:`fill_received` or :func:`fill_query` to fill."""
    return [[[None] * hw[1] for _ in range(hw[0])] for _ in range(heads)]


def fill_received(grid: Grid, maps: torch.Tensor, boxes: list[list[int]], win_hw: tuple[int, int]) -> None:
    """Set each token of the windows in ``boxes`` to the mean attention it receives from the real (not padding)
    queries of its window."""
    heads, ww = maps.shape[0], win_hw[1]
    for k, (y0, x0, bh, bw) in enumerate(boxes):
        real = [n for n in range(win_hw[0] * ww) if n // ww < bh and n % ww < bw]  # not zero padding
        received = maps[:, k, real].mean(dim=1)  # (heads, N): mean over the window's real queries
        for n in real:
            for hd in range(heads):
                grid[hd][y0 + n // ww][x0 + n % ww] = float(received[hd, n])


def query_window(boxes: list[list[int]], hw: tuple[int, int], win_hw: tuple[int, int], query: int) -> tuple[int, int]:
    """The window holding token ``query`` (``y * W + x``), and the query's row in that window's maps."""
    qy, qx = divmod(query, hw[1])
    k = next(i for i, (y0, x0, bh, bw) in enumerate(boxes) if y0 <= qy < y0 + bh and x0 <= qx < x0 + bw)
    y0, x0 = boxes[k][:2]
    return k, (qy - y0) * win_hw[1] + (qx - x0)


def fill_query(grid: Grid, row: torch.Tensor, box: list[int], win_hw: tuple[int, int]) -> None:
    """Set the tokens of the query's window (``box``) to what the query attends to: ``row`` ``(heads, N)``, its row
    of that window's maps."""
    (y0, x0, bh, bw), (wh, ww) = box, win_hw
    for n in range(wh * ww):
        ty, tx = n // ww, n % ww
        if ty < bh and tx < bw:
            for hd in range(row.shape[0]):
                grid[hd][y0 + ty][x0 + tx] = float(row[hd, n])
