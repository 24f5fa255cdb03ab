"""The local tier's copies of each process's part (`jaxckpt._local`): which peers hold this
process's part and whose parts it keeps, each part sent in a thread a holder (one in
flight and one waiting: a newer step replaces an older one not sent yet), the copies owners
put here, and `settle`, the bounded wait for the newest step's copies."""

from __future__ import annotations

import logging
import threading
import time

import jax

from jaxckpt import _peers

log = logging.getLogger("jaxckpt")


class Copies:
    """This process's copies: its parts sent to their holders, in a thread a holder (at
    most one copy in flight to it and one waiting: a newer step replaces an older one not
    sent yet), and the copies its owners put here (`tried`, from the listener)."""

    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s
        # Under `_changed`: the step waiting to go to each holder, the newest step each
        # holder answered (copy in place, or failed), the newest step each owner put here
        # (or tried to).
        self._changed = threading.Condition()
        self._waiting: dict[int, int | None] = {}
        self._answered: dict[int, int] = {}
        self._received: dict[int, int] = {}
        self._closed = False
        self._peers: _peers.Peers | None = None  # from `start` on

    @property
    def peers(self) -> _peers.Peers:
        """The peers, once `start`ed: every copy sent and every settle comes after it."""
        if self._peers is None:
            raise RuntimeError("the local tier's copies were used before they started")
        return self._peers

    def start(self, peers: _peers.Peers, replicas: int) -> None:
        me, machines = jax.process_index(), [a.machine for a in peers.addresses]
        holders = _peers.holders(me, machines, replicas)
        owners = [o for o in range(len(machines)) if me in _peers.holders(o, machines, replicas)]
        self._peers, self._me = peers, me
        with self._changed:
            self._waiting = dict.fromkeys(holders)
            self._answered = dict.fromkeys(holders, -1)
            self._received = {o: self._received.get(o, -1) for o in owners}
        for h in holders:
            name = f"jaxckpt-copies-to-{h}"
            threading.Thread(target=self._send, args=(h,), name=name, daemon=True).start()

    def close(self) -> None:
        with self._changed:
            self._closed = True
            self._changed.notify_all()

    def send(self, step: int) -> None:
        """Offers this process's part of `step` to its holders; returns at once."""
        with self._changed:
            for h in self._waiting:
                self._waiting[h] = step
            self._changed.notify_all()

    def tried(self, owner: int, step: int) -> None:
        with self._changed:
            if self._peers is None or owner in self._received:  # before `start`: any
                self._received[owner] = max(self._received.get(owner, -1), step)
                self._changed.notify_all()

    def forget(self, step: int) -> None:
        """The copies put here of steps from `step` on are gone (another timeline)."""
        with self._changed:
            for owner, got in self._received.items():
                self._received[owner] = min(got, step - 1)

    def settle(self, step: int) -> None:
        """Waits, at most `timeout_s`, until every holder answered the copy of `step` (or a
        newer one) and every owner whose copies this process keeps put its own here (an
        owner whose listener refuses connections is gone: not waited for); logs a warning
        naming each peer that did not."""
        deadline = time.monotonic() + self.timeout_s
        gone: set[int] = set()
        while True:
            with self._changed:
                holders = [h for h, s in self._answered.items() if s < step]
                owners = [o for o, s in self._received.items() if s < step and o not in gone]
                left = deadline - time.monotonic()
                if not (holders or owners) or left <= 0 or self._closed:
                    break
                self._changed.wait(min(left, 1.0))
            gone.update(o for o in owners if self.peers.refuses(o))
        late = f"within {self.timeout_s:.0f} s (stopped or overloaded?)"
        said = [(o, "is gone (it refuses connections): its copy will not come") for o in gone]
        said += [(h, f"did not answer this process's copy of step {step} {late}") for h in holders]
        said += [
            (o, f"did not answer: its copy of step {step} did not arrive {late}") for o in owners
        ]
        for peer, what in sorted(said):
            log.warning(
                "local tier: %s %s; the step stands on each process's own part",
                self.peers.where(peer),
                what,
            )

    def _send(self, holder: int) -> None:
        while True:
            with self._changed:
                while (step := self._waiting[holder]) is None and not self._closed:
                    self._changed.wait()
                if step is None or self._closed:  # (nothing waiting: only once closed)
                    return
                self._waiting[holder] = None
            try:
                self.peers.put(holder, self._me, step, str(step))
            except FileNotFoundError:  # deleted meanwhile: a newer step replaced it
                log.info("local tier: step %d was deleted before its copy went", step)
            except Exception as e:  # never the end of this thread: the next copy may go
                if not self.peers.closed:
                    where = self.peers.where(holder)
                    why = e if isinstance(e, _peers.PeerError) else f"{where}: {e!r}"
                    log.warning(
                        "local tier: no copy of step %d: %s; the step stands on this "
                        "process's own part",
                        step,
                        why,
                    )
            with self._changed:
                self._answered[holder] = max(self._answered[holder], step)
                self._changed.notify_all()
