"""What a finished command returned: the scheduler's and the transport's answers alike."""

from __future__ import annotations

import posixpath
from dataclasses import dataclass


@dataclass(frozen=True)
class CommandResult:
    """What a finished command returned; a non-zero exit is a result, not an error."""

    argv: tuple[str, ...]
    returncode: int
    stdout: str
    stderr: str

    @property
    def ok(self) -> bool:
        return self.returncode == 0

    def describe(self) -> str:
        """One line for messages: ``sbatch exited 1: <first line of stderr>``."""
        name = posixpath.basename(self.argv[0]) if self.argv else "command"
        lines = (line.strip() for line in f"{self.stderr}\n{self.stdout}".splitlines())
        detail = next((line for line in lines if line), "")  # stderr's first, else stdout's
        summary = f"{name} exited {self.returncode}"
        return f"{summary}: {detail}" if detail else summary
