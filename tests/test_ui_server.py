"""The web page's server bounds what clients can hold, over real sockets: idle and slow
connections are closed after its request timeout and never crowd out a request; so many
connections and event streams at once and no more; malformed requests get a 4xx or a
closed connection, never a traceback; and the token of the printed URL is moved into a
cookie at the first visit. The server runs here in a thread, with short limits, so that
its timeouts pass in seconds (`Limits` is what `chainrun ui` takes with its defaults)."""

from __future__ import annotations

import http.client
import json
import secrets
import select
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import suppress
from pathlib import Path
from typing import Callable
from urllib.parse import parse_qs, urlsplit

import pytest
from conftest import wait_for
from test_ui import ui as ui  # the fixture that starts `chainrun ui`

from chainrun.store import Store
from chainrun.ui import charts
from chainrun.ui.server import LIMITS, MAX_FORM, Limits, Server

WAIT = 30.0  # seconds: far longer than any limit here, short of a hung test


@pytest.fixture
def serve(home: Path) -> Iterator[Callable[[Limits], Server]]:
    """Start the page's server over an empty state directory, with ``limits``."""
    Store(home).close()
    servers: list[Server] = []

    def start(limits: Limits = LIMITS) -> Server:
        server = Server(("127.0.0.1", 0), home, secrets.token_urlsafe(24), secrets.token_urlsafe(24), limits)
        threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True).start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


def _connect(server: Server) -> socket.socket:
    return socket.create_connection(("127.0.0.1", server.server_port), timeout=WAIT)


def _request(server: Server, line: str, *headers: str) -> bytes:
    """A request with the session's cookie, as a browser sends it after the first visit."""
    cookie = f"Cookie: {server.cookie}={server.token}"
    return "\r\n".join([line, "Host: 127.0.0.1", cookie, *headers, "", ""]).encode()


def _until_closed(connection: socket.socket) -> bytes:
    """All the server sends until it closes the connection (a hang fails the test)."""
    received = b""
    deadline = time.monotonic() + WAIT
    with connection:
        while time.monotonic() < deadline:
            try:
                chunk = connection.recv(65536)
            except ConnectionResetError:
                return received
            if not chunk:
                return received
            received += chunk
    raise AssertionError(f"the connection still open after {WAIT:.0f} s, having sent {received[:200]!r}")


def _answer(server: Server, data: bytes) -> bytes:
    """``data`` sent on a new connection: the first line of the answer, b"" when the
    connection was closed without one."""
    connection = _connect(server)
    with suppress(BrokenPipeError, ConnectionResetError):  # closed before it had all: its answer is there
        connection.sendall(data)
    return _until_closed(connection).partition(b"\r\n")[0]


def _good(server: Server) -> bool:
    return _answer(server, _request(server, "GET / HTTP/1.1", "Connection: close")) == b"HTTP/1.1 200 OK"


def _closed(connection: socket.socket) -> bool:
    """The server closed ``connection`` (read within the test's deadline)."""
    try:
        return connection.recv(1) == b""
    except ConnectionResetError:
        return True


def test_idle_connections_never_crowd_out_a_request_and_are_closed_after_the_timeout(
    serve: Callable[[Limits], Server], capsys: pytest.CaptureFixture[str]
) -> None:
    """200 connections opened and left silent: a request is answered while they are open,
    and the server closes each of them after its request timeout."""
    server = serve(Limits(request_timeout=3.0))
    idle = [_connect(server) for _ in range(200)]
    try:
        assert _good(server)
        assert all(_closed(c) for c in idle)
    finally:
        for connection in idle:
            connection.close()
    assert _good(server)
    assert "Traceback" not in capsys.readouterr().err


def test_one_connection_past_the_bound_is_closed_at_once(serve: Callable[[Limits], Server]) -> None:
    """With so many connections open, one more is closed at once (not queued behind them);
    once they close, requests are answered again."""
    server = serve(Limits(request_timeout=WAIT * 4, connections=4))
    held = [_connect(server) for _ in range(4)]
    try:
        assert _closed(_connect(server))
    finally:
        for connection in held:
            connection.close()
    wait_for(lambda: _good(server), WAIT, "a request answered once the held connections closed")


def _stream(server: Server) -> socket.socket:
    """An event stream, open: read up to its first line of data."""
    connection = _connect(server)
    connection.sendall(_request(server, "GET /events HTTP/1.1"))
    received = b""
    while b"retry: " not in received:
        chunk = connection.recv(4096)
        assert chunk, received
        received += chunk
    assert received.startswith(b"HTTP/1.1 200 OK"), received
    return connection


