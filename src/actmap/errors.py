"""The one exception type for mistakes a user can fix (a bad file, path, value or folder).

The library raises `ActmapUserError` (or a subclass) when the input is wrong, with a
message that names the file, line, field, id or option. The CLI prints exactly those
as one line; any other exception is a bug and keeps its traceback.
"""

from __future__ import annotations


class ActmapUserError(ValueError):
    """Bad input: the message says what is wrong and where (file, line, field, id)."""
