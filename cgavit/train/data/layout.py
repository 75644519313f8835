"""The image-folder layout: listing a split's classes and images, and checking a dataset before a
run starts.

Layout (the ImageNet-1k one)::

    DIR/train/<class>/<image>     DIR/val/<class>/<image>

Class indices are the sorted class-folder names, so an ImageNet ``val`` folder of synset names gets
the standard 1000-class order.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Sequence
from pathlib import Path

from ...classes import class_name
from ...images import BadImageError, load_image
from ...io import DataError
from ...schema import MAX_NAME_LENGTH, shown

log = logging.getLogger(__name__)

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".gif", ".tif", ".tiff", ".webp", ".ppm", ".pgm", ".pbm")


def files_under(folder: str | Path, dangling: list[Path] | None = None, special: list[Path] | None = None) -> list[Path]:
    """Every file in ``folder`` and its sub-folders, sorted, found as torchvision's ``ImageFolder`` finds them: linked
    folders are followed (each real folder once, so a link loop ends), and hidden files and folders (a name starting
    with a dot) are left out, with everything in them. Links that lead to no file (a target gone, a loop) are left
    out too, and added to ``dangling`` when it is given; so are pipes, sockets and devices, added to ``special``."""
    found, seen = [], set()
    for top, dirs, names in os.walk(folder, followlinks=True):
        real = os.path.realpath(top)
        if real in seen:
            dirs[:] = []
            continue
        seen.add(real)
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        for name in names:
            path = os.path.join(top, name)
            if name.startswith("."):
                continue
            if os.path.isfile(path):
                found.append(Path(path))
            elif dangling is not None and os.path.islink(path):
                dangling.append(Path(path))
            elif special is not None and not os.path.islink(path):
                special.append(Path(path))
    return sorted(found)


def check_folder(path: str | Path, what: str = "data folder") -> Path:
    """Return ``path`` if it is a folder that can be listed; raise :class:`~cgavit.io.DataError`
    naming it and saying what is wrong otherwise (missing, a file, a pipe, or not permitted)."""
    path = Path(path)
    if not path.exists():
        raise DataError(f"{what} {path} does not exist; check the path")
    if not path.is_dir():
        raise DataError(f"{what} {path} is not a folder (a file, pipe or device); give the folder")
    try:
        next(path.iterdir(), None)
    except OSError as err:
        raise DataError(f"{what} {path} cannot be listed ({err.strerror or err}); fix its permissions") from None
    return path


def list_split(
    root: str | Path, split: str | None = None, order: Sequence[str] | None = None
) -> tuple[list[str], list[tuple[str, int]]]:
    """Class names and ``(path, class index)`` samples of one image-folder split.

    Args:
        root: the dataset folder (``split`` is looked up inside it), or the split folder itself
            when ``split`` is None.
        split: ``"train"``, ``"val"``, ... or None.
        order: the class order to index by, where the folders name exactly these classes (a resumed run's: an
            earlier cgavit sorted the folder names as stored, and a name stored decomposed may sort elsewhere);
            default, and for other folders, the names sorted.

    Raises:
        DataError: a blank ``split``; the folder is missing, not a folder, has no class folders, or a class folder
            holds no image; the message names the folder and says what the layout must be.
    """
    check_split_name(root, split)
    if split:
        check_folder(root)
    folder = Path(root) / split if split else Path(root)
    if not folder.exists():
        raise DataError(
            f"data folder {folder} does not exist; expected the image-folder layout "
            f"DIR/train/<class>/<image> and DIR/val/<class>/<image>{_folders_held(folder.parent)}"
        )
    check_folder(folder)
    entries = [p for p in folder.iterdir() if not p.name.startswith(".")]
    folders = _class_folders(folder, entries)
    classes = sorted(folders)  # the class indices: the names' order, whichever form the folders are stored in
    if order is not None and all(isinstance(c, str) for c in order) and sorted(map(class_name, order)) == classes:
        classes = [class_name(c) for c in order]
    if not classes:
        raise DataError(f"{folder} has no class folders; put each class's images in {folder}/<class name>/")
    odd = [c for c in classes if not (c.isprintable() and len(c) <= MAX_NAME_LENGTH)]
    if odd:  # a class name is recorded in every checkpoint and printed by predict: the checkpoint schema refuses these
        raise DataError(
            f"class folder names must be printable text of at most {MAX_NAME_LENGTH} characters; {folder} has "
            f"{', '.join(shown(c) for c in odd[:5])}: rename them"
        )
    samples: list[tuple[str, int]] = []
    empty, left_out, special = [], [], []
    dangling = [p for p in entries if p.is_symlink() and not p.exists()]  # a class folder's link to nothing
    warn_loose_images(folder)
    for idx, name in enumerate(classes):
        found = files_under(folder / folders[name], dangling, special)
        files = [p for p in found if p.suffix.lower() in IMAGE_EXTENSIONS]
        left_out += [p for p in found if p.suffix.lower() not in IMAGE_EXTENSIONS]
        if not files:
            empty.append(name)
        samples.extend((str(p), idx) for p in files)
    _warn_left_out(folder, left_out, dangling, special)
    _refuse_shared_folders(folder, classes, samples)
    if empty:
        raise DataError(
            f"{len(empty)} class folder(s) in {folder} hold no images ({_first_few(empty)}); remove them or add images "
            f"(recognised extensions: {' '.join(IMAGE_EXTENSIONS)})"
        )
    return classes, samples


def _folders_held(root: str | Path) -> str:
    """What a dataset folder without the split asked for holds, for the message: its splits may have other names
    (``validation``, ``test``), to be named by the split option."""
    try:
        held = sorted(p.name for p in Path(root).iterdir() if p.is_dir() and not p.name.startswith("."))
    except OSError:  # missing, a file, or not permitted: the message goes without the list
        return ""
    if not held:
        return f" ({root} holds no folder)"
    return f" ({root} holds the folders {_first_few([shown(n) for n in held])})"


def check_split_name(root: str | Path, split: str | None, flag: str = "a split") -> None:
    """Refuse a blank ``split`` (``""`` read the dataset's own split folders as classes, or eval's default ``val``);
    None, no split, is fine. ``flag`` names the option in the message."""
    if split is not None and not split.strip():
        raise DataError(f"{flag} must name a folder inside {root} (e.g. train or val), got {split!r}")


def _class_folders(folder: Path, entries: list[Path]) -> dict[str, str]:
    """Class name (:func:`~cgavit.classes.class_name`) -> its folder's name, for the folders among ``entries``.

    Raises:
        DataError: two folders whose names are one name in two Unicode forms.
    """
    folders: dict[str, str] = {}
    for name in sorted(p.name for p in entries if p.is_dir()):
        if class_name(name) in folders:
            raise DataError(f"{folder} has two class folders named {shown(folders[class_name(name)])} and "
                            f"{shown(name)}, the same name in two Unicode forms; merge them")
        folders[class_name(name)] = name
    return folders


def warn_loose_images(folder: Path) -> None:
    """Warn about images directly in ``folder``, a folder of class folders: beside them, an image has no class and is
    not read."""
    loose = sorted(p for p in folder.iterdir() if not p.name.startswith(".") and p.is_file()
                   and p.suffix.lower() in IMAGE_EXTENSIONS)
    if loose:
        log.warning("%d image(s) directly in %s are left out: beside class folders an image has no class; move them "
                    "into %s/<class>/ (e.g. %s)", len(loose), folder, folder, ", ".join(shown(p.name) for p in loose[:3]))


def _refuse_shared_folders(folder: Path, classes: list[str], samples: list[tuple[str, int]]) -> None:
    """Refuse a folder of images that two class folders reach (a link to another class's folder, or to a folder
    above them): its images would be counted once under each class, with contradictory labels.

    Raises:
        DataError: naming both class folders and the folder they share.
    """
    owner: dict[str, int] = {}
    for parent, label in sorted({(os.path.dirname(path), label) for path, label in samples}):
        real = os.path.realpath(parent)
        other = owner.setdefault(real, label)
        if other != label:
            first, second = sorted((classes[other], classes[label]))
            raise DataError(f"class folders {shown(first)} and {shown(second)} of {folder} both reach the images of "
                            f"{shown(real)} through a link, so each would be counted under two classes; remove the link")


def _warn_left_out(folder: Path, left_out: list[Path], dangling: list[Path], special: list[Path] = ()) -> None:
    """Say which files of ``folder``'s class folders are not read, so that none vanishes without a word."""
    if special:  # a pipe named 7.png was dropped without one
        log.warning("%d file(s) in %s are left out: they are no regular files (a pipe, socket or device), e.g. %s",
                    len(special), folder, ", ".join(shown(str(p)) for p in sorted(special)[:3]))
    if left_out:  # a .jfif or .avif photo, or a name without a suffix
        log.warning("%d file(s) in %s are left out: their names do not end in an image suffix read here (%s), e.g. "
                    "%s; rename the images among them (a .jfif is a .jpg)", len(left_out), folder,
                    " ".join(IMAGE_EXTENSIONS), ", ".join(shown(p.name) for p in sorted(left_out)[:3]))
    if dangling:
        log.warning("%d link(s) in %s are left out: they lead to no file (a target moved or deleted, or a loop), e.g. "
                    "%s", len(dangling), folder, ", ".join(shown(str(p)) for p in sorted(dangling)[:3]))


