"""Reading a chain's progress: the sidecar, its cache across ticks, and sidecars that are not files.

Each test runs on this machine and over SSH to the loopback sshd that
``scripts/start-sshd`` starts (skipped without it, or failing under
CHAINRUN_REQUIRE_CLUSTERS=1). A sidecar that is a FIFO, a directory, a
symlink to /dev/zero, a device or a sparse 3 GiB file must give "no new
progress" (None) within seconds, in little memory, and be logged once.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator, MutableMapping
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Optional

import pytest
from conftest import need
from structlog.testing import capture_logs
from test_transport import (
    CLIENT_DIR,
    HANG_S,
    MiB,
    call_within,
    make_special,
    peak_memory,
    release_fifo,
    sshd_problem,
)

from chainrun import progress as reading
from chainrun.checkpoint import SIDECAR_NAME, write_progress
from chainrun.model import NO_PROGRESS, JobSpec, Progress
from chainrun.transport import LocalTransport, SSHTransport, Transport

# Each kind of hostile sidecar, and why it is refused.
HOSTILE = {
    "FIFO": "it is a FIFO, not a regular file",
    "directory": "it is a directory, not a regular file",
    "symlink to /dev/zero": "it is a symbolic link, not a regular file",
    "character device": "it is a character device, not a regular file",
    "sparse 3 GiB file": "it is 3 GiB, more than the 1 MiB allowed",
}
SHA = "ab" * 32
LONG_AGO = 1_700_000_000  # an mtime well in the past: the sidecar has settled


@pytest.fixture(params=["local", pytest.param("ssh", marks=pytest.mark.ssh)])
def transport(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[Transport]:
    """A fresh transport of each kind; the SSH one is crtest on the test sshd."""
    if request.param == "local":
        yield LocalTransport()
        return
    problem = sshd_problem()
    need(f"the test sshd ({problem})", problem is None, "scripts/start-sshd (as root)")
    monkeypatch.setenv("CHAINRUN_SSH_CONFIG", str(CLIENT_DIR / "config"))
    t = SSHTransport("crtest-local")
    yield t
    # A read that hung holds the transport's lock: never wait for it here.
    threading.Thread(target=t.close, daemon=True).start()


@pytest.fixture
def ckdir(transport: Transport, tmp_path: Path) -> Iterator[str]:
    """An empty checkpoint directory on the transport's side."""
    if transport.host is None:
        yield str(tmp_path / "ckpt")
        return
    admin = SSHTransport("crtest-local")  # its own connection: the test's may be stuck
    try:
        home = admin.run(["sh", "-c", 'printf %s "$HOME"']).stdout
        path = f"{home}/chainrun-watch-test-{uuid.uuid4().hex[:8]}"
        yield path
        admin.run(["rm", "-rf", path])
    finally:
        admin.close()


@pytest.fixture(autouse=True)
def _make_ckdir(transport: Transport, ckdir: str) -> None:
    transport.makedirs(ckdir)


def spec_for(ckdir: str) -> JobSpec:
    return JobSpec(
        name="cifar",
        command="python train.py",
        workdir="/w",
        total_time=72000,
        walltime=3600,
        target_epoch=100,
        max_failures=3,
        checkpoint_dir=ckdir,
        signal="USR1",
        grace=300,
    )


def put_sidecar(transport: Transport, ckdir: str, tmp_path: Path, epoch: int, mtime: Optional[int]) -> None:
    """A sidecar as ``write_progress`` writes it, put on the transport's side with the given mtime."""
    source = tmp_path / f"source-{uuid.uuid4().hex[:8]}"
    source.mkdir()
    write_progress(
        source, epoch=epoch, step=0, file="ckpt.pt", size=1, sha256=SHA, saved_at=1000.0, segment=1
    )
    path = f"{ckdir}/{SIDECAR_NAME}"
    transport.write_file(path, (source / SIDECAR_NAME).read_bytes())
    if mtime is not None:
        set_mtime(transport, path, mtime)


def set_mtime(transport: Transport, path: str, mtime: int) -> None:
    result = transport.run(["touch", "-h", "-m", "-d", f"@{mtime}", path])
    assert result.ok, result.describe()


