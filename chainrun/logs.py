"""structlog setup: pretty lines on a terminal, JSON lines everywhere else.

Events go through the standard library's logging, so the libraries'
records (APScheduler's) come out the same way. Under journald
(``$JOURNAL_STREAM`` names our stderr) each JSON line starts with its syslog
priority (``<4>`` for a warning), which journald strips and files under that
priority, so ``journalctl -p warning`` works. The service adds a rotating
JSON log file in ``$CHAINRUN_HOME``, re-opened on SIGHUP for logrotate.
"""

from __future__ import annotations

import logging
import logging.handlers
import os
import sys
from pathlib import Path
from typing import Optional, TextIO

import structlog

LOG_FILE = "service.log"
MAX_BYTES = 10 * 1024 * 1024
BACKUPS = 3

# sd-daemon(3) priorities by logging level.
_PRIORITIES = ((logging.CRITICAL, 2), (logging.ERROR, 3), (logging.WARNING, 4), (logging.INFO, 6))

_SHARED: list[structlog.typing.Processor] = [
    structlog.contextvars.merge_contextvars,
    structlog.stdlib.add_log_level,
    structlog.stdlib.add_logger_name,
    structlog.stdlib.ExtraAdder(),
    structlog.processors.TimeStamper(fmt="iso", utc=True),
]

_handlers: list[logging.Handler] = []  # the ones this module added to the root logger
_file_handler: Optional[logging.handlers.RotatingFileHandler] = None


def priority(levelno: int) -> int:
    """The syslog priority of a logging level: 3 for errors, 4 warnings, 6 info, 7 debug."""
    for level, prio in _PRIORITIES:
        if levelno >= level:
            return prio
    return 7


def under_journald(stream: TextIO) -> bool:
    """True when ``stream`` is the journal stream systemd connected (``$JOURNAL_STREAM``)."""
    value = os.environ.get("JOURNAL_STREAM", "")
    dev, _, ino = value.partition(":")
    try:
        st = os.fstat(stream.fileno())
        return (st.st_dev, st.st_ino) == (int(dev), int(ino))
    except (ValueError, OSError, AttributeError):
        return False


class _JournalFormatter(structlog.stdlib.ProcessorFormatter):
    """Prefixes every line with its syslog priority for journald."""

    def format(self, record: logging.LogRecord) -> str:
        return f"<{priority(record.levelno)}>" + super().format(record)


def _json_processors() -> list[structlog.typing.Processor]:
    return [
        structlog.stdlib.ProcessorFormatter.remove_processors_meta,
        structlog.processors.format_exc_info,
        structlog.processors.JSONRenderer(default=str),
    ]


def _level(name: str) -> int:
    value = logging.getLevelName(name.upper())
    if not isinstance(value, int):
        raise ValueError(f"log level {name!r}: use debug, info, warning or error")
    return value


def setup(level: str = "info", stream: Optional[TextIO] = None, pretty: Optional[bool] = None) -> None:
    """Configure logging once for this process: ``level`` and up to ``stream`` (stderr)."""
    out = stream or sys.stderr
    journald = under_journald(out)
    if pretty is None:
        pretty = out.isatty() and not journald
    formatter: logging.Formatter
    if pretty:
        formatter = structlog.stdlib.ProcessorFormatter(
            processors=[
                structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                structlog.dev.ConsoleRenderer(colors=True),
            ],
            foreign_pre_chain=_SHARED,
        )
    else:
        kind = _JournalFormatter if journald else structlog.stdlib.ProcessorFormatter
        formatter = kind(processors=_json_processors(), foreign_pre_chain=_SHARED)
    handler = logging.StreamHandler(out)
    handler.setFormatter(formatter)
    root = logging.getLogger()
    for old in _handlers:
        root.removeHandler(old)
        if old is not _file_handler:
            old.close()
    _handlers[:] = [handler] + ([_file_handler] if _file_handler is not None else [])
    for h in _handlers:
        root.addHandler(h)
    root.setLevel(_level(level))
    # APScheduler reports every run of the tick at INFO; only its trouble matters.
    logging.getLogger("apscheduler").setLevel(logging.WARNING)
    structlog.configure(
        processors=[
            structlog.stdlib.filter_by_level,
            *_SHARED,
            structlog.stdlib.PositionalArgumentsFormatter(),
            structlog.processors.StackInfoRenderer(),
            structlog.stdlib.ProcessorFormatter.wrap_for_formatter,
        ],
        wrapper_class=structlog.stdlib.BoundLogger,
        logger_factory=structlog.stdlib.LoggerFactory(),
        cache_logger_on_first_use=False,
    )


def open_file(home: Path) -> Path:
    """Also log, as JSON lines, to ``home/service.log`` (rotated at 10 MB, 3 kept)."""
    global _file_handler
    path = Path(home) / LOG_FILE
    if _file_handler is not None and Path(_file_handler.baseFilename) == path.resolve():
        return path
    close_file()
    old_umask = os.umask(0o077)
    try:
        handler = logging.handlers.RotatingFileHandler(path, maxBytes=MAX_BYTES, backupCount=BACKUPS)
    finally:
        os.umask(old_umask)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(processors=_json_processors(), foreign_pre_chain=_SHARED)
    )
    _file_handler = handler
    _handlers.append(handler)
    logging.getLogger().addHandler(handler)
    return path


def reopen_file() -> None:
    """Close the log file so the next line opens it afresh (after an outside rotation)."""
    handler = _file_handler
    if handler is None:
        return
    handler.acquire()
    try:
        if handler.stream is not None:
            handler.stream.close()
            handler.stream = None  # FileHandler reopens it on the next emit
    finally:
        handler.release()


def close_file() -> None:
    global _file_handler
    handler = _file_handler
    if handler is None:
        return
    logging.getLogger().removeHandler(handler)
    if handler in _handlers:
        _handlers.remove(handler)
    handler.close()
    _file_handler = None


def flush() -> None:
    for handler in _handlers:
        handler.flush()


def reset() -> None:
    """Undo ``setup`` and ``open_file``: structlog's defaults, none of our handlers."""
    close_file()
    root = logging.getLogger()
    for handler in _handlers:
        root.removeHandler(handler)
    _handlers.clear()
    structlog.reset_defaults()
