"""The systemd side of chainrun: the unit, `service install`, sd_notify, signals, logs."""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import re
import secrets
import shlex
import shutil
import signal
import socket
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Callable, Optional

import pytest
import structlog
from conftest import REPO, cli_env, have, need, wait_for

from chainrun import config as service_config
from chainrun import doorbell, heartbeat, jobfile, logsetup, sdnotify, systemd
from chainrun import service as service_module
from chainrun.engine import TickSummary
from chainrun.errors import JobFileError, StoreUnavailable
from chainrun.localrunner import machine_dir
from chainrun.model import NO_PROGRESS
from chainrun.store import Store

TRAINER = Path(__file__).parent / "data" / "trainer.py"


# -- helpers --------------------------------------------------------------------


class Listener:
    """A unix datagram socket standing in for systemd's notify socket."""

    def __init__(self, address: Optional[str] = None) -> None:
        self.name = address or f"@chainrun-test-{secrets.token_hex(6)}"
        bind_to = "\0" + self.name[1:] if self.name.startswith("@") else self.name
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(bind_to)
        self.sock.settimeout(0.2)
        self.messages: list[tuple[float, list[str]]] = []
        self.lock = threading.Lock()
        self.done = False
        self.thread = threading.Thread(target=self._receive, daemon=True)
        self.thread.start()

    def _receive(self) -> None:
        while not self.done:
            try:
                data = self.sock.recv(4096)
            except socket.timeout:
                continue
            except OSError:
                return
            with self.lock:
                self.messages.append((time.monotonic(), data.decode().split("\n")))

    def fields(self) -> list[tuple[float, str]]:
        """Every field received, in order, with its arrival time."""
        with self.lock:
            return [(t, f) for t, fields in self.messages for f in fields]

    def wait(self, predicate: Callable[[str], bool], timeout: float, what: str, after: int = 0) -> int:
        """Index (in fields()) of the first field from ``after`` on that matches."""
        found: list[int] = []

        def seen() -> bool:
            for i, (_, f) in enumerate(self.fields()[after:], start=after):
                if predicate(f):
                    found.append(i)
                    return True
            return False

        wait_for(seen, timeout, what, every=0.05)
        return found[0]

    def close(self) -> None:
        self.done = True
        self.thread.join()
        self.sock.close()


@pytest.fixture
def listener() -> Iterator[Listener]:
    """A notify socket in the abstract namespace, as systemd uses."""
    sock = Listener()
    yield sock
    sock.close()


@pytest.fixture
def daemon(
    service: Callable[..., subprocess.Popen[bytes]], tmp_path: Path
) -> Callable[..., subprocess.Popen[bytes]]:
    """conftest's service, ticking every 0.3 s, with its config under tmp_path/config."""

    def start(interval: Optional[float] = 0.3, **env: str) -> subprocess.Popen[bytes]:
        return service(interval, XDG_CONFIG_HOME=str(tmp_path / "config"), **env)

    return start


def daemon_log(tmp_path: Path, n: int = 0) -> str:
    return (tmp_path / f"daemon-{n}.log").read_text()


def write_job(tmp_path: Path, command: str, name: str = "t", extra: str = "") -> Path:
    work = tmp_path / "work"
    work.mkdir(exist_ok=True)
    shutil.copy(TRAINER, work / "trainer.py")
    path = work / f"{name}.toml"
    path.write_text(
        f'name = "{name}"\ncommand = "{command}"\ntotal_time = "5m"\nwalltime = "1m"\ngrace = "2s"\n'
        f'checkpoint_dir = "checkpoints-{name}"\n{extra}'  # one chain per checkpoint directory
    )
    return path


def trainer(epochs: int, epoch_time: float = 0.4, mode: str = "ok") -> str:
    return f"python3 trainer.py --mode {mode} --epochs {epochs} --epoch-time {epoch_time}"


