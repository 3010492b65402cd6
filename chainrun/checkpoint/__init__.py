"""Exact, crash-proof resume for training loops chained across walltime-limited jobs.

This package runs inside training jobs, often on an old cluster Python, so it
imports only the standard library (the framework helpers live in
``chainrun.checkpoint.torch`` and ``chainrun.checkpoint.tensorflow``). It
provides the atomic write, the progress sidecar that chainrun's service reads
(``chainrun-progress.json``), keep-last-K retention with verified fallback
(``CheckpointDir``), ``SegmentClock``, which says when to save and exit, and
``chain_seed()``, the chain's own seed.
Everything works the same without the chainrun service.
"""

from __future__ import annotations

from chainrun.checkpoint._atomic import (
    TEMP_SUFFIX,
    Written,
    atomic_write,
    cleanup_temp_files,
    fsync_dir,
    is_temp_file,
)
from chainrun.checkpoint._clock import SegmentClock, parse_signal
from chainrun.checkpoint._digest import FileDigest, file_digest, sha256_file
from chainrun.checkpoint._fence import FENCED_EXIT, Fenced
from chainrun.checkpoint._progress import (
    SIDECAR_NAME,
    SIDECAR_VERSION,
    encode_progress,
    load_progress,
    read_progress,
    write_progress,
)
from chainrun.checkpoint._seed import SEED_VAR, chain_seed
from chainrun.checkpoint._store import (
    CheckpointDir,
    CheckpointError,
    CheckpointWarning,
    Entry,
    Resume,
    Saved,
    resolve_directory,
)

__all__ = [
    "FENCED_EXIT",
    "SEED_VAR",
    "SIDECAR_NAME",
    "SIDECAR_VERSION",
    "TEMP_SUFFIX",
    "CheckpointDir",
    "CheckpointError",
    "CheckpointWarning",
    "Entry",
    "Fenced",
    "FileDigest",
    "Resume",
    "Saved",
    "SegmentClock",
    "Written",
    "atomic_write",
    "chain_seed",
    "cleanup_temp_files",
    "encode_progress",
    "file_digest",
    "fsync_dir",
    "is_temp_file",
    "load_progress",
    "parse_signal",
    "read_progress",
    "resolve_directory",
    "sha256_file",
    "write_progress",
]
