"""The progress sidecar: one line of JSON that says which checkpoint is the latest good one.

chainrun's service reads it (``read_progress``) and the segment wrapper greps
it (``"epoch": N`` and ``"done": true``), so its shape is a contract: one line
of ``json.dumps(obj, sort_keys=True)`` with default separators and a final
newline. ``epoch`` is the number of COMPLETED epochs and ``step`` the number
of batches done in the epoch in progress, so "epoch >= target_epoch" means
the training is done; ``save_seconds``, how long the save took (the wrapper
keeps it in its end marker, and an adaptive grace is made of it). The sidecar
is written atomically and only after the checkpoint it names is durable: it is
the commit point of every save, and where the fence (``_fence``) is checked.
"""

from __future__ import annotations

import math
import os
import re
import time
import warnings
from collections.abc import Mapping
from typing import Any, Optional, Union

from chainrun.checkpoint import _fence
from chainrun.checkpoint._atomic import atomic_write, fsync_file
from chainrun.checkpoint._digest import sha256_file

SIDECAR_NAME = "chainrun-progress.json"
SIDECAR_VERSION = 1

_SHA256_RE = re.compile(r"^[0-9a-f]{64}$")
# What the bash wrapper before the segment runner grepped for (its jobs may still be queued
# when chainrun is upgraded); each must occur exactly once per sidecar.
_GREP_EPOCH = re.compile(r'"epoch": *[0-9]+')
_GREP_DONE = re.compile(r'"done": ')
# Top-level fields the wrapper greps for, which no metric may be named.
_GREPPED = ("epoch", "done", "save_seconds")
_REQUIRED = ("version", "epoch", "step", "file", "size", "sha256", "saved_at", "done")