def chain_json(chainrun: Callable[..., subprocess.CompletedProcess[str]], ref: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(chainrun("status", ref, "--json", check=True).stdout)[0]
    return data


def segments(home: Path) -> list[tuple[int, Optional[str], str]]:
    db = sqlite3.connect(home / "chainrun.db")
    try:
        return [
            (n, job, phase)
            for n, job, phase in db.execute("select n, job_id, phase from segments order by n")
        ]
    finally:
        db.close()


def verify(path: Path, home_dir: Path) -> subprocess.CompletedProcess[str]:
    """`systemd-analyze verify --user PATH`, as REAL-CLUSTERS.md says it runs here."""
    need("systemd-analyze", have("systemd-analyze"), "apt-get install systemd")
    # Socket paths under the runtime dir must fit in 108 bytes: keep it short (pytest -n
    # makes tmp paths long, and the user units' gpg-agent sockets then fail to parse).
    with tempfile.TemporaryDirectory(prefix="crrt", dir="/tmp") as runtime:
        env = dict(os.environ, HOME=str(home_dir), XDG_RUNTIME_DIR=runtime)
        env.pop("XDG_CONFIG_HOME", None)
        return subprocess.run(
            ["systemd-analyze", "verify", "--user", str(path)],
            capture_output=True,
            text=True,
            env=env,
            timeout=60,
        )


def fake_tools(bin_dir: Path, systemd: bool, linger: str = "no") -> Path:
    """`systemctl` and `loginctl` stand-ins that record their argv (no user manager runs here)."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    calls = bin_dir / "calls"
    systemctl = f'echo "systemctl $*" >> {shlex.quote(str(calls))}\n' + (
        "exit 0\n" if systemd else 'echo "Failed to connect to bus: No medium found" >&2\nexit 1\n'
    )
    loginctl = f'echo "loginctl $*" >> {shlex.quote(str(calls))}\necho Linger={linger}\n'
    for name, body in (("systemctl", systemctl), ("loginctl", loginctl)):
        (bin_dir / name).write_text("#!/bin/sh\n" + body)
        (bin_dir / name).chmod(0o755)
    return calls


def install_env(home: Path, tmp_path: Path, bin_dir: Path) -> dict[str, str]:
    env = cli_env(home)
    env["HOME"] = str(tmp_path / "userhome")
    env["PATH"] = f"{bin_dir}{os.pathsep}{env['PATH']}"
    env["USER"] = "alice"
    env.pop("XDG_CONFIG_HOME", None)
    return env


def run_cli(
    env: dict[str, str], *args: str, exe: Optional[list[str]] = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*(exe or [sys.executable, "-m", "chainrun"]), *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )


def exec_start(unit_text: str) -> list[str]:
    line = systemd.unit_exec_start(unit_text)
    assert line is not None
    return shlex.split(line)


def local_jobs(home: Path) -> list[dict[str, Any]]:
    """What the local runner was asked to run: each job's job.json, by id."""
    jobs = machine_dir(home / "local") / "jobs"
    found = []
    for jobdir in jobs.iterdir() if jobs.is_dir() else []:
        try:
            found.append(json.loads((jobdir / "job.json").read_text()))
        except (OSError, ValueError):
            continue  # being written
    return sorted(found, key=lambda job: int(job["id"]))


def cancel_local_jobs(home: Path) -> None:
    """Cancel every local runner job under ``home``, as a chain's cancel would."""
    ids = [str(job["id"]) for job in local_jobs(home)]
    if ids:
        subprocess.run(
            [sys.executable, "-m", "chainrun.localrunner", "cancel", *ids],
            env=cli_env(home),
            capture_output=True,
            timeout=60,
        )


def exits(proc: subprocess.Popen[bytes], timeout: float, what: str) -> int:
    """Wait for ``proc`` to exit (an assertion, not a TimeoutExpired, if it does not)."""
    wait_for(lambda: proc.poll() is not None, timeout, what)
    return proc.wait()


class FakeEngine:
    """Stands in for the engine class: each tick takes the next step of ``plan``
    (a summary to return, or an exception to raise); then empty summaries."""

    def __init__(self, plan: list[Any]) -> None:
        self.plan = list(plan)
        self.ticks: list[float] = []  # monotonic start of each tick

    def __call__(
        self, store: Store, on_end: Any = None, on_problem: Any = None, on_warning: Any = None
    ) -> FakeEngine:
        return self  # Engine(store, on_end=..., on_problem=..., on_warning=...) in the service

    def tick(self, only: Optional[str] = None) -> TickSummary:
        self.ticks.append(time.monotonic())
        step = self.plan.pop(0) if self.plan else TickSummary()
        if isinstance(step, BaseException):
            raise step
        assert isinstance(step, TickSummary)
        return step


class InProcess:
    """A Service run in a thread of this process, with its JSON log lines kept."""

    def __init__(self, service: service_module.Service, log: io.StringIO) -> None:
        self.service = service
        self.log = log
        self.errors: list[BaseException] = []
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        try:
            self.service.run()
        except BaseException as exc:  # the test reports it
            self.errors.append(exc)

    def __enter__(self) -> InProcess:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.service.stop()
        self.thread.join(60)
        assert not self.thread.is_alive(), "the service did not stop"
        assert self.errors == [], self.errors

    def events(self) -> list[str]:
        return [json.loads(line)["event"] for line in self.log.getvalue().splitlines()]


@pytest.fixture
def in_process(
    home: Path, tmp_path: Path, listener: Listener, restore_logging: None, monkeypatch: pytest.MonkeyPatch
) -> Callable[..., InProcess]:
    """Make a service with the engine replaced by ``engine``, notifying ``listener`` (watchdog 0.4 s)."""

    def make(engine: FakeEngine, **kwargs: Any) -> InProcess:
        out = io.StringIO()
        logsetup.setup("info", stream=out)
        monkeypatch.setattr(service_module, "Engine", engine)
        kwargs.setdefault("config_path", tmp_path / "no-config.toml")
        notify = sdnotify.SdNotify(listener.name, watchdog_usec=400_000)
        return InProcess(service_module.Service(home, notify=notify, **kwargs), out)

    return make


# -- the unit -------------------------------------------------------------------


def test_shipped_unit_passes_systemd_analyze_verify_without_a_word(tmp_path: Path) -> None:
    """systemd/chainrun.service verifies clean when %h/.local/bin/chainrun exists."""
    bin_dir = tmp_path / "userhome" / ".local" / "bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / "chainrun").write_text("#!/bin/sh\nexit 0\n")
    (bin_dir / "chainrun").chmod(0o755)
    result = verify(REPO / "systemd" / "chainrun.service", tmp_path / "userhome")
    assert result.returncode == 0 and result.stdout + result.stderr == ""


def test_shipped_unit_is_exactly_what_install_writes_for_the_default_path() -> None:
    """The shipped file and the installer's template cannot drift apart."""
    assert (REPO / "systemd" / "chainrun.service").read_text() == systemd.shipped_unit()


def test_shipped_unit_declares_notify_watchdog_reload_restart_and_quick_stop() -> None:
    """The unit's settings that the service's behaviour relies on."""
    text = systemd.shipped_unit()
    for line in (
        "Type=notify",
        "ExecReload=/bin/kill -HUP $MAINPID",
        "Restart=on-failure",
        "WatchdogSec=10min",
        "TimeoutStopSec=30s",
        "KillMode=process",
        "WantedBy=default.target",
    ):
        assert f"\n{line}\n" in text, line


def test_install_without_systemd_writes_a_verified_unit_running_this_chainrun_and_says_what_to_run(
    home: Path, tmp_path: Path
) -> None:
    """No user manager: the unit is written with the real interpreter, and the commands are
    printed; `--now` exits 1 and says that nothing was started."""
    calls = fake_tools(tmp_path / "bin", systemd=False)
    env = install_env(home, tmp_path, tmp_path / "bin")
    result = run_cli(env, "service", "install", "--now")
    assert result.returncode == 1 and result.stderr == (
        "chainrun: nothing was started: no systemd user manager answers here (see above)\n"
    )
    path = tmp_path / "userhome" / ".config" / "systemd" / "user" / "chainrun.service"
    text = path.read_text()
    argv = exec_start(text)
    # The console script beside this interpreter (an installed chainrun), else this interpreter.
    beside = os.path.join(os.path.dirname(sys.executable), "chainrun")
    assert argv in ([beside, "daemon"], [sys.executable, "-m", "chainrun", "daemon"])
    # Importable only through PYTHONPATH (a plain checkout): the unit carries it.
    clean = {"PATH": "/usr/bin:/bin", "HOME": env["HOME"]}
    if f"Environment=PYTHONPATH={REPO}\n" in text:
        clean["PYTHONPATH"] = str(REPO)
    # The command line the unit starts really is chainrun, with nothing from this shell.
    help_run = subprocess.run(
        [*argv[:-1], "daemon", "--help"], capture_output=True, text=True, env=clean, cwd="/"
    )
    assert help_run.returncode == 0 and "Run the service in the foreground" in help_run.stdout
    assert "systemctl --user daemon-reload" in result.stdout
    assert "systemctl --user enable --now chainrun.service" in result.stdout
    # Lingering and the journal are the user manager's: without one, where the log really is.
    assert "linger" not in result.stdout and "journalctl" not in result.stdout
    assert result.stdout.splitlines()[-1].startswith(f"logs: {home / 'service.log'} (chainrun logs CHAIN")
    assert "systemctl --user daemon-reload" not in calls.read_text()  # only the probe ran
    check = verify(path, tmp_path / "userhome")
    assert check.returncode == 0 and check.stdout + check.stderr == ""

    result = run_cli(env, "service", "uninstall")
    assert result.returncode == 0 and not path.exists()
    assert f"removed {path}" in result.stdout


def unit_env(text: str) -> dict[str, str]:
    """What a unit's Environment= lines set, read as systemd reads them."""
    found = {}
    for line in text.splitlines():
        if line.startswith("Environment="):
            key, _, value = shlex.split(line[len("Environment=") :])[0].partition("=")
            found[key] = value.replace("$$", "$").replace("%%", "%")
    return found


def test_the_unit_reads_the_state_directory_and_settings_of_the_shell_that_installed_it(
    home: Path, tmp_path: Path
) -> None:
    """A user with CHAINRUN_HOME set submitted into one state directory while the installed
    service read the default one, and nothing ever advanced. The unit now carries the state
    directory and what chainrun and the schedulers read; started with the unit's environment
    alone, chainrun sees the chain this shell submitted. `service status` says when the unit
    reads another state directory."""
    fake_tools(tmp_path / "bin", systemd=False)
    env = install_env(home, tmp_path, tmp_path / "bin")
    env.update(CHAINRUN_SSH_CONFIG=str(tmp_path / "my ssh_config"), SGE_ROOT="/opt/sge", SGE_CELL="default")
    job = tmp_path / "job.toml"
    job.write_text('name = "mine"\ncommand = "true"\ntotal_time = "1h"\nwalltime = "10m"\n')
    (chain_id,) = run_cli(env, "submit", str(job)).stdout.split()
    result = run_cli(env, "service", "install")
    assert result.returncode == 0, result.stderr
    assert f"the service reads the state in {home} (CHAINRUN_HOME)" in result.stdout
    text = (tmp_path / "userhome" / ".config" / "systemd" / "user" / "chainrun.service").read_text()
    carried = unit_env(text)
    assert carried["CHAINRUN_HOME"] == str(home)
    assert carried["CHAINRUN_SSH_CONFIG"] == str(tmp_path / "my ssh_config")
    assert (carried["SGE_ROOT"], carried["SGE_CELL"], carried["PATH"]) == ("/opt/sge", "default", env["PATH"])
    alone = {"HOME": env["HOME"], **carried}  # what the user manager gives the service
    listed = subprocess.run(
        [*exec_start(text)[:-1], "status", "--json"], capture_output=True, text=True, env=alone, cwd="/"
    )
    assert [c["id"] for c in json.loads(listed.stdout)] == [chain_id], listed.stderr

    other = dict(env, CHAINRUN_HOME=str(tmp_path / "elsewhere"))
    out = run_cli(other, "service", "status").stdout
    assert f"it reads the state in {home}, not {tmp_path / 'elsewhere'}; `chainrun service install`" in out
    assert "it reads the state" not in run_cli(env, "service", "status").stdout


def test_install_now_without_systemd_prints_the_command_that_starts_the_service_by_hand(
    home: Path, tmp_path: Path
) -> None:
    """`service install --now` where `systemctl --user` does not answer exits 1, says nothing
    was started, and prints the command that runs the service here (tmux when installed,
    else nohup) with the same state directory: run as printed, it starts the service."""
    fake_tools(tmp_path / "bin", systemd=False)
    env = install_env(home, tmp_path, tmp_path / "bin")
    env["TMUX_TMPDIR"] = str(tmp_path)  # a tmux server of this test's own
    result = run_cli(env, "service", "install", "--now")
    assert result.returncode == 1 and "nothing was started" in result.stderr
    lines = result.stdout.splitlines()
    command = lines[lines.index("to run the service here without systemd:") + 1].strip()
    assert command.startswith("tmux new-session" if shutil.which("tmux") else "CHAINRUN_HOME=")
    assert f"CHAINRUN_HOME={home}" in command
    started = subprocess.run(["bash", "-c", command], env=env, cwd=tmp_path, timeout=60)
    try:
        assert started.returncode == 0
        wait_for(
            lambda: "service: running" in run_cli(env, "status").stdout, 60, "the service started by hand"
        )
    finally:
        pid = (heartbeat.read(home) or {}).get("pid")
        if isinstance(pid, int):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        if command.startswith("tmux"):
            subprocess.run(["tmux", "kill-server"], env=env, timeout=30)


def test_install_with_systemd_reloads_and_enables_now_and_uninstall_disables(
    home: Path, tmp_path: Path
) -> None:
    """With a user manager: daemon-reload, enable --now; uninstall: disable --now, remove, reload."""
    calls = fake_tools(tmp_path / "bin", systemd=True, linger="yes")
    env = install_env(home, tmp_path, tmp_path / "bin")
    result = run_cli(env, "service", "install", "--now")
    assert result.returncode == 0, result.stderr
    recorded = calls.read_text().splitlines()
    assert "systemctl --user daemon-reload" in recorded
    assert recorded.index("systemctl --user daemon-reload") < recorded.index(
        "systemctl --user enable --now chainrun.service"
    )
    assert "loginctl show-user alice -p Linger" in recorded
    assert "lingering is on for alice" in result.stdout and "enable-linger" not in result.stdout
    path = tmp_path / "userhome" / ".config" / "systemd" / "user" / "chainrun.service"
    assert path.exists()

    calls.write_text("")
    result = run_cli(env, "service", "uninstall")
    assert result.returncode == 0, result.stderr
    assert not path.exists()
    recorded = calls.read_text().splitlines()
    assert recorded.index("systemctl --user disable --now chainrun.service") < recorded.index(
        "systemctl --user daemon-reload"
    )


def test_install_from_a_console_script_puts_that_script_in_exec_start(home: Path, tmp_path: Path) -> None:
    """Run through a virtualenv's `chainrun` script, the unit starts that very script."""
    fake_tools(tmp_path / "bin", systemd=False)
    env = install_env(home, tmp_path, tmp_path / "bin")
    venv_bin = tmp_path / "my venv" / "bin"  # a space, as in "My Projects"
    venv_bin.mkdir(parents=True)
    script = venv_bin / "chainrun"
    script.write_text(  # what pip writes for a console_scripts entry point
        f"#!{sys.executable}\nimport sys\nfrom chainrun.cli import main\nif __name__ == '__main__':\n    sys.exit(main())\n"
    )
    script.chmod(0o755)
    result = run_cli(env, "service", "install", exe=[str(script)])
    assert result.returncode == 0, result.stderr
    text = (tmp_path / "userhome" / ".config" / "systemd" / "user" / "chainrun.service").read_text()
    assert exec_start(text) == [str(script), "daemon"]
    assert f'ExecStart="{script}" daemon\n' in text


def test_service_status_reports_the_unit_linger_config_and_process(home: Path, tmp_path: Path) -> None:
    """`service status` says where the unit is, whether lingering is on, the config, and the process."""
    fake_tools(tmp_path / "bin", systemd=False, linger="no")
    env = install_env(home, tmp_path, tmp_path / "bin")
    out = run_cli(env, "service", "status").stdout
    assert "unit: not installed" in out and "lingering is off for alice" in out
    assert "service: not running" in out
    run_cli(env, "service", "install")
    config = tmp_path / "userhome" / ".config" / "chainrun" / "config.toml"
    config.parent.mkdir(parents=True)
    config.write_text('interval = "30s"\n')
    out = run_cli(env, "service", "status").stdout
    assert "unit: " + str(tmp_path / "userhome" / ".config" / "systemd" / "user" / "chainrun.service") in out
    assert "not the chainrun running now" not in out
    assert "interval=30.0" in out
    config.write_text("interval = -1\n")
    result = run_cli(env, "service", "status")
    assert (
        result.returncode == 0
        and "config: BROKEN" in result.stdout
        and "must be 0.2 to 3600 seconds" in result.stdout
    )


# -- config ---------------------------------------------------------------------


def test_config_unknown_key_is_an_error_that_names_it(tmp_path: Path) -> None:
    """A typo in config.toml is refused, naming the key and what is allowed."""
    path = tmp_path / "config.toml"
    path.write_text('on_edn = "true"\n')
    with pytest.raises(
        JobFileError,
        match=r"unknown key on_edn; did you mean on_end\? Allowed here: on_end, webhook, interval",
    ):
        service_config.load_config(path)


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ('webhook = "ftp://x"', "webhook = 'ftp://x': must be an http:// or https:// URL"),
        (
            'webhook = "http:///x"',
            "webhook = 'http:///x': must be an http:// or https:// URL with a valid host",
        ),
        ('interval = "soon"', "interval = 'soon': not seconds or a duration"),
        ("interval = 0", "interval = 0: must be 0.2 to 3600 seconds"),
        ("interval = -1", "interval = -1: must be 0.2 to 3600 seconds"),
        ("interval = 0.1", "interval = 0.1: must be 0.2 to 3600 seconds"),
        ("interval = nan", "interval = nan: must be 0.2 to 3600 seconds"),
        ("interval = inf", "interval = inf: must be 0.2 to 3600 seconds"),
        ("interval = -inf", "interval = -inf: must be 0.2 to 3600 seconds"),
        ("interval = 1e300", "interval = 1e+300: must be 0.2 to 3600 seconds"),
        ('interval = "1e300"', "interval = '1e300': must be 0.2 to 3600 seconds"),
        ('interval = "2h"', "interval = '2h': must be 0.2 to 3600 seconds"),
        ("interval = true", "interval = True: expected seconds between ticks"),
        ('on_end = "  "', "on_end = '  ': must be a non-empty command"),
    ],
)
def test_config_bad_values_are_errors_naming_the_field(tmp_path: Path, text: str, problem: str) -> None:
    """Each config field is validated like a job file field."""
    path = tmp_path / "config.toml"
    path.write_text(text + "\n")
    with pytest.raises(JobFileError, match=re.escape(problem)):
        service_config.load_config(path)


