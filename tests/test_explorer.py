"""CGA Explorer: the JSON API's numbers, validation, static-file safety and uploads (no browser)."""

from __future__ import annotations

import contextlib
import http.client
import io
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from cgavit.analysis import head_similarity, map_similarity, mean_off_diagonal
from cgavit.attention import CascadedGroupAttention
from cgavit.explorer import ImageAttention, ToyCGA, build_model
from cgavit.explorer.limits import MAX_UPLOAD_BYTES
from cgavit.explorer.server import STATIC_DIR, ExplorerServer
from cgavit.testing import randomize_


@pytest.fixture(scope="module")
def server():
    srv = ExplorerServer(("127.0.0.1", 0), ImageAttention(*build_model()))
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    yield srv
    srv.shutdown()
    srv.server_close()


def request(srv, method, path, body=None, headers=None):
    """Send ``path`` exactly as written (no client-side normalisation of ``..``)."""
    conn = http.client.HTTPConnection(*srv.server_address[:2], timeout=30)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        res = conn.getresponse()
        data = res.read()
        return res.status, dict(res.getheaders()), data
    finally:
        conn.close()


def get_json(srv, path, method="GET", body=None):
    status, headers, data = request(srv, method, path, body)
    assert headers["Content-Type"] == "application/json"
    return status, json.loads(data)


def png_bytes(size=(96, 64)) -> bytes:
    from PIL import Image, ImageDraw

    img = Image.new("RGB", size, (40, 90, 160))
    ImageDraw.Draw(img).ellipse((10, 8, 60, 56), fill=(240, 200, 30))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


