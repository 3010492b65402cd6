"""The service: APScheduler ticks the engine until told to stop.

One service per ``CHAINRUN_HOME`` (``lock``): before every tick it checks
that the database it locked is still the one at that path; a service whose
database was deleted or replaced stops, so two services never tick the same
chains.

APScheduler is the only clock. Each tick is a one-off job that, when done,
schedules the next one an interval later, or sooner when the engine asks
(a submission's backoff that ends before the interval). Ticks run one at a
time in APScheduler's single worker thread; the main thread only waits for
signals, which reach it through a wakeup socket, so all work happens outside
signal handlers. SIGTERM and SIGINT stop the service: queued jobs keep
running in the scheduler and are picked up on the next start. (With an
``on_interrupt``, a SIGINT first asks it, in the main thread while the ticks
go on, whether to stop: ``chainrun run``'s prompt.) SIGHUP re-reads the
service config and re-opens the log file without stopping the ticks. At start and
once a day, the code snapshots of chains that ended long ago are removed (``chainrun.gc``).

A database that cannot be used for a while (its disk full, read-only, or
locked by another process) is an outage, not a failure: it is logged when
it begins and when it ends, every tick retries, and the service goes on
reporting to systemd.

Under systemd (``Type=notify``) the service reports READY=1 once the first
tick has loaded every chain and adopted any interrupted submission, STATUS=
after each tick, RELOADING=1/READY=1 around a reload and STOPPING=1 on the
way out. WATCHDOG=1 comes from a job of its own at half the watchdog
timeout, in the same single worker thread as the ticks, so a tick that hangs
stops the pings and systemd restarts the service.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import select
import signal
import socket
import threading
import time
from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any, Optional

from chainrun import gc, heartbeat, logsetup
from chainrun.config import MIN_INTERVAL, ServiceConfig, load_config
from chainrun.constants import DEFAULT_INTERVAL
from chainrun.doorbell import Doorbell
from chainrun.engine import Engine, TickSummary
from chainrun.errors import ChainrunError, StoreUnavailable
from chainrun.lock import InstanceLock, LockLost
from chainrun.notify import Hooks, Notifier
from chainrun.sdnotify import SdNotify
from chainrun.store import Store

log = logsetup.get_logger(__name__)

MIN_DELAY = MIN_INTERVAL  # the soonest a tick may follow the previous one, whatever the engine asks
STOP_WAIT = 15.0  # seconds a tick in flight gets to finish on stop
NOTIFY_WAIT = 10.0  # seconds queued end-of-chain notifications get on stop
_WAKE = b"\0"  # written by stop() from a tick; signals arrive as their numbers


def _job_lookup_error() -> type[Exception]:
    """APScheduler's "no such job", imported where a service runs."""
    from apscheduler.jobstores.base import JobLookupError

    return JobLookupError  # type: ignore[no-any-return]


