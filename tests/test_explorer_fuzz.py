"""The explorer against hostile and heavy use (issue #13): fuzzed parameters and uploads, load,
idle and slow clients, Host/Origin checks, JSON for every error, and bad checkpoints at startup.

Every request goes over loopback to a server in this process (or, for the memory check, in a
subprocess), with a client timeout, so a hang fails the test instead of stalling it.
"""

from __future__ import annotations

import base64
import http.client
import http.server
import io
import ipaddress
import json
import logging
import os
import re
import socket
import stat
import struct
import subprocess
import sys
import threading
import time
import zlib
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import quote

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image, ImageDraw
from safetensors.torch import load_file, save_file

from cgavit import cli, create_model, save_weights
from cgavit.cli import explore as explore_command
from cgavit.bounds import MAX_UPLOAD_PIXELS
from cgavit.explorer import ImageAttention, build_model, image_attention, loading
from cgavit.explorer.guard import HostCheck, Refused, split_host
from cgavit.explorer.limits import MAX_PREVIEW_SIDE, MAX_UPLOAD_BYTES, Budget, Busy, Limits, TooLarge, window_map_bytes
from cgavit.explorer.server import ApiError, ExplorerServer, parse_int
from cgavit.weights import read_metadata

FUZZ = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
TEXT = st.text(st.characters(blacklist_categories=("Cs",)), max_size=30)  # anything UTF-8 can carry


# ------------------------------------------------------------------------------- helpers
@pytest.fixture(scope="module")
def images():
    return ImageAttention(*build_model())


@contextmanager
def serving(images, limits=None, host="127.0.0.1", **kw):
    srv = ExplorerServer((host, 0), images, limits=limits, **kw)
    thread = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True)
    thread.start()
    try:
        yield srv
    finally:
        srv.shutdown()
        srv.server_close()


@pytest.fixture(scope="module")
def server(images):
    with serving(images) as srv:
        yield srv


def host_of(srv):
    return f"127.0.0.1:{srv.server_address[1]}"


def raw(srv, data: bytes, timeout: float = 30):
    """Send ``data`` exactly as given on a new connection; return (status, headers, JSON body or bytes)."""
    with socket.create_connection(srv.server_address[:2], timeout=timeout) as sock:
        sock.sendall(data)
        res = http.client.HTTPResponse(sock, method=data.split(b" ", 1)[0].decode("latin-1"))
        res.begin()
        body = res.read()
    headers = {k.lower(): v for k, v in res.getheaders()}
    if headers.get("content-type") == "application/json" and body:
        body = json.loads(body)
    return res.status, headers, body


def get(srv, target: str, extra: str = ""):
    return raw(srv, f"GET {target} HTTP/1.1\r\nHost: {host_of(srv)}\r\n{extra}\r\n".encode("latin-1"))


def post(srv, target: str, body: bytes, extra: str = ""):
    head = f"POST {target} HTTP/1.1\r\nHost: {host_of(srv)}\r\nContent-Length: {len(body)}\r\n{extra}\r\n"
    return raw(srv, head.encode("latin-1") + body)


def assert_json_error(status, headers, body, expected):
    assert status in (expected if isinstance(expected, tuple) else (expected,)), (status, body)
    assert headers["content-type"] == "application/json"
    assert isinstance(body, dict) and body["error"], body


