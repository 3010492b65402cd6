"""``chainrun tensorboard``: TensorBoard on a chain's logs, where the chain runs, at a URL that works here.

For a chain on this machine TensorBoard starts here, on 127.0.0.1 and the port
asked for (else one free). For a chain on an SSH host it starts on that host
(the login node), bound to the host's loopback on a port free there
(TensorBoard's ``--port 0``, read back from what it prints), and a local port
is forwarded to it over the SSH connection (``SSHTransport.forward``: a
``direct-tcpip`` channel per browser connection, through the configured
ProxyJump hops, re-opened after a reconnect, so the URL serves again once the
host answers). Either way TensorBoard is started through the chain's transport,
detached in a session of its own with its output in the chain's run directory
(``tensorboard.log``), and when the command ends (Ctrl-C, SIGTERM, SIGHUP) its
whole process group is stopped: TensorBoard and the data server it starts.
TensorBoard on a compute node of a running job is not offered: it runs where
the chain's scheduler commands run.
"""

from __future__ import annotations

import importlib.util
import posixpath
import re
import signal
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Optional

from chainrun.errors import ChainrunError, TransportError, UsageError
from chainrun.model import Chain
from chainrun.rundir import trust_run_dir
from chainrun.schedulers.segment import run_dir
from chainrun.transport import Transport, transport_for

if TYPE_CHECKING:
    from chainrun.transport.ssh import PortForward

LOG_NAME = "tensorboard.log"  # in the chain's run directory
DEFAULT_LOGDIR = "runs"  # in the chain's workdir
INSTALL_HINT = "pip install 'chainrun[tensorboard]'"
START_TIMEOUT = 180.0  # seconds for TensorBoard to say where it serves (it imports TensorFlow if there)
START_STEP = 0.5
CHECK_EVERY = 5.0  # seconds between looks at whether TensorBoard still runs
LOG_LIMIT = 1 << 20
_SERVING = re.compile(r"TensorBoard \S+ at http://[^\s/]+:(\d+)/")

# $1: the log file; the rest: the command. `setsid` in a background job (no job
# control: not a group leader) makes the command a session and group leader in
# place, so $! is its pid and its group holds the data server it starts.
_LAUNCH = """\
log=$1; shift
command -v "$1" >/dev/null 2>&1 || exit 127
umask 077
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
    """A TensorBoard this command started: its pid (and process group), port and log, on ``where``."""

    pid: int
    port: int
    log: str
    where: str


def logdir_for(chain: Chain, given: Optional[str]) -> str:
    """The log directory on the chain's host: ``given`` (relative to the workdir), else the
    job file's ``tensorboard_dir``, else workdir/runs."""
    path = given or chain.spec.tensorboard_dir or DEFAULT_LOGDIR
    return posixpath.normpath(posixpath.join(chain.spec.workdir, path))


def program_for(host: Optional[str], given: Optional[str]) -> list[str]:
    """The TensorBoard command: ``given``; else, here, this Python's ``tensorboard`` module
    (the ``tensorboard`` extra), and on a host ``tensorboard`` on its login PATH."""
    if given:
        return [given]
    if host:
        return ["tensorboard"]
    if importlib.util.find_spec("tensorboard") is None:
        raise UsageError(f"TensorBoard is not installed with chainrun: {INSTALL_HINT}")
    return [sys.executable, "-m", "tensorboard.main"]


def start(transport: Transport, program: Sequence[str], logdir: str, port: int, log: str) -> Server:
    """Start TensorBoard detached, on 127.0.0.1:``port`` (0: one free there), and wait until it serves."""
    where = transport.host or "localhost"
    args = [*program, "--logdir", logdir, "--host", "127.0.0.1", "--port", str(port)]
    result = transport.run(["bash", "-c", _LAUNCH, "chainrun-tensorboard", log, *args], timeout=60)
    if result.returncode == 127:
        raise UsageError(
            f"{program[0]}: not found on {where} (its login PATH); install TensorBoard there "
            f"(pip install tensorboard) or name it with --program PATH"
        )
    if not result.ok or not result.stdout.strip().isdigit():
        raise ChainrunError(f"cannot start TensorBoard on {where}: {result.describe()}")
    server = Server(int(result.stdout), 0, log, where)
    try:
        return _await_port(transport, server)
    except BaseException:
        stop(transport, server)
        raise


