"""Preemption notices: turn a signal or a callback on any process into one agreed save step.

One process: a handler for the policy's signals (SIGTERM by default) sets a flag; the next
`should_save(step)` is true. Several processes: SIGTERM goes through JAX's own preemption
service (`multihost_utils.reached_preemption_sync_point`), which agrees on the first step
that every process can still reach; other signals and the `check` callback are OR-ed over
all processes at each call, so every process sees the notice at the same step.

Only the first signal is a notice. Any later one of the policy's signals is handled as it was
before jaxckpt caught it, so a second SIGTERM ends the process (SIGTERM's default action), also
while the main thread is blocked in a long `restore()` or `wait()`: they block in waits that
run Python's signal handlers (lock waits, the asyncio loop, tensorstore futures). SIGINT is
never caught unless it is one of the policy's signals: Ctrl-C raises KeyboardInterrupt as
always, before or after a notice.
"""

from __future__ import annotations

import dataclasses
import logging
import signal
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

from jaxckpt.errors import ConfigError

log = logging.getLogger("jaxckpt")

# What signal.signal takes and returns: a Python handler, SIG_DFL, SIG_IGN, or None (a
# handler set outside Python).
_Handler = Callable[[int, FrameType | None], Any] | int | signal.Handlers | None


@dataclasses.dataclass(frozen=True, kw_only=True)
class PreemptionPolicy:
    """How a preemption notice reaches `CheckpointManager.should_save`.

    Attributes:
      enabled: whether a notice makes `should_save` true (and `preempted` set).
      signals: signals that mean "about to be preempted". With several processes, SIGTERM is
        handled by JAX's preemption service (`jax.distributed` installs it). Only the first
        is a notice: a later one is handled as before jaxckpt caught it (a second SIGTERM
        ends the process, even while `restore` or `wait` blocks).
      check: called at every `should_save`; True means a notice arrived (e.g. a poll of the
        cloud's maintenance-event endpoint). With several processes it costs a small
        collective per call.
    """

    enabled: bool = True
    signals: tuple[int, ...] = (signal.SIGTERM,)
    check: Callable[[], bool] | None = None

    def __post_init__(self) -> None:
        if not all(isinstance(s, int) for s in self.signals):
            raise ConfigError(
                f"PreemptionPolicy.signals must be signal numbers, got {self.signals!r}"
            )


class PreemptionWatcher:
    """Installs the policy's signal handlers; says when the agreed preemption step is reached."""

    def __init__(self, policy: PreemptionPolicy):
        self._policy = policy
        self._noticed = threading.Event()
        self._previous: dict[int, _Handler] = {}
        self._multi = jax.process_count() > 1
        self.preempted = False
        if not policy.enabled:
            return
        signals = [s for s in policy.signals if not (self._multi and s == signal.SIGTERM)]
        if signals and threading.current_thread() is not threading.main_thread():
            log.warning(
                "preemption signals can only be caught from the main thread; ignoring %s", signals
            )
            return
        for sig in signals:
            self._previous[sig] = signal.signal(sig, self._on_signal)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if not self._noticed.is_set():
            # Set before logging: Python may run the next signal's handler inside this one
            # (in the logging call), which must then see the notice and escalate.
            self._noticed.set()
            log.warning("preemption notice: signal %s; the next should_save() is true", signum)
            return
        # A signal after the notice: what it did before jaxckpt caught it (the default
        # action for SIGTERM: the process dies by the signal; KeyboardInterrupt for SIGINT).
        previous = self._previous.get(signum, signal.SIG_DFL)
        log.warning(
            "signal %s after the preemption notice: handled as before jaxckpt caught it", signum
        )
        if previous == signal.SIG_IGN:
            return
        if callable(previous):  # a Python handler, e.g. SIGINT's default_int_handler
            previous(signum, frame)
            return
        # SIG_DFL, or None: a handler set outside Python, which Python cannot call.
        signal.signal(signum, signal.SIG_DFL)
        signal.raise_signal(signum)  # SIGTERM's default action ends the process here

    def reached(self, step: int) -> bool:
        """True once: at the step every process saves for a preemption. Call at every step."""
        if not self._policy.enabled or self.preempted:
            return False
        local = self._noticed.is_set() or bool(self._policy.check and self._policy.check())
        if self._multi:  # SIGTERM through JAX's service; the rest OR-ed over all processes
            agreed = multihost_utils.reached_preemption_sync_point(step)
            if self._previous or self._policy.check is not None:
                agreed |= bool(np.any(multihost_utils.process_allgather(np.bool_(local))))
            local = agreed
        self.preempted = local
        return local

    def close(self) -> None:
        """Puts back the signal handlers that were there before."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
