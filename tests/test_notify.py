"""End-of-chain notifications: the on_end command, the webhook, and their failures."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator, MutableMapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Callable, Optional

import pytest
from conftest import cli_env
from structlog.testing import capture_logs

from chainrun.model import Chain, ChainState, JobSpec, Progress, SchedulerSpec
from chainrun.notify import Delivery, Hooks, Notifier, end_payload

TRAINER = Path(__file__).parent / "data" / "trainer.py"
CLI = Callable[..., "subprocess.CompletedProcess[str]"]
PROXIES = ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY", "all_proxy", "ALL_PROXY")


class Server(ThreadingHTTPServer):
    """A loopback webhook receiver that answers with scripted status codes and redirects."""

    received: list[dict[str, Any]]
    statuses: list[int]
    redirects: dict[str, tuple[int, str]]  # path -> (status, Location)


class _Handler(BaseHTTPRequestHandler):
    server: Server

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        self._answer({"type": self.headers["Content-Type"], "body": json.loads(body)})

    def do_GET(self) -> None:
        self._answer({})

    def _answer(self, request: dict[str, Any]) -> None:
        self.server.received.append({"method": self.command, "path": self.path, **request})
        if self.path in self.server.redirects:
            status, location = self.server.redirects[self.path]
            self.send_response(status)
            self.send_header("Location", location)
        else:
            self.send_response(self.server.statuses.pop(0) if self.server.statuses else 200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def server(monkeypatch: pytest.MonkeyPatch) -> Iterator[Server]:
    """An HTTP server on 127.0.0.1 that records every POST."""
    for name in PROXIES:
        monkeypatch.delenv(name, raising=False)
    srv = Server(("127.0.0.1", 0), _Handler)
    srv.received, srv.statuses, srv.redirects = [], [], {}
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    yield srv
    srv.shutdown()
    srv.server_close()


def url(srv: Server, path: str = "/hook/SECRET-TOKEN") -> str:
    return f"http://127.0.0.1:{srv.server_address[1]}{path}"


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def listener() -> Iterator[socket.socket]:
    """A TCP port on 127.0.0.1 that listens and never answers: where an FTP client would connect."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(8)
        yield s


def connected(sock: socket.socket) -> bool:
    """Whether anyone connected to ``sock`` (the kernel queues a connection whether or not it is accepted)."""
    sock.setblocking(False)
    try:
        conn, _ = sock.accept()
    except BlockingIOError:
        return False
    conn.close()
    return True


def ended_chain(
    workdir: Path,
    state: ChainState = ChainState.COMPLETED,
    on_end: Optional[str] = None,
    webhook: Optional[str] = None,
    host: Optional[str] = None,
) -> Chain:
    spec = JobSpec(
        name="cifar",
        command="python train.py",
        workdir=str(workdir),
        total_time=7200,
        walltime=600,
        target_epoch=7,
        max_failures=3,
        checkpoint_dir=str(workdir / "checkpoints"),
        signal="USR1",
        grace=60,
        scheduler=SchedulerSpec(host=host),
        on_end=on_end,
        webhook=webhook,
    )
    return Chain(
        id="cifar-a1b2c3",
        spec=spec,
        state=state,
        created_at=0.0,
        failures=1,
        used=1800.0,
        latest=Progress(epoch=7),
        reason="target epoch 7 reached (epoch 7)",
        ended_at=1000.0,
    )


def notifier(tmp_path: Path, **kw: Any) -> Notifier:
    return Notifier(tmp_path / "home", backoff=0.0, **kw)


def events(logs: list[MutableMapping[str, Any]], level: Optional[str] = None) -> list[str]:
    return [e["event"] for e in logs if level is None or e["log_level"] == level]


# -- in process -------------------------------------------------------------------


