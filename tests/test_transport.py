"""Contract tests for chainrun.transport, run against this machine and the test sshd.

The SSH half talks to the loopback sshd that ``scripts/start-sshd`` starts
(127.0.0.1:2222, user crtest). Without it the SSH tests skip, or fail when
CHAINRUN_REQUIRE_CLUSTERS=1.

``call_within``, ``make_special`` and ``release_fifo`` are shared with
test_watch: a read that regresses into a hang fails the test instead of
stalling the suite.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import tracemalloc
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, TypeVar

import paramiko
import pytest
from conftest import need

from chainrun.errors import TransportError
from chainrun.model import CommandResult
from chainrun.transport import (
    FileInfo,
    FileRefused,
    LocalTransport,
    SSHTransport,
    Transport,
    transport_for,
)

CLIENT_DIR = Path("/var/lib/chainrun-test/ssh")
SSHD_ADDR = ("127.0.0.1", 2222)
HOSTILE = [
    "a b",
    "it's",
    '"double"',
    "$(echo injected)",
    "`id`",
    "line1\nline2",
    "*",
    "",
    "-n",
    "back\\slash",
    "$HOME",
    "; exit 9",
    "| cat",
    "!!",
    "tab\there",
    "ünïcödé",
]


T = TypeVar("T")

MiB = 1024 * 1024
# What each special file is made with, and what FileRefused calls it.
SPECIAL = {
    "FIFO": "a FIFO",
    "directory": "a directory",
    "symlink to /dev/zero": "a symbolic link",
    "character device": "a character device",
}


def sshd_problem() -> str | None:
    """Why the test sshd cannot be used, or None when it can."""
    if not (CLIENT_DIR / "config").is_file():
        return f"{CLIENT_DIR}/config is missing"
    try:
        socket.create_connection(SSHD_ADDR, timeout=2).close()
    except OSError as e:
        return f"nothing answers on {SSHD_ADDR[0]}:{SSHD_ADDR[1]} ({e.strerror or e})"
    return None


@pytest.fixture(scope="module")
def sshd() -> None:
    """Skip (or fail under CHAINRUN_REQUIRE_CLUSTERS=1) without the test sshd."""
    problem = sshd_problem()
    need(f"the test sshd ({problem})", problem is None, "scripts/start-sshd (as root)")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _host_keys(kind: str | None = None) -> str:
    lines = (CLIENT_DIR / "known_hosts").read_text().splitlines()
    return "".join(f"{line}\n" for line in lines if kind is None or f" {kind} " in line)


@pytest.fixture(scope="module")
def ssh_config(sshd: None, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The start-sshd config plus hosts that fail in the ways tests need."""
    d = tmp_path_factory.mktemp("ssh")
    key = CLIENT_DIR / "id_ed25519"
    stranger = d / "stranger_key"
    paramiko.ECDSAKey.generate().write_private_key_file(str(stranger))
    client_pub = (CLIENT_DIR / "id_ed25519.pub").read_text().split()
    files = {
        "empty_known_hosts": "",
        "ecdsa_known_hosts": _host_keys("ecdsa-sha2-nistp256"),
        # A key of the right type that is not the server's: a changed host key.
        "wrong_known_hosts": f"[127.0.0.1]:2222 {client_pub[0]} {client_pub[1]}\n",
    }
    for name, text in files.items():
        (d / name).write_text(text)

    def host(
        alias: str, *, port: int = 2222, known: str | Path, identity: Path = key, extra: str = ""
    ) -> str:
        return (
            f"Host {alias}\n    HostName 127.0.0.1\n    Port {port}\n    User crtest\n"
            f"    IdentityFile {identity}\n    IdentitiesOnly yes\n"
            f"    UserKnownHostsFile {known}\n    GlobalKnownHostsFile /dev/null\n{extra}\n"
        )

    known = CLIENT_DIR / "known_hosts"
    config = d / "config"
    config.write_text(
        (CLIENT_DIR / "config").read_text()
        + "\n"
        + host("unknown-key", known=d / "empty_known_hosts")
        + host("changed-key", known=d / "wrong_known_hosts")
        + host("ecdsa-only", known=d / "ecdsa_known_hosts")
        + host("refused", port=_free_port(), known=known)
        + host("bad-auth", known=known, identity=stranger)
        + host("via-jump", known=known, extra="    ProxyJump crtest-local\n")
    )
    return config


