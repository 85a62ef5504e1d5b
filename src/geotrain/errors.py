"""User-facing errors.

Every problem caused by the user's input (a spec, a cluster that cannot host the model, a
request) is raised as a `GeotrainError`; the CLI prints its one-line message and exits with
status 2 instead of showing a traceback.
"""

from __future__ import annotations

import unicodedata


class GeotrainError(Exception):
    """An error whose message is a complete, one-line explanation for the user."""

    exit_code = 2


class SpecError(GeotrainError):
    """A spec file is malformed: names the file, the field and the reason."""

    def __init__(self, file: str, field: str, reason: str):
        self.file, self.field, self.reason = str(file), field, reason
        where = f"{self.file}: {field}: " if field else f"{self.file}: "
        super().__init__(where + reason)


class InfeasibleError(GeotrainError):
    """The cluster cannot host the job (memory per GPU, GPU count, ...)."""


def printable(text: str) -> str:
    """`text` safe to print as one line: control and format characters (newlines, escape
    sequences, bidi overrides) written as escapes, so a value echoed from a hostile file can
    neither break the line nor drive the terminal."""
    return "".join(ascii(c)[1:-1] if unicodedata.category(c) in ("Cc", "Cf", "Zl", "Zp") else c for c in str(text))
