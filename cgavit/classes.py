"""Class folders matched to a model's classes: the one rule the analyses and the int8 commands' image loading share.

A checkpoint that records its class names (:attr:`~cgavit.factory.ModelInfo.names_recorded`) is matched by
name: a folder's classes, read in sorted order, are relabelled with the checkpoint's index of each name
(:func:`model_indices`), so a folder that lacks a class, or whose names sort in another order than the
checkpoint lists them, still gives the right targets. A file without names has only its class count to go
by: one class folder per output, in sorted order.

Only torch is imported here.
"""

from __future__ import annotations

import unicodedata
from collections.abc import Sequence
from pathlib import Path

import torch

from .factory import ModelInfo


def class_name(name: str) -> str:
    """A class name as it is compared and recorded: in Unicode's composed form (NFC), so that a folder ``café``
    stored decomposed (as macOS stores names) is the class ``café`` of a checkpoint trained elsewhere."""
    return unicodedata.normalize("NFC", name)


def same_classes(a: Sequence[str], b: Sequence[str]) -> bool:
    """Whether two class lists name the same classes in the same order (:func:`class_name`'s form)."""
    return [class_name(n) for n in a] == [class_name(n) for n in b]


def check_classes(source: str | Path, classes: Sequence[str], info: ModelInfo, num_classes: int, *,
                  subset: bool = False) -> None:
    """A folder's class folders must be the checkpoint's classes: by name where it records them, else by count.

    Args:
        source: the folder, for the message.
        classes: its class folder names.
        info: the checkpoint's class names (and whether it records them).
        num_classes: the classes the model predicts.
        subset: with recorded names, accept a folder that holds only some of the checkpoint's classes
            (each matched by name); otherwise it must hold all of them.

    Raises:
        ValueError: a class folder the checkpoint does not have (or, without ``subset``, one it has that the
            folder lacks), named; without recorded names, a class count other than the model's.
    """
    if not info.names_recorded:
        if len(classes) != num_classes:
            raise ValueError(f"{source} has {len(classes)} class folders, but the checkpoint predicts {num_classes} "
                             "classes: give the folder the model was trained on")
        return
    classes = [class_name(n) for n in classes]
    recorded = [class_name(n) for n in info.class_names]
    want = [name for name in recorded if name in classes] if subset else recorded
    if sorted(classes) != sorted(want):
        raise ValueError(f"{source}'s class folders are not the checkpoint's classes: "
                         f"{class_difference(list(classes), want)}; give the folder the model was trained on")


def model_indices(classes: Sequence[str], info: ModelInfo) -> torch.Tensor:
    """The checkpoint's index of each of a folder's classes (checked by :func:`check_classes`):
    ``model_indices(classes, info)[label]`` is the model's class of an image the folder labels ``label``."""
    named = [class_name(n) for n in info.class_names]
    return torch.tensor([named.index(class_name(name)) for name in classes])


def class_difference(have: list[str], want: list[str]) -> str:
    """What ``have`` has that ``want`` lacks and the other way round, e.g. ``"'nine' is not among them; '9' is missing"``."""
    def few(names: list[str]) -> str:
        return ", ".join(map(repr, names[:5])) + (" ..." if len(names) > 5 else "")

    extra, missing = [n for n in have if n not in want], [n for n in want if n not in have]
    parts = ([f"{few(extra)} {'is' if len(extra) == 1 else 'are'} not among them"] if extra else []) \
        + ([f"{few(missing)} {'is' if len(missing) == 1 else 'are'} missing"] if missing else [])
    return "; ".join(parts) or "the same names"