def split_fingerprint(samples: Sequence[tuple[str, int]], folder: str | Path) -> dict:
    """What identifies a split's images in their order: ``{"images": count, "digest": hex}``, the digest over each
    sample's path relative to the split's ``folder`` and its class index (so a dataset moved elsewhere keeps it).

    A run stopped mid-epoch records its training split's, so that a resume can tell whether the positions it skips
    are still the images it trained on (an epoch's order is a permutation of the samples' indices)."""
    prefix = os.path.join(str(folder), "")
    text = "\n".join(f"{path[len(prefix):] if path.startswith(prefix) else path}\0{label}" for path, label in samples)
    digest = hashlib.sha256(text.encode("utf-8", "surrogateescape")).hexdigest()
    return {"images": len(samples), "digest": digest[:32]}


def same_split(root: str | Path, a: str, b: str) -> bool:
    """Whether splits ``a`` and ``b`` of ``root`` are one folder, however spelt (``train``, ``./train``, a link)."""
    da, db = Path(root) / a, Path(root) / b
    return a == b or (da.is_dir() and db.is_dir() and da.samefile(db))


def check_layout(root: str | Path, train_split: str = "train", val_split: str = "val",
                 order: Sequence[str] | None = None) -> dict:
    """Check both splits before training starts: different folders that name the same classes (indexed in ``order``
    where given and they are its classes: :func:`list_split`).

    Returns:
        ``{"classes": [...], "train": samples, "val": samples}``.

    Raises:
        DataError: a missing or empty split or class folder, class sets that differ, one folder for both or a
            folder of images in both through links (validated on its training images, a run would choose its best
            checkpoint on them), or a single class
            (nothing to learn: every prediction would be right).
    """
    if same_split(root, train_split, val_split):
        raise DataError(f"--train-split {train_split!r} and --val-split {val_split!r} are the same folder of {root}: "
                        "validation on the training images says nothing about others (and best.* would be chosen on "
                        "them); give a held-out split")
    for flag, split, role in (("--train-split", train_split, "training"), ("--val-split", val_split, "validation")):
        if Path(root).is_dir() and split.strip() and not (Path(root) / split).exists():  # a dataset's "validation"
            raise DataError(f"{flag} {split!r}: {Path(root) / split} does not exist{_folders_held(root)}; give --data the "
                            f"dataset folder and {flag} the name of its {role} split folder")
    train_classes, train_samples = list_split(root, train_split, order)
    val_classes, val_samples = list_split(root, val_split, order)
    shared = _real_folders(train_samples).keys() & _real_folders(val_samples).keys()
    if shared:  # a class folder of val linked to train's: the same refusal as the whole split linked
        example = _real_folders(val_samples)[min(shared)]
        raise DataError(f"--val-split {val_split!r} reaches images of --train-split {train_split!r} through links "
                        f"({len(shared)} folder(s), e.g. {shown(example)}): validation on the training images says "
                        "nothing about others (and best.* would be chosen on them); give a held-out split")
    if train_classes != val_classes:
        only_t = sorted(set(train_classes) - set(val_classes))[:5]
        only_v = sorted(set(val_classes) - set(train_classes))[:5]
        raise DataError(
            f"the {train_split} and {val_split} splits of {root} name different classes "
            f"(only in {train_split}: {only_t}; only in {val_split}: {only_v}); both need the same class folders"
        )
    if len(train_classes) < 2:
        raise DataError(
            f"{Path(root) / train_split} has one class folder ({train_classes[0]}): a classifier of one class has "
            f"nothing to learn and scores 100 %; add a folder of images for each other class (DIR/{train_split}/<class>/)"
        )
    return {"classes": train_classes, "train": train_samples, "val": val_samples}