@pytest.fixture
def use_ssh_config(ssh_config: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("CHAINRUN_SSH_CONFIG", str(ssh_config))
    return ssh_config


@pytest.fixture(params=["local", pytest.param("ssh", marks=pytest.mark.ssh)])
def transport(request: pytest.FixtureRequest) -> Iterator[Transport]:
    """A fresh transport of each kind; the SSH one is crtest on the test sshd."""
    t: Transport
    if request.param == "local":
        t = LocalTransport()
    else:
        request.getfixturevalue("use_ssh_config")
        t = SSHTransport("crtest-local")
    yield t
    t.close()


@pytest.fixture
def ssh(use_ssh_config: Path) -> Iterator[SSHTransport]:
    t = SSHTransport("crtest-local")
    yield t
    t.close()


@pytest.fixture
def workdir(transport: Transport, tmp_path: Path) -> Iterator[str]:
    """An absolute, empty directory on the transport's side."""
    if transport.host is None:
        yield str(tmp_path)
        return
    home = transport.run(["sh", "-c", 'printf %s "$HOME"']).stdout
    path = f"{home}/chainrun-transport-test-{uuid.uuid4().hex[:8]}"
    assert transport.run(["mkdir", path]).ok
    yield path
    transport.run(["rm", "-rf", path])


HANG_S = 30.0  # past this a read is hung (blocked on a FIFO), however busy the machine


def call_within(seconds: float, fn: Callable[[], T]) -> T:
    """``fn()``, run in a daemon thread so that a hang fails the test instead of stalling the suite."""
    outcome: list[T] = []
    error: list[BaseException] = []

    def target() -> None:
        try:
            outcome.append(fn())
        except BaseException as e:
            error.append(e)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        pytest.fail(f"did not return within {seconds:g} s")
    if error:
        raise error[0]
    return outcome[0]


def peak_memory(fn: Callable[[], T]) -> tuple[T, int]:
    """``fn()`` and the most memory Python allocated meanwhile, in bytes (all threads)."""
    tracemalloc.start()
    try:
        return fn(), tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def make_special(t: Transport, kind: str, path: str) -> None:
    """Put a ``kind`` from SPECIAL, or a "sparse 3 GiB file", at ``path`` on the transport's side."""
    maker = t
    if kind == "character device":
        argv = ["mknod", path, "c", "1", "5"]  # what /dev/zero is: reading it never ends
        if t.host is None and os.geteuid() != 0:
            pytest.skip("mknod needs root")
        if t.host is not None:
            maker = SSHTransport("root-local")  # the test sshd's own root
    else:
        argv = {
            "FIFO": ["mkfifo", path],
            "directory": ["mkdir", path],
            "symlink to /dev/zero": ["ln", "-s", "/dev/zero", path],
            "sparse 3 GiB file": ["truncate", "-s", "3G", path],
        }[kind]
    try:
        result = maker.run(argv)
    finally:
        if maker is not t:
            maker.close()
    assert result.ok, result.describe()


def refusal(read: Callable[[], object], seconds: float = HANG_S) -> FileRefused:
    """The FileRefused that ``read`` raises, within ``seconds``."""
    with pytest.raises(FileRefused) as excinfo:
        call_within(seconds, read)
    return excinfo.value


def release_fifo(path: str) -> None:
    """Let go a reader stuck opening the FIFO at ``path`` (here, or on the loopback sshd): open its write end."""
    with contextlib.suppress(OSError):  # no reader, or no FIFO: nothing to release
        os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))


def _mode(t: Transport, path: str) -> str:
    result = t.run(["stat", "-c", "%a", path])
    assert result.ok, result.describe()
    return result.stdout.strip()


def _wait_until_dead(t: Transport, pidfile: str) -> bool:
    """True once the process in ``pidfile`` is gone or a zombie (init may reap late)."""
    alive = 'state=$(cut -d" " -f3 "/proc/$(cat "$1")/stat" 2>/dev/null) && [ "$state" != Z ]'
    deadline = time.monotonic() + 3
    while time.monotonic() < deadline:
        if not t.run(["sh", "-c", alive, "sh", pidfile]).ok:
            return True
        time.sleep(0.05)
    return False


