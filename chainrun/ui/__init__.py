"""``chainrun ui``: a web page of every chain, its segments on a timeline, its training
plotted, and what the allocation bought, served from this machine's state.

``serve`` starts the server (``server``) on 127.0.0.1 and a free port unless told
otherwise, with a random token in the one URL it prints; the pages (``pages``) and their
SVG charts (``charts``) are built from the read model ``status`` uses, and the script and
style sheet they load are files of this package (``static/``): the page needs no network.
``remote`` starts it on a login node over SSH and forwards it here.
"""

from __future__ import annotations

import secrets
from pathlib import Path
from typing import Callable

from chainrun.ui.server import Server

LOOPBACK = "127.0.0.1"


def open_server(home: Path, bind: str = LOOPBACK, port: int = 0) -> Server:
    """The server, listening (not serving yet), with fresh secrets."""
    return Server((bind, port), home, secrets.token_urlsafe(24), secrets.token_urlsafe(24))


def url_of(server: Server, host: str = "") -> str:
    """The URL to open: ``host`` (else the address it listens on) and its port, with the token."""
    where = host or str(server.server_address[0])
    if where in ("0.0.0.0", "::", ""):
        where = LOOPBACK
    if ":" in where:
        where = f"[{where}]"
    return f"http://{where}:{server.server_port}/?token={server.token}"


def serve(home: Path, bind: str, port: int, announce: Callable[[str], None]) -> None:
    """Serve until interrupted; ``announce`` gets the URL once the server listens."""
    server = open_server(home, bind, port)
    try:
        announce(url_of(server))
        server.serve_forever(poll_interval=0.5)
    except KeyboardInterrupt:
        pass
    finally:
        server.stopping.set()
        server.server_close()
