"""A type check of a dataclass read back from SQLite and JSON, which keep whatever they
are given: ``check`` names the first field (nested ones too) whose value is not of its
declared type. Each field's test is made once per type hint (``fits``): a chain's row is
read field by field on every load.
"""

from __future__ import annotations

import dataclasses
import functools
import operator
import typing
from typing import Any, Callable, Union

from chainrun.model import ChainState, Outcome, Phase


class Unfit(Exception):
    """A field whose value is not of its declared type: ``field`` (dotted) and ``value``."""

    def __init__(self, field: str, value: Any, hint: Any) -> None:
        super().__init__(field)
        self.field = field
        self.value = value
        self.hint = hint


# By dataclass: a getter of all its fields' values at once, for each field the types
# that fit it at a glance (see _plain), and its name, type hint, fit test, and whether
# it may hold a dataclass.
_FIELDS: dict[
    type,
    tuple[
        Callable[[Any], Any],
        tuple[frozenset[type], ...],
        list[tuple[str, Any, Callable[[Any], bool], bool]],
    ],
] = {}


def check(obj: Any, prefix: str = "") -> None:
    """Raise Unfit naming the first field of dataclass ``obj`` (nested ones too) whose value
    is not of its declared type."""
    known = _FIELDS.get(type(obj))
    if known is None:
        hints = typing.get_type_hints(type(obj))
        names = [f.name for f in dataclasses.fields(obj) if f.init]  # not one derived (Chain.live)
        known = _FIELDS[type(obj)] = (
            operator.attrgetter(*names),  # every dataclass read here has several fields
            tuple(_plain(hints[n]) for n in names),
            [(n, hints[n], fits(hints[n]), _holds_dataclass(hints[n])) for n in names],
        )
    values, plain, fields = known
    for value, types, (name, hint, fit, nested) in zip(values(obj), plain, fields):
        if type(value) in types:  # most fields: a str, a number, None, an Enum
            continue
        if not fit(value):
            raise Unfit(f"{prefix}{name}", value, hint)
        if nested and dataclasses.is_dataclass(value):
            check(value, f"{prefix}{name}.")


# The exact types a value of these hints may have: JSON and SQLite give no subclasses.
_PLAIN: dict[Any, frozenset[type]] = {
    str: frozenset({str}),
    int: frozenset({int}),
    float: frozenset({int, float}),
    bool: frozenset({bool}),
    type(None): frozenset({type(None)}),
}


def _plain(hint: Any) -> frozenset[type]:
    """The types whose values fit ``hint`` with no closer look (a str for ``str``, a Phase
    for ``Phase``); none for hints that need one (tuples, dataclasses): ``fits`` then."""
    if typing.get_origin(hint) is Union:
        parts = [_plain(arg) for arg in typing.get_args(hint)]
        return frozenset().union(*parts) if all(parts) else frozenset()
    if isinstance(hint, type) and issubclass(hint, (ChainState, Phase, Outcome)):
        return frozenset({hint})
    return _PLAIN.get(hint, frozenset())


def _holds_dataclass(hint: Any) -> bool:
    args = typing.get_args(hint) if typing.get_origin(hint) is Union else (hint,)
    return any(isinstance(a, type) and dataclasses.is_dataclass(a) for a in args)


@functools.cache
def fits(hint: Any) -> Callable[[Any], bool]:
    """A test of whether a value is of type ``hint``, made once per hint: a row is read
    field by field on every load of a chain."""
    origin = typing.get_origin(hint)
    if origin is Union:
        args = typing.get_args(hint)
        if len(args) == 2 and type(None) in args:  # Optional[X]
            inner = fits(next(a for a in args if a is not type(None)))
            return lambda v: v is None or inner(v)
        parts = tuple(fits(arg) for arg in args)
        return lambda v: any(p(v) for p in parts)
    if origin is tuple:
        args = typing.get_args(hint)
        if len(args) == 2 and args[1] is Ellipsis:
            each = fits(args[0])
            return lambda v: isinstance(v, tuple) and all(each(x) for x in v)
        items = tuple(fits(a) for a in args)
        return lambda v: isinstance(v, tuple) and len(v) == len(items) and all(f(x) for f, x in zip(items, v))
    if hint is type(None):
        return lambda v: v is None
    if hint is bool:
        return lambda v: isinstance(v, bool)
    if hint is int:
        return lambda v: isinstance(v, int) and not isinstance(v, bool)
    if hint is float:
        return lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)
    if hint is str:
        return lambda v: isinstance(v, str)
    return lambda v: isinstance(v, hint)  # an Enum or a dataclass


def kind_of(hint: Any) -> str:
    origin = typing.get_origin(hint)
    if origin is Union:
        return " or ".join(kind_of(arg) for arg in typing.get_args(hint))
    if origin is tuple:
        args = typing.get_args(hint)
        inner = args[0] if len(args) == 2 and args[1] is Ellipsis else None
        if inner is None:
            return f"a list of {len(args)}"
        return "a list of pairs" if typing.get_origin(inner) is tuple else f"a list of {kind_of(inner)}"
    names = {int: "a whole number", float: "a number", str: "text", bool: "true or false", type(None): "null"}
    return names.get(hint, getattr(hint, "__name__", str(hint)))