# ------------------------------------------------------------------------------- six tokens
def direct_maps(heads, cascade, groups, seed):
    """The same setting built here, independently of the server: the module's own maps."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        attn = CascadedGroupAttention(24, key_dim=8, num_heads=heads, window=3, cascade=cascade, group_split=groups)
    randomize_(attn, seed).eval()
    x = torch.randn(1, 24, 2, 3, generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        return torch.stack([m[0] for m in attn.head_attention_maps(x)]).double().numpy()


@pytest.mark.parametrize("heads,cascade,groups,seed", [(4, 1, 1, 0), (8, 1, 1, 3), (3, 0, 1, 7), (6, 0, 0, 11), (1, 1, 1, 2)])
def test_cga_matches_module(server, heads, cascade, groups, seed):
    status, d = get_json(server, f"/api/cga?heads={heads}&cascade={cascade}&groups={groups}&seed={seed}")
    assert status == 200
    maps = np.array(d["maps"])
    assert maps.shape == (heads, 6, 6)
    np.testing.assert_allclose(maps.sum(-1), 1.0, atol=1e-5)
    np.testing.assert_allclose(maps, direct_maps(heads, bool(cascade), bool(groups), seed), rtol=0, atol=1e-7)
    flat = maps.reshape(heads, -1)
    flat = flat / np.linalg.norm(flat, axis=1, keepdims=True)
    sim = np.array(d["similarity"])
    np.testing.assert_allclose(sim, flat @ flat.T, atol=1e-6)
    np.testing.assert_allclose(np.diag(sim), 1.0, atol=1e-9)
    off = sim[~np.eye(heads, dtype=bool)]
    assert (d["mean_similarity"] is None) if heads == 1 else d["mean_similarity"] == pytest.approx(off.mean())
    width = 24 // heads if groups else 24
    assert [(s["start"], s["stop"]) for s in d["slices"]] == [
        (j * width, (j + 1) * width) if groups else (0, 24) for j in range(heads)
    ]
    assert [s["reads_previous"] for s in d["slices"]] == [bool(cascade) and j > 0 for j in range(heads)]


def test_cascade_toggle_keeps_weights(server):
    """Same seed, cascade on vs off: head 1 (fed by no one) is unchanged, head 2 is not."""
    _, on = get_json(server, "/api/cga?heads=4&cascade=1&groups=1&seed=5")
    _, off = get_json(server, "/api/cga?heads=4&cascade=0&groups=1&seed=5")
    _, other = get_json(server, "/api/cga?heads=4&cascade=1&groups=1&seed=6")
    assert on["maps"][0] == off["maps"][0]
    assert not np.allclose(on["maps"][1], off["maps"][1], atol=1e-3)
    assert not np.allclose(on["maps"][0], other["maps"][0], atol=1e-3)


def test_cga_defaults(server):
    status, d = get_json(server, "/api/cga")
    assert status == 200 and (d["heads"], d["cascade"], d["groups"], d["seed"]) == (4, True, True, 0)
    assert d["grid"] == [2, 3] and d["window"] == 3 and d["channels"] == 24


@pytest.mark.parametrize(
    "query,needle",
    [
        ("heads=5", "heads must be one of"),
        ("heads=0", "heads must be in"),
        ("heads=four", "integer"),
        ("cascade=2", "cascade must be 0 or 1"),
        ("cascade=1&groups=0", "needs groups=1"),
        ("seed=-1", "seed must be in"),
        ("seed=1.5", "integer"),
        ("heads=4&heads=2", "given 2 times"),
        ("colour=red", "unknown parameter"),
    ],
)
def test_cga_bad_parameters(server, query, needle):
    status, d = get_json(server, f"/api/cga?{query}")
    assert status == 400
    assert needle in d["error"]


# ------------------------------------------------------------------------------- static files
@pytest.mark.parametrize(
    "path,kind",
    [("/", "text/html"), ("/static/index.html", "text/html"), ("/static/explorer.js", "text/javascript"), ("/static/explorer.css", "text/css")],
)
def test_static_files(server, path, kind):
    status, headers, body = request(server, "GET", path)
    assert status == 200 and headers["Content-Type"].startswith(kind) and body
    assert "default-src 'self'" in headers["Content-Security-Policy"]
    assert headers["X-Content-Type-Options"] == "nosniff"


@pytest.mark.parametrize(
    "path,status",
    [
        ("/static/../compute.py", 403),
        ("/static/%2e%2e/server.py", 403),
        ("/static/..%2f..%2fcli.py", 403),
        ("/static/%2e%2e%2f%2e%2e%2f%2e%2e%2fpyproject.toml", 403),
        ("/static//etc/passwd", 403),
        ("/static/missing.js", 404),
        ("/static/", 404),
        ("/compute.py", 404),
        ("/api/nothing", 404),
    ],
)
def test_no_files_outside_the_page(server, path, status):
    got, headers, body = request(server, "GET", path)
    assert got == status
    assert b"import" not in body and b"root:" not in body
    assert "error" in json.loads(body)


def test_page_loads_nothing_from_elsewhere():
    """Every URL in the page's files is the server's own (the SVG namespace is a name, not a fetch)."""
    for path in STATIC_DIR.iterdir():
        text = path.read_text()
        urls = set(re.findall(r"(?:https?:)?//[\w.-]+\.[a-z]{2,}[^\s\"')]*", text))
        assert urls <= {"http://www.w3.org/2000/svg"}, (path.name, urls)


# ------------------------------------------------------------------------------- uploads
def test_oversized_upload_413(server):
    status, d = get_json(server, "/api/image", "POST", b"\0" * (MAX_UPLOAD_BYTES + 1))
    assert status == 413 and "limit" in d["error"]
    assert f"is {MAX_UPLOAD_BYTES + 1:,} bytes" in d["error"]  # one byte over read "5.0 MB; the limit is 5 MB"


@pytest.mark.parametrize("body", [b"hello, not an image", png_bytes()[:60], b""])
def test_non_image_upload_400(server, body):
    status, d = get_json(server, "/api/image", "POST", body)
    assert status == 400 and d["error"]


@pytest.mark.parametrize("content_type", ["multipart/form-data; boundary=XyZ", "Multipart/Mixed; boundary=XyZ",
                                          "application/x-www-form-urlencoded"])
def test_a_form_upload_says_to_send_the_file_itself(server, content_type):
    """`curl -F file=@photo.png .../api/image`, the usual way to post a file, was told "cannot identify an image
    format in it" of a PNG: the body was the form wrapping it."""
    form = b"--XyZ\r\nContent-Disposition: form-data; name=file; filename=a.png\r\n\r\n" + png_bytes() + b"\r\n--XyZ--\r\n"
    status, headers, data = request(server, "POST", "/api/image", form, {"Content-Type": content_type})
    assert status == 415 and headers["Content-Type"] == "application/json"
    assert json.loads(data)["error"] == ("send the image file itself as the request body (curl --data-binary @FILE), "
                                         "not a form (curl -F)")
    status, _, data = request(server, "POST", "/api/image", png_bytes(), {"Content-Type": "image/png"})
    assert status == 200 and json.loads(data)["size"] == [224, 224]


