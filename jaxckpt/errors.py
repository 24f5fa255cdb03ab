"""Exceptions raised by jaxckpt.

Every error says what is wrong, names the leaf path or step involved, shows both sides where
there are two, and says how to fix it. Catch :class:`JaxckptError` to handle them all.
"""

from __future__ import annotations

from collections.abc import Sequence


class JaxckptError(Exception):
    """Base class of every error jaxckpt raises on purpose."""


class ConfigError(JaxckptError, ValueError):
    """An option or policy has an invalid value."""


class NoCheckpointError(JaxckptError, FileNotFoundError):
    """The directory holds no committed checkpoint."""


class StepNotFoundError(JaxckptError, KeyError):
    """The requested step is not a committed checkpoint in the directory."""

    def __init__(self, step: int, available: Sequence[int], directory: str, *, why: str = ""):
        self.step = step
        self.available = list(available)
        super().__init__(
            f"step {step} is not a committed checkpoint in {directory}{why}; "
            f"available steps: {_steps(self.available)}. "
            "Pass one of them, or step=None for the latest."
        )

    def __str__(self) -> str:  # KeyError would quote the message otherwise.
        return str(self.args[0])


class StepExistsError(JaxckptError, FileExistsError):
    """A checkpoint for this step already exists; jaxckpt never overwrites one."""


class TreeMismatchError(JaxckptError, ValueError):
    """The restore target's tree does not match the saved tree (missing or extra leaves)."""


class LeafMismatchError(JaxckptError, ValueError):
    """A leaf of the restore target differs from the saved leaf in shape or dtype."""


class ShardingError(JaxckptError, ValueError):
    """A restore-target leaf's sharding cannot hold the saved array."""


class MissingShardingError(ShardingError):
    """A restore-target leaf does not say where its data should land."""


class UnsupportedValueError(JaxckptError, TypeError):
    """A value cannot be checkpointed (a non-JSON `meta` value, an object leaf, ...)."""


class DataStateError(JaxckptError, ValueError):
    """The data-iterator state cannot be saved or restored."""


class CorruptCheckpointError(JaxckptError, OSError):
    """A step's files do not match its manifest, or its metadata is unreadable."""

    def __init__(self, step: int, problems: Sequence[str], directory: str):
        self.step = step
        self.problems = list(problems)
        listing = "; ".join(self.problems[:10]) + (" ..." if len(self.problems) > 10 else "")
        super().__init__(
            f"step {step} in {directory} is corrupt: {listing}. Restore another step, or pass "
            "fallback=True to restore the newest step that verifies."
        )


class IncompleteStepError(CorruptCheckpointError):
    """An incremental step shares bytes with an earlier step that is not in its directory
    (it was copied or moved without it). Nothing is damaged; `fallback=True` passes over it
    as over a corrupt step, since it cannot be restored here."""

    def __init__(self, step: int, problems: Sequence[str], directory: str):
        super().__init__(step, problems, directory)
        self.args = (f"step {step} in {directory} is incomplete: {'; '.join(self.problems)}",)


class RestoreError(JaxckptError, RuntimeError):
    """Reading a step's arrays failed for a reason other than a mismatch jaxckpt checks
    first (an I/O error, a storage error); the message carries Orbax's first line."""


class StorageError(JaxckptError, OSError):
    """Object storage (gs://, s3://) could not be reached or did not answer in time (the
    give-up time, `JAXCKPT_STORAGE_TIMEOUT_S`), refused the credentials or the access, has
    no such bucket, or failed. The message names the store and its endpoint, says what to
    check, and quotes the store's own error (also its `__cause__`)."""


class LockedError(JaxckptError, BlockingIOError):
    """Another live process holds the directory for writing."""


class NameMapError(JaxckptError, ValueError):
    """A name map cannot place a leaf, or places two leaves on one tensor name."""


class FormatError(JaxckptError, ValueError):
    """A file is not valid safetensors (corrupt or truncated header, bad metadata)."""


class NotWritableError(JaxckptError, PermissionError):
    """This process cannot create or write the checkpoint directory (no permission, or a
    read-only file system); nothing was written."""


