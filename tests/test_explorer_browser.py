"""CGA Explorer in a real browser: Debian's chromium driven by playwright.

The page must show the API's numbers after every control change. Screenshots go to
``$CGAVIT_ARTIFACTS/explorer/`` when that variable names a folder, else to pytest's tmp_path.
Without chromium these tests skip, unless ``CGAVIT_REQUIRE_BROWSER=1`` (CI), where they fail.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from cgavit.explorer import ImageAttention, Limits, build_model
from cgavit.explorer.server import ExplorerServer
from cgavit.testing import randomize_
from conftest import skip_unless_required

pytestmark = pytest.mark.browser

CHROMIUM = "/usr/bin/chromium"
LAUNCH_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update"]


def _chromium_missing() -> str | None:
    if not os.path.exists(CHROMIUM) and not shutil.which("chromium"):
        return f"{CHROMIUM} not found (apt-get install chromium)"
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "the playwright package is not installed"
    return None


@pytest.fixture(scope="module")
def browser():
    missing = _chromium_missing()
    if missing:
        skip_unless_required("CGAVIT_REQUIRE_BROWSER", missing)
    from playwright.sync_api import sync_playwright

    path = CHROMIUM if os.path.exists(CHROMIUM) else shutil.which("chromium")
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=path, args=LAUNCH_ARGS)
        yield b
        b.close()


@pytest.fixture(scope="module")
def server():
    srv = ExplorerServer(("127.0.0.1", 0), ImageAttention(*build_model()))
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield srv
    srv.shutdown()
    srv.server_close()


@pytest.fixture
def shots(tmp_path):
    root = os.environ.get("CGAVIT_ARTIFACTS")
    out = Path(root) / "explorer" if root else tmp_path
    out.mkdir(parents=True, exist_ok=True)
    return out


def api(srv, path):
    with urllib.request.urlopen(srv.url.rstrip("/") + path, timeout=30) as res:
        return json.loads(res.read())


def open_page(browser, srv, width=1280, height=800):
    page = browser.new_page(viewport={"width": width, "height": height})
    page.set_default_timeout(20000)
    problems, foreign = [], []
    page.on("pageerror", lambda err: problems.append(str(err)))
    page.on("console", lambda msg: problems.append(msg.text) if msg.type == "error" else None)
    page.on("request", lambda req: None if req.url.startswith((srv.url, "data:")) else foreign.append(req.url))
    page.goto(srv.url)
    return page, problems, foreign


def wait_toy(page, query):
    # attribute selectors, not JS predicates: the page's CSP forbids eval
    page.wait_for_selector(f'#toy[data-state="{query}"][data-busy="0"]', state="attached")


def shown_map(page):
    """The heatmap as drawn: the numbers in the cells' data- attributes and the printed labels."""
    cells = page.locator("#cells rect.cell").evaluate_all(
        "els => els.map(e => [+e.dataset.q, +e.dataset.k, e.dataset.value])"
    )
    texts = page.locator("#cells text.cell-val").evaluate_all(
        "els => els.map(e => [+e.dataset.q, +e.dataset.k, e.textContent])"
    )
    values = [[None] * 6 for _ in range(6)]
    labels = [[None] * 6 for _ in range(6)]
    for q, k, v in cells:
        values[q][k] = float(v)
    for q, k, t in texts:
        labels[q][k] = t
    return values, labels


def shown_bars(page, svg="#simbars"):
    pairs = page.locator(f"{svg} g.bar").evaluate_all("els => els.map(e => [e.dataset.pair, e.dataset.value])")
    return {pair: float(v) for pair, v in pairs}


def check_matches_api(page, srv, query, head):
    d = api(srv, f"/api/cga?{query}")
    values, labels = shown_map(page)
    assert values == d["maps"][head]  # the exact numbers the API returned
    assert labels == [[f"{v:.2f}" for v in row] for row in d["maps"][head]]
    assert page.locator("#map-head").text_content() == str(head + 1)
    h = d["heads"]
    want = {f"{i + 1}-{j + 1}": d["similarity"][i][j] for i in range(h) for j in range(i + 1, h)}
    assert shown_bars(page) == want
    assert page.locator("#slices g.headbox").count() == h
    assert page.locator("#slices .cascade-arrow").count() == (h - 1 if d["cascade"] else 0)
    return d


