"""The `geotrain` command line.

Subcommands live one per module in `geotrain.commands`; each module defines HELP, ORDER,
`add_arguments(parser)` and `run(args) -> int`, and keeps heavy imports (torch) inside `run`
so `geotrain --help` stays fast. A `GeotrainError` becomes a one-line message and exit 2.
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys

import geotrain.commands as pkg
from geotrain import __version__
from geotrain.errors import GeotrainError


def _command_modules() -> list:
    mods = [importlib.import_module(f"geotrain.commands.{m.name}")
            for m in pkgutil.iter_modules(pkg.__path__) if not m.name.startswith("_")]
    return sorted(mods, key=lambda m: (getattr(m, "ORDER", 100), m.__name__))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="geotrain",
        description="Plan, simulate and run LLM training across datacenters joined by a slow WAN.",
    )
    parser.add_argument("--version", action="version", version=f"geotrain {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for mod in _command_modules():
        name = getattr(mod, "NAME", mod.__name__.rsplit(".", 1)[1].replace("_", "-"))
        p = sub.add_parser(name, help=mod.HELP, description=getattr(mod, "DESCRIPTION", mod.HELP))
        mod.add_arguments(p)
        p.set_defaults(_run=mod.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "_run", None):
        parser.print_help(sys.stderr)
        return 2
    try:
        return int(args._run(args) or 0)
    except GeotrainError as e:
        print(f"geotrain {args.command}: error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print(f"geotrain {args.command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # The reader left (`geotrain plan ... | head`): not an error of ours. Point stdout at
        # /dev/null so the interpreter's final flush does not raise again.
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141


if __name__ == "__main__":
    sys.exit(main())
