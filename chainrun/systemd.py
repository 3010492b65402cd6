"""Running chainrun as a systemd user service: the unit, installing and removing it, and what
systemd says of it.

``install`` writes the user unit with the absolute path of the running
chainrun (a virtualenv's included) and enables it through ``systemctl
--user`` when a user manager answers, or says exactly what to run when none
does; it also checks lingering, without which the service stops at logout.
"""

from __future__ import annotations

import getpass
import os
import shlex
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Optional

from chainrun.errors import ChainrunError
from chainrun.logsetup import LOG_FILE

if TYPE_CHECKING:
    from chainrun.transport import Transport

UNIT_NAME = "chainrun.service"
# What the shipped unit (systemd/chainrun.service) starts: `pip install --user`
# and pipx both put the command there. `install` writes the real path instead.
DEFAULT_EXEC = "%h/.local/bin/chainrun"
SYSTEMCTL_TIMEOUT = 60.0

UNIT_TEMPLATE = """\
# chainrun keeps long training runs alive by chaining walltime-limited jobs.
# `chainrun service install` writes this unit with the real path of chainrun
# in ExecStart; docs/service.md ("Running chainrun as a service") explains
# the settings and the fallbacks.
[Unit]
Description=chainrun: keeps long training runs alive across walltime-limited jobs
StartLimitIntervalSec=10min
StartLimitBurst=5

[Service]
Type=notify
ExecStart={exec_start}
{environment}ExecReload=/bin/kill -HUP $MAINPID
# READY=1 comes after the first tick has loaded the chains and adopted the
# jobs of an interrupted submission; a poll may take a minute on a slow cluster.
TimeoutStartSec=10min
# Pinged from the tick loop: a tick stuck for this long gets the service
# restarted. Longer than the slowest honest tick (a 60 s poll and 120 s
# submissions through a struggling scheduler).
WatchdogSec=10min
Restart=on-failure
RestartSec=30s
# Queued and running jobs belong to the scheduler and keep going; stopping only
# waits for a tick in flight and for end-of-chain notifications, both bounded.
TimeoutStopSec=30s
# Stop the service alone: segments of the local backend run in this unit's
# control group and must outlive it, as jobs on a cluster do.
KillMode=process
SyslogIdentifier=chainrun

[Install]
WantedBy=default.target
"""


# What chainrun itself reads from the environment, and what the schedulers' commands
# need, carried into the unit as this shell has them: a service started by the user
# manager would otherwise read another config, another ssh_config, and find no `qsub`.
# The state directory is always written, resolved: CHAINRUN_HOME (or --home), else where
# XDG_STATE_HOME puts it.
CARRIED = ("XDG_CONFIG_HOME", "CHAINRUN_SSH_CONFIG", "SGE_ROOT", "SGE_CELL", "SLURM_CONF", "PATH")
DAEMON_OUT = "daemon.out"  # where a service started by hand keeps its output


def unit_dir() -> Path:
    """Where systemd looks for user units: ``$XDG_CONFIG_HOME/systemd/user``."""
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "systemd" / "user"


def unit_path() -> Path:
    return unit_dir() / UNIT_NAME


def systemd_quote(arg: str) -> str:
    """One word of an ExecStart= or Environment= line, quoted for systemd."""
    text = arg.replace("%", "%%").replace("$", "$$")
    if text and not any(c in text for c in " \t\"'\\;"):
        return text
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def render_unit(exec_argv: list[str], environment: Optional[dict[str, str]] = None) -> str:
    """The unit text for ``exec_argv`` (the command before ``daemon``)."""
    exec_start = " ".join(systemd_quote(a) for a in [*exec_argv, "daemon"])
    env = "".join(
        f"Environment={systemd_quote(f'{k}={v}')}\n" for k, v in sorted((environment or {}).items())
    )
    return UNIT_TEMPLATE.format(exec_start=exec_start, environment=env)


def shipped_unit() -> str:
    """The unit as shipped in systemd/chainrun.service (``%h`` left for systemd to expand)."""
    return UNIT_TEMPLATE.format(exec_start=f"{DEFAULT_EXEC} daemon", environment="")


