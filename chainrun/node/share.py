"""A snapshot chain's code where it runs: its own working copy of the snapshot, with everything
else of the workdir (and of the workdir's parents, for a job in a subdirectory of its
repository) linked in, and every file the command makes or changes there brought home to the
workdir. Standard library alone, Python 3.8: shipped beside the segment runner, and run by
``chainrun gc`` on the host before it removes a copy (``python3 -c``, ``main``).

The snapshot is unpacked once per commit (``.chainrun/code/<commit>``, never run in); each
chain runs in its own copy of it (``.chainrun/<chain-id>/code``), so no chain of a sweep sees,
moves or replaces another's files. Before and after each segment (``bring_home``, ``link_in``):

- a file the command made (not the snapshot's), or a snapshot file it changed (its size or
  time differs from the unpacked snapshot's), moves to the same place in the workdir and is
  linked back, so the next segment sees it there;
- where the workdir's file is not what this chain left there (the user changed it, another
  chain put its own there), the chain's file goes beside it, ``NAME.chainrun-<chain-id>``,
  and is named in the segment's end marker (so in ``history``);
- what the workdir has that the copy lacks is linked in under its own name.

What went where is recorded in the copy (``.chainrun-home``): the workdir's file at a path is
this chain's to replace when it is the very file (device, inode) the chain last put or linked
there, or has the snapshot's own content.
"""

from __future__ import annotations

import contextlib
import errno
import filecmp
import json
import os
import shutil
import sys
from typing import Any, Optional

RECORD = ".chainrun-home"  # in a working copy: where each of its files went, as (dev, ino, path)
BESIDE = ".chainrun-"  # NAME.chainrun-<chain-id>: the chain's file, where the workdir's is not its own
_SKIPPED = (".git", "__pycache__")


class Copy:
    """One chain's working copy of a snapshot, and the workdir it brings its files home to."""

    def __init__(self, settings: dict[str, Any]) -> None:
        self.pristine: str = settings["pristine"]  # the snapshot as unpacked, shared, never run in
        self.root: str = settings["copy"]  # this chain's copy of it
        self.names_file: str = settings["names"]  # the snapshot's paths, NUL-separated
        self.subdir: str = settings["subdir"]  # where the command runs, from the top ("": the top)
        self.workdir: str = settings["workdir"]
        self.chain: str = settings["chain"]
        self.names: set[str] = set()
        self.record: dict[str, list[Any]] = {}
        self.moved: list[str] = []  # workdir paths a file was brought to
        self.beside: list[str] = []  # and where one was kept beside the workdir's own file
        self.left: list[str] = []  # copy paths that could not be brought home, and why

    def load(self) -> bool:
        """Read the snapshot's paths and this copy's record; False where the snapshot is not
        (yet, or any more) unpacked: nothing is moved then."""
        try:
            with open(self.names_file, "rb") as f:
                self.names = set(os.fsdecode(n) for n in f.read().split(b"\0") if n)
        except OSError:
            return False
        try:
            with open(os.path.join(self.root, RECORD)) as f:
                record = json.load(f)
            self.record = record if isinstance(record, dict) else {}
        except (OSError, ValueError):
            self.record = {}
        return True

    def levels(self) -> list[tuple[str, str, str, str, str]]:
        """Each directory of the copy paired with the workdir's: where the command runs with
        the workdir, then each parent up to the copy's top with the workdir's parent as many
        levels up; as (here, there, prefix of snapshot paths, name left out here, and there:
        the child that the level below pairs)."""
        parts = self.subdir.split("/") if self.subdir else []
        here = os.path.join(self.root, *parts)
        pairs = [(here, self.workdir, "".join(p + "/" for p in parts), "", "")]
        there = self.workdir
        for i in range(len(parts) - 1, -1, -1):
            up = os.path.dirname(there)
            if up == there:
                break
            pairs.append(
                (
                    os.path.join(self.root, *parts[:i]),
                    up,
                    "".join(p + "/" for p in parts[:i]),
                    parts[i],
                    os.path.basename(there),
                )
            )
            there = up
        return pairs

    def bring_home(self) -> None:
        """Bring every file the command made or changed in the copy to the workdir."""
        for here, there, prefix, skip, _ in self.levels():
            self._home(here, there, prefix, skip)
        self._save()

    def link_in(self) -> None:
        """Link what the workdir (and its parents) has and the copy lacks into the copy."""
        for here, there, prefix, _, skip in self.levels():
            self._link(here, there, prefix, skip)
        self._save()

    def _home(self, here: str, there: str, prefix: str, skip: str) -> None:
        for name in _entries(here):
            if name == skip:
                continue
            entry, target, path = os.path.join(here, name), os.path.join(there, name), prefix + name
            if os.path.islink(entry):
                continue  # the workdir's own, linked in (or the snapshot's own link)
            if os.path.isdir(entry):
                if path in self.names or (os.path.isdir(target) and not os.path.islink(target)):
                    self._home(entry, target, path + "/", "")
                elif not os.path.lexists(target):  # a directory the command made: moved whole
                    self._move(entry, target, path)
                else:  # the workdir has a file of that name
                    self._move(entry, target, path, aside=True)
            elif os.path.isfile(entry) and (path not in self.names or self._changed(entry, path)):
                self._move(entry, target, path, aside=not self._mine(target, path))

    def _link(self, here: str, there: str, prefix: str, skip: str) -> None:
        for name in _entries(there):
            if name == skip:
                continue
            entry, target, path = os.path.join(here, name), os.path.join(there, name), prefix + name
            if not os.path.lexists(entry):
                try:
                    os.symlink(target, entry)
                except OSError:
                    continue
                self._remember(path, target)
            elif _real_dir(entry) and _real_dir(target):
                self._link(entry, target, path + "/", "")

    def _changed(self, entry: str, path: str) -> bool:
        """A snapshot file the command rewrote: its size or time is not the unpacked one's
        (the copy keeps both). Where the snapshot's is gone, it counts as unchanged."""
        try:
            mine, theirs = os.stat(entry), os.stat(os.path.join(self.pristine, path))
        except OSError:
            return False
        return (mine.st_size, mine.st_mtime_ns) != (theirs.st_size, theirs.st_mtime_ns)

    def _mine(self, target: str, path: str) -> bool:
        """Whether the workdir's ``target`` is this chain's to replace: there is none, or it
        is the very file this chain last put or linked there, or it holds the snapshot's own
        content (the user's file as it was at submit)."""
        try:
            st = os.lstat(target)
        except OSError:
            return True
        if self.record.get(path) == [st.st_dev, st.st_ino, target]:
            return True
        pristine = os.path.join(self.pristine, path)
        with contextlib.suppress(OSError):
            if path in self.names and not os.path.islink(target):
                return filecmp.cmp(target, pristine, shallow=False)
        return False

    def _move(self, entry: str, target: str, path: str, aside: bool = False) -> None:
        """Move ``entry`` to ``target`` in the workdir (or beside it: ``aside``), replacing
        what is there, and link it back."""
        if aside:
            target += BESIDE + self.chain
        try:
            os.makedirs(os.path.dirname(target), exist_ok=True)
            try:
                os.replace(entry, target)
            except OSError as exc:
                if exc.errno != errno.EXDEV or os.path.isdir(entry):
                    raise
                _copy_over(entry, target)
            os.symlink(target, entry)
        except OSError as exc:
            self.left.append(f"{entry}: {exc.strerror or exc}")
            return
        self._remember(path, target)
        (self.beside if aside else self.moved).append(target)

    def _remember(self, path: str, target: str) -> None:
        with contextlib.suppress(OSError):
            st = os.lstat(target)
            self.record[path] = [st.st_dev, st.st_ino, target]

    def _save(self) -> None:
        tmp = os.path.join(self.root, RECORD + ".tmp")
        with contextlib.suppress(OSError):
            with open(tmp, "w") as f:
                json.dump(self.record, f)
            os.replace(tmp, os.path.join(self.root, RECORD))


