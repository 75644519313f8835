"""Grid maths of the image panel: where each attention window lies in a block's ``H x W`` map, and
the per-token values the page draws (what one query attends to, or the mean attention each token
receives).

``maps`` are one block's attention weights ``(heads, n_windows, N, N)`` over windows of
``win_hw`` = ``(wh, ww)`` tokens (``N = wh * ww``, zero padding included at the bottom/right edge of
a map that does not divide into windows).
"""

from __future__ import annotations

import torch

Grid = list[list[list[float | None]]]  # [heads][H][W], None where nothing is shown


def window_boxes(n_windows: int, hw: tuple[int, int], win_hw: tuple[int, int], window: int) -> list[list[int]]:
    """``[y0, x0, rows, cols]`` of each window in the ``H x W`` map, cropped to the map (padding cut)."""
    (H, W), (wh, ww) = hw, win_hw
    n_cols = 1 if (H <= window and W <= window) else -(-W // window)
    boxes = []
    for k in range(n_windows):
        y0, x0 = (k // n_cols) * wh, (k % n_cols) * ww
        boxes.append([y0, x0, min(wh, H - y0), min(ww, W - x0)])
    return boxes


def received_grid(maps: torch.Tensor, boxes: list[list[int]], hw: tuple[int, int], win_hw: tuple[int, int]) -> Grid:
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


def query_grid(
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
