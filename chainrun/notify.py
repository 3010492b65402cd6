"""Tell someone when a chain ends: the ``on_end`` command and the webhook.

The engine calls a ``Notifier`` for every chain that reaches a final state.
It writes the end to an outbox under ``$CHAINRUN_HOME`` and hands it to one
background worker, so a slow hook never holds up a tick, and an end still
undelivered when the service stops goes out at its next start (at least
once). The command runs through the transport with ``bash -c`` in the
chain's workdir, the chain's end in its environment; the webhook is a JSON
POST with a timeout and a few tries, to http and https URLs only: a redirect
is followed (the JSON posted again) only to another http or https URL, and at
most ``MAX_REDIRECTS`` times. A hook that fails is logged and otherwise
ignored: it never touches the chain. The log names the webhook's host, never
its path (which often holds a secret token).
"""

from __future__ import annotations

import http.client
import json
import os
import queue
import string
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional
from urllib.parse import quote, urljoin, urlsplit

from chainrun.constants import VERSION
from chainrun.errors import TransportError
from chainrun.logsetup import get_logger
from chainrun.model import Chain
from chainrun.transport import LocalTransport, Transport

log = get_logger(__name__)

HOOK_TIMEOUT = 60.0
WEBHOOK_TIMEOUT = 10.0
WEBHOOK_TRIES = 3
WEBHOOK_SCHEMES = ("http", "https")
MAX_REDIRECTS = 5  # followed per try
REDIRECTS = (301, 302, 303, 307, 308)
OUTPUT_LIMIT = 4000  # characters of a hook's output kept in the log


@dataclass(frozen=True)
class Hooks:
    """Where ends go when the job file does not say: the service config's values."""

    on_end: Optional[str] = None
    webhook: Optional[str] = None


def _payload(event: str, chain: Chain, **fields: Any) -> dict[str, Any]:
    """A webhook's JSON body: the event, which chain, ``fields``, and where it runs."""
    spec = chain.spec
    about = {"event": event, "chain": chain.id, "name": spec.name, "state": chain.state.value}
    where = {"scheduler": spec.scheduler.kind, "host": spec.scheduler.host, "workdir": spec.workdir}
    return {**about, **fields, **where}


def end_payload(chain: Chain) -> dict[str, Any]:
    """The chain's end as the webhook's JSON body."""
    spec = chain.spec
    return _payload(
        "chain_ended",
        chain,
        reason=chain.reason,
        epoch=chain.latest.epoch,
        target_epoch=spec.target_epoch,
        failures=chain.failures,
        max_failures=spec.max_failures,
        segments=len(chain.segments),
        used_seconds=chain.used,
        ended_at=chain.ended_at,
    )


def problem_payload(chain: Chain, n: int, reason: str, change: str) -> dict[str, Any]:
    """A segment the scheduler keeps pending for a reason that will not clear by itself, as the
    webhook's JSON body."""
    job = next((s.job_id for s in chain.segments if s.n == n), None)
    return _payload("segment_will_not_start", chain, segment=n, job=job, reason=reason, change=change)


def warning_payload(chain: Chain, text: str) -> dict[str, Any]:
    """A warning about a chain that goes on (its segments barely train), as the webhook's JSON
    body."""
    return _payload("chain_warning", chain, warning=text, segments=len(chain.segments))


def hook_env(payload: dict[str, Any]) -> dict[str, str]:
    """The environment of the ``on_end`` command."""
    epoch = payload.get("epoch")
    target = payload.get("target_epoch")
    return {
        "CHAINRUN_CHAIN": str(payload["chain"]),
        "CHAINRUN_NAME": str(payload["name"]),
        "CHAINRUN_STATE": str(payload["state"]),
        "CHAINRUN_REASON": str(payload.get("reason") or ""),
        "CHAINRUN_EPOCH": "" if epoch is None else str(epoch),
        "CHAINRUN_TARGET_EPOCH": "" if target is None else str(target),
    }


def _cwd(chain: Chain) -> str:
    """Where the ``on_end`` command runs: the workdir of a remote chain is on the cluster, and
    the command runs here."""
    spec = chain.spec
    return spec.workdir if not spec.scheduler.remote else str(Path.home())


def redact(url: str) -> str:
    """``https://hooks.example.com/…``: webhook paths often hold a secret token."""
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.netloc.rpartition('@')[2]}/…"


class _Refused(Exception):
    """A webhook not sent, or a redirect not followed; asking again changes nothing."""


class _NoRedirects(urllib.request.HTTPRedirectHandler):
    """Hands every redirect back as an ``HTTPError``: ``_send`` decides which to follow.

    urllib's own handler would follow one to ``ftp://`` (and turn the POST into a GET)."""

    def http_error_302(self, req: urllib.request.Request, fp: Any, code: int, msg: str, headers: Any) -> None:
        return None

    http_error_301 = http_error_303 = http_error_307 = http_error_308 = http_error_302


