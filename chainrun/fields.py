"""The validated-TOML toolkit: read a TOML file, take typed fields out of its tables, durations
and URLs, each error one line naming the file, the field, the bad value and what is allowed.

The job file's schema (``schema``) and the service config (``config``) are both written with
it, so that every error reads the same way.
"""

from __future__ import annotations

import difflib
import ipaddress
import os
import re
import reprlib
import stat
import sys
from pathlib import Path
from typing import Any, Callable, Optional
from urllib.parse import urlsplit

from chainrun.errors import JobFileError
from chainrun.text import exact

format_duration = exact  # a value from the job file written back: the inverse of parse_duration


def _tomllib() -> Any:
    """The TOML parser (tomli before Python 3.11), imported only to parse: the carrier, which
    imports this module on a node's python3, needs no package beside the standard library."""
    if sys.version_info >= (3, 11):
        import tomllib

        return tomllib
    import tomli  # pragma: no cover - exercised on old Pythons only

    return tomli


DURATION_HELP = "a duration such as 90s, 45m, 4h, 2d, 1h30m, HH:MM:SS or D-HH:MM:SS"

_N = "([0-9]{1,20})"  # ASCII digits only, and few enough that any sum of them fits a float
_UNITS_RE = re.compile(f"(?:{_N}d)?(?:{_N}h)?(?:{_N}m)?(?:{_N}s)?")
_CLOCK_RE = re.compile(f"(?:{_N}-)?(?:{_N}:)?{_N}:{_N}")
_DNS_RE = re.compile(
    r"[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?)*\.?"
)

# Bounds that keep a valid file workable: a duration past a year overflows the clock
# arithmetic of every tick; a string past 64 KiB is no honest value of any field.
MAX_FILE_BYTES = 1 << 20
MAX_DURATION = 365 * 86400
MAX_STRING_BYTES = 64 << 10


def _repr(maxstring: int) -> reprlib.Repr:
    r = reprlib.Repr()
    r.maxstring = maxstring
    r.maxother = 60
    r.maxlong = 40
    r.maxlevel = 2
    r.maxlist = r.maxtuple = r.maxdict = 4
    return r


# Values in error lines: escaped (one line), cut short, and safe at any depth.
_VALUE = _repr(240)
_INNER_VALUE = _repr(40)


def show(value: Any) -> str:
    """A value for an error line: escaped, on one line, cut short."""
    return (_INNER_VALUE if isinstance(value, (dict, list)) else _VALUE).repr(value)


def parse_duration(text: str) -> int:
    """Seconds in ``text``; raises ValueError when it is not a duration.

    Only ASCII digits count (Python's ``int`` takes any script's digits), and
    spaces around it are the only thing ignored: a trailing newline is not."""
    s = text.strip(" ").lower()
    if not s.isascii():
        raise ValueError(text)
    m = _UNITS_RE.fullmatch(s)
    if s and m and any(m.groups()):
        d, h, mi, se = (int(g or 0) for g in m.groups())
        return ((d * 24 + h) * 60 + mi) * 60 + se
    m = _CLOCK_RE.fullmatch(s)
    if m:
        d, h, mi, se = (int(g or 0) for g in m.groups())
        if mi < 60 and se < 60:
            return ((d * 24 + h) * 60 + mi) * 60 + se
    raise ValueError(text)


def path_shown(path: str | os.PathLike[str]) -> str:
    """A path for an error line: as given, or quoted when it holds a newline or such."""
    text = os.fspath(path)
    return text if text.isprintable() else repr(text)


def _key(key: str) -> str:
    """A TOML key for an error line: bare keys as they are, any other one quoted and cut short."""
    return key if re.fullmatch(r"[A-Za-z0-9_-]{1,64}", key) else _VALUE.repr(key)


def size(text: str) -> int:
    """``text``'s length in UTF-8 bytes, as the kernel counts it."""
    return len(text.encode("utf-8", "surrogatepass"))


