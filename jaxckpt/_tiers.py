"""Which tier serves a restore, agreed by every process: the local tier (`LocalTier`) when
every process can restore the step from its own part, else the persistent directory.

    Tiers.restore
      _local_candidates        the newest steps whose every part is somewhere (a collective),
                               unless the persistent tier has a newer one
      _fetch_if_lost           a process lacking its part fetches it from a peer's copy
      _local_problem           each checks its part holds what the target needs; all agree
      read_trees               then the step is read, each process from its own directory
                               (`_read_step`)
      Reader.read              or, if none serves, the persistent tier

A `CheckpointManager` with no local tier reads through `Reader.read` alone.
"""

from __future__ import annotations

import dataclasses
import json
import logging

import jax

from jaxckpt import _agree, _iterators, _local, _transfer
from jaxckpt._agree import refusing
from jaxckpt._checks import check_step, gc_paused
from jaxckpt._read_step import Restored, Wanted, items, plan_item, read_trees
from jaxckpt._reader import Reader

log = logging.getLogger("jaxckpt")

_AGREED_STEPS = 32  # the newest local steps each process reports when they agree
_HELD = 128  # the most (step, owner) pairs of parts and copies a process reports


class Tiers:
    """The persistent tier's reader and, if set, this process's local store."""

    def __init__(self, persistent: Reader, local: _local.LocalStore | None):
        self.persistent, self.local = persistent, local

    def latest(self) -> int | None:
        """The newest committed step of either tier (with a local tier, agreed: a local step
        counts once every process's part of it exists, the persistent tier's newest is
        process 0's)."""
        if self.local is None:
            return self.persistent.latest()
        newest = self._persistent_latest()
        local = complete_steps(holdings(self.local))
        if local and (newest is None or local[-1] > newest):
            return local[-1]
        return newest

    def _persistent_latest(self) -> int | None:
        """The persistent tier's newest committed step, as process 0 lists it, for all."""
        found = _agree.decided(
            "the newest persistent step", lambda: json.dumps(self.persistent.latest())
        )
        return None if (newest := json.loads(found)) is None else int(newest)

    def restore(self, step: int | None, wanted: Wanted, fallback: bool) -> Restored:
        """The step from the tier that serves it (`step=None`: the newest of either)."""
        restored = None
        if self.local is not None and wanted.item is None:
            restored = self._restore_local(self.local, step, wanted)
        return restored or self.persistent.read(step, wanted, fallback)

    def _restore_local(
        self, local: _local.LocalStore, step: int | None, wanted: Wanted
    ) -> Restored | None:
        """The step from the local tier when every process can restore it from its own
        part (agreed: a collective), else None, with the reason logged. Without `step`: the
        newest local step every process holds, unless the persistent tier has a newer one."""
        held = holdings(local)
        steps = complete_steps(held)
        persistent = self._persistent_latest()
        if step is not None:
            steps = [s for s in steps if s == check_step(step)]
        elif persistent is not None and steps and steps[-1] < persistent:
            log.info(
                "restore: the persistent step %d is newer than the newest local step %d",
                persistent,
                steps[-1],
            )
        for candidate in reversed(steps):
            if step is None and persistent is not None and candidate < persistent:
                break
            problem = self._fetch_if_lost(local, candidate, held[candidate])
            problem = problem or self._local_problem(local, candidate, wanted)
            refused = refusing(f"the restore of local step {candidate}", problem)
            if not refused:
                with gc_paused():
                    return self._restore_local_step(local, candidate, wanted)
            log.warning(
                "restore: local step %d in %s is passed over: %s",
                candidate,
                local.directory,
                problem or f"process(es) {refused} cannot restore it (their logs say why)",
            )
        return None

    def _fetch_if_lost(
        self, local: _local.LocalStore, step: int, parts: dict[int, list[int]]
    ) -> str | None:
        """Agreed by all: which processes lack their own part of `step`, whole (checked
        against its manifest); each of those fetches it from the first peer keeping a copy
        (why not, if it could not)."""
        me = jax.process_index()
        own = local.own_problem(step)
        lost = refusing(f"the parts of local step {step} lost", own)
        if me not in lost:
            return None
        peers = [h for h in parts.get(me, []) if h != me]
        if not peers:
            return f"{own}, and no other process keeps a copy of it"
        return local.fetch(step, peers[0])

    def _local_problem(self, local: _local.LocalStore, step: int, wanted: Wanted) -> str | None:
        """Why this process cannot restore `step` from its local part, which is whole and
        its own (`_fetch_if_lost`): None if it can."""
        try:
            info = local.info(step)
            for item, target, home, partial in items(info, wanted):
                requests, _ = plan_item(info, item, target, home, partial)
                if problem := local.holds(info, item, requests):
                    return problem
            if wanted.data is not None:
                return _iterators.problem(info, wanted.data, wanted.mismatch_ok, local.directory)
        except Exception as e:  # the same target fails the persistent tier too: raised there
            return f"{type(e).__name__}: {_transfer.first_line(e)}"
        return None

    def _restore_local_step(self, local: _local.LocalStore, step: int, wanted: Wanted) -> Restored:
        info = local.info(step)
        restored = read_trees(local, info, wanted, self.persistent.budget)
        if wanted.data is not None:  # last: after everything else was read
            _iterators.restore(wanted.data, info, local.directory)
        log.info("restored step %d from the local tier (%s)", step, local.directory)
        return dataclasses.replace(restored, data=wanted.data, tier="local")


# --- agreement between processes (collectives: every process calls these in turn) ---------


def holdings(store: _local.LocalStore) -> dict[int, dict[int, list[int]]]:
    """Every process's local parts and copies, {step: {owner: [holders]}}, of the newest
    steps each reports (agreed by all, `_agree.gather`)."""
    me = jax.process_index()
    mine = [(s, me) for s in store.steps()[-_AGREED_STEPS:]]
    for owner, steps in store.copies().items():
        mine += [(s, owner) for s in steps[-_AGREED_STEPS:]]
    mine = sorted(mine, reverse=True)[:_HELD]
    found: dict[int, dict[int, list[int]]] = {}
    for holder, rows in enumerate(
        _agree.gather("the local steps each process holds", json.dumps(mine))
    ):
        for step, owner in json.loads(rows):
            found.setdefault(int(step), {}).setdefault(int(owner), []).append(holder)
    return found


def complete_steps(held: dict[int, dict[int, list[int]]]) -> list[int]:
    """The steps of which every process's part is somewhere, oldest first."""
    owners = set(range(jax.process_count()))
    return sorted(s for s, parts in held.items() if owners <= set(parts))
