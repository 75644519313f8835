"""The CGA Explorer's HTTP server: the page and its JSON API (standard library HTTP server).

``cgavit explore`` (:mod:`cgavit.cli.explore`) starts it from the command line.

Routes:

* ``GET /`` and ``GET /static/<file>``: the page, only from the ``static/`` folder next to this file.
* ``GET /api/cga?heads=H&cascade=0|1&groups=0|1&seed=S``: six tokens through a cascaded group
  attention (:class:`~cgavit.explorer.toy.ToyCGA`).
* ``GET /api/model``: the real model behind the image panel and its blocks.
* ``POST /api/image`` (body: the image file itself, at most 5 MB and 16 megapixels; a form is refused, 415):
  validate, keep, return an id.
* ``GET /api/attention?image=ID&block=K&query=Q|mean``: that image's attention maps in block K.

Every error is JSON ``{"error": "..."}``, also those the standard library sends itself: 400 (bad
parameter, file or request), 403 (foreign Host or Origin, see :mod:`.guard`), 404, 405, 408, 411,
413, 414, 415, 431, 500, 501 and 503 (at a limit of :class:`~cgavit.explorer.limits.Limits`; retry).

The server stays within its :class:`~cgavit.explorer.limits.Limits`: at most ``max_connections``
connection threads (a burst waits briefly in a listen queue of ``listen_queue``, beyond that 503),
idle clients dropped after ``idle_timeout`` and any request cut off after ``request_timeout``,
request bodies, decoded pixels and attention replies (until sent) each within a shared budget, and an
attention request that waits ``compute_wait`` for the model (busy with another's maps) answered 503.

A request target may be a path (``/api/model``) or, as HTTP/1.1 requires a server to accept, absolute
(``http://127.0.0.1:8765/api/model``), whose host is then checked in place of the ``Host`` header.
"""

from __future__ import annotations

import json
import logging
import re
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlsplit

from ..io import printable
from .image_attention import ImageAttention
from .loading import build_model
from .guard import HostCheck, Refused, split_host
from .limits import MAX_UPLOAD_BYTES, Budget, Busy, Limits, TooLarge
from .toy import ToyCGA

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
DRAIN_LIMIT = 4 * MAX_UPLOAD_BYTES  # read (and drop) a refused body up to this, so the reply arrives
STATIC_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")  # the page's files: flat, short names
INTEGER = re.compile(r"(-?)([0-9]+)")  # ASCII digits only: no "４", "4_0", "+4" or " 4"
IMAGE_ID = re.compile(r"[0-9a-f]{16}")
FORM_TYPES = ("application/x-www-form-urlencoded",)  # besides multipart/*: bodies that wrap an upload, never are one
#: A client that hung up or stalled: routine, never a traceback in the log.
CLIENT_GONE = (BrokenPipeError, ConnectionResetError, ConnectionAbortedError, TimeoutError)