# -- commands -----------------------------------------------------------------


def test_run_delivers_hostile_arguments_verbatim(transport: Transport) -> None:
    """Spaces, quotes, $(), backticks, newlines and globs reach the command unchanged."""
    result = transport.run(["printf", "<%s>", *HOSTILE])
    assert result.stdout == "".join(f"<{a}>" for a in HOSTILE)
    assert result.returncode == 0


def test_run_returns_nonzero_exit_as_result_with_both_streams(transport: Transport) -> None:
    """A failing command is a CommandResult with its code and output, not an exception."""
    result = transport.run(["sh", "-c", "echo out; echo 'it broke' >&2; exit 7"])
    assert (result.returncode, result.stdout, result.stderr) == (7, "out\n", "it broke\n")
    assert not result.ok
    assert result.describe() == "sh exited 7: it broke"
    assert result.argv == ("sh", "-c", "echo out; echo 'it broke' >&2; exit 7")


def test_run_reports_death_by_signal_as_128_plus_signal(transport: Transport) -> None:
    """A command killed by a signal reads 128+N, as in a shell, on both sides."""
    assert transport.run(["sh", "-c", "kill -9 $$"]).returncode == 137


def test_run_feeds_input_on_stdin_and_gives_empty_stdin_otherwise(transport: Transport) -> None:
    """``input`` arrives byte for byte; without it the command sees EOF at once."""
    text = "line one\nzwei ü\n$(not run)\n"
    assert transport.run(["cat"], input=text).stdout == text
    assert transport.run(["cat"], timeout=10).stdout == ""


def test_run_streams_large_input_and_output(transport: Transport) -> None:
    """Megabytes in both directions neither deadlock nor truncate."""
    big = "x" * (3 * 1024 * 1024)
    assert transport.run(["wc", "-c"], input=big).stdout.strip() == str(len(big))
    result = transport.run(["sh", "-c", "head -c 2000000 /dev/zero | tr '\\0' y; echo done >&2"])
    assert len(result.stdout) == 2_000_000 and result.stderr == "done\n"


def test_run_passes_env_on_top_of_the_inherited_environment(transport: Transport) -> None:
    """``env`` values arrive verbatim and PATH/HOME are still there."""
    value = "v a l'ue $(id) `id`\nnext"
    result = transport.run(
        ["sh", "-c", 'printf "%s|%s" "$CR_VALUE" "$CR_OTHER"; test -n "$HOME" && test -n "$PATH"'],
        env={"CR_VALUE": value, "CR_OTHER": ""},
    )
    assert result.ok, result.describe()
    assert result.stdout == f"{value}|"


def test_run_rejects_invalid_env_names_and_empty_argv(transport: Transport) -> None:
    """Programming errors are ValueErrors raised before anything runs."""
    with pytest.raises(ValueError, match="not valid"):
        transport.run(["true"], env={"BAD NAME": "x"})
    with pytest.raises(ValueError, match="empty"):
        transport.run([])


def test_missing_command_exits_127_command_not_found(transport: Transport) -> None:
    """A missing executable is exit 127 and "<cmd>: command not found", locally too."""
    result = transport.run(["chainrun-no-such-command", "arg"])
    assert result.returncode == 127
    assert "chainrun-no-such-command: command not found" in result.stderr


def test_timeout_raises_transport_error_and_kills_the_command_and_its_children(
    transport: Transport, workdir: str
) -> None:
    """A hung command raises TransportError naming it and the host; nothing is left running."""
    pidfile = f"{workdir}/child.pid"
    started = time.monotonic()
    with pytest.raises(TransportError) as excinfo:
        transport.run(["sh", "-c", 'sleep 30 & echo $! > "$1"; wait', "sh", pidfile], timeout=0.5)
    assert time.monotonic() - started < 5
    message = str(excinfo.value)
    assert "sh did not answer within 0.5 s on " in message
    assert (transport.host or "localhost") in message and "\n" not in message
    assert _wait_until_dead(transport, pidfile), "the timed-out command's child still runs"
    assert transport.run(["true"]).ok, "the transport is usable after a timeout"


