"""`partita` command line: one subcommand per module, each registered here.

Every command module exposes `register(subparsers)`, which adds its parser and sets
`func` (called with the parsed arguments, returns an exit code) and, where that needs
torch, `imports_torch`; `bench`'s also takes the benchmark the command line names, the
only one whose module it imports. A `PartitaError` is printed as its one paragraph,
without a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import os
import signal
import sys

from partita.errors import PartitaError, Stopped, closest, signals_held, stop_on_signals
from partita.local_world import note_ignored_hangup

# Module paths, imported lazily so `partita --help` stays fast and one broken command
# does not take the others down.
COMMANDS = (
    "partita.commands.train",
    "partita.commands.generate",
    "partita.commands.bench",
    "partita.commands.plan",
    "partita.commands.schedule",
    "partita.commands.checkpoint",
    "partita.commands.export",
)


def build_parser(only: str | None = None, benchmark: str | None = None
                 ) -> argparse.ArgumentParser:
    """All commands, or only the command `only` (its module alone is imported, so a
    light command such as `partita plan` does not pay for the others' imports). Of the
    benchmarks only `benchmark` (`partita bench NAME`) is imported: each imports torch."""
    parser = argparse.ArgumentParser(
        prog="partita",
        description="Train transformer language models beyond one device.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for path in COMMANDS:
        if only is not None and path.rsplit(".", 1)[1] != only:
            continue
        try:
            module = importlib.import_module(path)
        except ModuleNotFoundError as exc:
            if exc.name != path:
                raise
            continue  # command not built yet
        if path == "partita.commands.bench":
            module.register(sub, benchmark)
        else:
            module.register(sub)
    return parser


def parser_for(words: list[str]) -> argparse.ArgumentParser:
    """The parser for the command line `words`: the command it names alone (all of them
    when it names none), and of `bench`'s benchmarks the one it names."""
    names = {path.rsplit(".", 1)[1] for path in COMMANDS}
    only = words[0] if words and words[0] in names else None
    return build_parser(only, words[1] if only == "bench" and len(words) > 1 else None)


def _innermost(parser: argparse.ArgumentParser, args: argparse.Namespace
               ) -> argparse.ArgumentParser:
    """The (sub)command parser that read `args`: its usage and options are the ones to
    show for an argument it does not take."""
    while True:
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        chosen = getattr(args, subs[0].dest, None) if subs else None
        if chosen is None or chosen not in subs[0].choices:
            return parser
        parser = subs[0].choices[chosen]


def _override_word(word: str, awaiting: bool) -> bool:
    """Whether `word`, a word that no option of the command took, is part of an override
    rather than the config file: one in option form (argparse takes a word with a space,
    "--data.mix=a.jsonl=0.7, b.jsonl=0.3", for a positional argument), or the value of
    a setting written as two words ("--train.steps 5": `awaiting` says the word before is
    a setting without its value). A word ending in .toml is the config file, never a
    value ("--parallel.sequence_parallel run.toml": the flag, then the file)."""
    from partita.config import is_config_file_word

    if word.startswith("--"):
        return True
    return awaiting and not is_config_file_word(word)


def _setting_hint(word: str, words: list[str]) -> str:
    """A hint for a setting written without its section: one of partita's settings
    ("--steps=5"), a section given as an option ("--model small") or another trainer's
    name ("--learning_rate=0.1", "--max-steps 5"). Settings are written
    --SECTION.FIELD=VALUE."""
    import dataclasses
    import typing

    from partita.config import PEER_NAMES, Config, _all_keys

    name, _, value = word.lstrip("-").partition("=")
    if not value and words.index(word) + 1 < len(words):
        value = words[words.index(word) + 1]
    value = "" if value.startswith("-") else value
    key, shown = name.replace("-", "_"), value or "..."
    # partita's own field names first: "seed" is model.seed or data.seed.
    owners = [k for k in _all_keys() if k.partition(".")[2] == key]
    if owners:
        return f" Did you mean {' or '.join(repr(f'--{k}={shown}') for k in owners)}?"
    if peer := PEER_NAMES.get(key):
        return f" Did you mean '--{peer}={shown}'?"
    section = typing.get_type_hints(Config).get(name)
    if section is None:
        return ""
    if name == "model" and value:
        return f" Did you mean '--model.name={value}'?"
    fields = [f.name for f in dataclasses.fields(section)][:4]
    return (f" '{name}' is a section of settings: write --{name}.FIELD=VALUE "
            f"(its fields include {', '.join(fields)}).")


def main(argv: list[str] | None = None) -> int:
    note_ignored_hangup()  # before any handler changes (nohup: see there)
    words = sys.argv[1:] if argv is None else list(argv)
    # Before parsing: building the parser imports the commands (about two seconds where
    # one imports torch), and a SIGTERM meanwhile ended the process without a word.
    stop_on_signals()
    try:
        args = _parse(words)
    except KeyboardInterrupt:  # a Ctrl-C before the handler above was in place
        return _stopped(Stopped(signal.SIGINT))
    except Stopped as exc:
        if words[:1] == ["train"] and exc.signum == signal.SIGTERM:
            from partita.commands.train import stopped_before_start

            return stopped_before_start()  # nothing started: a stop on request
        return _stopped(exc)
    if args is None:
        return 0
    try:
        if getattr(args, "imports_torch", False):
            with signals_held():  # see _parse
                import torch  # noqa: F401
        return int(args.func(args) or 0)
    except PartitaError as exc:
        print(f"partita: error: {exc}", file=sys.stderr)
        return 2
    except Stopped as exc:
        return _stopped(exc)
    except BrokenPipeError:
        # The reader went away (`partita plan ... | head`): end quietly. Python flushes
        # stdout again at exit, so point it at nothing first.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        # The status a command settled before printing (plan's does not-fits = 1).
        return getattr(args, "exit_status", 0)


def _stopped(exc: Stopped) -> int:
    print(f"partita: {exc}; every process was stopped.", file=sys.stderr)
    return exc.exit_code


def _parse(words: list[str]) -> argparse.Namespace | None:
    """The command's arguments, or None where there is no command (help was printed)."""
    # Where torch is imported, a Ctrl-C must wait until the import is done (an exception
    # raised inside it can abort the process: `signals_held` says why). `bench` imports
    # it to build its options; commands that set `imports_torch` import it before they
    # run, in `main`.
    with signals_held():
        parser = parser_for(words)
    args, extra = parser.parse_known_args(words)
    if args.command is None:
        parser.print_help()
        return None
    # A word in option form without a section ("--nprocs") is no setting: it was meant
    # for one of the command's own options.
    overrides = getattr(args, "accepts_overrides", False)
    stray = [w for w in extra if w.startswith("--") and "." not in w.split("=")[0]]
    if (overrides and stray) or (extra and not overrides):
        extra = stray if overrides else extra
        command = _innermost(parser, args)
        # Compared without their dashes, which every option shares.
        options = [o.lstrip("-") for a in command._actions for o in a.option_strings]
        near = closest(extra[0].split("=")[0].lstrip("-"), options)
        hint = f" Did you mean '--{near}'?" if near and extra[0].startswith("--") else ""
        if overrides:
            hint = _setting_hint(extra[0], words) or hint
        command.error(f"unrecognized arguments: {' '.join(extra)}.{hint}")
    from partita.layout import notes_for_old_spellings

    notes_for_old_spellings()  # a deprecated schedule or layout name, said once
    if overrides:
        # The words no option of the command took, in their order: argparse's extras
        # and the word it took for the config file, where that stands (past the
        # options' values: "--nproc 2 --train.steps 2" holds "2" twice).
        command = _innermost(parser, args)
        valued = [o for a in command._actions if a.nargs != 0 for o in a.option_strings]
        free, rest, i = [], list(extra), int(words[:1] == [args.command])
        config = getattr(args, "config", None)
        while i < len(words):
            word = words[i]
            if rest and word == rest[0]:
                free.append(rest.pop(0))
            elif word.startswith("--") and "=" not in word and any(
                    o.startswith(word) for o in valued):  # argparse takes a prefix too
                i += 1  # the option's value
            elif config is not None and word == config:
                free.append(word)
                config = None
            i += 1
        # Then which of them is the config file, and which the overrides.
        args.config, extra, awaiting = None, [], False
        for word in free:
            if args.config is None and not _override_word(word, awaiting):
                args.config, awaiting = word, False
                continue
            extra.append(word)
            # A setting without "=" may take the next word as its value; a value does not.
            awaiting = word.startswith("--") and "=" not in word
    args.overrides = extra
    return args


if __name__ == "__main__":
    sys.exit(main())
