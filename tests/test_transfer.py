"""The checkpoint follows (issue 39): ``move_checkpoint`` copies a chain's newest committed
checkpoint between two places, verified, and never leaves a half-written file in use.

Real parts: checkpoints written by the PyTorch helper, this machine's file system, and the
test sshd (``scripts/start-sshd``) as the remote place, its SSH connection cut mid-copy."""

from __future__ import annotations

import inspect
import os
import posixpath
import signal
import socket
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from conftest import need, wait_for
from test_transport import _session_sshd, sshd_problem

from chainrun.checkpoint import SIDECAR_NAME, SegmentClock, _store, read_progress, write_progress
from chainrun.checkpoint._digest import StreamDigest
from chainrun.checkpoint._fence import FENCE_NAME
from chainrun.checkpoint.torch import Checkpointer
from chainrun.errors import TransportError
from chainrun.progress import _newest_checkpoint
from chainrun.testing import FakeCluster, FakeTransport
from chainrun.transfer import MOVE_SUFFIX, TransferError, move_checkpoint
from chainrun.transport import FileRefused, LocalTransport, SSHTransport, Transport

SSH_CONFIG = "/var/lib/chainrun-test/ssh/config"
LOCAL = LocalTransport()


@pytest.fixture(autouse=True)
def _no_chain_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("CHAINRUN_CHECKPOINT_DIR", "CHAINRUN_SEGMENT", "CHAINRUN_FENCE"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def ssh(monkeypatch: pytest.MonkeyPatch) -> Iterator[SSHTransport]:
    problem = sshd_problem()
    need(f"the test sshd ({problem})", problem is None, "scripts/start-sshd (as root)")
    monkeypatch.setenv("CHAINRUN_SSH_CONFIG", SSH_CONFIG)
    t = SSHTransport("crtest-local")
    yield t
    t.close()


@pytest.fixture
def remote_dir(ssh: SSHTransport) -> Iterator[str]:
    """An absolute directory on the SSH side that does not exist yet."""
    home = ssh.run(["sh", "-c", 'printf %s "$HOME"']).stdout
    path = f"{home}/chainrun-transfer-test-{uuid.uuid4().hex[:8]}"
    yield path
    SSHTransport("crtest-local").run(["rm", "-rf", path])


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Linear(256, 64))


def helper_save(directory: Path, net: torch.nn.Module, epoch: int) -> Checkpointer:
    """A checkpoint written by the PyTorch helper after one more step of training."""
    optimizer = torch.optim.Adam(net.parameters(), lr=0.01)
    net(torch.randn(4, net[0].in_features)).square().sum().backward()
    optimizer.step()
    ckpt = Checkpointer(directory, model=net, optimizer=optimizer, clock=SegmentClock(install=False))
    ckpt.save(epoch, 0)
    ckpt.wait()
    return ckpt


def names(transport: Transport, directory: str) -> set[str]:
    return {f.name for f in transport.listdir(directory) or []}


def sha_there(transport: Transport, path: str, chunk: int) -> str:
    digest = StreamDigest(chunk)
    data = transport.read_file(path)
    assert data is not None, path
    digest.update(data)
    return digest.digest().sha256


def assert_committed(transport: Transport, directory: str) -> dict[str, object]:
    """The sidecar at ``directory`` names a file that is there and matches its digest."""
    data = transport.read_file(posixpath.join(directory, SIDECAR_NAME))
    assert data is not None
    progress = read_progress(data)
    path = posixpath.join(directory, str(progress["file"]))
    assert sha_there(transport, path, int(progress["sha256_chunk"])) == progress["sha256"]
    return progress