def test_close_then_run_opens_a_new_connection(transport: Transport) -> None:
    """close() is not final: the next call works again."""
    assert transport.run(["true"]).ok
    transport.close()
    assert transport.run(["echo", "again"]).stdout == "again\n"


# -- files --------------------------------------------------------------------


def test_missing_paths_read_as_none_and_remove_quietly(transport: Transport, workdir: str) -> None:
    """Missing file -> None, missing dir -> None, removing a missing file is fine."""
    assert transport.read_file(f"{workdir}/nope") is None
    assert transport.listdir(f"{workdir}/no-dir") is None
    transport.remove(f"{workdir}/nope")


def test_write_file_is_private_atomic_and_replaces(transport: Transport, workdir: str) -> None:
    """Written files are 0600, replace the old content whole, and leave no temp file."""
    path = f"{workdir}/state.json"
    transport.write_file(path, b"first")
    transport.write_file(path, b"\x00second\xff")
    assert transport.read_file(path) == b"\x00second\xff"
    assert _mode(transport, path) == "600"
    listing = transport.listdir(workdir)
    assert listing is not None and [i.name for i in listing] == ["state.json"]


def test_readers_never_see_a_partially_written_file(transport: Transport, workdir: str) -> None:
    """While one file is rewritten over and over, every read gets one whole version."""
    path = f"{workdir}/progress"
    versions = [b"A" * 300_000, b"B" * 200_000]
    transport.write_file(path, versions[0])
    reader = LocalTransport() if transport.host is None else SSHTransport("crtest-local")
    seen: list[bytes | None] = []
    done = threading.Event()

    def read_until_done() -> None:
        while not done.is_set():
            seen.append(reader.read_file(path))

    thread = threading.Thread(target=read_until_done)
    thread.start()
    try:
        for i in range(20):
            transport.write_file(path, versions[i % 2])
    finally:
        done.set()
        thread.join()
        reader.close()
    assert seen and all(data in versions for data in seen)


def test_write_file_honours_an_explicit_mode(transport: Transport, workdir: str) -> None:
    """``mode`` is applied exactly, whatever the umask."""
    transport.write_file(f"{workdir}/run.sh", b"#!/bin/sh\n", mode=0o755)
    assert _mode(transport, f"{workdir}/run.sh") == "755"


def test_create_file_creates_only_where_nothing_is_and_one_of_two_at_once_wins(
    transport: Transport, workdir: str
) -> None:
    """The claim's primitive: a file created private with its bytes, whole (never seen empty or
    part written), and never over anything that is there (a file, a directory, a dangling
    link); of several creators at once, one."""
    path = f"{workdir}/seg-0002.queued"
    assert transport.create_file(path, b"walltime=60\n") is True
    assert transport.read_file(path) == b"walltime=60\n" and _mode(transport, path) == "600"
    assert transport.create_file(path, b"by=another\n") is False
    assert transport.read_file(path) == b"walltime=60\n"
    transport.makedirs(f"{workdir}/d")
    assert transport.create_file(f"{workdir}/d", b"x") is False
    transport.run(["ln", "-s", f"{workdir}/nowhere", f"{workdir}/link"])
    assert transport.create_file(f"{workdir}/link", b"x") is False
    with pytest.raises(TransportError, match=r"cannot create .*/no-dir/f on "):
        transport.create_file(f"{workdir}/no-dir/f", b"x")
    with ThreadPoolExecutor(8) as pool:
        won = list(pool.map(lambda i: transport.create_file(f"{workdir}/race", b"%d" % i), range(8)))
    assert won.count(True) == 1
    listing = transport.listdir(workdir) or []
    assert [i.name for i in listing if i.name.endswith(".tmp")] == []  # written whole, aside, then linked


def test_write_file_into_missing_directory_raises_transport_error(transport: Transport, workdir: str) -> None:
    """A write that cannot happen names the path, in one line."""
    with pytest.raises(TransportError, match=r"cannot write .*/no-dir/f on "):
        transport.write_file(f"{workdir}/no-dir/f", b"x")