def _web_scheme(url: str) -> bool:
    return urlsplit(url).scheme.lower() in WEBHOOK_SCHEMES


@dataclass(frozen=True)
class Delivery:
    """One end to deliver, as written to the outbox."""

    payload: dict[str, Any]
    on_end: Optional[str]
    webhook: Optional[str]
    cwd: str

    def to_json(self) -> dict[str, Any]:
        return {"payload": self.payload, "on_end": self.on_end, "webhook": self.webhook, "cwd": self.cwd}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Delivery:
        return cls(data["payload"], data.get("on_end"), data.get("webhook"), data["cwd"])


class Notifier:
    """The engine's ``on_end``: queues each end and delivers it in a worker thread."""

    def __init__(
        self,
        home: Path,
        defaults: Hooks = Hooks(),
        transport: Optional[Transport] = None,
        hook_timeout: float = HOOK_TIMEOUT,
        webhook_timeout: float = WEBHOOK_TIMEOUT,
        tries: int = WEBHOOK_TRIES,
        backoff: float = 1.0,
    ) -> None:
        self.outbox = Path(home) / "outbox"
        self.defaults = defaults  # replaced whole on a reload
        self.transport = transport or LocalTransport()
        self.hook_timeout = hook_timeout
        self.webhook_timeout = webhook_timeout
        self.tries = max(1, tries)
        self.backoff = backoff
        self._queue: queue.Queue[Optional[Path]] = queue.Queue()
        self._thread: Optional[threading.Thread] = None
        self._start_lock = threading.Lock()

    def __call__(self, chain: Chain) -> None:
        self._queue_one(chain.id, lambda: self.plan(chain))

    def problem(self, chain: Chain, n: int, reason: str, change: str) -> None:
        """Segment ``n``'s job is kept pending for a reason that will not clear by itself: to
        the webhook (the ``on_end`` command is for ends alone)."""
        self._to_webhook(chain, f"{chain.id}.{n}.problem", problem_payload(chain, n, reason, change))

    def warning(self, chain: Chain, text: str) -> None:
        """The chain's segments start up for most of their time (``decide.startup``): to the
        webhook."""
        self._to_webhook(chain, f"{chain.id}.warning", warning_payload(chain, text))

    def _to_webhook(self, chain: Chain, name: str, payload: dict[str, Any]) -> None:
        webhook = chain.spec.webhook or self.defaults.webhook
        if webhook:
            self._queue_one(name, lambda: Delivery(payload, None, webhook, _cwd(chain)))

    def _queue_one(self, name: str, make: Callable[[], Optional[Delivery]]) -> None:
        try:
            delivery = make()
            if delivery is None:
                return
            path = self._write(name, delivery)
        except Exception:  # a notification must never break the tick that asked for it
            log.exception("could not queue the notification", file=name)
            return
        self.start()
        self._queue.put(path)

    def plan(self, chain: Chain) -> Optional[Delivery]:
        """What to deliver for ``chain``: the job file's hooks win over the defaults."""
        spec = chain.spec
        defaults = self.defaults
        on_end = spec.on_end or defaults.on_end
        webhook = spec.webhook or defaults.webhook
        if not on_end and not webhook:
            return None
        return Delivery(end_payload(chain), on_end, webhook, _cwd(chain))

    def start(self, leftovers: bool = False) -> None:
        """Start the worker (once); ``leftovers`` also queues ends a previous run left undelivered."""
        with self._start_lock:
            if self._thread is not None:
                return
            if leftovers and self.outbox.is_dir():
                pending = sorted(self.outbox.glob("*.json"), key=lambda p: p.stat().st_mtime)
                for path in pending:
                    log.info("delivering an end left over from before the restart", file=path.name)
                    self._queue.put(path)
            self._thread = threading.Thread(target=self._work, name="chainrun-notify", daemon=True)
            self._thread.start()

    def close(self, timeout: float) -> bool:
        """Finish queued deliveries, waiting at most ``timeout`` s; True when all are done."""
        if self._thread is None:
            return True
        self._queue.put(None)
        self._thread.join(timeout)
        done = not self._thread.is_alive()
        if not done:
            log.warning(
                "end-of-chain notifications still running at exit; "
                "the undelivered ones go out at the next start",
                outbox=str(self.outbox),
            )
        return done

    def _write(self, name: str, delivery: Delivery) -> Path:
        self.outbox.mkdir(mode=0o700, parents=True, exist_ok=True)
        path = self.outbox / f"{name}.json"
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(json.dumps(delivery.to_json()))
        os.replace(tmp, path)
        return path

    def _work(self) -> None:
        while True:
            path = self._queue.get()
            if path is None:
                return
            try:
                delivery = Delivery.from_json(json.loads(path.read_text()))
            except FileNotFoundError:
                continue  # delivered already
            except (OSError, ValueError, KeyError, TypeError) as exc:
                log.warning("unreadable notification in the outbox; dropped", file=str(path), error=str(exc))
            else:
                self.deliver(delivery)
            path.unlink(missing_ok=True)

    def deliver(self, delivery: Delivery) -> None:
        """Run the command and post the webhook; failures are logged, never raised."""
        bound = log.bind(chain=delivery.payload.get("chain"), state=delivery.payload.get("state"))
        if delivery.on_end:
            try:
                self._run(delivery.on_end, delivery, bound)
            except Exception:
                bound.exception("on_end hook crashed; the chain is not affected")
        if delivery.webhook:
            try:
                self._post(delivery.webhook, delivery.payload, bound)
            except Exception:
                bound.exception("webhook crashed; the chain is not affected")

    def _run(self, command: str, delivery: Delivery, bound: Any) -> None:
        # The workdir comes in as $1 so that nothing of it is parsed as shell.
        script = 'cd -- "$1" || exit 1\nshift\n' + command
        argv = ["bash", "-c", script, "chainrun-on-end", delivery.cwd]
        try:
            result = self.transport.run(argv, timeout=self.hook_timeout, env=hook_env(delivery.payload))
        except TransportError as exc:
            bound.warning(
                "on_end hook did not finish; the chain is not affected", command=command, error=str(exc)
            )
            return
        fields = {
            "command": command,
            "exit_code": result.returncode,
            "stdout": result.stdout.strip()[-OUTPUT_LIMIT:],
            "stderr": result.stderr.strip()[-OUTPUT_LIMIT:],
        }
        if result.ok:
            bound.info("on_end hook ran", **fields)
        else:
            bound.warning("on_end hook failed; the chain is not affected", **fields)

    def _post(self, url: str, payload: dict[str, Any], bound: Any) -> None:
        body = json.dumps(payload).encode()
        error = ""
        attempt = 0
        for attempt in range(1, self.tries + 1):
            try:
                status = self._send(url, body)
                bound.info("webhook delivered", url=redact(url), status=status, attempt=attempt)
                return
            except _Refused as exc:
                error = str(exc)
                break
            except ValueError as exc:  # http.client.InvalidURL: its message quotes the path
                error = f"invalid URL ({type(exc).__name__})"
                break
            except urllib.error.HTTPError as exc:
                error = f"HTTP {exc.code} {exc.reason}"
                # A client error will not go away by asking again (but 408 and 429 may).
                if 400 <= exc.code < 500 and exc.code not in (408, 429):
                    break
            except (urllib.error.URLError, http.client.HTTPException, OSError) as exc:
                reason = exc.reason if isinstance(exc, urllib.error.URLError) else exc
                error = str(reason) or type(reason).__name__
            if attempt < self.tries:
                bound.info("webhook failed; retrying", url=redact(url), error=error, attempt=attempt)
                time.sleep(self.backoff * 2 ** (attempt - 1))
        bound.warning(
            "webhook failed; the chain is not affected", url=redact(url), error=error, attempts=attempt
        )

    def _send(self, url: str, body: bytes) -> int:
        """POST ``body`` to ``url``, following at most ``MAX_REDIRECTS`` redirects to http(s)
        URLs; the final status. Raises ``_Refused`` for any other scheme, urllib's errors else.

        A 301, 302, 307 or 308 posts the JSON again at the new URL (a GET there would
        deliver nothing); a 303 says the POST was handled, and is followed with a GET."""
        if not _web_scheme(url):
            raise _Refused(f"not an http or https URL: {redact(url)}")
        opener = urllib.request.build_opener(_NoRedirects)
        method: str = "POST"
        data: Optional[bytes] = body
        for _ in range(MAX_REDIRECTS + 1):
            headers = {"User-Agent": f"chainrun/{VERSION}"}
            if data is not None:
                headers["Content-Type"] = "application/json"
            request = urllib.request.Request(url, data=data, headers=headers, method=method)
            try:
                with opener.open(request, timeout=self.webhook_timeout) as response:
                    return int(response.status)
            except urllib.error.HTTPError as exc:
                location = exc.headers.get("Location") if exc.code in REDIRECTS and exc.headers else None
                if not location:
                    raise
                code = exc.code
                exc.close()
            # As urllib does: percent-encode what is not URL text, resolve against the current URL.
            target = urljoin(url, quote(location.strip(), encoding="iso-8859-1", safe=string.punctuation))
            if not _web_scheme(target):
                raise _Refused(f"redirect to {redact(target)} not followed: only http and https are")
            url = target
            if code == 303:
                method, data = "GET", None
        raise _Refused(f"more than {MAX_REDIRECTS} redirects")
