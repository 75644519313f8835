"""The training and evaluation transforms: timm's, PIL image -> normalised tensor."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from PIL import Image, ImageOps
from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD, create_transform
from timm.data.auto_augment import posterize
from torchvision.transforms import Compose

from ...bounds import MAX_IMAGE_PIXELS
from ...images import BadImageError, load_image


def build_transform(
    img_size: int,
    training: bool,
    *,
    auto_augment: str | None = "rand-m9-mstd0.5-inc1",
    interpolation: str = "bicubic",
    re_prob: float = 0.25,
    crop_pct: float = 0.875,
    hflip: float = 0.5,
    scale: tuple[float, float] = (0.08, 1.0),
    color_jitter: float = 0.4,
    mean: Sequence[float] = IMAGENET_DEFAULT_MEAN,
    std: Sequence[float] = IMAGENET_DEFAULT_STD,
) -> Callable:
    """timm's train (RandomResizedCrop, flip, RandAugment, random erasing) or eval (resize, center
    crop) transform, PIL image -> normalised tensor ``(3, img_size, img_size)``."""
    if training:
        return _pillow_safe(create_transform(
            img_size,
            is_training=True,
            auto_augment=auto_augment or None,
            interpolation=interpolation,
            re_prob=re_prob,
            re_mode="pixel",
            re_count=1,
            hflip=hflip,
            scale=scale,
            color_jitter=color_jitter,
            mean=tuple(mean),
            std=tuple(std),
        ))
    return BoundedEvalTransform(create_transform(
        img_size, is_training=False, interpolation=interpolation, crop_pct=crop_pct, mean=tuple(mean), std=tuple(std)
    ), math.floor(img_size / crop_pct))


class BoundedEvalTransform(Compose):
    """timm's evaluation transform (a ``Compose``: resize the shorter side, centre crop, to tensor, normalise),
    refusing an image its resize would blow up: the shorter side goes to ``resize`` pixels first, so a
    1 x 100,000 px PNG of a few hundred bytes, far under the decoding bound, would become 256 x 25,600,000 px
    (20 GB). Such an image is a :class:`~cgavit.images.BadImageError`, as an unreadable one is (skipped and
    counted, or named, by the commands), instead of the process's memory.

    Args:
        transform: timm's eval transform; its steps become this one's.
        resize: the size its resize gives the shorter side.
    """

    def __init__(self, transform: Compose, resize: int) -> None:
        super().__init__(list(transform.transforms))
        self.resize = resize

    def __call__(self, img: Image.Image):
        w, h = img.size
        resized = self.resize * self.resize * max(w, h) / max(min(w, h), 1)
        if resized > MAX_IMAGE_PIXELS:
            raise BadImageError(
                f"a {w}x{h} px image is too thin for the evaluation resize (its shorter side to {self.resize} px would "
                f"make it {resized / 1e6:.0f} megapixels, above {MAX_IMAGE_PIXELS / 1e6:.0f}); crop it nearer to square"
            )
        return super().__call__(img)


def load_transformed(path, transform: Callable):
    """The image file at ``path`` read upright as RGB (:func:`~cgavit.images.load_image`) and passed through
    ``transform``: each :class:`~cgavit.images.BadImageError` names the file, the evaluation resize's too (a
    too-thin image) as well as the reader's."""
    img = load_image(path)
    try:
        return transform(img)
    except BadImageError as err:
        raise BadImageError(f"image {path}: {err}") from None


#: What ``--aa`` may say for no auto-augmentation (any case).
NO_AUTO_AUGMENT = ("", "none", "off")

#: The rest of :func:`auto_augment_policy`'s advice, after RandAugment.
AUTO_AUGMENT_EXAMPLES = "augmix-m5, original, v0 or 3a, or none"

#: RandAugment's op sets, named by a ``t`` section (``rand-m9-t3a``); timm takes any other name as its default set.
RAND_OP_SETS = ("tweights", "t3aw", "t3a")


def auto_augment_policy(aa: str | None) -> str | None:
    """``aa`` as :func:`build_transform` takes it: None for no auto-augmentation (:data:`NO_AUTO_AUGMENT`), else
    the policy, once timm has built it (with its own parser, on no image: milliseconds).

    Raises:
        ValueError: timm has no such policy (it would assert while the run's loaders are built), or the policy has a
            section timm reads as nothing (a typo: ``rand-m9-mstd0.5-incl`` trained without ``inc1``, silently).
    """
    if aa is None or aa.strip().lower() in NO_AUTO_AUGMENT:
        return None
    try:
        create_transform(32, is_training=True, auto_augment=aa)
    except (AssertionError, ValueError, KeyError, IndexError) as err:  # timm's parsers assert on what they do not know
        reason = f" ({' '.join(str(err).split())})" if str(err).strip() else ""
        raise ValueError(f"--aa {aa!r} is no timm auto-augment policy{reason}; give one such as rand-m9-mstd0.5-inc1 "
                         f"(RandAugment), {AUTO_AUGMENT_EXAMPLES}") from None
    ignored = [section for section in aa.split("-")[1:] if not _read_by_timm(section, aa.startswith("rand"))]
    if ignored:
        raise ValueError(f"--aa {aa!r}: timm skips its section{'s' if len(ignored) > 1 else ''} "
                         f"{', '.join(map(repr, ignored))} without a word (each section is a key and a number, such as "
                         f"m9, mstd0.5, inc1), so the run would train with another policy than the one named; give one "
                         f"such as rand-m9-mstd0.5-inc1 (RandAugment), {AUTO_AUGMENT_EXAMPLES}")
    return aa


def _read_by_timm(section: str, rand: bool) -> bool:
    """Whether timm's policy parsers use ``section`` of a policy string: a key and its number (``m9``), or for
    RandAugment a named op set; they skip any other section without a word."""
    if rand and section.startswith("t"):
        return section in RAND_OP_SETS
    return any(c.isdigit() for c in section)


def _posterize_any_bits(img: Image.Image, bits_to_keep: int, **_) -> Image.Image:
    """Posterize that keeps 0 bits as older Pillow did (a black image); Pillow >= 10 raises instead."""
    if bits_to_keep >= 8:
        return img
    if bits_to_keep <= 0:
        return img.point(lambda _: 0)
    return ImageOps.posterize(img, bits_to_keep)


def _pillow_safe(transform: Callable) -> Callable:
    """Patch the posterize ops of a timm transform (this instance only) so that keeping 0 bits does not raise on
    current Pillow: ``PosterizeIncreasing`` at the top magnitude of RandAugment (``rand-m9-mstd0.5-inc1`` reaches it)
    and AugMix (their ``ops``), and the ``Posterize`` of AutoAugment's ``v0`` policy (its sub-policies, ``policy``),
    which stopped a run with Pillow's ValueError from the loader."""
    for t in getattr(transform, "transforms", []):
        for op in [*getattr(t, "ops", []), *(op for sub in getattr(t, "policy", []) for op in sub)]:
            if getattr(op, "aug_fn", None) is posterize:
                op.aug_fn = _posterize_any_bits
    return transform
