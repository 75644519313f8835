"""The CGA Explorer's HTTP server: the page and its JSON API (standard library HTTP server).

``cgavit explore`` (:mod:`cgavit.cli.explore`) starts it from the command line.

Routes:

* ``GET /`` and ``GET /static/<file>``: the page, only from the ``static/`` folder next to this file.
* ``GET /api/cga?heads=H&cascade=0|1&groups=0|1&seed=S``: six tokens through a cascaded group
  attention (:class:`~cgavit.explorer.compute.ToyCGA`).
* ``GET /api/model``: the real model behind the image panel and its blocks.
* ``POST /api/image`` (body: the image file, at most 5 MB): validate, keep, return an id.
* ``GET /api/attention?image=ID&block=K&query=Q|mean``: that image's attention maps in block K.

Errors are JSON ``{"error": "..."}`` with status 400 (bad parameter or file), 404, 411, 413 or 500.
"""

from __future__ import annotations

import json
import logging
import socket
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlsplit

from .compute import MAX_UPLOAD_BYTES, ImageAttention, ToyCGA, build_model

log = logging.getLogger(__name__)

STATIC_DIR = Path(__file__).resolve().parent / "static"
CONTENT_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".json": "application/json",
    ".png": "image/png",
    ".svg": "image/svg+xml",
    ".ico": "image/x-icon",
}
# the page loads nothing from elsewhere; the browser enforces it
CSP = (
    "default-src 'self'; img-src 'self' data: blob:; style-src 'self'; script-src 'self'; "
    "connect-src 'self'; object-src 'none'; base-uri 'none'; frame-ancestors 'none'"
)
_DRAIN_LIMIT = 4 * MAX_UPLOAD_BYTES  # read (and drop) an oversized body up to this, so the 413 arrives


class ApiError(Exception):
    """An HTTP error with a message for the JSON body."""

    def __init__(self, status: HTTPStatus, message: str) -> None:
        super().__init__(message)
        self.status = status


def _query(url_query: str, allowed: dict[str, str | None]) -> dict[str, str]:
    """Query parameters checked against ``allowed`` (name -> default; None = required)."""
    try:
        raw = parse_qs(url_query, keep_blank_values=True, strict_parsing=bool(url_query), max_num_fields=20)
    except ValueError as err:
        raise ApiError(HTTPStatus.BAD_REQUEST, f"malformed query string: {err}") from None
    unknown = sorted(set(raw) - set(allowed))
    if unknown:
        raise ApiError(HTTPStatus.BAD_REQUEST, f"unknown parameter(s) {unknown}; allowed: {sorted(allowed)}")
    out = {}
    for name, default in allowed.items():
        values = raw.get(name)
        if values is None:
            if default is None:
                raise ApiError(HTTPStatus.BAD_REQUEST, f"missing parameter {name!r}")
            out[name] = default
        elif len(values) > 1:
            raise ApiError(HTTPStatus.BAD_REQUEST, f"parameter {name!r} given {len(values)} times; give it once")
        else:
            out[name] = values[0]
    return out


def _int(name: str, text: str, lo: int, hi: int) -> int:
    try:
        value = int(text, 10)
    except ValueError:
        raise ApiError(HTTPStatus.BAD_REQUEST, f"{name} must be an integer, got {text!r}") from None
    if not lo <= value <= hi:
        raise ApiError(HTTPStatus.BAD_REQUEST, f"{name} must be in {lo}..{hi}, got {value}")
    return value


def _flag(name: str, text: str) -> bool:
    if text not in ("0", "1"):
        raise ApiError(HTTPStatus.BAD_REQUEST, f"{name} must be 0 or 1, got {text!r}")
    return text == "1"


class ExplorerServer(ThreadingHTTPServer):
    """HTTP server holding the two number sources the handler asks.

    Args:
        address: ``(host, port)``; port 0 picks a free one (read it from ``server_address``).
        images: the real-model source for the image panel.
        toy: the six-token source. Default :class:`ToyCGA` with 24 channels.
    """

    daemon_threads = True

    def __init__(self, address: tuple[str, int], images: ImageAttention, toy: ToyCGA | None = None) -> None:
        if ":" in address[0]:
            self.address_family = socket.AF_INET6
        self.images = images
        self.toy = toy or ToyCGA()
        super().__init__(address, ExplorerHandler)

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        host = f"[{host}]" if ":" in host else host
        return f"http://{host}:{port}/"


