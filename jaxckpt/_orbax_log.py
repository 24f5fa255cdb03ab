"""What Orbax logs that jaxckpt says better itself: demoted to jaxckpt's debug log.

Orbax logs through absl's logger a traceback per thread for a save that failed in the
background, which jaxckpt raises itself as SaveError by the next save/wait/close. Only
the messages that name a directory jaxckpt has open are demoted: a user's own Orbax save
in the same process logs as it does without jaxckpt. These known messages go to the debug
log (`logging.getLogger("jaxckpt.orbax").setLevel(logging.DEBUG)` shows them); every
other Orbax message passes unchanged. The texts are Orbax's, not promised by it:
tests/test_cli_messages.py fails when an upgrade changes one.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable

_ORBAX_NOISE = re.compile(
    r"Failed to run \d+ Handler Commit operations or the Commit callback in background"
    r"|_SignalingThread\.run\(\) raised an exception"
)
_orbax_debug_log = logging.getLogger("jaxckpt.orbax")


# Whether a message's text names a directory jaxckpt has open (`demote_noise`'s).
_ours: Callable[[str], bool] | None = None


def demote_noise(ours: Callable[[str], bool]) -> None:
    """Filters absl's logger (where Orbax logs) through `_demote`, once in the process;
    `ours(text)`: whether a message names a directory jaxckpt has open."""
    global _ours
    _ours = ours
    absl = logging.getLogger("absl")
    if _demote not in absl.filters:
        absl.addFilter(_demote)


def _demote(record: logging.LogRecord) -> bool:
    """A filter on absl's logger: the known messages above that name a directory jaxckpt
    has open are handed to jaxckpt.orbax's handlers at DEBUG level (if enabled there)
    instead of absl's; all else passes."""
    try:
        text = record.getMessage()
        noise = _ours is not None and bool(_ORBAX_NOISE.search(text)) and _ours(text)
    except Exception:  # a record whose arguments do not format: not ours to judge
        return True
    if not noise:
        return True
    if _orbax_debug_log.isEnabledFor(logging.DEBUG):
        record.levelno, record.levelname = logging.DEBUG, "DEBUG"
        _orbax_debug_log.handle(record)
    return False