def test_on_end_runs_in_the_workdir_with_the_chain_end_in_its_environment(tmp_path: Path) -> None:
    """The command sees CHAINRUN_CHAIN, _NAME, _STATE, _REASON, _EPOCH, from the chain's workdir."""
    work = tmp_path / "my work"
    work.mkdir()
    command = 'printf "%s|%s|%s|%s|%s|%s" "$CHAINRUN_CHAIN" "$CHAINRUN_NAME" "$CHAINRUN_STATE" "$CHAINRUN_REASON" "$CHAINRUN_EPOCH" "$PWD" > ended.txt; echo said-so'
    n = notifier(tmp_path)
    with capture_logs() as logs:
        n(ended_chain(work, on_end=command))
        assert n.close(10)
    assert (work / "ended.txt").read_text() == (
        f"cifar-a1b2c3|cifar|completed|target epoch 7 reached (epoch 7)|7|{work}"
    )
    ran = [e for e in logs if e["event"] == "on_end hook ran"]
    assert ran and ran[0]["stdout"] == "said-so" and ran[0]["chain"] == "cifar-a1b2c3"
    assert not list((tmp_path / "home" / "outbox").iterdir())


def test_failing_on_end_is_logged_with_its_output_and_never_raises(tmp_path: Path) -> None:
    """A hook exiting non-zero is a warning carrying exit code and stderr; the caller sees nothing."""
    n = notifier(tmp_path)
    with capture_logs() as logs:
        n(ended_chain(tmp_path, on_end="echo boom >&2; exit 3"))
        assert n.close(10)
    failed = [e for e in logs if e["event"] == "on_end hook failed; the chain is not affected"]
    assert failed and failed[0]["exit_code"] == 3 and failed[0]["stderr"] == "boom"
    assert failed[0]["log_level"] == "warning"


def test_on_end_that_hangs_is_killed_at_its_timeout(tmp_path: Path) -> None:
    """A hook past its timeout is killed and logged; the worker moves on."""
    n = notifier(tmp_path, hook_timeout=0.5)
    with capture_logs() as logs:
        n(ended_chain(tmp_path, on_end="sleep 30"))
        assert n.close(10)
    assert "on_end hook did not finish; the chain is not affected" in events(logs, "warning")


def test_webhook_posts_the_end_as_json(tmp_path: Path, server: Server) -> None:
    """One JSON POST with chain, name, state, reason and epoch; the token never reaches the log."""
    n = notifier(tmp_path)
    with capture_logs() as logs:
        n(ended_chain(tmp_path, state=ChainState.FAILED, webhook=url(server)))
        assert n.close(10)
    (got,) = server.received
    assert got["path"] == "/hook/SECRET-TOKEN" and got["type"] == "application/json"
    body = got["body"]
    assert (body["chain"], body["name"], body["state"], body["epoch"]) == (
        "cifar-a1b2c3",
        "cifar",
        "failed",
        7,
    )
    assert body["reason"] == "target epoch 7 reached (epoch 7)" and body["failures"] == 1
    assert "webhook delivered" in events(logs)
    assert "SECRET-TOKEN" not in json.dumps(logs)


def test_webhook_retries_server_errors_with_backoff_then_succeeds(tmp_path: Path, server: Server) -> None:
    """Two 503s then 200: three tries, delivered."""
    server.statuses = [503, 503]
    n = notifier(tmp_path)
    with capture_logs() as logs:
        n(ended_chain(tmp_path, webhook=url(server)))
        assert n.close(10)
    assert len(server.received) == 3
    assert "webhook delivered" in events(logs)


def test_webhook_gives_up_after_three_tries_and_logs_a_warning(tmp_path: Path, server: Server) -> None:
    """Always 500: exactly three tries, then one warning; nothing raised."""
    server.statuses = [500] * 10
    n = notifier(tmp_path)
    with capture_logs() as logs:
        n(ended_chain(tmp_path, webhook=url(server)))
        assert n.close(10)
    assert len(server.received) == 3
    (warning,) = [e for e in logs if e["log_level"] == "warning"]
    assert warning["event"] == "webhook failed; the chain is not affected"
    assert warning["error"] == "HTTP 500 Internal Server Error" and warning["attempts"] == 3


def test_webhook_client_error_is_not_retried(tmp_path: Path, server: Server) -> None:
    """A 404 will not go away by asking again: one try."""
    server.statuses = [404, 404, 404]
    n = notifier(tmp_path)
    with capture_logs():
        n(ended_chain(tmp_path, webhook=url(server)))
        assert n.close(10)
    assert len(server.received) == 1


