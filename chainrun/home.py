"""Where chainrun keeps its state (``CHAINRUN_HOME``), the one check that it is the user's
own, and which file system a path is on (``network_mount``: the store keeps its database
off network file systems): used by the store, the CLI and the local runner (which ships it
beside itself, so it imports the standard library alone and keeps to Python 3.8)."""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path
from typing import NamedTuple, Optional

MOUNTINFO = "/proc/self/mountinfo"  # the mounts this process sees (mount namespaces differ)

# Kernel file systems (their names in mountinfo; linux/magic.h has their statfs magic) on which
# SQLite's WAL (shared memory beside the database) and flock do not hold as on a local disk:
# NFS 0x6969, SMB/CIFS 0xFF534D42 and SMB2 0xFE534D42 (named cifs or smb3), old SMB 0x517B,
# Lustre 0x0BD00BD0, GPFS 0x47504653, BeeGFS 0x19830326, CephFS 0x00C36400, AFS 0x5346414F
# and 9p 0x01021997 (VM shares, WSL's drives). FUSE (0x65735546) is a driver, not a place:
# every FUSE file system but the two below, which keep a local disk's data, counts as one
# (sshfs, glusterfs, s3fs, rclone ...).
NETWORK_TYPES = frozenset(
    {"nfs", "nfs4", "cifs", "smb3", "smbfs", "lustre", "gpfs", "beegfs", "ceph", "afs", "9p"}
)
LOCAL_FUSE = frozenset({"fuseblk", "fuse.fuse-overlayfs"})  # a local block device; containers' root


class Mount(NamedTuple):
    """The mount a path is on: where it is mounted, and its file system type as mountinfo names it."""

    point: str
    kind: str

    @property
    def network(self) -> bool:
        fuse = self.kind == "fuse" or self.kind.startswith("fuse.")
        return self.kind in NETWORK_TYPES or (fuse and self.kind not in LOCAL_FUSE)


def _unescape(field: str) -> str:
    """A mountinfo path: the kernel writes space, tab, newline and backslash as octal (``\\040``)."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def mount_of(path: Path, mountinfo: Optional[str] = None) -> Optional[Mount]:
    """The mount ``path`` is on (symlinks resolved; a path not made yet is on its parent's):
    the one at the longest mount point above it, and of mounts stacked there the top one (no
    other's parent). None when the mount table cannot be read (not Linux)."""
    try:
        with open(mountinfo or MOUNTINFO, encoding="utf-8", errors="surrogateescape") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    target = os.path.realpath(path)
    above: dict[str, tuple[str, str, Mount]] = {}  # mount id: (parent id, its point's length, the mount)
    for line in lines:
        fields = line.split(" ")
        if "-" not in fields[6:]:
            continue
        point = _unescape(fields[4])
        if target == point or target.startswith(point.rstrip("/") + "/"):
            above[fields[0]] = (fields[1], point, Mount(point, fields[fields.index("-", 6) + 1]))
    if not above:
        return None
    deepest = max(len(point) for _, point, _ in above.values())
    stacked = {mid: m for mid, (_, point, m) in above.items() if len(point) == deepest}
    parents = {above[mid][0] for mid in stacked}
    return next((m for mid, m in stacked.items() if mid not in parents), next(iter(stacked.values())))


class HomeError(Exception):
    """The state directory cannot be used; ``str(err)`` says why and what to do."""


def default_home() -> Path:
    """``$CHAINRUN_HOME``, else ``$XDG_STATE_HOME/chainrun``, else ``~/.local/state/chainrun``."""
    home = os.environ.get("CHAINRUN_HOME")
    if home:
        return Path(home).expanduser()
    state = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(state) / "chainrun"


def short_path(path: Path) -> str:
    """A path for a one-line message: a very long one is cut in the middle."""
    text = str(path)
    return text if len(text) <= 200 else f"{text[:100]}...{text[-60:]}"


def private_dir(path: Path) -> Path:
    """Create ``path`` (mode 0700) if needed; state is private to the user.

    An existing directory others can enter, or one that belongs to another user,
    is refused, never chmod-ed: it may be a shared one (CHAINRUN_HOME=$HOME by
    mistake) that must stay as it is, or a neighbour's, whose state is not ours.
    """
    try:
        path.mkdir(mode=0o700, parents=True)
        return path
    except FileExistsError:
        pass
    except OSError as exc:
        raise HomeError(f"cannot create the state directory {short_path(path)}: {exc.strerror}") from None
    try:
        st = path.stat()
    except OSError as exc:
        raise HomeError(f"cannot use the state directory {short_path(path)}: {exc.strerror}") from None
    if not stat.S_ISDIR(st.st_mode):
        raise HomeError(f"{path} is not a directory; set CHAINRUN_HOME to a directory of your own")
    if st.st_uid != os.geteuid():
        raise HomeError(
            f"{path} belongs to another user (uid {st.st_uid}); chainrun keeps its state private: "
            "set CHAINRUN_HOME to a directory of your own"
        )
    if st.st_mode & 0o077:
        raise HomeError(
            f"{path} is open to other users; chainrun keeps its state private: "
            f"run `chmod 700 {path}` if it is chainrun's own, or set CHAINRUN_HOME to a new directory"
        )
    return path
