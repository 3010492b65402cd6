"""``chainrun ui`` and ``chainrun tensorboard``: the commands that serve a page until
Ctrl-C, here or on a login node through a forwarded port (registered on the group in
``cli``)."""

from __future__ import annotations

import sys
from typing import Optional

import click

from chainrun.errors import UsageError


@click.command()
@click.option(
    "--port",
    type=click.IntRange(0, 65535),
    default=0,
    help="The local port of the URL (default: a free one).",
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
def ui(ctx: click.Context, port: int, bind: str, ssh_host: Optional[str], program: Optional[str]) -> None:
    """Serve a web page of every chain: timelines, curves, accounting, sweeps compared.

    Prints one URL, with a random token that every request must carry; it serves
    until Ctrl-C. Only this machine can reach it unless --bind says otherwise.
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

        sys.exit(remote.serve(ssh_host, port, program, lambda line: click.echo(line, err=True), click.echo))
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
        page.serve(ctx.obj, bind, port, lambda url: click.echo(url))
    except OSError as exc:
        raise UsageError(
            f"--bind {bind} --port {port}: cannot listen there ({exc.strerror or exc})"
        ) from None


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
