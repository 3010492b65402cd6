"""CheckpointDir: unique names, commit order, keep-last-K retention and the verified restore order."""

from __future__ import annotations

import hashlib
import json
import os
import threading
import warnings
from pathlib import Path

import pytest
from ckpt_support import no_chainrun_env, restore_signal_handlers  # noqa: F401

from chainrun.checkpoint import (
    SIDECAR_NAME,
    CheckpointDir,
    CheckpointError,
    CheckpointWarning,
    FileDigest,
    Resume,
    load_progress,
    write_progress,
)
from chainrun.checkpoint import _store as store_module
from chainrun.checkpoint._digest import CHUNK


def tree_companion(data: bytes, name: str, chunk: int = CHUNK) -> str:
    """The companion of a file saved with a tree digest, spelled out: the root line, then each
    chunk's sha256."""
    chunks = [hashlib.sha256(data[i : i + chunk]).hexdigest() for i in range(0, len(data), chunk)]
    root = hashlib.sha256(b"".join(bytes.fromhex(c) for c in chunks)).hexdigest()
    return "".join([f"sha256-tree:{chunk}:{root}  {name}\n"] + [f"{c}\n" for c in chunks])


def save_n(store: CheckpointDir, n: int) -> list[str]:
    """Save ``n`` entries and let the last one's retention (a helper thread) finish."""
    names = [store.save(f"payload {i}".encode(), epoch=i, step=0).file for i in range(1, n + 1)]
    store.wait()
    return names


def flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def test_save_commits_file_companion_and_sidecar(tmp_path: Path) -> None:
    """After save() the sidecar names the new file with its tree digest's root and chunk size;
    after wait() the companion beside it holds the root and each chunk's sha256."""
    store = CheckpointDir(tmp_path, suffix=".bin")
    saved = store.save(b"weights", epoch=2, step=5, done=False, metrics={"loss": 1.5})
    assert saved.file == "ckpt-000001-e0002-s000005.bin"
    assert (tmp_path / saved.file).read_bytes() == b"weights"
    store.wait()
    assert (tmp_path / (saved.file + ".sha256")).read_text() == tree_companion(b"weights", saved.file)
    progress = load_progress(tmp_path)
    assert progress is not None
    assert (progress["file"], progress["epoch"], progress["step"], progress["sha256"]) == (
        saved.file,
        2,
        5,
        saved.sha256,
    )
    assert progress["sha256_chunk"] == saved.chunk == CHUNK
    assert progress["metrics"] == {"loss": 1.5}
    # How long the save took, of which chainrun makes the grace (docs/how-it-decides.md).
    assert progress["save_seconds"] is not None and 0 <= progress["save_seconds"] < 60


def test_a_new_checkpoint_never_takes_the_name_of_an_existing_file(tmp_path: Path) -> None:
    """The same epoch and step saved again by a new process gets a new name: the sidecar's file never changes under it."""
    first = CheckpointDir(tmp_path, suffix=".bin").save(b"first", epoch=1, step=1)
    second = CheckpointDir(tmp_path, suffix=".bin").save(b"second", epoch=1, step=1)
    assert second.file != first.file
    assert (tmp_path / first.file).read_bytes() == b"first"


def test_new_names_sort_after_every_file_present_even_leftovers(tmp_path: Path) -> None:
    """Names count up past any file of an entry, finished or not (TensorFlow data files included)."""
    store = CheckpointDir(tmp_path, suffix=".bin")
    (tmp_path / "ckpt-000009-e0001-s000000.bin").write_bytes(b"orphan")
    (tmp_path / "ckpt-000011-e0001-s000000.data-00000-of-00001").write_bytes(b"orphan data")
    assert store.new_name(1, 1) == "ckpt-000012-e0001-s000001.bin"
    assert store.new_name(1, 1) == "ckpt-000013-e0001-s000001.bin"


def test_retention_keeps_the_last_k_committed_checkpoints(tmp_path: Path) -> None:
    """keep=2: the two newest stay (files and companions), older ones go."""
    store = CheckpointDir(tmp_path, suffix=".bin", keep=2)
    names = save_n(store, 5)
    left = sorted(n for n in os.listdir(tmp_path) if n != SIDECAR_NAME)
    assert left == sorted([names[3], names[3] + ".sha256", names[4], names[4] + ".sha256"])