def service_environment(home: Path, needed: dict[str, str]) -> dict[str, str]:
    """What the service needs to read the state this shell reads: ``needed`` (from
    ``current_command``), the state directory, and what ``CARRIED`` names as set here."""
    env = dict(needed)
    env["CHAINRUN_HOME"] = str(Path(home).absolute())
    env.update((key, os.environ[key]) for key in CARRIED if os.environ.get(key))
    return env


def by_hand(command: list[str], env: dict[str, str], home: Path) -> str:
    """The command that starts the service without systemd on this machine, with the same
    environment (``PATH`` aside: it runs from this shell): in tmux when there is one, else
    under nohup."""
    assignments = [f"{k}={shlex.quote(v)}" for k, v in sorted(env.items()) if k != "PATH"]
    daemon = " ".join([*assignments, shlex.join([*command, "daemon"])])
    if shutil.which("tmux"):
        return f"tmux new-session -d -s chainrun {shlex.quote(daemon)}"
    out = shlex.quote(str(Path(home).absolute() / DAEMON_OUT))
    return f"{' '.join(assignments)} nohup {shlex.join([*command, 'daemon'])} >> {out} 2>&1 &".lstrip()


def user_manager() -> bool:
    """Whether a systemd user manager runs for this user, without asking it (its private
    socket is there): cheap enough for ``chainrun status``."""
    runtime = os.environ.get("XDG_RUNTIME_DIR") or f"/run/user/{os.getuid()}"
    return os.path.exists(os.path.join(runtime, "systemd", "private"))


def start_advice(home: Path) -> str:
    """How to start the service on this machine: through systemd where a user manager runs
    (one line), else the command that runs it by hand (on a line of its own, indented)."""
    if user_manager():
        if unit_path().exists():
            return f"start it with `systemctl --user start {UNIT_NAME}`"
        return "install and start it with `chainrun service install --now`"
    # This shell's PYTHONPATH stands in for current_command's probe: `status` runs no process.
    needed = {"PYTHONPATH": os.environ["PYTHONPATH"]} if os.environ.get("PYTHONPATH") else {}
    line = by_hand(this_command(), service_environment(home, needed), home)
    return f"no systemd user manager here; start one with:\n    {line}"


def current_command(transport: Optional[Transport] = None) -> tuple[list[str], dict[str, str]]:
    """The absolute command that runs this chainrun, and the environment it needs.

    Prefers the installed console script (``sys.argv[0]``, or the one beside
    the interpreter); else ``python -m chainrun``. The interpreter's path is
    kept as it is, never resolved: a virtualenv's python is a symlink, and
    following it would leave the virtualenv. When chainrun is importable only
    through ``PYTHONPATH`` or the current directory (a source checkout), the
    unit gets that directory in its environment.
    """
    package_root = str(Path(__file__).resolve().parent.parent)
    env = {} if _importable_alone(package_root, transport) else {"PYTHONPATH": package_root}
    return this_command(), env