def png_bytes(size=(96, 64), mode="RGB", colour=(40, 90, 160)) -> bytes:
    img = Image.new(mode, size, colour)
    ImageDraw.Draw(img).ellipse((1, 1, size[0] // 2 + 1, size[1] // 2 + 1), fill=colour if mode != "RGB" else (240, 200, 30))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def png_declaring(width: int, height: int) -> bytes:
    """A small PNG whose header claims ``width x height`` (checksum fixed, so only the size lies)."""
    data = bytearray(png_bytes((8, 8)))
    data[16:24] = struct.pack(">II", width, height)
    data[29:33] = struct.pack(">I", zlib.crc32(bytes(data[12:29])))
    return bytes(data)


def jpeg_declaring(width: int, height: int) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (16, 16), (200, 10, 10)).save(buf, format="JPEG")
    data = bytearray(buf.getvalue())
    sof = data.index(b"\xff\xc0")
    data[sof + 5 : sof + 9] = struct.pack(">HH", height, width)
    return bytes(data)


def gif_declaring(width: int, height: int) -> bytes:
    buf = io.BytesIO()
    Image.new("P", (8, 8)).save(buf, format="GIF")
    data = bytearray(buf.getvalue())
    data[6:10] = struct.pack("<HH", width, height)
    return bytes(data)


PNG = png_bytes()


# ------------------------------------------------------------------------------- strict parameters
@pytest.mark.parametrize("text", ["４", "4_0", "+4", " 4", "4 ", "0x4", "4.0", "٤", "4\n", "", "-0", "99999999999999999999"])
def test_integers_are_ascii_digits_only(text):
    with pytest.raises(ApiError) as err:
        parse_int("heads", text, 1, 24)
    assert err.value.status == 400


@pytest.mark.parametrize("text", ["25", "0", "-1", "99999999999999999999", "9" * 5000])
def test_an_integer_out_of_range_says_the_range(text):
    """Twenty digits or more were refused as "must be an integer written in digits 0-9", which they were."""
    with pytest.raises(ApiError, match=r"^heads must be in 1\.\.24, got '[-0-9]{1,40}'(\.\.\.)?$") as err:
        parse_int("heads", text, 1, 24)
    assert err.value.status == 400


def test_full_width_and_underscore_digits_are_refused(server):
    for query in ("heads=%EF%BC%94", "seed=4_0", "heads=%2B4", "heads=%204", "seed=-0"):
        assert_json_error(*get(server, f"/api/cga?{query}"), 400)
    assert get(server, "/api/cga?heads=4&seed=40")[0] == 200


@FUZZ
@given(params=st.dictionaries(st.sampled_from(["heads", "cascade", "groups", "seed", "other"]), TEXT, max_size=5))
def test_cga_any_parameter_values(server, params):
    query = "&".join(f"{quote(k, safe='')}={quote(v, safe='')}" for k, v in params.items())
    status, headers, body = get(server, f"/api/cga?{query}")
    assert status in (200, 400) and headers["content-type"] == "application/json"
    assert ("maps" in body) if status == 200 else body["error"]


@FUZZ
@given(query=st.binary(max_size=60).map(lambda b: b.replace(b"\r", b"").replace(b"\n", b"")))
def test_cga_raw_query_bytes(server, query):
    status, headers, body = raw(server, b"GET /api/cga?" + query + b" HTTP/1.1\r\nHost: " + host_of(server).encode() + b"\r\n\r\n")
    assert status in (200, 400) and headers["content-type"] == "application/json"


@FUZZ
@given(image=st.one_of(TEXT, st.just("0123456789abcdef")), block=TEXT, token=TEXT)
def test_attention_any_parameter_values(server, image, block, token):
    target = f"/api/attention?image={quote(image, safe='')}&block={quote(block, safe='')}&query={quote(token, safe='')}"
    status, headers, body = get(server, target)
    assert status in (400, 404) and headers["content-type"] == "application/json" and body["error"]


def test_attention_parameters_after_an_upload(server):
    status, _, up = post(server, "/api/image", PNG)
    assert status == 200
    image_id = up["image_id"]
    assert get(server, f"/api/attention?image={image_id}&block=2&query=mean")[0] == 200
    for block, token in [("%EF%BC%92", "mean"), ("2_0", "mean"), ("2", "1_0"), ("2", "-1"), ("2", "%2B3"), ("05", "mean")]:
        status, headers, body = get(server, f"/api/attention?image={image_id}&block={block}&query={token}")
        assert status == (200 if block == "05" else 400), (block, token, body)  # leading zeros are digits too


@FUZZ
@given(name=TEXT)
def test_static_any_name(server, name):
    status, headers, body = get(server, "/static/" + quote(name, safe=""))
    assert status in (200, 403, 404)
    if status != 200:
        assert headers["content-type"] == "application/json" and body["error"]


@pytest.mark.parametrize("length", [255, 256, 300, 5000])
def test_long_static_name_is_404(server, length):
    assert_json_error(*get(server, "/static/" + "a" * length + ".js"), 404)


# ------------------------------------------------------------------------------- uploads
def upload_strategy():
    return st.one_of(
        st.binary(min_size=1, max_size=3000),
        st.integers(1, len(PNG) - 1).map(lambda k: PNG[:k]),
        st.tuples(st.integers(1, 65535), st.integers(1, 65535)).map(lambda wh: png_declaring(*wh)),
        st.tuples(st.integers(1, 65535), st.integers(1, 65535)).map(lambda wh: jpeg_declaring(*wh)),
    )


@FUZZ
@given(body=upload_strategy())
def test_upload_any_body(server, body):
    status, headers, reply = post(server, "/api/image", body)
    assert status in (200, 400, 413) and headers["content-type"] == "application/json"
    assert ("image_id" in reply) if status == 200 else reply["error"]


@pytest.mark.parametrize(
    "body,why",
    [
        (png_declaring(6300, 6300), "the issue's 4.9 KB 6300x6300 PNG"),
        (png_declaring(4001, 4000), "just over the cap"),
        (png_declaring(20000, 20000), "over Pillow's own bomb ceiling"),
        (png_declaring(65535, 65535), "the largest PNG header"),
        (jpeg_declaring(65000, 65000), "JPEG: even at 1/8 scale over the cap"),
        (gif_declaring(65535, 65535), "GIF logical screen"),
    ],
)
def test_huge_declared_sizes_are_refused_before_decoding(images, body, why):
    local = ImageAttention(images.model, images.about)
    with serving(local) as srv:
        start = time.monotonic()
        status, headers, reply = post(srv, "/api/image", body)
    assert_json_error(status, headers, reply, 413)
    assert "limit" in reply["error"], why
    assert local.pixels.peak == 0  # nothing was ever reserved for decoding
    assert time.monotonic() - start < 5


def test_real_sixteen_megapixel_png_is_served(server):
    side = int(MAX_UPLOAD_PIXELS**0.5)  # 4000
    status, _, reply = post(server, "/api/image", png_bytes((side, side), mode="1", colour=1))
    assert status == 200 and reply["original_size"] == [side, side]


def test_big_jpeg_decodes_at_a_reduced_scale(images):
    buf = io.BytesIO()
    Image.new("RGB", (3000, 2000), (10, 120, 200)).save(buf, format="JPEG")
    local = ImageAttention(images.model, images.about)
    reply = local.add_image(buf.getvalue())
    assert reply["original_size"] == [2000, 3000]  # (H, W), as "size" (it gave (W, H))
    assert local.pixels.peak <= (3000 // 8 + 1) * (2000 // 8 + 1)  # decoded at 1/8 scale
    # a phone photo stored sideways (EXIF orientation 6): the size as it is shown, upright (it gave the stored one)
    exif = Image.Exif()
    exif[0x0112] = 6
    for fmt in ("JPEG", "PNG", "WEBP"):  # a PNG's or WebP's was turned for the view, its size not
        buf = io.BytesIO()
        Image.new("RGB", (300, 200), (10, 120, 200)).save(buf, format=fmt, exif=exif)
        assert local.add_image(buf.getvalue())["original_size"] == [300, 200], fmt


@pytest.mark.parametrize(
    "head,status",
    [
        ("Content-Length: 99999999999\r\n", 413),
        ("Content-Length: 999999999999999999999999\r\n", 400),
        ("Content-Length: +5\r\n", 400),
        ("Content-Length: -5\r\n", 400),
        ("Content-Length: 5\r\nContent-Length: 6\r\n", 400),
        ("Transfer-Encoding: chunked\r\n", 501),
        ("", 411),
    ],
)
def test_upload_declared_lengths(server, head, status):
    data = f"POST /api/image HTTP/1.1\r\nHost: {host_of(server)}\r\n{head}\r\n".encode() + b"hello"
    assert_json_error(*raw(server, data), status)


def test_eps_is_not_an_accepted_format(server):
    eps = b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 10 10\nshowpage\n"
    status, _, reply = post(server, "/api/image", eps)
    assert status == 400 and "JPEG" in reply["error"]


def test_body_shorter_than_declared_times_out(images):
    with serving(images, Limits(idle_timeout=0.5)) as srv:
        data = f"POST /api/image HTTP/1.1\r\nHost: {host_of(srv)}\r\nContent-Length: 1000\r\n\r\n".encode() + PNG[:100]
        start = time.monotonic()
        assert_json_error(*raw(srv, data, timeout=10), 408)
        assert time.monotonic() - start < 5


# ------------------------------------------------------------------------------- budgets
def test_budget_waits_then_refuses():
    budget = Budget(10, "pixels")
    with budget.reserve(8, wait=0):
        with pytest.raises(Busy):
            with budget.reserve(5, wait=0.05):
                pass
        with budget.reserve(2, wait=0):
            assert budget.used == 10
    with pytest.raises(TooLarge):
        with budget.reserve(11, wait=0):
            pass
    assert budget.used == 0 and budget.peak == 10


def test_spent_budgets_answer_503(images):
    local = ImageAttention(images.model, images.about, limits=Limits(budget_wait=0.1))
    with serving(local, Limits(budget_wait=0.1)) as srv:
        with srv.bodies.reserve(srv.bodies.total, wait=0):
            status, headers, reply = post(srv, "/api/image", PNG)
        assert_json_error(status, headers, reply, 503)
        assert headers["retry-after"] == "1"
        with local.pixels.reserve(local.pixels.total, wait=0):
            assert_json_error(*post(srv, "/api/image", PNG), 503)
        assert post(srv, "/api/image", PNG)[0] == 200


def test_a_spent_reply_budget_answers_503(images):
    """Attention replies were held in every connection at once until sent: 64 of efficientvit_m0's first block at
    4096 px, 1.3 GB."""
    image_id = images.add_image(PNG)["image_id"]
    with serving(images, Limits(budget_wait=0.1)) as srv:
        with srv.replies.reserve(srv.replies.total - images.reply_bytes(0) + 1, wait=0):
            status, headers, reply = get(srv, f"/api/attention?image={image_id}&block=0")
        assert_json_error(status, headers, reply, 503)
        assert "busy with other replies" in reply["error"] and headers["retry-after"] == "1"
        assert get(srv, f"/api/attention?image={image_id}&block=0")[0] == 200
    assert srv.replies.used == 0


def test_a_request_queued_behind_the_model_answers_503(images):
    """An attention request waited for the model without a bound while another request's maps were computed, until
    the request time limit cut its connection with no reply at all; now it waits ``compute_wait``, then a 503."""
    local = ImageAttention(images.model, images.about, limits=Limits(compute_wait=0.1))
    image_id = local.add_image(PNG)["image_id"]
    with serving(local, Limits(compute_wait=0.1)) as srv:
        with local.computing():
            status, headers, reply = get(srv, f"/api/attention?image={image_id}&block=0")
        assert_json_error(status, headers, reply, 503)
        assert "computing another request's attention maps" in reply["error"] and "retry" in reply["error"]
        assert headers["retry-after"] == "1"
        assert get(srv, f"/api/attention?image={image_id}&block=0")[0] == 200
    assert srv.replies.used == 0


def test_a_client_gone_while_queued_leaves_the_model_free(images):
    """A client that hangs up while its request waits for the model: the request still ends, and gives the model
    and its reply's budget back (the next request is answered, and the model can be held again)."""
    local = ImageAttention(images.model, images.about, limits=Limits(compute_wait=20))
    image_id = local.add_image(PNG)["image_id"]
    target = f"/api/attention?image={image_id}&block=0"
    with serving(local, Limits(compute_wait=20)) as srv:
        with local.computing():
            sock = socket.create_connection(srv.server_address[:2], timeout=10)
            sock.sendall(f"GET {target} HTTP/1.1\r\nHost: {host_of(srv)}\r\n\r\n".encode())
            end = time.monotonic() + 20
            while srv.replies.used == 0 and time.monotonic() < end:  # its handler has reserved its reply: queued
                time.sleep(0.01)
            assert srv.replies.used > 0
            sock.close()
        assert get(srv, target)[0] == 200
        with local.computing():
            pass
    assert srv.replies.used == 0


def test_attention_maps_stay_within_their_budget(monkeypatch):
    """A block's maps were made whole, for all its windows (13 million values, 210 MB, for efficientvit_m0's first
    block at 4096 px; 17 GB with 64x64 windows), and summarised outside the lock, so each request in flight held
    its own. Now a few windows at a time, one request at a time, and the page's numbers are the same."""
    loaded = build_model(img_size=160)  # stage 1: 10x10 tokens, four 7x7 windows (padded)
    whole = ImageAttention(*loaded)
    two_windows = 2 * window_map_bytes(4, 49)
    small = ImageAttention(*loaded, limits=Limits(map_bytes=two_windows))
    held = {"now": 0, "peak": 0}
    plain = image_attention.map_similarity

    def watched(maps):  # the peak: the float64 maps and their normalised copy
        held["now"] += window_map_bytes(maps.shape[0], maps.shape[2]) * maps.shape[1]
        held["peak"] = max(held["peak"], held["now"])
        time.sleep(0.05)  # long enough for other requests to overlap, were they let
        try:
            return plain(maps)
        finally:
            held["now"] -= window_map_bytes(maps.shape[0], maps.shape[2]) * maps.shape[1]

    image_id = small.add_image(PNG)["image_id"]
    assert whole.add_image(PNG)["image_id"] == image_id
    want = [whole.attention(image_id, 0, q) for q in (None, 0, 99)]
    monkeypatch.setattr(image_attention, "map_similarity", watched)
    got = [None] * 6
    threads = [threading.Thread(target=lambda k=k: got.__setitem__(k, small.attention(image_id, 0, (None, 0, 99)[k % 3])))
               for k in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert held["peak"] <= two_windows and held["now"] == 0
    for k, d in enumerate(got):
        ref = want[k % 3]
        assert d["windows"] == ref["windows"] and d["query_window"] == ref["query_window"]
        np.testing.assert_allclose(np.array(d["similarity"]), np.array(ref["similarity"]), atol=1e-12)
        np.testing.assert_allclose(np.array(d["maps"], dtype=float), np.array(ref["maps"], dtype=float), atol=1e-6)


def test_a_model_over_the_memory_budgets_is_refused_at_start():
    loaded = build_model(img_size=160)  # stage 1: four 7x7 windows of 4 heads; 4 x 100 values per reply
    with pytest.raises(ValueError, match=r"^block 0 \(stage 1, 4 heads over 10x10 tokens in 7x7 windows\): one window's "
                       r"attention maps take 153,664 bytes, more than the explorer holds at once \(153,663 bytes\)"):
        ImageAttention(*loaded, limits=Limits(map_bytes=window_map_bytes(4, 49) - 1))
    with pytest.raises(ValueError, match=r"^block 0 .* at 160x160 px\): one reply .* use a smaller --img-size"):
        ImageAttention(*loaded, limits=Limits(reply_bytes=4 * 100 * 80))
    ImageAttention(*loaded, limits=Limits(map_bytes=window_map_bytes(4, 49), reply_bytes=1024**2))


def test_limits_are_checked():
    for bad in [dict(max_connections=0), dict(idle_timeout=0), dict(connection_wait=-1), dict(decoded_pixels=10),
                dict(map_bytes=0), dict(reply_bytes=0), dict(compute_wait=-1), dict(compute_wait=30)]:
        with pytest.raises(ValueError):
            Limits(**bad)


# ------------------------------------------------------------------------------- load
def test_parallel_uploads_and_api_calls_are_all_served(server):
    uploads = [png_bytes((64 + k, 48), colour=(k * 5 % 255, 90, 160)) for k in range(40)]
    calls = [f"/api/cga?heads={(1, 2, 3, 4, 6, 8)[k % 6]}&seed={k}" if k % 3 else "/api/model" for k in range(300)]
    start = threading.Barrier(len(uploads) + len(calls))
    results: list[tuple[str, int]] = []

    def worker(kind, fn):
        start.wait()
        try:
            results.append((kind, fn()[0]))
        except Exception as err:  # a reset or refused connection counts as lost
            results.append((kind, type(err).__name__))

    threads = [threading.Thread(target=worker, args=("upload", lambda b=b: post(server, "/api/image", b))) for b in uploads]
    threads += [threading.Thread(target=worker, args=("api", lambda c=c: get(server, c))) for c in calls]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert time.monotonic() - t0 < 120
    lost = [r for r in results if r[1] != 200]
    assert len(results) == len(threads) and not lost, lost[:10]


def test_idle_connections_do_not_pile_up_threads(images):
    limits = Limits(max_connections=8, connection_wait=0.2, idle_timeout=1.0)
    with serving(images, limits) as srv:
        base = threading.active_count()
        peak, socks = base, []
        for _ in range(2000):
            socks.append(socket.create_connection(srv.server_address[:2], timeout=10))
            peak = max(peak, threading.active_count())
        replies = []
        for sock in socks:  # each is either refused with a 503 or served, then dropped when idle
            sock.settimeout(5)
            replies.append(sock.recv(200))
        assert all(r.startswith(b"HTTP/1.1 503") or r == b"" for r in replies)
        assert sum(r == b"" for r in replies) < 1000  # most were refused at once, not held
        assert peak <= base + limits.max_connections + 1
        deadline = time.monotonic() + 10
        while threading.active_count() > base and time.monotonic() < deadline:
            time.sleep(0.1)
        assert threading.active_count() <= base  # the idle ones were dropped after idle_timeout
        for sock in socks:
            sock.close()
        assert get(srv, "/api/model")[0] == 200  # and the server serves again


def test_idle_keep_alive_connection_is_closed(images):
    with serving(images, Limits(idle_timeout=0.5)) as srv:
        with socket.create_connection(srv.server_address[:2], timeout=10) as sock:
            sock.sendall(f"GET /api/model HTTP/1.1\r\nHost: {host_of(srv)}\r\n\r\n".encode())
            res = http.client.HTTPResponse(sock)
            res.begin()
            res.read()
            assert res.status == 200 and not res.will_close
            start = time.monotonic()
            assert sock.recv(10) == b""  # closed by the server
            assert time.monotonic() - start < 3
        with socket.create_connection(srv.server_address[:2], timeout=10) as sock:  # never sends anything
            start = time.monotonic()
            assert sock.recv(10) == b""
            assert time.monotonic() - start < 3


def test_trickling_client_is_cut_off(images):
    with serving(images, Limits(idle_timeout=1.0, request_timeout=1.0, compute_wait=0.5)) as srv:
        with socket.create_connection(srv.server_address[:2], timeout=10) as sock:
            sock.sendall(f"GET /api/model HTTP/1.1\r\nHost: {host_of(srv)}\r\n".encode())
            start = time.monotonic()
            with pytest.raises(OSError):
                for k in range(40):  # one header every 0.25 s: never idle, never done
                    sock.sendall(f"X-{k}: slow\r\n".encode())
                    time.sleep(0.25)
                    sock.setblocking(False)
                    try:
                        if sock.recv(100) == b"":
                            raise ConnectionResetError("closed by the server")
                    except BlockingIOError:
                        pass
                    finally:
                        sock.setblocking(True)
            assert time.monotonic() - start < 4


def test_client_hang_ups_are_not_logged_as_errors(server, caplog, capfd):
    caplog.set_level(logging.DEBUG, logger="cgavit.explorer")
    request = f"GET /api/cga?heads=8&seed=9 HTTP/1.1\r\nHost: {host_of(server)}\r\n\r\n".encode()
    for _ in range(20):
        sock = socket.create_connection(server.server_address[:2], timeout=10)
        sock.sendall(request)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.close()  # a reset, before the reply
    assert get(server, "/api/model")[0] == 200
    time.sleep(0.3)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert "Traceback" not in capfd.readouterr().err


# ------------------------------------------------------------------------------- Host and Origin
@pytest.mark.parametrize(
    "host,status",
    [
        ("{ip}:{port}", 200),
        ("localhost:{port}", 200),
        ("LOCALHOST:{port}", 200),
        ("[::1]:{port}", 200),
        ("evil.example:{port}", 403),
        ("127.0.0.1.nip.io:{port}", 403),
        ("localhost.:{port}", 403),
        ("{ip}:1", 403),
        ("{ip}", 403),  # no port means 80
        ("{ip}:{port}:1", 400),
        ("{ip}:+{port}", 400),
        ("[::1", 400),
        ("", 400),
    ],
)
def test_host_header(server, host, status):
    value = host.format(ip="127.0.0.1", port=server.server_address[1])
    got = raw(server, f"GET /api/model HTTP/1.1\r\nHost: {value}\r\n\r\n".encode())
    if status == 200:
        assert got[0] == 200
    else:
        assert_json_error(*got, status)


def test_absolute_form_targets_are_served_by_their_host(server):
    """HTTP/1.1 servers must accept a request target in absolute form (RFC 9112, 3.2.2; proxies and some clients send
    it): it was answered 400. Its host stands in for the Host header, which it overrides, and is checked as that is;
    an HTTP/1.1 request still needs a Host header of sound form (3.2)."""
    here = host_of(server)
    origin_form = get(server, "/api/cga?heads=2")
    assert origin_form[0] == 200
    for extra in (f"Host: {here}\r\n", "Host: evil.example\r\n"):
        got = raw(server, f"GET http://{here}/api/cga?heads=2 HTTP/1.1\r\n{extra}\r\n".encode())
        assert got[0] == 200 and got[2] == origin_form[2]
    for version, extra, status in (("HTTP/1.1", "", 400), ("HTTP/1.1", "Host: a b c\r\n", 400), ("HTTP/1.0", "", 200)):
        got = raw(server, f"GET http://{here}/api/model {version}\r\n{extra}\r\n".encode())  # Host: there and sound
        assert got[0] == status, (version, extra, got)
    assert raw(server, f"GET HTTP://{here} HTTP/1.1\r\nHost: {here}\r\n\r\n".encode())[0] == 200  # the page: "/"
    for target, status in ((f"http://evil.example:{server.server_address[1]}/", 403), (f"http://me@{here}/", 400),
                           ("http:///api/cga", 400), ("http://[::1/api/cga", 400)):
        assert_json_error(*raw(server, f"GET {target} HTTP/1.1\r\nHost: {here}\r\n\r\n".encode()), status)


def test_host_header_required_and_single(server):
    assert_json_error(*raw(server, b"GET /api/model HTTP/1.1\r\n\r\n"), 400)
    twice = f"GET /api/model HTTP/1.1\r\nHost: {host_of(server)}\r\nHost: {host_of(server)}\r\n\r\n"
    assert_json_error(*raw(server, twice.encode()), 400)
    assert raw(server, b"GET /api/model HTTP/1.0\r\n\r\n")[0] == 200  # an HTTP/1.0 tool, not a browser


@pytest.mark.parametrize(
    "origin,status",
    [
        ("http://{host}", 200),
        ("http://localhost:{port}", 200),
        ("http://evil.example", 403),
        ("http://evil.example:{port}", 403),
        ("https://{host}", 403),
        ("null", 403),
        ("http://{host}.evil.example", 403),
        ("http://127.0.0.1:1", 403),
        ("", 403),
    ],
)
def test_origin_header(server, origin, status):
    value = origin.format(host=host_of(server), port=server.server_address[1])
    got = get(server, "/api/model", f"Origin: {value}\r\n")
    assert got[0] == status
    if status == 403:
        assert "cross-origin" in got[2]["error"]
        assert_json_error(*post(server, "/api/image", PNG, f"Origin: {value}\r\n"), 403)  # no cross-site upload


def test_allowed_and_wildcard_hosts(images):
    with serving(images, allow_hosts=("mybox.lan",)) as srv:
        port = srv.server_address[1]
        assert raw(srv, f"GET /api/model HTTP/1.1\r\nHost: mybox.lan:{port}\r\n\r\n".encode())[0] == 200
        assert raw(srv, f"GET /api/model HTTP/1.1\r\nHost: other.lan:{port}\r\n\r\n".encode())[0] == 403
    check = HostCheck.for_address("0.0.0.0", 8765)
    check.check_host("192.168.1.20:8765", "HTTP/1.1")  # any IP address: it cannot be rebound
    check.check_origin("http://192.168.1.20:8765", "192.168.1.20:8765")
    for origin in ("http://8.8.8.8:8765", "http://[2001:db8::1]:8765"):  # a page elsewhere: any IP was accepted
        with pytest.raises(Refused):
            check.check_origin(origin, "192.168.1.20:8765")
        with pytest.raises(Refused):
            check.check_origin(origin)
    with pytest.raises(Refused):
        check.check_host("attacker.example:8765", "HTTP/1.1")


@FUZZ
@given(value=st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7E), max_size=40))
def test_any_host_header(server, value):
    status, headers, body = raw(server, b"GET /api/model HTTP/1.1\r\nHost: " + value.encode("latin-1") + b"\r\n\r\n")
    assert status in (200, 400, 403) and headers["content-type"] == "application/json"
    try:
        name, port = split_host(value)
    except ValueError:
        assert status == 400
        return
    try:
        local = ipaddress.ip_address(name).is_loopback
    except ValueError:
        local = name == "localhost"
    assert (status == 200) == (local and port == server.server_address[1])


# ------------------------------------------------------------------------------- JSON for every error
@pytest.mark.parametrize(
    "request_bytes,status",
    [
        (b"GET / HTTP/9.9x\r\n\r\n", 400),
        (b"GET /a b c HTTP/1.1\r\n\r\n", 400),
        (b"GET http://evil.example/ HTTP/1.1\r\nHost: {host}\r\n\r\n", 403),  # absolute form: its host counts
        (b"GET https://{host}/ HTTP/1.1\r\nHost: {host}\r\n\r\n", 400),
        (b"GET ftp://{host}/ HTTP/1.1\r\nHost: {host}\r\n\r\n", 400),
        (b"GET evil HTTP/1.1\r\nHost: {host}\r\n\r\n", 400),
        (b"GET /api/model HTTP/1.1\r\nHost: evil.example\r\n\r\n", 403),
        (b"GET /nothing HTTP/1.1\r\nHost: {host}\r\n\r\n", 404),
        (b"GET /api/image HTTP/1.1\r\nHost: {host}\r\n\r\n", 405),
        (b"DELETE /api/cga HTTP/1.1\r\nHost: {host}\r\n\r\n", 501),
        (b"BREW / HTTP/1.1\r\nHost: {host}\r\n\r\n", 501),
        (b"GET /" + b"a" * 70000 + b" HTTP/1.1\r\n\r\n", 414),
        (b"GET / HTTP/1.1\r\nHost: {host}\r\nX: " + b"a" * 70000 + b"\r\n\r\n", 431),
        (b"GET / HTTP/1.1\r\nHost: {host}\r\n" + b"".join(b"X%d: 1\r\n" % i for i in range(120)) + b"\r\n", 431),
        (b"HEAD /nothing HTTP/1.1\r\nHost: {host}\r\n\r\n", 404),
    ],
)
def test_every_error_is_json(server, request_bytes, status):
    data = request_bytes.replace(b"{host}", host_of(server).encode())
    got_status, headers, body = raw(server, data)
    assert got_status == status and headers["content-type"] == "application/json"
    if not data.startswith(b"HEAD"):
        assert body["error"]
    if status == 405:
        assert headers["allow"] == "POST"


def test_internal_errors_are_json_500(images, monkeypatch, caplog):
    with serving(images) as srv:
        monkeypatch.setattr(srv.toy, "run", lambda *a: 1 / 0)
        with caplog.at_level(logging.ERROR, logger="cgavit.explorer"):
            assert_json_error(*get(srv, "/api/cga"), 500)
        assert any("ZeroDivisionError" in (r.exc_text or "") for r in caplog.records)


@pytest.mark.parametrize("request_bytes", [
    b"GET /\x1b[2J\x1b]0;owned\x07 HTTP/1.1\r\nHost: HOST\r\n\r\n",  # clear the screen, set the title
    b"GET /api/\xe2\x80\xaeevil\r HTTP/1.1\r\nHost: HOST\r\n\r\n",  # U+202E as UTF-8 (C1 bytes as Latin-1), CR
    b"\x1b[31mGET / HTTP/1.1\r\nHost: HOST\r\n\r\n",
    b"GET /\x9b31m HTTP/1.1\r\nHost: \x1b[31mevil\r\n\r\n",  # the one-byte CSI
])
def test_request_lines_reach_the_log_escaped(images, request_bytes, caplog):
    """The log (a terminal with `cgavit explore -v`) got the client's request line raw: escape sequences."""
    with serving(images) as srv, caplog.at_level(logging.DEBUG, logger="cgavit.explorer"):
        status, _, _ = raw(srv, request_bytes.replace(b"HOST", host_of(srv).encode()))
    assert status >= 400
    lines = [r.getMessage() for r in caplog.records]
    assert lines and all(line.isprintable() for line in lines), lines
    assert any("\\x1b" in line or "\\x9b" in line or "\\x80" in line for line in lines), lines


def test_internal_errors_log_the_target_escaped(images, monkeypatch, caplog):
    with serving(images) as srv:
        monkeypatch.setattr(srv.toy, "run", lambda *a: 1 / 0)
        with caplog.at_level(logging.ERROR, logger="cgavit.explorer"):
            assert_json_error(*get(srv, "/api/cga?\x1b[2J"), 400)  # the query is refused before the toy runs
            assert_json_error(*get(srv, "/api/cga#\x1b]0;x\x07"), 500)
    assert caplog.records and all(r.getMessage().isprintable() for r in caplog.records)


# ------------------------------------------------------------------------------- startup
def checkpoints(tmp: Path) -> dict[str, Path]:
    """Hostile checkpoint files by name: empty, corrupt, cut short, bad metadata, folder, FIFO, missing."""
    good = save_weights(create_model("m0", num_classes=10), tmp / "good.safetensors")
    files = {"zero": tmp / "zero.pth", "corrupt": tmp / "corrupt.pth", "truncated": tmp / "cut.safetensors"}
    files["zero"].write_bytes(b"")
    files["corrupt"].write_bytes(os.urandom(3000))
    files["truncated"].write_bytes(good.read_bytes()[:5000])
    for name, meta in {
        "interpolation": {"interpolation": "sideways"},
        "num_classes": {"num_classes": "2000000"},
        "config": {"config": json.dumps({"embed_dim": [64, 128, 192], "depth": [1, 2, 3], "num_heads": [4, 4, 4], "checkpoint_path": "/etc/passwd"})},
    }.items():  # written past save_weights, which records the network's own config and class count over a record's
        files[name] = tmp / f"{name}.safetensors"
        save_file(load_file(good), files[name], metadata={**read_metadata(good), **meta})
    files["folder"] = tmp / "folder"
    files["folder"].mkdir()
    files["fifo"] = tmp / "fifo.pth"
    os.mkfifo(files["fifo"])
    files["missing"] = tmp / "missing.pth"
    return files


@pytest.mark.timeout(120)
def test_bad_checkpoints_fail_at_startup_in_one_line(tmp_path, monkeypatch, capsys):
    def never(*args, **kwargs):
        raise AssertionError("a bad input got as far as building a model or a server")

    monkeypatch.setattr(explore_command, "make_server", never)  # so no case can start serving
    files = checkpoints(tmp_path)
    for name, path in files.items():
        with monkeypatch.context() as m:
            if name in ("num_classes", "config"):
                m.setattr(loading, "EfficientViT", never)  # refused before any allocation
            start = time.monotonic()
            assert cli.main(["explore", "--port", "0", "--checkpoint", str(path)]) == 2, name
            assert time.monotonic() - start < 20, name
        err = capsys.readouterr().err
        assert err.startswith("cgavit explore: error:") and err.count("\n") == 1, (name, err)
        assert "Traceback" not in err and path.name in err, (name, err)
    assert stat.S_ISFIFO(os.stat(files["fifo"]).st_mode)


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["--img-size", "100000"], "--img-size"),
        (["--img-size", "0"], "--img-size"),
        (["--img-size", "-5"], "--img-size"),
        (["--port", "70000"], "--port"),
        (["--allow-host", "box.lan:80"], "--allow-host"),
        (["--allow-host", "a b"], "malformed host"),
        (["--host", "192.0.2.1"], "give --host an address of this machine"),  # a documentation address
        (["--host", "999.1.1.1"], "give --host an address of this machine"),  # it said: choose another --port
        (["--host", "localhost:8080"], "--host takes an address without a port"),  # it said: give an address of this machine
        (["--host", "[::1]:8080"], "--host takes an address without a port"),
        # one 48x48 window of 16 heads: 1.3 GiB of maps, over the 1 GiB bound (it started, and each request held them)
        (["--img-size", "768", "--window-size", "48", "--num-heads", "16"], "one window's attention maps take 1,296.0 MiB"),
    ],
)
@pytest.mark.timeout(60)
def test_bad_options_fail_in_one_line(argv, needle, capsys):
    start = time.monotonic()
    assert cli.main(["explore", "--port", "0", *argv]) == 2
    err = capsys.readouterr().err
    assert needle in err and err.count("\n") == 1 and "Traceback" not in err
    assert time.monotonic() - start < 30