def test_controls_update_panels(browser, server, shots):
    page, problems, foreign = open_page(browser, server)
    wait_toy(page, "heads=4&cascade=1&groups=1&seed=0")
    check_matches_api(page, server, "heads=4&cascade=1&groups=1&seed=0", 0)
    page.screenshot(path=str(shots / "explorer_default.png"))

    page.click("#heads button[data-value='6']")
    wait_toy(page, "heads=6&cascade=1&groups=1&seed=0")
    check_matches_api(page, server, "heads=6&cascade=1&groups=1&seed=0", 0)

    page.click("#cascade-wrap")
    wait_toy(page, "heads=6&cascade=0&groups=1&seed=0")
    check_matches_api(page, server, "heads=6&cascade=0&groups=1&seed=0", 0)

    page.click("#head-pick button[data-value='4']")  # H5
    check_matches_api(page, server, "heads=6&cascade=0&groups=1&seed=0", 4)
    assert page.locator("#head-pick button[data-value='4']").get_attribute("aria-pressed") == "true"
    page.screenshot(path=str(shots / "explorer_h6_nocascade_head5.png"))

    page.click("#slices g.headbox[data-head='1']")  # clicking a head in panel 1 selects it too
    check_matches_api(page, server, "heads=6&cascade=0&groups=1&seed=0", 1)

    page.click("#cascade-wrap")
    wait_toy(page, "heads=6&cascade=1&groups=1&seed=0")
    page.fill("#seed", "42")
    page.press("#seed", "Enter")
    wait_toy(page, "heads=6&cascade=1&groups=1&seed=42")
    check_matches_api(page, server, "heads=6&cascade=1&groups=1&seed=42", 1)
    assert problems == [] and foreign == []
    page.close()


def test_groups_off_disables_cascade(browser, server, shots):
    page, problems, _ = open_page(browser, server)
    wait_toy(page, "heads=4&cascade=1&groups=1&seed=0")
    page.click("label.switch:has(#groups)")
    wait_toy(page, "heads=4&cascade=0&groups=0&seed=0")
    assert page.locator("#cascade").is_disabled() and not page.locator("#cascade").is_checked()
    assert "needs channel groups" in page.locator("#cascade-note").text_content()
    check_matches_api(page, server, "heads=4&cascade=0&groups=0&seed=0", 0)
    page.screenshot(path=str(shots / "explorer_groups_off.png"))
    page.click("label.switch:has(#groups)")  # back on: the cascade the user had comes back
    wait_toy(page, "heads=4&cascade=1&groups=1&seed=0")
    assert page.locator("#cascade").is_checked() and not page.locator("#cascade").is_disabled()
    assert problems == []
    page.close()


def test_layout_is_stable_and_fits_narrow(browser, server, shots):
    page, problems, _ = open_page(browser, server)
    wait_toy(page, "heads=4&cascade=1&groups=1&seed=0")
    panels = ["#toy .slices", "#toy .heat", "#toy .sim", "#toy .controls"]
    before = [page.locator(p).bounding_box() for p in panels]
    page.click("#heads button[data-value='8']")
    wait_toy(page, "heads=8&cascade=1&groups=1&seed=0")
    page.click("#head-pick button[data-value='7']")
    after = [page.locator(p).bounding_box() for p in panels]
    assert before == after  # no panel moves or resizes while numbers change

    page.set_viewport_size({"width": 400, "height": 800})
    page.wait_for_timeout(200)  # the debounced redraw for the new width
    assert page.evaluate("() => document.scrollingElement.scrollWidth") <= 400
    boxes = [page.locator(p).bounding_box() for p in ["#toy .controls", "#toy .slices", "#toy .heat", "#toy .sim"]]
    for upper, lower in zip(boxes, boxes[1:]):
        assert lower["y"] >= upper["y"] + upper["height"]  # stacked in reading order
        assert upper["width"] <= 400
    page.screenshot(path=str(shots / "explorer_narrow.png"), full_page=True)
    assert problems == []
    page.close()