def test_webhook_to_a_closed_port_is_logged_and_the_command_still_runs(tmp_path: Path) -> None:
    """Connection refused on every try is a warning; the on_end command runs regardless."""
    n = notifier(tmp_path)
    with capture_logs() as logs:
        n(ended_chain(tmp_path, on_end="touch ran", webhook=f"http://127.0.0.1:{closed_port()}/x"))
        assert n.close(10)
    assert (tmp_path / "ran").exists()
    assert "webhook failed; the chain is not affected" in events(logs, "warning")


def test_webhook_redirect_to_ftp_is_not_followed(
    tmp_path: Path, server: Server, listener: socket.socket
) -> None:
    """A 302 to ftp:// is a failed delivery, not an FTP connection; the log names hosts, never paths."""
    ftp = f"ftp://127.0.0.1:{listener.getsockname()[1]}/SECRET-FTP-PATH"
    server.redirects["/hook/SECRET-TOKEN"] = (302, ftp)
    n = notifier(tmp_path, webhook_timeout=2.0)
    with capture_logs() as logs:
        n(ended_chain(tmp_path, webhook=url(server)))
        assert n.close(30)
    assert not connected(listener), "the notifier followed the redirect to ftp://"
    assert [r["path"] for r in server.received] == ["/hook/SECRET-TOKEN"]  # refused: not retried
    (warning,) = [e for e in logs if e["log_level"] == "warning"]
    assert warning["event"] == "webhook failed; the chain is not affected"
    assert warning["error"] == (
        f"redirect to ftp://127.0.0.1:{listener.getsockname()[1]}/… not followed: only http and https are"
    )
    assert "SECRET" not in json.dumps(logs)


def test_webhook_redirect_to_a_file_url_is_not_followed(tmp_path: Path, server: Server) -> None:
    """A 302 to file:///etc/passwd: one warning with no path in it, one POST, nothing read."""
    server.redirects["/hook/SECRET-TOKEN"] = (302, "file:///etc/passwd")
    n = notifier(tmp_path)
    with capture_logs() as logs:
        n(ended_chain(tmp_path, webhook=url(server)))
        assert n.close(10)
    assert len(server.received) == 1
    (warning,) = [e for e in logs if e["log_level"] == "warning"]
    assert warning["event"] == "webhook failed; the chain is not affected"
    assert warning["error"] == "redirect to file:///… not followed: only http and https are"
    assert "passwd" not in json.dumps(logs) and "SECRET" not in json.dumps(logs)


@pytest.mark.parametrize("code", [301, 302, 307, 308])
def test_webhook_follows_a_redirect_to_http_posting_the_end_again(
    tmp_path: Path, server: Server, code: int
) -> None:
    """A redirect to another http URL is followed, and the JSON posted there (a GET would deliver nothing)."""
    server.redirects["/hook/SECRET-TOKEN"] = (code, url(server, "/moved/OTHER-TOKEN"))
    n = notifier(tmp_path)
    with capture_logs() as logs:
        n(ended_chain(tmp_path, webhook=url(server)))
        assert n.close(10)
    first, moved = server.received
    assert (first["method"], first["path"]) == ("POST", "/hook/SECRET-TOKEN")
    assert (moved["method"], moved["path"], moved["type"]) == (
        "POST",
        "/moved/OTHER-TOKEN",
        "application/json",
    )
    assert moved["body"]["chain"] == "cifar-a1b2c3" and moved["body"] == first["body"]
    assert "webhook delivered" in events(logs) and not events(logs, "warning")


def test_webhook_relative_303_is_followed_with_a_get(tmp_path: Path, server: Server) -> None:
    """303 See Other: the POST was taken; the answer is fetched with a GET, relative Location resolved."""
    server.redirects["/hook/SECRET-TOKEN"] = (303, "/done")
    n = notifier(tmp_path)
    with capture_logs() as logs:
        n(ended_chain(tmp_path, webhook=url(server)))
        assert n.close(10)
    assert [(r["method"], r["path"]) for r in server.received] == [
        ("POST", "/hook/SECRET-TOKEN"),
        ("GET", "/done"),
    ]
    assert "webhook delivered" in events(logs)


