"""Every rule of chainrun, pure: facts and ``now`` in, actions and their reasons out.

``chain`` is the state machine of one chain (``decide``): how each segment ended and what
it costs, what comes next, when the chain ends; ``facts`` is what the engine tells it each
tick. ``retry`` says when to try again (a failed submission, a chain whose ticks keep
failing, accounting that did not know a job yet). ``placement`` says where and when a new
segment may start (a pool's hosts and slots, a sweep's ``max_concurrent``, array jobs);
``goal`` when a chain's goal is reached (the one completion rule);
``grace`` how long before its walltime a segment gets the signal; ``carry`` what a segment
may queue while the service is away; ``holds`` which chain holds a checkpoint directory.
Nothing here does I/O or reads a clock: the engine gathers the facts and carries the
actions out.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from chainrun.decide.chain import LOST_AFTER, decide, quiet_until
    from chainrun.decide.facts import Facts, JobFacts
    from chainrun.decide.placement import place
    from chainrun.decide.retry import after_submit, backoff

# Each name from its module, loaded on first use: `status` reads one small rule
# (``startup``) without loading the state machine and the job file's schema.
_FROM = {
    "LOST_AFTER": "chain",
    "decide": "chain",
    "quiet_until": "chain",
    "Facts": "facts",
    "JobFacts": "facts",
    "place": "placement",
    "after_submit": "retry",
    "backoff": "retry",
}
__all__ = ["LOST_AFTER", "Facts", "JobFacts", "after_submit", "backoff", "decide", "place", "quiet_until"]


def __getattr__(name: str) -> Any:
    if name not in _FROM:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"chainrun.decide.{_FROM[name]}"), name)
