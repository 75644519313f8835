"""The ImageNet-1k class names, in class-index order (package data built from timm's ImageNet
metadata): what a 1000-class checkpoint that records no names of its own predicts."""

from __future__ import annotations

from functools import lru_cache
from importlib import resources


@lru_cache(maxsize=1)
def imagenet_classes() -> list[tuple[str, str]]:
    """The 1000 ``(synset, description)`` pairs, e.g. ``("n01440764", "tench, Tinca tinca")``."""
    text = resources.files(__package__).joinpath("imagenet_classes.txt").read_text()
    return [tuple(line.split("\t", 1)) for line in text.splitlines() if line.strip()]


def class_names(num_classes: int, stored: list[str] | tuple[str, ...] | None = None) -> list[str]:
    """The names to show for a classifier of ``num_classes`` outputs: the ``stored`` ones when they
    fit, ImageNet-1k's short names for 1000 classes (:func:`imagenet_names`), else ``"class i"``."""
    if stored and len(stored) == num_classes:
        return list(stored)
    if num_classes == 1000:
        return list(imagenet_names())
    return [f"class {i}" for i in range(num_classes)]


@lru_cache(maxsize=1)
def imagenet_names() -> tuple[str, ...]:
    """ImageNet-1k's short names (the first of each description's), one per class: the two short names that two
    classes share (``crane``, the bird and the machine; ``maillot``) carry their synset, e.g.
    ``crane (n02012849)``, so that every class has its own name, as an exported file's must."""
    short = [desc.split(",")[0] for _, desc in imagenet_classes()]
    shared = {name for name in short if short.count(name) > 1}
    return tuple(f"{name} ({synset})" if name in shared else name for name, (synset, _) in zip(short, imagenet_classes()))