def test_image_attention_in_page(browser, server, shots, tmp_path):
    from PIL import Image, ImageDraw

    img = Image.new("RGB", (320, 240), (70, 120, 190))
    draw = ImageDraw.Draw(img)
    draw.ellipse((30, 50, 150, 200), fill=(240, 200, 40))
    draw.rectangle((190, 30, 300, 150), fill=(200, 60, 60))
    path = tmp_path / "shapes.png"
    img.save(path)

    page, problems, foreign = open_page(browser, server)
    wait_toy(page, "heads=4&cascade=1&groups=1&seed=0")
    page.wait_for_selector("#block option", state="attached")
    assert "randomly initialised" in page.locator("#about").text_content()
    page.set_input_files("#upload", str(path))
    page.wait_for_selector('#real[data-state^="image="][data-busy="0"]', state="attached")

    def check():
        query = page.locator("#real").get_attribute("data-state")
        d = api(server, f"/api/attention?{query}")
        figs = page.locator("#head-grid figure")
        assert figs.count() == d["heads"]
        for j in range(d["heads"]):
            values = [v for row in d["maps"][j] for v in row if v is not None]
            assert float(figs.nth(j).get_attribute("data-max")) == max(values)
            assert float(figs.nth(j).get_attribute("data-sum")) == pytest.approx(sum(values), abs=1e-9)
        h = d["heads"]
        want = {f"{i + 1}-{j + 1}": d["similarity"][i][j] for i in range(h) for j in range(i + 1, h)}
        assert shown_bars(page, "#real-sim") == want
        return query

    first = check()
    assert first.endswith(f"block=0&query={7 * 14 + 7}")  # the centre token by default
    page.screenshot(path=str(shots / "explorer_image.png"), full_page=True)

    page.select_option("#block", "3")
    page.wait_for_selector('#real[data-state$="block=3&query=10"][data-busy="0"]', state="attached")
    check()
    canvas = page.locator("#head-grid canvas").first
    box = canvas.bounding_box()
    canvas.click(position={"x": box["width"] * 0.1, "y": box["height"] * 0.9})  # token (3, 0) of 4x4
    page.wait_for_selector('#real[data-state$="block=3&query=12"][data-busy="0"]', state="attached")
    check()
    page.click("#mode button[data-mode='mean']")
    page.wait_for_selector('#real[data-state$="block=3&query=mean"][data-busy="0"]', state="attached")
    check()
    page.screenshot(path=str(shots / "explorer_image_mean.png"), full_page=True)
    assert problems == [] and foreign == []
    page.close()


def shapes_png(path, size=(320, 240)):
    from PIL import Image, ImageDraw

    img = Image.new("RGB", size, (70, 120, 190))
    ImageDraw.Draw(img).ellipse((30, 50, 150, 200), fill=(240, 200, 40))
    img.save(path)
    return path


def test_the_same_file_can_be_chosen_again(browser, server, tmp_path):
    """The page tells the user to upload an image again once the server has forgotten it ("unknown image id"),
    but a file input fires no change event for the file it already holds: choosing the same file again did
    nothing. The input is emptied as soon as its file is taken."""
    path = shapes_png(tmp_path / "again.png")
    page, problems, _ = open_page(browser, server)
    page.wait_for_selector("#block option", state="attached")
    page.set_input_files("#upload", str(path))
    page.wait_for_selector('#real[data-state^="image="][data-busy="0"]', state="attached")
    assert page.locator("#upload").input_value() == ""
    assert page.locator("#head-grid figure").count() == 4
    assert problems == []
    page.close()


def test_a_non_square_model_is_drawn_in_its_proportions(browser, shots, tmp_path):
    """A checkpoint built for 160x256 px (recorded as its input_size) had its 256x160 view and 10x16 token map
    squeezed onto square canvases; each head's canvas now has the model's proportions, and a click still picks
    the token under it."""
    from cgavit import create_model

    model = randomize_(create_model("m0", img_size=(64, 128)), 0)
    srv = ExplorerServer(("127.0.0.1", 0), ImageAttention(model, "a 64x128 model"))
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        page, problems, _ = open_page(browser, srv)
        page.wait_for_selector("#block option", state="attached")
        page.set_input_files("#upload", str(shapes_png(tmp_path / "wide.png", (400, 150))))
        page.wait_for_selector('#real[data-state$="block=0&query=20"][data-busy="0"]', state="attached")  # 4x8: (2, 4)
        canvas = page.locator("#head-grid canvas").first
        assert canvas.evaluate("c => [c.width, c.height]") == [224, 112]
        box = canvas.bounding_box()
        assert box["height"] / box["width"] == pytest.approx(0.5, abs=0.02)
        canvas.click(position={"x": box["width"] * 0.95, "y": box["height"] * 0.9})
        page.wait_for_selector('#real[data-state$="block=0&query=31"][data-busy="0"]', state="attached")  # (3, 7)
        page.locator("#real").screenshot(path=str(shots / "explorer_non_square.png"))
        assert problems == []
        page.close()
    finally:
        srv.shutdown()
        srv.server_close()


