"""The service: APScheduler ticks the engine until told to stop.

One service per ``CHAINRUN_HOME`` (a file lock). Every tick runs the engine
once over all chains; ticks never overlap. SIGTERM and SIGINT stop it cleanly:
queued jobs keep running in the scheduler and are picked up on the next start.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from types import FrameType
from typing import Optional

import filelock
import structlog
from apscheduler.executors.pool import ThreadPoolExecutor
from apscheduler.schedulers.blocking import BlockingScheduler

from chainrun.engine import Engine, TickSummary
from chainrun.errors import AlreadyRunning
from chainrun.store import Store

log = structlog.get_logger(__name__)

DEFAULT_INTERVAL = 10.0


class InstanceLock:
    """Holds the single-instance lock of a CHAINRUN_HOME while open."""

    def __init__(self, home: Path) -> None:
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


class Service:
    """Ticks the engine every ``interval`` seconds until stopped."""

    def __init__(
        self,
        home: Path,
        interval: float = DEFAULT_INTERVAL,
        on_tick: Optional[Callable[[TickSummary], None]] = None,
        stop_when: Optional[Callable[[], bool]] = None,
    ) -> None:
        self.home = Path(home)
        self.interval = interval
        self.on_tick = on_tick
        self.stop_when = stop_when
        self.stopping = threading.Event()
        self.scheduler = BlockingScheduler(
            executors={"default": ThreadPoolExecutor(1)}, timezone=timezone.utc
        )

    def run(self) -> None:
        lock = InstanceLock(self.home)
        lock.acquire()
        store = Store(self.home)
        try:
            self.engine = Engine(store)
            self.scheduler.add_job(
                self._tick,
                "interval",
                seconds=self.interval,
                next_run_time=datetime.now(timezone.utc),
                max_instances=1,
                coalesce=True,
                id="tick",
                misfire_grace_time=None,
            )
            previous = {s: signal.signal(s, self._on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
            log.info("service started", home=str(self.home), interval=self.interval)
            try:
                self.scheduler.start()
            finally:
                for s, handler in previous.items():
                    signal.signal(s, handler)
            log.info("service stopped")
        finally:
            store.close()
            lock.release()

    def stop(self) -> None:
        if not self.stopping.is_set():
            self.stopping.set()
            # From a signal handler, let a tick in flight finish before the
            # store closes; from inside a tick, waiting would wait on itself.
            self.scheduler.shutdown(wait=threading.current_thread() is threading.main_thread())

    def _on_signal(self, signum: int, frame: Optional[FrameType]) -> None:
        log.info("stopping", signal=signal.Signals(signum).name)
        self.stop()

    def _tick(self) -> None:
        if self.stopping.is_set():
            return
        try:
            summary = self.engine.tick()
        except Exception:  # a bug must not kill the service; the next tick retries
            log.exception("tick failed")
            return
        if self.on_tick is not None:
            self.on_tick(summary)
        if self.stop_when is not None and self.stop_when():
            self.stop()