class ApiError(Exception):
    """An HTTP error with a message for the JSON body (and extra headers such as ``Allow``)."""

    def __init__(self, status: HTTPStatus, message: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.headers = headers or {}


def _absolute_form(target: str) -> tuple[str, str]:
    """An absolute-form request target ``http://host[:port][/path][?query]`` as its host (what ``Host`` would say) and
    its origin form ``/path[?query]``.

    Raises:
        ValueError: another scheme than http, user information, no host, or a malformed address.
    """
    parts = urlsplit(target)
    if parts.scheme.lower() != "http":
        raise ValueError(f"the request target's scheme must be http (this server speaks plain HTTP), got {shown(target)}")
    if "@" in parts.netloc or not parts.netloc:
        raise ValueError(f"the request target must name a host and nothing else before its path, got {shown(target)}")
    return parts.netloc, (parts.path or "/") + (f"?{parts.query}" if parts.query else "")


def shown(text: str, limit: int = 40) -> str:
    """``text`` quoted for an error message, cut to ``limit`` characters."""
    return repr(text[:limit]) + ("..." if len(text) > limit else "")


def parse_query(url_query: str, allowed: dict[str, str | None]) -> dict[str, str]:
    """Query parameters checked against ``allowed`` (name -> default; None = required).

    Raises:
        ApiError: 400 for a malformed query, an unknown or repeated parameter, or a missing one.
    """
    try:
        raw = parse_qs(url_query, keep_blank_values=True, strict_parsing=bool(url_query), max_num_fields=20)
    except ValueError as err:
        raise ApiError(HTTPStatus.BAD_REQUEST, f"malformed query string: {shown(str(err), 80)}") from None
    unknown = sorted(set(raw) - set(allowed))
    if unknown:
        names = ", ".join(shown(name) for name in unknown[:5])
        raise ApiError(HTTPStatus.BAD_REQUEST, f"unknown parameter(s) [{names}]; allowed: {sorted(allowed)}")
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


def parse_int(name: str, text: str, lo: int, hi: int) -> int:
    """``text`` as an integer in ``lo..hi``: ASCII digits, a minus sign only where ``lo`` < 0.

    Raises:
        ApiError: 400 for anything else (full-width digits, underscores, spaces, "+", out of range).
    """
    match = INTEGER.fullmatch(text)
    if match is None:
        raise ApiError(HTTPStatus.BAD_REQUEST, f"{name} must be an integer written in digits 0-9, got {shown(text)}")
    value = int(text) if len(match.group(2)) <= 18 else None  # longer: out of any range here, and never converted
    if value is None or not lo <= value <= hi or (match.group(1) and lo >= 0):
        raise ApiError(HTTPStatus.BAD_REQUEST, f"{name} must be in {lo}..{hi}, got {shown(text)}")
    return value


def parse_flag(name: str, text: str) -> bool:
    """``"0"`` or ``"1"`` as a bool; ApiError 400 for anything else."""
    if text not in ("0", "1"):
        raise ApiError(HTTPStatus.BAD_REQUEST, f"{name} must be 0 or 1, got {shown(text)}")
    return text == "1"


class ExplorerServer(ThreadingHTTPServer):
    """HTTP server holding the two number sources the handler asks, within fixed limits.

    Args:
        address: ``(host, port)``; port 0 picks a free one (read it from ``server_address``).
        images: the real-model source for the image panel.
        toy: the six-token source. Default :class:`ToyCGA` with 24 channels.
        limits: connections, timeouts, and the budgets of request bodies and attention replies. Default :class:`Limits`.
        allow_hosts: host names besides ``127.0.0.1``, ``localhost``, ``[::1]`` and the bound
            address under which the server may be addressed (see :mod:`.guard`).

    Raises:
        OSError: the address cannot be bound (port in use, unknown interface).
    """

    daemon_threads = True
    # never SO_REUSEPORT (Python 3.14's alphas set it for every HTTPServer): a second explorer started on a port in use
    # would bind too, and the kernel would deal the page's requests out between two servers with different models
    allow_reuse_port = False

    def __init__(
        self,
        address: tuple[str, int],
        images: ImageAttention,
        toy: ToyCGA | None = None,
        limits: Limits | None = None,
        allow_hosts: tuple[str, ...] = (),
    ) -> None:
        if ":" in address[0]:
            self.address_family = socket.AF_INET6
        self.images = images
        self.toy = toy or ToyCGA()
        self.limits = limits or Limits()
        self.request_queue_size = self.limits.listen_queue
        self.bodies = Budget(self.limits.upload_bytes, "bytes")
        self.replies = Budget(self.limits.reply_bytes, "bytes", "replies")
        self._slots = threading.BoundedSemaphore(self.limits.max_connections)
        self._saturated = False  # the last slot wait ran out and no slot has been taken since
        self._held: set[socket.socket] = set()  # connections holding a slot
        self._workers: set[threading.Thread] = set()  # the threads serving them
        self._held_lock = threading.Lock()
        self._deadlines: dict[socket.socket, float] = {}
        self._deadlines_lock = threading.Lock()
        super().__init__(address, ExplorerHandler)
        self.hosts = HostCheck.for_address(address[0], self.server_address[1], allow_hosts)

    @property
    def url(self) -> str:
        """The page's address on this machine: behind a wildcard bind, the loopback one (browsers refuse or stall on
        ``http://0.0.0.0:PORT/``, which names no host; other machines use this one's own address)."""
        host, port = self.server_address[:2]
        host = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host)
        host = f"[{host}]" if ":" in host else host
        return f"http://{host}:{port}/"

    # ----------------------------------------------------------------- one thread per connection, capped
    def process_request(self, request: socket.socket, client_address: tuple) -> None:
        """Serve the connection in a thread of its own if a slot is free, else answer 503 right here."""
        wait = 0 if self._saturated else self.limits.connection_wait
        self._saturated = not self._slots.acquire(timeout=wait)
        if self._saturated:
            self._refuse(request)
            return
        with self._held_lock:
            self._held.add(request)
        try:
            super().process_request(request, client_address)
        except BaseException:  # e.g. Ctrl-C while the thread starts: the slot is given back once, by either side
            self._give_back(request)
            raise

    def process_request_thread(self, request: socket.socket, client_address: tuple) -> None:
        with self._held_lock:
            self._workers.add(threading.current_thread())
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._give_back(request)
            with self._held_lock:
                self._workers.discard(threading.current_thread())

    def server_close(self) -> None:
        """Stop listening, cut the open connections, and wait (up to ``request_timeout``) for their threads.

        Handler threads are daemons, and one still inside torch when the interpreter exits is stopped
        there: the process aborts ("terminate called without an active exception", SIGABRT) where a
        Ctrl-C should end it with status 0. Cut off, a waiting handler's read ends at once; one that is
        computing finishes its computation, and its reply fails.
        """
        super().server_close()
        with self._held_lock:
            held, workers = list(self._held), list(self._workers)
        for conn in held:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        end = time.monotonic() + self.limits.request_timeout
        for worker in workers:
            worker.join(max(0.0, end - time.monotonic()))

    def _give_back(self, request: socket.socket) -> None:
        """Release ``request``'s connection slot, if it still holds one."""
        with self._held_lock:
            if request not in self._held:
                return
            self._held.remove(request)
        self._slots.release()

    def _refuse(self, request: socket.socket) -> None:
        body = json.dumps(
            {"error": f"the explorer is busy ({self.limits.max_connections} connections open); retry in a moment"}
        ).encode()
        head = (
            "HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nRetry-After: 1\r\nConnection: close\r\n\r\n"
        )
        try:
            request.setblocking(False)  # a few hundred bytes fit the send buffer: never blocks
            request.send(head.encode() + body)
            request.recv(1 << 16)  # what the client sent already, so closing does not reset the reply
        except OSError:
            pass
        self.shutdown_request(request)

    # ----------------------------------------------------------------- request deadlines
    @contextmanager
    def deadline(self, connection: socket.socket) -> Iterator[None]:
        """Within the block, ``connection`` is shut down once ``request_timeout`` has passed."""
        with self._deadlines_lock:
            self._deadlines[connection] = time.monotonic() + self.limits.request_timeout
        try:
            yield
        finally:
            with self._deadlines_lock:
                self._deadlines.pop(connection, None)

    def service_actions(self) -> None:
        """Between polls of the accept loop (every half second): cut off requests past their deadline."""
        super().service_actions()
        now = time.monotonic()
        with self._deadlines_lock:
            late = [conn for conn, t in self._deadlines.items() if t < now]
            for conn in late:
                del self._deadlines[conn]
        for conn in late:
            log.debug("explorer: closing a request that ran past %s s", self.limits.request_timeout)
            try:
                conn.shutdown(socket.SHUT_RDWR)  # the handler's blocked read returns; its write fails
            except OSError:
                pass

    def handle_error(self, request: socket.socket, client_address: tuple) -> None:
        """A client that hung up is routine (debug log); anything else is logged with its traceback."""
        err = sys.exc_info()[1]
        if isinstance(err, CLIENT_GONE):
            log.debug("explorer: %s from %s", type(err).__name__, client_address[0])
        else:
            log.exception("explorer: connection from %s failed", client_address[0])


