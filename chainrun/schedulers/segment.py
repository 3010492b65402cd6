"""The segment protocol: what every backend's job shares, as names, paths and markers.

A segment's names and paths: the tag ``cr.CHAIN.N`` that finds a job again
after a crash (``tag_for``, read back by ``parse_tag``), and the run directory
next to the training that holds its script, log and markers. The segment runner every
backend runs (``chainrun.node.runner``, under the script ``script`` renders) leaves markers:
``seg-NNNN.start`` and ``seg-NNNN.end``, each with the checkpoint as the
segment found and left it, read here into the model's ``StartMarker`` and
``EndMarker``; ``final``, written when the chain ends so that a successor
that starts anyway exits at once; ``seg-NNNN.queued``, the claim of a
successor that the segment before it queued while the service was away
(``Carried``), beside ``carry.json``, what the service last recorded;
``grace``, the adaptive grace the wrapper reads at start (decide/grace.py);
``ready``, which the helper writes once the command takes the walltime signal.
A sweep's first segments may share one array job: its tasks run those same
segment scripts, under the array's name ``cr@CHAIN``.
"""

from __future__ import annotations

import json
import posixpath
import re
from dataclasses import dataclass
from typing import Optional

from chainrun.model import Carried, EndMarker, JobSpec, Progress, StartMarker
from chainrun.sweep import param_text

RUN_DIR_NAME = ".chainrun"
FINAL_NAME = "final"
CARRY_NAME = "carry.json"  # what the service last recorded of the chain, for chainrun.carry
CLAIM_SUFFIX = ".queued"
GRACE_NAME = "grace"
CODE_DIR = "code"  # in RUN_DIR_NAME: the code snapshots (snapshot = "git"), one per commit
CODE_NAMES = ".chainrun-names"  # in a snapshot's directory: its paths, written once it is unpacked
TAG_PREFIX = "cr."


@dataclass(frozen=True)
class SegmentJob:
    """One segment as the scheduler sees it: names, paths, limits."""

    chain_id: str
    n: int
    spec: JobSpec
    walltime: int
    after: Optional[str] = None

    @property
    def shortest(self) -> int:
        """The shortest walltime this segment may be granted (``walltime = "MIN..MAX"``: Slurm's
        ``--time-min``; other schedulers run every segment for its whole ``walltime``); 0 when
        it asks for one length."""
        least = self.spec.walltime_min
        return least if 0 < least < self.walltime else 0

    @property
    def tag(self) -> str:
        """Deterministic job name: finds the job again after a crash."""
        return tag_for(self.chain_id, self.n)

    @property
    def run_dir(self) -> str:
        return run_dir(self.spec, self.chain_id)

    @property
    def stem(self) -> str:
        return posixpath.join(self.run_dir, f"seg-{self.n:04d}")

    @property
    def script_path(self) -> str:
        return self.stem + ".sh"

    @property
    def log_path(self) -> str:
        return self.stem + ".log"

    @property
    def claim_path(self) -> str:
        """Made (exclusively) by the segment before this one when it queues this one itself."""
        return self.stem + CLAIM_SUFFIX


def tag_for(chain_id: str, n: int) -> str:
    return f"{TAG_PREFIX}{chain_id}.{n}"


def parse_tag(name: str) -> Optional[tuple[str, int]]:
    """The chain id and segment number in a job name ``tag_for`` made; None for any other."""
    if not name.startswith(TAG_PREFIX):
        return None
    chain_id, _, n = name[len(TAG_PREFIX) :].rpartition(".")
    return (chain_id, int(n)) if chain_id and n.isascii() and n.isdigit() else None


ARRAY_PREFIX = "cr@"


def array_tag(chain_id: str) -> str:
    """The name of an array job of first segments: its first chain's id (each chain is
    journaled into one array, ever), so that after a crash its tasks are found again."""
    return ARRAY_PREFIX + chain_id


def array_stem(spec: JobSpec, name: str) -> str:
    """Where an array's script and its own (normally empty) log go."""
    return posixpath.join(spec.workdir, RUN_DIR_NAME, "array-" + name[len(ARRAY_PREFIX) :])


def run_dir(spec: JobSpec, chain_id: str) -> str:
    """Where a chain's scripts, logs and markers live, next to the training."""
    return posixpath.join(spec.workdir, RUN_DIR_NAME, chain_id)


