"""Preemption notices, and the step every process of a job agrees to save at after one.

One process: a handler for the policy's signals (SIGTERM by default) sets a flag, and the
next `should_save(step)` is true; so is the first at which the policy's `check()` is.

Several processes: a notice on any of them (a signal, `check()`) makes every process save
the same step, agreed through the key-value store of JAX's coordination service, whose
waits end (`Round`). Not through JAX's own preemption service: it waits for every process
in a barrier that holds the training thread and that nothing ends, nor through a
collective, which waits for ever.

- Until a notice, `should_save` makes no request: each process's `Round` has a thread
  blocked in one request (renewed every few minutes) on a key of its own.
- The process that gets the notice sets that key for every process: each one's thread
  then publishes the last step its training thread passed to `should_save`, without
  waiting for that thread, which may be in a step whose collectives wait for this one.
- The agreed step is the largest published one plus one: no process has passed it. A
  process reads the published steps at each `should_save` until all are there, and once
  its step could be the agreed one it waits for those missing, so that none passes it.
- A process still missing `timeout_s` after this one learnt of the notice makes
  `should_save` raise `ProcessesMissingError`, naming it.

`SavePolicy.every_seconds` with several processes is the same agreement (`TimedSaves`):
process 0's clock gives the notice, one `Round` a save, and its keys go after the next.

Only the first signal is a notice. Any later one of the policy's signals is handled as it was
before jaxckpt caught it, so a second SIGTERM ends the process (SIGTERM's default action), also
while the main thread is blocked in a long `restore()` or `wait()`: they block in waits that
run Python's signal handlers (lock waits, the asyncio loop, tensorstore futures). SIGINT is
never caught unless it is one of the policy's signals: Ctrl-C raises KeyboardInterrupt as
always, before or after a notice.
"""

from __future__ import annotations

import atexit
import dataclasses
import itertools
import logging
import signal
import threading
import time
import weakref
from collections.abc import Callable
from types import FrameType
from typing import Any

import jax

from jaxckpt import _internals
from jaxckpt._policy import SavePolicy
from jaxckpt.errors import ConfigError, ProcessesMissingError

log = logging.getLogger("jaxckpt")

# What signal.signal takes and returns: a Python handler, SIG_DFL, SIG_IGN, or None (a
# handler set outside Python).
_Handler = Callable[[int, FrameType | None], Any] | int | signal.Handlers | None

_POLL_MS = 300_000  # a listening thread's one request to the coordination service, renewed
_SLICE_MS = 500  # a training thread waits in slices: the signals' Python handlers run between
_JOIN_S = 5.0  # how long `close` waits for its listening thread to hear "stop"
_STOP = "stop"


@dataclasses.dataclass(frozen=True, kw_only=True)
class PreemptionPolicy:
    """How a preemption notice reaches `CheckpointManager.should_save`.

    Attributes:
      enabled: whether a notice makes `should_save` true (and `preempted` set).
      signals: signals that mean "about to be preempted". Only the first is a notice: a
        later one is handled as before jaxckpt caught it (a second SIGTERM ends the
        process, even while `restore` or `wait` blocks).
      check: called at every `should_save` until a notice; True means one arrived (e.g. a
        poll of the cloud's maintenance-event endpoint).
      timeout_s: with several processes, how long after a notice each one waits for the
        others to agree on the step to save; then `should_save` raises
        `ProcessesMissingError`, naming those that did not come (stopped or dead).
    """

    enabled: bool = True
    signals: tuple[int, ...] = (signal.SIGTERM,)
    check: Callable[[], bool] | None = None
    timeout_s: float = 60

    def __post_init__(self) -> None:
        if not all(isinstance(s, int) for s in self.signals):
            raise ConfigError(
                f"PreemptionPolicy.signals must be signal numbers, got {self.signals!r}"
            )
        seconds = self.timeout_s
        if isinstance(seconds, bool) or not isinstance(seconds, int | float) or not seconds > 0:
            raise ConfigError(
                f"PreemptionPolicy.timeout_s must be a positive number of seconds, got {seconds!r}"
            )


_managers = itertools.count()  # of a job's managers, made in the same order on every process


def namespace() -> str:
    """The keys of a new manager's agreements: managers are made by every process of a job
    in the same order (each one's opening is agreed), so each has the same number on all."""
    return f"jaxckpt/notices/{next(_managers)}"


_listening: weakref.WeakSet[Round] = weakref.WeakSet()
_atexit_set = False


def _stop_all() -> None:
    """At exit, each listening thread told to stop before JAX's own exit handler ends the
    coordination client: a thread whose request ends while the interpreter is being torn
    down takes the process with it (std::terminate)."""
    for round_ in list(_listening):
        round_.stop()


