"""What the user's OpenSSH config says about a host, and what a failed connection means.

paramiko's ``SSHConfig`` parses the files; this module adds what it lacks
(``Include``, the system file after the user's, ProxyJump hops as
``[user@]host[:port]``) and resolves an alias into an ``Endpoint``: where to
connect, as whom, with which keys, against which known_hosts files and host
key types. ``connect_message`` is the table that turns a failed connection
into one line a user can act on; ``canonical_host`` names the machine an alias
reaches. Only ``ssh.py`` and ``chainrun.transport.canonical_host`` import this
module, so paramiko is loaded only when a chain has a host.
"""

from __future__ import annotations

import getpass
import glob
import os
import re
import shlex
import socket
from dataclasses import dataclass

import paramiko

from chainrun.errors import TransportError
from chainrun.transport.base import oneline

CONNECT_TIMEOUT = 15.0  # seconds, where the config gives no ConnectTimeout
_KEEPALIVE_S = 30  # where the config gives no ServerAliveInterval


@dataclass
class Endpoint:
    """One SSH hop, resolved from the ssh config."""

    alias: str
    hostname: str
    port: int
    user: str
    key_files: list[str]
    identities_only: bool
    known_hosts: list[str]  # global files, then the user's
    user_known_hosts: str  # where ssh would record a newly accepted key
    strict_host_keys: bool
    proxy_command: str | None
    proxy_jump: list[str]
    keepalive: int
    connect_timeout: float

    @property
    def where(self) -> str:
        return f"{self.hostname} port {self.port}"

    @property
    def known_hosts_name(self) -> str:
        return self.hostname if self.port == 22 else f"[{self.hostname}]:{self.port}"


def load_config() -> tuple[paramiko.SSHConfig, str]:
    """The user's ssh config (or ``$CHAINRUN_SSH_CONFIG``, like ``ssh -F``) and its path.

    As ssh does, the system's /etc/ssh/ssh_config follows the user's file
    (first value wins) unless a file is named explicitly.
    """
    override = os.environ.get("CHAINRUN_SSH_CONFIG")
    path = override or os.path.expanduser("~/.ssh/config")
    if override and not os.path.isfile(override):
        raise TransportError(
            f"CHAINRUN_SSH_CONFIG={override}: no such file; point it at an ssh config or unset it"
        )
    files = [path] if override else [path, "/etc/ssh/ssh_config"]
    try:
        # "Host *" first: a file's leading global lines must not join the
        # previous file's last Host block.
        text = "".join(
            "Host *\n" + _config_text(f, "/etc/ssh" if f.startswith("/etc/ssh/") else "~/.ssh")
            for f in files
            if os.path.isfile(f)
        )
        return paramiko.SSHConfig.from_text(text), path
    except (OSError, paramiko.ssh_exception.ConfigParseError) as e:
        raise TransportError(
            f"cannot read ssh config {path}: {oneline(e)}; fix it so `ssh` accepts it"
        ) from None


_INCLUDE = re.compile(r"\s*include(?:\s*=\s*|\s+)(.+)", re.IGNORECASE)


def _config_text(path: str, base: str, depth: int = 0) -> str:
    """The file with its ``Include`` lines replaced by the files they name (paramiko lacks Include).

    Relative names are looked up in ``base`` (~/.ssh, or /etc/ssh for the
    system file). An Include inside a Host block is inlined there too, which
    matches ssh as long as the included files start with their own Host lines.
    """
    lines = []
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            match = _INCLUDE.match(line)
            if match is None or depth >= 16:
                lines.append(line if line.endswith("\n") else line + "\n")
                continue
            for pattern in shlex.split(match.group(1)):
                pattern = os.path.join(os.path.expanduser(base), os.path.expanduser(pattern))
                for included in sorted(glob.glob(pattern)):
                    if os.path.isfile(included):
                        lines.append(_config_text(included, base, depth + 1))
    return "".join(lines)


def _hops(proxy_jump: str | None) -> list[str]:
    if not proxy_jump or proxy_jump.lower() == "none":
        return []
    return [hop.strip() for hop in proxy_jump.split(",") if hop.strip()]


