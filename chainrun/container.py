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

``container_gpus = true`` adds the runtime's GPU option: ``--nv`` for
Apptainer and Singularity. ch-run has none: it shares the host's ``/dev``, and
Charliecloud's documentation has the GPU driver's libraries put into the image
once, with ``ch-fromhost --nvidia IMAGE``; so for Charliecloud the image is
checked for them instead (``probe``).

This is what the job file allows, the words that run the command, the probe
that asks a machine whether it can run them, and how the runtimes say they
could not start the command (``start_failure``: their own exit statuses and
error lines); running the probe is ``jobfile``'s, through the transport.
"""

from __future__ import annotations

import posixpath
import re
from typing import Optional

from chainrun.model import JobSpec
from chainrun.text import visible

# The runtime's name in the job file, and the program that runs an image.
RUNTIMES = {"charliecloud": "ch-run", "apptainer": "apptainer", "singularity": "singularity"}
GPU_OPTIONS = {"charliecloud": (), "apptainer": ("--nv",), "singularity": ("--nv",)}
# How each runtime says it could not start the command: its exit statuses and the form of
# its last line. ch-run (Charliecloud's ch-run(1), "Exit status"): 31 for its own failure, 49
# when execvp failed; releases before 0.32 exit 1; every error line is "ch-run[PID]: error: ...".
# Apptainer and Singularity: sylog.Fatalf prints "FATAL:   ..." and exits 255.
_START_FAILURES = {
    "charliecloud": ((1, 31, 49), re.compile(r"ch-run\[\d+\]: error: ")),
    "apptainer": ((255,), re.compile(r"FATAL: ")),
    "singularity": ((255,), re.compile(r"FATAL: ")),
}
NOT_FOUND = 127  # bash: the runtime itself is not on PATH


def binds(spec: JobSpec) -> list[str]:
    """The directories bound into the container at their own paths: the workdir (for a code
    snapshot of a job in a subdirectory of its repository, the workdir's parent as many levels
    up, which its working copy links in), and the checkpoint directory when it lies outside."""
    top = spec.workdir
    for _ in spec.snapshot_subdir.split("/") if spec.snapshot_commit and spec.snapshot_subdir else ():
        top = posixpath.dirname(top)
    dirs = [top]
    if not within(spec.checkpoint_dir, top):
        dirs.append(spec.checkpoint_dir)
    return dirs


def argv(spec: JobSpec, cwd: str) -> list[str]:
    """The words that run ``bash -c COMMAND`` in ``cwd`` inside the container; [] without one."""
    if not spec.container:
        return []
    program = RUNTIMES[spec.container_runtime]
    options = [*(GPU_OPTIONS[spec.container_runtime] if spec.container_gpus else ()), *spec.container_options]
    if spec.container_runtime == "charliecloud":
        mounts = [w for d in binds(spec) for w in ("-b", d)]
        return [program, *mounts, "-c", cwd, *options, spec.container, "--"]
    mounts = [w for d in binds(spec) for w in ("--bind", d)]
    return [program, "exec", *mounts, "--pwd", cwd, *options, spec.container]


def probe(spec: JobSpec) -> tuple[str, list[str]]:
    """A shell script, and its arguments, that says on its stdout, one word a line, what stops
    the machine it runs on from running ``spec``'s container: ``no-runtime`` (not on its PATH),
    ``no-image`` (an image path that is not there), ``no-gpu-libraries`` (a Charliecloud image
    directory without the driver's libraries that ``container_gpus`` needs); nothing when
    nothing does."""
    assert spec.container
    script = (
        'command -v "$1" >/dev/null 2>&1 || echo no-runtime; '
        'case $2 in *://*) exit 0 ;; esac; [ -e "$2" ] || { echo no-image; exit 0; }; '
        'if [ "$3" = yes ] && [ -d "$2" ] && '
        '[ -z "$(find "$2" -maxdepth 4 -name "libcuda.so*" -print 2>/dev/null | head -n 1)" ]; '
        "then echo no-gpu-libraries; fi"
    )
    gpus = "yes" if spec.container_gpus and spec.container_runtime == "charliecloud" else "no"
    return script, [RUNTIMES[spec.container_runtime], spec.container, gpus]


def probe_problem(spec: JobSpec, answer: str, where: str) -> Optional[str]:
    """What ``probe``'s ``answer`` on ``where`` (a host, or "this machine") says stops
    the container from running there, in words that say what to do; None when nothing does."""
    words = answer.split()
    program = RUNTIMES[spec.container_runtime]
    if "no-runtime" in words:
        return (
            f"{program} ({spec.container_runtime}) is not on PATH on {where}, where the segments run: "
            "install it or load its module in that login shell's profile (module load ...)"
        )
    if "no-image" in words:
        where = f"{where}, where the segments run"
        return f"{spec.container}: no such image on {where}; give the image's path there"
    if "no-gpu-libraries" in words:
        return (
            f"container_gpus: the image {spec.container} has no GPU driver libraries (libcuda.so) and ch-run "
            f"has no GPU option; put them in once on a GPU node, as Charliecloud's documentation has it: "
            f"ch-fromhost --nvidia {spec.container}"
        )
    return None


def start_failure(spec: JobSpec, exit_code: Optional[int], tail: tuple[str, ...]) -> str:
    """The container runtime's own words when it could not start the command (the image or
    the runtime missing where the segment ran, an image it cannot use): every segment would
    fail the same way. "" for a segment without a container, or any other end."""
    if not spec.container or exit_code is None or not tail:
        return ""
    last = visible(tail[-1]).strip()
    program = RUNTIMES[spec.container_runtime]
    if exit_code == NOT_FOUND and re.search(rf"\b{re.escape(program)}: (command )?not found", last):
        return f"the container runtime {program} is not on PATH where the segment ran: {last}"
    codes, line = _START_FAILURES[spec.container_runtime]
    if exit_code in codes and line.match(last):
        return f"{program} could not start the command in {spec.container} (exit {exit_code}): {last}"
    return ""


def within(path: str, directory: str) -> bool:
    return path == directory or path.startswith(directory.rstrip("/") + "/")
