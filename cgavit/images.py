"""Opening images safely: the package's one image opener, for files and for uploaded bytes.

Training, evaluation, prediction, the analyses, detection and the explorer read every image through
:func:`open_image` (the header only) and :func:`decode` (the pixels, as RGB), or through
:func:`load_image`, which does both:

- a path is checked first, so a pipe or device is never opened (nothing blocks);
- the size the header declares is held to a bound before any pixel is decoded, so a decompression
  bomb costs a few bytes read: :data:`~cgavit.bounds.MAX_IMAGE_PIXELS` for files,
  :data:`~cgavit.bounds.MAX_UPLOAD_PIXELS` for explorer uploads;
- only the formats a caller allows are tried, and never EPS, which Pillow hands to Ghostscript;
- a JPEG may be decoded at a reduced DCT scale (1/2, 1/4, 1/8) that still covers the size needed;
- any mode becomes 8-bit RGB (:func:`to_rgb`);
- a picture is read upright: turned as its EXIF orientation says, as every viewer shows it (a phone's photo
  stored sideways), by :func:`load_image` for files and by the explorer for uploads (``decode(...,
  exif_transpose=True)``), so training, evaluation, prediction and the explorer see the same picture;
  detection reads files as stored (``upright=False``), the frame COCO's boxes are in, in all its commands.

Whatever is wrong (missing, a pipe, empty, not an image, an unaccepted format, truncated, corrupt,
too large) is one error type, :class:`BadImageError` (:class:`ImageTooLarge` for the size bound),
whose message names the image and says what was wrong.

Pillow comes with the ``train`` and ``detect`` extras; the model core never imports this module.
"""

from __future__ import annotations

import io
import logging
import os
import warnings
from collections.abc import Mapping, Sequence

import numpy as np
from PIL import Image, ImageOps

from .bounds import MAX_IMAGE_PIXELS
from .io import DataError, UnreadableFileError, check_readable_file

#: Formats never opened, whatever a caller allows: Pillow hands EPS to Ghostscript, an interpreter.
REFUSED_FORMATS = frozenset({"EPS"})

SKIPPED_NAMED = 20  # unreadable images a run names one line each; the rest are counted (debug logging names them)

log = logging.getLogger(__name__)

Source = str | os.PathLike | bytes


class BadImageError(DataError):
    """An image that cannot be used: not a readable file, not an image of an accepted format,
    damaged or truncated, or too large. The message names the image and says what was wrong."""


class ImageTooLarge(BadImageError):
    """An image whose size (as declared, or at the reduced JPEG scale it would decode at) is over
    the pixel bound: refused from its header, before any pixel is decoded."""


class SkippedImages:
    """The images a run skipped because they could not be read, each warned about once.

    The first :data:`SKIPPED_NAMED` get a warning line each, naming the image and what was wrong; after them each
    report counts the new ones in one line and names them at debug level (``cgavit -v``), so a folder of thousands of
    broken files does not bury the run's output.
    """

    def __init__(self, named: int = SKIPPED_NAMED):
        self.named = named
        self.seen: set[str] = set()

    def __len__(self) -> int:
        return len(self.seen)

    def report(self, errors: Mapping[str, str]) -> None:
        """Warn about the images in ``errors`` (path -> the line naming it and what was wrong) not reported yet."""
        new = sorted(set(errors) - self.seen)
        shown = max(0, min(len(new), self.named - len(self.seen)))
        for path in new[:shown]:
            log.warning("skipped an image: %s", errors[path])
        for path in new[shown:]:
            log.debug("skipped an image: %s", errors[path])
        if len(new) > shown:
            more = len(new) - shown
            log.warning("skipped %d more image%s that could not be read (%d in all; cgavit -v names each)",
                        more, "" if more == 1 else "s", len(self.seen) + len(new))
        self.seen.update(new)


def skipped_text(count: int) -> str:
    """``count`` skipped images as result lines say it: ``"1 unreadable image skipped"``, ``"3 unreadable images ..."``."""
    return f"{count} unreadable image{'' if count == 1 else 's'} skipped"