def test_makedirs_creates_parents_0700_and_tolerates_existing(transport: Transport, workdir: str) -> None:
    """Every directory it creates is 0700; an existing one is left alone."""
    assert transport.run(["chmod", "755", workdir]).ok
    transport.makedirs(f"{workdir}/a/b/c")
    transport.makedirs(f"{workdir}/a/b/c")
    for d in ("a", "a/b", "a/b/c"):
        assert _mode(transport, f"{workdir}/{d}") == "700"
    assert _mode(transport, workdir) == "755"


def test_makedirs_over_a_file_raises_transport_error(transport: Transport, workdir: str) -> None:
    """A file in the way is an error that names it."""
    transport.write_file(f"{workdir}/f", b"")
    with pytest.raises(TransportError, match=r"(?i)not a directory"):
        transport.makedirs(f"{workdir}/f/sub")


def test_listdir_reports_name_size_mtime_and_kind(transport: Transport, workdir: str) -> None:
    """Files and directories are listed sorted, with size and mtime; symlinks are followed."""
    transport.write_file(f"{workdir}/b.ckpt", b"12345")
    transport.makedirs(f"{workdir}/a-dir")
    assert transport.run(["ln", "-s", "b.ckpt", f"{workdir}/latest"]).ok
    listing = transport.listdir(workdir)
    assert listing is not None
    by_name = {i.name: i for i in listing}
    assert [i.name for i in listing] == ["a-dir", "b.ckpt", "latest"]
    assert by_name["b.ckpt"].size == 5 and by_name["b.ckpt"].is_file
    assert not by_name["a-dir"].is_file
    assert by_name["latest"].is_file and by_name["latest"].size == 5
    assert abs(by_name["b.ckpt"].mtime - time.time()) < 120


def test_remove_deletes_a_file(transport: Transport, workdir: str) -> None:
    transport.write_file(f"{workdir}/gone", b"x")
    transport.remove(f"{workdir}/gone")
    assert transport.read_file(f"{workdir}/gone") is None


def test_rename_moves_a_directory_whole_and_never_replaces_what_is_there(
    transport: Transport, workdir: str
) -> None:
    """`submit --fresh` moves checkpoints aside with it: the directory and its files arrive
    as they were; a target that exists, even an empty directory, is refused and both stay."""
    transport.makedirs(f"{workdir}/ckpt")
    transport.write_file(f"{workdir}/ckpt/model.pt", b"weights")
    transport.rename(f"{workdir}/ckpt", f"{workdir}/ckpt.old")
    assert transport.stat(f"{workdir}/ckpt") is None
    assert transport.read_file(f"{workdir}/ckpt.old/model.pt") == b"weights"
    transport.makedirs(f"{workdir}/ckpt")
    transport.makedirs(f"{workdir}/empty")
    for taken in ("ckpt.old", "empty"):
        with pytest.raises(TransportError, match="cannot rename"):
            transport.rename(f"{workdir}/ckpt", f"{workdir}/{taken}")
    assert transport.stat(f"{workdir}/ckpt") is not None
    assert transport.read_file(f"{workdir}/ckpt.old/model.pt") == b"weights"


def test_read_file_reads_a_regular_file_up_to_the_limit(transport: Transport, workdir: str) -> None:
    """``limit`` is the most bytes a file may have: up to it the file is read, over it refused."""
    path = f"{workdir}/f"
    data = bytes(range(100))
    transport.write_file(path, data)
    assert transport.read_file(path) == data
    assert transport.read_file(path, limit=100) == data
    with pytest.raises(FileRefused) as excinfo:
        transport.read_file(path, limit=99)
    where = transport.host or "localhost"
    assert (
        str(excinfo.value)
        == f"cannot read {path} on {where}: it is 100 bytes, more than the 99 bytes allowed"
    )
    assert excinfo.value.reason == "larger than 99 bytes"
    assert transport.read_file(f"{workdir}/nope", limit=10) is None


@pytest.mark.parametrize("kind", SPECIAL)
def test_read_file_refuses_what_is_not_a_regular_file_at_once(
    transport: Transport, workdir: str, kind: str, request: pytest.FixtureRequest
) -> None:
    """A FIFO (whose open would wait for a writer), a directory, a symlink or a device is refused, quickly."""
    path = f"{workdir}/special"
    make_special(transport, kind, path)
    request.addfinalizer(lambda: release_fifo(path))
    error = refusal(lambda: transport.read_file(path))
    what = SPECIAL[kind]
    where = transport.host or "localhost"
    assert str(error) == f"cannot read {path} on {where}: it is {what}, not a regular file"
    assert error.reason == what
    assert isinstance(error, TransportError)  # a transport's trouble, as the engine expects