class Service:
    """Ticks the engine every ``interval`` seconds, or sooner when it asks, until stopped."""

    def __init__(
        self,
        home: Path,
        interval: Optional[float] = None,
        on_tick: Optional[Callable[[TickSummary], None]] = None,
        stop_when: Optional[Callable[[], bool]] = None,
        config_path: Optional[Path] = None,
        notify: Optional[SdNotify] = None,
        on_interrupt: Optional[Callable[[], bool]] = None,
    ) -> None:
        self.home = Path(home)
        self.fixed_interval = interval  # from the command line: wins over the config
        self.on_tick = on_tick
        self.stop_when = stop_when
        # Asked in the main thread on SIGINT, while the ticks go on: True stops the
        # service; False keeps it, and the next tick comes at once (`run`'s prompt).
        self.on_interrupt = on_interrupt
        self.config_path = config_path
        self.config = load_config(config_path)  # a broken config stops the start, loudly
        self.sd = notify or SdNotify.from_environ()
        self.lock = InstanceLock(self.home)
        self.store: Optional[Store] = None
        self.engine: Optional[Engine] = None
        self.notifier: Optional[Notifier] = None
        self.stopping = threading.Event()
        self.idle = threading.Event()
        self.idle.set()
        self.ready = False
        self.status_line = "starting"
        self.hosts: dict[str, Any] = {}  # the pools' hosts as the last tick found them
        self.failure: Optional[ChainrunError] = None  # why the service stopped by itself
        self.outage_since: Optional[float] = None  # monotonic time the database became unusable
        self._status_failed = False
        self._clock = threading.Lock()  # a tick scheduling the next one, against a reload
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_w.setblocking(False)
        self.doorbell = Doorbell(self.home)  # rung by `chainrun submit`: a tick at once
        self._soon = False  # rung while a tick ran: the next one follows it at once
        # APScheduler (a tenth of a second to import) only for a service that runs.
        from apscheduler.executors.pool import ThreadPoolExecutor
        from apscheduler.schedulers.background import BackgroundScheduler

        logsetup.configure_now()  # its log records go where chainrun's go
        self.scheduler = BackgroundScheduler(
            executors={"default": ThreadPoolExecutor(1)}, timezone=timezone.utc
        )

    @property
    def interval(self) -> float:
        return self.fixed_interval or self.config.interval or DEFAULT_INTERVAL

    def run(self) -> None:
        self.lock.acquire()
        restore = self._catch_signals()
        try:
            try:
                logsetup.open_file(self.home)
            except OSError as exc:  # a read-only or full home: log to stderr alone
                log.warning("cannot open the log file; logging to stderr only", error=str(exc))
            why = self.doorbell.open()
            if why is not None:
                log.info("no doorbell: a chain submitted waits for the next tick", reason=why)
            self.notifier = Notifier(self.home, self._hooks(self.config))
            self.notifier.start(leftovers=True)
            try:
                self._engine()
            except StoreUnavailable as exc:  # the ticks retry
                self._outage(exc)
                self.sd.send(f"STATUS={self.status_line}")
            self._schedule_tick(None, delay=0.0)
            period = self.sd.watchdog_period
            if period:
                # In the ticks' single thread: while a tick hangs, no ping goes out.
                self.scheduler.add_job(
                    self._ping,
                    "interval",
                    seconds=period,
                    next_run_time=datetime.now(timezone.utc),
                    max_instances=1,
                    coalesce=True,
                    id="watchdog",
                    misfire_grace_time=None,
                )
            self.scheduler.add_job(  # in the ticks' thread too: the store is theirs
                self._collect,
                "interval",
                seconds=gc.EVERY,
                next_run_time=datetime.now(timezone.utc),
                max_instances=1,
                coalesce=True,
                id="gc",
                misfire_grace_time=None,
            )
            log.info(
                "service started",
                home=str(self.home),
                interval=self.interval,
                watchdog=period,
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
            if self.notifier is not None:
                self.notifier.close(NOTIFY_WAIT)
            restore()
            if hung:
                # Closing the store under a tick that still uses it would be worse
                # than leaving: every step is journaled and resumes at the next start.
                log.error("a tick did not finish; exiting without it", waited=STOP_WAIT)
                logsetup.flush()
                os._exit(1)
            if self.store is not None:
                self.store.close()
            if not isinstance(self.failure, LockLost):  # else the home may be another service's now
                with contextlib.suppress(OSError):  # a full disk: the pid left names a dead process
                    heartbeat.stopped(self.home)
            self.lock.release()
            self.sd.close()
            self.doorbell.close(mine=not isinstance(self.failure, LockLost))
            self._wake_r.close()
            self._wake_w.close()
            log.info("service stopped")
            logsetup.close_file()
        if self.failure is not None:
            raise self.failure

    def stop(self) -> None:
        """Ask the service to stop; safe from a tick and from any thread."""
        if not self.stopping.is_set():
            self.stopping.set()
            with contextlib.suppress(OSError):  # the buffer is full of wake-ups already
                self._wake_w.send(_WAKE)

    def reload(self) -> None:
        """Re-read the service config and re-open the log file; the ticks go on."""
        self.sd.send("RELOADING=1", f"MONOTONIC_USEC={time.monotonic_ns() // 1000}", "STATUS=reloading")
        logsetup.reopen_file()
        try:
            config = load_config(self.config_path)
        except ChainrunError as exc:
            log.error("configuration not reloaded; keeping the previous one", error=str(exc))
        else:
            with self._clock:
                self.config = config
                if self.notifier is not None:
                    self.notifier.defaults = self._hooks(config)
                # A shorter interval brings the next tick forward; a tick running now
                # schedules its successor with the new interval when it ends.
                job = self.scheduler.get_job("tick")
                sooner = datetime.now(timezone.utc) + timedelta(seconds=self.interval)
                if job is not None and job.next_run_time is not None and sooner < job.next_run_time:
                    with contextlib.suppress(_job_lookup_error()):  # it has just started: see above
                        job.modify(next_run_time=sooner)
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
        bell = [self.doorbell.sock] if self.doorbell.sock is not None else []
        while not self.stopping.is_set():
            ready, _, _ = select.select([self._wake_r, *bell], [], [])
            if bell and bell[0] in ready:
                self.doorbell.answer()
                self.tick_now()
            data = self._wake_r.recv(64) if self._wake_r in ready else b""
            for number in data:
                if number == signal.SIGINT and self._interrupt_kept():
                    continue
                if number in (signal.SIGTERM, signal.SIGINT):
                    log.info("stopping", signal=signal.Signals(number).name)
                    self.stopping.set()
                elif number == signal.SIGHUP and not self.stopping.is_set():
                    log.info("reloading", signal="SIGHUP")
                    self.reload()

    def _interrupt_kept(self) -> bool:
        """Whether ``on_interrupt`` keeps the service running after a SIGINT; if so, tick at once."""
        if self.on_interrupt is None or self.stopping.is_set() or self.on_interrupt():
            return False
        self.tick_now()
        return True

    def tick_now(self) -> None:
        """Bring the next tick forward to now; a tick running now, which may have read the
        store before what it is woken for, is followed at once by the next. Safe from any thread."""
        with self._clock:
            job = self.scheduler.get_job("tick")
            if job is None:
                self._soon = True
                return
            try:
                job.modify(next_run_time=datetime.now(timezone.utc))
            except _job_lookup_error():  # it has just started
                self._soon = True

    # -- the ticks ----------------------------------------------------------------

    def _schedule_tick(self, wanted: Optional[float], delay: Optional[float] = None) -> None:
        """Schedule the next tick: after ``delay``, else after the interval or what the engine wants."""
        try:
            with self._clock:
                if delay is None:
                    delay = max(MIN_DELAY, min(self.interval, self.interval if wanted is None else wanted))
                    delay, self._soon = (MIN_DELAY if self._soon else delay), False
                self.scheduler.add_job(
                    self._tick,
                    "date",
                    run_date=datetime.now(timezone.utc) + timedelta(seconds=delay),
                    id="tick",
                    replace_existing=True,
                    max_instances=1,
                    misfire_grace_time=None,  # late is better than never
                )
        except Exception as exc:  # no next tick: stop, loudly, rather than ping on while idle
            log.exception("cannot schedule the next tick; stopping")
            self.failure = ChainrunError(f"cannot schedule the next tick: {exc}")
            self.stop()

    def _tick(self) -> None:
        self.idle.clear()  # before the check: stop() waits for idle after setting stopping
        again, wanted = True, None
        try:
            if self.stopping.is_set():
                return
            again, wanted = self._engine_tick()
        finally:
            # Even after a bug in the tick: a service that stopped ticking but went on
            # pinging the watchdog would stall unseen.
            if again and not self.stopping.is_set():
                self._schedule_tick(wanted)
            self.idle.set()

    def _collect(self) -> None:
        """``chainrun gc``, at start and once a day: what chains that ended long ago ran."""
        if self.store is None or self.stopping.is_set():
            return
        try:
            gc.collect(self.store, time.time(), self.config.gc_after or gc.DEFAULT_AFTER)
        except ChainrunError as exc:  # the database away, say: tomorrow again
            log.warning("collecting old code snapshots failed", error=str(exc))

    def _ping(self) -> None:
        if not self.stopping.is_set():
            self.sd.send("WATCHDOG=1")

    def _engine(self) -> Engine:
        """The engine, opening the store first if an outage kept it closed so far."""
        if self.engine is None:
            self.store = Store(self.home)
            problem = self.notifier.problem if self.notifier is not None else None
            warning = self.notifier.warning if self.notifier is not None else None
            self.engine = Engine(self.store, on_end=self.notifier, on_problem=problem, on_warning=warning)
        return self.engine

    def _engine_tick(self) -> tuple[bool, Optional[float]]:
        """One tick of the engine: whether to tick again, and how soon the engine wants it."""
        summary: Optional[TickSummary] = None
        done = False
        try:
            self.lock.check()  # never tick a home another service may have taken
            engine = self._engine()
            engine.beat_every = self.interval
            summary = engine.tick()
            if self.on_tick is not None:
                self.on_tick(summary)
            done = self.stop_when is not None and self.stop_when()
        except LockLost as exc:
            log.error("stopping: the state database is not the one this service locked", error=str(exc))
            self.failure = exc
            self.stop()
            return False, None
        except StoreUnavailable as exc:
            self._outage(exc)
            summary = None  # (the outage may have come after the engine's tick, in on_tick)
        except Exception:  # a bug must not kill the service; the next tick retries
            log.exception("tick failed")
            summary = None
        if summary is not None:
            if self.outage_since is not None:
                log.warning("database available again", after=round(time.monotonic() - self.outage_since, 1))
                self.outage_since = None
            self.status_line = summary.line()
            self.hosts = summary.hosts()
        if summary is not None or self.outage_since is not None:
            self._write_status()
        fields = [f"STATUS={self.status_line}"]
        if summary is not None and not self.ready:
            self.ready = True
            fields.insert(0, "READY=1")
            log.info("service ready", status=self.status_line)
        self.sd.send(*fields)
        if done:
            self.stop()
            return False, None
        return True, summary.next_in if summary is not None else None

    def _outage(self, exc: StoreUnavailable) -> None:
        """The database cannot be used now: say so once per outage; every tick retries."""
        if self.outage_since is None:
            self.outage_since = time.monotonic()
            log.warning("database unavailable; retrying every tick", error=str(exc))
        self.status_line = f"database unavailable, retrying: {exc}"

    def _write_status(self) -> None:
        try:
            heartbeat.write(self.home, self.status_line, self.interval, self.hosts)
        except OSError as exc:
            if not self._status_failed:  # once until it works again: a full disk fails every tick
                path = str(self.home / heartbeat.STATUS_FILE)
                log.warning("cannot write the service status file", path=path, error=str(exc))
            self._status_failed = True
        else:
            self._status_failed = False

    @staticmethod
    def _hooks(config: ServiceConfig) -> Hooks:
        return Hooks(on_end=config.on_end, webhook=config.webhook)
