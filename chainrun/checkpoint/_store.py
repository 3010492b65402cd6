"""The checkpoints of one run in one directory: naming, commit order, retention, and the restore order.

Each save is an *entry*: a main file named ``<prefix>-<seq>-e<epoch>-s<step><suffix>``
(seq counts up past every file present, so a save never replaces an existing
file and names sort by age), a
``<main>.sha256`` companion, and for TensorFlow the
data files that share the stem. A save commits in this order, each step
durable before the next: the files, then the sidecar, which records their
size and digest: the sha256 of the whole file, or (``save()``'s own files) the
root of a tree of chunks hashed side by side (``_digest``). The companion
repeats that digest (a whole-file sha256 in ``sha256sum -c`` format; a tree as
``sha256-tree:<chunk>:<root>  <name>`` and then each chunk's sha256, one a
line, which name the corrupt chunk when the root differs) for when the sidecar has
moved on: a helper thread writes it after the commit, then applies
retention, so neither a small file's fsync nor deleting a large old file holds
up the caller. Restore tries the file the sidecar names, then older entries
that have a companion, newest first, verifying each sha256; a fallback warns,
and no usable checkpoint is an error rather than a silent fresh start.
Retention keeps the last ``keep`` committed entries and never deletes the one
the sidecar names. A writer killed before its helper thread ran leaves the
committed entry without its companion and one entry too many: the next
writer's ``prepare`` writes the companion from the sidecar and prunes.
"""

from __future__ import annotations

import os
import re
import shutil
import threading
import time
import warnings
from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Any, Callable, NamedTuple, Optional, Union

from chainrun.checkpoint._atomic import Writer, atomic_write, cleanup_temp_files
from chainrun.checkpoint._digest import CHUNK, FileDigest, file_digest, root_of
from chainrun.checkpoint._progress import SIDECAR_NAME, load_progress, write_progress

DEFAULT_DIRECTORY = "checkpoints"
COMPANION_SUFFIX = ".sha256"
_TREE_RE = re.compile(r"^sha256-tree:([1-9][0-9]*):([0-9a-f]{64})$")
_HEX_RE = re.compile(r"^[0-9a-f]{64}$")
_PREFIX_RE = re.compile(r"^[A-Za-z0-9_.-]+$")


class CheckpointError(RuntimeError):
    """No usable checkpoint where one was expected (all corrupt, missing files)."""


class CheckpointWarning(UserWarning):
    """Restore fell back to an older checkpoint, or started fresh because the caller allowed it."""


class Entry(NamedTuple):
    """One saved checkpoint as found in the directory."""

    seq: int
    epoch: int
    step: int
    name: str


class Saved(NamedTuple):
    """A committed save: the sidecar names ``file`` now. ``sha256`` is the file's whole sha256
    when ``chunk`` is 0, else the root of its tree of ``chunk``-byte pieces (``_digest``)."""

    file: str
    path: str
    epoch: int
    step: int
    size: int
    sha256: str
    done: bool
    chunk: int = 0