# ------------------------------------------------------------------------------- memory
SERVE = """
from cgavit.explorer import ImageAttention, build_model, make_server
srv = make_server("127.0.0.1", 0, ImageAttention(*build_model()))
print(srv.server_address[1], flush=True)
srv.serve_forever()
"""


def peak_rss_mb(pid: int) -> float:
    text = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"VmHWM:\s+(\d+) kB", text).group(1)) / 1024


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs Linux /proc")
def test_parallel_big_uploads_stay_within_the_pixel_budget():
    """40 parallel uploads of the issue's 6300x6300 PNG, then 12 of a 15-megapixel one, in a fresh server:
    the peak memory grows by about two decodes (the budget), not twelve."""
    big = png_bytes((3900, 3900), mode="1", colour=1)  # 15.2 megapixels, a few KB
    bomb = png_bytes((6300, 6300), mode="1", colour=1)
    proc = subprocess.Popen([sys.executable, "-c", SERVE], stdout=subprocess.PIPE, text=True)
    try:
        port = int(proc.stdout.readline())
        srv = type("Addr", (), {"server_address": ("127.0.0.1", port)})()
        assert get(srv, "/api/model")[0] == 200
        before = peak_rss_mb(proc.pid)
        results = []

        def send(body):
            results.append(post(srv, "/api/image", body)[0])

        for bodies in ([bomb] * 40, [big] * 12):
            threads = [threading.Thread(target=send, args=(b,)) for b in bodies]
            for t in threads:
                t.start()
            for t in threads:
                t.join(timeout=120)
        grown = peak_rss_mb(proc.pid) - before
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    assert results[:40] == [413] * 40
    assert set(results[40:]) <= {200, 503} and results[40:].count(200) >= 2, results
    assert grown < 2 * MAX_UPLOAD_PIXELS * 8 / 2**20 + 60, f"peak memory grew by {grown:.0f} MB"


