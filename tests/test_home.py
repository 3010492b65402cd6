"""The state home on a network file system (issue 35, item 8): which mount a path is on, read
from /proc/self/mountinfo, and the database and the service's lock refused there with one
line. There is no NFS server here: the refusals are shown through a mount table written
for the test (``chainrun.home.MOUNTINFO``), read by the same code as the real one, which is
checked against util-linux's ``findmnt`` on this machine."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from chainrun import home as state_home
from chainrun.errors import UsageError
from chainrun.home import Mount, mount_of
from chainrun.lock import InstanceLock
from chainrun.store import Store

# Lines as the kernel writes them: mount id, parent, device, root, mount point, options,
# optional fields (none, one or two), "-", type, source, super options.
TABLE = """\
22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw
30 22 0:40 / /home rw,relatime shared:9 - nfs4 srv:/export/home rw,vers=4.2
31 30 8:2 / /home/me/scratch rw shared:10 master:3 - xfs /dev/sdb1 rw
32 22 0:41 / /mnt/lab\\040share rw - cifs //nas/lab rw
33 22 0:42 / /mnt/box rw - fuse.sshfs me@box: rw
34 33 0:43 / /mnt/box rw - ext4 /dev/sdc1 rw
35 22 0:44 / /run/user/1000/containers rw - fuse.fuse-overlayfs fuse-overlayfs rw
36 22 0:45 / /lustre rw - lustre 10.0.0.1@o2ib:/fs rw,flock
"""


@pytest.fixture
def table(tmp_path: Path) -> Path:
    path = tmp_path / "mountinfo"
    path.write_text(TABLE)
    return path


@pytest.mark.parametrize(
    ("path", "mount", "network"),
    [
        ("/home/me/.local/state/chainrun", Mount("/home", "nfs4"), True),
        ("/home/me/scratch/chainrun", Mount("/home/me/scratch", "xfs"), False),  # a local disk under NFS
        ("/home", Mount("/home", "nfs4"), True),
        ("/homework/chainrun", Mount("/", "ext4"), False),  # a prefix, not a parent
        ("/mnt/lab share/state", Mount("/mnt/lab share", "cifs"), True),  # \040 in the table
        ("/mnt/box/state", Mount("/mnt/box", "ext4"), False),  # mounted over the sshfs: it hides it
        ("/run/user/1000/containers/home", Mount("/run/user/1000/containers", "fuse.fuse-overlayfs"), False),
        ("/lustre/me", Mount("/lustre", "lustre"), True),
    ],
)
def test_a_path_is_on_the_longest_mount_point_above_it(
    table: Path, path: str, mount: Mount, network: bool
) -> None:
    """The mount of a path is the deepest mount point above it (the last of equal ones), with
    mountinfo's octal escapes read back; its type says whether it is a network file system."""
    found = mount_of(Path(path), str(table))
    assert found == mount
    assert found is not None and found.network is network


def test_the_mount_of_a_path_is_what_findmnt_says_on_this_machine(tmp_path: Path) -> None:
    """On this machine's own /proc/self/mountinfo, the mount point and type of a few paths
    (a test directory, /, /proc, /dev/shm, a path not made yet) are findmnt's."""
    if shutil.which("findmnt") is None:
        pytest.skip("util-linux's findmnt is not installed")
    for path in (tmp_path, Path("/"), Path("/proc/self"), Path("/dev/shm")):
        shown = subprocess.run(
            ["findmnt", "-n", "-o", "TARGET,FSTYPE", "--target", str(path)],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.splitlines()[-1]  # mounts stacked at one point: the last is on top
        assert mount_of(path) == Mount(*shown.split()), path
    assert mount_of(tmp_path / "not" / "yet") == mount_of(tmp_path)
    assert mount_of(tmp_path, str(tmp_path / "no-such-table")) is None


def test_the_database_is_refused_on_a_network_file_system_with_one_line(
    table: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SQLite's WAL and the service's flock do not hold on NFS: a home there is refused for
    writing with one line that says where the database must go, and nothing is made there."""
    home = tmp_path / "home"
    monkeypatch.setattr(state_home, "MOUNTINFO", str(nfs_table(table, home)), raising=False)
    with pytest.raises(UsageError) as refused:
        Store(home).close()
    message = str(refused.value)
    assert "\n" not in message
    assert f"{home} is on a network file system (nfs4 at {home.parent})" in message
    assert "set CHAINRUN_HOME to a directory on this machine's own disk" in message
    assert not home.exists()


def test_the_service_lock_is_refused_on_a_network_file_system(
    table: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The single-service lock (an flock on the database) is refused there too, before it
    creates the database; a look (``held_elsewhere``, as ``status`` asks) is not."""
    home = tmp_path / "home"
    monkeypatch.setattr(state_home, "MOUNTINFO", str(nfs_table(table, home)), raising=False)
    with pytest.raises(UsageError, match="is on a network file system"):
        InstanceLock(home).acquire()
    assert not home.exists()
    assert InstanceLock(home).held_elsewhere() is False


def test_a_home_on_a_local_disk_is_used_as_before(tmp_path: Path) -> None:
    """On this machine's own file system (the real mount table) the store opens and the lock
    is taken."""
    home = tmp_path / "home"
    mount = mount_of(home)
    assert mount is not None and not mount.network, mount
    Store(home).close()
    lock = InstanceLock(home)
    lock.acquire()
    lock.release()


def nfs_table(table: Path, home: Path) -> Path:
    """The test's mount table with ``home``'s parent directory mounted over NFS."""
    with table.open("a") as f:
        f.write(f"40 22 0:50 / {home.parent} rw - nfs4 srv:/export rw\n")
    return table
