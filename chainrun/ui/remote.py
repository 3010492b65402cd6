"""``chainrun ui --host ALIAS``: the web page started on an SSH host (the login node, where
the service and its state are) and served here, the way `chainrun tensorboard` serves a
remote chain's TensorBoard (``hostserver``).

`chainrun ui` is started there detached, on the host's loopback and a port free there,
with its output in a log of its own under ``~/.local/state/chainrun/`` on the host
(private to the user, removed when it stops); the URL it prints there gives its port
and token. A local port is forwarded to it over
the SSH connection, which is opened again after a drop, so the same URL, printed here
with the same token, serves again once the host answers. Ctrl-C stops both.
"""

from __future__ import annotations

import re
import secrets
import shlex
import socket
from contextlib import suppress
from typing import Callable, Optional

from chainrun import hostserver
from chainrun.errors import TransportError, UsageError
from chainrun.text import clip, escaped
from chainrun.transport import transport_for

LOGS = ".local/state/chainrun"  # relative to the login directory on the host
START_TIMEOUT = 60.0
_SERVING = re.compile(r"http://127\.0\.0\.1:(\d+)/\?token=([A-Za-z0-9_-]+)")


def check_host(host: str) -> None:
    """``host`` names an SSH host: it reads as one, and (unless the config reaches it
    through a proxy) its address is known; a typo is the caller's mistake, said in one line."""
    from chainrun.schema import HOST_RE
    from chainrun.transport.sshconfig import load_config, resolve

    shown = clip(escaped(host), 80)
    if len(host) > 255 or not HOST_RE.fullmatch(host):
        raise UsageError(f"--host {shown!r}: not an SSH host name or ~/.ssh/config alias")
    config, path = load_config()
    try:
        ep = resolve(config, host, path)
    except TransportError as exc:
        raise UsageError(str(exc)) from None
    if ep.proxy_jump or ep.proxy_command:
        return
    try:
        socket.getaddrinfo(ep.hostname, ep.port)
    except (OSError, UnicodeError):
        raise UsageError(
            f"--host {shown!r}: no such host ({ep.hostname} has no address, and {path} names no other)"
        ) from None


def serve(
    host: str,
    port: int,
    new_token: bool,
    program: Optional[str],
    echo: Callable[[str], None],
    announce: Callable[[str], None],
) -> int:
    """Start the page on ``host`` and serve it here until Ctrl-C (0) or until it ends there
    (1); ``announce`` gets the URL, ``echo`` what happens on the way. The token is the one
    the page there keeps (``new_token``: a new one)."""
    check_host(host)
    transport = transport_for(host)
    log = f"{LOGS}/ui-{secrets.token_hex(4)}.log"  # one per page: two at once never share one
    args = [*(shlex.split(program) if program else ["chainrun"]), "ui", "--port", "0"]
    args += ["--new-token"] if new_token else []
    missing = "install chainrun there or name it with --program 'PATH ...'"
    with hostserver.stopped_by_signals():
        try:
            server = hostserver.start(transport, "chainrun ui", args, log, _SERVING, START_TIMEOUT, missing)
        except KeyboardInterrupt:
            return 0
        token = server.found[0]

        def url(local: int) -> None:
            announce(f"http://127.0.0.1:{local}/?token={token}")
            echo(f"the page of {host}'s chains, forwarded from its port {server.port}; Ctrl-C stops it")

        code = hostserver.serve(transport, server, port or None, echo, url)
    with suppress(TransportError):
        transport.run(["rm", "-f", "--", log], timeout=30)
    return code