def test_a_model_description_that_did_not_load_is_fetched_again(browser, server, tmp_path):
    """A busy server (503, "retry in a moment") as the page loaded left it without the model's blocks for good:
    every upload then failed with "error: Cannot read properties of null (reading 'blocks')". An upload now asks
    for them again, and says so in words when they still do not come."""
    path = shapes_png(tmp_path / "late.png")
    answered = []

    def busy_twice(route):
        answered.append(route.request.url)
        if len(answered) <= 2:
            route.fulfill(status=503, content_type="application/json", body='{"error": "the explorer is busy"}')
        else:
            route.continue_()

    page, problems, _ = open_page(browser, server)  # the page's first request for /api/model may go before the route
    page.route("**/api/model", busy_twice)
    page.reload()
    page.wait_for_selector("#about:has-text('unavailable (the explorer is busy)')", state="attached")
    page.set_input_files("#upload", str(path))
    page.wait_for_selector("#real-status:has-text('did not load (the explorer is busy)')", state="attached")
    page.set_input_files("#upload", str(path))
    page.wait_for_selector('#real[data-state^="image="][data-busy="0"]', state="attached")
    assert "randomly initialised" in page.locator("#about").text_content()
    assert page.locator("#block option").count() == 6 and page.locator("#head-grid figure").count() == 4
    assert not [p for p in problems if "503" not in p]  # the browser logs each 503 it was given
    page.close()


def test_a_stopped_server_is_said_in_words(browser):
    """With the server stopped (Ctrl-C), every control answered "error: Failed to fetch", the browser's words for
    a request that got no HTTP answer."""
    srv = ExplorerServer(("127.0.0.1", 0), ImageAttention(*build_model(None, None, 64)))
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    page, _, _ = open_page(browser, srv)
    wait_toy(page, "heads=4&cascade=1&groups=1&seed=0")
    srv.shutdown()
    srv.server_close()
    page.click("#heads button[data-value='2']")
    wait_toy(page, "error:heads=2&cascade=1&groups=1&seed=0")
    assert page.locator("#status").text_content() == (
        "error: no answer from the explorer: is cgavit explore still running? (it also cuts off a request that takes "
        "too long)"
    )
    page.close()


def test_a_refused_setting_leaves_the_controls_on_what_is_shown(browser, server):
    """A setting the server did not answer (here a 503 while busy) left its control pressed over the panels of
    the previous one: "6 heads" selected above four heads' maps and bars."""
    page, _, _ = open_page(browser, server)
    wait_toy(page, "heads=4&cascade=1&groups=1&seed=0")
    page.route("**/api/cga?heads=6*", lambda route: route.fulfill(
        status=503, content_type="application/json", body='{"error": "the explorer is busy; retry in a moment"}'))
    page.click("#heads button[data-value='6']")
    wait_toy(page, "error:heads=6&cascade=1&groups=1&seed=0")
    assert page.locator("#status").text_content() == "error: the explorer is busy; retry in a moment"
    assert page.locator("#heads button[aria-pressed='true']").text_content() == "4"
    check_matches_api(page, server, "heads=4&cascade=1&groups=1&seed=0", 0)
    page.close()


def test_a_refused_block_leaves_the_controls_on_what_is_shown(browser, server, tmp_path):
    """The image panel's twin of the test above: a block the server did not answer stayed selected over the
    maps of the previous block, and "mean over queries" stayed pressed over one query's maps."""
    page, _, _ = open_page(browser, server)
    page.wait_for_selector("#block option", state="attached")
    page.set_input_files("#upload", str(shapes_png(tmp_path / "refused.png")))
    page.wait_for_selector('#real[data-state$="block=0&query=105"][data-busy="0"]', state="attached")
    page.route("**/api/attention?*block=2*", lambda route: route.fulfill(
        status=503, content_type="application/json", body='{"error": "the explorer is busy; retry in a moment"}'))
    page.route("**/api/attention?*query=mean", lambda route: route.fulfill(
        status=503, content_type="application/json", body='{"error": "the explorer is busy; retry in a moment"}'))
    page.select_option("#block", "2")
    page.wait_for_selector('#real[data-state^="error:"][data-state$="block=2&query=24"][data-busy="0"]', state="attached")
    assert page.locator("#block").input_value() == "0"
    page.click("#mode button[data-mode='mean']")
    page.wait_for_selector('#real[data-state^="error:"][data-state$="block=0&query=mean"][data-busy="0"]', state="attached")
    assert page.locator("#mode button[aria-pressed='true']").get_attribute("data-mode") == "query"
    assert page.locator("#real-status").text_content() == "error: the explorer is busy; retry in a moment"
    page.close()


