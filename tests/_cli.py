"""`geotrain ARGV` in the test's own process: the CLI's start-up imports (torch, the planner, the
simulator -- 4-6 s of CPU per process on the 2-core CI machine) are paid once per session instead
of once per call; the ranks a command launches are still processes. Output is read through
pytest's `capfd` (file-descriptor level, so what a rank prints to the stdout it inherited is in it)."""

from __future__ import annotations

import contextlib
import io
import os

from geotrain.cli import main


def geotrain(capfd, *argv, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of `geotrain ARGV`; `env` is set for its duration (ranks inherit
    it). `capfd` None (a module or session fixture has none): what this process prints is read
    instead, and what a rank prints to its inherited stdout goes to the test's own output."""
    if capfd is not None:
        capfd.readouterr()
    out, err = io.StringIO(), io.StringIO()
    saved = {k: os.environ.get(k) for k in env or {}}
    os.environ.update(env or {})
    try:
        with contextlib.ExitStack() as stack:
            if capfd is None:
                stack.enter_context(contextlib.redirect_stdout(out))
                stack.enter_context(contextlib.redirect_stderr(err))
            try:
                rc = main([str(a) for a in argv])
            except SystemExit as e:            # argparse's usage errors
                rc = e.code if isinstance(e.code, int) else 2
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    if capfd is None:
        return rc, out.getvalue(), err.getvalue()
    got = capfd.readouterr()
    return rc, got.out, got.err