def open_image(
    source: Source,
    *,
    name: str | None = None,
    max_pixels: int = MAX_IMAGE_PIXELS,
    formats: Sequence[str] | None = None,
    cover: int | None = None,
    verify: bool = False,
) -> tuple[Image.Image, tuple[int, int]]:
    """An image opened from its header and checked; no pixel is decoded yet.

    Args:
        source: a file path, or the bytes of an image (an upload).
        name: how messages name the image. Default ``"image PATH"``, or ``"the image"`` for bytes.
        max_pixels: the largest ``width * height`` that may be decoded.
        formats: the Pillow format names to try, e.g. ``("PNG", "JPEG")``. Default: every format
            Pillow reads, except :data:`REFUSED_FORMATS`.
        cover: decode a JPEG at the smallest DCT scale whose sides are still at least ``cover``
            pixels (the bound then applies to that size). None: full size.
        verify: check the file's structure first (Pillow's ``verify``: PNG checksums, ...), at the
            cost of reading it twice; meant for uploads held in memory.

    Returns:
        ``(image, declared size)``: the lazily decoding PIL image (``size``: what it will decode at;
        close it, or :func:`decode` it) and the ``(width, height)`` its header declares.

    Raises:
        BadImageError: a path that is missing, empty, a folder, a pipe or not permitted; content
            that is not an image of an accepted format, or whose header is damaged.
        ImageTooLarge: over ``max_pixels``.
    """
    name = _name(source, name)
    if not isinstance(source, (bytes, bytearray)):
        try:
            source = check_readable_file(source, "image")
        except UnreadableFileError as err:
            raise BadImageError(str(err)) from None
    allowed = tuple(f for f in formats or _pillow_formats() if f.upper() not in REFUSED_FORMATS)
    try:
        if verify:
            with _open(source, allowed) as probe:
                probe.verify()  # structure check, decoding nothing
        img = _open(source, allowed)
    except Image.DecompressionBombError as err:  # Pillow's own ceiling, above any bound of ours
        raise ImageTooLarge(f"{name} is too large to decode ({_reason(err)}); {_limit(max_pixels)}: downscale it") from None
    except Image.UnidentifiedImageError:
        accepted = f" (accepted: {', '.join(formats)})" if formats else ""
        raise BadImageError(f"cannot read {name}: cannot identify an image format in it{accepted}") from None
    except Exception as err:  # Pillow's plugins raise many types for damaged headers
        raise BadImageError(f"cannot read {name}: {_reason(err)}") from None
    declared = img.size
    if cover is not None and img.format in ("JPEG", "MPO"):  # a camera's multi-picture JPEG opens as MPO
        img.draft("RGB", (cover, cover))  # far fewer pixels decoded, the same picture after a resize
    if img.width * img.height > max_pixels:
        img.close()
        raise _too_large(name, declared, img.size, max_pixels)
    return img, declared


def decode(img: Image.Image, name: str = "the image", *, exif_transpose: bool = False) -> Image.Image:
    """The pixels of an image from :func:`open_image`, decoded, as 8-bit RGB (:func:`to_rgb`).

    Args:
        img: the opened image.
        name: how a message names it (as given to :func:`open_image`).
        exif_transpose: turn the picture as its EXIF orientation says (a phone's upright photo).

    Raises:
        BadImageError: the body is truncated or corrupt (found only now, while decoding).
    """
    try:
        sixteen_bit = is_sixteen_bit(img)  # read from the file's format, which the turned copy no longer has
        if exif_transpose:
            with warnings.catch_warnings():
                _quiet_exif_warning()
                img = ImageOps.exif_transpose(img)
        else:
            img.load()
        return to_rgb(img, sixteen_bit=sixteen_bit)
    except Exception as err:  # Pillow's decoders raise OSError, ValueError, SyntaxError, struct.error, ...
        raise BadImageError(f"cannot read {name}: {_reason(err)}") from None


def load_image(
    source: Source, *, name: str | None = None, max_pixels: int = MAX_IMAGE_PIXELS, formats: Sequence[str] | None = None,
    upright: bool = True,
) -> Image.Image:
    """Open, check, fully decode upright (EXIF orientation applied) and convert to RGB: :func:`open_image` then
    :func:`decode` with ``exif_transpose``.

    Args:
        source: a file path or the bytes of an image.
        name: how messages name the image (default ``"image PATH"``).
        max_pixels: the largest ``width * height`` decoded.
        formats: the Pillow formats to try (default: all but :data:`REFUSED_FORMATS`).
        upright: turn it as its EXIF orientation says (default); False: its pixels as stored, the frame COCO's
            boxes and sizes are given in, which detection reads in training, evaluation and prediction alike.

    Raises:
        BadImageError: whatever makes the image unusable, named (:class:`ImageTooLarge` for size).
    """
    name = _name(source, name)
    img, _ = open_image(source, name=name, max_pixels=max_pixels, formats=formats)
    with img:
        return decode(img, name, exif_transpose=upright)


def is_sixteen_bit(img: Image.Image) -> bool:
    """Whether ``img`` holds 16-bit samples, by its mode or its file's format: Pillow opens a 16-bit PGM/PPM
    (any maxval above 255, scaled by Pillow to 0-65535) as mode ``I``, as it may a 16-bit PNG or TIFF."""
    if img.mode.startswith("I;16"):
        return True
    if img.mode != "I":
        return False
    if img.format in ("PPM", "PNG"):
        return True
    bits = img.tag_v2.get(258) if img.format == "TIFF" and hasattr(img, "tag_v2") else None  # BitsPerSample
    return bool(bits) and max(bits) <= 16


