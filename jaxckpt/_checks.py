"""What `save` and `restore` are given, checked before anything is done (a step number,
`meta` and a data iterator's state as JSON), and Python's collector paused while they block
the training step."""

from __future__ import annotations

import contextlib
import gc
import math
import operator
import sys
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from jaxckpt._tree import short
from jaxckpt.errors import ConfigError, UnsupportedValueError


def check_step(step: Any) -> int:
    """A step number as given: a non-negative int (ConfigError otherwise)."""
    try:
        value = operator.index(step)
    except TypeError:
        raise ConfigError(f"step must be an int, got {type(step).__name__} {step!r}") from None
    if isinstance(step, bool) or value < 0:
        raise ConfigError(f"step must be a non-negative int, got {step!r}")
    return value


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Pauses Python's cyclic garbage collector while `save` blocks the training step, and
    during a restore.

    Orbax creates a few objects per shard; at thousands of leaves those allocations set off
    collections that walk every live object of the process: ~45% of a 4,000-leaf save's
    blocking time and ~30% of its restore (BENCHMARKS.md). Reference counting still frees
    all else meanwhile (a restore's peak memory is unchanged).
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


MAX_JSON_DEPTH = 200  # far below where Python's json (and most others) stop reading


def check_json(value: Any, path: str = "meta") -> None:
    """Raises UnsupportedValueError naming the first value that is not JSON, or that JSON
    readers refuse: nesting deeper than MAX_JSON_DEPTH, integers too long to print.

    NaN and infinities are kept (a NaN loss in `meta=` must not stop training): Python's
    json writes and reads them as the tokens NaN, Infinity and -Infinity, which strict JSON
    lacks; `strict_json` turns them into those strings for output that must be strict.
    """
    stack = [(value, path, 0)]
    while stack:
        value, path, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise UnsupportedValueError(
                f"{path} is nested more than {MAX_JSON_DEPTH} levels deep, which JSON readers "
                "refuse; flatten it, or keep such data in a file of its own."
            )
        if isinstance(value, int) and value.bit_length() > 14_000:
            try:
                str(value)
            except ValueError:  # over sys.get_int_max_str_digits()
                raise UnsupportedValueError(
                    f"{path} is an integer of more than {sys.get_int_max_str_digits()} digits, "
                    "which Python's JSON cannot write or read; store it as a string."
                ) from None
        if value is None or isinstance(value, str | int | float):  # (bool is an int)
            continue
        items: Iterable[tuple[Any, Any]]
        if isinstance(value, Mapping):
            for k in value:
                if not isinstance(k, str):
                    raise UnsupportedValueError(
                        f"{path} has the key {short(k)} of type {type(k).__name__}; JSON object "
                        "keys must be strings. Convert the key with str()."
                    )
            items = value.items()
        elif isinstance(value, list | tuple):
            items = enumerate(value)
        else:
            raise UnsupportedValueError(
                f"{path} is a {type(value).__module__}.{type(value).__qualname__} "
                f"({short(value)}), which is not JSON. meta= takes dicts with string keys, "
                "lists, strings, numbers, booleans and None; convert the value first (e.g. "
                ".item() for a NumPy scalar, str() for a path, or keep arrays in state=)."
            )
        children = [(v, f"{path}[{k!r}]", depth + 1) for k, v in items]
        stack.extend(reversed(children))  # the first bad value is the one reported


_NON_FINITE = {"nan": "NaN", "inf": "Infinity", "-inf": "-Infinity"}


def strict_json(value: Any) -> Any:
    """`value` with NaN and infinities as the strings "NaN", "Infinity" and "-Infinity" (the
    tokens Python's json writes for them), for documents that must be strict JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return _NON_FINITE[repr(value)]
    if isinstance(value, Mapping):
        return {k: strict_json(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [strict_json(v) for v in value]
    return value