def count_reads(transport: Transport, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The paths ``transport.read_file`` is asked for from now on (it still reads them)."""
    reads: list[str] = []
    read_file = transport.read_file

    def counting(path: str, limit: Optional[int] = None) -> Optional[bytes]:
        reads.append(path)
        return read_file(path, limit)

    monkeypatch.setattr(transport, "read_file", counting)
    return reads


def warnings_in(logs: list[MutableMapping[str, Any]]) -> list[MutableMapping[str, Any]]:
    return [e for e in logs if e["log_level"] == "warning"]


def tick(read: Callable[[], Optional[Progress]]) -> Optional[Progress]:
    """One tick's read of progress, which must not hang."""
    return call_within(HANG_S, read)


def epoch(progress: Optional[Progress]) -> Optional[int]:
    return progress.epoch if progress is not None else None


# -- a good sidecar ---------------------------------------------------------------


def test_a_sidecar_written_by_write_progress_is_read(
    transport: Transport, ckdir: str, tmp_path: Path
) -> None:
    put_sidecar(transport, ckdir, tmp_path, epoch=7, mtime=None)
    expected = Progress(epoch=7, step=0, file="ckpt.pt", sha256=SHA, saved_at=1000.0, segment=1)
    assert reading.read(transport, spec_for(ckdir)) == expected
    assert reading.ProgressReader().progress(transport, spec_for(ckdir)) == expected


def test_an_unchanged_sidecar_is_not_read_again_and_a_changed_one_is(
    transport: Transport, ckdir: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each tick stats the sidecar; only a new size or mtime makes it read the file again."""
    reader, spec = reading.ProgressReader(), spec_for(ckdir)
    put_sidecar(transport, ckdir, tmp_path, epoch=1, mtime=LONG_AGO)
    reads = count_reads(transport, monkeypatch)
    assert [epoch(tick(lambda: reader.progress(transport, spec))) for _ in range(3)] == [1, 1, 1]
    assert len(reads) == 1
    put_sidecar(transport, ckdir, tmp_path, epoch=2, mtime=LONG_AGO + 60)  # same size, new mtime
    assert [epoch(reader.progress(transport, spec)) for _ in range(3)] == [2, 2, 2]
    assert len(reads) == 2
    put_sidecar(transport, ckdir, tmp_path, epoch=30, mtime=LONG_AGO + 60)  # same mtime, new size
    assert epoch(reader.progress(transport, spec)) == 30
    assert len(reads) == 3


def test_a_sidecar_rewritten_in_the_second_it_was_read_is_read_again(
    transport: Transport, ckdir: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SFTP's mtimes are whole seconds: a fresh sidecar is trusted only once it has settled."""
    reader, spec = reading.ProgressReader(), spec_for(ckdir)
    # Fresh, with the cluster's clock a little ahead: not settled, however slowly this test runs.
    fresh = int(time.time()) + 30
    put_sidecar(transport, ckdir, tmp_path, epoch=1, mtime=fresh)
    reads = count_reads(transport, monkeypatch)
    assert epoch(reader.progress(transport, spec)) == 1
    put_sidecar(transport, ckdir, tmp_path, epoch=2, mtime=fresh)  # same size, same mtime
    assert epoch(reader.progress(transport, spec)) == 2
    set_mtime(transport, f"{ckdir}/{SIDECAR_NAME}", LONG_AGO)
    assert epoch(reader.progress(transport, spec)) == 2
    assert epoch(reader.progress(transport, spec)) == 2
    assert len(reads) == 3, "read while fresh, twice, and once when its mtime changed; then from the cache"


def test_without_a_sidecar_the_newest_regular_checkpoint_stands_in(
    transport: Transport, ckdir: str, request: pytest.FixtureRequest
) -> None:
    spec = spec_for(ckdir)
    assert reading.read(transport, spec) == NO_PROGRESS
    for name, mtime in (("a.pt", LONG_AGO), ("b.pt", LONG_AGO + 10), (".hidden", LONG_AGO + 20)):
        transport.write_file(f"{ckdir}/{name}", b"x")
        set_mtime(transport, f"{ckdir}/{name}", mtime)
    make_special(transport, "FIFO", f"{ckdir}/c.fifo")
    request.addfinalizer(lambda: release_fifo(f"{ckdir}/c.fifo"))
    make_special(transport, "symlink to /dev/zero", f"{ckdir}/d.pt")
    progress = call_within(HANG_S, lambda: reading.ProgressReader().progress(transport, spec))
    assert progress == Progress(file="b.pt", saved_at=float(LONG_AGO + 10))


# -- sidecars that are not files --------------------------------------------------


@pytest.mark.parametrize("kind", HOSTILE)
def test_a_hostile_sidecar_gives_no_new_progress_at_once_in_little_memory(
    transport: Transport, ckdir: str, kind: str, request: pytest.FixtureRequest
) -> None:
    """None within seconds: never a tick stuck on a FIFO, nor gigabytes read from /dev/zero."""
    path = f"{ckdir}/{SIDECAR_NAME}"
    make_special(transport, kind, path)
    request.addfinalizer(lambda: release_fifo(path))
    spec = spec_for(ckdir)
    with capture_logs():
        progress, peak = peak_memory(lambda: tick(lambda: reading.read(transport, spec)))
    assert progress is None
    assert peak < 100 * MiB


@pytest.mark.parametrize("kind", HOSTILE)
def test_a_hostile_sidecar_is_logged_once_across_ticks(
    transport: Transport, ckdir: str, kind: str, request: pytest.FixtureRequest
) -> None:
    """Tick after tick it is "no new progress", and one warning that names the path and why."""
    path = f"{ckdir}/{SIDECAR_NAME}"
    make_special(transport, kind, path)
    request.addfinalizer(lambda: release_fifo(path))
    reader, spec = reading.ProgressReader(), spec_for(ckdir)
    with capture_logs() as logs:
        for i in range(4):
            assert tick(lambda: reader.progress(transport, spec)) is None
            if kind == "sparse 3 GiB file":  # it grows: read again, refused for the same reason
                assert transport.run(["truncate", "-s", f"{4 + i}G", path]).ok
    warnings = warnings_in(logs)
    assert len(warnings) == 1, warnings
    assert warnings[0]["path"] == path
    assert warnings[0]["error"].endswith(f"{path} on {transport.host or 'localhost'}: {HOSTILE[kind]}")


def test_an_unreadable_sidecar_is_logged_once_until_it_reads_well_again(
    transport: Transport, ckdir: str, tmp_path: Path
) -> None:
    reader, spec = reading.ProgressReader(), spec_for(ckdir)
    path = f"{ckdir}/{SIDECAR_NAME}"
    with capture_logs() as logs:
        for i in range(3):
            transport.write_file(path, b'{"epoch": 3')  # a script that writes it by hand, and badly
            set_mtime(transport, path, LONG_AGO + i)
            assert reader.progress(transport, spec) is None
        assert len(warnings_in(logs)) == 1
        put_sidecar(transport, ckdir, tmp_path, epoch=4, mtime=LONG_AGO + 10)
        assert epoch(reader.progress(transport, spec)) == 4
        transport.write_file(path, b'{"epoch": 3')
        assert reader.progress(transport, spec) is None
    warnings = warnings_in(logs)
    assert len(warnings) == 2, "reported again once it had been good"
    assert warnings[0]["event"] == "progress sidecar unreadable, counting no new progress"


# -- the script's own JSON file (progress = "FILE:KEY") ----------------------------


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        (b'{"epoch": 12, "lr": 0.1}', 12),
        (b'{"meta": {"epoch": 3}}', None),  # the key is "epoch" at the top: not found
        (b'{"epoch": true}', None),
        (b'{"epoch": -1}', None),
        (b'{"epoch": "7"}', None),
        (b"not json", None),
    ],
)
def test_the_epoch_is_read_from_the_scripts_own_json_file_at_its_key(
    transport: Transport, ckdir: str, content: bytes, expected: Optional[int]
) -> None:
    """A whole number at the key is the epoch, saved at the file's mtime; anything else is
    "unreadable" (no new progress), said once in the log, never a crash."""
    path = f"{ckdir}/state.json"
    transport.write_file(path, content)
    set_mtime(transport, path, LONG_AGO)
    spec = replace(spec_for(ckdir), progress_file=path, progress_key="epoch")
    with capture_logs() as logs:
        progress = tick(lambda: reading.ProgressReader().progress(transport, spec))
    if expected is None:
        assert progress is None
        assert [e["path"] for e in warnings_in(logs)] == [path]
    else:
        assert progress == Progress(epoch=expected, file="state.json", saved_at=float(LONG_AGO))