class Round:
    """One agreement of the processes of a job on a step to save, started by a notice on
    any of them (see the module's docstring). `last` is the last step this process's
    training thread passed to `should_save`: it sets it before it looks for a notice.
    `what` names the agreement in `ProcessesMissingError`, `reason` the save's reason."""

    def __init__(
        self,
        prefix: str,
        *,
        what: str,
        reason: str,
        timeout_s: float,
        setting: str,
        last: int = -1,
    ):
        global _atexit_set
        self.last = last
        self._prefix = prefix
        self._what, self._reason = what, reason
        self._timeout_s, self._setting = timeout_s, setting
        self._me, self._n = jax.process_index(), jax.process_count()
        self._known = threading.Event()  # of a notice, this process's or another's
        self._lock = threading.Lock()  # one publication of this process's step
        self._since = 0.0  # when this process learnt of the notice
        self._agreed: int | None = None
        self._stopping = False
        self._thread = threading.Thread(target=self._listen, name="jaxckpt-notices", daemon=True)
        if not _atexit_set:  # registered after JAX's, so it runs before
            atexit.register(_stop_all)
            _atexit_set = True
        _listening.add(self)
        self._thread.start()

    def _key(self, kind: str, process: int) -> str:
        return f"{self._prefix}/{kind}/{process}"

    @property
    def known(self) -> bool:
        """Whether a notice reached this process."""
        return self._known.is_set()

    def notice(self, why: str) -> None:
        """This process got a notice: every process's thread is woken."""
        for process in range(self._n):
            _internals.publish(self._key("wake", process), why)
        self._learn()

    def reached(self, step: int) -> bool:
        """Once a notice is known: whether `step` is the agreed step. Raises
        ProcessesMissingError if the others did not all publish theirs in time."""
        if self._agreed is None:
            self._learn()  # (done already, but perhaps still in the listening thread)
            self._agreed = self._agree(step)
            if self._agreed is None:
                return False
        if step > self._agreed:
            raise ConfigError(
                f"should_save({step}) came after step {self._agreed}, which every process "
                f"agreed to save for {self._reason}: call should_save at every step, on every "
                "process, with the same step numbers"
            )
        return step == self._agreed

    def _learn(self) -> None:
        """Publishes this process's last step, once: the step it will not pass until the
        agreement is known."""
        with self._lock:
            if self._known.is_set():
                return
            self._since = time.monotonic()
            # Set before `last` is read: the training thread sets `last` before it looks.
            self._known.set()
            _internals.publish(self._key("step", self._me), str(self.last))

    def _agree(self, step: int) -> int | None:
        """The agreed step, once every process published its own; None while `step` is
        before any step a process published (the agreed one is later, whoever is
        missing); else waits for the missing ones, until the deadline."""
        end = self._since + self._timeout_s
        while True:
            found = {
                int(key.rsplit("/", 1)[1]): int(value)
                for key, value in _internals.published(f"{self._prefix}/step").items()
            }
            if len(found) == self._n:
                return max(found.values()) + 1
            missing = [process for process in range(self._n) if process not in found]
            left = end - time.monotonic()
            if left <= 0:
                raise ProcessesMissingError(self._what, missing, self._timeout_s, self._setting)
            if found and step <= max(found.values()):
                return None
            _internals.wait_for(self._key("step", missing[0]), int(min(left * 1000, _SLICE_MS)))

    def _listen(self) -> None:
        """The listening thread: learns of another process's notice as it is given."""
        try:
            while not self._stopping:
                why = _internals.wait_for(self._key("wake", self._me), _POLL_MS)
                if why is not None and not self._stopping:
                    self._learn()
                    return
        except Exception as e:  # the job's coordination service is gone: the job is ending
            log.debug("jaxckpt stopped listening for notices: %s", e)
        finally:
            _listening.discard(self)

    def stop(self) -> None:
        """Stops the listening thread (its own key set to "stop"), and deletes that key."""
        if self._stopping:
            return
        self._stopping = True
        _listening.discard(self)
        try:
            if self._thread.is_alive():
                _internals.publish(self._key("wake", self._me), _STOP)
                self._thread.join(_JOIN_S)
            _internals.delete(self._key("wake", self._me))
        except Exception as e:  # the coordination service is gone already
            log.debug("jaxckpt could not stop listening for notices: %s", e)


