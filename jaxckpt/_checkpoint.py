"""`jaxckpt.open(directory)` and the `Checkpoint` it returns: a checkpoint read by a
program that does not write it; and `jaxckpt.verify`.

The public face of `_reader.Reader`, which does the work for these, the manager and the
CLI alike: what a `Checkpoint` shows is what "API at a glance" documents, nothing more.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from etils import epath

from jaxckpt import _agree, _reader
from jaxckpt._integrity import StepReport
from jaxckpt._plan import RestorePlan
from jaxckpt._read_step import Restored, Wanted
from jaxckpt._store_errors import naming_its_store


def open(
    directory: str | os.PathLike[str],
    *,
    verify: bool = True,
    restore_inflight_bytes: int | None = None,
    timeout_s: float = _agree.DEFAULT_TIMEOUT_S,
) -> Checkpoint:
    """Opens a checkpoint directory to read: jaxckpt's, or one plain Orbax or Flax wrote.

    Takes no lock and writes nothing; close it (or use it as a context manager).

    >>> import jax.numpy as jnp, numpy as np, tempfile, jaxckpt
    >>> directory = tempfile.mkdtemp()
    >>> with jaxckpt.CheckpointManager(directory) as mngr:
    ...     mngr.save(7, state={"w": jnp.arange(3.0)})
    >>> with jaxckpt.open(directory) as ckpt:
    ...     ckpt.steps(), ckpt.read(state={"w": np.zeros(3, np.float32)}).state["w"].tolist()
    ([7], [0.0, 1.0, 2.0])

    Args:
      directory: a local path or `gs://bucket/prefix`.
      verify: check each step's files against its manifest as it is read.
      restore_inflight_bytes: read leaves in batches of at most this many bytes per
        process (None: 128 MiB, or a quarter of the host's memory where that is less).
      timeout_s: in a job of several processes, how long one read waits for the others,
        in all (ProcessesMissingError naming those that did not come).
    """
    reader = _reader.open_reader(
        directory,
        verify=verify,
        restore_inflight_bytes=restore_inflight_bytes,
        timeout_s=timeout_s,
    )
    return Checkpoint(reader)


class Checkpoint:
    """A checkpoint directory, open to read: its steps, a step's `meta=`, restore plans,
    reads onto a target and verification. Made by [`jaxckpt.open`][jaxckpt.open]."""

    def __init__(self, reader: _reader.Reader):
        self._reader = reader

    @property
    def directory(self) -> epath.Path:
        """The directory, as a path (`etils.epath.Path`: local, gs:// or s3://)."""
        return self._reader.directory

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        """Closes its store; reading after that is an error."""
        self._reader.close()

    def steps(self) -> list[int]:
        """The committed steps, oldest first: jaxckpt's and those plain Orbax wrote."""
        return self._reader.steps()

    def latest(self) -> int | None:
        """The newest committed step (None: none). It looks only at the step folders from
        the newest down to it; step-like folders it meets that no one can read are logged
        as warnings, each once, and where there is nothing else the warning says that a
        resume from here starts over."""
        return self._reader.latest()

    def meta(self, step: int | None = None) -> Any:
        """The `meta=` saved with a step (None: the latest committed), reading no array."""
        return self._reader.meta(step)

    def plan(
        self, step: int | None = None, *, state: Any, partial: bool = False, item: str | None = None
    ) -> RestorePlan:
        """A restore dry-run of `state`
        ([`CheckpointManager.plan`][jaxckpt.CheckpointManager.plan])."""
        return self._reader.plan(step, state=state, partial=partial, item=item)

    @naming_its_store("reading a step")
    def read(
        self,
        step: int | None = None,
        *,
        state: Any = None,
        rng: Any = None,
        data: Any = None,
        partial: bool = False,
        fallback: bool = False,
        data_mismatch_ok: bool = False,
        item: str | None = None,
    ) -> Restored:
        """A committed step onto a target (`step=None`: the latest committed one), verified
        against its manifest; the arguments are
        [`CheckpointManager.restore`][jaxckpt.CheckpointManager.restore]'s.

        >>> import jax.numpy as jnp, numpy as np, tempfile, jaxckpt
        >>> directory = tempfile.mkdtemp()
        >>> with jaxckpt.CheckpointManager(directory) as mngr:
        ...     for step in (1, 2):
        ...         mngr.save(step, state={"w": jnp.full(2, float(step)), "b": jnp.zeros(2)})
        >>> with jaxckpt.open(directory) as ckpt:  # the leaves a target names, of step 1
        ...     ckpt.read(1, state={"w": np.zeros(2, np.float32)}, partial=True).state
        {'w': array([1., 1.], dtype=float32)}
        """
        wanted = Wanted(state, rng, data, data_mismatch_ok, partial, item)
        return self._reader.read(step, wanted, fallback)

    def verify(
        self, step: int | None = None, *, progress: Callable[[int, int, int], None] | None = None
    ) -> list[StepReport]:
        """Verifies every committed step (or one); reads, never writes.

        Also reports step folders that look like damaged jaxckpt steps: empty, or holding a
        `jaxckpt/` folder without its metadata. Folders jaxckpt did not write are not judged.
        A step plain Orbax wrote has no manifest: each of its arrays is read whole instead,
        and its report says it is not checksummed (`StepReport.checksummed`).
        `progress(step, bytes checked, bytes to check)` is called as the files are read."""
        return self._reader.verify(step, progress=progress)


def verify(
    directory: str | os.PathLike[str],
    step: int | None = None,
    *,
    progress: Callable[[int, int, int], None] | None = None,
) -> list[StepReport]:
    """Verifies every committed step (or one) of a checkpoint directory; reads, never writes
    ([`Checkpoint.verify`][jaxckpt.Checkpoint.verify])."""
    with open(directory) as ckpt:
        return ckpt.verify(step, progress=progress)
