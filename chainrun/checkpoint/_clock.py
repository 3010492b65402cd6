"""SegmentClock: tells a training loop that this segment's time is up and it should save and exit.

It turns true when the walltime signal arrives (the one in ``CHAINRUN_SIGNAL``,
SIGUSR1 by default, and SIGTERM, which schedulers send at the kill) or when
``CHAINRUN_DEADLINE`` minus a safety margin has passed. The handler only sets
a flag: the loop decides when to look, so a signal that arrives during a save
lets that save finish. Handlers are installed in the main process only; a
forked DataLoader worker that receives the signal neither stops nor dies of it.
"""

from __future__ import annotations

import atexit
import math
import os
import signal
import sys
import threading
import time
import warnings
from collections.abc import Iterable
from types import FrameType
from typing import Any, Callable, Optional, Union

from chainrun.checkpoint import _ready

ALLOWED_SIGNALS = ("SIGUSR1", "SIGUSR2", "SIGTERM")
MAX_AUTO_MARGIN = 300.0
AUTO_MARGIN_FRACTION = 0.1

SignalLike = Union[int, str, signal.Signals]
_Handler = Union[Callable[[int, Optional[FrameType]], Any], int, signal.Handlers, None]


def parse_signal(value: SignalLike) -> signal.Signals:
    """``"USR1"``, ``"SIGUSR1"``, ``signal.SIGUSR1`` or its number -> ``signal.SIGUSR1``.

    Only USR1, USR2 and TERM can be walltime signals.
    """
    sig: Optional[signal.Signals] = None
    if isinstance(value, str):
        name = value.strip().upper()
        name = name if name.startswith("SIG") else "SIG" + name
        if name in ALLOWED_SIGNALS:
            sig = signal.Signals[name]
    else:
        try:
            candidate = signal.Signals(value)
        except ValueError:
            candidate = None
        if candidate is not None and candidate.name in ALLOWED_SIGNALS:
            sig = candidate
    if sig is None:
        raise ValueError(f"walltime signal {value!r} is not supported: use USR1, USR2 or TERM")
    return sig


