"""``chainrun ui``: a web page of every chain, its segments on a timeline, its training
plotted, and what the allocation bought, served from this machine's state.

``serve`` starts the server (``server``) on 127.0.0.1, with a random token in the one
URL it prints; the port and the token are kept in the state directory (``ui.json``,
mode 0600) and used again at the next start, so that a bookmark of the URL still opens
the page, unless it is told a port (0: a free one) or a new token. The pages (``pages``) and their
charts (``charts``: the timeline as SVG, the plots' data for uPlot) are built from the read
model ``status`` uses, and the scripts, the chart library and the style sheet they load are
files of this package (``static/``): the page needs no network.
``remote`` starts it on a login node over SSH and forwards it here.
"""

from __future__ import annotations

import json
import os
import re
import secrets
from pathlib import Path
from typing import Callable, NamedTuple, Optional

from chainrun.home import HomeError, private_dir
from chainrun.ui.server import Server

LOOPBACK = "127.0.0.1"
KEPT = "ui.json"  # in the state directory: the port and token of the last page served
_TOKEN = re.compile(r"[A-Za-z0-9_-]{24,128}")


class Kept(NamedTuple):
    """The port and token the page had last time (the token None when others could read it)."""

    port: int
    token: Optional[str]


def kept(home: Path) -> Optional[Kept]:
    """What ``keep`` wrote, or None: none written, unreadable, or not as written. A token
    that others could read (the file is not the user's own, or open to others) is not used
    again."""
    path = home / KEPT
    try:
        st = path.stat()
        data = json.loads(path.read_text(encoding="utf-8"))
        port, token = data["port"], data["token"]
    except (OSError, ValueError, TypeError, KeyError):
        return None
    if not isinstance(port, int) or not 0 < port < 65536:
        return None
    private = not st.st_mode & 0o077 and st.st_uid == os.geteuid()
    return Kept(port, token if private and isinstance(token, str) and _TOKEN.fullmatch(token) else None)


def keep(home: Path, server: Server) -> None:
    """Write the server's port and token for the next start, atomically, mode 0600."""
    path = private_dir(home) / KEPT
    tmp = path.with_name(f".{KEPT}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        json.dump({"port": server.server_port, "token": server.token}, f)
    os.replace(tmp, path)


def open_server(
    home: Path, bind: str = LOOPBACK, port: Optional[int] = 0, new_token: bool = True
) -> tuple[Server, str]:
    """The server, listening (not serving yet), and what to tell the user about it ("" or a
    warning). ``port`` None: last time's (else a free one); 0: a free one. Unless
    ``new_token``, last time's token; the CSRF secret is always fresh."""
    last = kept(home)
    token = (last.token if last is not None and not new_token else None) or secrets.token_urlsafe(24)
    want = port if port is not None else last.port if last is not None else 0
    note = ""
    try:
        server = Server((bind, want), home, token, secrets.token_urlsafe(24))
    except OSError as exc:
        if port is not None or not want:
            raise
        note = f"port {want}, the page's last time, is taken ({exc.strerror or exc}): a free one instead"
        server = Server((bind, 0), home, token, secrets.token_urlsafe(24))
    return server, note


def url_of(server: Server, host: str = "") -> str:
    """The URL to open: ``host`` (else the address it listens on) and its port, with the token."""
    where = host or str(server.server_address[0])
    if where in ("0.0.0.0", "::", ""):
        where = LOOPBACK
    if ":" in where:
        where = f"[{where}]"
    return f"http://{where}:{server.server_port}/?token={server.token}"


def serve(
    home: Path,
    bind: str,
    port: Optional[int],
    new_token: bool,
    announce: Callable[[str], None],
    warn: Callable[[str], None],
) -> None:
    """Serve until interrupted; ``announce`` gets the URL once the server listens (and its
    port and token are kept for the next start), ``warn`` a port that could not be kept."""
    server, note = open_server(home, bind, port, new_token)
    try:
        try:
            keep(home, server)
        except (OSError, HomeError) as exc:
            warn(f"the URL is not kept for the next start: {getattr(exc, 'strerror', None) or exc}")
        if note:
            warn(note)
        announce(url_of(server))
        server.serve_forever(poll_interval=0.5)
    except KeyboardInterrupt:
        pass
    finally:
        server.stopping.set()
        server.server_close()