@pytest.mark.parametrize("device", ["/dev/zero", "/dev/null"])
def test_read_file_refuses_a_device(transport: Transport, device: str) -> None:
    """/dev/zero would never end."""
    error = refusal(lambda: transport.read_file(device, limit=MiB))
    assert str(error).endswith(": it is a character device, not a regular file")
    assert str(error).startswith(f"cannot read {device} on ")


def test_read_file_refuses_a_file_over_the_limit_before_reading_it(
    transport: Transport, workdir: str
) -> None:
    """A sparse 3 GiB file with a 1 MiB limit: refused at once, without reading any of it."""
    path = f"{workdir}/big"
    make_special(transport, "sparse 3 GiB file", path)
    error, peak = peak_memory(lambda: refusal(lambda: transport.read_file(path, limit=MiB)))
    where = transport.host or "localhost"
    assert str(error) == f"cannot read {path} on {where}: it is 3 GiB, more than the 1 MiB allowed"
    assert error.reason == "larger than 1 MiB"
    assert peak < 10 * MiB


@pytest.mark.parametrize("kind", ["FIFO", "symlink to /dev/zero"])
def test_a_special_file_swapped_in_after_the_lstat_is_refused_too(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    """Locally the open neither waits for a FIFO's writer nor follows a symlink; fstat has the last word."""
    regular, path = tmp_path / "regular", str(tmp_path / "special")
    regular.write_bytes(b"x")
    make_special(LocalTransport(), kind, path)
    real_lstat = os.lstat
    # As if the lstat ran just before the swap.
    monkeypatch.setattr(os, "lstat", lambda p: real_lstat(regular if p == path else p))
    error = refusal(lambda: LocalTransport().read_file(path))
    assert error.reason == SPECIAL[kind]


def test_stat_describes_the_path_itself_and_is_none_when_missing(transport: Transport, workdir: str) -> None:
    """stat is lstat: a symlink to a file is not a file; a FIFO or directory is not either."""
    transport.write_file(f"{workdir}/f", b"12345")
    assert transport.run(["ln", "-s", "f", f"{workdir}/link"]).ok
    make_special(transport, "FIFO", f"{workdir}/fifo")
    info = transport.stat(f"{workdir}/f")
    assert info is not None and (info.name, info.size, info.is_file) == ("f", 5, True)
    assert abs(info.mtime - time.time()) < 120
    for name in ("link", "fifo"):
        other = transport.stat(f"{workdir}/{name}")
        assert isinstance(other, FileInfo) and other.name == name and not other.is_file
    directory = transport.stat(workdir + "/")
    assert directory is not None and not directory.is_file
    assert transport.stat(f"{workdir}/nope") is None
    # Beneath a file nothing is (a checkpoint directory's name taken by a file): as over SFTP,
    # whose server answers "no such file" for ENOTDIR, not an error that stalls a chain's tick.
    assert transport.stat(f"{workdir}/f/chainrun-progress.json") is None
    assert transport.read_file(f"{workdir}/f/chainrun-progress.json") is None
    assert transport.listdir(f"{workdir}/f") is None  # no directory is there


def test_tilde_paths_are_relative_to_the_home_directory(
    transport: Transport, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``~/x`` means x in the home of whoever the transport runs as."""
    if transport.host is None:
        monkeypatch.setenv("HOME", str(tmp_path))
    name = f"chainrun-tilde-{uuid.uuid4().hex[:8]}"
    try:
        transport.makedirs(f"~/{name}")
        transport.write_file(f"~/{name}/f", b"tilde")
        result = transport.run(["sh", "-c", 'cat "$HOME/$1/f"', "sh", name])
        assert result.stdout == "tilde"
        assert transport.read_file(f"~/{name}/f") == b"tilde"
    finally:
        transport.run(["sh", "-c", 'rm -rf "$HOME/$1"', "sh", name])


# -- results and the factory --------------------------------------------------


def test_describe_falls_back_to_stdout_and_to_the_bare_code() -> None:
    """describe() names the program and the first non-blank line of output."""
    assert CommandResult(("/usr/bin/sbatch", "x"), 1, "", "\n  sbatch: error: bad\nmore\n").describe() == (
        "sbatch exited 1: sbatch: error: bad"
    )
    assert CommandResult(("qsub",), 2, "only stdout\n", "").describe() == "qsub exited 2: only stdout"
    assert CommandResult(("true",), 0, "", "").describe() == "true exited 0"


def test_transport_for_gives_local_for_no_host_and_one_ssh_transport_per_host() -> None:
    assert isinstance(transport_for(None), LocalTransport)
    assert transport_for("") is transport_for(None)
    cluster = transport_for("chainrun-test-cluster")
    assert isinstance(cluster, SSHTransport) and cluster.host == "chainrun-test-cluster"
    assert transport_for("chainrun-test-cluster") is cluster
    assert transport_for("chainrun-test-other") is not cluster


# Run in a fresh interpreter: what it imported is left in sys.modules, as a command's would be.
_LOCAL_WORK_THEN_A_HOST = """
import json, os, sys, tempfile

import chainrun.cli
from chainrun.transport import (
    CommandResult, FileInfo, FileRefused, LocalTransport, Transport, transport_for,
)

heavy = ("paramiko", "invoke")
seen = {"import": [m for m in heavy if m in sys.modules]}
local = transport_for(None)
with tempfile.TemporaryDirectory() as d:
    local.makedirs(os.path.join(d, "ck"))
    local.write_file(os.path.join(d, "ck", "f"), b"x")
    assert local.read_file(os.path.join(d, "ck", "f")) == b"x"
    assert [i.name for i in local.listdir(os.path.join(d, "ck"))] == ["f"]
    assert local.stat(os.path.join(d, "ck")).is_dir
    assert local.run(["true"]).ok
seen["local work"] = [m for m in heavy if m in sys.modules]
transport_for("some-host")  # builds the transport; connects on first use only
seen["a host"] = [m for m in heavy if m in sys.modules]
print(json.dumps(seen))
"""


def test_paramiko_is_imported_only_when_a_chain_has_a_host() -> None:
    """chainrun.cli and a local chain's transport work leave paramiko (and invoke) unloaded."""
    proc = subprocess.run(
        [sys.executable, "-c", _LOCAL_WORK_THEN_A_HOST], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == {"import": [], "local work": [], "a host": ["paramiko", "invoke"]}


# -- SSH only -----------------------------------------------------------------


def _connect_error(alias: str) -> str:
    t = SSHTransport(alias)
    try:
        with pytest.raises(TransportError) as excinfo:
            t.run(["true"])
    finally:
        t.close()
    message = str(excinfo.value)
    assert "\n" not in message and message.startswith(f"ssh {alias}: ")
    return message


@pytest.mark.ssh
def test_ssh_commands_run_in_a_bash_login_shell(ssh: SSHTransport) -> None:
    """The profile is read (PATH as at login): `shopt` is a bash builtin, so it runs in that shell."""
    assert ssh.run(["shopt", "-q", "login_shell"]).returncode == 0


@pytest.mark.ssh
def test_unknown_host_key_is_refused_with_what_to_do(use_ssh_config: Path) -> None:
    """No known_hosts entry: refused, and the message says how to accept the key."""
    message = _connect_error("unknown-key")
    assert "host key of [127.0.0.1]:2222 is not known" in message
    assert f"run `ssh -F {use_ssh_config} unknown-key` once to accept it" in message
    assert "empty_known_hosts" in message


@pytest.mark.ssh
def test_changed_host_key_is_refused_as_changed(use_ssh_config: Path) -> None:
    """A known_hosts key that does not match the server's is reported as a changed key."""
    message = _connect_error("changed-key")
    assert "has CHANGED" in message and "ssh-keygen -R '[127.0.0.1]:2222'" in message


@pytest.mark.ssh
def test_host_known_only_by_its_ecdsa_key_is_accepted(use_ssh_config: Path) -> None:
    """As with OpenSSH, a host whose known_hosts entry is ECDSA only still connects."""
    t = SSHTransport("ecdsa-only")
    try:
        assert t.run(["whoami"]).stdout == "crtest\n"
    finally:
        t.close()


@pytest.mark.ssh
def test_connection_refused_is_one_line_naming_host_and_port(use_ssh_config: Path) -> None:
    message = _connect_error("refused")
    assert "connection refused by 127.0.0.1 port " in message


@pytest.mark.ssh
def test_authentication_failure_names_the_user(use_ssh_config: Path) -> None:
    message = _connect_error("bad-auth")
    assert "authentication failed for user crtest" in message


@pytest.mark.ssh
def test_missing_chainrun_ssh_config_is_a_clear_error(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("CHAINRUN_SSH_CONFIG", str(tmp_path / "absent"))
    with pytest.raises(TransportError, match=r"CHAINRUN_SSH_CONFIG=.*absent: no such file"):
        SSHTransport("crtest-local").read_file("x")


@pytest.mark.ssh
def test_proxyjump_reaches_the_host_through_the_jump_host(use_ssh_config: Path) -> None:
    t = SSHTransport("via-jump")
    try:
        assert t.run(["whoami"]).stdout == "crtest\n"
        assert t.read_file("/etc/hostname") is not None
    finally:
        t.close()


@pytest.mark.ssh
def test_ssh_config_include_is_followed(sshd: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Hosts defined in a file pulled in with ``Include`` are found (paramiko alone ignores Include)."""
    (tmp_path / "config").write_text(f"Include {CLIENT_DIR}/conf*\n")
    monkeypatch.setenv("CHAINRUN_SSH_CONFIG", str(tmp_path / "config"))
    t = SSHTransport("crtest-local")
    try:
        assert t.run(["whoami"]).stdout == "crtest\n"
    finally:
        t.close()


def _session_sshd(ssh: SSHTransport) -> int:
    """The pid of the sshd process serving this transport's connection (and only it)."""
    # sh's parent is the login bash, whose parent is the connection's sshd.
    pid = int(ssh.run(["sh", "-c", 'cut -d" " -f4 "/proc/$PPID/stat"']).stdout)
    assert Path(f"/proc/{pid}/comm").read_text().strip() == "sshd"
    return pid


@pytest.mark.ssh
@pytest.mark.parametrize("next_call", ["run", "read_file", "listdir", "write_file"])
def test_next_call_after_a_dropped_connection_reconnects(ssh: SSHTransport, next_call: str) -> None:
    """After the server side dies, the next call opens a new connection and works."""
    assert ssh.read_file("/etc/hostname") is not None  # SFTP channel open, to go stale too
    os.kill(_session_sshd(ssh), signal.SIGKILL)
    if next_call == "run":
        assert ssh.run(["echo", "back"]).stdout == "back\n"
    elif next_call == "read_file":
        assert ssh.read_file("/etc/hostname") is not None
    elif next_call == "listdir":
        assert ssh.listdir("/etc") is not None
    else:
        name = f"chainrun-reconnect-{uuid.uuid4().hex[:8]}"
        ssh.write_file(f"~/{name}", b"ok")
        ssh.remove(f"~/{name}")


@pytest.mark.ssh
def test_connection_dropped_during_a_command_raises_and_is_not_retried(ssh: SSHTransport) -> None:
    """A drop mid-command is a one-line TransportError saying it may have run; the next call works."""
    killer = threading.Timer(0.5, os.kill, args=(_session_sshd(ssh), signal.SIGKILL))
    killer.start()
    started = time.monotonic()
    try:
        with pytest.raises(TransportError) as excinfo:
            ssh.run(["sleep", "20"])
    finally:
        killer.cancel()
    assert time.monotonic() - started < 10
    message = str(excinfo.value)
    assert "connection lost while running sleep" in message and "may or may not have run" in message
    assert "\n" not in message
    assert ssh.run(["echo", "back"]).stdout == "back\n"


@pytest.mark.ssh
def test_concurrent_calls_on_one_transport_all_succeed(ssh: SSHTransport) -> None:
    """Threads may share a transport: calls are serialized, none is lost."""
    results: list[str] = []

    def work(i: int) -> None:
        results.append(ssh.run(["echo", str(i)]).stdout.strip())
        assert ssh.read_file("/etc/hostname") is not None

    threads = [threading.Thread(target=work, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(results) == [str(i) for i in range(6)]
