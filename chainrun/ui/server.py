"""The web page's server: the standard library's threading HTTP server over the read model
``status`` uses, opened read-only for each request.

Safe by default: every request must carry the session's random token, or it is answered
403, the pages, the event stream, the JSON and the static files alike. The URL printed
carries it (``?token=``) for the first visit, which is answered with a cookie holding it
(``HttpOnly``, ``SameSite=Strict``) and sent to the same URL without it; every later
request carries the cookie alone. The one thing that writes, a cancel, is a POST that
must also carry the session's CSRF token from the confirmation form, and is refused when
the browser says it comes from another site. Every answer forbids inline script, framing
and referrers, so a chain's text can neither run nor leak the token. The event stream
(``/events``) tells an open page that the database changed (SQLite's ``data_version``),
and the page fetches its main part again.

Bounded, so that no client holds the server (``Limits``): a connection has a deadline to
send each whole request, however slowly its bytes come, and is closed when it passes;
so many connections at once, and so many event streams, and no more.
"""

from __future__ import annotations

import hashlib
import hmac
import io
import json
import math
import re
import select
import socket
import sys
import threading
import time
from collections.abc import Sequence
from contextlib import closing, suppress
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, NamedTuple, Optional
from urllib.parse import parse_qs, parse_qsl, unquote, urlencode, urlsplit

from chainrun import cancel
from chainrun import status as view
from chainrun.accounting import account
from chainrun.errors import ChainrunError
from chainrun.model import Chain
from chainrun.store import Store
from chainrun.ui import charts, pages

STATIC = Path(__file__).parent / "static"
_TYPES = {".css": "text/css; charset=utf-8", ".js": "text/javascript; charset=utf-8", ".svg": "image/svg+xml"}
WATCH_EVERY = 0.5  # seconds between looks at whether the database changed, for /events
PING_EVERY = 15.0  # a comment on the event stream this often, so a dead client is noticed
MAX_FORM = 4096
_LENGTH = re.compile(r"[0-9]{1,9}")
_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; connect-src 'self'; "
        "form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "X-Frame-Options": "DENY",
    "Cache-Control": "no-store",
}


class Limits(NamedTuple):
    """What clients can hold of the server."""

    request_timeout: float = 20.0  # seconds to send a whole request (or to take an answer's bytes)
    connections: int = 256  # open at once; one more is closed at once
    streams: int = 16  # event streams open at once; one more is answered 503


LIMITS = Limits()


class Server(ThreadingHTTPServer):
    """The page's server, with what its handlers need: the state directory and the secrets."""

    daemon_threads = True
    request_queue_size = 128  # not the standard library's 5: a burst of connections is not made to retry

    def __init__(
        self, address: tuple[str, int], home: Path, token: str, csrf: str, limits: Limits = LIMITS
    ) -> None:
        super().__init__(address, Handler)
        self.home = home
        self.token = token
        self.cookie = "chainrun-" + hashlib.sha256(token.encode()).hexdigest()[:16]  # one per token
        self.csrf = csrf
        self.limits = limits
        self.stopping = threading.Event()
        self.connections = threading.BoundedSemaphore(limits.connections)
        self.streams = threading.BoundedSemaphore(limits.streams)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self.connections.acquire(blocking=False):
            self.shutdown_request(request)  # full: closed at once, not queued
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self.connections.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.connections.release()

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that went away mid-request is no fault of the server's: nothing logged."""
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)

    def shutdown(self) -> None:
        self.stopping.set()  # ends the event streams
        super().shutdown()


class _Deadline(io.RawIOBase):
    """A connection's reading end that gives up at ``until`` (``time.monotonic``), however
    slowly the bytes come: a client that trickles its request is closed like one that
    sends nothing."""

    def __init__(self, connection: socket.socket, timeout: float) -> None:
        self.connection = connection
        self.timeout = timeout
        self.until = math.inf

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        left = self.until - time.monotonic()
        if left <= 0:
            raise TimeoutError("the request took too long")
        self.connection.settimeout(min(left, self.timeout))
        try:
            return self.connection.recv_into(buffer)
        finally:
            self.connection.settimeout(self.timeout)  # for the answer's writes