def to_rgb(img: Image.Image, *, sixteen_bit: bool | None = None) -> Image.Image:
    """Any PIL image as 8-bit RGB.

    Transparent images (RGBA, LA, PA, and palette, grayscale (8- or 16-bit) or RGB images with a transparent colour, as
    a PNG or GIF may have) are composited on white; 16-bit images
    (``sixteen_bit``, default :func:`is_sixteen_bit`) are scaled from 0-65535 to 0-255 whatever values they
    hold; 32-bit integer and float images, which have no standard range, by their values' range (kept as they
    are within 0-255; floats within 0-1 scaled by 255; the range is the finite values', and a float image's NaN
    pixels, "no data", are black); CMYK, grayscale, 1-bit and palette images go through PIL's conversion.
    """
    if sixteen_bit is None:
        sixteen_bit = is_sixteen_bit(img)
    if img.mode in ("I;16", "I;16L", "I;16B", "I;16N", "I", "F"):
        arr = np.asarray(img, dtype=np.float32)
        clear = img.info.get("transparency")  # a 16-bit PNG's transparent value (tRNS)
        opaque = None if isinstance(clear, bool) or not isinstance(clear, int) else arr != clear
        arr = arr / 257.0 if sixteen_bit else _to_byte_range(arr, img.mode)
        byte = np.clip(np.nan_to_num(arr), 0, 255).round().astype(np.uint8)
        if opaque is None:
            img = Image.fromarray(byte, "L")
        else:  # the transparent value as alpha, composited on white below as an 8-bit image's
            img = Image.fromarray(np.stack([byte, opaque.astype(np.uint8) * 255], -1), "LA")
    if img.mode in ("P", "L", "RGB") and "transparency" in img.info:  # a transparent colour (tRNS): as a palette's
        img = img.convert("RGBA")
    if img.mode in ("RGBA", "LA", "PA", "RGBa", "La"):
        rgba = img.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return img if img.mode == "RGB" else img.convert("RGB")


def _to_byte_range(arr: np.ndarray, mode: str) -> np.ndarray:
    """The values of a 32-bit integer (``I``) or float (``F``) image in 0-255, judged by its finite values alone:
    one NaN (a float image's "no data") made a 0-1 image read as 0-255 (black), one inf stretched it all to 0."""
    finite = arr[np.isfinite(arr)]
    if not finite.size:
        return arr
    lo, top = float(finite.min()), float(finite.max())
    if mode == "F" and lo >= 0.0 and top <= 1.0:
        return arr * 255.0
    if lo >= 0 and top <= 255:
        return arr
    if mode == "I" and lo >= 0 and top <= 65535:  # 16-bit values held as 32-bit
        return arr / 257.0
    return (arr - lo) * (255.0 / max(top - lo, 1e-12))  # an arbitrary range: stretch what is there


def _name(source: Source, name: str | None) -> str:
    if name:
        return name
    return "the image" if isinstance(source, (bytes, bytearray)) else f"image {source}"


def _open(source: Source, formats: tuple[str, ...]) -> Image.Image:
    fp = io.BytesIO(source) if isinstance(source, (bytes, bytearray)) else source
    # Pillow warns about images over its own limit before our bound refuses them: the warning says
    # nothing the error does not. (The filter is process-wide while it lasts; threads opening images
    # at once can only leave Pillow's bomb warning shown or hidden, never change what is refused.)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        _quiet_exif_warning()
        return Image.open(fp, formats=formats)


def _quiet_exif_warning() -> None:
    """Within a ``warnings.catch_warnings()`` block: hide Pillow's "Corrupt EXIF data" warning. A damaged EXIF block
    only leaves the picture as stored (not turned), and the warning names no file."""
    warnings.filterwarnings("ignore", message="Corrupt EXIF data", category=UserWarning)


def _pillow_formats() -> tuple[str, ...]:
    Image.init()  # registers every plugin Pillow has
    return tuple(Image.OPEN)


def _too_large(name: str, declared: tuple[int, int], decoded: tuple[int, int], max_pixels: int) -> ImageTooLarge:
    size = f"{declared[0]}x{declared[1]} pixels" + (f", at least {decoded[0]}x{decoded[1]} decoded" if decoded != declared else "")
    n = decoded[0] * decoded[1]
    return ImageTooLarge(f"{name} declares {size} = {n:,} ({n / 1e6:.1f} MP), too large to decode: {_limit(max_pixels)}; downscale it")


def _limit(pixels: int) -> str:
    return f"the limit is {pixels:,} pixels ({pixels / 1e6:g} megapixels)"


def _reason(err: Exception) -> str:
    text = " ".join(str(err).split())
    return text if text else type(err).__name__