def test_a_dotted_key_reaches_into_nested_objects(transport: Transport, ckdir: str) -> None:
    path = f"{ckdir}/state.json"
    transport.write_file(path, b'{"meta": {"epoch": 3}, "epoch": 99}')
    spec = replace(spec_for(ckdir), progress_file=path, progress_key="meta.epoch")
    progress = reading.read(transport, spec)
    assert progress is not None and progress.epoch == 3


def test_metrics_are_an_object_in_json_and_the_stored_list_of_pairs_still_reads() -> None:
    """``status --json`` and every stored record give the metrics as name: value, in the
    sidecar's order (issue 36: a list of pairs was no object a script could index); a record
    stored before, with its list of pairs, reads the same."""
    from chainrun.model import Progress

    p = Progress(epoch=3, metrics=(("loss", 0.5), ("acc", 0.9)))
    assert p.to_json()["metrics"] == {"loss": 0.5, "acc": 0.9}
    assert list(p.to_json()["metrics"]) == ["loss", "acc"]
    assert Progress.from_json(p.to_json()) == p
    assert Progress.from_json({**p.to_json(), "metrics": [["loss", 0.5], ["acc", 0.9]]}) == p
    assert Progress.from_json({"epoch": 1}) == Progress(epoch=1)


# -- no sidecar: the checkpoint directory's listing ----------------------------------


