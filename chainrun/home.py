"""Where chainrun keeps its state (``CHAINRUN_HOME``), and the one check that it is the
user's own: used by the store, the CLI and the local runner (which ships it beside itself,
so it imports the standard library alone and keeps to Python 3.8)."""

from __future__ import annotations

import os
import stat
from pathlib import Path


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