def test_a_head_of_the_event_stream_ends_and_one_stream_past_the_bound_is_refused(
    serve: Callable[[Limits], Server],
) -> None:
    """HEAD /events is answered with the headers alone, and ends. With the bound's number
    of streams open, one more is refused with 503 and the open ones go on; once a page
    closes its stream, its place is free again."""
    server = serve(Limits(streams=3))
    head = _until_closed(_send(server, _request(server, "HEAD /events HTTP/1.1", "Connection: close")))
    assert head.startswith(b"HTTP/1.1 200 OK\r\n") and head.endswith(b"\r\n\r\n"), head
    assert b"Content-Type: text/event-stream" in head and b"retry:" not in head
    streams = [_stream(server) for _ in range(3)]
    try:
        refused = _answer(server, _request(server, "GET /events HTTP/1.1", "Connection: close"))
        assert refused == b"HTTP/1.1 503 Service Unavailable"
        for connection in streams:  # still open (a ping may have come, unread)
            assert not select.select([connection], [], [], 0)[0] or connection.recv(1, socket.MSG_PEEK)
        streams.pop(0).close()

        def opened() -> bool:
            connection = _connect(server)
            connection.sendall(_request(server, "GET /events HTTP/1.1"))
            if connection.recv(4096).startswith(b"HTTP/1.1 200 OK"):
                streams.append(connection)
                return True
            connection.close()
            return False

        wait_for(opened, WAIT, "a stream's place freed when its page closed it")
    finally:
        for connection in streams:
            connection.close()


def _send(server: Server, data: bytes) -> socket.socket:
    connection = _connect(server)
    connection.sendall(data)
    return connection


def _post(server: Server, *headers: str) -> bytes:
    return _request(server, "POST /cancel HTTP/1.1", "Sec-Fetch-Site: same-origin", *headers)


def test_malformed_requests_get_a_4xx_or_a_closed_connection_and_never_a_traceback(
    serve: Callable[[Limits], Server], capsys: pytest.CaptureFixture[str]
) -> None:
    """Each malformed request, on a connection of its own, is answered 4xx or closed (an
    HTTP version or a method it does not know: 505, 501, as the standard says);
    a slowloris (a byte a second) is closed after the request timeout; the server logs no
    traceback and answers a good request after them all."""
    server = serve(Limits(request_timeout=3.0))
    malformed = {
        "not a request line": b"NONSENSE\r\n\r\n",
        "no HTTP version": b"GET /\r\n\r\n",
        "a request line too long": b"GET /" + b"a" * 70_000 + b" HTTP/1.1\r\n\r\n",
        "bytes that are not text": b"GET /\xff\xfe%00%zz HTTP/1.1\r\nHost: \xff\x00\r\n\r\n",
        "a header line too long": b"GET / HTTP/1.1\r\nX-A: " + b"a" * 70_000 + b"\r\n\r\n",
        "a flood of headers": b"GET / HTTP/1.1\r\n" + b"X-A: b\r\n" * 1000 + b"\r\n",
        "a header that is not one": b"GET / HTTP/1.1\r\nno colon here\r\n\r\n",
        "a negative Content-Length": _post(server, "Content-Length: -5") + b"csrf=x",
        "a Content-Length that is not a number": _post(server, "Content-Length: 12abc") + b"csrf=x",
        "a huge Content-Length": _post(server, "Content-Length: 99999999999999999999") + b"csrf=x",
        "a form too large": _post(server, f"Content-Length: {MAX_FORM + 1}") + b"x" * (MAX_FORM + 1),
        "two Content-Lengths": _post(server, "Content-Length: 6", "Content-Length: 60") + b"csrf=x",
        "a form in chunks": _post(server, "Transfer-Encoding: chunked") + b"6\r\ncsrf=x\r\n0\r\n\r\n",
        "a form shorter than it says": _post(server, "Content-Length: 100") + b"csrf=x",
    }
    for what, data in malformed.items():
        first = _answer(server, data)
        assert first == b"" or (first.startswith(b"HTTP/1.") and first.split()[1][:1] == b"4"), (what, first)
    # An HTTP it does not speak, a method it does not know: the standard's own 5xx answers.
    assert _answer(server, b"GET / HTTP/7.1\r\n\r\n").startswith(b"HTTP/1.1 505 ")
    assert _answer(server, _request(server, "BREW / HTTP/1.1")).startswith(b"HTTP/1.1 501 ")

    slow = _send(server, b"GET / HTTP/1.1\r\n")
    started = time.monotonic()
    closed = False
    with slow:
        while not closed and time.monotonic() - started < WAIT:
            try:
                slow.sendall(b"X")
            except OSError:
                closed = True
                break
            if select.select([slow], [], [], 1.0)[0]:  # a byte a second
                closed = _closed(slow)
    assert closed, "the slowloris still served after the deadline"
    assert _good(server)
    assert "Traceback" not in capsys.readouterr().err