def working_copy(pristine: str, root: str) -> None:
    """Make ``root`` a copy of ``pristine`` (times kept, so that a file the command changes
    can be told from one it did not), once: copied aside, then renamed into place. OSError
    when it cannot be made."""
    if os.path.isdir(root):
        return
    aside = f"{root}.{os.getpid()}.tmp"
    shutil.rmtree(aside, ignore_errors=True)
    shutil.copytree(pristine, aside, symlinks=True, ignore=shutil.ignore_patterns(".chainrun*"))
    try:
        os.rename(aside, root)
    except OSError:
        shutil.rmtree(aside, ignore_errors=True)
        if not os.path.isdir(root):  # else: another run of this chain made it first
            raise


def _copy_over(entry: str, target: str) -> None:
    """Across file systems: copy beside the target, put it in place, then drop the original."""
    aside = f"{target}.{os.getpid()}.tmp"
    shutil.copy2(entry, aside)
    os.replace(aside, target)
    os.unlink(entry)


def _entries(directory: str) -> list[str]:
    try:
        return [n for n in os.listdir(directory) if n not in _SKIPPED and not n.startswith(".chainrun")]
    except OSError:
        return []


def _real_dir(path: str) -> bool:
    return os.path.isdir(path) and not os.path.islink(path)


def share(settings: Optional[dict[str, Any]]) -> Optional[Copy]:
    """Before and after a segment: the copy made if needed, what the command left there
    brought home, and the workdir linked in; None for a chain without a snapshot, or whose
    snapshot is not unpacked."""
    if not settings:
        return None
    copy = Copy(settings)
    if not copy.load():
        return None
    working_copy(copy.pristine, copy.root)
    copy.bring_home()
    copy.link_in()
    return copy


def main(argv: list[str]) -> int:
    """``SETTINGS-JSON``: bring a copy's files home (for ``chainrun gc``, before it removes
    the copy); prints what moved, what went beside and what is left, as JSON."""
    copy = Copy(json.loads(argv[0]))
    if copy.load() and os.path.isdir(copy.root):
        copy.bring_home()
    print(json.dumps({"moved": copy.moved, "beside": copy.beside, "left": copy.left}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
