"""A real sshd of a test's own, to stop and start again: a network drop without disturbing others.

It uses the host keys and the authorized client key that ``scripts/start-sshd``
set up, on a port of its own, with a client config naming it ``root-private``.
``stop`` kills the listener and every process under it (the per-connection
sshds and their sessions), so every connection to it drops, as when a login
node goes away; the shared test sshd and the tests using it are untouched.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
from pathlib import Path

from conftest import need, wait_for

CLIENT_DIR = Path("/var/lib/chainrun-test/ssh")
HOST_KEYS = ("/etc/ssh/ssh_host_ed25519_key", "/etc/ssh/ssh_host_ecdsa_key", "/etc/ssh/ssh_host_rsa_key")
ALIAS = "root-private"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _children(pid: int) -> list[int]:
    """Every process under ``pid``, found through /proc."""
    parents: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            parents.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in parents.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


class PrivateSSHD:
    """One sshd on 127.0.0.1:``port``; ``config`` is the client config to point CHAINRUN_SSH_CONFIG at."""

    def __init__(
        self, directory: Path, alias: str = ALIAS, server: str = "", launcher: tuple[str, ...] = ()
    ) -> None:
        """``alias``: the client config's name for it; ``server``: lines added to its sshd_config
        (``SetEnv CHAINRUN_HOME=...`` gives its sessions a state directory of their own);
        ``launcher``: a command that runs sshd (``scripts/lab-machine NAME DIR``: as a machine
        of its own)."""
        need(
            "the test sshd's keys",
            os.geteuid() == 0 and (CLIENT_DIR / "id_ed25519").is_file() and os.path.exists("/usr/sbin/sshd"),
            "sudo scripts/start-sshd",
        )
        self.dir = directory
        self.alias = alias
        self.launcher = launcher
        self.port = _free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        keys = [k for k in HOST_KEYS if os.path.exists(k)]
        (directory / "sshd_config").write_text(
            f"Port {self.port}\nListenAddress 127.0.0.1\n"
            + "".join(f"HostKey {k}\n" for k in keys)
            + f"PidFile {directory}/sshd.pid\n"
            "PermitRootLogin prohibit-password\nPubkeyAuthentication yes\n"
            "PasswordAuthentication no\nKbdInteractiveAuthentication no\n"
            "AuthorizedKeysFile .ssh/authorized_keys\nUsePAM yes\nAllowTcpForwarding yes\n"
            "MaxStartups 50:30:100\nMaxSessions 50\nSubsystem sftp /usr/lib/openssh/sftp-server\n" + server
        )
        known = [
            f"[127.0.0.1]:{self.port} {' '.join(Path(k + '.pub').read_text().split()[:2])}" for k in keys
        ]
        (directory / "known_hosts").write_text("\n".join(known) + "\n")
        self.config = directory / "ssh_config"
        self.config.write_text(
            f"Host {alias}\n    HostName 127.0.0.1\n    Port {self.port}\n    User root\n"
            f"    IdentityFile {CLIENT_DIR}/id_ed25519\n    IdentitiesOnly yes\n"
            f"    UserKnownHostsFile {directory}/known_hosts\n    StrictHostKeyChecking yes\n"
            "    BatchMode yes\n    ServerAliveInterval 5\n"
        )
        self.config.chmod(0o600)

    def answers(self) -> bool:
        result = subprocess.run(
            ["ssh", "-F", str(self.config), "-o", "ConnectTimeout=5", self.alias, "true"],
            capture_output=True,
            timeout=30,
        )
        return result.returncode == 0

    def start(self) -> None:
        with open(self.dir / "sshd.log", "ab") as log:
            self.proc = subprocess.Popen(
                [*self.launcher, "/usr/sbin/sshd", "-D", "-e", "-f", str(self.dir / "sshd_config")],
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        wait_for(self.answers, 60, f"the private sshd on port {self.port} to answer")

    def cut_off(self) -> None:
        """The machine's network cut, the machine itself on: its sshd listener stopped
        (SIGSTOP: a new connection gets no answer) and its open sessions dropped, while
        everything else it runs goes on."""
        assert self.proc is not None
        (listener,) = [p for p in self._sshds() if b"[listener]" in Path(f"/proc/{p}/cmdline").read_bytes()]
        os.kill(listener, signal.SIGSTOP)  # first: it starts no session from now on
        for pid in set(self._sshds()) - {listener}:  # "sshd: USER@notty", each an open session
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def reconnect(self) -> None:
        """The network back: its sshd listener answers again."""
        for pid in self._sshds():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)

    def _sshds(self) -> list[int]:
        assert self.proc is not None
        found = []
        for pid in _children(self.proc.pid):
            with contextlib.suppress(OSError):
                if Path(f"/proc/{pid}/comm").read_text().startswith("sshd"):
                    found.append(pid)
        return found

    def stop(self) -> None:
        """Stop the listener and drop every connection: all processes under it are killed."""
        if self.proc is None:
            return
        for pid in [*_children(self.proc.pid), self.proc.pid]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.proc.wait(timeout=30)
        self.proc = None
