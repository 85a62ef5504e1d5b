"""Benches that rewrite a section of docs/VALIDATION.md or the README between two markers."""

from __future__ import annotations

import re
import sys
from pathlib import Path


def replace_section(path: Path, begin: str, end: str, body: str) -> None:
    """Put `body` between the markers `begin` and `end` of `path` (a note, and nothing written, when
    the file lacks them)."""
    text = path.read_text()
    if begin not in text or end not in text:
        print(f"note: {path} has no {begin} ... {end} section; not updated", file=sys.stderr)
        return
    block = begin + "\n" + body.rstrip() + "\n" + end
    path.write_text(re.sub(re.escape(begin) + r".*?" + re.escape(end), lambda _: block, text, flags=re.S))
    print(f"wrote {path}")