def test_the_token_moves_from_the_url_into_a_cookie_at_the_first_visit(ui: Callable[..., str]) -> None:
    """`chainrun ui`'s printed URL (or a bookmark of any page with its token) sets an
    HttpOnly, SameSite=Strict cookie and sends the browser to the same URL without the
    token; the cookie alone is let in after; neither, a wrong one, or a wrong token in the
    URL: 403. The pages' own links carry no token."""
    url = urlsplit(ui())
    token = parse_qs(url.query)["token"][0]
    connection = http.client.HTTPConnection("127.0.0.1", url.port, timeout=WAIT)

    def ask(path: str, cookie: str = "") -> tuple[http.client.HTTPResponse, str]:
        connection.request("GET", path, headers={"Cookie": cookie} if cookie else {})
        answer = connection.getresponse()
        return answer, answer.read().decode()

    first, _ = ask(f"/?token={token}")
    assert first.status == 303 and first.getheader("Location") == "/"
    name, _, rest = first.getheader("Set-Cookie", "").partition("=")
    value, *attributes = rest.split(";")
    assert name.startswith("chainrun-") and value == token
    assert {a.strip() for a in attributes} == {"Path=/", "HttpOnly", "SameSite=Strict"}
    cookie = f"{name}={value}"
    deeper, _ = ask(f"/api/chains?fragment=1&token={token}")
    assert deeper.status == 303 and deeper.getheader("Location") == "/api/chains?fragment=1"

    page, body = ask("/", f"other=1; {cookie}")
    assert page.status == 200 and token not in body and "/static/ui.js" in body
    listed, body = ask("/api/chains", cookie)
    assert listed.status == 200 and json.loads(body) == []
    assert ask("/static/ui.js", cookie)[0].status == 200
    assert ask("/")[0].status == 403
    assert ask("/", f"{name}={token[:-1]}{'A' if token[-1] != 'A' else 'B'}")[0].status == 403
    assert ask("/", f"chainrun-other={token}")[0].status == 403
    assert ask(f"/?token={token[:-1]}", cookie)[0].status == 403


def test_the_vendored_chart_library_is_served_by_its_version_and_kept_by_the_browser(
    serve: Callable[[Limits], Server],
) -> None:
    """The page loads uPlot from a name that carries its version; that file is served as
    the package holds it, with its content type and a year's private cache (a new version
    is a new name), to the session's cookie alone, like every other file; another version,
    the files' own folder and the licence are not served."""
    server = serve(LIMITS)
    connection = http.client.HTTPConnection("127.0.0.1", server.server_port, timeout=WAIT)
    cookie = f"{server.cookie}={server.token}"

    def ask(path: str, cookie: str = cookie) -> tuple[http.client.HTTPResponse, bytes]:
        connection.request("GET", path, headers={"Cookie": cookie} if cookie else {})
        answer = connection.getresponse()
        return answer, answer.read()

    page = ask("/")[1].decode()
    for name, path in charts.vendored().items():
        assert f'"/static/{name}"' in page
        answer, body = ask(f"/static/{name}")
        assert answer.status == 200 and body == path.read_bytes(), name
        kind = "text/javascript" if name.endswith(".js") else "text/css"
        assert answer.getheader("Content-Type") == f"{kind}; charset=utf-8"
        assert answer.getheader("Cache-Control") == "private, max-age=31536000, immutable"
        assert answer.getheader("X-Content-Type-Options") == "nosniff"
        assert ask(f"/static/{name}", "")[0].status == 403
    assert ask("/static/ui.js")[0].getheader("Cache-Control") == "no-store"  # ours change with the package
    assert ask("/static/plots.js")[0].status == 200
    js = next(name for name in charts.vendored() if name.endswith(".js"))
    for other in (
        js.replace("uplot-", "uplot-0."),
        "vendor/uplot/uPlot.iife.min.js",
        js.replace("uPlot.iife.min.js", "LICENSE"),
    ):
        assert ask(f"/static/{other}")[0].status == 404, other
