"""Tests of the tests: a module of chainrun with one deliberate bug in it, to show that a
test fails on that bug (and so pins the rule) as well as passing on the real code."""

from __future__ import annotations

import inspect
import sys
from types import ModuleType


def mutant(module: ModuleType, old: str, new: str) -> ModuleType:
    """A fresh copy of ``module`` with ``old``, which its source holds exactly once, made
    ``new``: the bug. The copy imports what the module imports (the real ones)."""
    source = inspect.getsource(module)
    assert source.count(old) == 1, f"{module.__name__} holds {old!r} {source.count(old)} times, not once"
    copy = ModuleType(f"{module.__name__}_mutant")
    copy.__file__ = module.__file__
    sys.modules[copy.__name__] = copy  # dataclasses look their module up while they are made
    try:
        exec(compile(source.replace(old, new), f"{module.__file__} (mutant)", "exec"), copy.__dict__)
    finally:
        del sys.modules[copy.__name__]
    return copy


def rules_mutant(old: str, new: str) -> ModuleType:
    """A fresh copy of ``decide.chain`` with the bug in it, or in the charging rules it
    applies (``decide.charge``), or in the completion rule (``decide.goal``, which
    ``decide``, the carrier and submit share)."""
    from chainrun.decide import chain, charge, goal

    if old in inspect.getsource(chain):
        return mutant(chain, old, new)
    if old in inspect.getsource(charge):
        line = "from chainrun.decide import charge as costs"
        copy = mutant(chain, line, line)  # a copy, to carry the buggy rules
        copy.costs = mutant(charge, old, new)  # type: ignore[attr-defined]
        return copy
    bug = mutant(goal, old, new)
    line = "from chainrun.decide.goal import finished_on_its_own, goal_reached"
    copy = mutant(chain, line, line)  # a copy, to carry the buggy rule
    copy.goal_reached = bug.goal_reached  # type: ignore[attr-defined]
    copy.finished_on_its_own = bug.finished_on_its_own  # type: ignore[attr-defined]
    return copy