def code_root(spec: JobSpec) -> str:
    """Where a snapshot chain's commit is unpacked, once, for every chain of that commit to
    copy (never run in)."""
    return posixpath.join(spec.workdir, RUN_DIR_NAME, CODE_DIR, spec.snapshot_commit)


def working_copy(spec: JobSpec, chain_id: str) -> str:
    """A snapshot chain's own copy of its commit, in its run directory (``node.share``)."""
    return posixpath.join(run_dir(spec, chain_id), CODE_DIR)


def code_dir(spec: JobSpec, chain_id: str) -> str:
    """Where the command runs: the workdir, or a snapshot chain's working copy (at the job's
    subdirectory of its repository)."""
    if not spec.snapshot_commit:
        return spec.workdir
    copy = working_copy(spec, chain_id)
    return posixpath.join(copy, spec.snapshot_subdir) if spec.snapshot_subdir else copy


def code_names(spec: JobSpec) -> str:
    """The list of every path of a snapshot's tree (NUL-separated), written last when it was
    unpacked: what is the snapshot's own in its directory, and what the command made there."""
    return posixpath.join(code_root(spec), CODE_NAMES)


def share_settings(spec: JobSpec, chain_id: str) -> Optional[dict[str, str]]:
    """What ``node.share`` needs to keep a snapshot chain's working copy and bring its files
    home (the segment runner before and after each segment, ``gc`` before it removes the
    copy); None for a chain without a snapshot."""
    if not spec.snapshot_commit:
        return None
    return {
        "pristine": code_root(spec),
        "copy": working_copy(spec, chain_id),
        "names": code_names(spec),
        "subdir": spec.snapshot_subdir,
        "workdir": spec.workdir,
        "chain": chain_id,
    }


def made_dirs(spec: JobSpec) -> list[str]:
    """What the wrapper makes besides the checkpoint directory, before the command starts: the
    directories chainrun reads, so that a snapshot chain's links reach them from the start."""
    wanted = [spec.tensorboard_dir, posixpath.dirname(spec.progress_file or "")]
    return [d for d in dict.fromkeys(wanted) if d and d != spec.workdir]


def final_path(spec: JobSpec, chain_id: str) -> str:
    return posixpath.join(run_dir(spec, chain_id), FINAL_NAME)


def grace_path(spec: JobSpec, chain_id: str) -> str:
    """Where an adaptive grace is written for the wrapper (``grace=SECONDS``)."""
    return posixpath.join(run_dir(spec, chain_id), GRACE_NAME)


RUN_ID_MAX = 64  # W&B, MLflow and TensorBoard all take a run id this long
_NOT_IN_RUN_ID = re.compile(r"[^a-z0-9-]")


def tracker_run_id(chain_id: str) -> str:
    """``CHAINRUN_RUN_ID``: the chain's id as every tracker takes it, the same in each of its
    segments: lowercase letters, digits and hyphens (any other character becomes a hyphen), at
    most ``RUN_ID_MAX`` long (a longer name is cut, its random ``-HEX`` ending kept)."""
    safe = _NOT_IN_RUN_ID.sub("-", chain_id.lower())
    if len(safe) <= RUN_ID_MAX:
        return safe
    tail = safe[-7:]  # the "-HEX" that new_chain_id ends every id with
    return safe[: RUN_ID_MAX - len(tail)] + tail


def tracking_environment(spec: JobSpec, chain_id: str) -> list[tuple[str, str]]:
    """What ``[tracking]`` sets: each tracker's own variables, so that an unchanged script's
    ``wandb.init()`` continues the chain's one run in every segment (``[env]`` may set another)."""
    run_id = tracker_run_id(chain_id)
    wanted = {
        "wandb": [("WANDB_RUN_ID", run_id), ("WANDB_RESUME", "allow")],
        "mlflow": [],  # its run ids are its own: found in the job, before each command (node.tracking)
    }
    return [pair for tracker in spec.tracking for pair in wanted[tracker]]


def sweep_environment(spec: JobSpec) -> list[tuple[str, str]]:
    """What a sweep chain's command gets: each parameter, all of them as JSON, the repetition."""
    if not spec.sweep_name:
        return []
    pairs = [(f"CHAINRUN_PARAM_{k.upper()}", param_text(v)) for k, v in spec.params]
    everything = json.dumps({k: json.loads(v) for k, v in spec.params}, separators=(",", ":"))
    return [*pairs, ("CHAINRUN_PARAMS", everything), ("CHAINRUN_REP", str(spec.rep))]


