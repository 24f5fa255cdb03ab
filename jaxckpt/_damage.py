"""What a reader calls damage (`Damaged`): a step's file that is not what jaxckpt writes, or
bytes that disagree with their digest. Only that, and a file the step needs that is gone,
is a CorruptCheckpointError (`_transfer.corrupt_if_not_jaxckpts`), which `fallback=True`
passes over; any other failure while reading (a store's, a target's placement) is raised as
what it is, never as damage."""


class Damaged(ValueError):
    """A step's file is not what jaxckpt writes, or bytes disagree with their digest."""


class Incomplete(Damaged):
    """A step refers to bytes of an earlier step that is not in its directory (a step
    copied without the steps it shares bytes with): `IncompleteStepError`."""
