"""``chainrun run`` of a sweep: the live view of its chains, on ``run``'s.

Each chain's events print as lines that name the chain. The progress area (``run.View``,
the same as for one chain) shows the sweep as a whole: a bar of its chains' progress
together (each chain's epochs of its target, else its budget used of its total_time; an
ended chain counts whole) with the sweep's ETA, its chains by state (running, queued,
completed, failed, ...) with the best value so far of the first metric they report, then
a line per running chain: its parameters and repetition, its progress, its segment and
job, and its latest value of that metric. Off a terminal a line is printed when the
counts, an epoch or the best value change. The first Ctrl-C asks whether to stop watching
(the sweep goes on) or to cancel the whole sweep. The chains are read from the store, as
``status SWEEP`` reads them (``sweepstatus``); their logs and markers are not looked at,
which for hundreds of chains would be a look at each host every second: a running
chain's own output is ``chainrun logs CHAIN``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Callable, Optional

from chainrun.model import Chain, ChainState, Phase
from chainrun.run import (
    EXIT_COMPLETED,
    EXIT_NOT_COMPLETED,
    EXIT_STOPPED_WATCHING,
    START_ADVICE,
    Frame,
    current,
    measure,
    segment_text,
    stamp,
)
from chainrun.status import budget_used, eta
from chainrun.store import Store
from chainrun.sweepstatus import config_text, lower_is_better, metric_names, states, summary
from chainrun.text import duration

PROMPT = "Stop watching (the sweep goes on) or cancel the whole sweep? [w/c] "
RUNNING_SHOWN = 10  # lines of running chains under the bar; the rest are counted


def running(chain: Chain) -> bool:
    seg = current(chain)
    return not chain.state.final and seg is not None and seg.phase is Phase.RUNNING


def counts(chains: Sequence[Chain]) -> str:
    """``2 running, 3 queued, 1 completed, 1 failed``: an active chain is running while one of
    its segments runs, else queued (waiting in the scheduler, or for a slot of the sweep)."""
    now_running = sum(running(c) for c in chains)
    parts = [f"{now_running} running"] if now_running else []
    for state, n in states(chains):
        if state == ChainState.ACTIVE.value:
            n -= now_running
            state = "queued"
        if n:
            parts.append(f"{n} {state}")
    return ", ".join(parts)


def best(chains: Sequence[Chain]) -> tuple[str, Optional[tuple[float, Chain]]]:
    """The first metric the chains report, and its best latest value so far with its chain
    (lowest for a loss or an error, else highest); ("", None) before any is reported."""
    names = metric_names(chains)
    if not names:
        return "", None
    metric = names[0]
    values = [(v, c) for c in chains for k, v in c.latest.metrics if k == metric]
    pick = min if lower_is_better(metric) else max
    return metric, pick(values, key=lambda vc: vc[0])


def sweep_eta(chains: Sequence[Chain], now: float) -> Optional[float]:
    """Seconds until the last chain ends, at the rates so far: the budget each
    unfinished chain still needs (one not started yet: as long as the others take in all),
    shared by as many as run at once now, and never less than the longest of the running
    ones. None while no chain has a rate yet."""
    left = [c for c in chains if not c.state.final]
    if not left:
        return 0.0
    etas = {c.id: eta(c, now) for c in left}
    known = [e for e in etas.values() if e is not None]
    spans = [budget_used(c, now) + e for c in left if (e := etas[c.id]) is not None]
    spans += [c.used for c in chains if c.state is ChainState.COMPLETED]
    if not spans:
        return None
    unknown = sum(e is None for e in etas.values())
    work = sum(known) + unknown * sum(spans) / len(spans)
    at_once = max(1, sum(running(c) for c in left))
    return max(max(known, default=0.0), work / at_once)


def sweep_frame(name: str, chains: Sequence[Chain], now: float) -> Frame:
    """The sweep's frame at ``now``: see the module's docstring."""
    done = 0.0
    for c in chains:
        part, whole, _ = measure(c, now)
        done += 1.0 if c.state.final else part / whole if whole else 0.0
    total = len(chains)
    left = sweep_eta(chains, now)
    head = f"{int(100 * done // total) if total else 100}% of {total} chains"
    until = "" if left is None else f"ETA {duration(left)}"
    metric, top = best(chains)
    tally = counts(chains)
    if top is not None:
        tally += f"; best {metric} {top[0]:.4g} ({config_text(top[1])})"
    shown = [c for c in chains if running(c)]
    lines = [tally]
    for c in shown[:RUNNING_SHOWN]:
        value = dict(c.latest.metrics).get(metric) if metric else None
        score = f"  {metric} {value:.4g}" if value is not None else ""
        lines.append(f"  {config_text(c)}  {measure(c, now)[2]}  {segment_text(c)}{score}")
    if len(shown) > RUNNING_SHOWN:
        lines.append(f"  ... and {len(shown) - RUNNING_SHOWN} more running")
    key = (tally, tuple(c.latest.epoch for c in chains))
    return Frame(
        done,
        max(1, total),
        f"{head}  {until}",
        tuple(lines),
        "",
        f"sweep {name}: {head}{', ' + until if until else ''}; {tally}",
        key,
        all(c.state.final for c in chains),
    )


def submitted_line(name: str, how: Sequence[str]) -> str:
    """What ``run`` says first of a sweep: its chains stored now, those already active, and
    those that already completed (``submission.Submitted.how``)."""
    running, completed = how.count("running"), how.count("completed")
    if not running and not completed:
        return f"sweep {name}: {len(how)} chains submitted"
    parts = [f"{len(how) - running - completed} submitted now"]
    if running:
        parts.append(f"{running} already running, followed as they are")
    if completed:
        parts.append(f"{completed} already completed")
    return f"sweep {name}: {len(how)} chains: {', '.join(parts)}"


class SweepFollower:
    """A sweep's chains as the store has them (``run.Watch``): their new events, each
    naming its chain, and the sweep's frame. Used from the service's tick thread and the main
    thread (a cancel), one at a time."""

    noun = "sweep"
    prompt = PROMPT

    def __init__(self, store: Store, name: str, chain_ids: Sequence[str]) -> None:
        self.store = store
        self.name = name
        self.chain_ids = list(dict.fromkeys(chain_ids))
        self._lock = threading.Lock()
        self._seen = dict.fromkeys(self.chain_ids, 0)  # per chain, the last event id printed

    def chains(self) -> list[Chain]:
        return [self.store.chain(chain_id) for chain_id in self.chain_ids]

    def look(self, markers: bool) -> tuple[list[str], Callable[[float], Frame], list[tuple[str, str]]]:
        with self._lock:
            told = []
            for chain_id in self.chain_ids:
                events = self.store.events(chain_id, self._seen[chain_id])
                if events:
                    self._seen[chain_id] = events[-1].id
                told += [(ev.at, ev.id, f"{stamp(ev.at)}  {chain_id}: {ev.message}") for ev in events]
            chains = self.chains()
        lines = [line for _, _, line in sorted(told)]
        clusters = list(dict.fromkeys(c.cluster_key for c in chains if not c.state.final))
        return lines, lambda now: sweep_frame(self.name, chains, now), clusters

    def news(self) -> bool:
        return False  # the ticks tell, at the interval: see the module's docstring

    def ended(self) -> bool:
        with self._lock:
            return all(c.state.final for c in self.chains())

    def request_cancel(self) -> None:
        with self._lock:
            now = time.time()
            for chain in self.chains():
                if not chain.state.final:
                    self.store.request_cancel(chain.id, now)

    def last_word(self, service_elsewhere: bool) -> tuple[list[str], int]:
        chains = self.chains()
        if not all(c.state.final for c in chains):
            lines = [f"sweep {self.name} goes on; see it with: chainrun status {self.name}"]
            return (lines if service_elsewhere else [*lines, START_ADVICE]), EXIT_STOPPED_WATCHING
        lines = summary(self.name, chains).splitlines()
        ended = [c for c in chains if c.state is not ChainState.COMPLETED]
        lines += [f"chain {c.id} {c.state.value}: {c.reason}" for c in ended]
        code = EXIT_NOT_COMPLETED if ended else EXIT_COMPLETED
        return lines, code