class OutputExistsError(JaxckptError, FileExistsError):
    """The output directory exists and is not empty; nothing was written to it."""


class ProcessesMissingError(JaxckptError, TimeoutError):
    """Processes of a multi-process job did not reach an agreement (a save, a restore, the
    preemption agreement) by its deadline: stopped, dead or far slower. Raised on every
    process still waiting; `missing_processes` names the others (empty where JAX's
    coordination service did not say), `what` the agreement, `waited_s` the deadline."""

    def __init__(self, what: str, missing: Sequence[int], waited_s: float, setting: str):
        self.what = what
        self.missing_processes = list(missing)
        self.waited_s = waited_s
        who = ", ".join(map(str, self.missing_processes)) or "some process (unnamed)"
        super().__init__(
            f"process(es) {who} did not reach {what} within {waited_s:g} s ({setting}): "
            "stopped, dead or far slower than this one. Committed steps are intact; restart "
            f"the job, or raise {setting} if they are only slow."
        )

    def __str__(self) -> str:  # OSError's own would do, but say so rather than rely on it
        return str(self.args[0])


class ProcessesDisagreeError(JaxckptError, RuntimeError):
    """The processes of a multi-process job arrived at different agreements (one deleting
    a step while another starts a save, say): they no longer make the same calls. Raised
    at once on every process of the agreement; `agreements` says which each made."""

    def __init__(self, agreements: dict[int, str]):
        self.agreements = dict(agreements)
        each = "; ".join(f"process {p}: {what}" for p, what in self.agreements.items())
        super().__init__(
            f"the processes of the job reached different agreements ({each}). Every process "
            "must call the manager's methods in the same order with the same arguments; if "
            "they did, this is a bug in jaxckpt (please report it). Committed steps are "
            "intact; restart the job."
        )


class ProcessFailedError(JaxckptError, RuntimeError):
    """Another process of the job failed what it does for every process (process 0
    deciding which steps retention deletes, whether a step may be saved, which step a
    restore reads): every other process raises this, naming its error."""


class SaveError(JaxckptError, RuntimeError):
    """A save failed: at once, or in the background (then raised by the next `save`, `wait`
    or `close`). Steps committed before it are intact.

    The failed step is not visible, unless `committed` is True: every process had written
    its part and the step committed, but something failed around it, e.g. a process that
    died before confirming the commit. Such a step is whole; a multi-host job whose process
    died still has to restart. Where the store did not answer the listing that would tell
    (`unlisted`, the store's error), the steps named are those it listed last.
    """

    def __init__(
        self,
        step: int,
        cause: BaseException,
        committed: Sequence[int],
        *,
        background: bool = True,
        missing: Sequence[int] = (),
        unlisted: BaseException | None = None,
    ):
        self.step = step
        self.committed = step in committed and unlisted is None
        self.missing_processes = list(missing)
        when = " in the background" if background else ""
        if unlisted is not None:  # `committed`: as the store was last listed
            fate = (
                f"Whether step {step} committed is not known: the store did not answer a "
                f"listing ({type(unlisted).__name__}). Steps committed before are intact; "
                "as last listed:"
            )
            lost = " never reached the commit barrier: they probably died."
        elif self.committed:
            fate = f"Step {step} committed all the same and is whole; committed steps:"
            lost = (
                " never confirmed the commit: they probably died after writing their part;"
                f" restart the job, it resumes from step {step}."
            )
        else:
            fate = f"Step {step} was not committed; committed steps are intact:"
            lost = (
                " never reached the commit barrier: they probably died; restart the job, it"
                " resumes from the last committed step."
            )
        named = isinstance(cause, ProcessesMissingError) and not self.committed  # (said there)
        lost = f" Process(es) {', '.join(map(str, missing))}{lost}" if missing and not named else ""
        said = str(cause).rstrip(".")
        super().__init__(
            f"saving step {step} failed{when}: {type(cause).__name__}: {said}.{lost} "
            f"{fate} {_steps(committed)}."
        )


def _steps(steps: Sequence[int]) -> str:
    shown = [str(s) for s in steps]
    if len(shown) > 12:
        shown = [*shown[:5], "...", *shown[-5:]]
    return ", ".join(shown) or "none"
