"""When to save and which steps to keep: small frozen option objects and pure functions.

Time is never read here: callers pass the current time, so policies are tested without sleeping.

>>> policy = SavePolicy(every_steps=100)
>>> policy.due(step=200, seconds_since_last_save=3.0)
True
>>> RetentionPolicy(keep_last=2, keep_every=1000).steps_to_delete([500, 1000, 1500, 1600, 1700])
[500, 1500]
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from jaxckpt.errors import ConfigError


def _check_positive(policy: SavePolicy | RetentionPolicy) -> None:  # each field: a number or None
    for field in dataclasses.fields(policy):
        if (value := getattr(policy, field.name)) is not None and not value > 0:
            owner = type(policy).__name__
            raise ConfigError(f"{owner}.{field.name} must be positive or None, got {value!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class SavePolicy:
    """When `CheckpointManager.should_save(step)` is true.

    Attributes:
      every_steps: save at every step divisible by this number.
      every_seconds: save when this many seconds passed since the last save (or since the
        manager was created). With several processes, process 0's clock decides for all.

    Both rules may be combined; either one being due is enough. With neither set,
    `should_save` is always false and saving is left to the caller.
    """

    every_steps: int | None = None
    every_seconds: float | None = None

    def __post_init__(self) -> None:
        _check_positive(self)

    def due(self, *, step: int, seconds_since_last_save: float) -> bool:
        """Whether a save is due at `step`, by either rule."""
        if self.every_steps is not None and step % self.every_steps == 0:
            return True
        return self.every_seconds is not None and seconds_since_last_save >= self.every_seconds


@dataclasses.dataclass(frozen=True, kw_only=True)
class RetentionPolicy:
    """Which committed steps to keep; the rest are deleted after each commit.

    Attributes:
      keep_last: keep the newest N committed steps (None keeps all).
      keep_every: also keep every step divisible by K, forever (e.g. for evaluation).

    Only steps written by jaxckpt are ever deleted, and never the newest committed one.
    """

    keep_last: int | None = None
    keep_every: int | None = None

    def __post_init__(self) -> None:
        _check_positive(self)

    def steps_to_delete(self, committed: Iterable[int]) -> list[int]:
        """Which of the `committed` steps this policy deletes, oldest first."""
        steps = sorted(committed)
        if self.keep_last is None:
            return []
        recent = set(steps[-self.keep_last :])
        return [
            s
            for s in steps
            if s not in recent and not (self.keep_every is not None and s % self.keep_every == 0)
        ]
