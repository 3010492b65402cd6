"""The service config (``$XDG_CONFIG_HOME/chainrun/config.toml``): the defaults a job file may
override (``on_end``, ``webhook``), the service's tick ``interval`` and how long the code
snapshots of ended chains are kept (``gc_after``), read and checked with the job file's
error style.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from chainrun.fields import Fields, parse_duration, read_toml, web_url

CONFIG_KEYS = ("on_end", "webhook", "interval", "gc_after")
# Seconds between ticks: faster would only load the scheduler, slower would
# leave a segment's end unnoticed for too long (and 1e300 overflows the clock).
MIN_INTERVAL = 0.2
MAX_INTERVAL = 3600.0
INTERVAL_HELP = f"{MIN_INTERVAL:g} to {MAX_INTERVAL:g} seconds, or a duration up to 1h such as 30s or 5m"


@dataclass(frozen=True)
class ServiceConfig:
    """The service config; a job file's own ``on_end``/``webhook`` win over these."""

    on_end: Optional[str] = None
    webhook: Optional[str] = None
    interval: Optional[float] = None  # seconds between ticks
    gc_after: Optional[int] = None  # seconds after its end that a chain's code snapshot is kept
    path: str = ""


def config_path() -> Path:
    """``$XDG_CONFIG_HOME/chainrun/config.toml``, else ``~/.config/chainrun/config.toml``."""
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "chainrun" / "config.toml"


def load_config(path: Optional[Path] = None) -> ServiceConfig:
    """Read and validate the service config; a missing file means all defaults."""
    p = path or config_path()
    try:
        data = read_toml(p, "the service config")
    except FileNotFoundError:
        return ServiceConfig(path=str(p))
    return parse_config(data, str(p))


def parse_config(data: dict[str, Any], path: str) -> ServiceConfig:
    """Validate an already-parsed config document, with the job file's error style."""
    f = Fields(path, data)
    f.check_keys(CONFIG_KEYS)
    on_end = f.get("on_end", str, "a shell command run when a chain ends")
    f.checked("on_end", on_end, lambda c: c.strip() and "\0" not in c, "must be a non-empty command")
    webhook = f.get("webhook", str, "an http:// or https:// URL")
    f.checked("webhook", webhook, web_url, "must be an http:// or https:// URL with a valid host")
    interval: Optional[float] = None
    if "interval" in data:
        value = data["interval"]
        if isinstance(value, bool) or not isinstance(value, (str, int, float)):
            raise f.error("interval", 'expected seconds between ticks, e.g. 10 or "30s"')
        try:
            interval = parse_interval(value)
        except ValueError as exc:
            raise f.error("interval", str(exc)) from None
    gc_after = f.duration("gc_after")
    return ServiceConfig(on_end=on_end, webhook=webhook, interval=interval, gc_after=gc_after, path=path)


def parse_interval(value: str | float) -> float:
    """Seconds between ticks from a number or a duration (``"30s"``), within the bounds.

    Raises ValueError with what is wrong and what is allowed (nan, inf, zero,
    negative, too long, or not a number at all)."""
    if isinstance(value, str):
        text = value.strip()
        try:
            seconds = float(text)
        except ValueError:
            try:
                seconds = float(parse_duration(text))
            except ValueError:
                raise ValueError(f"not seconds or a duration; use {INTERVAL_HELP}") from None
    else:
        seconds = float(value)
    # Written so that nan fails too: every comparison with nan is false.
    if not MIN_INTERVAL <= seconds <= MAX_INTERVAL:
        raise ValueError(f"must be {INTERVAL_HELP}")
    return seconds
