"""The run directory, ``WORKDIR/.chainrun``, where scripts, logs and markers live: made private,
trusted before anything in it is run, written there.

A workdir is often shared (a sticky scratch directory), so nothing is submitted from a run
directory that someone else could change.
"""

from __future__ import annotations

import contextlib
import posixpath
import secrets
import stat
from collections.abc import Callable
from typing import Optional

from chainrun.errors import TransportError, UnsafePathError
from chainrun.model import JobSpec
from chainrun.schedulers.segment import RUN_DIR_NAME, final_path, grace_path, run_dir
from chainrun.transport import FileInfo, Transport


def trust_run_dir(
    transport: Transport,
    spec: JobSpec,
    chain_id: Optional[str],
    create: bool = True,
    ran_there: bool = False,
) -> None:
    """Make sure ``WORKDIR/.chainrun`` (and the chain's directory in it, given ``chain_id``) is a
    directory only this user can change, creating what is missing (mode 0700) when ``create``.
    A workdir is often shared (a sticky scratch directory): an existing one that another user
    owns, that others may write, or that is a symlink is refused, and nothing is run from it.

    Once the chain has run there (``ran_there``) the workdir itself is never made again: a
    missing one was moved or purged, and the next segment would start over in an empty one."""
    if ran_there and transport.stat(spec.workdir) is None:
        raise UnsafePathError(
            f"workdir {spec.workdir} is gone (moved, removed or purged since the chain ran there); "
            "chainrun will not start over in an empty one: put it back and submit the job file again"
        )
    me = transport.user_id()
    paths = [posixpath.join(spec.workdir, RUN_DIR_NAME)]
    if chain_id is not None:
        paths.append(run_dir(spec, chain_id))
    for path in paths:
        info = transport.stat(path)
        if info is None and create:
            transport.makedirs(path, 0o700)
            info = transport.stat(path)  # and look again: another user may have been quicker
            if info is not None and path == paths[0] and info.uid == me:
                # Never part of the user's repository: `git status` stays as it was.
                transport.write_file(posixpath.join(path, ".gitignore"), b"*\n")
        if info is not None:
            _trust(info, path, me, directory=True)


def write_script(transport: Transport, path: str, script: str) -> None:
    """Write a script to submit (executable, this user's alone), and check right before
    submission that it is still a regular file of this user's alone."""
    transport.write_file(path, script.encode(), mode=0o700)
    _trust(transport.stat(path), path, transport.user_id(), directory=False)


def _trust(info: Optional[FileInfo], path: str, me: int, directory: bool) -> None:
    if info is None:
        problem = "is gone"
    elif stat.S_ISLNK(info.mode):
        problem = "is a symbolic link"
    elif directory and not info.is_dir:
        problem = "is not a directory"
    elif not directory and not info.is_file:
        problem = "is not a regular file"
    elif info.uid != me:
        problem = f"belongs to another user (uid {info.uid})"
    elif info.mode & 0o022:
        problem = f"can be changed by other users (mode {stat.S_IMODE(info.mode):o})"
    else:
        return
    raise UnsafePathError(
        f"{path} {problem}, so chainrun will not run scripts from it: remove it "
        "(or, if it is your own, `chmod go-w` it) and submit again"
    )


def write_final(transport: Transport, spec: JobSpec, chain_id: str) -> None:
    """The chain has ended: a successor that starts anyway finds this and exits at once."""
    transport.write_file(final_path(spec, chain_id), b"chain ended\n")


def probe_shared(
    spec: JobSpec, transports: Callable[[str], Transport], create: bool = False
) -> tuple[Optional[bool], str]:
    """Whether a pool's workdir is one directory on all its hosts (an NFS home or data drive),
    and the words for the plan: a probe file is written into it through the first host and
    looked for through the others. None when it cannot be found out (a host not reached, the
    workdir not there yet, and not ``create``-d): a chain then keeps to the host its
    checkpoint is on."""
    hosts = spec.scheduler.hosts
    probe = posixpath.join(spec.workdir, f".chainrun-probe-{secrets.token_hex(8)}")
    first = transports(hosts[0])
    try:
        if create:  # as the first segment's submission would (``trust_run_dir``)
            first.makedirs(spec.workdir, 0o700)
        if first.stat(spec.workdir) is None:
            return None, f"not known yet: {spec.workdir} is not on {hosts[0]}"
        first.write_file(probe, b"written through " + hosts[0].encode() + b"\n")
    except TransportError as exc:
        return None, f"not known: {hosts[0]} not reached ({exc})"
    missing, unreached = [], []
    try:
        for host in hosts[1:]:
            try:
                if transports(host).stat(probe) is None:
                    missing.append(host)
            except TransportError:
                unreached.append(host)
    finally:
        with contextlib.suppress(TransportError):
            first.remove(probe)
    if missing:
        return False, (
            f"not shared: a file written through {hosts[0]} is not seen through {', '.join(missing)}; "
            "a chain keeps to the host its checkpoint is on"
        )
    if unreached:
        return None, f"not known: {', '.join(unreached)} not reached; a chain keeps to the host it ran on"
    return True, f"shared by {', '.join(hosts)}: a chain may resume on any of them"


def write_grace(transport: Transport, spec: JobSpec, chain_id: str, seconds: int) -> None:
    """The grace the chain's later segments get (decide/grace.py): their wrapper reads it at start."""
    transport.write_file(grace_path(spec, chain_id), f"grace={seconds}\n".encode())