PREPARE = """
import io, re, threading
from PIL import Image
from cgavit.explorer import ImageAttention, Limits, build_model
images = ImageAttention(*build_model(img_size=1024), limits=Limits(cached_bytes=0))
bodies = []
for k in range(16):
    buf = io.BytesIO()
    Image.new("RGB", (640 + k, 480), (40, 90, 160)).save(buf, format="PNG")
    bodies.append(buf.getvalue())
images.add_image(bodies.pop())
before = int(re.search(r"VmHWM:\\s+(\\d+) kB", open("/proc/self/status").read()).group(1))
threads = [threading.Thread(target=images.add_image, args=(body,)) for body in bodies]
for t in threads:
    t.start()
for t in threads:
    t.join()
print((int(re.search(r"VmHWM:\\s+(\\d+) kB", open("/proc/self/status").read()).group(1)) - before) / 1024)
"""


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs Linux /proc")
def test_parallel_uploads_are_made_model_inputs_by_the_decoding_threads():
    """15 parallel uploads at --img-size 1024: each was made the model's input (float32, 36 bytes per model pixel
    at the peak) in its connection's thread, all at once. The two decoding threads make them now, in place (about
    15 bytes per pixel), and the peak grows by what two of them take, not fifteen."""
    out = subprocess.run([sys.executable, "-c", PREPARE], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    grown = float(out.stdout)
    assert grown < 2 * 15 * 1024**2 / 2**20 + 60, f"peak memory grew by {grown:.0f} MB"


def test_the_preview_is_what_the_page_draws():
    """The preview was the model's view at its full size: at 4096 px a photograph's took 48 MB of JSON and 7 s,
    for a page that draws it at 224 px."""
    reply = ImageAttention(*build_model(img_size=1024)).add_image(png_bytes((800, 600)))
    preview = Image.open(io.BytesIO(base64.b64decode(reply["preview"].removeprefix("data:image/png;base64,"))))
    assert preview.size == (MAX_PREVIEW_SIDE, MAX_PREVIEW_SIDE) and reply["size"] == [1024, 1024]


def test_upload_limit_constant_is_what_the_page_reports(server):
    status, _, info = get(server, "/api/model")
    assert info["max_upload_bytes"] == MAX_UPLOAD_BYTES and info["max_image_pixels"] == MAX_UPLOAD_PIXELS


def test_a_port_in_use_says_to_choose_another(capsys):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        assert cli.main(["explore", "--port", str(taken.getsockname()[1])]) == 2
    assert "choose another --port" in capsys.readouterr().err


def test_host_may_be_an_ipv6_address_in_brackets(monkeypatch):
    """`--host [::1]`, as the page's own address is written, was refused: "cannot listen on [::1]:0 (Name or
    service not known); give --host an address of this machine"."""
    if not socket.has_ipv6:
        pytest.skip("no IPv6")
    served = []
    monkeypatch.setattr(ExplorerServer, "serve_forever", lambda self, poll_interval=0.5: served.append(self.url))
    assert cli.main(["explore", "--port", "0", "--img-size", "64", "--host", "[::1]"]) == 0
    assert served and served[0].startswith("http://[::1]:")


def test_every_interface_prints_the_page_at_the_loopback_address(monkeypatch, capsys):
    """Behind --host 0.0.0.0 the page's address was printed as http://0.0.0.0:PORT/, which names no host (browsers
    refuse or stall on it); it is the loopback address, beside the warning that other machines can reach it."""
    served = []
    monkeypatch.setattr(ExplorerServer, "serve_forever", lambda self, poll_interval=0.5: served.append(self.url))
    assert cli.main(["explore", "--port", "0", "--img-size", "64", "--host", "0.0.0.0"]) == 0
    out = capsys.readouterr().out
    assert served[0].startswith("http://127.0.0.1:") and f"CGA Explorer: {served[0]}" in out, out
    assert "reachable from other machines" in out


def test_a_second_server_on_the_same_port_is_refused(images, monkeypatch):
    """Where the standard library's HTTPServer sets SO_REUSEPORT (Python 3.14.0a2, cpython#127319), a second explorer
    on a port in use bound as well, and the kernel dealt requests out between the two servers, each with its own
    model and uploads."""
    monkeypatch.setattr(http.server.HTTPServer, "allow_reuse_port", True, raising=False)
    first = ExplorerServer(("127.0.0.1", 0), images)
    try:
        with pytest.raises(OSError):
            ExplorerServer(("127.0.0.1", first.server_address[1]), images).server_close()
    finally:
        first.server_close()
