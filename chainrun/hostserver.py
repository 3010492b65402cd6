"""A web server started detached through a transport, here or on an SSH host (the login
node), and served at a URL that works here: what `chainrun tensorboard` and `chainrun ui
--host` share.

The server is started in a session of its own (``setsid``) with its output in a log file
there, and its port is read back from what it prints (``serving``: a pattern whose first
group is the port, and whose other groups the caller may use). On a host, a local port
is forwarded to it over the SSH connection (``SSHTransport.forward``: a ``direct-tcpip``
channel per browser connection, through the configured ProxyJump hops, re-opened after a
reconnect, so the URL serves again once the host answers). When the command ends
(Ctrl-C, SIGTERM, SIGHUP) the server's whole process group is stopped.
"""

from __future__ import annotations

import re
import signal
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Optional

from chainrun.errors import ChainrunError, TransportError, UsageError
from chainrun.transport import Transport

if TYPE_CHECKING:
    from chainrun.transport.ssh import PortForward

START_STEP = 0.5
CHECK_EVERY = 5.0  # seconds between looks at whether the server still runs
LOG_LIMIT = 1 << 20

# $1: the log file; the rest: the command. `setsid` in a background job (no job
# control: not a group leader) makes the command a session and group leader in
# place, so $! is its pid and its group holds whatever it starts.
_LAUNCH = """\
log=$1; shift
command -v "$1" >/dev/null 2>&1 || exit 127
umask 077
mkdir -p -- "$(dirname -- "$log")"
setsid "$@" </dev/null >"$log" 2>&1 &
echo $!
"""
# $1: the process group: TERM, then KILL what is left after 5 s.
_STOP = """\
kill -TERM -- "-$1" 2>/dev/null || exit 0
for _ in $(seq 50); do
    kill -0 -- "-$1" 2>/dev/null || exit 0
    sleep 0.1
done
kill -KILL -- "-$1" 2>/dev/null
exit 0
"""


@dataclass(frozen=True)
class Server:
    """A server this command started: its pid (and process group), port and log, on
    ``where``; ``found`` is what its serving line said (the pattern's match)."""

    name: str  # what it is, for messages: "TensorBoard"
    pid: int
    port: int
    log: str
    where: str
    found: tuple[str, ...] = ()


def start(
    transport: Transport,
    name: str,
    args: Sequence[str],
    log: str,
    serving: re.Pattern[str],
    timeout: float,
    missing: str,
) -> Server:
    """Start ``args`` detached, and wait until its log says where it serves. ``missing``
    is the one line that says what to do when its program is not there."""
    where = transport.host or "localhost"
    result = transport.run(["bash", "-c", _LAUNCH, f"chainrun-{name.lower()}", log, *args], timeout=60)
    if result.returncode == 127:
        raise UsageError(f"{args[0]}: not found on {where} (its login PATH); {missing}")
    if not result.ok or not result.stdout.strip().isdigit():
        raise ChainrunError(f"cannot start {name} on {where}: {result.describe()}")
    server = Server(name, int(result.stdout), 0, log, where)
    try:
        return _await_port(transport, server, serving, timeout)
    except BaseException:
        stop(transport, server)
        raise


def _await_port(transport: Transport, server: Server, serving: re.Pattern[str], timeout: float) -> Server:
    deadline = time.monotonic() + timeout
    while True:
        output = (transport.read_file(server.log, LOG_LIMIT) or b"").decode(errors="replace")
        found = serving.search(output)
        if found:
            port = int(found.group(1))
            return Server(server.name, server.pid, port, server.log, server.where, found.groups()[1:])
        if not running(transport, server):
            last = [line for line in output.splitlines() if line.strip()][-1:] or ["(no output)"]
            raise ChainrunError(
                f"{server.name} ended as it started on {server.where}: {last[0].strip()} "
                f"(all of its output: {server.log})"
            )
        if time.monotonic() > deadline:
            within = f"within {timeout:g} s on {server.where}"
            raise ChainrunError(f"{server.name} did not start serving {within}; see {server.log}")
        time.sleep(START_STEP)


def running(transport: Transport, server: Server) -> bool:
    return transport.run(["kill", "-0", str(server.pid)], timeout=30).ok


def stop(transport: Transport, server: Server) -> None:
    """Stop the server's process group (TERM, then KILL after 5 s)."""
    transport.run(["bash", "-c", _STOP, "chainrun-stop", str(server.pid)], timeout=60)


@contextmanager
def stopped_by_signals() -> Iterator[None]:
    """SIGTERM and SIGHUP end the wait as Ctrl-C does, so that the server is stopped too."""

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    previous = {s: signal.signal(s, interrupt) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def forward(
    transport: Transport, server: Server, port: Optional[int], echo: Callable[[str], None]
) -> PortForward:
    """127.0.0.1:``port`` here (0: a free port) carried to the server's port on the host."""
    from chainrun.transport.ssh import SSHTransport

    if not isinstance(transport, SSHTransport):
        raise TypeError(f"a forward needs an SSH transport, not {transport!r}")

    def changed(error: Optional[str]) -> None:
        if error is None:
            echo(f"connection to {server.where} back; the URL serves again")
        else:
            echo(f"connection lost: {error}; the URL serves again once {server.where} answers")

    try:
        return transport.forward(("127.0.0.1", server.port), port or 0, changed)
    except OSError as exc:
        raise UsageError(
            f"--port {port}: cannot listen on 127.0.0.1:{port} ({exc.strerror or exc}); "
            "choose another port, or leave --port out for a free one"
        ) from None


def wait(transport: Transport, server: Server, echo: Callable[[str], None]) -> int:
    """Until Ctrl-C; 1 when the server ends by itself. A host out of reach is waited out."""
    while True:
        time.sleep(CHECK_EVERY)
        try:
            if running(transport, server):
                continue
        except TransportError:
            continue  # the forward says so when a browser's request cannot get through
        echo(f"{server.name} ended by itself on {server.where}; its output: {server.log}")
        return 1


def serve(
    transport: Transport,
    server: Server,
    port: Optional[int],
    echo: Callable[[str], None],
    announce: Callable[[int], None],
) -> int:
    """Serve ``server`` (started by ``start``) until Ctrl-C (0) or until it ends by itself
    (1): forwarded to a local port when it runs on a host; ``announce`` gets the port of
    the URL. Stops it at the end, whatever ends the wait."""
    pipe: Optional[PortForward] = None
    try:
        if transport.host:
            pipe = forward(transport, server, port, echo)
        announce(pipe.port if pipe is not None else server.port)
        return wait(transport, server, echo)
    except KeyboardInterrupt:
        return 0
    finally:
        if pipe is not None:
            pipe.close()
        try:
            stop(transport, server)
            echo(f"{server.name} stopped (pid {server.pid} on {server.where})")
        except TransportError as exc:
            echo(
                f"cannot stop {server.name} (pid {server.pid} on {server.where}): {exc}; "
                f"stop its process group there: kill -- -{server.pid}"
            )
