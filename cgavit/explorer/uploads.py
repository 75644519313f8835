"""Uploaded images, opened with the package's one image opener (:mod:`cgavit.images`) within the
explorer's bounds, and turned into the model's view of them.

An upload is held to :data:`~cgavit.bounds.MAX_UPLOAD_PIXELS` decoded pixels, checked from its
header before anything is decoded, in one of :data:`UPLOAD_FORMATS`; a JPEG is decoded at the
smallest DCT scale that still covers the model's input. Over the bound is
:class:`~cgavit.explorer.limits.TooLarge` (HTTP 413); anything else wrong is
:class:`~cgavit.images.BadImageError`, a ``ValueError`` (HTTP 400).
"""

from __future__ import annotations

from PIL import Image, ImageOps

from ..bounds import MAX_UPLOAD_PIXELS
from ..images import ImageTooLarge, decode, open_image
from .limits import TooLarge

#: What an upload may be: common raster formats only (no EPS, which Pillow hands to Ghostscript).
#: A camera's multi-picture JPEG opens as JPEG and reports format "MPO".
UPLOAD_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")

UPLOAD_NAME = "the upload"  # how messages name an upload


def open_upload(data: bytes, cover: int) -> tuple[Image.Image, tuple[int, int]]:
    """The upload opened from its header only (nothing decoded yet), and the size it declares.

    The image will decode at ``img.size``: the declared size, or for a JPEG the smallest DCT
    scale whose sides are still at least ``cover`` pixels.

    Raises:
        BadImageError: not an accepted image format, or a broken file (a ``ValueError``).
        TooLarge: it decodes to more than :data:`~cgavit.bounds.MAX_UPLOAD_PIXELS` pixels.
    """
    try:
        return open_image(
            data, name=UPLOAD_NAME, max_pixels=MAX_UPLOAD_PIXELS, formats=UPLOAD_FORMATS, cover=cover, verify=True
        )
    except ImageTooLarge as err:
        raise TooLarge(str(err)) from None


#: PIL's filter for each interpolation a checkpoint may record (:data:`~cgavit.bounds.INTERPOLATIONS`).
RESAMPLE = {"bicubic": Image.Resampling.BICUBIC, "bilinear": Image.Resampling.BILINEAR, "nearest": Image.Resampling.NEAREST}


def model_view(img: Image.Image, size: tuple[int, int], interpolation: str = "bicubic") -> tuple[Image.Image, bool]:
    """Decode ``img`` (EXIF orientation applied, RGB), resize its short side to cover ``size``
    ``(W, H)`` (with ``interpolation``, one of :data:`RESAMPLE`) and crop the centre.

    Returns:
        ``(view, turned)``: the model's view, and whether the EXIF orientation turned the picture a quarter
        (its sides as shown are then the header's swapped), in any format that carries one.

    Raises:
        BadImageError: the file breaks while decoding (a truncated or corrupt body surfaces only now).
    """
    stored = img.size
    rgb = decode(img, UPLOAD_NAME, exif_transpose=True)
    return ImageOps.fit(rgb, size, RESAMPLE[interpolation]), rgb.size != stored
