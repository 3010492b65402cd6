"""The progress sidecar: its exact shape (the service and the bash wrapper rely on it) and its validation."""

from __future__ import annotations

import hashlib
import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
from ckpt_support import no_chainrun_env, restore_signal_handlers  # noqa: F401
from hypothesis import given, settings
from hypothesis import strategies as st

from chainrun.checkpoint import SIDECAR_NAME, encode_progress, load_progress, read_progress, write_progress

SHA = "a" * 64
VALID: dict[str, Any] = {
    "version": 1,
    "epoch": 3,
    "step": 17,
    "file": "ckpt-000004-e0003-s000017.pt",
    "size": 1234,
    "sha256": SHA,
    "sha256_chunk": 0,
    "saved_at": 1700000000.5,
    "done": False,
    "segment": 2,
    "metrics": {"loss": 0.25},
    "save_seconds": 1.25,
}


def sidecar(**changes: Any) -> bytes:
    obj = {**VALID, **changes}
    return (json.dumps(obj, sort_keys=True) + "\n").encode()


def test_write_progress_writes_one_sorted_json_line_the_wrapper_can_grep(tmp_path: Path) -> None:
    """One line of json.dumps(sort_keys=True) plus newline; the wrapper's two greps find one value each."""
    (tmp_path / "c.pt").write_bytes(b"weights")
    write_progress(tmp_path, epoch=12, step=0, file="c.pt", done=True, segment=3, saved_at=5.0)
    data = (tmp_path / SIDECAR_NAME).read_bytes()
    assert data.endswith(b"\n") and data.count(b"\n") == 1
    assert data == (json.dumps(json.loads(data), sort_keys=True) + "\n").encode()
    assert b'"epoch": 12' in data and b'"done": true' in data
    sidecar_path = str(tmp_path / SIDECAR_NAME)
    epoch = subprocess.run(
        ["bash", "-c", "grep -o '\"epoch\": *[0-9][0-9]*' \"$1\" | grep -o '[0-9]*$'", "-", sidecar_path],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert epoch == "12\n"
    assert subprocess.run(["grep", "-q", '"done": true', sidecar_path]).returncode == 0


def test_write_progress_hashes_and_sizes_the_named_file_when_not_told(tmp_path: Path) -> None:
    """A script with its own saves gets size and sha256 filled in from the file."""
    (tmp_path / "own.pt").write_bytes(b"abc")
    progress = write_progress(tmp_path, epoch=1, step=2, file=str(tmp_path / "own.pt"))
    assert progress["file"] == "own.pt"
    assert progress["size"] == 3
    assert progress["sha256"] == hashlib.sha256(b"abc").hexdigest()
    assert load_progress(tmp_path) == progress


def test_write_progress_records_the_segment_from_chainrun_env(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """CHAINRUN_SEGMENT lands in the sidecar; without it the segment is null."""
    (tmp_path / "c.pt").write_bytes(b"x")
    assert write_progress(tmp_path, epoch=0, step=1, file="c.pt")["segment"] is None
    monkeypatch.setenv("CHAINRUN_SEGMENT", "7")
    assert write_progress(tmp_path, epoch=0, step=1, file="c.pt")["segment"] == 7
    assert read_progress((tmp_path / SIDECAR_NAME).read_bytes())["segment"] == 7


def test_write_progress_turns_scalars_into_json_and_nan_into_text(tmp_path: Path) -> None:
    """Metric values with .item() (NumPy, torch) are converted; a NaN loss does not fail the save."""
    import numpy as np

    (tmp_path / "c.pt").write_bytes(b"x")
    progress = write_progress(
        tmp_path, epoch=0, step=1, file="c.pt", metrics={"loss": np.float32(0.5), "bad": float("nan")}
    )
    assert progress["metrics"] == {"loss": 0.5, "bad": "nan"}


def test_a_save_without_metrics_carries_each_metrics_last_value(tmp_path: Path) -> None:
    """A save mid-epoch reports no metrics: the sidecar (what `status` shows) keeps the last
    values; a metric reported again takes its new value, the others stay."""
    (tmp_path / "c.pt").write_bytes(b"x")
    write_progress(tmp_path, epoch=1, step=0, file="c.pt", metrics={"loss": 0.5, "acc": 0.75})
    assert write_progress(tmp_path, epoch=1, step=7, file="c.pt")["metrics"] == {"loss": 0.5, "acc": 0.75}
    write_progress(tmp_path, epoch=2, step=0, file="c.pt", metrics={"loss": 0.25})
    progress = load_progress(tmp_path)
    assert progress is not None and progress["metrics"] == {"loss": 0.25, "acc": 0.75}


@pytest.mark.parametrize(
    "metrics",
    [
        {"epoch": 5},
        {"done": True},
        {"save_seconds": 1},
        {'a"b': 1},
        {"nested": {"x": 1}},
        {"text": 'say "done": true'},
    ],
)
def test_write_progress_refuses_metrics_that_would_confuse_the_wrapper(
    tmp_path: Path, metrics: dict[str, Any]
) -> None:
    """Metrics that could fake a second "epoch"/"done"/"save_seconds" for grep are refused before
    anything is written."""
    (tmp_path / "c.pt").write_bytes(b"x")
    with pytest.raises(ValueError, match="metrics"):
        write_progress(tmp_path, epoch=0, step=1, file="c.pt", metrics=metrics)
    assert not (tmp_path / SIDECAR_NAME).exists()


def test_read_progress_returns_the_version_1_fields() -> None:
    """A valid sidecar parses to exactly the contract's keys."""
    assert read_progress(sidecar()) == VALID


def test_read_progress_defaults_optional_segment_and_metrics() -> None:
    """segment, metrics, save_seconds and sha256_chunk may be absent (hand-written sidecars, and
    those of chainrun before the tree digest): null, {}, null and 0 (a whole-file sha256)."""
    obj = {k: v for k, v in VALID.items() if k not in ("segment", "metrics", "save_seconds", "sha256_chunk")}
    progress = read_progress((json.dumps(obj, sort_keys=True) + "\n").encode())
    assert progress["segment"] is None and progress["metrics"] == {} and progress["save_seconds"] is None
    assert progress["sha256_chunk"] == 0


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"", "empty"),
        (sidecar()[:-1], "truncated"),
        (sidecar()[:40], "truncated"),
        (sidecar() + sidecar(), "more than one line"),
        (b"\xff\xfe\n", "UTF-8"),
        (b"{not json}\n", "not valid JSON"),
        (b"[1, 2]\n", "JSON object"),
        (sidecar(saved_at=float("nan")), "not valid JSON"),
        (sidecar().replace(b'"step": 17', b'"step": 17, "step": 18'), "duplicate"),
        (sidecar(version=2), "version 2"),
        (sidecar(epoch=True), "epoch must be a non-negative integer"),
        (sidecar(epoch="3"), "epoch must be a non-negative integer"),
        (sidecar(step=-1), "step must be a non-negative integer"),
        (sidecar(size=1.5), "size must be a non-negative integer"),
        (sidecar(file=""), "file must be"),
        (sidecar(file="/abs/ckpt.pt"), "file must be"),
        (sidecar(file="../ckpt.pt"), "file must be"),
        (sidecar(sha256="ABC"), "sha256 must be"),
        (sidecar(sha256_chunk=-1), "sha256_chunk must be"),
        (sidecar(sha256_chunk="64M"), "sha256_chunk must be"),
        (sidecar(saved_at="yesterday"), "saved_at must be"),
        (sidecar(done="true"), "done must be true or false"),
        (sidecar(segment=0), "segment must be"),
        (sidecar(metrics=[1]), "metrics must be an object"),
        (sidecar(metrics={"epoch": 1}), "metrics"),
        ((json.dumps(VALID, sort_keys=True, separators=(",", ":")) + "\n").encode(), "default separators"),
    ],
)
def test_read_progress_rejects_corrupt_and_wrong_typed_sidecars_with_a_clear_message(
    data: bytes, message: str
) -> None:
    """Every kind of damage is a ValueError that says what is wrong."""
    with pytest.raises(ValueError, match=message):
        read_progress(data)


