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

This is what the job file allows and the words that run the command; what a
machine has (a runtime on PATH, an image that can hold the binds) is looked
up by ``jobfile``.
"""

from __future__ import annotations

from chainrun.model import JobSpec

# The runtime's name in the job file, and the program that runs an image.
RUNTIMES = {"charliecloud": "ch-run", "apptainer": "apptainer", "singularity": "singularity"}


def binds(spec: JobSpec) -> list[str]:
    """The directories bound into the container at their own paths: the workdir, and the
    checkpoint directory when it lies outside it."""
    dirs = [spec.workdir]
    if not within(spec.checkpoint_dir, spec.workdir):
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


def within(path: str, directory: str) -> bool:
    return path == directory or path.startswith(directory.rstrip("/") + "/")
