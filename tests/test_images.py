"""The one image opener (cgavit.images): bounds from the header, formats, modes, reduced-scale JPEG,
and one error type for whatever is wrong."""

from __future__ import annotations

import io
import os
import struct
import zlib

import numpy as np
import pytest
from PIL import Image

from cgavit.bounds import MAX_IMAGE_PIXELS
from cgavit.images import BadImageError, ImageTooLarge, decode, load_image, open_image, to_rgb


def _encoded(img: Image.Image, fmt: str = "PNG", **kw) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format=fmt, **kw)
    return buf.getvalue()


def _png_declaring(width: int, height: int) -> bytes:
    """An 8x8 PNG whose header claims ``width x height`` (checksum fixed, so only the size lies)."""
    data = bytearray(_encoded(Image.new("RGB", (8, 8), (1, 2, 3))))
    data[16:24] = struct.pack(">II", width, height)
    data[29:33] = struct.pack(">I", zlib.crc32(bytes(data[12:29])))
    return bytes(data)


def _modes() -> dict[str, Image.Image]:
    rng = np.random.default_rng(0)
    rgb = Image.fromarray(rng.integers(0, 256, (5, 7, 3), dtype=np.uint8))
    clear = Image.new("RGBA", (7, 5), (10, 20, 30, 0))  # fully transparent: white once composited
    palette = rgb.convert("P")
    palette.info["transparency"] = 0
    return {
        "RGB": rgb, "L": rgb.convert("L"), "1": rgb.convert("1"), "P": rgb.convert("P"), "P+transparency": palette,
        "RGBA": clear, "LA": clear.convert("LA"), "CMYK": rgb.convert("CMYK"),
        "I;16": Image.fromarray(rng.integers(0, 65536, (5, 7), dtype=np.uint16)),
        "I": Image.fromarray(rng.integers(0, 65536, (5, 7)).astype(np.int32)),
        "F": Image.fromarray(rng.random((5, 7)).astype(np.float32)),
    }


@pytest.mark.parametrize("mode", list(_modes()))
def test_any_mode_becomes_8_bit_rgb_from_a_file_and_from_bytes(mode, tmp_path):
    img = _modes()[mode]
    fmt = "TIFF" if mode in ("I;16", "I", "F", "CMYK") else "PNG"
    path = tmp_path / f"x.{fmt.lower()}"
    img.save(path, format=fmt)
    for source in (path, path.read_bytes()):
        out = load_image(source)
        assert out.mode == "RGB" and out.size == (7, 5), (mode, out.mode, out.size)
    if mode in ("RGBA", "LA"):
        assert np.asarray(out).min() == 255  # transparent pixels on white, not their hidden colour
    if mode == "RGB":
        assert np.array_equal(np.asarray(out), np.asarray(img))


def test_the_header_bound_refuses_before_any_pixel_is_decoded(tmp_path):
    side = int(MAX_IMAGE_PIXELS**0.5) + 1
    bomb = tmp_path / "bomb.png"
    bomb.write_bytes(_png_declaring(side, side))  # decoding it would fail as truncated, not as too large
    with pytest.raises(ImageTooLarge, match=rf"image {bomb} declares {side}x{side} pixels .* too large to decode: the limit"):
        load_image(bomb)
    with pytest.raises(ImageTooLarge, match="the upload declares 4001x4000"):
        open_image(_png_declaring(4001, 4000), name="the upload", max_pixels=16_000_000)
    with pytest.raises(ImageTooLarge, match="too large to decode"):  # past Pillow's own ceiling
        load_image(_png_declaring(20_000, 20_000))
    img, declared = open_image(_png_declaring(1000, 1000))  # within the bound: opened, its pixels not read yet
    with img, pytest.raises(BadImageError, match="cannot read the image: "):
        decode(img)  # now they are: 8x8 pixels of data for a 1000x1000 header
    assert declared == (1000, 1000)


def test_a_jpeg_decodes_at_the_smallest_scale_that_covers(tmp_path):
    data = _encoded(Image.new("RGB", (6000, 4000), (10, 120, 200)), "JPEG")  # 24 MP
    img, declared = open_image(data, max_pixels=16_000_000, cover=224)  # within 16 MP at 1/8 scale
    with img:
        assert declared == (6000, 4000) and img.size == (750, 500)
        assert decode(img).size == (750, 500)
    with pytest.raises(ImageTooLarge, match="declares 6000x4000 pixels = 24,000,000"):
        open_image(data, max_pixels=16_000_000)  # no cover: full size, over the bound


def test_formats_are_an_allow_list_and_eps_is_never_opened(tmp_path):
    bmp = _encoded(Image.new("RGB", (4, 4)), "BMP")
    assert load_image(bmp).size == (4, 4)
    with pytest.raises(BadImageError, match=r"cannot identify an image format in it \(accepted: PNG, JPEG\)"):
        load_image(bmp, formats=("PNG", "JPEG"))
    eps = b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 10 10\nshowpage\n"
    for formats in (None, ("EPS", "PNG")):  # refused even when a caller allows it
        with pytest.raises(BadImageError, match="cannot identify"):
            load_image(eps, formats=formats)