def read_progress(data: bytes) -> dict[str, Any]:
    """Parse and validate sidecar bytes; ``ValueError`` names what is wrong.

    Returns a dict with exactly the keys of version 1 (``version``, ``epoch``,
    ``step``, ``file``, ``size``, ``sha256``, ``saved_at`` as float, ``done``,
    ``segment``, ``metrics``, ``save_seconds``, ``sha256_chunk``); ``segment``, ``metrics``,
    ``save_seconds`` and ``sha256_chunk`` may be absent in the file and default to None, ``{}``,
    None and 0. ``sha256_chunk`` > 0 says ``sha256`` is the root of a tree of pieces that
    size (``chainrun.checkpoint._digest``); 0, the sha256 of the whole file.
    Keys it does not know are ignored.
    """
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise TypeError(f"read_progress needs the sidecar's bytes, got {type(data).__name__}")
    raw = bytes(data)
    if not raw:
        raise ValueError(f"progress sidecar {SIDECAR_NAME} is empty")
    if not raw.endswith(b"\n"):
        raise ValueError(f"progress sidecar {SIDECAR_NAME} is truncated: it does not end with a newline")
    if b"\n" in raw[:-1]:
        raise ValueError(f"progress sidecar {SIDECAR_NAME} has more than one line")
    try:
        text = raw[:-1].decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"progress sidecar {SIDECAR_NAME} is not UTF-8: {exc}") from None
    import json

    try:
        obj = json.loads(text, parse_constant=_reject_constant, object_pairs_hook=_no_duplicates)
    except ValueError as exc:
        raise ValueError(f"progress sidecar {SIDECAR_NAME} is not valid JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise ValueError(f"progress sidecar {SIDECAR_NAME} must hold a JSON object, got {type(obj).__name__}")
    progress = _validate(obj)
    _check_greppable(text)
    return progress


def encode_progress(progress: Mapping[str, Any]) -> bytes:
    """The sidecar bytes for a progress dict (validated first; ``ValueError`` if invalid)."""
    import json

    obj = _validate(dict(progress))
    text = json.dumps(obj, sort_keys=True, allow_nan=False)
    _check_greppable(text)
    return text.encode("utf-8") + b"\n"


def write_progress(
    directory: Union[str, os.PathLike[str]],
    *,
    epoch: int,
    step: int,
    file: str,
    size: Optional[int] = None,
    sha256: Optional[str] = None,
    sha256_chunk: int = 0,
    done: bool = False,
    metrics: Optional[Mapping[str, Any]] = None,
    segment: Optional[int] = None,
    saved_at: Optional[float] = None,
    save_seconds: Optional[float] = None,
) -> dict[str, Any]:
    """Atomically write the sidecar in ``directory`` naming ``file``; returns what was written.

    ``epoch`` counts completed epochs, ``step`` the batches done in the epoch
    in progress. Without ``size`` and ``sha256`` the file is fsynced and hashed
    here (for scripts that write their own checkpoints); with them, the caller
    vouches that the file is already durable; ``sha256_chunk``, when > 0, that ``sha256`` is
    the root of its tree of pieces that size (``_digest``). ``segment`` defaults to
    ``CHAINRUN_SEGMENT``. Metric values may be numbers, bools, None or short
    strings; NumPy and torch scalars are converted, NaN becomes ``"nan"``. Each
    metric the sidecar already holds keeps its last value until a save reports
    it again: a save mid-epoch, with no metrics, leaves them as the last one said.
    ``save_seconds`` is how long the save took, when the caller measured it.
    """
    root = os.fspath(directory)
    name = _relative_name(root, file)
    path = os.path.join(root, name)
    if size is None or sha256 is None:
        fsync_file(path)
        size = os.path.getsize(path)
        sha256, sha256_chunk = sha256_file(path), 0
    progress = {
        "version": SIDECAR_VERSION,
        "epoch": epoch,
        "step": step,
        "file": name,
        "size": size,
        "sha256": sha256,
        "sha256_chunk": sha256_chunk,
        "saved_at": time.time() if saved_at is None else saved_at,
        "done": done,
        "segment": segment_from_env() if segment is None else segment,
        "metrics": {**_last_metrics(root), **{str(k): _plain(v) for k, v in (metrics or {}).items()}},
        "save_seconds": None if save_seconds is None else round(float(save_seconds), 3),
    }
    data = encode_progress(progress)
    # The commit: refused (``Fenced``) when a newer segment of the chain owns the directory.
    atomic_write(os.path.join(root, SIDECAR_NAME), data, before_replace=lambda: _fence.check(root))
    return _validate(progress)


def load_progress(directory: Union[str, os.PathLike[str]]) -> Optional[dict[str, Any]]:
    """The sidecar in ``directory``, or None when there is none; ``ValueError`` when corrupt."""
    try:
        with open(os.path.join(os.fspath(directory), SIDECAR_NAME), "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return None
    return read_progress(data)


def _last_metrics(directory: str) -> dict[str, Any]:
    """The metrics of the sidecar in ``directory``; none when there is none or it is unreadable."""
    try:
        progress = load_progress(directory)
    except (OSError, ValueError):
        return {}
    return progress["metrics"] if progress is not None else {}


def segment_from_env() -> Optional[int]:
    """``CHAINRUN_SEGMENT`` as an int, or None outside chainrun (a bad value warns, never fails a save)."""
    text = os.environ.get("CHAINRUN_SEGMENT", "").strip()
    if not text:
        return None
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        warnings.warn(
            f"CHAINRUN_SEGMENT={text!r} is not a positive integer; the sidecar records no segment",
            stacklevel=3,
        )
        return None
    return value


def _validate(obj: dict[str, Any]) -> dict[str, Any]:
    missing = [k for k in _REQUIRED if k not in obj]
    if missing:
        raise ValueError(f"progress sidecar {SIDECAR_NAME} lacks {', '.join(repr(k) for k in missing)}")
    version = obj["version"]
    if not _is_int(version) or version != SIDECAR_VERSION:
        raise ValueError(
            f"progress sidecar {SIDECAR_NAME} has version {version!r}; this chainrun reads version "
            f"{SIDECAR_VERSION}: upgrade chainrun where the sidecar is read"
        )
    for key in ("epoch", "step", "size"):
        if not _is_int(obj[key]) or obj[key] < 0:
            raise ValueError(_bad(key, obj[key], "a non-negative integer"))
    name = obj["file"]
    if (
        not isinstance(name, str)
        or not name
        or name.startswith("/")
        or ".." in name.split("/")
        or "\n" in name
    ):
        raise ValueError(_bad("file", name, "a non-empty file name relative to the checkpoint directory"))
    if not isinstance(obj["sha256"], str) or not _SHA256_RE.match(obj["sha256"]):
        raise ValueError(_bad("sha256", obj["sha256"], "64 lowercase hex digits"))
    chunk = obj.get("sha256_chunk")
    chunk = 0 if chunk is None else chunk
    if not _is_int(chunk) or chunk < 0:
        raise ValueError(_bad("sha256_chunk", chunk, "a non-negative integer (0: sha256 of the whole file)"))
    saved_at = obj["saved_at"]
    if (
        isinstance(saved_at, bool)
        or not isinstance(saved_at, (int, float))
        or not math.isfinite(saved_at)
        or saved_at < 0
    ):
        raise ValueError(_bad("saved_at", saved_at, "epoch seconds as a number"))
    if not isinstance(obj["done"], bool):
        raise ValueError(_bad("done", obj["done"], "true or false"))
    segment = obj.get("segment")
    if segment is not None and (not _is_int(segment) or segment < 1):
        raise ValueError(_bad("segment", segment, "a positive integer or null"))
    metrics = obj.get("metrics", {})
    if metrics is None:
        metrics = {}
    if not isinstance(metrics, dict):
        raise ValueError(_bad("metrics", metrics, "an object"))
    for key, value in metrics.items():
        if not isinstance(key, str) or not key or key in _GREPPED or '"' in key or "\\" in key:
            raise ValueError(
                _bad(
                    "metrics",
                    key,
                    "keys that are non-empty, not 'epoch', 'done' or 'save_seconds', "
                    "without quotes or backslashes",
                )
            )
        if isinstance(value, str):
            if '"' in value or "\\" in value or len(value) > 200:
                raise ValueError(
                    _bad(
                        f"metrics.{key}",
                        value,
                        "a string of at most 200 characters without quotes or backslashes",
                    )
                )
        elif isinstance(value, float):
            if not math.isfinite(value):
                raise ValueError(_bad(f"metrics.{key}", value, "a finite number"))
        elif value is not None and not isinstance(value, (int, bool)):
            raise ValueError(_bad(f"metrics.{key}", value, "a number, bool, null or short string"))
    took = obj.get("save_seconds")
    if took is not None and (
        isinstance(took, bool) or not isinstance(took, (int, float)) or not math.isfinite(took) or took < 0
    ):
        raise ValueError(_bad("save_seconds", took, "seconds as a non-negative number or null"))
    return {
        "version": version,
        "epoch": obj["epoch"],
        "step": obj["step"],
        "file": name,
        "size": obj["size"],
        "sha256": obj["sha256"],
        "sha256_chunk": chunk,
        "saved_at": float(saved_at),
        "done": obj["done"],
        "segment": segment,
        "metrics": dict(metrics),
        "save_seconds": None if took is None else float(took),
    }


def _check_greppable(text: str) -> None:
    # The segment wrapper greps for these: each must be there, and only once.
    for pattern, what in ((_GREP_EPOCH, '"epoch": N'), (_GREP_DONE, '"done": ')):
        count = len(pattern.findall(text))
        if count != 1:
            raise ValueError(
                f"progress sidecar {SIDECAR_NAME} has {what} {count} times instead of once: write it with "
                "write_progress (json.dumps with sort_keys=True and default separators)"
            )


def _relative_name(root: str, file: Union[str, os.PathLike[str]]) -> str:
    name = os.fspath(file)
    if os.path.isabs(name):
        rel = os.path.relpath(name, os.path.abspath(root))
        if rel.startswith(".."):
            raise ValueError(
                f"checkpoint {name!r} is outside the checkpoint directory {root!r}: save it inside"
            )
        name = rel
    return name.replace(os.sep, "/")


def _plain(value: Any) -> Any:
    if value is not None and not isinstance(value, (str, int, float, bool)) and hasattr(value, "item"):
        value = value.item()  # NumPy, torch and TensorFlow scalars
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _bad(key: str, value: Any, allowed: str) -> str:
    return f"progress sidecar {SIDECAR_NAME}: {key} must be {allowed}, got {value!r}"


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not allowed")


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj: dict[str, Any] = {}
    for key, value in pairs:
        if key in obj:
            raise ValueError(f"duplicate key {key!r}")
        obj[key] = value
    return obj