def _real_folders(samples: Sequence[tuple[str, int]]) -> dict[str, str]:
    """The real folder (links resolved) of each folder holding one of ``samples`` -> that folder as listed."""
    return {os.path.realpath(parent): parent for parent in {os.path.dirname(path) for path, _ in samples}}


def unreadable_classes(layout: dict, root: str | Path, train_split: str = "train", val_split: str = "val") -> str | None:
    """What is wrong when a class of either split has no image that can be read, else None.

    A class folder with no image file is refused by :func:`list_split`; this finds the class whose
    files are all unreadable (damaged, truncated, too large, not images), which training would
    otherwise skip image by image and never learn. Each class's images are decoded in order until
    one works, so a readable dataset costs one decode per class and split.

    Args:
        layout: what :func:`check_layout` returned.
        root: the dataset folder, for the message.
        train_split, val_split: the split folder names, for the message.

    Returns:
        One line naming the classes and an example error, or None when every class has an image.
    """
    for split, key in ((train_split, "train"), (val_split, "val")):
        failed = _classes_without_an_image(layout[key], len(layout["classes"]))
        if failed:
            names = [layout["classes"][i] for i in failed]
            first = failed[min(failed)]
            return (
                f"{len(names)} class folder(s) in {Path(root) / split} hold no image that could be read "
                f"({_first_few(names)}); e.g. {first}. Fix or replace their images, or remove the class folders"
            )
    return None


def _classes_without_an_image(samples: Sequence[tuple[str, int]], num_classes: int) -> dict[int, str]:
    """``{class index: the first image's error}`` for every class none of whose images decodes."""
    readable: set[int] = set()
    errors: dict[int, str] = {}
    for path, label in samples:
        if label in readable:
            continue
        try:
            load_image(path)
        except BadImageError as err:
            errors.setdefault(label, str(err))
        else:
            readable.add(label)
    return {i: errors[i] for i in range(num_classes) if i not in readable and i in errors}


def _first_few(names: list[str], n: int = 5) -> str:
    return ", ".join(names[:n]) + (" ..." if len(names) > n else "")