def test_upload_needs_length(server):
    conn = http.client.HTTPConnection(*server.server_address[:2], timeout=30)
    conn.putrequest("POST", "/api/image")
    conn.endheaders()
    res = conn.getresponse()
    assert res.status == 411
    conn.close()


def test_image_attention(server):
    status, up = get_json(server, "/api/image", "POST", png_bytes())
    assert status == 200 and up["preview"].startswith("data:image/png;base64,")
    image_id = up["image_id"]
    images = server.images
    info = images.info()
    assert [b["grid"] for b in info["blocks"]] == [[14, 14], [7, 7], [7, 7], [4, 4], [4, 4], [4, 4]]

    # stage 1 (14x14, four 7x7 windows): query token (9, 3) lives in the bottom-left window
    status, d = get_json(server, f"/api/attention?image={image_id}&block=0&query={9 * 14 + 3}")
    assert status == 200 and d["query_window"] == [7, 0, 7, 7]
    grid = np.array([[[np.nan if v is None else v for v in row] for row in head] for head in d["maps"]])
    assert np.isnan(grid[:, :7, :]).all() and np.isnan(grid[:, :, 7:]).all()
    np.testing.assert_allclose(np.nansum(grid, axis=(1, 2)), 1.0, atol=1e-5)
    # independently: the block's input, its bottom-left window cut by hand, through the block's attention
    lwa = images.model.stages[0].blocks[0].mixer.m
    seen = {}
    hook = lwa.register_forward_pre_hook(lambda _, a: seen.setdefault("x", a[0]))
    with torch.no_grad():
        images.model.forward_features(images.image(image_id))
        hook.remove()
        maps = lwa.attn.head_attention_maps(seen["x"][:, :, 7:14, 0:7])
    want = np.stack([m[0, (9 - 7) * 7 + 3].double().numpy().reshape(7, 7) for m in maps])
    np.testing.assert_allclose(grid[:, 7:14, 0:7], want, atol=1e-6)
    sim = np.array(d["similarity"])
    np.testing.assert_allclose(np.diag(sim), 1.0, atol=1e-9)
    np.testing.assert_allclose(sim, sim.T, atol=1e-12)

    # mean over queries: every token has a value, each window's values sum to 1
    _, m = get_json(server, f"/api/attention?image={image_id}&block=0&query=mean")
    mg = np.array(m["maps"])
    assert mg.shape == (4, 14, 14)
    for y0, x0, h, w in m["windows"]:
        np.testing.assert_allclose(mg[:, y0 : y0 + h, x0 : x0 + w].sum(axis=(1, 2)), 1.0, atol=1e-5)

    for query, block, status in [("0", "6", 400), ("16", "3", 400), ("x", "0", 400), ("0", "-1", 400)]:
        got, err = get_json(server, f"/api/attention?image={image_id}&block={block}&query={query}")
        assert got == status and err["error"]
    got, err = get_json(server, "/api/attention?image=0123456789abcdef&block=0")
    assert got == 404 and "upload it again" in err["error"]