def test_retention_with_keep_1_leaves_only_the_newest(tmp_path: Path) -> None:
    """Even keep=1 never deletes the checkpoint the sidecar names."""
    store = CheckpointDir(tmp_path, suffix=".bin", keep=1)
    names = save_n(store, 3)
    assert sorted(os.listdir(tmp_path)) == sorted([SIDECAR_NAME, names[2], names[2] + ".sha256"])


def test_retention_deletes_after_save_returns_and_then_leaves_exactly_keep(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """save() returns with the new entry committed before the old one is deleted; wait() finishes the deletion."""
    store = CheckpointDir(tmp_path, suffix=".bin", keep=1)
    first = save_n(store, 1)[0]
    release = threading.Event()
    delete = store._delete

    def held_delete(names: list[str]) -> list[str]:
        release.wait(timeout=30)
        return delete(names)

    monkeypatch.setattr(store, "_delete", held_delete)
    second = store.save(b"second", epoch=2, step=0).file
    assert load_progress(tmp_path)["file"] == second  # type: ignore[index]
    assert (tmp_path / first).exists(), "save() waited for retention to delete the previous checkpoint"
    release.set()
    store.wait()
    assert sorted(os.listdir(tmp_path)) == sorted([SIDECAR_NAME, second, second + ".sha256"])


def test_save_returns_before_the_companion_is_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The companion's write and fsync happen after the commit, off the caller's path; wait() finishes them."""
    store = CheckpointDir(tmp_path, suffix=".bin")
    release = threading.Event()
    write_companion = store._write_companion

    def held(name: str, digest: FileDigest) -> None:
        release.wait(timeout=30)
        write_companion(name, digest)

    monkeypatch.setattr(store, "_write_companion", held)
    saved = store.save(b"weights", epoch=1, step=0)
    assert load_progress(tmp_path)["file"] == saved.file  # type: ignore[index]
    assert not (tmp_path / (saved.file + ".sha256")).exists()
    release.set()
    store.wait()
    assert (tmp_path / (saved.file + ".sha256")).read_text() == tree_companion(b"weights", saved.file)


def test_a_writer_killed_before_its_companion_leaves_it_to_the_next_writer(tmp_path: Path) -> None:
    """Killed between the sidecar and the companion: the next writer writes the companion from the
    sidecar, so the checkpoint stays a verified fallback once a newer one is committed."""
    names = save_n(CheckpointDir(tmp_path, suffix=".bin", keep=2), 2)
    os.unlink(tmp_path / (names[1] + ".sha256"))  # what a kill right after the sidecar's rename leaves
    store = CheckpointDir(tmp_path, suffix=".bin", keep=2)
    store.prepare()
    sha256 = load_progress(tmp_path)["sha256"]  # type: ignore[index]
    # The chunk digests were the dead writer's alone: the root from the sidecar vouches for it.
    assert (tmp_path / (names[1] + ".sha256")).read_text() == f"sha256-tree:{CHUNK}:{sha256}  {names[1]}\n"
    newest = store.save(b"newest", epoch=3, step=0).file
    store.wait()
    assert sorted(n for n in os.listdir(tmp_path) if n != SIDECAR_NAME) == sorted(
        [names[1], names[1] + ".sha256", newest, newest + ".sha256"]
    )
    flip_a_byte(tmp_path / newest)
    with pytest.warns(CheckpointWarning, match="sha256"):
        resume, value = store.restore(lambda p: Path(p).read_bytes())
    assert (resume.file, value) == (names[1], b"payload 2")


def test_a_new_writer_prunes_what_writers_killed_before_retention_left(tmp_path: Path) -> None:
    """Writers killed between commit and prune, one per segment, leave old checkpoints; the next writer removes them before it writes."""
    names = save_n(CheckpointDir(tmp_path, suffix=".bin", keep=10), 5)  # as if no prune ever ran
    CheckpointDir(tmp_path, suffix=".bin", keep=2).prepare()
    left = sorted(n for n in os.listdir(tmp_path) if n != SIDECAR_NAME)
    assert left == sorted([names[3], names[3] + ".sha256", names[4], names[4] + ".sha256"])


def test_prune_never_touches_the_sidecar_checkpoint_or_anything_newer(tmp_path: Path) -> None:
    """A save in flight (newer than the sidecar's file) and the committed file survive pruning."""
    store = CheckpointDir(tmp_path, suffix=".bin", keep=1)
    names = save_n(store, 2)
    in_flight = tmp_path / "ckpt-000003-e0003-s000000.bin"
    in_flight.write_bytes(b"being written")
    assert store.prune() == []
    assert (tmp_path / names[1]).exists() and in_flight.exists()


def test_prune_removes_leftovers_of_interrupted_older_saves(tmp_path: Path) -> None:
    """Uncommitted files (no companion) and orphan data files older than the sidecar's go."""
    store = CheckpointDir(tmp_path, suffix=".bin", keep=3)
    (tmp_path / "ckpt-000001-e0001-s000000.bin").write_bytes(b"never committed")
    (tmp_path / "ckpt-000002-e0001-s000000.data-00000-of-00001").write_bytes(b"orphan data")
    (tmp_path / "ckpt-000002-e0001-s000000_temp").mkdir()
    saved = store.save(b"good", epoch=2, step=0)
    store.wait()
    assert sorted(os.listdir(tmp_path)) == sorted([SIDECAR_NAME, saved.file, saved.file + ".sha256"])


def test_restore_of_an_empty_directory_is_a_quiet_fresh_start(tmp_path: Path) -> None:
    """The first segment has nothing to resume: fresh, with no warning and no load call."""
    store = CheckpointDir(tmp_path / "new", suffix=".bin")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        resume, value = store.restore(lambda path: pytest.fail("nothing to load"))
    assert resume == Resume() and resume.fresh and value is None


def test_restore_loads_the_checkpoint_the_sidecar_names(tmp_path: Path) -> None:
    """The newest committed checkpoint is loaded and described."""
    store = CheckpointDir(tmp_path, suffix=".bin")
    names = save_n(store, 3)
    resume, value = store.restore(lambda path: Path(path).read_bytes())
    assert (resume.file, resume.epoch, resume.fresh, resume.fell_back) == (names[2], 3, False, False)
    assert value == b"payload 3"
    assert resume.describe() == f"resumed from {names[2]} (epoch 3)"


@pytest.mark.parametrize(
    ("damage", "reason"),
    [
        (flip_a_byte, "sha256"),
        (lambda p: p.write_bytes(p.read_bytes()[:-3]), "size"),
        (os.unlink, "missing"),
    ],
)
def test_restore_falls_back_to_the_previous_checkpoint_and_warns(
    tmp_path: Path, damage: object, reason: str
) -> None:
    """A corrupt, truncated or missing newest checkpoint: the previous one is used, with a warning saying why."""
    store = CheckpointDir(tmp_path, suffix=".bin")
    names = save_n(store, 3)
    damage(tmp_path / names[2])  # type: ignore[operator]
    with pytest.warns(CheckpointWarning, match=rf"{names[2]}: .*{reason}") as record:
        resume, value = store.restore(lambda path: Path(path).read_bytes())
    assert f"resumed from {names[1]}" in str(record[0].message)
    assert (resume.file, resume.epoch, resume.fell_back, value) == (names[1], 2, True, b"payload 2")
    assert len(resume.rejected) == 1 and resume.rejected[0].startswith(names[2])


def test_a_corrupt_chunk_is_named_when_the_newest_falls_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Restore hashes the chunks again and names the one whose sha256 differs from the companion's."""
    monkeypatch.setattr(store_module, "CHUNK", 1000)
    store = CheckpointDir(tmp_path, suffix=".bin")
    store.save(os.urandom(10_500), epoch=1, step=0)
    newest = store.save(os.urandom(10_500), epoch=2, step=0)
    store.wait()
    assert newest.chunk == 1000
    data = bytearray((tmp_path / newest.file).read_bytes())
    data[3500] ^= 0xFF
    (tmp_path / newest.file).write_bytes(bytes(data))
    with pytest.warns(CheckpointWarning) as record:
        resume, _ = store.restore(lambda path: Path(path).read_bytes())
    assert resume.epoch == 1 and resume.fell_back
    message = str(record[0].message)
    assert "chunk 3 (bytes 3000 to 4000) of 11 differs from its recorded sha256" in message, message


def test_checkpoints_with_a_whole_file_sha256_still_restore_and_verify(tmp_path: Path) -> None:
    """Checkpoints written before the tree digest (a sidecar without sha256_chunk, companions in
    sha256sum format) load, a corrupt one is caught by its whole-file sha256, and a new save
    beside them keeps the old one as a verified fallback."""
    payloads = {"ckpt-000001-e0001-s000000.bin": b"old one", "ckpt-000002-e0002-s000000.bin": b"old two"}
    for name, data in payloads.items():
        (tmp_path / name).write_bytes(data)
        (tmp_path / (name + ".sha256")).write_text(f"{hashlib.sha256(data).hexdigest()}  {name}\n")
    sidecar = {  # as chainrun wrote it before: no sha256_chunk
        "version": 1, "epoch": 2, "step": 0, "file": "ckpt-000002-e0002-s000000.bin", "size": 7,
        "sha256": hashlib.sha256(b"old two").hexdigest(), "saved_at": 1.0, "done": False,
        "segment": None, "metrics": {}, "save_seconds": 0.1,
    }  # fmt: skip
    (tmp_path / SIDECAR_NAME).write_text(json.dumps(sidecar, sort_keys=True) + "\n")
    store = CheckpointDir(tmp_path, suffix=".bin", keep=3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        resume, value = store.restore(lambda path: Path(path).read_bytes())
    assert (resume.file, value) == ("ckpt-000002-e0002-s000000.bin", b"old two")
    flip_a_byte(tmp_path / "ckpt-000002-e0002-s000000.bin")
    with pytest.warns(
        CheckpointWarning, match=r"ckpt-000002-e0002-s000000.bin: sha256 [0-9a-f]+\.\.\. differs"
    ):
        resume, value = store.restore(lambda path: Path(path).read_bytes())
    assert (resume.file, value) == ("ckpt-000001-e0001-s000000.bin", b"old one")
    newest = store.save(b"new", epoch=3, step=0)
    flip_a_byte(tmp_path / newest.file)
    with pytest.warns(CheckpointWarning, match="sha256 root"):
        resume, value = store.restore(lambda path: Path(path).read_bytes())
    assert (resume.file, value) == ("ckpt-000001-e0001-s000000.bin", b"old one")


def test_restore_falls_back_when_the_newest_does_not_load(tmp_path: Path) -> None:
    """A file whose hash matches but whose loader fails is passed over too."""
    store = CheckpointDir(tmp_path, suffix=".bin")
    names = save_n(store, 2)

    def load(path: str) -> bytes:
        if path.endswith(names[1]):
            raise ValueError("bad pickle")
        return Path(path).read_bytes()

    with pytest.warns(CheckpointWarning, match="bad pickle"):
        resume, _ = store.restore(load)
    assert resume.file == names[0]


def test_restore_without_a_usable_checkpoint_is_an_error_not_a_fresh_start(tmp_path: Path) -> None:
    """All checkpoints corrupt: CheckpointError lists them and says how to start over."""
    store = CheckpointDir(tmp_path, suffix=".bin")
    for name in save_n(store, 2):
        flip_a_byte(tmp_path / name)
    with pytest.raises(CheckpointError, match="no usable checkpoint") as info:
        store.restore(lambda path: b"")
    assert "allow_fresh=True" in str(info.value)
    assert "ckpt-000001" in str(info.value) and "ckpt-000002" in str(info.value)


def test_restore_starts_fresh_with_a_warning_only_when_allowed(tmp_path: Path) -> None:
    """allow_fresh=True turns the error into a loud fresh start."""
    store = CheckpointDir(tmp_path, suffix=".bin")
    (name,) = save_n(store, 1)
    os.unlink(tmp_path / name)
    with pytest.warns(CheckpointWarning, match="starting fresh"):
        resume, value = store.restore(lambda path: b"", allow_fresh=True)
    assert resume.fresh and value is None and resume.rejected


def test_restore_with_a_corrupt_sidecar_uses_the_newest_verified_checkpoint(tmp_path: Path) -> None:
    """Without a readable sidecar the companions still vouch for the files."""
    store = CheckpointDir(tmp_path, suffix=".bin")
    names = save_n(store, 2)
    (tmp_path / SIDECAR_NAME).write_bytes(b"{garbage")
    with pytest.warns(CheckpointWarning, match="unreadable"):
        resume, _ = store.restore(lambda path: b"")
    assert resume.file == names[1]


def test_restore_ignores_a_newer_save_that_never_committed(tmp_path: Path) -> None:
    """A checkpoint written after the sidecar's (killed before the sidecar moved) is not used."""
    store = CheckpointDir(tmp_path, suffix=".bin")
    (committed,) = save_n(store, 1)
    newer = store.new_name(5, 0)
    (tmp_path / newer).write_bytes(b"uncommitted")
    resume, value = store.restore(lambda path: Path(path).read_bytes())
    assert resume.file == committed and value == b"payload 1" and not resume.fell_back


def test_restore_skips_a_half_deleted_older_checkpoint(tmp_path: Path) -> None:
    """An older file whose companion is gone (prune interrupted) is not a fallback candidate."""
    store = CheckpointDir(tmp_path, suffix=".bin")
    names = save_n(store, 3)
    os.unlink(tmp_path / (names[1] + ".sha256"))
    flip_a_byte(tmp_path / names[2])
    with pytest.warns(CheckpointWarning):
        resume, _ = store.restore(lambda path: b"")
    assert resume.file == names[0]


def test_restore_reports_done_and_metrics_from_the_sidecar(tmp_path: Path) -> None:
    """A finished run says so, so the script can exit at once."""
    store = CheckpointDir(tmp_path, suffix=".bin")
    store.save(b"x", epoch=10, step=0, done=True, metrics={"acc": 0.9})
    resume, _ = store.restore(lambda path: None)
    assert resume.done and resume.metrics == {"acc": 0.9}


def test_sidecar_can_name_a_file_the_user_wrote(tmp_path: Path) -> None:
    """A script with its own saves can still publish progress; restore verifies that file."""
    (tmp_path / "model.pt").write_bytes(b"own format")
    write_progress(tmp_path, epoch=4, step=0, file="model.pt")
    resume, value = CheckpointDir(tmp_path).restore(lambda path: Path(path).read_bytes())
    assert (resume.file, resume.epoch, value) == ("model.pt", 4, b"own format")


def test_directory_defaults_to_chainrun_checkpoint_dir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Inside a chainrun segment the helper saves where the service looks."""
    monkeypatch.setenv("CHAINRUN_CHECKPOINT_DIR", str(tmp_path / "watched"))
    assert CheckpointDir().path == str(tmp_path / "watched")


def test_directory_defaults_to_checkpoints_without_chainrun(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without chainrun the directory is ./checkpoints."""
    monkeypatch.chdir(tmp_path)
    assert CheckpointDir().path == str(tmp_path / "checkpoints")


def test_explicit_directory_other_than_the_watched_one_warns(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Saving elsewhere than CHAINRUN_CHECKPOINT_DIR would look like no progress: say so."""
    monkeypatch.setenv("CHAINRUN_CHECKPOINT_DIR", str(tmp_path / "watched"))
    with pytest.warns(CheckpointWarning, match="CHAINRUN_CHECKPOINT_DIR"):
        CheckpointDir(tmp_path / "elsewhere")


@pytest.mark.parametrize("kwargs", [{"keep": 0}, {"prefix": "a b"}, {"prefix": "x~y"}, {"suffix": "pt"}])
def test_bad_store_settings_are_refused(tmp_path: Path, kwargs: dict[str, object]) -> None:
    """keep < 1 or names that would break the file pattern are errors."""
    with pytest.raises(ValueError):
        CheckpointDir(tmp_path, **kwargs)  # type: ignore[arg-type]


def test_resume_skip_counts_batches_only_in_the_resumed_epoch() -> None:
    """skip(epoch) is the step for the epoch in progress and 0 for the others."""
    resume = Resume(epoch=3, step=17, file="x", fresh=False)
    assert (resume.skip(3), resume.skip(4), resume.skip(2)) == (17, 0, 0)
    assert resume.describe() == "resumed from x (epoch 3) at step 17"
