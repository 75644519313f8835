"""Command-line spelling of the design dials, shared by every sub-command that builds a model."""

from __future__ import annotations

import argparse

from ..bounds import IMG_SIZE_RANGE
from ..reallocation import ALLOCATIONS


def _on_off(text: str) -> bool:
    t = text.lower()
    if t in ("on", "true", "1", "yes"):
        return True
    if t in ("off", "false", "0", "no"):
        return False
    raise argparse.ArgumentTypeError(f"expected on or off, got {text!r}")


def _allocation(text: str) -> str:
    if text not in ALLOCATIONS:
        raise argparse.ArgumentTypeError(f"expected one of {', '.join(ALLOCATIONS)}, got {text!r}")
    return text


def _ints(text: str) -> int | tuple[int, ...]:
    return _numbers(text, int, "whole numbers", "64,128,192")


def _floats(text: str) -> float | tuple[float, ...]:
    return _numbers(text, float, "numbers", "0.5,1,2")


def _numbers(text: str, kind: type, what: str, example: str) -> int | float | tuple:
    """One value, or several separated by commas (``64,128,192``: one argument, no spaces)."""
    try:
        vals = tuple(kind(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected one value or {what} separated by commas (no spaces), e.g. {example}; "
                                         f"got {text!r}") from None
    return vals[0] if len(vals) == 1 else vals


# (flag, dest, type, help)
_DIALS = (
    ("--cascade", "cascade", _on_off, "on|off: add each head's output to the next head's input (paper: on)"),
    ("--group-split", "group_split", _on_off, "on|off: each head reads its own channel group; off = standard MHSA (paper: on)"),
    ("--ffn-per-side", "ffn_per_side", _ints, "sandwich N: dw+FFN pairs each side of the attention, or B,A (paper: 1)"),
    ("--key-dim", "key_dim", _ints, "Q/K width per head, one value or three per stage (paper: 16)"),
    ("--attn-ratio", "attn_ratio", _floats, "V width = attn_ratio x key_dim, one value or three (paper: width/(key_dim*heads))"),
    ("--ffn-ratio", "ffn_ratio", float, "FFN expansion (paper: 2)"),
    ("--allocation", "allocation", _allocation, "parameter reallocation: paper (Q/K 16, V C/h, FFN x2) or uniform (Q/K = V "
     "= C/h, FFN x4); --key-dim, --attn-ratio, --ffn-ratio given too win (paper: paper)"),
    ("--num-heads", "num_heads", _ints, "heads per stage, one value or three"),
    ("--embed-dim", "embed_dim", _ints, "channels per stage, three values separated by commas, e.g. 64,128,192"),
    ("--depth", "depth", _ints, "sandwich blocks per stage, three values separated by commas, e.g. 1,2,3"),
    ("--window-size", "window_size", _ints, "attention window, one value or three (paper: 7)"),
    ("--kernels", "kernels", _ints, "query depthwise kernel per head, e.g. 7,5,3,3"),
)


def add_dial_args(parser: argparse.ArgumentParser) -> None:
    """Add the design-dial options (all default to the variant's own values)."""
    group = parser.add_argument_group("design dials (default: the variant's published values)")
    for flag, dest, typ, text in _DIALS:
        group.add_argument(flag, dest=dest, type=typ, default=None, help=text)


def dials_from_args(args: argparse.Namespace) -> dict:
    """The dials given on the command line, as keyword arguments for ``create_model``.

    Raises:
        ValueError: ``--group-split off`` without ``--cascade off`` (the model's own refusal names its keyword
            ``cascade=False``, not the flag).
    """
    out = {}
    for _, dest, _, _ in _DIALS:
        value = getattr(args, dest, None)
        if value is not None:
            out[dest] = value if dest != "kernels" or isinstance(value, tuple) else (value,)
    if out.get("group_split") is False and out.get("cascade", True):
        raise ValueError("--group-split off (standard multi-head attention) needs --cascade off too: the cascade adds "
                         "each head's output to the next head's channel group, which only --group-split on has")
    return out


MIN_IMG_SIZE, MAX_IMG_SIZE = IMG_SIZE_RANGE


def image_size(values: int | list[int] | tuple[int, ...], flag: str = "--img-size") -> tuple[int, int]:
    """``N`` or ``H W`` from the command line as ``(H, W)``, each within 32..4096 pixels."""
    vals = [values] if isinstance(values, int) else list(values)
    if len(vals) not in (1, 2):
        raise ValueError(f"{flag} takes N or H W, got {len(vals)} values")
    hw = (vals[0], vals[0]) if len(vals) == 1 else (vals[0], vals[1])
    for v in hw:
        if not MIN_IMG_SIZE <= v <= MAX_IMG_SIZE:
            raise ValueError(f"{flag} must be between {MIN_IMG_SIZE} and {MAX_IMG_SIZE} pixels, got {v}")
    return hw