def this_command() -> list[str]:
    """The absolute command that runs this chainrun (see ``current_command``)."""
    argv0 = os.path.abspath(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    beside = os.path.join(os.path.dirname(sys.executable), "chainrun")
    if os.path.basename(argv0) == "chainrun" and _executable(argv0):
        return [argv0]
    if _executable(beside):
        return [beside]
    return [sys.executable, "-m", "chainrun"]


def _or_local(transport: Optional[Transport]) -> Transport:
    """``transport``, else this machine's: imported only here, so that `chainrun status`,
    which asks only ``start_advice``, loads no transport."""
    if transport is not None:
        return transport
    from chainrun.transport import LocalTransport

    return LocalTransport()


def _executable(path: str) -> bool:
    return os.path.isfile(path) and os.access(path, os.X_OK)


def _importable_alone(package_root: str, transport: Optional[Transport]) -> bool:
    """True when a fresh interpreter finds this chainrun without PYTHONPATH or the cwd."""
    probe = (
        "import sys; sys.path = [p for p in sys.path if p not in ('', '.')]; "
        "import os, chainrun; print(os.path.dirname(os.path.dirname(os.path.realpath(chainrun.__file__))))"
    )
    t = _or_local(transport)
    result = t.run([sys.executable, "-E", "-c", probe], timeout=60.0)
    return result.ok and result.stdout.strip() == package_root


@dataclass
class Systemd:
    """``systemctl --user`` and ``loginctl`` through the transport."""

    transport: Transport

    def available(self) -> tuple[bool, str]:
        """Whether a user manager answers, and if not, why."""
        if shutil.which("systemctl") is None:
            return False, "systemctl is not installed"
        result = self.transport.run(["systemctl", "--user", "show-environment"], timeout=SYSTEMCTL_TIMEOUT)
        if result.ok:
            return True, ""
        return False, result.describe()

    def systemctl(self, *args: str) -> str:
        result = self.transport.run(["systemctl", "--user", *args], timeout=SYSTEMCTL_TIMEOUT)
        if not result.ok:
            raise ChainrunError(f"systemctl --user {' '.join(args)} failed: {result.describe()}")
        return result.stdout.strip()

    def state(self, verb: str) -> str:
        """``is-enabled`` / ``is-active`` answer (their non-zero exits are answers too)."""
        result = self.transport.run(["systemctl", "--user", verb, UNIT_NAME], timeout=SYSTEMCTL_TIMEOUT)
        return (result.stdout.strip() or result.stderr.strip() or "unknown").splitlines()[0]

    def linger(self, user: str) -> Optional[bool]:
        """Whether ``user`` lingers; None when it cannot be found out."""
        if shutil.which("loginctl") is not None:
            result = self.transport.run(
                ["loginctl", "show-user", user, "-p", "Linger"], timeout=SYSTEMCTL_TIMEOUT
            )
            for line in result.stdout.splitlines():
                if result.ok and line.startswith("Linger="):
                    return line.split("=", 1)[1].strip() == "yes"
        # logind keeps one marker file per lingering user.
        marker = Path("/var/lib/systemd/linger") / user
        return True if marker.exists() else None


def _user() -> str:
    return os.environ.get("USER") or getpass.getuser()


def linger_advice(systemd: Systemd) -> list[str]:
    user = _user()
    lingering = systemd.linger(user)
    if lingering:
        return [f"lingering is on for {user}: the service keeps running after you log out"]
    head = (
        f"lingering is off for {user}"
        if lingering is False
        else f"could not find out whether {user} lingers (loginctl did not answer)"
    )
    return [
        f"{head}: without it the user manager, and the service, stop when you log out.",
        f"  turn it on with: loginctl enable-linger {user}",
        "  where the site does not allow lingering, run the service under tmux, nohup or",
        "  scrontab instead: docs/service.md ('Fallbacks: tmux, nohup, scrontab') has the commands",
    ]


def install(home: Path, now: bool = False, transport: Optional[Transport] = None) -> tuple[list[str], bool]:
    """Write the unit, for the state directory ``home``, and enable it (and start it:
    ``now``). Returns what to tell the user, line by line, and whether a user manager
    answered: where none does, the lines say how to start the service by hand."""
    t = _or_local(transport)
    command, needed = current_command(t)
    env = service_environment(home, needed)
    path = unit_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(render_unit(command, env))
    os.replace(tmp, path)
    lines = [
        f"wrote {path}",
        f"  ExecStart={' '.join([*command, 'daemon'])}",
        f"  the service reads the state in {env['CHAINRUN_HOME']} (CHAINRUN_HOME)",
        "  with this shell's " + ", ".join(k for k in sorted(env) if k != "CHAINRUN_HOME"),
    ]
    systemd = Systemd(t)
    enable = ["enable", "--now", UNIT_NAME] if now else ["enable", UNIT_NAME]
    ok, why = systemd.available()
    if ok:
        systemd.systemctl("daemon-reload")
        systemd.systemctl(*enable)
        lines.append(f"enabled {UNIT_NAME}" + (" and started it" if now else "; start it with:"))
        if not now:
            lines.append(f"  systemctl --user start {UNIT_NAME}")
    else:
        lines += [
            f"systemd --user does not answer here ({why}); where it does, run:",
            "  systemctl --user daemon-reload",
            f"  systemctl --user {' '.join(enable)}",
            "to run the service here without systemd:",
            f"  {by_hand(command, env, home)}",
        ]
    if ok:  # lingering and the journal are the user manager's: no advice about them without one
        lines += linger_advice(systemd)
        lines.append(f"logs: journalctl --user -u {UNIT_NAME} -f")
    else:
        lines.append(f"logs: {Path(env['CHAINRUN_HOME']) / LOG_FILE} (chainrun logs CHAIN for a chain's)")
    return lines, ok


def uninstall(transport: Optional[Transport] = None) -> list[str]:
    """Stop and disable the service, and remove the unit file."""
    t = _or_local(transport)
    path = unit_path()
    systemd = Systemd(t)
    ok, why = systemd.available()
    lines = []
    if ok and path.exists():
        # Disabling a unit that is not loaded fails; the file goes anyway.
        result = t.run(["systemctl", "--user", "disable", "--now", UNIT_NAME], timeout=SYSTEMCTL_TIMEOUT)
        lines.append(
            f"stopped and disabled {UNIT_NAME}"
            if result.ok
            else f"systemctl --user disable --now {UNIT_NAME}: {result.describe()}"
        )
    if path.exists():
        path.unlink()
        lines.append(f"removed {path}")
    else:
        lines.append(f"no unit at {path}; nothing to remove")
    if ok:
        systemd.systemctl("daemon-reload")
    else:
        lines += [
            f"systemd --user does not answer here ({why}); if a user manager runs the unit, run:",
            f"  systemctl --user disable --now {UNIT_NAME} && systemctl --user daemon-reload",
        ]
    return lines


def unit_exec_start(text: str) -> Optional[str]:
    for line in text.splitlines():
        if line.startswith("ExecStart="):
            return line[len("ExecStart=") :]
    return None


def unit_environment(text: str) -> dict[str, str]:
    """The ``Environment=`` settings of a unit as ``render_unit`` writes them."""
    env = {}
    for line in text.splitlines():
        if line.startswith("Environment="):
            for word in shlex.split(line[len("Environment=") :]):
                key, _, value = word.replace("$$", "$").replace("%%", "%").partition("=")
                env[key] = value
    return env


def status(home: Path, transport: Optional[Transport] = None) -> list[str]:
    """Where the unit is, which state directory it reads, whether systemd runs it,
    lingering, and the config."""
    t = _or_local(transport)
    path = unit_path()
    lines = []
    if path.exists():
        text = path.read_text()
        written = unit_exec_start(text)
        command, env = current_command(t)
        lines.append(f"unit: {path}")
        lines.append(f"  ExecStart={written}")
        if written != unit_exec_start(render_unit(command, env)):
            lines.append("  this is not the chainrun running now; `chainrun service install` rewrites it")
        reads = unit_environment(text).get("CHAINRUN_HOME")
        here = str(Path(home).absolute())
        if reads != here:
            where = f"the state in {reads}" if reads else "the default state directory (no CHAINRUN_HOME)"
            lines.append(f"  it reads {where}, not {here}; `chainrun service install` rewrites it")
    else:
        lines.append(f"unit: not installed ({path}); `chainrun service install --now` installs it")
    systemd = Systemd(t)
    ok, why = systemd.available()
    if ok:
        lines.append(f"systemd: {systemd.state('is-enabled')}, {systemd.state('is-active')}")
    else:
        lines.append(f"systemd: --user does not answer here ({why})")
    lines += linger_advice(systemd)
    from chainrun.config import CONFIG_KEYS, config_path, load_config

    cfg = config_path()
    if cfg.exists():
        try:
            config = load_config(cfg)
        except ChainrunError as exc:
            lines.append(f"config: BROKEN, the service will not start or reload with it: {exc}")
        else:
            values = ", ".join(f"{k}={v!r}" for k in CONFIG_KEYS if (v := getattr(config, k)) is not None)
            lines.append(f"config: {cfg}" + (f" ({values})" if values else " (empty)"))
    else:
        lines.append(f"config: none at {cfg} (optional: on_end, webhook, interval)")
    return lines