def test_webhook_redirect_loop_ends_after_a_few_hops(tmp_path: Path, server: Server) -> None:
    """A server that redirects forever gets 1 + MAX_REDIRECTS requests, then a warning; no retries."""
    from chainrun.notify import MAX_REDIRECTS

    server.redirects["/loop"] = (307, "/loop")
    n = notifier(tmp_path)
    with capture_logs() as logs:
        n(ended_chain(tmp_path, webhook=url(server, "/loop")))
        assert n.close(10)
    assert len(server.received) == 1 + MAX_REDIRECTS
    (warning,) = [e for e in logs if e["log_level"] == "warning"]
    assert warning["error"] == f"more than {MAX_REDIRECTS} redirects" and warning["attempts"] == 1


@pytest.mark.parametrize("scheme", ["ftp", "file"])
def test_webhook_that_is_not_http_is_never_sent(tmp_path: Path, listener: socket.socket, scheme: str) -> None:
    """An ftp:// or file:// webhook (an old outbox, a config that slipped by) is refused before any I/O."""
    secret = tmp_path / "SECRET-FILE"
    secret.write_text("not for a webhook\n")
    hook = f"ftp://127.0.0.1:{listener.getsockname()[1]}/SECRET" if scheme == "ftp" else f"file://{secret}"
    n = notifier(tmp_path, webhook_timeout=2.0)
    with capture_logs() as logs:
        n(ended_chain(tmp_path, on_end="touch ran", webhook=hook))
        assert n.close(30)
    assert not connected(listener)
    assert (tmp_path / "ran").exists()
    (warning,) = [e for e in logs if e["log_level"] == "warning"]
    assert warning["event"] == "webhook failed; the chain is not affected"
    assert warning["error"].startswith("not an http or https URL") and warning["attempts"] == 1
    assert "webhook delivered" not in events(logs) and "SECRET" not in json.dumps(logs)


def test_job_file_hooks_win_over_the_config_defaults(tmp_path: Path) -> None:
    """The job file's on_end/webhook replace the config's; each falls back on its own."""
    n = notifier(tmp_path, defaults=Hooks(on_end="config-cmd", webhook="http://config/"))
    own = n.plan(ended_chain(tmp_path, on_end="job-cmd"))
    assert own is not None and (own.on_end, own.webhook) == ("job-cmd", "http://config/")
    fallback = n.plan(ended_chain(tmp_path))
    assert fallback is not None and (fallback.on_end, fallback.webhook) == ("config-cmd", "http://config/")
    assert notifier(tmp_path).plan(ended_chain(tmp_path)) is None


def test_remote_chain_hook_runs_in_the_home_directory(tmp_path: Path) -> None:
    """A chain on a cluster has its workdir there; its on_end runs here, in $HOME."""
    plan = notifier(tmp_path).plan(ended_chain(Path("/scratch/u/run"), on_end="x", host="cluster"))
    assert plan is not None and plan.cwd == str(Path.home())


def test_end_left_in_the_outbox_is_delivered_at_the_next_start(tmp_path: Path) -> None:
    """An end queued when the service stopped goes out when the next one starts."""
    home = tmp_path / "home"
    (home / "outbox").mkdir(parents=True)
    delivery = Delivery(end_payload(ended_chain(tmp_path)), "touch delivered", None, str(tmp_path))
    (home / "outbox" / "cifar-a1b2c3.json").write_text(json.dumps(delivery.to_json()))
    n = Notifier(home)
    with capture_logs():
        n.start(leftovers=True)
        assert n.close(10)
    assert (tmp_path / "delivered").exists()
    assert not (home / "outbox" / "cifar-a1b2c3.json").exists()


def test_close_returns_within_its_bound_while_a_hook_still_runs(tmp_path: Path) -> None:
    """The service's exit waits for hooks at most as long as told; the end stays in the outbox."""
    n = notifier(tmp_path, hook_timeout=30)
    with capture_logs() as logs:
        n(ended_chain(tmp_path, on_end="sleep 5"))
        assert n.close(0.5) is False
    assert (tmp_path / "home" / "outbox" / "cifar-a1b2c3.json").exists()
    assert any("still running at exit" in e for e in events(logs, "warning"))


# -- through the CLI --------------------------------------------------------------


def write_job(tmp_path: Path, extra: str, epochs: int = 2) -> Path:
    work = tmp_path / "work"
    work.mkdir(exist_ok=True)
    shutil.copy(TRAINER, work / "trainer.py")
    path = work / "job.toml"
    path.write_text(
        f'name = "t"\ncommand = "python3 trainer.py --epochs {epochs} --epoch-time 0.3"\n'
        f'total_time = "5m"\nwalltime = "1m"\ngrace = "2s"\ntarget_epoch = {epochs}\n{extra}'
    )
    return path