def test_config_interval_takes_durations_and_seconds_and_a_missing_file_is_defaults(tmp_path: Path) -> None:
    """interval = "1m" and interval = 60 mean the same; no file means nothing set."""
    path = tmp_path / "config.toml"
    path.write_text('interval = "1m"\non_end = "notify-send done"\n')
    assert service_config.load_config(path).interval == 60.0
    path.write_text("interval = 60\n")
    assert service_config.load_config(path).interval == 60.0
    for text, seconds in (
        ("0.2", 0.2),
        ("3600", 3600.0),
        ('"1h"', 3600.0),
        ('"0.5"', 0.5),
        ('"00:01:30"', 90.0),
    ):
        path.write_text(f"interval = {text}\n")
        assert service_config.load_config(path).interval == seconds
    assert service_config.load_config(tmp_path / "none.toml") == service_config.ServiceConfig(
        path=str(tmp_path / "none.toml")
    )


def test_systemd_quote_escapes_specifiers_variables_and_spaces() -> None:
    """% and $ are doubled and words with spaces quoted, so systemd reads back the same word."""
    assert systemd.systemd_quote("/opt/bin/chainrun") == "/opt/bin/chainrun"
    assert systemd.systemd_quote("/a b/c") == '"/a b/c"'
    assert systemd.systemd_quote("/x/50%/$HOME") == "/x/50%%/$$HOME"
    assert systemd.systemd_quote('say "hi"') == '"say \\"hi\\""'


