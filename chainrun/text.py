"""Text for people and for shells: cutting it short, escaping what a terminal would act on,
quoting a value for bash, and writing a measured duration.

Every view (``status``, ``run``'s live area, the command line's one-line errors) and every
script chainrun writes takes these from here, so that a value shows, and travels, the same
way everywhere.
"""

from __future__ import annotations

import math
import re
import shlex
import unicodedata

# What a terminal treats as the end of a line, besides "\n".
_LINE_BREAKS = frozenset("\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029")
# CSI (colours, cursor moves), OSC (titles, links) and two-character escapes.
_ESCAPE = re.compile(r"\x1b(?:\[[0-?]*[ -/]*[@-~]|\][^\x07\x1b]*(?:\x07|\x1b\\)?|[@-_])")
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def clip(text: str, width: int, mark: str = "…") -> str:
    """``text`` cut to at most ``width`` characters, ending in ``mark`` when it was cut."""
    return text if len(text) <= width else text[: max(0, width - len(mark))] + mark


def escaped(text: str) -> str:
    """A line of a program's output as a terminal only shows it: escape sequences and other
    control characters as their escapes, a tab as spaces."""
    text = text.replace("\t", "    ")
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text)


def printable(text: str) -> str:
    """``text`` as one line a terminal only shows: line breaks become spaces, and control and
    format characters (escape sequences, bidi overrides) their escapes."""
    out = []
    for ch in text:
        if ch in _LINE_BREAKS:
            out.append(" ")
        elif ch.isprintable() or unicodedata.category(ch) == "Zs":
            out.append(ch)
        else:
            out.append(ch.encode("unicode_escape").decode("ascii"))
    return "".join(out).strip()


def one_line(text: str, limit: int) -> str:
    """``text`` printable, each run of whitespace one space, at most ``limit`` characters."""
    return clip(" ".join(printable(text).split()), limit)


def visible(raw: str) -> str:
    """One line of output as a terminal shows it: after a carriage return only what follows
    it (a progress bar redrawn), escape sequences and control characters gone."""
    return _CONTROL.sub("", _ESCAPE.sub("", raw.rsplit("\r", 1)[-1].replace("\t", "    "))).rstrip()


def quote(value: str) -> str:
    """shlex.quote, with each newline written as ``$'\\n'``: no value from the job
    file ever starts a line of the script (qsub reads ``#$`` at any line's start)."""
    return "$'\\n'".join(shlex.quote(part) for part in value.split("\n"))


# A measured duration is written to the second below ten minutes, to the minute below a day,
# then to the hour: (below how many seconds, rounded to how many).
_PRECISION = ((600, 1), (86400, 60))


def duration(seconds: float) -> str:
    """A measured duration (time trained, queued, budget used, an ETA), rounded to the nearest
    unit shown, never cut: ``45s``, ``9m59s``, ``10m``, ``1h5m``, ``2d3h``. A value from the
    job file is written exactly, by ``exact``."""
    unit = next((u for below, u in _PRECISION if _rounded(seconds, u) < below), 3600)
    return exact(_rounded(seconds, unit))


def exact(seconds: float) -> str:
    """``5400`` -> ``1h30m``, to the second: how a value from the job file is written back
    (the inverse of ``fields.parse_duration``); ``0s`` for none."""
    s = round(seconds)
    if s <= 0:
        return "0s"
    parts = []
    for name, size in (("d", 86400), ("h", 3600), ("m", 60), ("s", 1)):
        if s >= size:
            parts.append(f"{s // size}{name}")
            s %= size
    return "".join(parts)


def _rounded(seconds: float, unit: int) -> int:
    """``seconds`` to the nearest multiple of ``unit``, a half up; never below 0."""
    return unit * math.floor(max(0.0, seconds) / unit + 0.5)