class Resume(NamedTuple):
    """What ``restore()`` resumed from; ``fresh`` when there was nothing to resume.

    ``epoch`` is the number of completed epochs and ``step`` the batches done in
    the epoch in progress: continue with ``range(resume.epoch, epochs)`` and skip
    ``resume.skip(epoch)`` batches of that first epoch. ``rejected`` says why
    newer checkpoints were passed over; ``fell_back`` is true when any were.
    """

    epoch: int = 0
    step: int = 0
    file: Optional[str] = None
    path: Optional[str] = None
    fresh: bool = True
    fell_back: bool = False
    rejected: tuple[str, ...] = ()
    done: bool = False
    metrics: Mapping[str, Any] = MappingProxyType({})
    extras: Mapping[str, Any] = MappingProxyType({})

    def loaded(self, saved: Mapping[str, Any]) -> Resume:
        """This resume with the epoch, step, extras and metrics a checkpoint saved (the metrics
        over those its sidecar carried from earlier saves)."""
        return self._replace(
            epoch=saved["epoch"],
            step=saved["step"],
            extras=saved.get("extras") or {},
            metrics={**self.metrics, **(saved.get("metrics") or {})},
        )

    def global_step(self, steps_per_epoch: int) -> int:
        """The batches trained since the run began: the global step of the first batch this
        segment trains. Log from it on, and tell the logger that whatever a crashed segment
        logged from it on is void: ``SummaryWriter(..., purge_step=start.global_step(len(loader)))``."""
        return self.epoch * steps_per_epoch + self.step

    def skip(self, epoch: int) -> int:
        """Batches of ``epoch`` already trained before the checkpoint (0 for any other epoch)."""
        return self.step if epoch == self.epoch else 0

    def describe(self) -> str:
        """One line for the log: ``resumed from ckpt-... (epoch 3) at step 17`` or ``fresh start``.

        The epoch is the number of completed epochs; the step, when there is one,
        the batches already done of the next.
        """
        if self.fresh:
            return "fresh start (no checkpoint to resume)"
        text = f"resumed from {self.file} (epoch {self.epoch})"
        if self.step:
            text += f" at step {self.step}"
        if self.fell_back:
            text += f" after skipping {len(self.rejected)} unusable checkpoint(s)"
        return text


class _Candidate(NamedTuple):
    name: str
    epoch: int
    step: int
    digest: FileDigest
    size: Optional[int]
    progress: Optional[dict[str, Any]]


def resolve_directory(directory: Optional[Union[str, os.PathLike[str]]]) -> str:
    """The checkpoint directory: the argument, else ``CHAINRUN_CHECKPOINT_DIR``, else ``checkpoints``.

    Warns when an explicit directory differs from the one chainrun watches.
    """
    env = os.environ.get("CHAINRUN_CHECKPOINT_DIR", "").strip()
    if directory is None:
        return os.path.abspath(env or DEFAULT_DIRECTORY)
    path = os.path.abspath(os.fspath(directory))
    if env and os.path.abspath(env) != path:
        warnings.warn(
            f"checkpoints go to {path} but chainrun reads progress from CHAINRUN_CHECKPOINT_DIR={env}: "
            "pass no directory (or the same one as checkpoint_dir in the job file)",
            CheckpointWarning,
            stacklevel=3,
        )
    return path