# ------------------------------------------------------------------------------- model and command
def test_checkpoint_model(tmp_path):
    from cgavit import create_model, save_weights
    from cgavit.io import CheckpointError

    src = randomize_(create_model("m0", num_classes=10, cascade=False, img_size=96), 3)
    path = save_weights(src, tmp_path / "m0.safetensors")
    model, about, info = build_model(path)
    assert "m0.safetensors" in about and model.num_classes == 10 and model.cfg.cascade is False
    assert about.endswith("loaded into efficientvit_m0 with dials of its own (cascade False).")  # save_weights names it
    assert info.img_size == 96 and info.mean == (0.485, 0.456, 0.406)
    assert tuple(model.img_size) == (96, 96)  # the size it was built for, not 224
    for key, value in src.state_dict().items():
        assert torch.equal(model.state_dict()[key], value), key
    assert tuple(build_model(path, img_size=128)[0].img_size) == (128, 128)
    bad = tmp_path / "bad.pth"
    bad.write_bytes(b"not a checkpoint")
    with pytest.raises(CheckpointError):
        build_model(bad)
    with pytest.raises(ValueError, match="records its own architecture"):
        build_model(path, cascade=True)



def test_a_trained_checkpoint_sees_uploads_as_it_was_trained(trained_digits):
    """The image panel feeds a checkpoint as `cgavit predict` does: its recorded mean, std and interpolation.
    It used ImageNet's for every model, so the digits model (mean 0.3, std 0.4) was shown maps of an input it
    never saw, and read a held-out 3 as a 1."""
    from cgavit.images import load_image
    from cgavit.train.data import build_transform

    loaded = build_model(trained_digits.checkpoint)
    images, info = ImageAttention(*loaded), loaded.info
    assert info.mean != (0.485, 0.456, 0.406)  # the test means something only for a model fed otherwise
    transform = build_transform(info.img_size, False, interpolation=info.interpolation, crop_pct=info.crop_pct,
                                mean=info.mean, std=info.std)
    files = sorted((trained_digits.data / "val").glob("*/*"))[::12]
    assert len(files) >= 20
    for path in files:
        shown = images.image(images.add_image(path.read_bytes())["image_id"])
        torch.testing.assert_close(shown, transform(load_image(path))[None], atol=1e-5, rtol=0)

def test_a_checkpoint_of_other_input_channels_is_refused_at_start(tmp_path):
    """A 1-channel model started, then answered every attention request with a 400 blaming the image."""
    from cgavit import create_model, save_weights

    path = save_weights(create_model("m0", num_classes=10, img_size=64, in_chans=1).eval(), tmp_path / "grey.safetensors")
    with pytest.raises(ValueError, match="grey.safetensors is a model of 1 input channel; .* 3-channel models only"):
        build_model(path)


def test_the_random_model_names_the_dials_it_was_built_with():
    """`cgavit explore --cascade off` said "a randomly initialised efficientvit_m0": the page showed maps of a model
    without the cascade under the name of one with it."""
    about = build_model(None, "m0", 64, cascade=False, num_heads=(2, 2, 2)).about
    assert about.startswith("a randomly initialised efficientvit_m0 with dials of its own (num_heads 2,2,2, cascade False) ")
    assert build_model(None, "m1", 64).about.startswith("a randomly initialised efficientvit_m1 (")


def test_the_random_model_is_the_same_at_every_start():
    """Only its BatchNorm statistics and bias tables were seeded: each start drew other weights, other maps."""
    before = torch.get_rng_state()
    first, second = (build_model(None, None, 64).model.state_dict() for _ in range(2))
    assert all(torch.equal(first[k], second[k]) for k in first)
    assert torch.equal(torch.get_rng_state(), before)  # the caller's generator is left as it was


def test_non_finite_attention_is_a_server_error_said_as_such():
    """A checkpoint whose weights overflow gave 400 'Out of range float values are not JSON compliant' (the
    request blamed), and nothing in the log."""
    model = build_model(None, None, 64).model
    with torch.no_grad():
        model.patch_embed.conv1.conv.weight.mul_(1e30)
    srv = ExplorerServer(("127.0.0.1", 0), ImageAttention(model, "overflowing"))
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    try:
        status, up = get_json(srv, "/api/image", "POST", png_bytes())
        assert status == 200
        status, reply = get_json(srv, f"/api/attention?image={up['image_id']}&block=0")
        assert status == 500 and "not finite (NaN or inf)" in reply["error"]
    finally:
        srv.shutdown()
        srv.server_close()