class ExplorerHandler(BaseHTTPRequestHandler):
    """Routes requests to the static page or the JSON API."""

    server: ExplorerServer
    server_version = "cgavit-explorer"
    protocol_version = "HTTP/1.1"

    # ------------------------------------------------------------------------------- plumbing
    def log_message(self, format: str, *args) -> None:  # noqa: A002 (the base class's name)
        log.debug("%s %s", self.address_string(), format % args)

    def _send(self, status: int, body: bytes, content_type: str, extra: dict | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("X-Content-Type-Options", "nosniff")
        self.send_header("Cache-Control", "no-store")
        for key, value in (extra or {}).items():
            self.send_header(key, value)
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _json(self, payload: dict, status: int = HTTPStatus.OK) -> None:
        self._send(status, json.dumps(payload, allow_nan=False).encode(), "application/json")

    def _error(self, status: int, message: str) -> None:
        self._json({"error": message}, status)

    def _dispatch(self, routes: dict) -> None:
        parts = urlsplit(self.path)
        try:
            for prefix, handler in routes.items():
                if parts.path == prefix or (len(prefix) > 1 and prefix.endswith("/") and parts.path.startswith(prefix)):
                    handler(parts)
                    return
            if parts.path.startswith("/api/"):
                raise ApiError(HTTPStatus.NOT_FOUND, f"no API route {parts.path}; see /api/cga, /api/model, /api/image, /api/attention")
            raise ApiError(HTTPStatus.NOT_FOUND, "not found")
        except ApiError as err:
            self._error(err.status, str(err))
        except ValueError as err:  # validation inside the library
            self._error(HTTPStatus.BAD_REQUEST, str(err))
        except Exception:
            log.exception("explorer request %s failed", self.path)
            self._error(HTTPStatus.INTERNAL_SERVER_ERROR, "internal error; see the server's log")

    def do_GET(self) -> None:
        self._dispatch(
            {
                "/": lambda p: self._static("index.html"),
                "/static/": lambda p: self._static(p.path[len("/static/"):]),
                "/api/cga": self._api_cga,
                "/api/model": self._api_model,
                "/api/attention": self._api_attention,
            }
        )

    do_HEAD = do_GET

    def do_POST(self) -> None:
        self.close_connection = True  # an error may leave the body unread: never reuse this connection
        self._dispatch({"/api/image": self._api_image})

    # --------------------------------------------------------------------------------- routes
    def _static(self, rel: str) -> None:
        rel = unquote(rel)
        if not rel or "\x00" in rel:
            raise ApiError(HTTPStatus.NOT_FOUND, "not found")
        root = STATIC_DIR
        target = (root / rel).resolve()
        if not target.is_relative_to(root):
            raise ApiError(HTTPStatus.FORBIDDEN, "outside the page folder")
        if not target.is_file():
            raise ApiError(HTTPStatus.NOT_FOUND, f"no file {rel}")
        kind = CONTENT_TYPES.get(target.suffix.lower())
        if kind is None:
            raise ApiError(HTTPStatus.FORBIDDEN, f"files of type {target.suffix or '(none)'} are not served")
        self._send(HTTPStatus.OK, target.read_bytes(), kind, {"Content-Security-Policy": CSP})

    def _api_cga(self, parts) -> None:
        toy = self.server.toy
        q = _query(parts.query, {"heads": "4", "cascade": "1", "groups": "1", "seed": "0"})
        heads = _int("heads", q["heads"], 1, toy.channels)
        if heads not in toy.head_choices:
            raise ApiError(HTTPStatus.BAD_REQUEST, f"heads must be one of {toy.head_choices}, got {heads}")
        cascade, groups = _flag("cascade", q["cascade"]), _flag("groups", q["groups"])
        if cascade and not groups:
            raise ApiError(
                HTTPStatus.BAD_REQUEST,
                "cascade=1 needs groups=1: the cascade adds a head's output to the next head's channel "
                "group, and without groups there is none (set cascade=0)",
            )
        seed = _int("seed", q["seed"], 0, 2**31 - 1)
        self._json(toy.run(heads, cascade, groups, seed))

    def _api_model(self, parts) -> None:
        _query(parts.query, {})
        self._json(self.server.images.info())

    def _api_attention(self, parts) -> None:
        images = self.server.images
        q = _query(parts.query, {"image": None, "block": "0", "query": "mean"})
        if not images.has_image(q["image"]):
            raise ApiError(HTTPStatus.NOT_FOUND, "unknown image id (the server keeps the last few uploads); upload it again")
        n_blocks = len(images.info()["blocks"])
        block = _int("block", q["block"], 0, n_blocks - 1)
        query = None if q["query"] == "mean" else _int("query", q["query"], 0, 10**6)
        try:
            self._json(images.attention(q["image"], block, query))
        except KeyError:  # evicted by other uploads since the check above
            raise ApiError(HTTPStatus.NOT_FOUND, "unknown image id; upload it again") from None

    def _api_image(self, parts) -> None:
        _query(parts.query, {})
        length = self.headers.get("Content-Length")
        if length is None:
            self.close_connection = True
            raise ApiError(HTTPStatus.LENGTH_REQUIRED, "send the image as the request body with a Content-Length")
        try:
            size = int(length)
            if size < 0:
                raise ValueError
        except ValueError:
            self.close_connection = True
            raise ApiError(HTTPStatus.BAD_REQUEST, f"bad Content-Length {length!r}") from None
        if size > MAX_UPLOAD_BYTES:
            if size <= _DRAIN_LIMIT:
                self._drain(size)
            else:
                self.close_connection = True
            raise ApiError(
                HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
                f"the upload is {size / 2**20:.1f} MB; the limit is {MAX_UPLOAD_BYTES / 2**20:.0f} MB: use a smaller image",
            )
        if size == 0:
            raise ApiError(HTTPStatus.BAD_REQUEST, "empty upload; choose an image file")
        data = self.rfile.read(size)
        if len(data) != size:
            self.close_connection = True
            raise ApiError(HTTPStatus.BAD_REQUEST, "the upload ended early")
        self._json(self.server.images.add_image(data))

    def _drain(self, size: int) -> None:
        left = size
        while left > 0:
            chunk = self.rfile.read(min(left, 1 << 16))
            if not chunk:
                self.close_connection = True
                return
            left -= len(chunk)


def make_server(host: str = "127.0.0.1", port: int = 0, images: ImageAttention | None = None) -> ExplorerServer:
    """Build (not start) an explorer server; with ``images`` None it uses a random efficientvit_m0.

    Raises:
        OSError: the address cannot be bound (port in use, unknown interface).
    """
    if images is None:
        images = ImageAttention(*build_model())
    return ExplorerServer((host, port), images)
