"""``chainrun status SWEEP``: a sweep's chains, compared.

Above the sweep's table: its chains by state, then, for each metric the chains' sidecars
report (``save(..., metrics=...)``), the mean and the spread (sample standard deviation) of
the latest values over each configuration's repetitions, one line a configuration, the best
first: lowest first for a metric whose name says it is a loss or an error (``loss``,
``err``, ``mse``, ``perplexity``...), highest first for any other. In the table, each chain
is named by its parameters, one column each, and its repetition; the hash of its
configuration (the middle of its name) is shown only when ``verbose``. Every line fits
``width``.
"""

from __future__ import annotations

import re
import statistics
from collections.abc import Sequence
from typing import NamedTuple, Optional

from chainrun.model import Chain, ChainState
from chainrun.status import CHAIN_MAX, WIDTH, Label, Shown, bar, columns
from chainrun.sweep import Config, digest, param_text
from chainrun.text import clip

PARAM_MIN = 6  # a parameter's column at its narrowest, when many share the width
# A metric is better low when its name holds one of these words (or "loss" or "err" anywhere).
_LOWER_WORDS = frozenset(
    {"mse", "mae", "rmse", "nll", "ppl", "perplexity", "wer", "cer", "regret", "latency", "time", "seconds"}
)


def lower_is_better(metric: str) -> bool:
    """Whether a lower value of ``metric`` is the better one, by its name."""
    name = metric.lower()
    return "loss" in name or "err" in name or any(w in _LOWER_WORDS for w in re.split(r"[^a-z0-9]+", name))


def _names(chains: Sequence[Chain]) -> list[str]:
    """The sweep's parameter names, in the job file's order (points may name different ones)."""
    names: dict[str, None] = {}
    for c in chains:
        names.update((k, None) for k, _ in c.spec.params)
    return list(names)


def _cells(config: Config, names: Sequence[str], per: int, verbose: bool) -> tuple[str, ...]:
    """A configuration's cells: its hash when ``verbose``, then each parameter's value."""
    values = dict(config)
    shown = tuple(clip(param_text(values[n]), per) if n in values else "-" for n in names)
    return (digest(config), *shown) if verbose else shown


def _per(names: Sequence[str], width: int) -> int:
    """How wide one parameter's column may be: the parameters share what the chain id had."""
    return max(PARAM_MIN, max(CHAIN_MAX, width * 3 // 10) // max(1, len(names)))


def label(chains: Sequence[Chain], width: int = WIDTH, verbose: bool = False) -> Label:
    """What names a sweep's chains in its table: parameters and repetition (and with
    ``verbose`` the configuration's hash) instead of the chain id."""
    names = _names(chains)
    per = _per(names, width)
    heads = (*(("CONFIG",) if verbose else ()), *(clip(n, per) for n in names), "REP")
    cells = {c.id: (*_cells(c.spec.params, names, per, verbose), str(c.spec.rep)) for c in chains}

    def name(chain: Shown) -> tuple[str, ...]:
        return cells[chain.id]

    return heads, name


def states(chains: Sequence[Chain]) -> list[tuple[str, int]]:
    """How many of ``chains`` are in each state, the most first."""
    counts: dict[str, int] = {}
    for c in chains:
        counts[c.state.value] = counts.get(c.state.value, 0) + 1
    return sorted(counts.items(), key=lambda kv: -kv[1])


def metric_names(chains: Sequence[Chain]) -> list[str]:
    """The metrics the chains' sidecars report, in the order they were first seen."""
    names: dict[str, None] = {}
    for c in chains:
        names.update((key, None) for key, _ in c.latest.metrics)
    return list(names)


def config_text(chain: Chain) -> str:
    """A sweep's chain in words, by its parameters and repetition: ``lr=0.1 bs=32 rep 1``."""
    values = " ".join(f"{k}={param_text(v)}" for k, v in chain.spec.params)
    return f"{values} rep {chain.spec.rep}" if values else chain.id


def summary(name: str, chains: Sequence[Chain], width: int = WIDTH, verbose: bool = False) -> str:
    """The lines above a sweep's table: its chains by state and a bar of those completed,
    then each metric compared over the configurations."""
    counted = states(chains)
    done = dict(counted).get(ChainState.COMPLETED.value, 0)
    counts = ", ".join(f"{n} {state}" for state, n in counted)
    lines = [clip(f"sweep {name}: {bar(done, len(chains))} completed; {counts}", width)]
    metrics = metric_names(chains)
    if not metrics:
        lines.append(clip("no metrics yet: the helper's save(..., metrics={...}) reports them", width))
    for metric in metrics:
        lines += compare(metric, chains, width, verbose)
    return "\n".join(lines)


class Score(NamedTuple):
    """One configuration's ``metric``: the mean and spread (None for a single value) of its
    repetitions' latest values, how many reported one, and how many there are."""

    config: Config
    mean: float
    spread: Optional[float]
    reported: int
    reps: int


def scores(metric: str, chains: Sequence[Chain]) -> list[Score]:
    """``metric`` per configuration of the sweep, the best first (``lower_is_better``); a
    configuration none of whose repetitions reported it is left out."""
    groups: dict[Config, list[Optional[float]]] = {}
    for c in chains:
        value = dict(c.latest.metrics).get(metric)
        groups.setdefault(c.spec.params, []).append(value)
    scored = []
    for config, values in groups.items():
        reported = [v for v in values if v is not None]
        if reported:
            spread = statistics.stdev(reported) if len(reported) > 1 else None
            scored.append(Score(config, statistics.fmean(reported), spread, len(reported), len(values)))
    lower = lower_is_better(metric)
    scored.sort(key=lambda s: s.mean if lower else -s.mean)
    return scored


def spread_text(score: Score) -> str:
    """The spread as the tables show it: ``±0.012``, or ``-`` for a single value."""
    return "-" if score.spread is None else f"±{score.spread:.2g}"


def compare(metric: str, chains: Sequence[Chain], width: int = WIDTH, verbose: bool = False) -> list[str]:
    """``metric`` over the sweep: per configuration, the mean and spread of its repetitions'
    latest values and how many reported one, the best configuration first."""
    names = _names(chains)
    per = _per(names, width)
    heads = (*(("CONFIG",) if verbose else ()), *(clip(n, per) for n in names), "MEAN", "SPREAD", "REPS")
    rows = [heads]
    for score in scores(metric, chains):
        cells = _cells(score.config, names, per, verbose)
        rows.append((*cells, f"{score.mean:.4g}", spread_text(score), f"{score.reported} of {score.reps}"))
    lower = lower_is_better(metric)
    heading = f"{metric}, {'lowest' if lower else 'highest'} first (mean and spread over repetitions):"
    table = columns(rows, width - 2, [0] * len(heads))
    return [clip(heading, width), *(f"  {line}" for line in table)]
