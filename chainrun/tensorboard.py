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
whole process group is stopped: TensorBoard and the data server it starts
(``hostserver``, which `chainrun ui --host` uses too).
TensorBoard on a compute node of a running job is not offered: it runs where
the chain's scheduler commands run.
"""

from __future__ import annotations

import importlib.util
import posixpath
import re
import sys
from collections.abc import Sequence
from typing import Callable, Optional

from chainrun import hostserver
from chainrun.errors import UsageError
from chainrun.model import Chain
from chainrun.rundir import trust_run_dir
from chainrun.schedulers.segment import run_dir
from chainrun.transport import Transport, transport_for

LOG_NAME = "tensorboard.log"  # in the chain's run directory
DEFAULT_LOGDIR = "runs"  # in the chain's workdir
INSTALL_HINT = "pip install 'chainrun[tensorboard]'"
START_TIMEOUT = 180.0  # seconds for TensorBoard to say where it serves (it imports TensorFlow if there)
_SERVING = re.compile(r"TensorBoard \S+ at http://[^\s/]+:(\d+)/")


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


def start(
    transport: Transport, program: Sequence[str], logdir: str, port: int, log: str
) -> hostserver.Server:
    """Start TensorBoard detached, on 127.0.0.1:``port`` (0: one free there), and wait until it serves."""
    args = [*program, "--logdir", logdir, "--host", "127.0.0.1", "--port", str(port)]
    missing = "install TensorBoard there (pip install tensorboard) or name it with --program PATH"
    return hostserver.start(transport, "TensorBoard", args, log, _SERVING, START_TIMEOUT, missing)


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

    def announce(url_port: int) -> None:
        echo(f"TensorBoard for chain {chain.id} ({directory} on {where}): http://127.0.0.1:{url_port}/")
        echo("Ctrl-C stops it")

    with hostserver.stopped_by_signals():
        try:
            server = start(transport, command, directory, 0 if host else (port or 0), log)
        except KeyboardInterrupt:
            return 0
        return hostserver.serve(transport, server, port, echo, announce)