# -- sd_notify --------------------------------------------------------------------


def test_sd_notify_reaches_a_filesystem_socket_and_an_abstract_one(tmp_path: Path) -> None:
    """One datagram per send, to a path or to @name in the abstract namespace."""
    short = Path(tempfile.mkdtemp(prefix="cr-", dir="/tmp"))  # socket paths must stay under 108 bytes
    try:
        for address in (str(short / "notify"), None):
            sock = Listener(address)
            try:
                notify = sdnotify.SdNotify(sock.name)
                assert notify.send("READY=1", "STATUS=1 running, 0 queued, 0 failed")
                sock.wait(lambda f: f.startswith("STATUS="), 30, "the status")
                assert sock.messages[0][1] == ["READY=1", "STATUS=1 running, 0 queued, 0 failed"]
                notify.close()
            finally:
                sock.close()
    finally:
        shutil.rmtree(short)


def test_sd_notify_without_socket_is_a_no_op_and_hides_its_variables_from_children(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Outside systemd nothing is sent; inside, children never inherit NOTIFY_SOCKET."""
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    assert sdnotify.SdNotify.from_environ().send("READY=1") is False
    monkeypatch.setenv("NOTIFY_SOCKET", "@x")
    monkeypatch.setenv("WATCHDOG_USEC", "4000000")
    notify = sdnotify.SdNotify.from_environ()
    assert notify.watchdog_period == 2.0
    assert "NOTIFY_SOCKET" not in os.environ and "WATCHDOG_USEC" not in os.environ
    monkeypatch.setenv("WATCHDOG_USEC", "4000000")
    monkeypatch.setenv("WATCHDOG_PID", "1")  # the watchdog is someone else's
    assert sdnotify.SdNotify.from_environ().watchdog_period is None


def test_ready_comes_only_after_the_first_tick_adopted_an_interrupted_submission(
    tmp_path: Path,
    home: Path,
    chainrun: Callable[..., subprocess.CompletedProcess[str]],
    daemon: Callable[..., subprocess.Popen[bytes]],
    listener: Listener,
) -> None:
    """A service killed mid-submission restarts; READY=1 arrives once the job is adopted, not before."""
    path = write_job(tmp_path, "sleep 30")
    chain_id = chainrun("submit", str(path), check=True).stdout.strip()
    first = daemon(CHAINRUN_LOCAL_SUBMIT_DELAY="20")
    # Killed once the local runner has the job (its id comes 20 s later, a margin no
    # load closes): before that there would be nothing to adopt.
    wait_for(
        lambda: [job["name"] for job in local_jobs(home)] == [f"cr.{chain_id}.1"],
        60,
        "the local runner's job for segment 1",
    )
    first.send_signal(signal.SIGKILL)
    first.wait()
    assert segments(home) == [(1, None, "submitting")]

    daemon(NOTIFY_SOCKET=listener.name)
    ready = listener.wait(lambda f: f == "READY=1", 60, "READY=1")
    # Read at READY: the interrupted submission is already resolved, by adoption (on a busy
    # machine a second tick may have queued segment 2 by the time this reads).
    n, job_id, phase = segments(home)[0]
    assert n == 1 and job_id is not None and phase in ("pending", "running")
    assert "adopted after a restart" in chainrun("history", chain_id, check=True).stdout
    assert listener.fields()[ready + 1][1].startswith("STATUS=")
    chainrun("cancel", chain_id, check=True)


class HungSSH:
    """A TCP server that accepts connections and never speaks: an sshd hung before
    its banner. Until ``hang`` is set it drops each connection at once instead."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.sock.settimeout(0.2)
        self.port = self.sock.getsockname()[1]
        self.hang = threading.Event()
        self.hung = threading.Event()  # a connection is being held
        self.held: list[socket.socket] = []
        self.done = False
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while not self.done:
            try:
                conn, _ = self.sock.accept()
            except (socket.timeout, OSError):
                continue
            if self.hang.is_set():
                self.held.append(conn)
                self.hung.set()
            else:
                conn.close()

    def release(self) -> None:
        """Stop hanging: close the held connections (the client reads EOF)."""
        self.hang.clear()
        for conn in self.held:
            conn.close()

    def close(self) -> None:
        self.done = True
        self.thread.join()
        self.release()
        self.sock.close()


def test_watchdog_pings_at_half_the_timeout_and_stop_while_a_tick_hangs(
    tmp_path: Path, home: Path, daemon: Callable[..., subprocess.Popen[bytes]], listener: Listener
) -> None:
    """WATCHDOG=1 every WATCHDOG_USEC/2; a tick stuck on a cluster whose sshd does not answer stops them."""
    server = HungSSH()
    try:
        ssh_config = tmp_path / "ssh_config"
        ssh_config.write_text(
            f"Host hung-cluster\n    HostName 127.0.0.1\n    Port {server.port}\n"
            "    User nobody\n    ConnectTimeout 60\n    StrictHostKeyChecking no\n"
        )
        path = write_job(
            tmp_path,
            "sleep 30",
            extra=f'workdir = "{tmp_path}/on-the-cluster"\n[scheduler]\nkind = "slurm"\nhost = "hung-cluster"\n',
        )
        # Stored as `chainrun submit` stores it when the cluster answers (this one never does).
        store = Store(home)
        store.add_chain(jobfile.load(path), NO_PROGRESS, time.time())
        store.close()
        proc = daemon(
            interval=5.0,
            NOTIFY_SOCKET=listener.name,
            WATCHDOG_USEC="400000",
            CHAINRUN_SSH_CONFIG=str(ssh_config),
        )
        listener.wait(lambda f: f == "READY=1", 60, "READY=1")  # the first poll failed at once
        start = len(listener.fields())
        time.sleep(1.5)
        pings = [t for t, f in listener.fields()[start:] if f == "WATCHDOG=1"]
        # Every 0.2 s, though the engine ticks only every 5 s.
        assert len(pings) >= 5
        assert max(b - a for a, b in zip(pings, pings[1:])) < 0.5

        # The next tick's poll connects and waits for a banner that never comes,
        # as behind a hung sshd or a dead VPN.
        server.hang.set()
        wait_for(server.hung.is_set, 30, "the next tick to connect")
        time.sleep(0.5)  # a ping sent just before the tick is still on its way
        hung_since = len(listener.fields())
        time.sleep(1.5)
        assert [f for _, f in listener.fields()[hung_since:] if f == "WATCHDOG=1"] == []
        assert proc.poll() is None

        # The connection drops: the poll fails, the tick returns, the pings come back.
        server.release()
        listener.wait(lambda f: f == "WATCHDOG=1", 30, "pings after the tick returned", after=hung_since)
        assert proc.poll() is None
        proc.terminate()
        assert proc.wait(30) == 0
    finally:
        server.close()


def test_status_line_follows_chains_as_they_run_complete_and_fail(
    tmp_path: Path,
    chainrun: Callable[..., subprocess.CompletedProcess[str]],
    daemon: Callable[..., subprocess.Popen[bytes]],
    listener: Listener,
) -> None:
    """STATUS= tells running, queued and failed chains, and changes with them."""
    ok = write_job(tmp_path, trainer(epochs=2), name="ok", extra="target_epoch = 2\n")
    chainrun("submit", str(ok), check=True)
    daemon(interval=0.2, NOTIFY_SOCKET=listener.name)
    # A running chain keeps its successor queued ahead: it counts in both.
    listener.wait(lambda f: f == "STATUS=1 running, 1 queued, 0 failed", 60, "the chain running")
    done = listener.wait(lambda f: f == "STATUS=0 running, 0 queued, 0 failed", 60, "the chain completed")
    bad = write_job(tmp_path, trainer(epochs=2, mode="crash"), name="bad", extra="max_failures = 0\n")
    chainrun("submit", str(bad), check=True)
    listener.wait(lambda f: f == "STATUS=0 running, 0 queued, 1 failed", 60, "the chain failed", after=done)
    assert chain_json(chainrun, "ok")["state"] == "completed"


def test_sigterm_sends_stopping_exits_at_once_and_leaves_the_job_running(
    tmp_path: Path,
    home: Path,
    chainrun: Callable[..., subprocess.CompletedProcess[str]],
    daemon: Callable[..., subprocess.Popen[bytes]],
    listener: Listener,
) -> None:
    """Stopping is quick and loses nothing: STOPPING=1, exit 0, the segment keeps running."""
    path = write_job(tmp_path, "sleep 30")
    chain_id = chainrun("submit", str(path), check=True).stdout.strip()
    proc = daemon(NOTIFY_SOCKET=listener.name)
    listener.wait(lambda f: f.startswith("STATUS=1 running"), 60, "the segment running")
    proc.send_signal(signal.SIGTERM)
    started = time.monotonic()
    assert proc.wait(10) == 0
    assert time.monotonic() - started < 3
    assert "STOPPING=1" in [f for _, f in listener.fields()]
    # What it knew is as of its last tick, and it names no process any more.
    assert "pid" not in json.loads((home / "service.status").read_text())
    # The running segment and its queued successor both live on after the service.
    jobs = machine_dir(home / "local") / "jobs"
    assert sorted(p.name for p in jobs.iterdir()) == ["1", "2"]
    assert (jobs / "1" / "start.json").exists()
    assert not (jobs / "1" / "end.json").exists() and not (jobs / "2" / "end.json").exists()
    for job in ("1", "2"):
        os.kill(int((jobs / job / "supervisor.pid").read_text().split()[0]), 0)  # raises if it died
    st = chain_json(chainrun, chain_id)
    assert st["state"] == "active" and st["segments"][0]["phase"] == "running"
    chainrun("cancel", chain_id, check=True)


def test_sighup_reloads_config_and_log_file_without_dropping_a_chain(
    tmp_path: Path,
    home: Path,
    chainrun: Callable[..., subprocess.CompletedProcess[str]],
    daemon: Callable[..., subprocess.Popen[bytes]],
    listener: Listener,
) -> None:
    """SIGHUP: RELOADING=1 then READY=1; a bad config is kept out; the new on_end applies; the chain goes on."""
    path = write_job(tmp_path, trainer(epochs=6, epoch_time=0.5), extra="target_epoch = 6\n")
    chain_id = chainrun("submit", str(path), check=True).stdout.strip()
    proc = daemon(interval=0.2, NOTIFY_SOCKET=listener.name)
    listener.wait(lambda f: f.startswith("STATUS=1 running"), 60, "the segment running")
    config = tmp_path / "config" / "chainrun" / "config.toml"
    config.parent.mkdir(parents=True)

    config.write_text('on_edn = "typo"\n')
    mark = len(listener.fields())
    proc.send_signal(signal.SIGHUP)
    reloading = listener.wait(lambda f: f == "RELOADING=1", 30, "RELOADING=1", after=mark)
    listener.wait(lambda f: f == "READY=1", 30, "READY=1 after the failed reload", after=reloading)
    assert "unknown key on_edn" in daemon_log(tmp_path)

    ended = tmp_path / "ended.txt"
    config.write_text(f'on_end = "echo $CHAINRUN_STATE > {ended}"\n')
    (home / "service.log").rename(home / "service.log.1")  # as logrotate does
    mark = len(listener.fields())
    proc.send_signal(signal.SIGHUP)
    reloading = listener.wait(lambda f: f == "RELOADING=1", 30, "RELOADING=1", after=mark)
    assert any(f.startswith("MONOTONIC_USEC=") for _, f in listener.fields()[reloading:])
    listener.wait(lambda f: f == "READY=1", 30, "READY=1 after the reload", after=reloading)
    listener.wait(lambda f: f.startswith("STATUS=1 running"), 30, "ticks after the reload", after=reloading)
    assert proc.poll() is None

    wait_for(lambda: chain_json(chainrun, chain_id)["state"] != "active", 60, "the chain to end")
    st = chain_json(chainrun, chain_id)
    assert st["state"] == "completed" and st["failures"] == 0
    # The segment running across both reloads carried the run to its end; the
    # queued successor was cancelled unused, or (on a loaded machine) started
    # first and exited at once as skipped, charged nothing.
    first, second = st["segments"]
    assert (first["n"], first["outcome"]) == (1, "completed")
    assert second["outcome"] == "cancelled" or "skipped" in second["reason"], second
    assert not second["charged"]
    wait_for(ended.exists, 10, "the reloaded on_end hook")
    assert ended.read_text().strip() == "completed"
    reopened = (home / "service.log").read_text()
    assert "configuration reloaded" in reopened


def test_ticks_follow_the_config_interval_and_a_reload_changes_it(
    tmp_path: Path, daemon: Callable[..., subprocess.Popen[bytes]], listener: Listener
) -> None:
    """With no --interval, config.toml's interval paces the ticks; SIGHUP applies a new one."""
    config = tmp_path / "config" / "chainrun" / "config.toml"
    config.parent.mkdir(parents=True)
    config.write_text("interval = 0.25\n")
    proc = daemon(interval=None, NOTIFY_SOCKET=listener.name)
    listener.wait(lambda f: f == "READY=1", 60, "READY=1")

    def tick_gap(after: int) -> float:
        """The median time between ticks over the next 9 ticks (robust to a loaded machine)."""
        wait_for(lambda: len(ticks(after)) >= 9, 60, "nine ticks")
        at = ticks(after)[:9]
        return statistics.median(b - a for a, b in zip(at, at[1:]))

    def ticks(after: int) -> list[float]:
        return [t for t, f in listener.fields()[after:] if f.startswith("STATUS=0 running")]

    assert 0.2 <= tick_gap(len(listener.fields())) <= 0.6  # interval = 0.25
    config.write_text('interval = "1s"\n')
    mark = len(listener.fields())
    proc.send_signal(signal.SIGHUP)
    reloaded = listener.wait(lambda f: f == "READY=1", 30, "READY=1 after the reload", after=mark)
    assert 0.9 <= tick_gap(reloaded) <= 1.5  # interval = 1s


def test_the_next_tick_comes_as_soon_as_the_engine_asks_and_never_sooner_than_the_floor(
    in_process: Callable[..., InProcess],
) -> None:
    """A tick follows after min(interval, next_in), no sooner than 0.2 s: one clock, APScheduler's."""
    engine = FakeEngine([TickSummary(next_in=0.0), TickSummary(next_in=0.0), TickSummary(next_in=0.5)])
    with in_process(engine, interval=3600):
        wait_for(lambda: len(engine.ticks) >= 4, 60, "four ticks, each asked for before the hour")
        time.sleep(1.0)
        assert len(engine.ticks) == 4  # the fourth asked for nothing: the next one is an hour away
    gaps = [b - a for a, b in zip(engine.ticks, engine.ticks[1:])]
    assert min(gaps[:2]) >= service_module.MIN_DELAY - 0.01  # next_in = 0: the floor
    assert gaps[2] >= 0.5 - 0.01


def test_a_reload_with_a_shorter_interval_brings_the_next_tick_forward(
    tmp_path: Path, in_process: Callable[..., InProcess]
) -> None:
    """interval = 3600, then 0.3 after a reload: the tick due in an hour comes at once."""
    config = tmp_path / "config.toml"
    config.write_text("interval = 3600\n")
    engine = FakeEngine([])
    with in_process(engine, config_path=config) as running:
        wait_for(lambda: len(engine.ticks) >= 1, 60, "the first tick")
        config.write_text("interval = 0.3\n")
        running.service.reload()
        wait_for(lambda: len(engine.ticks) >= 4, 60, "ticks at the new interval")


class GatedEngine(FakeEngine):
    """A FakeEngine whose first tick waits for ``gate``."""

    def __init__(self) -> None:
        super().__init__([])
        self.gate = threading.Event()

    def tick(self, only: Optional[str] = None) -> TickSummary:
        summary = super().tick(only)
        if len(self.ticks) == 1:
            assert self.gate.wait(60)
        return summary


def test_a_ring_during_a_tick_brings_the_next_tick_right_after_it(
    home: Path, in_process: Callable[..., InProcess]
) -> None:
    """A tick that was running when the doorbell rang may have read the store before the chain
    the ring is for was stored: the next tick follows it at once, not an interval (here an
    hour) later."""
    engine = GatedEngine()
    with in_process(engine, interval=3600) as running:
        wait_for(lambda: len(engine.ticks) == 1, 60, "the first tick to start")
        assert doorbell.ring(home)
        wait_for(lambda: running.service._soon, 60, "the service to answer the ring")
        engine.gate.set()
        wait_for(lambda: len(engine.ticks) >= 2, 60, "the tick after the one the ring came during")
    assert not (home / doorbell.WAKE_FILE).exists()  # the socket's file goes with the service


# -- one service per home -------------------------------------------------------------


def test_deleting_every_file_beside_the_database_does_not_let_a_second_service_in(
    tmp_path: Path,
    home: Path,
    chainrun: Callable[..., subprocess.CompletedProcess[str]],
    daemon: Callable[..., subprocess.Popen[bytes]],
    listener: Listener,
) -> None:
    """The lock is the database's own: with service.lock, service.pid and the rest deleted, a
    second service is refused in one line, and only the first one ever submitted."""
    path = write_job(tmp_path, "sleep 60", extra="max_failures = 0\n")
    chain_id = chainrun("submit", str(path), check=True).stdout.strip()
    first = daemon(NOTIFY_SOCKET=listener.name)
    listener.wait(lambda f: f.startswith("STATUS=1 running"), 60, "the segment running")
    for p in home.iterdir():
        if p.is_file() and not p.name.startswith("chainrun.db"):
            p.unlink()
    second = daemon()
    assert exits(second, 60, "the second service to be refused") == 1
    out = daemon_log(tmp_path, 1).splitlines()
    assert len(out) == 1 and out[0].startswith(f"chainrun: another chainrun service is running for {home}"), (
        out
    )
    assert first.poll() is None
    assert [job["name"] for job in local_jobs(home)] == [f"cr.{chain_id}.1"]
    first.terminate()
    assert first.wait(30) == 0
    chainrun("cancel", chain_id, check=True)


def test_two_services_started_at_once_never_both_tick(
    tmp_path: Path,
    home: Path,
    chainrun: Callable[..., subprocess.CompletedProcess[str]],
    daemon: Callable[..., subprocess.Popen[bytes]],
) -> None:
    """Started together on one home: one runs, the other is refused; one job is submitted."""
    path = write_job(tmp_path, "sleep 60", extra="max_failures = 0\n")  # no successor queued ahead
    chain_id = chainrun("submit", str(path), check=True).stdout.strip()
    procs = [daemon(), daemon()]
    wait_for(lambda: any(p.poll() is not None for p in procs), 60, "one of the two to be refused")
    (refused,) = [n for n, p in enumerate(procs) if p.poll() is not None]
    running = procs[1 - refused]
    assert procs[refused].wait() == 1
    out = daemon_log(tmp_path, refused).splitlines()
    assert len(out) == 1 and out[0].startswith("chainrun: another chainrun service is running"), out
    wait_for(lambda: chain_json(chainrun, chain_id)["segments"][:1] != [], 60, "segment 1 submitted")
    wait_for(
        lambda: chain_json(chainrun, chain_id)["segments"][0]["phase"] == "running", 60, "segment 1 running"
    )
    assert [job["name"] for job in local_jobs(home)] == [f"cr.{chain_id}.1"]
    assert "service started" not in daemon_log(tmp_path, refused)
    assert running.poll() is None
    running.terminate()
    assert running.wait(30) == 0
    chainrun("cancel", chain_id, check=True)


def test_a_chain_submitted_to_a_running_service_is_queued_at_once_not_at_its_next_tick(
    tmp_path: Path,
    home: Path,
    chainrun: Callable[..., subprocess.CompletedProcess[str]],
    daemon: Callable[..., subprocess.Popen[bytes]],
) -> None:
    """`chainrun submit` rings the running service's doorbell: a service that ticks once an
    hour, its first tick done, queues a new chain's first segment now, not an hour later."""
    running = daemon(3600)
    wait_for(lambda: heartbeat.read(home) is not None, 60, "the service's first tick")
    chain_id = chainrun("submit", str(write_job(tmp_path, "sleep 60")), check=True).stdout.strip()
    wait_for(lambda: any(job for _, job, _ in segments(home)), 60, "segment 1 queued")
    assert [job["name"] for job in local_jobs(home)] == [f"cr.{chain_id}.1"]
    assert running.poll() is None
    chainrun("cancel", chain_id, check=True)


def test_a_ring_with_no_service_listening_is_lost_and_says_nothing(tmp_path: Path, home: Path) -> None:
    """No service (or one that could not listen): the ring finds no one, and nothing fails."""
    assert doorbell.ring(home) is False
    home.mkdir(parents=True, exist_ok=True)
    (home / doorbell.WAKE_FILE).write_text("a file left behind, not a socket")
    assert doorbell.ring(home) is False


@pytest.mark.parametrize("how", ["deleted", "replaced"])
def test_a_service_whose_database_is_deleted_or_replaced_stops_instead_of_ticking(
    how: str,
    tmp_path: Path,
    home: Path,
    chainrun: Callable[..., subprocess.CompletedProcess[str]],
    daemon: Callable[..., subprocess.Popen[bytes]],
    listener: Listener,
) -> None:
    """Its lock went with the old file, so a second service could start on the new one: it stops, exit 1."""
    path = write_job(tmp_path, "sleep 60", extra="max_failures = 0\n")
    chain_id = chainrun("submit", str(path), check=True).stdout.strip()
    first = daemon(NOTIFY_SOCKET=listener.name)
    listener.wait(lambda f: f.startswith("STATUS=1 running"), 60, "the segment running")
    db = home / "chainrun.db"
    if how == "deleted":
        db.unlink()
    else:  # restored from a backup taken a moment ago
        copy = home / "backup.db"
        source, target = sqlite3.connect(db), sqlite3.connect(copy)
        source.backup(target)
        source.close()
        target.close()
        os.replace(copy, db)
    assert exits(first, 60, "the service to stop") == 1
    out = daemon_log(tmp_path)
    assert "the state database is not the one this service locked" in out
    assert out.splitlines()[-1].startswith(f"chainrun: {db} was deleted or replaced"), out.splitlines()[-1]
    assert [job["name"] for job in local_jobs(home)] == [f"cr.{chain_id}.1"]
    if how == "replaced":
        # A new service takes the database that is there now and carries on with the chain.
        mark = len(listener.fields())
        daemon(NOTIFY_SOCKET=listener.name)
        listener.wait(lambda f: f == "READY=1", 60, "the new service ready", after=mark)
        listener.wait(lambda f: f.startswith("STATUS=1 running"), 60, "the same segment running", after=mark)
        assert [job["name"] for job in local_jobs(home)] == [f"cr.{chain_id}.1"]
    cancel_local_jobs(home)


# -- outages --------------------------------------------------------------------------


def test_an_outage_is_one_warning_and_the_service_keeps_reporting_pinging_and_retrying(
    home: Path, in_process: Callable[..., InProcess], listener: Listener, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The database unusable at start and at some ticks: one warning per outage, one when it ends;
    STATUS= and WATCHDOG=1 go on; READY=1 comes with the first tick that worked; nothing stops."""
    full = StoreUnavailable(
        f"the disk holding {home}/chainrun.db is full; free some space (chainrun retries)"
    )
    opens: list[BaseException] = [full]
    real_store = service_module.Store

    def store(path: Path) -> Store:
        if opens:
            raise opens.pop()
        return real_store(path)

    monkeypatch.setattr(service_module, "Store", store)
    ok = TickSummary(running=1)
    engine = FakeEngine([full, full, ok, full, full, ok, ok])
    with in_process(engine, interval=0.2) as running:
        wait_for(lambda: len(engine.ticks) >= 9, 60, "nine ticks")
    events = running.events()
    assert events.count("database unavailable; retrying every tick") == 2  # two outages
    assert events.count("database available again") == 2
    assert "tick failed" not in events
    fields = [f for _, f in listener.fields()]
    down = [
        i for i, f in enumerate(fields) if f.startswith("STATUS=database unavailable, retrying: the disk")
    ]
    ready = fields.index("READY=1")
    assert fields.count("READY=1") == 1
    assert down[0] < ready and fields[ready + 1] == "STATUS=1 running, 0 queued, 0 failed"
    assert "WATCHDOG=1" in fields[down[0] : ready]  # pings went on during the outage
    assert any(i > ready for i in down)  # the second outage, reported too


@pytest.mark.slow
def test_a_database_locked_at_start_is_waited_out_not_a_failed_start(
    tmp_path: Path,
    home: Path,
    chainrun: Callable[..., subprocess.CompletedProcess[str]],
    daemon: Callable[..., subprocess.Popen[bytes]],
    listener: Listener,
) -> None:
    """Another process holds the database's write lock for long: the service starts anyway,
    says so once, retries, and is READY once the lock is gone."""
    path = write_job(tmp_path, "sleep 60", extra="max_failures = 0\n")
    chain_id = chainrun("submit", str(path), check=True).stdout.strip()
    holder = sqlite3.connect(home / "chainrun.db", isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")
    try:
        proc = daemon(NOTIFY_SOCKET=listener.name, WATCHDOG_USEC="1000000")

        def outage_reported(after: int) -> int:
            found = [
                i
                for i, (_, f) in enumerate(listener.fields())
                if i >= after and f.startswith("STATUS=database unavailable") and "locked" in f
            ]
            assert proc.poll() is None, daemon_log(tmp_path)
            return found[0] if found else -1

        wait_for(lambda: outage_reported(0) >= 0, 90, "the outage reported")
        first = outage_reported(0)
        wait_for(lambda: outage_reported(first + 1) >= 0, 90, "a retry, reported too")
        assert "READY=1" not in [f for _, f in listener.fields()]
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    ready = listener.wait(lambda f: f == "READY=1", 90, "READY=1 once the lock is gone")
    assert "WATCHDOG=1" in [f for _, f in listener.fields()[first:ready]]
    listener.wait(lambda f: f.startswith("STATUS=1 running"), 60, "the segment running", after=ready)
    out = daemon_log(tmp_path)
    assert out.count("database unavailable; retrying every tick") == 1
    assert out.count("database available again") == 1
    proc.terminate()
    assert proc.wait(30) == 0
    chainrun("cancel", chain_id, check=True)


# -- cancel -----------------------------------------------------------------------------


def test_cancel_without_a_service_moves_only_the_chain_it_cancels(
    tmp_path: Path, home: Path, chainrun: Callable[..., subprocess.CompletedProcess[str]]
) -> None:
    """`chainrun cancel A` with no service running ends A and leaves B exactly as it was."""
    a = chainrun("submit", str(write_job(tmp_path, "sleep 60", name="a")), check=True).stdout.strip()
    b = chainrun("submit", str(write_job(tmp_path, "sleep 60", name="b")), check=True).stdout.strip()
    result = chainrun("cancel", a, check=True)
    assert result.stdout.strip() == f"chain {a} cancelled"
    assert chain_json(chainrun, a)["state"] == "cancelled"
    other = chain_json(chainrun, b)
    assert other["state"] == "active" and other["segments"] == []
    assert local_jobs(home) == []
    chainrun("cancel", b, check=True)


# -- bounded intervals ------------------------------------------------------------------


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "-1", "0", "0.1", "3601", "2h", "1e300", "soon", ""])
def test_a_bad_interval_on_the_command_line_is_one_line_and_exit_2(
    value: str, tmp_path: Path, home: Path, chainrun: Callable[..., subprocess.CompletedProcess[str]]
) -> None:
    """`daemon --interval` and `run --interval` take 0.2 s to 1 h; anything else is refused at once."""
    path = write_job(tmp_path, "sleep 1")
    for args in (["daemon", f"--interval={value}"], ["run", str(path), f"--interval={value}"]):
        result = chainrun(*args, timeout=60)
        lines = result.stderr.splitlines()
        assert result.returncode == 2, (args, result.stderr)
        assert len(lines) == 1 and lines[0].startswith(f"chainrun: --interval {value}: "), lines
        assert "0.2 to 3600 seconds" in lines[0] and result.stdout == ""
    assert not (home / "chainrun.db").exists()  # nothing started, nothing submitted


def test_a_bad_interval_in_the_config_stops_the_service_start_in_one_line(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    chainrun: Callable[..., subprocess.CompletedProcess[str]],
) -> None:
    """interval = nan in config.toml: `chainrun daemon` says so in one line, exit 2."""
    config = tmp_path / "config" / "chainrun" / "config.toml"
    config.parent.mkdir(parents=True)
    config.write_text("interval = nan\n")
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    result = chainrun("daemon", timeout=60)
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        f"chainrun: {config}: interval = nan: must be {service_config.INTERVAL_HELP}"
    ]


# -- logs ---------------------------------------------------------------------------


@pytest.fixture
def restore_logging() -> Iterator[None]:
    """Leave logging as it was for the tests that follow."""
    yield
    logsetup.reset()


def test_logs_are_json_lines_with_bound_context_off_a_terminal(restore_logging: None) -> None:
    """Not a TTY, not journald: one JSON object per line, chain/segment/job included."""
    out = io.StringIO()
    logsetup.setup("info", stream=out)
    structlog.get_logger("chainrun.test").bind(chain="c-1", segment=2).info("submitted", job="42")
    logging.getLogger("apscheduler.scheduler").warning("Run time of job was missed")
    lines = [json.loads(line) for line in out.getvalue().splitlines()]
    assert lines[0]["event"] == "submitted" and lines[0]["level"] == "info"
    assert (lines[0]["chain"], lines[0]["segment"], lines[0]["job"]) == ("c-1", 2, "42")
    assert lines[1]["event"] == "Run time of job was missed" and lines[1]["level"] == "warning"


def test_logs_under_journald_carry_the_syslog_priority_prefix(
    restore_logging: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With $JOURNAL_STREAM naming our stream, lines start <6>, <4>, <3> so journalctl -p works."""
    with open(tmp_path / "journal", "w+") as stream:
        st = os.fstat(stream.fileno())
        monkeypatch.setenv("JOURNAL_STREAM", f"{st.st_dev}:{st.st_ino}")
        logsetup.setup("debug", stream=stream)
        log = structlog.get_logger("chainrun.test")
        log.debug("d")
        log.info("i")
        log.warning("w", chain="c-1")
        try:
            raise RuntimeError("boom")
        except RuntimeError:
            log.exception("tick failed")
        stream.seek(0)
        lines = stream.read().splitlines()
    assert [line[:3] for line in lines] == ["<7>", "<6>", "<4>", "<3>"]
    assert json.loads(lines[2][3:])["chain"] == "c-1"
    assert "RuntimeError: boom" in json.loads(lines[3][3:])["exception"]


def test_journal_stream_of_another_file_does_not_add_prefixes(
    restore_logging: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A JOURNAL_STREAM inherited by a process whose stderr went elsewhere is ignored."""
    monkeypatch.setenv("JOURNAL_STREAM", "1:1")
    out = io.StringIO()
    logsetup.setup("info", stream=out)
    structlog.get_logger("chainrun.test").warning("w")
    assert out.getvalue().startswith("{")


def test_log_file_rotates_and_reopens(
    restore_logging: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """service.log rotates by size, and reopen_file starts a fresh file after an outside rename."""
    monkeypatch.setattr(logsetup, "MAX_BYTES", 2000)
    logsetup.setup("info", stream=io.StringIO())
    path = logsetup.open_file(tmp_path)
    log = structlog.get_logger("chainrun.test")
    for i in range(40):
        log.info("tick", n=i)
    assert (tmp_path / "service.log.1").exists()
    path.rename(tmp_path / "moved.log")
    logsetup.reopen_file()
    log.info("after reopen")
    assert json.loads(path.read_text().splitlines()[-1])["event"] == "after reopen"