class CheckpointDir:
    """Names, commits, prunes and lists the checkpoints of one run (framework-neutral).

    The PyTorch and TensorFlow helpers build on it; a script with its own
    serialization can use it directly: ``saved = store.save(writer, epoch=e, step=s)``
    and ``resume = store.restore(load)``.
    """

    def __init__(
        self,
        directory: Optional[Union[str, os.PathLike[str]]] = None,
        *,
        prefix: str = "ckpt",
        suffix: str = ".pt",
        keep: int = 3,
    ) -> None:
        if not _PREFIX_RE.match(prefix):
            raise ValueError(f"checkpoint prefix {prefix!r} may only hold letters, digits, '.', '_' and '-'")
        if not suffix.startswith(".") or not _PREFIX_RE.match(suffix):
            raise ValueError(
                f"checkpoint suffix {suffix!r} must start with '.' and hold only letters, digits, "
                "'.', '_' and '-'"
            )
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise ValueError(f"keep={keep!r}: keep at least 1 checkpoint")
        self.path = resolve_directory(directory)
        self.prefix = prefix
        self.suffix = suffix
        self.keep = keep
        self._name_re = re.compile(rf"^{re.escape(prefix)}-(\d{{6,}})-e(\d+)-s(\d+){re.escape(suffix)}$")
        # Every file of an entry, finished or not: main, companion, data files, temp dirs.
        self._stem_re = re.compile(rf"^{re.escape(prefix)}-(\d{{6,}})-e\d+-s\d+[._]")
        self._last_seq = 0
        self._prepared = False
        self._retention: Optional[threading.Thread] = None

    def __repr__(self) -> str:
        return (
            f"CheckpointDir({self.path!r}, prefix={self.prefix!r}, suffix={self.suffix!r}, keep={self.keep})"
        )

    # -- layout -----------------------------------------------------------------------
    def prepare(self) -> None:
        """Get ready to write a new entry: finish the previous save's retention, so that a new
        entry never joins one retention has yet to delete (at most ``keep`` + 1 entries ever exist).

        The first time, also create the directory and finish what interrupted saves left: remove
        temp files of dead writers and uncommitted checkpoints, write the companion of the committed
        checkpoint when its writer died before it could, and remove committed checkpoints past
        ``keep`` whose writer died before retention ran (left unchecked, writers killed between
        commit and prune would pile them up one per segment).

        One process writes a checkpoint directory; restore() changes nothing.
        """
        self.wait()
        if self._prepared:
            return
        os.makedirs(self.path, exist_ok=True)
        cleanup_temp_files(self.path)
        self._drop_uncommitted()
        self._complete_committed()
        self.prune()
        self._prepared = True

    def _complete_committed(self) -> None:
        """Write the committed checkpoint's companion from the sidecar when it is missing."""
        try:
            progress = load_progress(self.path)
        except ValueError:
            return
        if progress is None or self.parse(progress["file"]) is None:
            return
        name = progress["file"]
        if os.path.exists(os.path.join(self.path, name + COMPANION_SUFFIX)):
            return
        if not os.path.exists(os.path.join(self.path, name)):
            return  # nothing to vouch for; restore reports the missing file
        # The chunk digests were the dead writer's alone: this companion has the root only.
        self._write_companion(name, FileDigest(progress["sha256"], progress["sha256_chunk"]))

    def _write_companion(self, name: str, digest: FileDigest) -> None:
        if digest.chunk:
            text = "".join(
                [f"sha256-tree:{digest.chunk}:{digest.sha256}  {name}\n"] + [f"{c}\n" for c in digest.chunks]
            )
        else:
            text = f"{digest.sha256}  {name}\n"
        atomic_write(os.path.join(self.path, name + COMPANION_SUFFIX), text.encode())

    def _drop_uncommitted(self) -> None:
        try:
            progress = load_progress(self.path)
        except ValueError:
            return  # an unreadable sidecar: leave every candidate for restore
        try:
            names = os.listdir(self.path)
        except FileNotFoundError:
            return
        committed = None if progress is None else self.parse(progress["file"])
        present = set(names)
        groups: dict[int, list[str]] = {}
        for name in names:
            m = self._stem_re.match(name)
            if m is not None:
                groups.setdefault(int(m.group(1)), []).append(name)
        for seq, group in groups.items():
            if committed is not None:
                stale = seq > committed.seq
            else:  # never committed: only entries with a companion could still be restored
                stale = not any(self.parse(n) is not None and n + COMPANION_SUFFIX in present for n in group)
            if stale:
                self._delete(group)

    def parse(self, name: str) -> Optional[Entry]:
        """The entry a file name stands for, or None for any other file."""
        m = self._name_re.match(name)
        if m is None:
            return None
        return Entry(int(m.group(1)), int(m.group(2)), int(m.group(3)), name)

    def entries(self) -> list[Entry]:
        """All checkpoint main files in the directory, oldest first (committed or not)."""
        try:
            names = os.listdir(self.path)
        except FileNotFoundError:
            return []
        found = [e for e in map(self.parse, names) if e is not None]
        return sorted(found)

    def new_name(self, epoch: int, step: int) -> str:
        """A fresh, never used name for a checkpoint at ``epoch``/``step``."""
        for key, value in (("epoch", epoch), ("step", step)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{key} must be a non-negative integer, got {value!r}")
        try:
            names = os.listdir(self.path)
        except FileNotFoundError:
            names = []
        # Leftovers of interrupted saves count too: a name is never reused.
        seqs = [int(m.group(1)) for m in map(self._stem_re.match, names) if m is not None]
        committed = self._committed_entry()
        if committed is not None:
            seqs.append(committed.seq)
        seq = max([*seqs, self._last_seq]) + 1
        self._last_seq = seq
        return f"{self.prefix}-{seq:06d}-e{epoch:04d}-s{step:06d}{self.suffix}"

    # -- saving -----------------------------------------------------------------------
    def save(
        self,
        writer: Union[bytes, Writer],
        *,
        epoch: int,
        step: int,
        done: bool = False,
        metrics: Optional[Mapping[str, Any]] = None,
        ready: Optional[Callable[[], None]] = None,
    ) -> Saved:
        """Write a new checkpoint atomically with ``writer`` (bytes or ``f -> None``) and commit it.

        ``ready``, when given, is called once the file is durable and before it is committed:
        when it raises, the file stays uncommitted (restore passes it over; the next save's
        ``prepare()`` deletes it) and the previous checkpoint stays in force."""
        began = time.monotonic()
        self.prepare()
        name = self.new_name(epoch, step)
        written = atomic_write(os.path.join(self.path, name), writer, chunk=CHUNK)
        if ready is not None:
            ready()
        return self.commit(
            name,
            epoch=epoch,
            step=step,
            size=written.size,
            sha256=written.sha256,
            chunk=written.chunk,
            chunks=written.chunks,
            done=done,
            metrics=metrics,
            began=began,
        )

    def commit(
        self,
        name: str,
        *,
        epoch: int,
        step: int,
        size: int,
        sha256: str,
        done: bool = False,
        metrics: Optional[Mapping[str, Any]] = None,
        began: Optional[float] = None,
        chunk: int = 0,
        chunks: Sequence[str] = (),
    ) -> Saved:
        """Make a durable checkpoint file the latest by writing the sidecar; companion and retention follow.

        ``sha256`` is the file's whole sha256, or with ``chunk`` > 0 the root of its tree of
        ``chunk``-byte pieces, whose digests ``chunks`` go to the companion.
        ``began`` (``time.monotonic()`` when the save began) puts how long it took in the sidecar.

        The companion and retention are written and applied by a helper thread once the sidecar
        is written (``wait()`` finishes it); the next save's ``prepare()``, ``prune()`` and
        ``restore()`` wait for it.
        """
        self.prepare()
        write_progress(
            self.path,
            epoch=epoch,
            step=step,
            file=name,
            size=size,
            sha256=sha256,
            sha256_chunk=chunk,
            done=done,
            metrics=metrics,
            save_seconds=None if began is None else time.monotonic() - began,
        )
        digest = FileDigest(sha256, chunk, tuple(chunks))
        self._retention = threading.Thread(
            target=self._retain, args=(name, digest), name="chainrun-retention"
        )
        self._retention.start()
        return Saved(name, os.path.join(self.path, name), epoch, step, size, sha256, done, chunk)

    def wait(self) -> None:
        """Finish the retention the last commit started (a no-op when it is done)."""
        thread, self._retention = self._retention, None
        if thread is not None:
            thread.join()

    def _retain(self, committed: str, digest: FileDigest) -> None:
        # Not a daemon thread: the interpreter finishes it before exiting.
        try:
            self._write_companion(committed, digest)
            self._prune(committed)
        except OSError as exc:  # the checkpoint is committed; what is left is the next prepare's
            warnings.warn(
                f"chainrun: could not write the companion of {committed} or delete old checkpoints "
                f"in {self.path}: {exc}",
                CheckpointWarning,
                stacklevel=1,
            )

    def prune(self, committed: Optional[str] = None) -> list[str]:
        """Delete all but the last ``keep`` committed checkpoints; returns the names removed.

        The checkpoint the sidecar names (``committed``, read from the sidecar
        when not given) is never deleted, nor anything newer (a save in
        flight). Leftovers of interrupted saves older than it go too.
        """
        self.wait()
        return self._prune(committed)

    def _prune(self, committed: Optional[str]) -> list[str]:
        entry = self._committed_entry() if committed is None else self.parse(committed)
        if entry is None:
            return []
        try:
            names = os.listdir(self.path)
        except FileNotFoundError:
            return []
        present = set(names)
        groups: dict[int, list[str]] = {}
        for name in names:
            m = self._stem_re.match(name)
            if m is not None and int(m.group(1)) < entry.seq:
                groups.setdefault(int(m.group(1)), []).append(name)
        complete = sorted(
            (
                e.seq
                for e in map(self.parse, names)
                if e is not None and e.seq < entry.seq and e.name + COMPANION_SUFFIX in present
            ),
            reverse=True,
        )
        kept = set(complete[: self.keep - 1])
        removed: list[str] = []
        for seq in sorted(groups):
            if seq not in kept:
                removed.extend(self._delete(groups[seq]))
        return removed

    def _delete(self, names: list[str]) -> list[str]:
        # Companion first, main file last: an entry half deleted by a crash is
        # then unverifiable, so restore skips it and the next prune finishes.
        def order(name: str) -> int:
            if name.endswith(self.suffix + COMPANION_SUFFIX):
                return 0
            return 2 if self.parse(name) is not None else 1

        removed = []
        for name in sorted(names, key=order):
            path = os.path.join(self.path, name)
            try:
                if os.path.isdir(path) and not os.path.islink(path):
                    shutil.rmtree(path)
                else:
                    os.unlink(path)
            except FileNotFoundError:
                continue
            removed.append(name)
        return removed

    # -- restoring ----------------------------------------------------------------------
    def restore(self, load: Callable[[str], Any], *, allow_fresh: bool = False) -> tuple[Resume, Any]:
        """Load the newest good checkpoint with ``load(path)``; returns ``(resume, what load returned)``.

        Newer checkpoints that are missing, fail their sha256 or fail to load
        are skipped with a ``CheckpointWarning``. An empty directory is a fresh
        start (``resume.fresh``, value None). When checkpoints exist but none is
        usable, ``CheckpointError`` is raised, unless ``allow_fresh``: then it
        warns and starts fresh.
        """
        self.wait()
        candidates, rejected = self._candidates()
        for cand in candidates:
            path = os.path.join(self.path, cand.name)
            problem = _verify(path, cand)
            if problem is None:
                try:
                    value = load(path)
                except CheckpointError:
                    raise  # the loader's verdict that no fallback can help (wrong settings)
                except Exception as exc:  # any other failure to load means: try the previous one
                    problem = f"does not load ({type(exc).__name__}: {exc})"
            if problem is not None:
                rejected.append(f"{cand.name}: {problem}")
                continue
            progress = cand.progress or {}
            resume = Resume(
                epoch=cand.epoch,
                step=cand.step,
                file=cand.name,
                path=path,
                fresh=False,
                fell_back=bool(rejected),
                rejected=tuple(rejected),
                done=bool(progress.get("done", False)),
                metrics=dict(progress.get("metrics") or {}),
            )
            if rejected:
                warnings.warn(
                    f"chainrun: {resume.describe()} in {self.path}; passed over: " + "; ".join(rejected),
                    CheckpointWarning,
                    stacklevel=3,
                )
            return resume, value
        if not rejected:
            return Resume(), None
        message = f"no usable checkpoint in {self.path}: " + "; ".join(rejected)
        if not allow_fresh:
            raise CheckpointError(
                message
                + ". Fix or restore the files, or restore(allow_fresh=True) to start over from scratch"
            )
        warnings.warn(
            f"chainrun: {message}; starting fresh because allow_fresh=True", CheckpointWarning, stacklevel=3
        )
        return Resume(rejected=tuple(rejected)), None

    def _committed_entry(self) -> Optional[Entry]:
        try:
            progress = load_progress(self.path)
        except ValueError:
            return None
        return None if progress is None else self.parse(progress["file"])

    def _candidates(self) -> tuple[list[_Candidate], list[str]]:
        """What restore tries, newest first, and the problems found on the way."""
        problems: list[str] = []
        candidates: list[_Candidate] = []
        newest_seq: Optional[int] = None
        try:
            progress = load_progress(self.path)
        except (ValueError, OSError) as exc:
            progress = None
            problems.append(f"{SIDECAR_NAME}: unreadable ({exc})")
        if progress is not None:
            entry = self.parse(progress["file"])
            newest_seq = entry.seq if entry is not None else None
            digest = FileDigest(progress["sha256"], progress["sha256_chunk"])
            known = read_companion(
                os.path.join(self.path, progress["file"] + COMPANION_SUFFIX), progress["file"]
            )
            if known is not None and known[:2] == digest[:2]:
                digest = known  # the same digest, with the chunks' own when the companion has them
            candidates.append(
                _Candidate(
                    progress["file"], progress["epoch"], progress["step"], digest, progress["size"], progress
                )
            )
        for e in reversed(self.entries()):
            if newest_seq is not None and e.seq >= newest_seq:
                continue  # the sidecar's own file, or a save that never committed
            if progress is not None and e.name == progress["file"]:
                continue
            vouched = read_companion(os.path.join(self.path, e.name + COMPANION_SUFFIX), e.name)
            if vouched is None:
                continue  # never finished: the save was interrupted before its companion
            candidates.append(_Candidate(e.name, e.epoch, e.step, vouched, None, None))
        return candidates, problems


def _verify(path: str, cand: _Candidate) -> Optional[str]:
    try:
        size = os.path.getsize(path)
    except FileNotFoundError:
        return "file is missing"
    if cand.size is not None and size != cand.size:
        return f"size {size} differs from the recorded {cand.size} (truncated or overwritten)"
    recorded = cand.digest
    found = file_digest(path, recorded.chunk)
    if found.sha256 == recorded.sha256:
        return None
    if not recorded.chunk:
        return f"sha256 {found.sha256[:12]}... differs from the recorded {recorded.sha256[:12]}... (corrupt)"
    problem = (
        f"sha256 root {found.sha256[:12]}... of its {recorded.chunk}-byte chunks differs from the "
        f"recorded {recorded.sha256[:12]}... (corrupt)"
    )
    if len(recorded.chunks) != len(found.chunks):
        return problem
    bad = [i for i, (a, b) in enumerate(zip(found.chunks, recorded.chunks)) if a != b]
    where = ", ".join(
        f"{i} (bytes {i * recorded.chunk} to {min(size, (i + 1) * recorded.chunk)})" for i in bad[:5]
    )
    more = f" and {len(bad) - 5} more" if len(bad) > 5 else ""
    return f"{problem}: chunk {where}{more} of {len(found.chunks)} differs from its recorded sha256"


def read_companion(path: str, name: str) -> Optional[FileDigest]:
    """The digest a companion records for ``name``; None when it is missing or malformed."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except (FileNotFoundError, UnicodeDecodeError):
        return None
    parts = lines[0].split("  ", 1) if lines else []
    if len(parts) != 2 or parts[1] != name:
        return None
    if _HEX_RE.match(parts[0]):
        return FileDigest(parts[0]) if len(lines) == 1 else None
    tree = _TREE_RE.match(parts[0])
    if tree is None or not all(_HEX_RE.match(c) for c in lines[1:]):
        return None
    root, chunk, chunks = tree.group(2), int(tree.group(1)), tuple(lines[1:])
    if chunks and root_of(chunks) != root:
        chunks = ()  # chunk digests that do not make the root would name the wrong chunk
    return FileDigest(root, chunk, chunks)
