"""A small allow-list schema language for the JSON of a program folder.

A spec is a function ``spec(value, where)`` that returns nothing or raises ``Invalid(where,
why)``, ``where`` being the JSON path of the value (``stages[0].file``). Specs accept only what
they name: an object's keys are exactly its required keys plus some of its optional ones, a
union is an object with exactly one known key, numbers are of the named type (a ``bool`` is
never an ``int``) and within bounds, strings and lists are bounded in length. The caller turns
``Invalid`` into an ``AutopartError`` naming the file (``refusal``).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Mapping
from typing import Any

from autopart.errors import AutopartError

Spec = Callable[[Any, str], None]

MAX_STR = 1 << 16  # the longest string any field may hold (a node's stack trace, ...)
MAX_ITEMS = 1 << 20  # the most items of any list or object
NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,254}")  # an identifier
DOTTED = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z0-9_]+){0,63}")  # an FQN, "" excluded


class Invalid(Exception):
    """A value the schema does not allow: ``where`` (its JSON path) and ``why``."""

    def __init__(self, where: str, why: str) -> None:
        super().__init__(f"{where or '(top)'}: {why}")
        self.where, self.why = where, why


def refusal(path: Any, exc: Invalid, hint: str | None = None) -> AutopartError:
    """The ``AutopartError`` for a file whose JSON failed its schema."""
    return AutopartError(
        f"{path}: field {exc.where or '(top level)'} {exc.why}",
        hint=hint
        or "the file is damaged or not from Program.save() of this autopart; re-save the program",
    )


def _at(where: str, key: Any) -> str:
    return f"{where}[{key}]" if isinstance(key, int) else (f"{where}.{key}" if where else str(key))


MAX_DIGITS = 64  # of a JSON integer (no count or size autopart writes is longer than 20)
MAX_VALUES = 1 << 24  # commas in one JSON text: a 16-layer stage's graph writes about 40 000
DENSE_FROM = 1 << 20  # commas past which a text must hold at least ``DENSE_BYTES`` bytes per comma
DENSE_BYTES = 8  # autopart's own JSON holds about 35 bytes per comma; ``[{},{},…]`` holds 3


def _check_values(text: str, where: str) -> None:
    """Refuse a text whose values would cost far more memory parsed than read: an empty
    object or list is 3 bytes of JSON and about 70 bytes of Python, so 256 MiB of ``[{},…]``
    used to cost 7 GB before any check saw it. Counting commas (one per value after a
    container's first) bounds the values, before the parser makes any of them."""
    commas = text.count(",")
    if commas > MAX_VALUES:
        raise Invalid(
            where, f"holds about {commas} values, more than autopart writes ({MAX_VALUES})"
        )
    if commas > DENSE_FROM and commas * DENSE_BYTES > len(text):
        raise Invalid(
            where,
            f"holds {commas} values in {len(text)} characters, denser than anything autopart "
            f"writes (at most one value per {DENSE_BYTES} characters past {DENSE_FROM} values)",
        )


def parse_json(data: bytes | str, where: str = "") -> Any:
    """``json.loads`` that refuses what Python's parser accepts beyond JSON (NaN, infinities,
    numbers past a float), duplicate keys (two readers could keep different ones), integers of
    more than ``MAX_DIGITS`` digits, nesting too deep to parse and more values than its size
    explains (``_check_values``)."""

    def pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for k, v in items:
            if k in out:
                raise Invalid(where, f"repeats the key {k[:80]!r}")
            out[k] = v
        return out

    def constant(name: str) -> Any:
        raise Invalid(where, f"holds {name}, which is not JSON")

    def integer(text: str) -> int:
        if len(text.lstrip("-")) > MAX_DIGITS:  # Python refuses past 4300 digits, raw
            raise Invalid(where, f"holds an integer of {len(text)} digits")
        return int(text)

    def real(text: str) -> float:
        value = float(text)
        if not math.isfinite(value):  # 1e999: past a float, read as an infinity
            raise Invalid(where, f"holds {text[:40]}, beyond a float")
        return value

    try:
        text = data.decode("utf-8") if isinstance(data, bytes) else data
    except UnicodeDecodeError as exc:
        raise Invalid(where, f"is not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    _check_values(text, where)
    try:
        return json.loads(
            text,
            object_pairs_hook=pairs,
            parse_constant=constant,
            parse_int=integer,
            parse_float=real,
        )
    except json.JSONDecodeError as exc:
        raise Invalid(where, f"is not JSON ({exc.msg} at line {exc.lineno})") from None
    except RecursionError:
        raise Invalid(where, "nests too deep") from None


def _type_name(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def integer(lo: int | None = None, hi: int | None = None) -> Spec:
    def spec(value: Any, where: str) -> None:
        if isinstance(value, bool) or not isinstance(value, int):
            raise Invalid(where, f"must be an integer, not {_type_name(value)}")
        if (lo is not None and value < lo) or (hi is not None and value > hi):
            raise Invalid(where, f"= {value} is outside [{lo}, {hi}]")

    return spec


def number(lo: float | None = None, hi: float | None = None) -> Spec:
    """A finite int or float (not a bool)."""

    def spec(value: Any, where: str) -> None:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise Invalid(where, f"must be a number, not {_type_name(value)}")
        if not math.isfinite(value):
            raise Invalid(where, "must be finite")
        if (lo is not None and value < lo) or (hi is not None and value > hi):
            raise Invalid(where, f"= {value} is outside [{lo}, {hi}]")

    return spec


def boolean(value: Any, where: str) -> None:
    if not isinstance(value, bool):
        raise Invalid(where, f"must be true or false, not {_type_name(value)}")


def string(pattern: re.Pattern[str] | None = None, max_len: int = MAX_STR) -> Spec:
    def spec(value: Any, where: str) -> None:
        if not isinstance(value, str):
            raise Invalid(where, f"must be a string, not {_type_name(value)}")
        if len(value) > max_len:
            raise Invalid(where, f"is a string of {len(value)} characters (at most {max_len})")
        if pattern is not None and not pattern.fullmatch(value):
            raise Invalid(where, f"= {value[:80]!r} is not of the form {pattern.pattern}")

    return spec


def one_of(*allowed: Any) -> Spec:
    def spec(value: Any, where: str) -> None:
        if isinstance(value, bool | int | str | type(None)) and any(
            type(value) is type(a) and value == a for a in allowed
        ):
            return
        shown = value[:80] if isinstance(value, str) else value
        raise Invalid(where, f"= {shown!r} is not one of {list(allowed)}")

    return spec


def nullable(inner: Spec) -> Spec:
    def spec(value: Any, where: str) -> None:
        if value is not None:
            inner(value, where)

    return spec


def list_of(item: Spec, max_len: int = MAX_ITEMS, min_len: int = 0) -> Spec:
    def spec(value: Any, where: str) -> None:
        if not isinstance(value, list):
            raise Invalid(where, f"must be a list, not {_type_name(value)}")
        if not min_len <= len(value) <= max_len:
            raise Invalid(where, f"has {len(value)} items (between {min_len} and {max_len})")
        for i, x in enumerate(value):
            item(x, _at(where, i))

    return spec


def dict_of(value_spec: Spec, key: Spec | None = None, max_len: int = MAX_ITEMS) -> Spec:
    key_spec = key or string()

    def spec(value: Any, where: str) -> None:
        if not isinstance(value, dict):
            raise Invalid(where, f"must be an object, not {_type_name(value)}")
        if len(value) > max_len:
            raise Invalid(where, f"has {len(value)} keys (at most {max_len})")
        for k, v in value.items():
            key_spec(k, _at(where, k) + " (a key)")
            value_spec(v, _at(where, k))

    return spec


def obj(required: Mapping[str, Spec], optional: Mapping[str, Spec] | None = None) -> Spec:
    """An object with exactly the ``required`` keys and some of the ``optional`` ones."""
    optional = optional or {}

    def spec(value: Any, where: str) -> None:
        if not isinstance(value, dict):
            raise Invalid(where, f"must be an object, not {_type_name(value)}")
        missing = [k for k in required if k not in value]
        if missing:
            raise Invalid(_at(where, missing[0]), "missing")
        for k, v in value.items():
            sub = required.get(k) or optional.get(k)
            if sub is None:
                raise Invalid(_at(where, str(k)[:80]), "is not a field autopart writes here")
            sub(v, _at(where, k))

    return spec


def union(variants: Mapping[str, Spec]) -> Spec:
    """An object with exactly one key, one of ``variants`` (torch's tagged unions)."""

    def spec(value: Any, where: str) -> None:
        if not isinstance(value, dict) or len(value) != 1:
            raise Invalid(where, f"must be an object with one of the keys {sorted(variants)}")
        ((k, v),) = value.items()
        if k not in variants:
            raise Invalid(_at(where, str(k)[:80]), "is not a kind autopart's programs use here")
        variants[k](v, _at(where, k))

    return spec


def each(*specs: Spec) -> Spec:
    """Every one of ``specs`` (a type, then a semantic check)."""

    def spec(value: Any, where: str) -> None:
        for s in specs:
            s(value, where)

    return spec


def check(test: Callable[[Any], bool], why: str) -> Spec:
    """A semantic check: ``test(value)`` must be true (run after a type spec, via ``each``)."""

    def spec(value: Any, where: str) -> None:
        if not test(value):
            raise Invalid(where, why)

    return spec


def anything(value: Any, where: str) -> None:
    """Any JSON value: for a field the code around the spec checks itself."""