def test_a_busy_model_is_asked_again_then_said_in_words(browser, tmp_path):
    """A request queued behind another's maps was cut off at the request time limit with no reply ("no answer from the
    explorer"); the server now answers 503 with Retry-After once it has waited ``compute_wait``. The page asks again
    after the seconds it is told, twice, then says why (and the controls stay on what is shown)."""
    limits = Limits(compute_wait=0.1)
    images = ImageAttention(*build_model(), limits=limits)
    srv = ExplorerServer(("127.0.0.1", 0), images, limits=limits)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        page, problems, _ = open_page(browser, srv)
        busy = []
        page.on("response", lambda res: busy.append(res.url) if res.status == 503 else None)
        page.wait_for_selector("#block option", state="attached")
        page.set_input_files("#upload", str(shapes_png(tmp_path / "busy.png")))
        page.wait_for_selector('#real[data-state$="block=0&query=105"][data-busy="0"]', state="attached")
        with images.computing():  # another request's maps, for as long as the page keeps asking
            page.select_option("#block", "2")
            page.wait_for_selector('#real[data-state^="error:"][data-state$="block=2&query=24"][data-busy="0"]',
                                   state="attached")
        assert len(busy) == 3 and all("block=2" in url for url in busy)  # the first ask and two more
        status = page.locator("#real-status").text_content()
        assert status.startswith("error: the explorer is still computing another request's attention maps")
        assert status.endswith("retry in a moment") and page.locator("#block").input_value() == "0"
        with images.computing(), page.expect_response(lambda res: res.status == 503):  # busy for the first ask only
            page.select_option("#block", "1")
        page.wait_for_selector('#real[data-state$="block=1&query=24"][data-busy="0"]', state="attached")
        assert "error" not in page.locator("#real-status").get_attribute("class").split()  # no error shown
        assert len(busy) == 4 and not [p for p in problems if "503" not in p]  # the browser logs each 503 it was given
        page.close()
    finally:
        srv.shutdown()
        srv.server_close()


@pytest.mark.parametrize("typed,seed", [("1e3", 1000), ("7.9", 7), ("99999999999", 2147483647)])
def test_the_seed_is_the_number_typed(browser, server, typed, seed):
    """The seed field is a number field, whose value "1e3" means 1000: the page read it with parseInt, as 1."""
    page, _, _ = open_page(browser, server)
    wait_toy(page, "heads=4&cascade=1&groups=1&seed=0")
    page.fill("#seed", typed)
    page.press("#seed", "Enter")
    wait_toy(page, f"heads=4&cascade=1&groups=1&seed={seed}")
    assert page.locator("#seed").input_value() == str(seed)
    page.close()


class SlowAttention(ImageAttention):
    """Attention that takes a while, as a large model's does (seconds at --img-size 4096), noting what was asked."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.asked = []

    def attention(self, image_id, block, query):
        self.asked.append((block, query))
        time.sleep(1.5)
        return super().attention(image_id, block, query)


def test_quick_clicks_ask_the_server_once_for_the_last(browser, tmp_path):
    """Each click sent its own attention request, and the server computes one at a time: at --img-size 4096 (7 s a
    request here) five quick clicks queued 35 s of work, and the last, the one the page waits for, was cut off at
    the 30 s request limit. Clicks made while a request is in flight are now asked for together when it ends."""
    images = SlowAttention(*build_model(None, None, 64))
    srv = ExplorerServer(("127.0.0.1", 0), images)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        page, problems, _ = open_page(browser, srv)
        page.wait_for_selector("#block option", state="attached")
        page.set_input_files("#upload", str(shapes_png(tmp_path / "quick.png")))
        page.wait_for_selector('#real[data-state$="block=0&query=10"][data-busy="0"]', state="attached")  # 4x4 tokens
        canvas = page.locator("#head-grid canvas").first
        box = canvas.bounding_box()
        images.asked.clear()
        for x, y in [(0.1, 0.1), (0.9, 0.1), (0.1, 0.9), (0.9, 0.9), (0.3, 0.3)]:  # tokens 0, 3, 12, 15, then 5
            canvas.click(position={"x": box["width"] * x, "y": box["height"] * y})
        page.wait_for_selector('#real[data-state$="block=0&query=5"][data-busy="0"]', state="attached")
        assert images.asked[0] == (0, 0) and images.asked[-1] == (0, 5) and len(images.asked) <= 3  # not all five
        assert problems == []
        page.close()
    finally:
        srv.shutdown()
        srv.server_close()