def test_whatever_is_wrong_is_one_error_type_naming_the_file(tmp_path):
    good = _encoded(Image.fromarray(np.random.default_rng(1).integers(0, 256, (64, 64, 3), dtype=np.uint8)))
    cases = {"truncated.png": good[:-40], "text.jpg": b"just text", "empty.png": b""}
    for name, content in cases.items():
        (tmp_path / name).write_bytes(content)
    fifo = tmp_path / "fifo.png"
    os.mkfifo(fifo)  # never opened: opening a pipe would block
    says = {"truncated.png": "image file is truncated", "text.jpg": "cannot identify", "empty.png": "empty",
            "fifo.png": "not a regular file", "missing.png": "does not exist", ".": "folder"}
    for name, what in says.items():
        path = tmp_path / name
        with pytest.raises(BadImageError) as err:
            load_image(path)
        assert str(path) in str(err.value) and what in str(err.value), (name, str(err.value))
    assert str(pytest.raises(BadImageError, load_image, tmp_path / "truncated.png").value) == (
        f"cannot read image {tmp_path / 'truncated.png'}: image file is truncated"
    )


@pytest.mark.parametrize("fmt", ["PNG", "JPEG"])
def test_a_file_is_read_upright_as_the_explorer_reads_an_upload(tmp_path, fmt):
    """A photo stored sideways with EXIF orientation 6 (what every viewer shows upright) was read sideways by
    predict, eval and training, and upright by the explorer: the same picture got another class."""
    from PIL import ImageOps

    from cgavit.explorer.uploads import model_view, open_upload

    upright = Image.fromarray(np.kron(np.arange(12, dtype=np.uint8).reshape(3, 4) * 20, np.ones((8, 8), np.uint8)))
    exif = Image.Exif()
    exif[0x0112] = 6  # stored turned: shown after a quarter turn clockwise
    path = tmp_path / f"photo.{fmt.lower()}"
    upright.convert("RGB").transpose(Image.Transpose.ROTATE_90).save(path, format=fmt, exif=exif.tobytes(), quality=100)
    read = load_image(path)
    assert read.size == upright.size  # 32 x 24, as shown, not 24 x 32 as stored
    if fmt == "PNG":  # lossless: the very picture
        assert np.array_equal(np.asarray(read), np.asarray(upright.convert("RGB")))
    seen, turned = model_view(open_upload(path.read_bytes(), 32)[0], (16, 16))
    assert turned
    assert np.array_equal(np.asarray(seen), np.asarray(ImageOps.fit(read, (16, 16), Image.Resampling.BICUBIC)))


def test_a_transparent_colour_is_white_whatever_the_mode_that_holds_it(tmp_path):
    """A grayscale or RGB PNG with a transparent colour (tRNS) kept that colour (black here) where a palette PNG or a
    GIF of the same picture was composited on white: one picture, two inputs, by how it was saved."""
    grey = np.zeros((8, 8), np.uint8)
    grey[2:6, 2:6] = 100
    saved = {"l.png": Image.fromarray(grey, "L"), "rgb.png": Image.fromarray(np.stack([grey] * 3, -1)),
             "p.png": Image.fromarray(grey, "L").convert("P"), "p.gif": Image.fromarray(grey, "L").convert("P")}
    for name, img in saved.items():
        img.save(tmp_path / name, transparency=(0, 0, 0) if img.mode == "RGB" else 0)
    arrays = {name: np.asarray(load_image(tmp_path / name)) for name in saved}
    for name, arr in arrays.items():
        assert tuple(arr[0, 0]) == (255, 255, 255) and tuple(arr[3, 3]) == (100, 100, 100), (name, arr[0, 0])
    deep = np.zeros((8, 8), "<u2")
    deep[2:6, 2:6] = 100 * 257
    Image.frombytes("I;16", (8, 8), deep.tobytes()).save(tmp_path / "l16.png", transparency=0)  # 16-bit grey, tRNS
    arr = np.asarray(load_image(tmp_path / "l16.png"))
    assert tuple(arr[0, 0]) == (255, 255, 255) and tuple(arr[3, 3]) == (100, 100, 100), arr[..., 0]
    opaque = tmp_path / "opaque.png"  # no transparent colour: as stored
    Image.fromarray(grey, "L").save(opaque)
    assert tuple(np.asarray(load_image(opaque))[0, 0]) == (0, 0, 0)


def test_a_float_image_is_scaled_by_its_finite_values():
    """One NaN pixel (a float image's "no data") made a 0-1 image read as 0-255, so 0.8 became 1 of 255 (black), and
    one inf stretched every other pixel to 0."""
    arr = np.full((4, 4), 0.8, np.float32)
    arr[0, 0] = np.nan
    out = np.asarray(to_rgb(Image.fromarray(arr, "F")))
    assert tuple(out[1, 1]) == (204, 204, 204) and tuple(out[0, 0]) == (0, 0, 0), out[..., 0]
    wide = np.full((4, 4), 1000.0, np.float32)
    wide[1, 1], wide[0, 0] = 0.0, np.inf
    out = np.asarray(to_rgb(Image.fromarray(wide, "F")))[..., 0]
    assert out[0, 1] == 255 and out[1, 1] == 0 and out[0, 0] == 255, out  # inf: above the range, white