class TimedSaves:
    """`SavePolicy.every_seconds` in a job of several processes: clocks differ between
    hosts, so process 0's decides, as a notice; every process saves the step agreed after
    it (a `Round`), the next round starting there. Process 0 deletes a round's keys once
    the next is agreed: every process has then read them."""

    def __init__(self, prefix: str, every_seconds: float, timeout_s: float):
        self._prefix, self._every, self._timeout_s = prefix, every_seconds, timeout_s
        self._first = jax.process_index() == 0
        self._number = 0
        self._round = self._start(-1)

    def _start(self, last: int) -> Round:
        return Round(
            f"{self._prefix}/timed/{self._number}",
            what="the agreement on the step to save for SavePolicy.every_seconds",
            reason="SavePolicy.every_seconds",
            timeout_s=self._timeout_s,
            setting="timeout_s",
            last=last,
        )

    def due(self, step: int, seconds_since_last_save: float) -> bool:
        """Whether `step` is saved for every_seconds; call at every step, on every process."""
        round_ = self._round
        round_.last = step  # before the notice is looked for (`Round`)
        if not round_.known:
            if not self._first or seconds_since_last_save < self._every:
                return False
            round_.notice("every_seconds")
        if not round_.reached(step):
            return False
        if self._first and self._number > 0:
            _internals.delete(f"{self._prefix}/timed/{self._number - 1}")
        self._number += 1
        self._round = self._start(step)
        return True

    def close(self) -> None:
        self._round.stop()


class PreemptionWatcher:
    """Installs the policy's signal handlers; says when the agreed preemption step is reached.

    `prefix`: the keys of the agreement (`namespace()`), in a job of several processes."""

    def __init__(self, policy: PreemptionPolicy, prefix: str = ""):
        self._policy = policy
        self._noticed = threading.Event()
        self._previous: dict[int, _Handler] = {}
        self._round: Round | None = None
        self.preempted = False
        if not policy.enabled:
            return
        if jax.process_count() > 1:
            self._round = Round(
                f"{prefix}/preemption",
                what="the preemption agreement",
                reason="a preemption",
                timeout_s=policy.timeout_s,
                setting="PreemptionPolicy.timeout_s",
            )
        signals = list(policy.signals)
        if signals and threading.current_thread() is not threading.main_thread():
            log.warning(
                "preemption signals can only be caught from the main thread; ignoring %s", signals
            )
            return
        # With several processes this replaces JAX's own SIGTERM handler (its preemption
        # service), which Python reports as SIG_DFL: it is never put back.
        for sig in signals:
            self._previous[sig] = signal.signal(sig, self._on_signal)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if not self._noticed.is_set():
            # Set before logging: Python may run the next signal's handler inside this one
            # (in the logging call), which must then see the notice and escalate.
            self._noticed.set()
            log.warning(
                "preemption notice: signal %s; %s",
                signum,
                "the next should_save() is true"
                if self._round is None
                else "the processes agree on the step to save from the next should_save()",
            )
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
        round_ = self._round
        if round_ is None:  # one process: at once
            self.preempted = self._noticed.is_set() or bool(
                self._policy.check and self._policy.check()
            )
            return self.preempted
        round_.last = step  # before the notice is looked for (`Round`)
        if not round_.known:
            if not (self._noticed.is_set() or (self._policy.check and self._policy.check())):
                return False
            log.warning("preemption notice at step %d: telling every process", step)
            round_.notice("preemption")
        self.preempted = round_.reached(step)
        return self.preempted

    def close(self) -> None:
        """Puts back the signal handlers that were there before; stops listening."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
        if self._round is not None:
            self._round.stop()


class Notices:
    """Why `should_save` is true at a step, beside the local tier: a preemption (the
    watcher's agreed step) and the save policy, whose `every_seconds` is agreed with several
    processes. Each agreement is asked at every step, whichever answer comes first."""

    def __init__(
        self,
        policy: SavePolicy,
        preemption: PreemptionPolicy,
        *,
        timeout_s: float,
        read_only: bool,
    ):
        if read_only:
            preemption = PreemptionPolicy(enabled=False)
        prefix = namespace() if jax.process_count() > 1 and not read_only else ""
        self._policy = policy
        self._watcher = PreemptionWatcher(preemption, prefix)
        every = policy.every_seconds
        self._timed = TimedSaves(prefix, every, timeout_s) if prefix and every else None

    @property
    def preempted(self) -> bool:
        return self._watcher.preempted

    def at(self, step: int, seconds_since_last_save: float) -> tuple[bool, bool]:
        """(for a preemption, per the save policy) at `step`."""
        preempting = self._watcher.reached(step)
        if self._timed is None:
            return preempting, self._policy.due(
                step=step, seconds_since_last_save=seconds_since_last_save
            )
        every = self._policy.every_steps
        timed = self._timed.due(step, seconds_since_last_save)
        return preempting, timed or bool(every and step % every == 0)

    def close(self) -> None:
        self._watcher.close()
        if self._timed is not None:
            self._timed.close()
