"""The design notes' six tokens (chapter 8) through one freshly drawn cascaded group attention: the
explorer's first panel.

:class:`ToyCGA` runs a :class:`~cgavit.attention.CascadedGroupAttention` of 24 channels on a 2x3
map (one window of side 3), with the head count, cascade and channel groups chosen by the user.
Head similarity is the package's one definition, :func:`cgavit.analysis.heads.map_similarity`: the
cosine similarity of two heads' flattened maps (the six tokens are one window). One head has no
pairs: its ``mean_similarity`` is None.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from ..analysis.heads import map_similarity, mean_off_diagonal
from ..attention import CascadedGroupAttention
from ..testing import randomize_


class ToyCGA:
    """Six tokens through one cascaded group attention, as in the design notes' chapter 8.

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