def resolve(config: paramiko.SSHConfig, spec: str, config_path: str) -> Endpoint:
    """An alias or ProxyJump hop (``[user@]host[:port]``) resolved through the config."""
    user = port = None
    alias = spec
    if "@" in alias:
        user, alias = alias.rsplit("@", 1)
    if alias.startswith("[") and "]:" in alias:
        alias, port = alias[1:].split("]:", 1)
    elif alias.count(":") == 1:
        alias, port = alias.split(":", 1)
    try:
        opts = config.lookup(alias)
        port_number = int(port or opts.get("port", 22))
        keepalive = int(opts.get("serveraliveinterval") or _KEEPALIVE_S)
        connect_timeout = float(opts.get("connecttimeout") or CONNECT_TIMEOUT)
    except (ValueError, paramiko.SSHException) as e:
        raise TransportError(f"ssh {spec}: bad setting in {config_path}: {oneline(e)}") from None
    user_known = opts.get("userknownhostsfile") or "~/.ssh/known_hosts ~/.ssh/known_hosts2"
    global_known = opts.get("globalknownhostsfile") or "/etc/ssh/ssh_known_hosts /etc/ssh/ssh_known_hosts2"
    proxy_command = opts.get("proxycommand")  # paramiko turns "none" into None
    return Endpoint(
        alias=spec,
        hostname=opts["hostname"],
        port=port_number,
        user=user or opts.get("user") or getpass.getuser(),
        key_files=[os.path.expanduser(k) for k in opts.get("identityfile", [])],
        identities_only=(opts.get("identitiesonly") or "no").lower() == "yes",
        known_hosts=[os.path.expanduser(p) for p in f"{global_known} {user_known}".split()],
        user_known_hosts=user_known.split()[0],
        strict_host_keys=(opts.get("stricthostkeychecking") or "yes").lower() != "no",
        proxy_command=proxy_command if proxy_command and proxy_command.lower() != "none" else None,
        proxy_jump=_hops(opts.get("proxyjump")),
        keepalive=keepalive,
        connect_timeout=connect_timeout,
    )


def canonical_host(alias: str) -> str:
    """The machine ``alias`` reaches, as ``ssh -G`` names it: its HostName and port
    (``node1:22``, lower case as ssh makes it), whichever alias of the config reaches it.
    Reads the config, connects to nothing; TransportError when the config cannot be read."""
    config, config_path = load_config()
    target = resolve(config, alias, config_path)
    return f"{target.hostname.lower()}:{target.port}"


class UnknownHostKey(Exception):
    """The host offered a key that no known_hosts file holds; ``key`` is what it offered."""

    def __init__(self, key: paramiko.PKey) -> None:
        super().__init__("host key not known")
        self.key = key


def host_key_types(ep: Endpoint) -> set[str]:
    """Key types known for the host: only those are offered, as OpenSSH prefers.

    Without this paramiko may pick ed25519 when known_hosts holds only the
    host's ECDSA key, and refuse a host that ssh accepts.
    """
    keys = paramiko.HostKeys()
    for path in ep.known_hosts:
        if os.path.isfile(path):
            try:
                keys.load(path)
            except OSError:
                continue
    found = keys.lookup(ep.known_hosts_name) or {}
    types: set[str] = set()
    for name in found:
        types.update(("rsa-sha2-512", "rsa-sha2-256") if name == "ssh-rsa" else (name,))
    return types


def connect_message(ep: Endpoint, e: Exception, config_path: str, at_auth: bool) -> str:
    """One line for a failed connection: what went wrong and the ssh command that would show or fix it.

    ``at_auth``: the handshake got as far as authentication, whatever paramiko raised last.
    """
    default_config = config_path == os.path.expanduser("~/.ssh/config")
    ssh = f"ssh {ep.alias}" if default_config else f"ssh -F {config_path} {ep.alias}"
    if isinstance(e, UnknownHostKey):
        return (
            f"ssh {ep.alias}: host key of {ep.known_hosts_name} is not known "
            f"({e.key.get_name()} {e.key.fingerprint}); run `{ssh}` once to accept it, "
            f"or add it to {ep.user_known_hosts}"
        )
    if isinstance(e, paramiko.BadHostKeyException):
        return (
            f"ssh {ep.alias}: host key of {ep.known_hosts_name} has CHANGED "
            f"(now {e.key.get_name()} {e.key.fingerprint}); this may be an attack. If the change "
            f"is expected, run `ssh-keygen -R '{ep.known_hosts_name}'` and then `{ssh}` once"
        )
    if isinstance(e, paramiko.PasswordRequiredException):
        return (
            f"ssh {ep.alias}: the key file needs a passphrase; load it into ssh-agent "
            "(`ssh-add`) so chainrun can use it"
        )
    if isinstance(e, paramiko.AuthenticationException) or at_auth:
        return (
            f"ssh {ep.alias}: authentication failed for user {ep.user} at {ep.where}; "
            f"make `{ssh} true` work without a password (ssh-agent or an IdentityFile)"
        )
    if isinstance(e, (socket.timeout, TimeoutError)):
        return (
            f"ssh {ep.alias}: {ep.where} did not complete the SSH handshake "
            f"within {ep.connect_timeout:g} s; check that it is an SSH server"
        )
    return f"ssh {ep.alias}: cannot connect to {ep.where}: {oneline(e) or type(e).__name__}"