class Handler(BaseHTTPRequestHandler):
    server: Server
    protocol_version = "HTTP/1.1"
    default_request_version = "HTTP/1.0"  # so that the answer to a malformed request has a status line

    def log_message(self, format: str, *args: Any) -> None:
        """Requests are not logged: a first visit's URL carries the token."""

    def setup(self) -> None:
        super().setup()
        self.rfile.close()
        self.reading = _Deadline(self.connection, self.server.limits.request_timeout)
        self.connection.settimeout(self.reading.timeout)
        self.rfile = io.BufferedReader(self.reading)

    def handle_one_request(self) -> None:
        self.reading.until = time.monotonic() + self.reading.timeout  # idle time counts too
        super().handle_one_request()

    def parse_request(self) -> bool:
        if not super().parse_request():
            return False
        if len(self.requestline.split()) != 3:  # HTTP/0.9's, with neither headers nor cookie
            self.send_error(400, "the request line names no HTTP version")
            return False
        return True

    # -- answers ------------------------------------------------------------------------
    def _send(self, status: int, kind: str, body: bytes, extra: Optional[dict[str, str]] = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        for name, value in {**_HEADERS, **(extra or {})}.items():
            self.send_header(name, value)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _html(self, status: int, title: str, main: str, fragment: bool, live: bool = True) -> None:
        text = main if fragment else pages.layout(title, pages.Links(), main, live)
        self._send(status, "text/html; charset=utf-8", text.encode())

    def _json(self, data: Any) -> None:
        self._send(200, "application/json", json.dumps(data).encode())

    def _refuse(self, status: int, text: str) -> None:
        self._send(status, "text/plain; charset=utf-8", (text + "\n").encode())

    def _token(self, given: str) -> bool:
        return hmac.compare_digest(given.encode(), self.server.token.encode())

    def _authorised(self) -> bool:
        """The request carries the session's cookie."""
        for header in self.headers.get_all("Cookie", []):
            for pair in header.split(";"):
                name, _, value = pair.strip().partition("=")
                if name == self.server.cookie and self._token(value):
                    return True
        return False

    def _forbidden(self) -> None:
        self._refuse(403, "forbidden: open the URL `chainrun ui` printed, with its token")

    def _first_visit(self, path: str, query: str) -> None:
        """The token given in the URL: kept in a cookie, and the same URL without it."""
        rest = urlencode([(k, v) for k, v in parse_qsl(query, keep_blank_values=True) if k != "token"])
        cookie = f"{self.server.cookie}={self.server.token}; Path=/; HttpOnly; SameSite=Strict"
        where = "/" + path.lstrip("/")  # on this server, whatever the request line said
        location = {"Location": where + ("?" + rest if rest else ""), "Set-Cookie": cookie}
        self._send(303, "text/plain; charset=utf-8", b"", location)

    # -- requests -----------------------------------------------------------------------
    def do_HEAD(self) -> None:
        self.do_GET()

    def do_GET(self) -> None:
        url = urlsplit(self.path)
        query = parse_qs(url.query)
        if "token" in query and self._token(query["token"][0]):
            self._first_visit(url.path, url.query)
            return
        if "token" in query or not self._authorised():
            self._forbidden()
            return
        path = unquote(url.path)
        fragment = query.get("fragment") == ["1"]
        try:
            if path == "/events":
                self._events()
            elif path.startswith("/static/"):
                self._static(path[len("/static/") :])
            else:
                self._page(path, query, fragment)
        except ChainrunError as exc:
            self._html(404, "not found", pages.message(str(exc)), fragment, live=False)
        except ConnectionError:
            self.close_connection = True  # the client went away

    def _page(self, path: str, query: dict[str, list[str]], fragment: bool) -> None:
        link = pages.Links()
        now = time.time()
        with _store(self.server.home) as store:
            if path == "/":
                chains, _ = store.glance(None)
                self._html(200, "chains", pages.overview(chains, store.allocations(now), link, now), fragment)
            elif path.startswith("/chain/"):
                chain = store.chain(store.resolve(path[len("/chain/") :]))
                owed = store.owed_for(chain.id)
                main = pages.chain_page(chain, store.progress_log(chain.id), link, now, owed)
                self._html(200, chain.id, main, fragment)
            elif path.startswith("/sweep/"):
                name = path[len("/sweep/") :]
                members = store.sweep(name)
                if not members:
                    raise ChainrunError(f"no sweep {name!r}")
                ranges = store.metric_ranges([c.id for c in members])
                x, y = query.get("x", [""])[0], query.get("y", [""])[0]
                self._html(200, name, pages.sweep_page(name, members, ranges, link, now, x, y), fragment)
            elif path == "/cancel":
                self._confirm(store, query, link)
            elif path == "/api/chains":
                chains, _ = store.glance(None)
                allocations = store.allocations(now)
                self._json([_glance_json(g, allocations.get(g.id), now) for g in chains])
            elif path.startswith("/api/chain/"):
                chain = store.chain(store.resolve(path[len("/api/chain/") :]))
                owed = store.owed_for(chain.id)
                self._json(_chain_json(chain, store.progress_log(chain.id), owed, now))
            else:
                self._html(404, "not found", pages.message(f"nothing at {path}"), fragment, live=False)

    def _confirm(self, store: Store, query: dict[str, list[str]], link: pages.Links) -> None:
        chain_ref, sweep = query.get("chain", [""])[0], query.get("sweep", [""])[0]
        if sweep:
            if not store.sweep(sweep):
                raise ChainrunError(f"no sweep {sweep!r}")
            main = pages.confirm(
                f"sweep {sweep}", {"sweep": sweep}, self.server.csrf, link, link.sweep(sweep)
            )
        else:
            chain = store.chain(store.resolve(chain_ref))
            main = pages.confirm(
                f"chain {chain.id}", {"chain": chain.id}, self.server.csrf, link, link.chain(chain.id)
            )
        self._html(200, "cancel", main, False, live=False)

    def _static(self, name: str) -> None:
        """A file of ``static/``, or of the vendored chart library: that one under a name
        that carries its version, so the browser may keep it for a year."""
        vendored = charts.vendored().get(name)
        path = vendored or STATIC / name
        if (not vendored and "/" in name) or path.suffix not in _TYPES or not path.is_file():
            self._refuse(404, f"no file {name}")
            return
        kept = {"Cache-Control": "private, max-age=31536000, immutable"} if vendored else None
        self._send(200, _TYPES[path.suffix], path.read_bytes(), kept)

    def _events(self) -> None:
        """Server-sent events: ``change`` whenever the database changed; a comment now and
        then, so that a client that went away ends the stream. So many at once
        (``Limits.streams``): one more is refused, and the open ones kept."""
        held = self.command != "HEAD"  # a HEAD gets the headers alone
        if held and not self.server.streams.acquire(blocking=False):
            self._refuse(503, f"too many live pages open ({self.server.limits.streams}): close one")
            return
        try:
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            for name, value in _HEADERS.items():
                self.send_header(name, value)
            self.end_headers()
            if held:
                self.close_connection = True
                self._stream()
        finally:
            if held:
                self.server.streams.release()

    def _stream(self) -> None:
        with _store(self.server.home) as store:
            seen = store.data_version()
            pinged = time.monotonic()
            self.wfile.write(b"retry: 2000\n\n")
            self.wfile.flush()
            while not self.server.stopping.wait(WATCH_EVERY) and not _gone(self.connection):
                now = store.data_version()
                if now != seen:
                    seen = now
                    self.wfile.write(f"event: change\ndata: {now}\n\n".encode())
                    self.wfile.flush()
                elif time.monotonic() - pinged > PING_EVERY:
                    pinged = time.monotonic()
                    self.wfile.write(b": ping\n\n")
                    self.wfile.flush()

    def do_POST(self) -> None:
        self.close_connection = True  # a refused form's body is never read
        if not self._authorised():
            self._forbidden()
            return
        if unquote(urlsplit(self.path).path) != "/cancel":
            self._refuse(404, "only a cancel is posted here")
            return
        if self.headers.get("Sec-Fetch-Site", "same-origin") not in ("same-origin", "none"):
            self._refuse(403, "forbidden: a cancel must come from this page")
            return
        lengths = self.headers.get_all("Content-Length", [])
        if "Transfer-Encoding" in self.headers or len(lengths) > 1:
            self._refuse(400, "a cancel form is sent with one Content-Length, not in chunks")
            return
        length = (lengths or ["0"])[0].strip()
        if not _LENGTH.fullmatch(length):
            self._refuse(400, "Content-Length is not a number of bytes")
            return
        if int(length) > MAX_FORM:
            self._refuse(413, "form too large")
            return
        form = parse_qs(self.rfile.read(int(length)).decode("utf-8", "replace"))
        given = form.get("csrf", [""])[0]
        if not hmac.compare_digest(given.encode(), self.server.csrf.encode()):
            self._refuse(403, "forbidden: the cancel form's check does not match; open the page again")
            return
        try:
            self._cancel(form)
        except ChainrunError as exc:
            self._html(409, "not cancelled", pages.message(f"not cancelled: {exc}"), False, live=False)

    def _cancel(self, form: dict[str, list[str]]) -> None:
        link = pages.Links()
        with _store(self.server.home, readonly=False) as store:
            sweep = form.get("sweep", [""])[0]
            targets = (
                store.sweep(sweep) if sweep else [store.chain(store.resolve(form.get("chain", [""])[0]))]
            )
            if not targets:
                raise ChainrunError(f"no sweep {sweep!r}")
            going = [c.id for c in targets if not c.state.final]
            for chain_id in going:  # asked for now; carried out beside the page (a save may take its grace)
                store.request_cancel(chain_id, time.time())
        if going:
            threading.Thread(target=_cancelled, args=(self.server.home, going), daemon=True).start()
        back = link.sweep(sweep) if sweep else link.chain(targets[0].id)
        self.send_response(303)
        self.send_header("Location", back.replace("&amp;", "&"))
        self.send_header("Content-Length", "0")
        for name, value in _HEADERS.items():
            self.send_header(name, value)
        self.end_headers()


def _gone(connection: socket.socket) -> bool:
    """The client closed the connection (a page closed: its event stream's place is free)."""
    if not select.select([connection], [], [], 0)[0]:
        return False
    try:
        return connection.recv(1, socket.MSG_PEEK) == b""
    except OSError:
        return True


def _cancelled(home: Path, ids: list[str]) -> None:
    """Carry a cancel out as ``chainrun cancel`` does (the service's, where one runs)."""
    with suppress(ChainrunError), _store(home, readonly=False) as store:  # it stays asked for
        cancel.cancel(home, store, [store.chain(i) for i in ids], wait=lambda _: None)


def _store(home: Path, readonly: bool = True) -> closing[Store]:
    """A store for one request: read-only unless asked."""
    return closing(Store(home, readonly=readonly))


def _glance_json(g: Any, allocation: Optional[tuple[float, float]], now: float) -> dict[str, Any]:
    return {
        "id": g.id,
        "name": g.name,
        "sweep": g.sweep or None,
        "state": g.state.value,
        "state_text": view.state_cell(g, now),
        "epoch": g.epoch,
        "target_epoch": g.target_epoch,
        "eta_seconds": view.eta(g, now),
        "failures": g.failures,
        "max_failures": g.max_failures,
        "allocated_seconds": allocation[0] if allocation else 0.0,
        "trained_seconds": allocation[1] if allocation else 0.0,
    }


def _chain_json(
    chain: Chain, progress: pages.Log, owed: Sequence[tuple[str, float]], now: float
) -> dict[str, Any]:
    acc = account(chain, now)
    data = view.to_json(chain, now, owed)
    data["accounting"] = {**acc.to_json(), "segments": [s.to_json() for s in acc.segments]}
    data["progress_log"] = [{"at": at, **p.to_json()} for at, p in progress]
    return data