def test_read_progress_rejects_a_missing_key_by_name() -> None:
    """A sidecar without sha256 names the key."""
    obj = {k: v for k, v in VALID.items() if k != "sha256"}
    with pytest.raises(ValueError, match="'sha256'"):
        read_progress((json.dumps(obj, sort_keys=True) + "\n").encode())


def test_read_progress_refuses_text() -> None:
    """The service passes bytes; a str is a programming error."""
    with pytest.raises(TypeError):
        read_progress(sidecar().decode())  # type: ignore[arg-type]


progress_values = st.fixed_dictionaries(
    {
        "version": st.just(1),
        "epoch": st.integers(0, 10**6),
        "step": st.integers(0, 10**9),
        "file": st.from_regex(r"[A-Za-z0-9_.-]{1,40}(/[A-Za-z0-9_-]{1,10})?", fullmatch=True).filter(
            lambda s: ".." not in s.split("/")
        ),
        "size": st.integers(0, 2**50),
        "sha256": st.from_regex(r"[0-9a-f]{64}", fullmatch=True),
        "sha256_chunk": st.integers(0, 2**40),
        "saved_at": st.floats(0, 4e9),
        "done": st.booleans(),
        "segment": st.none() | st.integers(1, 10**5),
        "metrics": st.dictionaries(
            st.from_regex(r"[a-z_][a-z0-9_/.]{0,15}", fullmatch=True).filter(
                lambda k: k not in ("epoch", "done", "save_seconds")
            ),
            st.none()
            | st.booleans()
            | st.integers(-(10**9), 10**9)
            | st.floats(allow_nan=False, allow_infinity=False)
            | st.from_regex(r"[a-z ]{0,20}", fullmatch=True),
            max_size=4,
        ),
        "save_seconds": st.none() | st.floats(0, 1e5),
    }
)


@settings(max_examples=150, deadline=None)
@given(progress=progress_values)
def test_encoded_progress_reads_back_equal(progress: dict[str, Any]) -> None:
    """Whatever write_progress accepts, read_progress returns unchanged."""
    assert read_progress(encode_progress(progress)) == {**progress, "saved_at": float(progress["saved_at"])}


@settings(max_examples=100, deadline=None)
@given(progress=progress_values, data=st.data())
def test_every_truncation_of_a_sidecar_is_rejected(progress: dict[str, Any], data: st.DataObject) -> None:
    """A half-written sidecar (any strict prefix) never parses as valid progress."""
    encoded = encode_progress(progress)
    cut = data.draw(st.integers(0, len(encoded) - 1))
    with pytest.raises(ValueError):
        read_progress(encoded[:cut])
