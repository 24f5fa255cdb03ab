"""Agreements between the processes of a job: each named by what it agrees, made by every
process, each wait bounded, and a named error on every process that arrived when another
does not (`ProcessesMissingError`) or arrived at another agreement (`ProcessesDisagreeError`).

An agreement is one barrier of JAX's coordination service and its key-value store (never
a collective, which waits for ever): each process sets what it agrees (`what`: the act and
its step, "the deletion of step 3") with what it brings, waits at the barrier, and reads
what the others set. Barriers pair in the order processes make them; the names are then
compared, so that two code paths can never pair up unnoticed: a process that took a branch
the others did not fails at once on every process, saying which agreement each made.

What several processes must agree on (which steps retention deletes, whether a step may be
saved, which step a restore reads) is decided once, by process 0 (`decided`), and handed
to all: never a condition each process evaluates alone from its own listing.

Each agreement waits at most the call's `timeout_s` from this process's own arrival
(`deadline`): a deadline on waiting for the others, never on work that is moving. A single
process agrees with itself at no cost.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import itertools
import json
from collections.abc import Callable, Iterator
from typing import Any

import jax

from jaxckpt import _internals, errors
from jaxckpt.errors import ConfigError, ProcessesDisagreeError, ProcessesMissingError

DEFAULT_TIMEOUT_S = 1200  # `CheckpointManager(timeout_s=...)`'s and `jaxckpt.open`'s default


@dataclasses.dataclass(frozen=True)
class Deadline:
    """How long each agreement of one call (`what`) waits for the others: `seconds` from
    this process's arrival; `setting` is the option that sets it, named by the error."""

    what: str
    seconds: float
    setting: str = "timeout_s"

    def ms(self) -> int:
        """The wait at one agreement, in milliseconds."""
        return max(1, int(self.seconds * 1000))

    def missing(self, error: BaseException) -> ProcessesMissingError:
        """The named error for a barrier that failed with JAX's `error`."""
        found = _internals.missing_processes(error)
        return ProcessesMissingError(self.what, found, self.seconds, self.setting)


_current: contextvars.ContextVar[Deadline | None] = contextvars.ContextVar(
    "jaxckpt_deadline", default=None
)
_numbers = itertools.count()  # the agreements this process made, in order: how they pair
# This process's keys of its last agreement: every process has read them once it passed
# the next barrier, which deletes them.
_stale: list[str] = []


def check_timeout(seconds: object, setting: str = "timeout_s") -> float:
    """`seconds` as a deadline's length: a positive number (ConfigError otherwise)."""
    if isinstance(seconds, bool) or not isinstance(seconds, int | float) or not seconds > 0:
        raise ConfigError(f"{setting} must be a positive number of seconds, got {seconds!r}")
    return float(seconds)


@contextlib.contextmanager
def deadline(what: str, seconds: float, setting: str = "timeout_s") -> Iterator[Deadline]:
    """Every agreement made in the block waits at most `seconds` from its arrival, and its
    error names the call (`what`). Inside a block that set one already, that one holds."""
    outer = _current.get()
    if outer is not None:
        yield outer
        return
    token = _current.set(Deadline(what, seconds, setting))
    try:
        yield _current.get()  # type: ignore[misc]  # (just set)
    finally:
        _current.reset(token)


def current() -> Deadline:
    """The deadline of the call being made (one of the default length where none was set)."""
    return _current.get() or Deadline("an agreement between processes", DEFAULT_TIMEOUT_S)


def barrier(what: str) -> None:
    """Waits until every process arrived at the agreement `what`."""
    if jax.process_count() > 1:
        _agree(what, None)


def refusing(what: str, problem: str | None) -> list[int]:
    """The processes that found a problem with `what` (this one's given), agreed by all."""
    if jax.process_count() == 1:
        return [] if problem is None else [0]
    brought = _agree(what, problem)
    return sorted(p for p, found in brought.items() if found is not None)


def together(what: str, attempt: Callable[[], object]) -> list[int]:
    """`attempt()` on every process, then agreed whether it failed anywhere: this process's
    own error raised here, else the processes whose attempt failed (empty: none did)."""
    failed = None
    try:
        attempt()
    except Exception as e:
        failed = e
    refused = refusing(what, None if failed is None else type(failed).__name__)
    if failed is not None:
        raise failed
    return refused


def gather(what: str, value: str) -> list[str]:
    """Every process's `value`, by process index, agreed by all."""
    if jax.process_count() == 1:
        return [value]
    brought = _agree(what, value)
    return [brought.get(i) or "" for i in range(jax.process_count())]


def decided(what: str, decide: Callable[[], str]) -> str:
    """`decide()`, run by process 0 alone, handed to every process: the one decision every
    process acts on. Where it raises, process 0 raises its error and every other process
    one of the same class where that is one of jaxckpt's (`ProcessFailedError` otherwise),
    saying that process 0 failed it, with the same plain attributes (`step`, `problems`)."""
    if jax.process_count() == 1:
        return decide()
    failed: Exception | None = None
    value: str | None = None
    if jax.process_index() == 0:
        try:
            value = json.dumps({"value": decide()})
        except Exception as e:
            failed = e
            plain = {k: v for k, v in vars(e).items() if _plain(v) and not k.startswith("_")}
            value = json.dumps({"error": type(e).__name__, "message": str(e), "about": plain})
    brought = _agree(what, value)
    if failed is not None:
        raise failed
    found = json.loads(brought.get(0) or "{}")
    if "value" in found:
        return str(found["value"])
    raise _carried(what, found)


def _plain(value: object) -> bool:
    """Whether `value` goes through JSON as it is (numbers, text, lists of them)."""
    if isinstance(value, list | tuple):
        return all(_plain(v) for v in value)
    return value is None or isinstance(value, bool | int | float | str)


def _carried(what: str, found: dict[str, Any]) -> Exception:
    """Process 0's failure to decide `what` (`decided`), raised on another process: of its
    class where that is one of jaxckpt's errors, with its plain attributes."""
    kind = str(found.get("error"))
    said = f"process 0 failed {what} for every process: {kind}: {found.get('message')}"
    cls = getattr(errors, kind, None)
    if not (isinstance(cls, type) and issubclass(cls, errors.JaxckptError)):
        return errors.ProcessFailedError(said)
    error = cls.__new__(cls)  # (its own __init__ takes what only process 0 has)
    Exception.__init__(error, said)
    for name, value in dict(found.get("about") or {}).items():
        setattr(error, name, value)
    return error


def _agree(what: str, value: str | None) -> dict[int, str | None]:
    """One agreement, `what`, of every process: each process's value, by process index.
    ProcessesMissingError when some do not arrive in time; ProcessesDisagreeError when
    some arrived at another agreement."""
    name = f"jaxckpt/agree/{next(_numbers)}"
    key = f"{name}/{jax.process_index()}"
    _internals.publish(key, json.dumps([what, value]))
    _stale.append(key)
    when = current()
    try:
        _internals.barrier(name, when.ms())
    except jax.errors.JaxRuntimeError as e:
        raise when.missing(e) from e
    for old in [k for k in _stale if not k.startswith(name + "/")]:
        _internals.delete(old)
        _stale.remove(old)
    brought = {
        int(k.rsplit("/", 1)[1]): json.loads(v) for k, v in _internals.published(name).items()
    }
    agreements = {p: str(found[0]) for p, found in brought.items()}
    if set(agreements.values()) != {what}:
        raise ProcessesDisagreeError(dict(sorted(agreements.items())))
    return {p: found[1] for p, found in brought.items()}
