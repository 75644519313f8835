"""Parameter reallocation (design notes, chapter 6): where an EfficientViT block spends its widths.

Queries and keys only produce a similarity score, so they can be narrow; values carry the content
that is mixed, so they stay wide; and the FFN expands 2x instead of a standard ViT's 4x. The opposite
is the **uniform** allocation of a standard multi-head attention block: every head's Q, K and V as
wide as its channel group (``C / h``) and a 4x FFN.

Two schemes, applied per stage to a layout of widths ``C`` and head counts ``h``:

=============  =====================  ===================  =========
scheme         Q/K width per head     V width per head     FFN ratio
=============  =====================  ===================  =========
``"paper"``    16                     ``C / h``            2
``"uniform"``  ``C / h``              ``C / h``            4
=============  =====================  ===================  =========

:func:`allocation_dials` gives the design dials of a scheme (``key_dim``, ``attn_ratio``,
``ffn_ratio``), which :meth:`cgavit.EfficientViTConfig.with_dials` applies for ``allocation=...``;
:func:`value_width` is the one definition of a head's value width; :func:`allocation_of` names the
scheme a layout follows.
"""

from __future__ import annotations

from collections.abc import Sequence

#: The schemes :func:`allocation_dials` knows.
ALLOCATIONS = ("paper", "uniform")

PAPER_KEY_DIM = 16
PAPER_FFN_RATIO = 2.0
UNIFORM_FFN_RATIO = 4.0


def value_width(dim: int, num_heads: int, key_dim: int, attn_ratio: float | None) -> int:
    """The value width of one head: ``attn_ratio * key_dim`` when a ratio is given, else the head's
    channel group ``dim // num_heads`` (the paper's choice: a head's output is then exactly as wide
    as the next head's group, which is what lets the cascade add it)."""
    if attn_ratio is None:
        return dim // num_heads
    return int(attn_ratio * key_dim)


def allocation_dials(scheme: str, embed_dim: Sequence[int], num_heads: Sequence[int]) -> dict:
    """The dials ``key_dim``, ``attn_ratio`` and ``ffn_ratio`` of ``scheme`` for a layout.

    Args:
        scheme: ``"paper"`` (narrow Q/K, wide V, FFN x2) or ``"uniform"`` (Q/K = V = C/h, FFN x4).
        embed_dim: channels per stage.
        num_heads: heads per stage.

    Raises:
        ValueError: an unknown scheme, or (uniform) a width not divisible by its head count.
    """
    if scheme not in ALLOCATIONS:
        raise ValueError(f"allocation must be one of {', '.join(ALLOCATIONS)}, got {scheme!r}")
    if scheme == "paper":
        return {"key_dim": (PAPER_KEY_DIM,) * len(embed_dim), "attn_ratio": None, "ffn_ratio": PAPER_FFN_RATIO}
    if any(c % h for c, h in zip(embed_dim, num_heads)):
        raise ValueError(
            f"the uniform allocation gives each head Q/K/V widths of C/h: the widths {list(embed_dim)} must be "
            f"divisible by the heads {list(num_heads)}"
        )
    tied = tuple(c // h for c, h in zip(embed_dim, num_heads))
    return {"key_dim": tied, "attn_ratio": 1.0, "ffn_ratio": UNIFORM_FFN_RATIO}


def allocation_of(
    embed_dim: Sequence[int], num_heads: Sequence[int], key_dim: Sequence[int],
    attn_ratio: Sequence[float] | None, ffn_ratio: float,
) -> str:
    """``"paper"``, ``"uniform"`` or ``"custom"``: which scheme these widths follow."""
    values = [value_width(c, h, k, None if attn_ratio is None else attn_ratio[i])
              for i, (c, h, k) in enumerate(zip(embed_dim, num_heads, key_dim))]
    groups = [c // h for c, h in zip(embed_dim, num_heads)]
    if ffn_ratio == PAPER_FFN_RATIO and all(k == PAPER_KEY_DIM for k in key_dim) and values == groups:
        return "paper"
    if ffn_ratio == UNIFORM_FFN_RATIO and list(key_dim) == groups and values == groups:
        return "uniform"
    return "custom"
