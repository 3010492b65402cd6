"""The segment runner's questions to the chain's carrier (``chainrun.carry``'s launcher, which
the service leaves in the run directory when the chain may queue its own successor).

Standard library alone: the segment runner ships this module beside itself.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from typing import Optional


class Carrier:
    """The chain's carrier (``chainrun.carry``'s launcher, left in the run directory by the
    service when the chain may queue its own successor), asked now and then while the command
    runs and, once more, when it has ended: it prints when to ask again, or nothing."""

    def __init__(self, run_dir: str, n: int, job: str, env: dict[str, str]) -> None:
        self.launcher = os.path.join(run_dir, "carry")
        self.argv = [self.launcher, run_dir, str(n), job]
        # The carrier runs with this interpreter, known to run here (``carry.PYTHON_VAR``).
        self.env = {**env, "CHAINRUN_PYTHON": sys.executable}
        self.proc: Optional[subprocess.Popen[bytes]] = None
        self.ask_at: Optional[float] = 0.0 if os.access(self.launcher, os.X_OK) else None

    def poll(self, now: float, state: str) -> None:
        """Start the next question when it is due; collect the answer of one that ended."""
        if self.proc is not None:
            if self.proc.poll() is None:
                return
            self._answer(now)
        if self.ask_at is not None and now >= self.ask_at and os.access(self.launcher, os.X_OK):
            self.proc = subprocess.Popen(
                [*self.argv, state],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                env=self.env,
                preexec_fn=ignore_walltime_signals,  # the walltime signal is the command's
            )

    def _answer(self, now: float) -> None:
        """The ended question's answer: when to ask again (seconds from now), or never."""
        assert self.proc is not None
        answer = (self.proc.stdout.read() if self.proc.stdout else b"").strip()
        self.proc = None
        self.ask_at = now + int(answer) if answer.isdigit() and int(answer) > 0 else None

    def finish(self) -> None:
        """Let a question under way end (a submission is never cut in half); ask no more."""
        if self.proc is not None:
            self.proc.wait()
            self._answer(time.time())

    def until_done(self) -> None:
        """Ask, as the segment ends, until told not to ask again."""
        self.ask_at = 0.0 if os.access(self.launcher, os.X_OK) else None
        while self.ask_at is not None:
            self.poll(time.time(), "ended")
            if self.proc is not None:
                self.proc.wait()
                self._answer(time.time())
            elif self.ask_at is not None:
                time.sleep(min(1.0, max(0.0, self.ask_at - time.time())))


def ignore_walltime_signals() -> None:
    """The walltime signals ignored: they are the command's, never this process's."""
    for name in ("USR1", "USR2", "ALRM"):
        signal.signal(getattr(signal, "SIG" + name), signal.SIG_IGN)