def run_cli(home: Path, tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = cli_env(home)
    env["XDG_CONFIG_HOME"] = str(tmp_path / "config")
    for name in PROXIES:
        env.pop(name, None)
    return subprocess.run(
        [sys.executable, "-m", "chainrun", *args], capture_output=True, text=True, env=env, timeout=120
    )


def test_chain_end_reaches_on_end_command_and_webhook(tmp_path: Path, home: Path, server: Server) -> None:
    """`chainrun run` to completion: the command and the local webhook both get the end before it exits."""
    path = write_job(
        tmp_path,
        'on_end = "echo $CHAINRUN_NAME $CHAINRUN_STATE $CHAINRUN_EPOCH > ended.txt"\n'
        f'webhook = "{url(server)}"\n',
    )
    result = run_cli(home, tmp_path, "run", str(path), "--interval", "0.2")
    assert result.returncode == 0, result.stdout + result.stderr
    assert (path.parent / "ended.txt").read_text() == "t completed 2\n"
    (got,) = server.received
    assert got["body"]["state"] == "completed" and got["body"]["epoch"] == 2


def test_failing_hooks_are_logged_and_the_chain_completes_anyway(tmp_path: Path, home: Path) -> None:
    """A crashing command and an unreachable webhook leave a completed chain and two warnings."""
    path = write_job(
        tmp_path, f'on_end = "echo boom >&2; exit 7"\nwebhook = "http://127.0.0.1:{closed_port()}/x"\n'
    )
    result = run_cli(home, tmp_path, "run", str(path), "--interval", "0.2")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "chain t-" in result.stdout and "completed" in result.stdout
    warnings = [json.loads(line) for line in result.stderr.splitlines() if line.startswith("{")]
    hook = [w for w in warnings if w["event"] == "on_end hook failed; the chain is not affected"]
    assert hook and hook[0]["exit_code"] == 7 and hook[0]["stderr"] == "boom"
    assert any(w["event"] == "webhook failed; the chain is not affected" for w in warnings)
    assert "Traceback" not in result.stderr


def test_config_on_end_applies_to_a_chain_cancelled_without_a_service(tmp_path: Path, home: Path) -> None:
    """`chainrun cancel` with no service delivers the end itself, using the config's on_end."""
    config = tmp_path / "config" / "chainrun" / "config.toml"
    config.parent.mkdir(parents=True)
    config.write_text(f'on_end = "echo $CHAINRUN_STATE > {tmp_path}/ended.txt"\n')
    path = write_job(tmp_path, "", epochs=50)
    chain_id = run_cli(home, tmp_path, "submit", str(path)).stdout.strip()
    result = run_cli(home, tmp_path, "cancel", chain_id)
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "ended.txt").read_text() == "cancelled\n"


def test_broken_config_stops_the_service_from_starting_with_one_line(tmp_path: Path, home: Path) -> None:
    """A typo in config.toml is a one-line error and exit 2 at start, not a service without hooks."""
    config = tmp_path / "config" / "chainrun" / "config.toml"
    config.parent.mkdir(parents=True)
    config.write_text('webhok = "http://x/"\n')
    result = run_cli(home, tmp_path, "daemon")
    assert result.returncode == 2
    assert (
        result.stderr.strip()
        == f"chainrun: {config}: unknown key webhok; did you mean webhook? Allowed here: on_end, webhook, interval, gc_after"
    )
    assert not os.path.exists(home / "service.status")


def test_broken_config_does_not_stop_a_cancel(tmp_path: Path, home: Path) -> None:
    """`chainrun cancel` with a broken config warns about it and cancels all the same."""
    config = tmp_path / "config" / "chainrun" / "config.toml"
    config.parent.mkdir(parents=True)
    config.write_text("on_end = 3\n")
    chain_id = run_cli(home, tmp_path, "submit", str(write_job(tmp_path, "", epochs=50))).stdout.strip()
    result = run_cli(home, tmp_path, "cancel", chain_id)
    assert result.returncode == 0 and f"chain {chain_id} cancelled" in result.stdout
    assert "on_end = 3: expected a shell command" in result.stderr