_REPEATED = ("tail=", "beside=")  # the end marker's keys that come once a line each


def _fields(data: bytes) -> dict[str, str]:
    """A marker's ``key=value`` lines (its repeated ones are read by ``_repeated``)."""
    return dict(line.split("=", 1) for line in _lines(data) if "=" in line and not line.startswith(_REPEATED))


def _lines(data: bytes) -> list[str]:
    return data.decode(errors="replace").split("\n")


def _repeated(data: bytes, key: str) -> tuple[str, ...]:
    """Each value of a key the end marker has once a line (``tail``: the last lines of a
    failed command's output; ``beside``: a snapshot chain's files kept beside the workdir's)."""
    return tuple(line[len(key) + 1 :] for line in _lines(data) if line.startswith(key + "="))


def _number(text: Optional[str], kind: type[float] | type[int]) -> Optional[float]:
    try:
        return kind(text) if text else None
    except ValueError:
        return None


def _whole(text: Optional[str]) -> Optional[int]:
    number = _number(text, int)
    return None if number is None else int(number)


def _progress(fields: dict[str, str]) -> Optional[Progress]:
    """The checkpoint as a marker recorded it; None for a marker without one."""
    if "ckpt_epoch" not in fields:
        return None
    epoch = _number(fields.get("ckpt_epoch"), int)
    step = _number(fields.get("ckpt_step"), int)
    saved = _number(fields.get("ckpt_saved"), float)
    mtime = _number(fields.get("ckpt_mtime"), float)
    if epoch is None and saved is None and mtime is None:
        return Progress()
    return Progress(
        epoch=None if epoch is None else int(epoch),
        step=None if step is None else int(step),
        saved_at=saved if epoch is not None or saved is not None else mtime,
        done=fields.get("ckpt_done") == "true",
    )


def claim_text(walltime: int, after: str, by: str, at: float) -> bytes:
    """A claim as made by ``by`` at ``at``, before the submission; ``claim_job`` adds the job
    once it answered."""
    return f"walltime={walltime}\nafter={after}\nby={by}\nat={at:.3f}\n".encode()


def claim_job(job_id: str) -> bytes:
    return f"job={job_id}\n".encode()


def parse_claim(data: bytes) -> Optional[Carried]:
    """A successor's claim; None while it is not whole."""
    fields = _fields(data)
    walltime = _number(fields.get("walltime"), int)
    if walltime is None or "after" not in fields:
        return None
    return Carried(
        job_id=fields.get("job", "").strip(),
        walltime=int(walltime),
        after=fields["after"].strip(),
        by=fields.get("by", "").strip(),
        at=_number(fields.get("at"), float),
    )


def parse_start_marker(data: bytes) -> StartMarker:
    """The wrapper's start marker."""
    fields = _fields(data)
    at, walltime = _number(fields.get("at"), float), _whole(fields.get("walltime"))
    return StartMarker(fields.get("job", "").strip(), at, _progress(fields), walltime)


def parse_end_marker(data: bytes) -> Optional[EndMarker]:
    """The wrapper's end marker; None while it is not whole."""
    fields = _fields(data)
    try:
        return EndMarker(
            exit_code=int(fields["exit"]),
            original=int(fields.get("original") or fields["exit"]),
            signal=fields.get("signal", ""),
            skipped=fields.get("skipped") == "1",
            preempted=fields.get("preempted") == "1",
            at=float(fields["at"]) if fields.get("at") else None,
            progress=_progress(fields),
            path=fields.get("path", ""),
            tail=_repeated(data, "tail"),
            beside=_repeated(data, "beside"),
            signalled_at=float(fields["signalled_at"]) if fields.get("signalled_at") else None,
            grace=_whole(fields.get("grace")),
            ready=fields.get("ready", "") if fields.get("ready") in ("0", "1") else "",
            ready_at=_number(fields.get("ready_at"), float),
            save_seconds=_number(fields.get("ckpt_save"), float),
            fenced=fields.get("fenced", "").strip(),
            skip=fields.get("skip", "").strip(),
        )
    except (KeyError, ValueError):
        return None
