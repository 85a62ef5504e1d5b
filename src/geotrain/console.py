"""Small helpers for what commands print: aligned tables, human units, a progress bar, the log set-up.

Kept deliberately tiny and stable because every command imports it. The progress bar stays
silent when stderr is not a terminal (CI logs, pipes, tests) so output files stay clean.
"""

from __future__ import annotations

import logging
import math
import os
import sys
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, TypeVar

T = TypeVar("T")

LOG_LEVEL_ENV = "GEOTRAIN_LOG_LEVEL"
LOG_LEVELS = ("debug", "info", "warning", "error")
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

_SI = [(1e21, "Z"), (1e18, "E"), (1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")]


def _cell(v: Any) -> str:
    if isinstance(v, float):
        if math.isnan(v):
            return "-"
        return f"{v:.4g}"
    return "" if v is None else str(v)


def _is_numeric(s: str) -> bool:
    """A plain number, optionally with a % or x suffix (right-aligned in tables)."""
    t = s.strip().rstrip("%x").replace(",", "")
    try:
        float(t)
        return True
    except ValueError:
        return False


def format_table(headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    """An aligned plain-text table: numbers right-aligned, text left-aligned, floats to 4
    significant digits, a dashed rule under the header."""
    body = [[_cell(v) for v in r] for r in rows]
    ncol = max([len(headers)] + [len(r) for r in body])
    heads = list(headers) + [""] * (ncol - len(headers))
    body = [r + [""] * (ncol - len(r)) for r in body]
    widths = [max([len(heads[i])] + [len(r[i]) for r in body]) for i in range(ncol)]
    right = [bool(body) and all(_is_numeric(r[i]) or r[i] in ("", "-") for r in body) for i in range(ncol)]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(c.rjust(w) if ra else c.ljust(w) for c, w, ra in zip(cells, widths, right)).rstrip()

    out = [line(heads), "  ".join("-" * w for w in widths)]
    out += [line(r) for r in body]
    return "\n".join(out)


def human_bytes(n: float) -> str:
    """Bytes with binary prefixes: 512 B, 1.50 KiB, 3.20 GiB."""
    n = float(n)
    sign = "-" if n < 0 else ""
    n = abs(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if n < 1024 or unit == "PiB":
            return f"{sign}{n:.0f} {unit}" if unit == "B" or n >= 999.5 else f"{sign}{n:.3g} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def human_seconds(s: float) -> str:
    """Durations from nanoseconds to hours: 850 ns, 12.3 us, 4.56 ms, 1.23 s, 2m05s, 1h02m."""
    s = float(s)
    if math.isnan(s) or math.isinf(s):
        return str(s)
    sign = "-" if s < 0 else ""
    a = abs(s)
    if a == 0:
        return "0 s"
    if a < 1e-6:
        return f"{sign}{a * 1e9:.3g} ns"
    if a < 1e-3:
        return f"{sign}{a * 1e6:.3g} us"
    if a < 1:
        return f"{sign}{a * 1e3:.3g} ms"
    if a < 60:
        return f"{sign}{a:.3g} s"
    if a < 3600:
        m, sec = divmod(round(a), 60)
        return f"{sign}{m}m{sec:02d}s"
    h, rem = divmod(round(a), 3600)
    return f"{sign}{h}h{rem // 60:02d}m"


def number_runs(numbers: Iterable[int], prefix: str = "") -> str:
    """Integers as runs, each number `prefix`ed: [0, 1, 2, 5] -> "0-2, 5" ("r0-r2, r5" with prefix "r")."""
    runs: list[list[int]] = []
    for n in sorted(numbers):
        if runs and n == runs[-1][1] + 1:
            runs[-1][1] = n
        else:
            runs.append([n, n])
    return ", ".join(f"{prefix}{a}" if a == b else f"{prefix}{a}-{prefix}{b}" for a, b in runs)


def sent_received(per_name: dict[str, dict[str, int]]) -> str:
    """{"east": {"out": B, "in": B}, ...} -> "east sent 1.2 MB, received 1.1 MB; west ..."."""
    return "; ".join(f"{name} sent {human_bytes(b['out'])}, received {human_bytes(b['in'])}"
                     for name, b in per_name.items())


def human_rate(x: float, unit: str) -> str:
    """A quantity with SI prefixes: human_rate(3.2e14, "FLOP/s") -> "320 TFLOP/s";
    also fine for counts (human_rate(2e18, "FLOP"))."""
    x = float(x)
    a = abs(x)
    for scale, prefix in _SI:
        if a >= scale:
            return f"{x / scale:.3g} {prefix}{unit}"
    return f"{x:.3g} {unit}"


def progress(iterable: Iterable[T], total: int | None = None, desc: str = "",
             enable: bool | None = None) -> Iterator[T] | Iterable[T]:
    """Wrap `iterable` in a tqdm bar on stderr; enable=None means "only when stderr is a TTY".
    Disabled, it returns the iterable itself (no overhead, nothing printed)."""
    if enable is None:
        enable = sys.stderr.isatty()
    if not enable:
        return iterable
    # lazy: tqdm only when called (importers that never call it stay free of it)
    from tqdm import tqdm

    return tqdm(iterable, total=total, desc=desc or None, leave=False, file=sys.stderr, dynamic_ncols=True)


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever sys.stderr is when a record is emitted (a redirect, a test's capture),
    never to a stream that was replaced and closed since the set-up."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, _value) -> None:
        pass


def configure_logging(level: str | None = None) -> None:
    """One stderr handler on the root logger (a standard format; idempotent), geotrain's loggers at
    `level`, else $GEOTRAIN_LOG_LEVEL, else info; other libraries' stay at warning. Without it Python
    printed warnings bare and dropped info lines (the HTTP server's dropped and refused clients).
    Called by the CLI and by each rank process, which inherit the level through the environment."""
    name = (level or os.environ.get(LOG_LEVEL_ENV) or "info").lower()
    root = logging.getLogger()
    for h in [h for h in root.handlers if isinstance(h, _StderrHandler)]:
        root.removeHandler(h)
    handler = _StderrHandler()
    handler.setFormatter(logging.Formatter(LOG_FORMAT))
    root.addHandler(handler)
    logging.getLogger("geotrain").setLevel(name.upper() if name in LOG_LEVELS else logging.INFO)
    if name not in LOG_LEVELS:
        logging.getLogger("geotrain").warning("%s=%r is not one of %s; logging at info", LOG_LEVEL_ENV, name,
                                              ", ".join(LOG_LEVELS))