def test_local_to_local_moves_the_newest_helper_checkpoint_alone_verified_by_its_chunk_tree(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Of two retained checkpoints only the one the sidecar names moves, then the sidecar and
    the fence; the tree digest (chunks forced small) is checked, and the helper resumes there."""
    monkeypatch.setattr(_store, "CHUNK", 4096)
    src, dst = tmp_path / "src", tmp_path / "dst"
    net = model()
    helper_save(src, net, 1)
    helper_save(src, net, 2)
    (src / FENCE_NAME).write_text("chain-a 2 0 123\n")
    progress = read_progress((src / SIDECAR_NAME).read_bytes())
    assert progress["sha256_chunk"] == 4096 and progress["size"] > 3 * 4096
    assert len([n for n in os.listdir(src) if n.endswith(".pt")]) == 2

    moved = move_checkpoint(LOCAL, str(src), LOCAL, str(dst), piece=1000)

    assert [f.name for f in moved.files] == [progress["file"], SIDECAR_NAME, FENCE_NAME]
    assert moved.digest == progress["sha256"] and moved.files[0].chunk == 4096
    assert moved.bytes == sum(os.path.getsize(src / f.name) for f in moved.files)
    assert names(LOCAL, str(dst)) == {progress["file"], SIDECAR_NAME, FENCE_NAME}
    for f in moved.files:
        assert (dst / f.name).read_bytes() == (src / f.name).read_bytes()
    resumed = model()
    with torch.no_grad():
        for p in resumed.parameters():
            p.zero_()
    opt = torch.optim.Adam(resumed.parameters(), lr=0.01)
    start = Checkpointer(dst, model=resumed, optimizer=opt, clock=SegmentClock(install=False)).restore()
    assert (start.epoch, start.file) == (2, progress["file"])
    for a, b in zip(net.state_dict().values(), resumed.state_dict().values()):
        assert torch.equal(a, b)


def test_a_whole_file_checkpoint_goes_to_ssh_and_back_byte_equal(
    tmp_path: Path, ssh: SSHTransport, remote_dir: str
) -> None:
    """local -> SSH -> local with a whole-file sha256 (a script's own file, committed with
    ``write_progress``): hashed on each host where it was written, equal at the end."""
    src, back = tmp_path / "src", tmp_path / "back"
    src.mkdir()
    (src / "model-e3.bin").write_bytes(os.urandom(3 * 1024 * 1024 + 17))
    write_progress(src, epoch=3, step=0, file="model-e3.bin")
    assert read_progress((src / SIDECAR_NAME).read_bytes())["sha256_chunk"] == 0

    there = move_checkpoint(LOCAL, str(src), ssh, remote_dir)
    assert names(ssh, remote_dir) == {"model-e3.bin", SIDECAR_NAME}
    assert_committed(ssh, remote_dir)
    home = move_checkpoint(ssh, remote_dir, LOCAL, str(back))

    assert there.digest == home.digest
    assert sorted(os.listdir(back)) == ["chainrun-progress.json", "model-e3.bin"]
    for name in os.listdir(back):
        assert (back / name).read_bytes() == (src / name).read_bytes()


def test_a_helper_checkpoint_goes_to_ssh_and_back_and_resumes(
    tmp_path: Path, ssh: SSHTransport, remote_dir: str
) -> None:
    src, back = tmp_path / "src", tmp_path / "back"
    net = model()
    helper_save(src, net, 1)
    move_checkpoint(LOCAL, str(src), ssh, remote_dir)
    assert assert_committed(ssh, remote_dir)["sha256_chunk"] == _store.CHUNK
    move_checkpoint(ssh, remote_dir, LOCAL, str(back))
    resumed = model()
    opt = torch.optim.Adam(resumed.parameters(), lr=0.01)
    start = Checkpointer(back, model=resumed, optimizer=opt, clock=SegmentClock(install=False)).restore()
    assert start.epoch == 1
    for a, b in zip(net.state_dict().values(), resumed.state_dict().values()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("way", ["local", "to-ssh", "from-ssh"])
def test_without_a_sidecar_the_scripts_files_move_with_their_mtimes(
    way: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """A script's own files (not temp or hidden ones, not subdirectories), each hashed at
    the source; mtimes kept, so progress by the newest file's mtime reads the same there."""
    src_t: Transport = LOCAL
    dst_t: Transport = LOCAL
    src, dst = str(tmp_path / "src"), str(tmp_path / "dst")
    if way != "local":
        ssh = request.getfixturevalue("ssh")
        remote = request.getfixturevalue("remote_dir")
        if way == "to-ssh":
            dst_t, dst = ssh, remote
        else:
            src_t, src = ssh, remote
    src_t.makedirs(src)
    src_t.makedirs(posixpath.join(src, "subdir"))
    files = {"weights-1.pt": os.urandom(70000), "weights-2.pt": os.urandom(150000), "notes.txt": b"hi\n"}
    files |= {"weights-3.pt.tmp": b"half", ".hidden": b"x"}
    for name, data in files.items():
        src_t.write_file(posixpath.join(src, name), data)
    mtimes = {"notes.txt": 1_700_000_000, "weights-1.pt": 1_700_000_100, "weights-2.pt": 1_700_000_200}
    for name, mtime in mtimes.items():  # through the transport's own writer, which sets mtimes
        path = posixpath.join(src, name)
        writer = src_t.open_new(path + ".new")
        writer.write(files[name])
        writer.commit(mtime)
        src_t.rename(path + ".new", path, replace=True)

    moved = move_checkpoint(src_t, src, dst_t, dst, piece=4096)

    assert [f.name for f in moved.files] == ["notes.txt", "weights-1.pt", "weights-2.pt"]  # oldest first
    assert moved.digest is None
    listed = {f.name: f for f in dst_t.listdir(dst) or []}
    assert set(listed) == set(mtimes)
    for name, mtime in mtimes.items():
        assert listed[name].mtime == mtime
        assert dst_t.read_file(posixpath.join(dst, name)) == files[name]
    assert _newest_checkpoint(dst_t.listdir(dst) or []) == _newest_checkpoint(src_t.listdir(src) or [])


def test_a_corrupt_source_is_refused_and_the_destination_keeps_its_checkpoint(tmp_path: Path) -> None:
    """One flipped byte: TransferError that blames the source (checked as the bytes pass, so
    it is told apart from a fault where they are written), nothing put in place, no temp file
    left, and the destination's previous checkpoint and sidecar as they were."""
    src, dst = tmp_path / "src", tmp_path / "dst"
    net = model()
    helper_save(src, net, 1)
    move_checkpoint(LOCAL, str(src), LOCAL, str(dst))
    before = {name: (dst / name).read_bytes() for name in os.listdir(dst)}
    helper_save(src, net, 2)
    newest = read_progress((src / SIDECAR_NAME).read_bytes())["file"]
    data = bytearray((src / newest).read_bytes())
    data[len(data) // 2] ^= 0x01
    (src / newest).write_bytes(bytes(data))

    with pytest.raises(TransferError) as raised:
        move_checkpoint(LOCAL, str(src), LOCAL, str(dst))

    message = str(raised.value)
    assert "\n" not in message and str(src) in message
    assert f"{newest} at the source does not match its recorded sha256: it is corrupt" in message
    assert {name: (dst / name).read_bytes() for name in os.listdir(dst)} == before
    assert_committed(LOCAL, str(dst))


def gone(pid: int) -> bool:
    """The process has ended (a zombie's sockets are closed already)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1].startswith(("Z", "X"))
    except OSError:
        return True


@pytest.mark.parametrize("side", ["destination", "source"])
@pytest.mark.parametrize("how", ["socket shut down", "sshd killed"])
def test_c_a_copy_cut_mid_transfer_is_never_used_and_a_new_connection_moves_it(
    how: str, side: str, tmp_path: Path, ssh: SSHTransport, remote_dir: str
) -> None:
    """Issue 39 (c): the SSH connection is cut after 1 MiB of a checkpoint's bytes, its socket
    shut down here or, for real, the sshd process serving it killed (SIGKILL). The streams do
    not retry: the move fails in one line, and its cleanup removes its temp file (over a new
    connection where the SSH side is the destination: the transport reconnects for a file
    operation that finds its link dead). The destination's previous checkpoint stands, every
    file as it was, its sidecar verified; nothing is left beside it. The next move, on a new
    connection, completes and verifies."""
    src_t: Transport = LOCAL if side == "destination" else ssh
    dst_t: Transport = ssh if side == "destination" else LOCAL
    local = tmp_path / "local"
    src, dst = (str(local), remote_dir) if side == "destination" else (remote_dir, str(local))
    staging = tmp_path / "staging"
    net = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.Linear(1024, 512))  # 4 MiB, x3 with Adam
    helper_save(staging, net, 1)
    move_checkpoint(LOCAL, str(staging), src_t, src)
    move_checkpoint(src_t, src, dst_t, dst)  # the destination's previous checkpoint
    old = {name: dst_t.read_file(posixpath.join(dst, name)) for name in names(dst_t, dst)}
    helper_save(staging, net, 2)
    move_checkpoint(LOCAL, str(staging), src_t, src)
    newest = read_progress((staging / SIDECAR_NAME).read_bytes())
    assert newest["size"] > 4 * 1024 * 1024
    server = _session_sshd(ssh)
    cut_at: list[int] = []

    def cut(copied: int) -> None:
        if copied < 1024 * 1024 or cut_at:
            return
        cut_at.append(copied)
        if how == "sshd killed":
            os.kill(server, signal.SIGKILL)
            wait_for(lambda: gone(server), 30, f"sshd {server} to end")
        else:
            assert ssh._conn is not None
            transport = ssh._conn.client.get_transport()
            assert transport is not None
            transport.sock.shutdown(socket.SHUT_RDWR)  # type: ignore[union-attr]

    with pytest.raises(TransferError) as raised:
        move_checkpoint(src_t, src, dst_t, dst, on_piece=cut)

    message = str(raised.value)
    assert "\n" not in message and "cannot move the checkpoint" in message and "crtest-local" in message
    assert cut_at and cut_at[0] < newest["size"], cut_at  # cut mid-file
    assert _session_sshd(ssh) != server  # the transport is on a new connection
    assert names(dst_t, dst) == set(old)  # no temp file left, nothing new under a real name
    for name, data in old.items():
        assert dst_t.read_file(posixpath.join(dst, name)) == data
    assert_committed(dst_t, dst)

    moved = move_checkpoint(src_t, src, dst_t, dst)

    assert moved.digest == newest["sha256"]
    assert not {n for n in names(dst_t, dst) if n.endswith(MOVE_SUFFIX)}
    assert assert_committed(dst_t, dst)["file"] == newest["file"]


def test_a_file_damaged_where_it_was_written_is_never_put_in_place(tmp_path: Path) -> None:
    """The bytes arrive intact but the destination's copy changes before it is put in place
    (a disk or file system fault, made here by flipping its first byte mid-copy): the hash
    taken there catches it, and the destination keeps its previous checkpoint."""
    src, dst = tmp_path / "src", tmp_path / "dst"
    net = model()
    helper_save(src, net, 1)
    move_checkpoint(LOCAL, str(src), LOCAL, str(dst))
    before = {name: (dst / name).read_bytes() for name in os.listdir(dst)}
    helper_save(src, net, 2)

    def damage(copied: int) -> None:
        if copied >= 2 * 4096:
            (temp,) = [name for name in os.listdir(dst) if name.endswith(MOVE_SUFFIX)]
            fd = os.open(dst / temp, os.O_RDWR)
            try:
                os.pwrite(fd, bytes([os.pread(fd, 1, 0)[0] ^ 0xFF]), 0)
            finally:
                os.close(fd)

    with pytest.raises(TransferError, match="as written at the destination does not match"):
        move_checkpoint(LOCAL, str(src), LOCAL, str(dst), piece=4096, on_piece=damage)

    assert {name: (dst / name).read_bytes() for name in os.listdir(dst)} == before


def test_a_hugging_face_checkpoint_directory_moves_with_every_file_its_manifest_lists(
    tmp_path: Path, ssh: SSHTransport, remote_dir: str
) -> None:
    """The Hugging Face helper commits a ``checkpoint-N`` directory through a manifest (here
    its own commit, on files standing in for the Trainer's): every file listed, in its
    subdirectory, then the manifest, then the sidecar; to SSH and back, byte-equal."""
    transformers = pytest.importorskip("transformers")
    from chainrun.checkpoint import hf

    out, back = tmp_path / "out", tmp_path / "back"
    files = {"model.safetensors": os.urandom(200000), "optimizer.pt": os.urandom(90000), "sub/rng.pth": b"r"}
    for name, data in files.items():
        (out / "checkpoint-7" / name).parent.mkdir(parents=True, exist_ok=True)
        (out / "checkpoint-7" / name).write_bytes(data)
    args = transformers.TrainingArguments(output_dir=str(out), report_to=[])
    state = transformers.TrainerState(global_step=7, epoch=1.0, max_steps=14, num_train_epochs=2)
    saved = hf._commit(args, state, keep=2)

    move_checkpoint(LOCAL, str(out), ssh, remote_dir)
    moved = move_checkpoint(ssh, remote_dir, LOCAL, str(back))

    listed = [f.name for f in moved.files]
    assert sorted(listed[:3]) == sorted(f"checkpoint-7/{name}" for name in files)
    assert listed[3:] == [saved.file, SIDECAR_NAME]
    for name, data in files.items():
        assert (back / "checkpoint-7" / name).read_bytes() == data
    assert hf.newest_checkpoint(str(back)) == str(back / "checkpoint-7")


@pytest.mark.parametrize("kind", ["local", "ssh", "fake"])
def test_the_streams_refuse_what_is_there_and_rename_replaces_only_when_asked(
    kind: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """``open_new`` never writes over a file, ``open_read`` opens regular files only (a FIFO
    would block), and ``rename`` replaces a file only with ``replace=True``; the engine tests'
    ``FakeTransport`` alike (it has no FIFO)."""
    t: Transport = LOCAL
    d = str(tmp_path)
    if kind == "ssh":
        t, d = request.getfixturevalue("ssh"), request.getfixturevalue("remote_dir")
        t.makedirs(d)
    elif kind == "fake":
        t, d = FakeCluster().transport(), "/fake/ckpt"
    a, b = posixpath.join(d, "a"), posixpath.join(d, "b")
    writer = t.open_new(a)
    writer.write(b"new bytes")
    writer.commit(1_600_000_000)
    assert t.read_file(a) == b"new bytes"
    with pytest.raises(TransportError, match="cannot create"):
        t.open_new(a)
    t.write_file(b, b"old")
    with pytest.raises(TransportError, match="cannot rename"):
        t.rename(a, b)
    t.rename(a, b, replace=True)
    assert (t.read_file(b), t.stat(a)) == (b"new bytes", None)
    reader = t.open_read(b)
    assert reader.read(3) + reader.read(100) + reader.read(100) == b"new bytes"
    reader.close()
    if kind == "fake":
        return
    assert t.run(["mkfifo", posixpath.join(d, "fifo")]).ok
    with pytest.raises(FileRefused, match="a FIFO"):
        t.open_read(posixpath.join(d, "fifo"))


def test_the_fake_transport_has_every_method_of_a_transport_and_a_checkpoint_moves_from_it(
    tmp_path: Path,
) -> None:
    """``chainrun.testing.FakeTransport`` stands in for a transport in the engine's tests: each
    method of the ``Transport`` protocol, with the same parameters; a checkpoint held in its
    files moves out of it by its streams, verified."""
    for name, member in vars(Transport).items():
        if callable(member) and not name.startswith("_"):
            fake = getattr(FakeTransport, name, None)
            assert fake is not None, f"FakeTransport has no {name}"
            assert list(inspect.signature(fake).parameters) == list(inspect.signature(member).parameters), (
                name
            )
    helper_save(tmp_path / "src", model(), 1)
    cluster = FakeCluster()
    for path in (tmp_path / "src").iterdir():
        cluster.files[f"/fake/ckpt/{path.name}"] = path.read_bytes()
    moved = move_checkpoint(cluster.transport(), "/fake/ckpt", LOCAL, str(tmp_path / "dst"))
    assert assert_committed(LOCAL, str(tmp_path / "dst"))["sha256"] == moved.digest


KILLED_MOVER = """
import os, signal, sys
from chainrun.transfer import move_checkpoint
from chainrun.transport import transport_for

def die(copied):
    if copied >= 1024 * 1024:
        os.kill(os.getpid(), signal.SIGKILL)

move_checkpoint(transport_for(""), sys.argv[1], transport_for(sys.argv[2]), sys.argv[3], on_piece=die)
"""


def test_a_mover_killed_mid_copy_leaves_nothing_in_use_and_the_next_move_cleans_up(
    tmp_path: Path, ssh: SSHTransport, remote_dir: str
) -> None:
    """The process doing the move is killed (SIGKILL) after 1 MiB: no cleanup runs, yet the
    destination shows no partial file under a real name and its old sidecar stands; the next
    move removes the temp file left behind and succeeds."""
    src = tmp_path / "src"
    net = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.Linear(1024, 512))
    helper_save(src, net, 1)
    move_checkpoint(LOCAL, str(src), ssh, remote_dir)
    old = {name: ssh.read_file(posixpath.join(remote_dir, name)) for name in names(ssh, remote_dir)}
    helper_save(src, net, 2)
    env = dict(os.environ, CHAINRUN_SSH_CONFIG=SSH_CONFIG, PYTHONPATH=str(Path(__file__).parent.parent))
    killed = subprocess.run(
        [sys.executable, "-c", KILLED_MOVER, str(src), "crtest-local", remote_dir], env=env, timeout=120
    )
    assert killed.returncode == -signal.SIGKILL

    now = names(ssh, remote_dir)
    left = {n for n in now if n.endswith(MOVE_SUFFIX)}
    assert len(left) == 1 and now - left == set(old)
    for name, data in old.items():
        assert ssh.read_file(posixpath.join(remote_dir, name)) == data
    assert_committed(ssh, remote_dir)

    moved = move_checkpoint(LOCAL, str(src), ssh, remote_dir)

    assert not {n for n in names(ssh, remote_dir) if n.endswith(MOVE_SUFFIX)}
    assert assert_committed(ssh, remote_dir)["sha256"] == moved.digest


@pytest.mark.parametrize(
    ("setup", "says"),
    [
        ("missing", "the directory is missing"),
        ("empty", "it holds no checkpoint"),
        ("bad sidecar", "progress sidecar chainrun-progress.json is not valid JSON"),
        ("file gone", "cannot read"),
        ("truncated", "has 5 bytes where 6 were recorded"),
    ],
)
def test_what_cannot_be_moved_is_said_in_one_line_and_nothing_lands(
    setup: str, says: str, tmp_path: Path
) -> None:
    src, dst = tmp_path / "src", tmp_path / "dst"
    if setup != "missing":
        src.mkdir()
    if setup in ("file gone", "truncated"):
        (src / "model.bin").write_bytes(b"weight")
        write_progress(src, epoch=1, step=0, file="model.bin")
        if setup == "file gone":
            (src / "model.bin").unlink()
        else:
            (src / "model.bin").write_bytes(b"weigh")
    if setup == "bad sidecar":
        (src / SIDECAR_NAME).write_text("{not json\n")

    with pytest.raises(TransferError) as raised:
        move_checkpoint(LOCAL, str(src), LOCAL, str(dst))

    message = str(raised.value)
    assert "\n" not in message and message.startswith(f"cannot move the checkpoint from localhost:{src}")
    assert says in message
    assert os.listdir(dst) == []


def test_between_two_directories_of_one_ssh_host_the_one_connection_serves_both_ends(
    tmp_path: Path, ssh: SSHTransport, remote_dir: str
) -> None:
    """Source and destination on the same SSHTransport: the streams use its SFTP session
    outside its lock, so reading one file while writing another does not wait on itself."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "w.bin").write_bytes(os.urandom(3 * 1024 * 1024))
    write_progress(src, epoch=2, step=5, file="w.bin")
    move_checkpoint(LOCAL, str(src), ssh, f"{remote_dir}/a")

    moved = move_checkpoint(ssh, f"{remote_dir}/a", ssh, f"{remote_dir}/b", piece=65536)

    assert [f.name for f in moved.files] == ["w.bin", SIDECAR_NAME]
    assert ssh.read_file(f"{remote_dir}/b/w.bin") == (src / "w.bin").read_bytes()
    assert_committed(ssh, f"{remote_dir}/b")