def kib(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 and n % (1 << 20) == 0 else f"{n >> 10} KiB"


def file_kind(mode: int) -> str:
    for test, kind in (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO (named pipe)"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISREG, "a regular file"),
    ):
        if test(mode):
            return kind
    return "not a regular file"


def why(exc: OSError) -> str:
    """What an OSError says, in lower case, for the end of an error line."""
    return (exc.strerror or str(exc)).lower()


class Fields:
    """Reads fields out of one TOML table, raising errors that name them."""

    def __init__(self, path: str, table: dict[str, Any], prefix: str = "") -> None:
        self.path = path
        self.table = table
        self.prefix = prefix

    def error(self, key: str, problem: str) -> JobFileError:
        name = self.prefix + _key(key)
        if key in self.table:
            shown = show(self.table[key])
            return JobFileError(f"{path_shown(self.path)}: {name} = {shown}: {problem}")
        return JobFileError(f"{path_shown(self.path)}: {name}: {problem}")

    def check_keys(self, allowed: tuple[str, ...], aliases: Optional[dict[str, str]] = None) -> None:
        """Every key of the table is one of ``allowed``; else JobFileError naming it, and what
        to write instead: for a key another tool spells so (``aliases``: key -> what chainrun
        calls it), that; for a near miss of an allowed key, that key."""
        for key in self.table:
            if key in allowed:
                continue
            unknown = f"{path_shown(self.path)}: unknown key {self.prefix}{_key(key)}"
            instead = (aliases or {}).get(key.lower())
            if instead:
                raise JobFileError(f"{unknown}; chainrun's is {instead}")
            near = difflib.get_close_matches(key.lower(), allowed, n=1, cutoff=0.75)
            allowed_here = f"llowed here: {', '.join(allowed)}"
            hint = f"; did you mean {self.prefix}{near[0]}? A{allowed_here}" if near else f"; a{allowed_here}"
            raise JobFileError(unknown + hint)

    def get(
        self,
        key: str,
        kind: type,
        what: str,
        default: Any = None,
        required: bool = False,
        max_bytes: int = MAX_STRING_BYTES,
    ) -> Any:
        """The value of ``key`` if it is a ``kind``; a string also free of NUL and at most
        ``max_bytes`` long (NUL would be dropped on the way to the job, silently)."""
        if key not in self.table:
            if required:
                raise self.error(key, f"missing; give {what}")
            return default
        value = self.table[key]
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise self.error(key, f"expected {what}")
        if isinstance(value, str):
            self.text(key, value, max_bytes)
        return value

    def text(self, key: str, value: str, max_bytes: int = MAX_STRING_BYTES) -> None:
        if "\0" in value:
            raise self.error(key, "must not contain NUL bytes")
        if size(value) > max_bytes:
            raise self.error(key, f"{size(value)} bytes long; at most {kib(max_bytes)} is allowed")

    def duration(self, key: str, default: Optional[int] = None, required: bool = False) -> Any:
        raw = self.get(key, str, DURATION_HELP + ' (quoted, e.g. "4h")', required=required, max_bytes=128)
        if raw is None:
            return default
        return self._seconds(key, raw)

    def duration_range(self, key: str) -> tuple[int, int]:
        """A required duration, or a range ``"MIN..MAX"`` of two: (shortest, longest), equal for
        one duration."""
        what = DURATION_HELP + ', or a range such as "4h..24h" (quoted)'
        raw = self.get(key, str, what, required=True, max_bytes=128)
        if ".." not in raw:
            one = self._seconds(key, raw)
            return one, one
        low, _, high = raw.partition("..")
        shortest, longest = self._seconds(key, low), self._seconds(key, high)
        if shortest >= longest:
            raise self.error(key, 'a range\'s first duration must be the shorter, as in "4h..24h"')
        return shortest, longest

    def _seconds(self, key: str, raw: str) -> int:
        try:
            seconds = parse_duration(raw)
        except ValueError:
            raise self.error(key, f"not a duration; use {DURATION_HELP}") from None
        if seconds <= 0:
            raise self.error(key, "must be longer than zero")
        if seconds > MAX_DURATION:
            raise self.error(key, "longer than 365 days, the longest a duration may be")
        return seconds

    def checked(self, key: str, value: Any, ok: Callable[[Any], object], problem: str) -> Any:
        if value is not None and not ok(value):
            raise self.error(key, problem)
        return value


def web_url(url: str) -> bool:
    """An http(s) URL whose host is a DNS name, an IPv4 or a bracketed IPv6 address."""
    if any(c.isspace() or not c.isprintable() for c in url):
        return False
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises ValueError on a port that is not one
        host = parts.hostname
    except ValueError:
        return False
    if parts.scheme not in ("http", "https") or not host:
        return False
    if parts.netloc.rpartition("@")[2].startswith("["):
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            return False
        return True
    try:
        ascii_host = host.encode("idna").decode("ascii")
    except UnicodeError:
        return False
    return _DNS_RE.fullmatch(ascii_host) is not None


def read_toml(path: Path, what: str) -> dict[str, Any]:
    """``what`` (a job file, the service config) as TOML: FileNotFoundError passes
    through; any other trouble is one JobFileError line naming the file.

    Only a regular file (or a symlink to one) is read, and at most
    MAX_FILE_BYTES of it: a FIFO never blocks, a device is never opened."""
    raw = _read_regular(path, what)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise JobFileError(f"{path_shown(path)}: not UTF-8 text; {what} is TOML") from None
    try:
        data: dict[str, Any] = _tomllib().loads(text)
    except RecursionError:
        raise JobFileError(f"{path_shown(path)}: not valid TOML: nested too deeply") from None
    except ValueError as exc:  # TOMLDecodeError, and ints past Python's digit limit
        problem = " ".join(str(exc).split())
        if len(problem) > 200:
            problem = problem[:200] + "..."
        raise JobFileError(f"{path_shown(path)}: not valid TOML: {problem}") from None
    return data


def _read_regular(path: Path, what: str) -> bytes:
    shown = path_shown(path)

    def refuse(problem: str) -> JobFileError:
        return JobFileError(f"{shown}: cannot read {what}: {problem}")

    def check(st: os.stat_result) -> None:
        if not stat.S_ISREG(st.st_mode):
            raise refuse(f"it is {file_kind(st.st_mode)}; {what} must be a regular file")
        if st.st_size > MAX_FILE_BYTES:
            raise refuse(f"{st.st_size} bytes; {what} is at most {kib(MAX_FILE_BYTES)}")

    # stat first, so a device is never even opened; fstat after, in case the
    # path was swapped in between. O_NONBLOCK: opening a FIFO never waits.
    try:
        check(os.stat(path))
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise refuse(why(exc)) from None
    except ValueError:  # a NUL in the path
        raise refuse("the path holds a NUL byte") from None
    try:
        check(os.fstat(fd))
        chunks: list[bytes] = []
        total = 0
        while total <= MAX_FILE_BYTES:  # it may grow while read: never past the cap
            chunk = os.read(fd, MAX_FILE_BYTES + 1 - total)
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
    except OSError as exc:
        raise refuse(why(exc)) from None
    finally:
        os.close(fd)
    if total > MAX_FILE_BYTES:
        raise refuse(f"longer than {kib(MAX_FILE_BYTES)}; {what} is at most that")
    return b"".join(chunks)
