"""Running the command inside a container: Charliecloud or Apptainer/Singularity.

The job file's ``container`` names the image (a Charliecloud image directory
or SquashFS file, an Apptainer ``.sif``, or a URI the runtime pulls). The
wrapper starts ``RUNTIME … IMAGE bash -c COMMAND`` in place of ``bash -c
COMMAND``: the workdir and checkpoint directory are bound at the same paths
and the command starts in the workdir; the job's environment (the
``CHAINRUN_*`` variables, ``inherit_env``, ``[env]``) passes in, as both
runtimes pass the host's environment by default. Both also exec the command
in place of themselves (``ch-run``) or forward signals to it (Apptainer), so
the walltime signal the wrapper sends reaches the command inside.
"""

from __future__ import annotations

import os
import posixpath
import shutil
from collections.abc import Mapping
from typing import Optional

from chainrun.model import JobSpec

# The runtime's name in the job file, and the program that runs an image.
RUNTIMES = {"charliecloud": "ch-run", "apptainer": "apptainer", "singularity": "singularity"}


def detect(environ: Mapping[str, str]) -> Optional[str]:
    """The first runtime found on ``environ``'s PATH (Charliecloud first), or None."""
    path = environ.get("PATH", os.defpath)
    return next((name for name, program in RUNTIMES.items() if shutil.which(program, path=path)), None)


def binds(spec: JobSpec) -> list[str]:
    """The directories bound into the container at their own paths: the workdir, and the
    checkpoint directory when it lies outside it."""
    dirs = [spec.workdir]
    if not _within(spec.checkpoint_dir, spec.workdir):
        dirs.append(spec.checkpoint_dir)
    return dirs


def argv(spec: JobSpec, cwd: str) -> list[str]:
    """The words that run ``bash -c COMMAND`` in ``cwd`` inside the container; [] without one."""
    if not spec.container:
        return []
    program = RUNTIMES[spec.container_runtime]
    if spec.container_runtime == "charliecloud":
        mounts = [w for d in binds(spec) for w in ("-b", d)]
        return [program, *mounts, "-c", cwd, *spec.container_options, spec.container, "--"]
    mounts = [w for d in binds(spec) for w in ("--bind", d)]
    return [program, "exec", *mounts, "--pwd", cwd, *spec.container_options, spec.container]


def image_problem(spec: JobSpec) -> Optional[str]:
    """What stops a Charliecloud image directory on this machine from holding the bind mounts:
    ch-run mounts only at paths the image has (or under its /tmp, which is the host's), unless
    it may write the image (``-w``). None when nothing does, or it cannot be known here."""
    image = spec.container
    if spec.container_runtime != "charliecloud" or not image or not os.path.isdir(image):
        return None
    options = set(spec.container_options)
    if options & {"-w", "--write"}:
        return None
    host_tmp = not options & {"-t", "--private-tmp"}
    for directory in binds(spec):
        if os.path.isdir(os.path.join(image, directory.lstrip("/"))):
            continue
        if host_tmp and _within(directory, "/tmp"):
            continue
        return (
            f"the image has no {directory} to bind it at: make it there "
            f"(mkdir -p {posixpath.join(image, directory.lstrip('/'))}), "
            'or let ch-run make it with container_options = ["-w"]'
        )
    return None


def _within(path: str, directory: str) -> bool:
    return path == directory or path.startswith(directory.rstrip("/") + "/")