def test_the_upload_cache_is_bounded_in_bytes():
    """Eight images were kept whatever their size: at --img-size 4096, 1.6 GB."""
    from cgavit.explorer.limits import Limits

    loaded = build_model(None, None, 64)
    one = 3 * 64 * 64 * 4
    for cached, kept in ((2 * one, 2), (0, 1), (100 * one, 8)):
        images = ImageAttention(*loaded, limits=Limits(cached_bytes=cached))
        ids = [images.add_image(png_bytes((96 + i, 64)))["image_id"] for i in range(10)]
        assert [images.has_image(i) for i in ids] == [False] * (10 - kept) + [True] * kept


def test_loopback_addresses_are_local():
    """`--host 127.0.0.2` warned it was reachable from other machines."""
    from cgavit.explorer.guard import is_loopback

    assert all(map(is_loopback, ("127.0.0.1", "127.0.0.2", "localhost", "LocalHost", "::1", "[::1]")))
    assert not any(map(is_loopback, ("0.0.0.0", "", "::", "192.168.1.2", "example.org")))


def test_random_model_says_so(server):
    status, info = get_json(server, "/api/model")
    assert status == 200 and "randomly initialised efficientvit_m0" in info["about"]
    assert info["max_upload_bytes"] == MAX_UPLOAD_BYTES


def test_command_serves_on_localhost():
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(
        [sys.executable, "-m", "cgavit", "explore", "--port", "0"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
    )
    try:
        line = proc.stdout.readline()
        match = re.search(r"http://127\.0\.0\.1:(\d+)/", line)
        assert match, line
        conn = http.client.HTTPConnection("127.0.0.1", int(match.group(1)), timeout=30)
        conn.request("GET", "/api/cga?heads=2")
        res = conn.getresponse()
        assert res.status == 200 and len(json.loads(res.read())["maps"]) == 2
        conn.close()
    finally:
        proc.terminate()
        proc.wait(timeout=30)


SLOW_ATTENTION = """
import sys, torch
from cgavit.explorer import image_attention
plain = image_attention.ImageAttention.attention
def slow(self, *args, **kwargs):  # a second inside torch's own code, with the GIL let go in each product
    print("computing", flush=True)
    x = torch.randn(384, 384)
    for _ in range(400):
        x = torch.tanh(x @ x)
    return plain(self, *args, **kwargs)
image_attention.ImageAttention.attention = slow
from cgavit.cli import main
sys.exit(main(["explore", "--port", "0"]))
"""


def test_ctrl_c_while_a_request_computes_exits_cleanly():
    """Ctrl-C while a handler thread is inside torch: the server waits for it, and the process ends with
    status 0. (It used to exit with the thread still there and abort: "terminate called without an active
    exception", SIGABRT.)"""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, "-c", SLOW_ATTENTION], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=env, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    lines = []
    try:
        while not (match := re.search(r"http://127\.0\.0\.1:(\d+)/", line := proc.stdout.readline())):
            assert line, "".join(lines)
            lines.append(line)
        srv = SimpleNamespace(server_address=("127.0.0.1", int(match.group(1))))
        status, reply = get_json(srv, "/api/image", "POST", png_bytes())
        assert status == 200, reply
        def ask():  # its reply never comes: the server is stopped while it computes
            with contextlib.suppress(OSError, http.client.HTTPException):
                request(srv, "GET", f"/api/attention?image={reply['image_id']}&block=0")

        threading.Thread(target=ask, daemon=True).start()
        while (line := proc.stdout.readline()) != "computing\n":
            assert line, "".join(lines)
            lines.append(line)
        time.sleep(0.1)
    finally:
        proc.send_signal(signal.SIGINT)
        rest, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, "".join(lines) + rest
    assert "terminate called" not in rest


