"""The `geotrain` command line: a table of commands, and only the chosen one imported.

Each command is a module of `geotrain.commands` with `add_arguments(parser)` and `run(args) -> int`
that calls one library function. `geotrain --help` prints this table without importing any of
them (so it never loads torch or pydantic). A `GeotrainError` becomes a one-line message and exit 2.
Logging is set up here, once (`console.configure_logging`, `--log-level` on every command).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from geotrain import __version__
from geotrain.console import LOG_LEVEL_ENV, LOG_LEVELS, configure_logging
from geotrain.errors import GeotrainError, printable

# name -> (module under geotrain.commands, one-line help), in the order `--help` lists them.
COMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("demo_cmd", "run the built-in demo: plan, simulate, train across emulated DCs with BubbleTea, report"),
    "validate": ("validate_cmd", "validate cluster, model and experiment spec files"),
    "estimate": ("estimate_cmd", "print per-unit and per-stage compute and memory estimates for an experiment spec"),
    "plan": ("plan_cmd", "choose DCs, stages, dp/pp, WAN use and schedule for an experiment (Atlas planner)"),
    "simulate": ("simulate_cmd", "simulate a training plan and write its trace, timeline and HTML report"),
    "report": ("report_cmd", "rebuild report.html and timeline.png of a run directory (predicted vs measured)"),
    "train": ("train_cmd", "train a model for real (one process per rank) following a spec or plan file"),
    "rehearse": ("rehearse_cmd", "rehearse a multi-host deployment on this machine: one torchrun per emulated DC"),
    "replan": ("replan_cmd", "re-plan a run for the cluster left after losing DCs or GPUs (then train --resume-from)"),
    "export": ("export_cmd", "write a training run's latest checkpoint as a Hugging Face directory (--hf OUT)"),
    "profile": ("profile_cmd", "measure compute, collectives, WAN and runtime overheads on this machine"),
    "validate-sim": ("validate_sim_cmd", "run small plans for real and compare them with the simulator's predictions"),
    "wan": ("wan_cmd", "bring the emulated datacenters and WAN up or down (root), for manual use"),
}


def _top_parser() -> argparse.ArgumentParser:
    epilog = "commands:\n" + "\n".join(f"  {name:<14}{help_}" for name, (_, help_) in COMMANDS.items())
    parser = argparse.ArgumentParser(
        prog="geotrain", formatter_class=argparse.RawDescriptionHelpFormatter, epilog=epilog,
        description="Plan, simulate and run LLM training across datacenters joined by a slow WAN.",
        usage="geotrain [--version] COMMAND [ARGS...]   (geotrain COMMAND --help for its options)")
    parser.add_argument("--version", action="version", version=f"geotrain {__version__}")
    parser.add_argument("command", nargs="?", metavar="COMMAND", choices=list(COMMANDS))
    return parser


def command_parser(name: str):
    """The chosen command's module and its parser (imports that one module only)."""
    module_name, help_ = COMMANDS[name]
    module = importlib.import_module(f"geotrain.commands.{module_name}")
    parser = argparse.ArgumentParser(prog=f"geotrain {name}", description=getattr(module, "DESCRIPTION", help_))
    module.add_arguments(parser)
    parser.add_argument("--log-level", choices=LOG_LEVELS, default=None,
                        help=f"what geotrain logs on stderr (default: ${LOG_LEVEL_ENV}, else info); ranks inherit it")
    return module, parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    top = _top_parser()
    if not argv or argv[0] not in COMMANDS:
        top.parse_args(argv[:1])        # --help, --version, or an unknown command: argparse's message
        top.print_help(sys.stderr)
        return 2
    name = argv[0]
    module, parser = command_parser(name)
    args = parser.parse_args(argv[1:])
    args.command = name
    if args.log_level:
        os.environ[LOG_LEVEL_ENV] = args.log_level      # the ranks and servers this command starts log alike
    configure_logging()
    try:
        return int(module.run(args) or 0)
    except GeotrainError as e:
        print(f"geotrain {name}: error: {printable(e)}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print(f"geotrain {name}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # The reader left (`geotrain plan ... | head`): not an error of ours. Point stdout at
        # /dev/null so the interpreter's final flush does not raise again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141


if __name__ == "__main__":
    sys.exit(main())
