"""Code snapshots (``snapshot = "git"``): every segment runs the code as it was at submit.

At submit the git repository holding the code (the workdir's, or for a chain
on a remote ``host`` the job file's on this machine) is captured as it is:
committed, uncommitted and untracked-but-not-ignored files, through a
temporary index, so the user's index, working tree and branch are never
touched. The commit is kept under ``refs/chainrun/<chain-id>`` (``git log
refs/chainrun/<id>`` finds it) and unpacked once per commit into
``WORKDIR/.chainrun/code/<commit>/`` where the chain runs (over SFTP for a
remote host), which every segment then runs from, with everything else of the
workdir linked in (the segment runner, ``node.runner``). What chainrun reads there (the
checkpoint and TensorBoard directories, the progress file, the run directory)
stays outside the snapshot. ``chainrun gc`` (``chainrun.gc``) removes the refs and
code of chains that ended long ago.
"""

from __future__ import annotations

import os
import posixpath
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Optional

from chainrun.errors import ChainrunError, TransportError
from chainrun.model import JobSpec
from chainrun.rundir import trust_run_dir
from chainrun.schedulers.segment import RUN_DIR_NAME, code_names, code_root
from chainrun.transport import LocalTransport, Transport

REF_PREFIX = "refs/chainrun/"
GIT_TIMEOUT = 300


class SnapshotError(ChainrunError):
    """The code cannot be captured (no repository, git failed); nothing is stored."""


@dataclass(frozen=True)
class Snapshot:
    repo: str  # the repository's top directory
    commit: str
    subdir: str  # where the command runs, relative to the repository's top ("" for the top)


def source_dir(spec: JobSpec) -> str:
    """The directory on this machine whose repository is captured."""
    if spec.scheduler.remote:
        return os.path.dirname(spec.source) or "."
    return spec.workdir


def repository(directory: str) -> Optional[str]:
    """The top of the git repository holding ``directory``; None when there is none."""
    try:
        out = _git(directory, "rev-parse", "--show-toplevel")
    except SnapshotError:
        return None
    return out.strip() or None


def capture(spec: JobSpec) -> Snapshot:
    """Commit the repository as it is now, without touching its index, tree or branch."""
    where = source_dir(spec)
    top = repository(where)
    if top is None:
        raise SnapshotError(f'{where} is not inside a git repository; snapshot = "git" needs one')
    subdir = os.path.relpath(os.path.realpath(where), os.path.realpath(top))
    subdir = "" if subdir == "." else subdir
    # What chainrun reads and writes in the workdir is never code: the checkpoint and
    # TensorBoard directories, the progress file, .chainrun (for a remote host, the same names
    # relative to the job file's directory, which stands for the workdir there).
    excluded = []
    run_dir = posixpath.join(spec.workdir, RUN_DIR_NAME)
    for p in (spec.checkpoint_dir, spec.tensorboard_dir, spec.progress_file, run_dir):
        rel = posixpath.relpath(p, spec.workdir) if p else "."
        if rel not in (".", "..") and not rel.startswith("../"):
            excluded.append(os.path.join(where, rel))
    pathspec = ["."] + [f":(top,exclude){os.path.relpath(p, top)}" for p in excluded if _inside(p, top)]
    with tempfile.TemporaryDirectory(prefix="chainrun-snapshot-") as tmp:
        env = {"GIT_INDEX_FILE": os.path.join(tmp, "index")}
        head = _head(top)
        if head:
            _git(top, "read-tree", head, env=env)
        _git(top, "add", "--all", "--", *pathspec, env=env)
        tree = _git(top, "write-tree", env=env).strip()
    parents = ["-p", head] if head else []
    message = f"chainrun snapshot of {top} for chain {spec.name}"
    commit = _git(top, "commit-tree", tree, *parents, "-m", message, env=_identity(top)).strip()
    return Snapshot(top, commit, subdir)


def pin(snap: Snapshot, chain_id: str) -> None:
    """Keep the commit reachable (and findable) as ``refs/chainrun/<chain-id>``."""
    _git(snap.repo, "update-ref", REF_PREFIX + chain_id, snap.commit)


def unpin(spec: JobSpec, chain_id: str) -> bool:
    """Drop ``refs/chainrun/<chain-id>`` from the repository the chain's code came from;
    False when there is none (the repository or the ref is gone)."""
    top = repository(source_dir(spec))
    ref = REF_PREFIX + chain_id
    if top is None or not _has(top, ref):
        return False
    _git(top, "update-ref", "-d", ref)
    return True