class ExplorerHandler(BaseHTTPRequestHandler):
    """Routes requests to the static page or the JSON API."""

    server: ExplorerServer
    server_version = "cgavit-explorer"
    protocol_version = "HTTP/1.1"
    default_request_version = "HTTP/1.0"  # errors found before the version is read still get headers

    # ------------------------------------------------------------------------------- plumbing
    def setup(self) -> None:
        self.timeout = self.server.limits.idle_timeout  # the socket timeout of every read and write
        super().setup()

    def handle_one_request(self) -> None:
        with self.server.deadline(self.connection):
            super().handle_one_request()

    def parse_request(self) -> bool:
        """The base class's parsing, then the Host and Origin checks of :mod:`.guard`. A request target in absolute
        form (``http://host:port/path``, which HTTP/1.1 servers must accept: RFC 9112, 3.2.2) names the host in
        place of the ``Host`` header and becomes ``/path``."""
        if not super().parse_request():
            return False
        try:
            if len(self.headers.get_all("Host", [])) > 1:
                raise ValueError("more than one Host header")
            host = self.headers.get("Host")
            if not self.path.startswith("/") and "://" in self.path:  # its host is the one checked; Host must be sound
                if host is None and self.request_version != "HTTP/1.0":
                    raise ValueError("the request has no Host header")
                if host is not None:
                    split_host(host)
                host, self.path = _absolute_form(self.path)
            self.server.hosts.check_host(host, self.request_version)
            for origin in self.headers.get_all("Origin", []):
                self.server.hosts.check_origin(origin, host)
        except Refused as err:
            self.send_error(HTTPStatus.FORBIDDEN, str(err))
            return False
        except ValueError as err:
            self.send_error(HTTPStatus.BAD_REQUEST, str(err))
            return False
        return True

    def log_message(self, format: str, *args) -> None:  # noqa: A002 (the base class's name)
        log.debug("%s %s", self.address_string(), printable(format % args))  # the request line is the client's text

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        """Every error as JSON, the base class's own (400, 414, 431, 501, ...) included; closes the connection."""
        self.log_error("code %d, message %s", code, message)
        self.close_connection = True
        text = message or HTTPStatus(code).phrase
        if explain:
            text = f"{text}: {explain}"
        self._error(code, text)

    def _send(self, status: int, body: bytes, content_type: str, extra: dict[str, str] | None = None) -> None:
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
        try:
            body = json.dumps(payload, allow_nan=False)
        except ValueError:  # the model's, not the request's: a 500, and in the log (it was a 400 naming JSON)
            log.error("explorer request %s: the model gave values that are not finite", printable(self.path[:200]))
            raise ApiError(HTTPStatus.INTERNAL_SERVER_ERROR, "the model gave values that are not finite (NaN or inf) for "
                           "this request: its weights overflow in float32; check the checkpoint") from None
        self._send(status, body.encode(), "application/json")

    def _error(self, status: int, message: str, extra: dict[str, str] | None = None) -> None:
        self._send(status, json.dumps({"error": message}).encode(), "application/json", extra)

    # ------------------------------------------------------------------------------- routing
    def do_GET(self) -> None:
        self._handle("GET")

    def do_HEAD(self) -> None:
        self._handle("HEAD")

    def do_POST(self) -> None:
        self.close_connection = True  # an error may leave the body unread: never reuse this connection
        self._handle("POST")

    def _handle(self, method: str) -> None:
        """Route one request and turn every failure into a JSON error reply."""
        if method != "POST" and ("Transfer-Encoding" in self.headers or self.headers.get("Content-Length", "0") != "0"):
            self.close_connection = True  # a body we do not read must not be taken for the next request
        try:
            path, query = self._target()
            self._route(method, path)(path, query)
        except ApiError as err:
            self._error(err.status, str(err), err.headers)
        except TooLarge as err:
            self._error(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, str(err))
        except Busy as err:
            self._error(HTTPStatus.SERVICE_UNAVAILABLE, str(err), {"Retry-After": "1"})
        except ValueError as err:  # validation inside the library
            self._error(HTTPStatus.BAD_REQUEST, str(err))
        except TimeoutError:
            self.close_connection = True
            self._error(HTTPStatus.REQUEST_TIMEOUT, f"nothing arrived for {self.server.limits.idle_timeout:g} s")
        except CLIENT_GONE as err:
            self.close_connection = True
            log.debug("explorer: client gone during %s (%s)", self.path, type(err).__name__)
        except Exception:
            log.exception("explorer request %s failed", printable(self.path[:200]))
            self._error(HTTPStatus.INTERNAL_SERVER_ERROR, "internal error; see the server's log")

    def _target(self) -> tuple[str, str]:
        """The request target as (path, query); 400 unless it is ``/path[?query]``."""
        if not self.path.startswith("/"):
            raise ApiError(HTTPStatus.BAD_REQUEST, f"the request target must start with '/', got {shown(self.path)}")
        path, _, query = self.path.partition("#")[0].partition("?")
        return path, query

    def _route(self, method: str, path: str) -> Callable[[str, str], None]:
        """The handler ``(path, query)`` for ``method`` on ``path``; 404 or 405 when there is none."""
        api = {
            "/api/cga": ("GET", self._api_cga),
            "/api/model": ("GET", self._api_model),
            "/api/attention": ("GET", self._api_attention),
            "/api/image": ("POST", self._api_image),
        }
        if path == "/" or path.startswith("/static/"):
            allowed, handler = "GET", self._static
        elif path in api:
            allowed, handler = api[path]
        elif path.startswith("/api/"):
            raise ApiError(HTTPStatus.NOT_FOUND, f"no API route {shown(path)}; see /api/cga, /api/model, /api/image, /api/attention")
        else:
            raise ApiError(HTTPStatus.NOT_FOUND, "not found")
        if method == allowed or (method == "HEAD" and allowed == "GET"):
            return handler
        allow = "GET, HEAD" if allowed == "GET" else allowed
        raise ApiError(HTTPStatus.METHOD_NOT_ALLOWED, f"{path} takes {allow}, not {method}", {"Allow": allow})

    # --------------------------------------------------------------------------------- routes
    def _static(self, path: str, query: str) -> None:
        name = "index.html" if path == "/" else unquote(path[len("/static/"):])
        if "/" in name or "\\" in name or name in (".", ".."):
            raise ApiError(HTTPStatus.FORBIDDEN, "outside the page folder: only the page's own files are served")
        if not STATIC_NAME.fullmatch(name):
            raise ApiError(HTTPStatus.NOT_FOUND, "not found")
        suffix = Path(name).suffix.lower()
        if suffix not in CONTENT_TYPES:
            raise ApiError(HTTPStatus.FORBIDDEN, f"files of type {suffix or '(none)'} are not served")
        target = STATIC_DIR / name
        if not target.is_file():
            raise ApiError(HTTPStatus.NOT_FOUND, f"no file {name}")
        self._send(HTTPStatus.OK, target.read_bytes(), CONTENT_TYPES[suffix], {"Content-Security-Policy": CSP})

    def _api_cga(self, path: str, query: str) -> None:
        toy = self.server.toy
        q = parse_query(query, {"heads": "4", "cascade": "1", "groups": "1", "seed": "0"})
        heads = parse_int("heads", q["heads"], 1, toy.channels)
        if heads not in toy.head_choices:
            raise ApiError(HTTPStatus.BAD_REQUEST, f"heads must be one of {toy.head_choices}, got {heads}")
        cascade, groups = parse_flag("cascade", q["cascade"]), parse_flag("groups", q["groups"])
        if cascade and not groups:
            raise ApiError(
                HTTPStatus.BAD_REQUEST,
                "cascade=1 needs groups=1: the cascade adds a head's output to the next head's channel "
                "group, and without groups there is none (set cascade=0)",
            )
        seed = parse_int("seed", q["seed"], 0, 2**31 - 1)
        self._json(toy.run(heads, cascade, groups, seed))

    def _api_model(self, path: str, query: str) -> None:
        parse_query(query, {})
        self._json(self.server.images.info())

    def _api_attention(self, path: str, query: str) -> None:
        images = self.server.images
        q = parse_query(query, {"image": None, "block": "0", "query": "mean"})
        if not IMAGE_ID.fullmatch(q["image"]):
            raise ApiError(HTTPStatus.BAD_REQUEST, f"image must be the 16-character id POST /api/image returned, got {shown(q['image'])}")
        if not images.has_image(q["image"]):
            raise ApiError(HTTPStatus.NOT_FOUND, "unknown image id (the server keeps the last few uploads); upload it again")
        n_blocks = len(images.info()["blocks"])
        block = parse_int("block", q["block"], 0, n_blocks - 1)
        token = None if q["query"] == "mean" else parse_int("query", q["query"], 0, 10**6)
        with self.server.replies.reserve(images.reply_bytes(block), self.server.limits.budget_wait):  # until sent
            try:
                self._json(images.attention(q["image"], block, token))
            except KeyError:  # evicted by other uploads since the check above
                raise ApiError(HTTPStatus.NOT_FOUND, "unknown image id; upload it again") from None

    def _api_image(self, path: str, query: str) -> None:
        parse_query(query, {})
        size = self._content_length()
        if self.headers.get_content_type() in FORM_TYPES or self.headers.get_content_maintype() == "multipart":
            self._drain(size)  # its bytes are a form's, wrapping the file: its image would be "no image format" (400)
            raise ApiError(
                HTTPStatus.UNSUPPORTED_MEDIA_TYPE,
                "send the image file itself as the request body (curl --data-binary @FILE), not a form (curl -F)",
            )
        if size > MAX_UPLOAD_BYTES:
            self._drain(size)
            raise ApiError(
                HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
                f"the upload is {size:,} bytes; the limit is {MAX_UPLOAD_BYTES:,} ({MAX_UPLOAD_BYTES / 2**20:.0f} MB): "
                "use a smaller image",
            )
        if size == 0:
            raise ApiError(HTTPStatus.BAD_REQUEST, "empty upload; choose an image file")
        with ExitStack() as held:
            try:
                held.enter_context(self.server.bodies.reserve(size, self.server.limits.budget_wait))
            except Busy:
                self._drain(size)
                raise
            data = self.rfile.read(size)
            if len(data) != size:
                raise ApiError(HTTPStatus.BAD_REQUEST, "the upload ended early")
            reply = self.server.images.add_image(data)
        self._json(reply)

    def _content_length(self) -> int:
        if "Transfer-Encoding" in self.headers:
            raise ApiError(HTTPStatus.NOT_IMPLEMENTED, "Transfer-Encoding is not supported; send the file with a Content-Length")
        values = self.headers.get_all("Content-Length", [])
        if not values:
            raise ApiError(HTTPStatus.LENGTH_REQUIRED, "send the image as the request body with a Content-Length")
        if len(values) > 1:
            raise ApiError(HTTPStatus.BAD_REQUEST, "more than one Content-Length header")
        return parse_int("Content-Length", values[0], 0, 10**18)

    def _drain(self, size: int) -> None:
        """Read and drop a refused body (up to DRAIN_LIMIT), so the client gets to read the reply."""
        left = size if size <= DRAIN_LIMIT else 0
        while left > 0:
            chunk = self.rfile.read(min(left, 1 << 16))
            if not chunk:
                return
            left -= len(chunk)


def make_server(
    host: str = "127.0.0.1",
    port: int = 0,
    images: ImageAttention | None = None,
    limits: Limits | None = None,
    allow_hosts: tuple[str, ...] = (),
) -> ExplorerServer:
    """Build (not start) an explorer server; with ``images`` None it uses a random efficientvit_m0.

    Raises:
        OSError: the address cannot be bound (port in use, unknown interface).
    """
    if images is None:
        images = ImageAttention(*build_model(), limits=limits)
    return ExplorerServer((host, port), images, limits=limits, allow_hosts=allow_hosts)
