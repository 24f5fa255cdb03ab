"""Agreements between the processes of a job, each wait bounded by the deadline of the call
that makes it, and a named error (`ProcessesMissingError`) on every process that arrived
when another does not.

An agreement is one barrier of JAX's coordination service and its key-value store (never
a collective, which waits for ever): each process sets what it brings, waits at the barrier
for what is left of the deadline, and reads what the others brought. A process that comes
after the deadline gets the error at once; the job must then restart, since its processes
no longer agree. Every process makes the same agreements in the same order (they are
numbered), as a collective would; a single process agrees with itself at no cost.

The deadline is the call's (`deadline`): a save, a restore, opening a manager each set
one, and every agreement inside shares it, so that the call waits at most that long in
all, not that long per agreement.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import itertools
import time
from collections.abc import Callable, Iterator

import jax

from jaxckpt import _internals
from jaxckpt.errors import ConfigError, ProcessesMissingError

DEFAULT_TIMEOUT_S = 1200  # `CheckpointManager(timeout_s=...)`'s and `jaxckpt.open`'s default


@dataclasses.dataclass(frozen=True)
class Deadline:
    """When the agreements of one call (`what`) give up: `seconds` after it started;
    `setting` is the option that sets it, named by the error."""

    what: str
    seconds: float
    setting: str = "timeout_s"
    end: float = dataclasses.field(default_factory=time.monotonic)

    def __post_init__(self) -> None:
        object.__setattr__(self, "end", self.end + self.seconds)

    def remaining_ms(self) -> int:
        """What is left, in milliseconds (at least 1: a barrier past its deadline still
        names who is missing)."""
        return max(1, int((self.end - time.monotonic()) * 1000))

    def missing(self, error: BaseException) -> ProcessesMissingError:
        """The named error for a barrier that failed with JAX's `error`."""
        found = _internals.missing_processes(error)
        return ProcessesMissingError(self.what, found, self.seconds, self.setting)


_current: contextvars.ContextVar[Deadline | None] = contextvars.ContextVar(
    "jaxckpt_deadline", default=None
)
_numbers = itertools.count()  # the agreements this process made, in order
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
    """Bounds every agreement made in the block by `seconds` from now, in all. Inside a
    block that set one already, that one holds: it is the call's."""
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


def barrier() -> None:
    """Waits until every process arrived here (ProcessesMissingError by the deadline)."""
    if jax.process_count() > 1:
        _meet(_name())


def refusing(problem: str | None) -> list[int]:
    """The processes that found a problem (this one's given), agreed by all; only those
    with a problem set a key."""
    if jax.process_count() == 1:
        return [] if problem is None else [0]
    name = _name()
    if problem is not None:
        _publish(name, problem)
    _meet(name)
    return sorted(int(key.rsplit("/", 1)[1]) for key in _internals.published(name))


def together(attempt: Callable[[], object]) -> list[int]:
    """`attempt()` on every process, then agreed whether it failed anywhere: this process's
    own error raised here, else the processes whose attempt failed (empty: none did)."""
    failed = None
    try:
        attempt()
    except Exception as e:
        failed = e
    refused = refusing(None if failed is None else type(failed).__name__)
    if failed is not None:
        raise failed
    return refused


def gather(value: str) -> list[str]:
    """Every process's `value`, by process index, agreed by all."""
    if jax.process_count() == 1:
        return [value]
    name = _name()
    _publish(name, value)
    _meet(name)
    found = _internals.published(name)
    return [found.get(f"{name}/{i}", "") for i in range(jax.process_count())]


def _name() -> str:
    return f"jaxckpt/agree/{next(_numbers)}"


def _publish(name: str, value: str) -> None:
    key = f"{name}/{jax.process_index()}"
    _internals.publish(key, value)
    _stale.append(key)


def _meet(name: str) -> None:
    when = current()
    try:
        _internals.barrier(name, when.remaining_ms())
    except jax.errors.JaxRuntimeError as e:
        raise when.missing(e) from e
    for key in [k for k in _stale if not k.startswith(name + "/")]:
        _internals.delete(key)
        _stale.remove(key)
