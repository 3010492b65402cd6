"""A snapshot chain's code directory, as its segments see it: the snapshot's own files, with
everything else of the workdir linked in, and what the command makes there moved back to the
workdir. Standard library alone: shipped beside the segment runner."""

from __future__ import annotations

import contextlib
import os


def link_code(code: str, work: str, prefix: str, names: set[str]) -> None:
    """The code of a snapshot chain holds only the snapshot (its paths: ``names``); everything
    else of the workdir is reachable there under its own name, as a link to the workdir's entry
    (within a directory both have, likewise), made before each segment. What the command made
    there beside the snapshot's own files moves to the workdir before and after each segment: a
    new directory where the workdir has none, a file always (an atomic save replaces the link to
    the workdir's file with a file of its own), so no output stays hidden in the code."""

    def entries(directory: str) -> list[str]:
        try:
            return [
                n
                for n in os.listdir(directory)
                if n not in (".git", "__pycache__") and not n.startswith(".chainrun")
            ]
        except OSError:
            return []

    for name in entries(code):
        entry = os.path.join(code, name)
        if os.path.islink(entry) or not os.path.exists(entry) or prefix + name in names:
            continue
        there = os.path.join(work, name)
        try:
            if os.path.isfile(entry):
                os.replace(entry, there)
            elif not os.path.lexists(there):
                os.rename(entry, there)
        except OSError:
            pass
    for name in entries(work):
        entry, here = os.path.join(work, name), os.path.join(code, name)
        if not os.path.lexists(here):
            with contextlib.suppress(OSError):
                os.symlink(entry, here)
        elif (
            os.path.isdir(here)
            and not os.path.islink(here)
            and os.path.isdir(entry)
            and not os.path.islink(entry)
        ):
            link_code(here, entry, prefix + name + "/", names)
