"""structlog setup: pretty lines on a terminal, JSON lines everywhere else."""

from __future__ import annotations

import logging
import sys
from typing import Optional, TextIO

import structlog


def setup(level: str = "info", stream: Optional[TextIO] = None, pretty: Optional[bool] = None) -> None:
    """Configure structlog once for this process."""
    out = stream or sys.stderr
    if pretty is None:
        pretty = out.isatty()
    renderer: structlog.typing.Processor = (
        structlog.dev.ConsoleRenderer(colors=True) if pretty else structlog.processors.JSONRenderer()
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level.upper())),
        logger_factory=structlog.PrintLoggerFactory(out),
        cache_logger_on_first_use=False,
    )