def count_calls(transport: Transport, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the file-system calls made through ``transport`` from now on."""
    made: list[str] = []
    for name in ("stat", "listdir", "read_file"):
        method = getattr(transport, name)

        def counting(*args: Any, _m: Any = method, _n: str = name, **kw: Any) -> Any:
            made.append(_n)
            return _m(*args, **kw)

        monkeypatch.setattr(transport, name, counting)
    return made


def test_without_a_sidecar_a_running_chain_s_directory_is_listed_only_when_due(
    transport: Transport, ckdir: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One listing per due time while the chain just runs, and between them one stat of the
    sidecar's path (a sidecar that comes is read at once: the first save of a script that uses
    the helper); a listing at every read that is not ``running``; a sidecar is read from then on."""
    reader, spec = reading.ProgressReader(), spec_for(ckdir)
    transport.write_file(f"{ckdir}/model.pt", b"x")
    set_mtime(transport, f"{ckdir}/model.pt", LONG_AGO)
    calls = count_calls(transport, monkeypatch)
    first = reader.progress(transport, spec, 0.0, running=True)
    assert first == Progress(file="model.pt", saved_at=float(LONG_AGO))
    assert calls == ["stat", "listdir"]
    transport.write_file(f"{ckdir}/model.pt", b"y")  # saved over in place
    set_mtime(transport, f"{ckdir}/model.pt", LONG_AGO + 100)
    calls.clear()
    seen = [reader.progress(transport, spec, float(t), running=True) for t in range(10, 130, 10)]
    assert sorted(calls) == ["listdir"] * 2 + ["stat"] * 10, "one listing in each of the two windows of 60 s"
    assert seen[-1] == Progress(file="model.pt", saved_at=float(LONG_AGO + 100))
    calls.clear()
    assert reader.progress(transport, spec, 130.0) == seen[-1]  # judged: read now
    assert calls == ["listdir"]
    put_sidecar(transport, ckdir, tmp_path, epoch=5, mtime=LONG_AGO)
    calls.clear()
    assert epoch(reader.progress(transport, spec, 131.0)) == 5
    assert calls == ["listdir", "stat", "read_file"]
    calls.clear()
    assert epoch(reader.progress(transport, spec, 132.0, running=True)) == 5
    assert calls == ["stat"], "a sidecar is looked at every tick, as before"


def test_a_sidecar_that_comes_while_the_first_segment_runs_is_read_at_the_next_tick(
    transport: Transport, ckdir: str, tmp_path: Path
) -> None:
    """A chain whose directory had no sidecar at its last listing (a first segment that has
    not saved yet) sees its first save at the next tick, not at the next listing a minute
    later: the web page's curves and the progress log keep every epoch (test_ui's live page
    lost epochs 1 and 2 when it waited for the listing)."""
    reader, spec = reading.ProgressReader(), spec_for(ckdir)
    assert reader.progress(transport, spec, 0.0, running=True) == NO_PROGRESS
    put_sidecar(transport, ckdir, tmp_path, epoch=1, mtime=LONG_AGO)
    assert epoch(reader.progress(transport, spec, 1.0, running=True)) == 1


@pytest.mark.parametrize(
    ("started", "now", "watched"),
    [
        (None, 5000.0, True),  # its start not known: looked for
        (1000.0, 1000.0, True),  # the segment just started
        (1000.0, 1000.0 + reading.PROGRESS_EVERY - 1, True),  # still in its first minute
        (1000.0, 1000.0 + reading.PROGRESS_EVERY, False),  # past it: the next listing finds it
        (1000.0, 1000.0 + 3600, False),  # an hour in
        (-float("inf"), 1000.0, False),  # nothing of it runs: nothing can write one
    ],
)
def test_a_sidecar_is_looked_for_between_listings_only_in_a_segment_s_first_minute(
    started: Optional[float], now: float, watched: bool
) -> None:
    """The rule: a chain whose directory had no sidecar stats the sidecar's path between its
    directory's listings only while the segment that runs is in its first PROGRESS_EVERY."""
    assert reading.sidecar_watched(started, now) is watched


def test_a_running_chain_not_watched_reads_nothing_between_listings(
    transport: Transport, ckdir: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past its segment's first minute (``watched=False``), a running chain whose directory
    had no sidecar makes no call until its next listing is due, and that listing finds a
    sidecar that came in between."""
    reader, spec = reading.ProgressReader(), spec_for(ckdir)
    assert reader.progress(transport, spec, 0.0, running=True, watched=False) == NO_PROGRESS
    window = reader.standing(transport, spec)
    assert window is not None
    calls = count_calls(transport, monkeypatch)
    put_sidecar(transport, ckdir, tmp_path, epoch=4, mtime=LONG_AGO)
    calls.clear()
    assert reader.progress(transport, spec, window[1] - 1, running=True, watched=False) == NO_PROGRESS
    assert calls == [], "nothing read between listings"
    assert epoch(reader.progress(transport, spec, window[1], running=True, watched=False)) == 4
    assert calls[0] == "listdir", calls