class SegmentClock:
    """True (``should_stop()``, or ``bool(clock)``) once the segment should save and exit.

    ``signals`` default to ``CHAINRUN_SIGNAL`` (or SIGUSR1 without chainrun)
    plus SIGTERM; the signal in ``CHAINRUN_SIGNAL`` is always handled, since
    chainrun will send it. ``deadline`` (epoch seconds) defaults to
    ``CHAINRUN_DEADLINE``; with both, the earlier counts. ``margin`` is how long
    before the deadline to stop; by default half the grace the wrapper gives
    this segment (``CHAINRUN_GRACE``: the signal comes first, and the deadline
    stops the loop only where it never came, with the longest save seen still
    to go), else 10% of the time left when the clock is made, at most 5
    minutes. Once its handlers are set, the clock tells chainrun's wrapper that
    the command is ready for the signal (``ready`` in ``CHAINRUN_RUN_DIR``): a
    signal due before then is held until then.
    Handlers that were installed before are called after ours (except the
    default action, which would kill the process).
    """

    def __init__(
        self,
        signals: Optional[Union[SignalLike, Iterable[SignalLike]]] = None,
        *,
        deadline: Optional[float] = None,
        margin: Optional[float] = None,
        install: bool = True,
        now: Callable[[], float] = time.time,
    ) -> None:
        self._now = now
        env_signal = os.environ.get("CHAINRUN_SIGNAL", "").strip()
        chosen: list[signal.Signals] = []
        if signals is None:
            chosen = [parse_signal(env_signal or "USR1"), signal.SIGTERM]
        else:
            items = [signals] if isinstance(signals, (int, str)) else list(signals)
            chosen = [parse_signal(s) for s in items]
            if env_signal:
                chosen.append(parse_signal(env_signal))
        self.signals: tuple[signal.Signals, ...] = tuple(dict.fromkeys(chosen))

        env_deadline = _deadline_from_env()
        candidates = [d for d in (deadline, env_deadline) if d is not None]
        self.deadline: Optional[float] = min(candidates) if candidates else None
        if margin is None:
            margin = _margin_from_env()
        if margin is None:
            left = 0.0 if self.deadline is None else max(0.0, self.deadline - now())
            margin = min(MAX_AUTO_MARGIN, AUTO_MARGIN_FRACTION * left)
        if margin < 0:
            raise ValueError(f"SegmentClock margin must be >= 0 seconds, got {margin!r}")
        self.margin: float = float(margin)

        self.received: Optional[signal.Signals] = None
        self._reason: Optional[str] = None
        self._owner_pid = os.getpid()
        self._previous: dict[signal.Signals, _Handler] = {}
        if install:
            self.install()

    # -- the question the loop asks ------------------------------------------------
    def should_stop(self) -> bool:
        """True once the walltime signal arrived, the deadline margin passed, or a stop was requested."""
        if self._reason is not None:
            return True
        if self.deadline is not None and self._now() >= self.deadline - self.margin:
            self._reason = (
                f"deadline in {max(0.0, self.deadline - self._now()):.0f}s (safety margin {self.margin:.0f}s)"
            )
            return True
        return False

    def __bool__(self) -> bool:
        return self.should_stop()

    @property
    def reason(self) -> Optional[str]:
        """Why the clock stopped (``"signal SIGUSR1"``, ``"deadline ..."``), or None while it runs."""
        self.should_stop()
        return self._reason

    def remaining(self) -> Optional[float]:
        """Seconds until the deadline minus the margin; None without a deadline."""
        if self.deadline is None:
            return None
        return self.deadline - self.margin - self._now()

    def request_stop(self, reason: str = "stop requested") -> None:
        """Make ``should_stop()`` true from code (a test, a custom condition)."""
        if self._reason is None:
            self._reason = reason

    # -- signal handlers --------------------------------------------------------------
    def install(self) -> bool:
        """Install the handlers; False (with a warning) where that is impossible or unwanted.

        Not in a multiprocessing child (a spawned DataLoader worker importing the
        training script), and not from a thread other than the main one.
        """
        if self._previous:
            return True
        mp = sys.modules.get("multiprocessing")
        if mp is not None and mp.parent_process() is not None:
            return False
        if threading.current_thread() is not threading.main_thread():
            warnings.warn(
                "SegmentClock made outside the main thread: no signal handlers installed, "
                "only the deadline applies",
                stacklevel=3,
            )
            return False
        self._owner_pid = os.getpid()
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._handle)
        atexit.register(self._ignore_late_signals)
        _tell_ready()
        return True

    def uninstall(self) -> None:
        """Put back the handlers that were there before (where ours is still the one installed)."""
        for sig, previous in self._previous.items():
            if signal.getsignal(sig) == self._handle:
                signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
        self._previous.clear()
        atexit.unregister(self._ignore_late_signals)

    def _ignore_late_signals(self) -> None:
        # Python resets handlers to the default action while it shuts down; a
        # walltime signal landing then (a run that just finished) would kill
        # the process and turn its exit 0 into a crash. SIGTERM keeps its meaning.
        if os.getpid() != self._owner_pid:
            return
        for sig in self.signals:
            if sig != signal.SIGTERM and signal.getsignal(sig) == self._handle:
                signal.signal(sig, signal.SIG_IGN)

    def __enter__(self) -> SegmentClock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.uninstall()

    def _handle(self, signum: int, frame: Optional[FrameType]) -> None:
        sig = signal.Signals(signum)
        previous = self._previous.get(sig)
        if os.getpid() != self._owner_pid:
            # A forked child (DataLoader worker): behave as if we were not here,
            # except that USR1/USR2 do not kill it (that would crash the loader).
            if callable(previous):
                previous(signum, frame)
            elif previous in (signal.SIG_DFL, None) and sig == signal.SIGTERM:
                signal.signal(sig, signal.SIG_DFL)
                os.kill(os.getpid(), sig)
            return
        if self.received is None:
            self.received = sig
        if self._reason is None:
            self._reason = f"signal {sig.name}"
        if callable(previous):
            previous(signum, frame)

    def __repr__(self) -> str:
        names = ",".join(s.name for s in self.signals)
        return (
            f"SegmentClock(signals={names}, deadline={self.deadline}, margin={self.margin:.0f}s, "
            f"stopped={self._reason!r})"
        )


def _deadline_from_env() -> Optional[float]:
    text = os.environ.get("CHAINRUN_DEADLINE", "").strip()
    if not text:
        return None
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not math.isfinite(value):
        raise ValueError(
            f"CHAINRUN_DEADLINE={text!r} is not epoch seconds; chainrun's wrapper sets it, "
            "check the job environment"
        )
    return value


def _margin_from_env() -> Optional[float]:
    """Half the grace the wrapper gives this segment (``CHAINRUN_GRACE``), or None."""
    try:
        value = float(os.environ.get("CHAINRUN_GRACE", ""))
    except ValueError:
        return None
    return value / 2 if math.isfinite(value) and value >= 0 else None


def _tell_ready() -> None:
    """Tell chainrun's runner that this process now takes the walltime signal (a line in
    ``CHAINRUN_RUN_DIR/ready``, ``checkpoint._ready``). Once a chain's command has said so, the
    runner of each later segment holds the signal until as many of its processes say so again."""
    directory = os.environ.get("CHAINRUN_RUN_DIR", "")
    segment = os.environ.get("CHAINRUN_SEGMENT", "").strip()
    if not directory or not segment.isdigit():
        return
    try:
        _ready.tell(directory, segment)
    except OSError as exc:
        warnings.warn(
            f"could not tell chainrun the command is ready ({exc}): its walltime signal is not held",
            stacklevel=3,
        )