def test_sigterm_ends_the_explorer_as_any_command():
    """Ctrl-C is how the server is stopped (status 0); a SIGTERM was taken for one too, and exited 0 with no word."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, "-m", "cgavit", "explore", "--port", "0"], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env)
    lines = []
    try:
        while "press Ctrl-C to stop" not in (line := proc.stdout.readline()):
            assert line, "".join(lines)
            lines.append(line)
    finally:
        proc.send_signal(signal.SIGTERM)
        rest, _ = proc.communicate(timeout=60)
    assert proc.returncode == 143 and "cgavit explore: terminated" in rest, (proc.returncode, "".join(lines) + rest)


def test_command_rejects_bad_options(capsys):
    from cgavit.cli import main

    assert main(["explore", "--port", "70000"]) == 2
    assert "--port" in capsys.readouterr().err


def test_windows_with_padding():
    """At 160 px stage 1 is 10x10 with window 7: padded to 14x14, the edge windows are cropped."""
    images = ImageAttention(*build_model(img_size=160))
    image_id = images.add_image(png_bytes())["image_id"]
    d = images.attention(image_id, 0, 9 * 10 + 9)
    assert d["windows"] == [[0, 0, 7, 7], [0, 7, 7, 3], [7, 0, 3, 7], [7, 7, 3, 3]]
    assert d["query_window"] == [7, 7, 3, 3]
    grid = np.array([[[np.nan if v is None else v for v in row] for row in head] for head in d["maps"]])
    shown = np.nansum(grid, axis=(1, 2))
    assert np.isfinite(grid[:, 7:, 7:]).all() and np.isnan(grid).sum() == 4 * 91
    np.testing.assert_allclose(shown + np.array(d["padding_share"]), 1.0, atol=1e-6)
    assert (np.array(d["padding_share"]) > 0).all()
    m = np.array(images.attention(image_id, 0, None)["maps"])
    np.testing.assert_allclose(m[:, :7, :7].sum(axis=(1, 2)), 1.0, atol=1e-5)  # the one uncropped window
    assert (m[:, 7:, 7:].sum(axis=(1, 2)) < 1).all()


# ------------------------------------------------------------------------------- one head similarity
@pytest.mark.parametrize("heads,cascade,groups", [(4, True, True), (6, False, False), (1, True, True)])
def test_toy_similarity_is_the_analysis_definition(heads, cascade, groups):
    """The page's six-token similarity is what cgavit.analysis computes for the same module and tokens."""
    toy = ToyCGA()
    got = toy.run(heads, cascade, groups, seed=4)
    (blk,) = head_similarity(toy.module(heads, cascade, groups, 4), toy.tokens(4))
    np.testing.assert_allclose(np.array(got["similarity"]), blk.matrix.double().numpy(), atol=1e-6)
    assert got["mean_similarity"] == (None if heads == 1 else pytest.approx(blk.mean_off_diagonal, abs=1e-6))
    assert blk.mean_off_diagonal is None if heads == 1 else blk.mean_off_diagonal is not None


def test_image_similarity_is_the_analysis_definition():
    """Several windows per map: the explorer and cgavit.analysis.head_similarity agree block by block."""
    images = ImageAttention(*build_model(img_size=160))  # stage 1: 10x10, four (partly padded) windows
    image_id = images.add_image(png_bytes())["image_id"]
    blocks = head_similarity(images.model, images.image(image_id))
    assert len(blocks) == len(images.info()["blocks"])
    for k, blk in enumerate(blocks):
        d = images.attention(image_id, k, None)
        np.testing.assert_allclose(np.array(d["similarity"]), blk.matrix.double().numpy(), atol=1e-6)
        assert d["mean_similarity"] == pytest.approx(blk.mean_off_diagonal, abs=1e-6)
    assert blocks[0].windows == 4


def test_one_head_has_no_pairs():
    maps = torch.rand(1, 3, 4, 4).softmax(-1)
    sim = map_similarity(maps)
    assert sim.tolist() == [[pytest.approx(1.0)]] and mean_off_diagonal(sim) is None
