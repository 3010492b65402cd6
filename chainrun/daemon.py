"""The service: APScheduler ticks the engine until told to stop.

One service per ``CHAINRUN_HOME`` (a file lock). Ticks run one at a time in
APScheduler's worker thread; the main thread only waits for signals, which
reach it through a wakeup socket, so all work happens outside signal
handlers. SIGTERM and SIGINT stop the service: queued jobs keep running in
the scheduler and are picked up on the next start. SIGHUP re-reads the
service config and re-opens the log file without stopping the ticks.

Under systemd (``Type=notify``) the service reports READY=1 once the first
tick has loaded every chain and adopted any interrupted submission, STATUS=
after each tick, RELOADING=1/READY=1 around a reload and STOPPING=1 on the
way out. WATCHDOG=1 is sent by the tick loop itself, at half the watchdog
timeout, so a tick that hangs stops the pings and systemd restarts the
service.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import os
import signal
import socket
import threading
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Optional

import filelock
import structlog
from apscheduler.executors.pool import ThreadPoolExecutor
from apscheduler.schedulers.background import BackgroundScheduler

from chainrun import logs
from chainrun.engine import Engine, TickSummary
from chainrun.errors import AlreadyRunning, ChainrunError
from chainrun.notify import Hooks, Notifier
from chainrun.service import SdNotify, ServiceConfig, load_config
from chainrun.store import Store, private_dir

log = structlog.get_logger(__name__)

DEFAULT_INTERVAL = 10.0
STOP_WAIT = 15.0  # seconds a tick in flight gets to finish on stop
NOTIFY_WAIT = 10.0  # seconds queued end-of-chain notifications get on stop
STATUS_FILE = "service.status"
_WAKE = b"\0"  # written by stop() from a tick; signals arrive as their numbers


class InstanceLock:
    """Holds the single-instance lock of a CHAINRUN_HOME while open."""

    def __init__(self, home: Path) -> None:
        private_dir(Path(home))  # before filelock, which would make it with the umask's mode
        self.path = Path(home) / "service.lock"
        self.pidfile = Path(home) / "service.pid"
        self.lock = filelock.FileLock(str(self.path), timeout=0)

    def acquire(self) -> None:
        try:
            self.lock.acquire()
        except filelock.Timeout:
            raise AlreadyRunning(
                f"another chainrun service is running for {self.path.parent}"
                f" (pid {self.holder() or '?'}); use `chainrun status`, or stop it first"
            ) from None
        self.pidfile.write_text(f"{os.getpid()}\n")

    def held_elsewhere(self) -> bool:
        """True when another process holds the lock (a service is running)."""
        try:
            self.lock.acquire()
        except filelock.Timeout:
            return True
        self.lock.release()
        return False

    def holder(self) -> Optional[int]:
        try:
            return int(self.pidfile.read_text().strip())
        except (OSError, ValueError):
            return None

    def release(self) -> None:
        if self.lock.is_locked:
            self.lock.release()


def read_status(home: Path) -> Optional[dict[str, Any]]:
    """What the running service last said about itself (pid, time, summary), if anything."""
    try:
        data = json.loads((Path(home) / STATUS_FILE).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


class Service:
    """Ticks the engine every ``interval`` seconds until stopped."""

    def __init__(
        self,
        home: Path,
        interval: Optional[float] = None,
        on_tick: Optional[Callable[[TickSummary], None]] = None,
        stop_when: Optional[Callable[[], bool]] = None,
        config_path: Optional[Path] = None,
        notify: Optional[SdNotify] = None,
    ) -> None:
        self.home = Path(home)
        self.fixed_interval = interval  # from the command line: wins over the config
        self.on_tick = on_tick
        self.stop_when = stop_when
        self.config_path = config_path
        self.config = load_config(config_path)  # a broken config stops the start, loudly
        self.sd = notify or SdNotify.from_environ()
        self.stopping = threading.Event()
        self.idle = threading.Event()
        self.idle.set()
        self.ready = False
        self.status_line = "starting"
        self._due = 0.0  # monotonic time of the next engine tick
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_w.setblocking(False)
        self.scheduler = BackgroundScheduler(
            executors={"default": ThreadPoolExecutor(1)}, timezone=timezone.utc
        )

    @property
    def interval(self) -> float:
        return self.fixed_interval or self.config.interval or DEFAULT_INTERVAL

    @property
    def step(self) -> float:
        """How often the tick loop runs: the interval, or more often to feed the watchdog."""
        period = self.sd.watchdog_period
        return min(self.interval, period) if period else self.interval

    def run(self) -> None:
        lock = InstanceLock(self.home)
        lock.acquire()
        restore = self._catch_signals()
        store: Optional[Store] = None
        notifier: Optional[Notifier] = None
        try:
            logs.open_file(self.home)
            store = Store(self.home)
            notifier = Notifier(self.home, self._hooks(self.config))
            notifier.start(leftovers=True)
            self.notifier = notifier
            self.engine = Engine(store, on_end=notifier)
            self.scheduler.add_job(
                self._tick,
                "interval",
                seconds=self.step,
                next_run_time=datetime.now(timezone.utc),
                max_instances=1,
                coalesce=True,
                id="tick",
                misfire_grace_time=None,
            )
            log.info(
                "service started",
                home=str(self.home),
                interval=self.interval,
                watchdog=self.sd.watchdog_period,
                config=self.config.path,
            )
            self.scheduler.start()
            self._wait_for_signals()
        finally:
            self.stopping.set()
            self.sd.send("STOPPING=1", "STATUS=stopping")
            if self.scheduler.running:
                self.scheduler.shutdown(wait=False)
            hung = not self.idle.wait(STOP_WAIT)
            if notifier is not None:
                notifier.close(NOTIFY_WAIT)
            restore()
            if hung:
                # Closing the store under a tick that still uses it would be worse
                # than leaving: every step is journaled and resumes at the next start.
                log.error("a tick did not finish; exiting without it", waited=STOP_WAIT)
                logs.flush()
                os._exit(1)
            if store is not None:
                store.close()
            (self.home / STATUS_FILE).unlink(missing_ok=True)
            lock.release()
            self.sd.close()
            self._wake_r.close()
            self._wake_w.close()
            log.info("service stopped")
            logs.close_file()

    def stop(self) -> None:
        """Ask the service to stop; safe from a tick and from any thread."""
        if not self.stopping.is_set():
            self.stopping.set()
            with contextlib.suppress(OSError):  # the buffer is full of wake-ups already
                self._wake_w.send(_WAKE)

    def reload(self) -> None:
        """Re-read the service config and re-open the log file; the ticks go on."""
        self.sd.send("RELOADING=1", f"MONOTONIC_USEC={time.monotonic_ns() // 1000}", "STATUS=reloading")
        logs.reopen_file()
        try:
            config = load_config(self.config_path)
        except ChainrunError as exc:
            log.error("configuration not reloaded; keeping the previous one", error=str(exc))
        else:
            old_step = self.step
            self.config = config
            self.notifier.defaults = self._hooks(config)
            if self.step != old_step:
                self.scheduler.reschedule_job("tick", trigger="interval", seconds=self.step)
            self._due = min(self._due, time.monotonic() + self.interval)
            log.info("configuration reloaded", config=config.path, interval=self.interval)
        self.sd.send("READY=1", f"STATUS={self.status_line}")

    # -- signals ------------------------------------------------------------------

    def _catch_signals(self) -> Callable[[], None]:
        """Route SIGTERM, SIGINT and SIGHUP to the wakeup socket; returns the undo."""
        if threading.current_thread() is not threading.main_thread():
            return lambda: None
        faulthandler.enable()  # a watchdog's SIGABRT leaves every thread's traceback in the log
        previous_fd = signal.set_wakeup_fd(self._wake_w.fileno(), warn_on_full_buffer=False)
        previous = {
            s: signal.signal(s, lambda signum, frame: None)
            for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
        }

        def restore() -> None:
            for s, handler in previous.items():
                signal.signal(s, handler)
            signal.set_wakeup_fd(previous_fd)

        return restore

    def _wait_for_signals(self) -> None:
        while not self.stopping.is_set():
            data = self._wake_r.recv(64)
            for number in data:
                if number in (signal.SIGTERM, signal.SIGINT):
                    log.info("stopping", signal=signal.Signals(number).name)
                    self.stopping.set()
                elif number == signal.SIGHUP and not self.stopping.is_set():
                    log.info("reloading", signal="SIGHUP")
                    self.reload()

    # -- the tick loop ------------------------------------------------------------

    def _tick(self) -> None:
        self.idle.clear()  # before the check: stop() waits for idle after setting stopping
        try:
            if self.stopping.is_set():
                return
            now = time.monotonic()
            # Half a step of slack: the loop's own jitter must not skip a whole step.
            if now + self.step / 2 >= self._due:
                self._due = now + self.interval
                self._engine_tick()
            # From the loop, not a timer: a tick that hangs stops the pings.
            if self.sd.watchdog_period:
                self.sd.send("WATCHDOG=1")
        finally:
            self.idle.set()

    def _engine_tick(self) -> None:
        try:
            summary: Optional[TickSummary] = self.engine.tick()
        except Exception:  # a bug must not kill the service; the next tick retries
            log.exception("tick failed")
            summary = None
        if summary is not None:
            self.status_line = summary.line()
            self._write_status()
        fields = [f"STATUS={self.status_line}"]
        if not self.ready:
            self.ready = True
            fields.insert(0, "READY=1")
            log.info("service ready", status=self.status_line)
        self.sd.send(*fields)
        if summary is not None and self.on_tick is not None:
            self.on_tick(summary)
        if self.stop_when is not None and self.stop_when():
            self.stop()

    def _write_status(self) -> None:
        path = self.home / STATUS_FILE
        tmp = path.with_name(f".{STATUS_FILE}.tmp")
        try:
            tmp.write_text(json.dumps({"pid": os.getpid(), "at": time.time(), "status": self.status_line}))
            os.replace(tmp, path)
        except OSError as exc:
            log.warning("cannot write the service status file", path=str(path), error=str(exc))

    @staticmethod
    def _hooks(config: ServiceConfig) -> Hooks:
        return Hooks(on_end=config.on_end, webhook=config.webhook)