def _await_port(transport: Transport, server: Server) -> Server:
    deadline = time.monotonic() + START_TIMEOUT
    while True:
        output = (transport.read_file(server.log, LOG_LIMIT) or b"").decode(errors="replace")
        found = _SERVING.search(output)
        if found:
            return Server(server.pid, int(found.group(1)), server.log, server.where)
        if not running(transport, server):
            last = [line for line in output.splitlines() if line.strip()][-1:] or ["(no output)"]
            raise ChainrunError(
                f"TensorBoard ended as it started on {server.where}: {last[0].strip()} "
                f"(all of its output: {server.log})"
            )
        if time.monotonic() > deadline:
            raise ChainrunError(
                f"TensorBoard did not start serving within {START_TIMEOUT:g} s on {server.where}; "
                f"see {server.log}"
            )
        time.sleep(START_STEP)


def running(transport: Transport, server: Server) -> bool:
    return transport.run(["kill", "-0", str(server.pid)], timeout=30).ok


def stop(transport: Transport, server: Server) -> None:
    """Stop TensorBoard's process group (TERM, then KILL after 5 s)."""
    transport.run(["bash", "-c", _STOP, "chainrun-tensorboard-stop", str(server.pid)], timeout=60)


@contextmanager
def _stopped_by_signals() -> Iterator[None]:
    """SIGTERM and SIGHUP end the wait as Ctrl-C does, so that TensorBoard is stopped too."""

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    previous = {s: signal.signal(s, interrupt) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def serve(
    chain: Chain,
    port: Optional[int],
    logdir: Optional[str],
    program: Optional[str],
    echo: Callable[[str], None],
) -> int:
    """Serve ``chain``'s TensorBoard until Ctrl-C (0) or until TensorBoard ends by itself (1)."""
    host = chain.host
    command = program_for(host, program)
    transport = transport_for(host)
    directory = logdir_for(chain, logdir)
    where = host or "localhost"
    trust_run_dir(transport, chain.spec, chain.id, ran_there=chain.ran_on(chain.placed))
    log = posixpath.join(run_dir(chain.spec, chain.id), LOG_NAME)
    if transport.stat(directory) is None:
        echo(
            f"{directory} does not exist on {where} yet; TensorBoard shows it once the training writes there"
        )
    with _stopped_by_signals():
        server = start(transport, command, directory, 0 if host else (port or 0), log)
        forward: Optional[PortForward] = None
        try:
            if host:
                forward = _forward(transport, server, port, echo)
            url_port = forward.port if forward is not None else server.port
            echo(f"TensorBoard for chain {chain.id} ({directory} on {where}): http://127.0.0.1:{url_port}/")
            echo("Ctrl-C stops it")
            return _wait(transport, server, echo)
        except KeyboardInterrupt:
            return 0
        finally:
            if forward is not None:
                forward.close()
            try:
                stop(transport, server)
                echo(f"TensorBoard stopped (pid {server.pid} on {where})")
            except TransportError as exc:
                echo(
                    f"cannot stop TensorBoard (pid {server.pid} on {where}): {exc}; "
                    f"stop its process group there: kill -- -{server.pid}"
                )


def _forward(
    transport: Transport, server: Server, port: Optional[int], echo: Callable[[str], None]
) -> PortForward:
    """127.0.0.1:``port`` here (0: a free port) carried to TensorBoard's port on the host."""
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


def _wait(transport: Transport, server: Server, echo: Callable[[str], None]) -> int:
    """Until Ctrl-C; 1 when TensorBoard ends by itself. A host out of reach is waited out."""
    while True:
        time.sleep(CHECK_EVERY)
        try:
            if running(transport, server):
                continue
        except TransportError:
            continue  # the forward says so when a browser's request cannot get through
        echo(f"TensorBoard ended by itself on {server.where}; its output: {server.log}")
        return 1