def remove(transport: Transport, target: str) -> None:
    """Delete a snapshot's unpacked code, or a chain's working copy of it, where it ran."""
    result = transport.run(["rm", "-rf", "--", target], timeout=GIT_TIMEOUT)
    if not result.ok:
        raise TransportError(f"removing {target} failed: {result.describe()}")


def prepare(transport: Transport, spec: JobSpec) -> tuple[JobSpec, Optional[Snapshot]]:
    """For a snapshot chain, capture the code and unpack it where the chain runs; the spec
    then names the commit. Before the chain is stored: a failure here stores nothing."""
    if not spec.snapshot:
        return spec, None
    snap = capture(spec)
    spec = replace(spec, snapshot_commit=snap.commit, snapshot_subdir=snap.subdir)
    trust_run_dir(transport, spec, None)
    deliver(transport, spec, snap)
    return spec, snap


def deliver(transport: Transport, spec: JobSpec, snap: Snapshot) -> None:
    """Unpack the commit into ``WORKDIR/.chainrun/code/<commit>`` where the chain runs, once."""
    target = code_root(spec)
    done = code_names(spec)
    if transport.stat(done) is not None:
        return  # an earlier chain of the same code unpacked it
    with tempfile.TemporaryDirectory(prefix="chainrun-snapshot-") as tmp:
        archive = Path(tmp) / "code.tar"
        _git(snap.repo, "archive", "--format=tar", "-o", str(archive), snap.commit)
        data = archive.read_bytes()
    names = _git(snap.repo, "ls-tree", "-r", "-t", "-z", "--name-only", snap.commit).encode()
    tar = target + ".tar"
    try:
        transport.makedirs(target, 0o700)
        transport.write_file(tar, data)
        result = transport.run(["tar", "-x", "-f", tar, "-C", target], timeout=GIT_TIMEOUT)
        if not result.ok:
            raise TransportError(f"unpacking the code snapshot failed: {result.describe()}")
        transport.write_file(done, names)  # last: a partly unpacked snapshot is unpacked again
    finally:
        transport.run(["rm", "-f", "--", tar], timeout=60)


def deliver_to(transport: Transport, spec: JobSpec) -> None:
    """Unpack a snapshot chain's code on the pool host a segment is placed on (``transport``),
    unless it is there already (the workdir shared, or unpacked before): from the commit
    kept in the repository on this machine."""
    if not spec.snapshot_commit:
        return
    done = code_names(spec)
    if transport.stat(done) is not None:
        return
    top = repository(source_dir(spec))
    if top is None:
        raise SnapshotError(
            f"{source_dir(spec)} is no longer a git repository: the code snapshot cannot be unpacked"
        )
    trust_run_dir(transport, spec, None)
    deliver(transport, spec, Snapshot(top, spec.snapshot_commit, spec.snapshot_subdir))


def _head(top: str) -> Optional[str]:
    try:
        return _git(top, "rev-parse", "--verify", "-q", "HEAD").strip() or None
    except SnapshotError:
        return None  # a repository with no commit yet


def _has(top: str, ref: str) -> bool:
    try:
        _git(top, "rev-parse", "--verify", "-q", ref)
    except SnapshotError:
        return False
    return True


def _identity(top: str) -> dict[str, str]:
    """Who the snapshot commit is by: the user's git identity, else chainrun's."""
    env = {}
    for kind, key in (("NAME", "user.name"), ("EMAIL", "user.email")):
        try:
            value = _git(top, "config", key).strip()
        except SnapshotError:
            value = ""
        fallback = "chainrun" if kind == "NAME" else "chainrun@localhost"
        env[f"GIT_AUTHOR_{kind}"] = env[f"GIT_COMMITTER_{kind}"] = value or fallback
    return env


def _inside(path: str, top: str) -> bool:
    rel = os.path.relpath(os.path.realpath(path), os.path.realpath(top))
    return rel != "." and not rel.startswith("..")


def _git(repo: str, *args: str, env: Optional[dict[str, str]] = None) -> str:
    try:
        result = LocalTransport().run(["git", "-C", repo, *args], env=env, timeout=GIT_TIMEOUT)
    except TransportError as exc:  # it did not answer in time
        raise SnapshotError(f"git {args[0]} in {repo}: {exc}") from None
    if not result.ok:
        problem = " ".join((result.stderr or result.stdout).split()) or f"exit {result.returncode}"
        raise SnapshotError(f"git {args[0]} in {repo} failed: {problem}")
    return result.stdout
