"""``chainrun ui`` and ``chainrun tensorboard``: the commands that serve a page until
Ctrl-C, here or on a login node through a forwarded port (registered on the group in
``cli``)."""

from __future__ import annotations

import sys
from typing import Optional

import click

from chainrun.errors import UsageError


def _say(line: str) -> None:
    click.echo(line, err=True)


@click.command()
@click.option(
    "--port",
    type=click.IntRange(0, 65535),
    default=None,
    help="The local port of the URL (default: the one it had last time, else a free one; 0: a free one).",
)
@click.option(
    "--new-token",
    is_flag=True,
    help="A new token in the URL: the one kept from last time (and every bookmark of it) stops working.",
)
@click.option(
    "--bind",
    default="127.0.0.1",
    metavar="ADDRESS",
    help="Listen on ADDRESS, not only this machine's loopback: whoever reaches it with the URL can cancel.",
)
@click.option(
    "--host",
    "ssh_host",
    default=None,
    metavar="ALIAS",
    help="Start the page on this SSH host (the login node where the service runs) and forward it here.",
)
@click.option(
    "--program",
    default=None,
    metavar="COMMAND",
    help="With --host: the chainrun command there (default: `chainrun` on its login PATH).",
)
@click.pass_context
def ui(
    ctx: click.Context,
    port: Optional[int],
    new_token: bool,
    bind: str,
    ssh_host: Optional[str],
    program: Optional[str],
) -> None:
    """Serve a web page of every chain: timelines, curves, accounting, sweeps compared.

    Prints one URL, with a random token that every request must carry; it serves
    until Ctrl-C. The port and the token are kept with the state and used again at
    the next start, so the URL stays the same unless --port or --new-token says
    otherwise. Only this machine can reach it unless --bind says otherwise.
    With --host, the page runs on that host over SSH and a local port is forwarded
    to it, surviving a dropped connection.

    Exits 0 on Ctrl-C; 2 for a bad option or a port that is taken; 1 when the host
    cannot start the page.
    """
    import ipaddress

    from chainrun import ui as page
    from chainrun.text import clip, escaped

    if program is not None and ssh_host is None:
        raise UsageError("--program names the chainrun command on the --host: give --host ALIAS too")
    if ssh_host is not None:
        from chainrun.ui import remote

        sys.exit(remote.serve(ssh_host, port or 0, new_token, program, _say, click.echo))
    try:
        bind = str(ipaddress.ip_address("127.0.0.1" if bind == "localhost" else bind))
    except ValueError:
        raise UsageError(f"--bind {clip(escaped(bind), 80)!r}: not an IP address of this machine") from None
    if not ipaddress.ip_address(bind).is_loopback:
        click.echo(
            f"chainrun: warning: the page listens on {bind}, not only this machine: anyone who can "
            "reach it and learns the URL sees every chain and can cancel them",
            err=True,
        )
    try:
        page.serve(ctx.obj, bind, port, new_token, click.echo, lambda note: _say(f"chainrun: {note}"))
    except OSError as exc:
        where = f"--bind {bind}" + ("" if port is None else f" --port {port}")
        raise UsageError(f"{where}: cannot listen there ({exc.strerror or exc})") from None


@click.command()
@click.argument("chain_ref", metavar="CHAIN")
@click.option(
    "--port",
    type=click.IntRange(1, 65535),
    default=None,
    help="The local port of the URL (default: a free one).",
)
@click.option(
    "--logdir",
    default=None,
    metavar="DIR",
    help="The log directory on the chain's host, relative to its workdir "
    "(default: the job file's tensorboard_dir, else runs).",
)
@click.option(
    "--program",
    default=None,
    metavar="PATH",
    help="The TensorBoard command there (default: this chainrun's on this machine, "
    "`tensorboard` on the host's login PATH).",
)
@click.pass_context
def tensorboard(
    ctx: click.Context, chain_ref: str, port: Optional[int], logdir: Optional[str], program: Optional[str]
) -> None:
    """Serve TensorBoard on CHAIN's logs at a local URL until Ctrl-C.

    For a chain on an SSH host, TensorBoard runs on that host (the login node,
    not a compute node) on a port free there, and a local port is forwarded to
    it over the SSH connection, also after a reconnect. Ctrl-C stops the
    forward and TensorBoard. Needs TensorBoard: pip install 'chainrun[tensorboard]'.

    Exits 0 after Ctrl-C; 1 when TensorBoard cannot start or ends by itself,
    or the host cannot be reached; 2 for an unknown CHAIN, a bad option, or no
    TensorBoard.
    """
    from chainrun import tensorboard as board
    from chainrun.store import Store

    store = Store(ctx.obj, readonly=True)
    try:
        chain = store.find(chain_ref)
    finally:
        store.close()
    sys.exit(board.serve(chain, port, logdir, program, click.echo))
