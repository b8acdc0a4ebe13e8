"""`partita` command line: one subcommand per module, each registered here.

Every command module exposes `register(subparsers)`, which adds its parser and sets
`func` (called with the parsed arguments, returns an exit code). A `PartitaError` is
printed as its one paragraph, without a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from partita.errors import PartitaError, Stopped, stop_on_signals

# Module paths, imported lazily so `partita --help` stays fast and one broken command
# does not take the others down.
COMMANDS = (
    "partita.commands.train",
    "partita.commands.generate",
    "partita.commands.bench",
    "partita.commands.plan",
    "partita.commands.schedule",
    "partita.commands.export",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="partita",
        description="Train transformer language models beyond one device.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for path in COMMANDS:
        try:
            module = importlib.import_module(path)
        except ModuleNotFoundError as exc:
            if exc.name != path:
                raise
            continue  # command not built yet
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    if extra and not getattr(args, "accepts_overrides", False):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    args.overrides = extra
    stop_on_signals()
    try:
        return int(args.func(args) or 0)
    except PartitaError as exc:
        print(f"partita: error: {exc}", file=sys.stderr)
        return 2
    except Stopped as exc:
        print(f"partita: {exc}; every process was stopped.", file=sys.stderr)
        return exc.exit_code


if __name__ == "__main__":
    sys.exit(main())
