"""structlog setup: pretty lines on a terminal, JSON lines everywhere else.

structlog (and through it asyncio, and rich when installed) costs about a
tenth of a second to import, which commands that never log (``--help``,
``status``, ``check``) should not pay. So modules take their logger from
``get_logger``, which imports structlog at its first use, and ``setup`` only
notes the wanted configuration until then (at once when structlog is loaded).

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
from typing import TYPE_CHECKING, Any, Optional, TextIO

if TYPE_CHECKING:
    import structlog

LOG_FILE = "service.log"
MAX_BYTES = 10 * 1024 * 1024
BACKUPS = 3

# sd-daemon(3) priorities by logging level.
_PRIORITIES = ((logging.CRITICAL, 2), (logging.ERROR, 3), (logging.WARNING, 4), (logging.INFO, 6))


def _shared() -> list[structlog.typing.Processor]:
    import structlog

    return [
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


class _Logger:
    """A module's logger: structlog's, got (and structlog imported) at the first use."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._log: Any = None

    def __getattr__(self, attr: str) -> Any:
        if self._log is None:
            import structlog

            if _wanted is not None:
                _configure(*_wanted)
            self._log = structlog.get_logger(self._name)
        return getattr(self._log, attr)


def get_logger(name: str) -> Any:
    """The logger for module ``name``; importing this costs nothing until it logs."""
    return _Logger(name)


def _journal_formatter(**kwargs: Any) -> logging.Formatter:
    """structlog's formatter, each line prefixed with its syslog priority for journald."""
    import structlog

    class JournalFormatter(structlog.stdlib.ProcessorFormatter):
        def format(self, record: logging.LogRecord) -> str:
            return f"<{priority(record.levelno)}>" + super().format(record)

    return JournalFormatter(**kwargs)


def _json_processors() -> list[structlog.typing.Processor]:
    import structlog

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


_wanted: Optional[tuple[str, Optional[TextIO], Optional[bool], bool]] = None  # setup() awaiting structlog


def setup(
    level: str = "info", stream: Optional[TextIO] = None, pretty: Optional[bool] = None, console: bool = True
) -> None:
    """Configure logging once for this process: ``level`` and up to ``stream`` (stderr);
    with ``console`` False, to the log file alone (``open_file``), or nowhere without one.
    Done now if structlog is loaded, else at the first line logged (see ``get_logger``)."""
    global _wanted
    _level(level)  # a bad level is refused now, not at the first log line
    _wanted = (level, stream, pretty, console)
    if "structlog" in sys.modules:
        _configure(level, stream, pretty, console)


def _configure(level: str, stream: Optional[TextIO], pretty: Optional[bool], console: bool = True) -> None:
    import structlog

    global _wanted
    _wanted = None
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
            foreign_pre_chain=_shared(),
        )
    elif journald:
        formatter = _journal_formatter(processors=_json_processors(), foreign_pre_chain=_shared())
    else:
        formatter = structlog.stdlib.ProcessorFormatter(
            processors=_json_processors(), foreign_pre_chain=_shared()
        )
    # Without the console, a handler that drops the records: else logging's last resort prints them.
    handler: logging.Handler = logging.StreamHandler(out) if console else logging.NullHandler()
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
            *_shared(),
            structlog.stdlib.PositionalArgumentsFormatter(),
            structlog.processors.StackInfoRenderer(),
            structlog.stdlib.ProcessorFormatter.wrap_for_formatter,
        ],
        wrapper_class=structlog.stdlib.BoundLogger,
        logger_factory=structlog.stdlib.LoggerFactory(),
        cache_logger_on_first_use=False,
    )


def configure_now() -> None:
    """Apply a deferred ``setup`` now: the service's libraries (APScheduler) log through
    the standard library before chainrun's own first line."""
    if _wanted is not None:
        _configure(*_wanted)


def open_file(home: Path) -> Path:
    """Also log, as JSON lines, to ``home/service.log`` (rotated at 10 MB, 3 kept)."""
    global _file_handler
    configure_now()
    path = Path(home) / LOG_FILE
    if _file_handler is not None and Path(_file_handler.baseFilename) == path.resolve():
        return path
    close_file()
    old_umask = os.umask(0o077)
    try:
        handler = logging.handlers.RotatingFileHandler(path, maxBytes=MAX_BYTES, backupCount=BACKUPS)
    finally:
        os.umask(old_umask)
    import structlog

    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(processors=_json_processors(), foreign_pre_chain=_shared())
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


def configured() -> bool:
    """Whether ``setup`` was called in this process (and not ``reset`` since)."""
    return _wanted is not None or bool(_handlers)


def reset() -> None:
    """Undo ``setup`` and ``open_file``: structlog's defaults, none of our handlers."""
    import structlog

    global _wanted
    _wanted = None
    close_file()
    root = logging.getLogger()
    for handler in _handlers:
        root.removeHandler(handler)
    _handlers.clear()
    structlog.reset_defaults()
