"""Untrusted text made safe to print on a terminal.

Folder names, leaf names, metadata strings and paths come from files anyone may have
written. Printed raw, an `ESC ] 0 ; ... BEL` (OSC) sequence retitles the terminal, `ESC [ 2J`
(CSI) clears it, a newline forges a line of a table and a bidi override reorders what is
read. `escape` writes each such character as its JSON escape (`\\u001b`, `\\n`), as `--json`
output does, and leaves all other text as it is:

>>> escape("w\\x1b]0;title\\x07\\n[red]x")
'w\\\\u001b]0;title\\\\u0007\\\\n[red]x'
"""

from __future__ import annotations

import logging
import re

# C0 controls, DEL, C1 controls, the line and paragraph separators, and the bidi
# controls (ALM, LRM, RLM, LRE..RLO, LRI..PDI).
_UNSAFE = re.compile("[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028\u2029\u202a-\u202e\u2066-\u2069]")
_SHORT = {"\b": "\\b", "\t": "\\t", "\n": "\\n", "\f": "\\f", "\r": "\\r"}


def escape(text: object) -> str:
    """`str(text)` with every control or bidi character as its JSON escape. Idempotent:
    backslashes are left as they are, so escaped text is never escaped twice."""
    return _UNSAFE.sub(lambda m: _SHORT.get(m[0]) or f"\\u{ord(m[0]):04x}", str(text))


def escape_markup(text: object) -> str:
    """`escape(text)`, also safe as rich markup (`[bold]` shown, not applied)."""
    from rich.markup import escape as rich_escape  # rich only where rich renders

    return rich_escape(escape(text))


class Formatter(logging.Formatter):
    """A log formatter whose messages are escaped (a traceback, added after, is not)."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        return escape(super().formatMessage(record))
