"""Request values checked and shown in error messages: JSON parsed with every failure a ValueError naming
the field, numbers and strings range-checked, a client's value clipped (a client may send megabytes)."""

from __future__ import annotations

import json
import math
import sys
from typing import Any


def json_object(text: str, what: str) -> dict[str, Any]:
    """Parses a JSON object (an empty string is {}); ValueError saying what `what` got wrong."""
    values = json_value(text, what) if text.strip() else {}
    if not isinstance(values, dict):
        raise ValueError(f"{what} must be a JSON object, got {json_type(values)}")
    return values


def json_value(text: str, what: str) -> Any:
    """json.loads, whose every failure (bad syntax, nesting too deep, a number too long for Python) is a
    ValueError naming `what`."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{what} is not valid JSON: {exc}") from None
    except RecursionError:
        raise ValueError(f"{what} is nested too deeply to parse") from None
    except ValueError as exc:
        if "integer string conversion" in str(exc):  # Python's bound on the digits of an int
            raise ValueError(
                f"{what} holds an integer of more than {sys.get_int_max_str_digits()} digits: no field allows one"
            ) from None
        raise ValueError(f"{what} could not be parsed: {exc}") from None


def show_key(key: Any) -> str:
    """A key for an error message: as is when plainly printable, else quoted (an empty or blank key)."""
    if isinstance(key, str) and key and key.isprintable() and key.strip() == key:
        return clip(key, 40)
    return clip(repr(key), 40)


def clip(text: str, limit: int = 80) -> str:
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def show_number(value: Any) -> str:
    """A value for an error message, clipped (a client may send megabytes): an integer of more than 30
    digits as its digit count, anything else as its repr."""
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 10**30:
        return f"{'a negative' if value < 0 else 'an'} integer of {len(str(abs(value)))} digits"
    if isinstance(value, str) and len(value) > 80:
        return f"{value[:80]!r}... ({len(value)} characters)"
    return clip(repr(value))


def json_type(value: Any) -> str:
    """The JSON name of a value's type, for error messages (clients send JSON, not Python)."""
    if value is None:
        return "null"
    for kind, name in ((bool, "boolean"), (int, "integer"), (float, "number"), (str, "string"), (dict, "object"),
                       ((list, tuple), "array")):
        if isinstance(value, kind):
            return name
    return type(value).__name__


def show_value(value: Any) -> str:
    """A value of the wrong type for an error message: its JSON type and (clipped) value."""
    if value is None or isinstance(value, bool):
        return json.dumps(value)  # null, true, false
    return f"{json_type(value)} {show_number(value)}"


def check_unicode(name: str, text: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"{name} is not valid Unicode: {exc.reason} at character {exc.start}") from None


def check_int(name: str, value: Any, low: int | None = None, high: int | None = None, note: str = "") -> None:
    """ValueError unless value is an int (not a bool) in [low, high]; the message names the range."""
    bounds = " and ".join(b for b in (
        f">= {low}" if low is not None else "", f"<= {high}" if high is not None else "") if b)
    note = f" ({note})" if note else ""
    # bool is an int subclass in Python; `max_tokens: true` is a type error, not 1.
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer {bounds}{note}, got {show_value(value)}")
    if (low is not None and value < low) or (high is not None and value > high):
        raise ValueError(f"{name} must be {bounds}{note}, got {show_number(value)}")


def check_number(name: str, value: Any, allowed: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number {allowed}, got {show_value(value)}")
    try:
        finite = math.isfinite(value)
    except OverflowError:  # an int beyond any float
        finite = False
    if not finite:
        raise ValueError(f"{name} must be a finite number {allowed}, got {show_number(value)}")
