"""`partita generate --run DIR --prompt TEXT`."""

from __future__ import annotations

import argparse
from collections.abc import Callable


def _not_negative(kind: type) -> Callable[[str], int | float]:
    """An argparse type: a number of `kind` that is 0 or more (a negative count or
    temperature would otherwise pass as an empty or greedy sample, unremarked)."""
    def parse(text: str) -> int | float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if value < 0:
            raise argparse.ArgumentTypeError(f"{text} is negative; give 0 or more")
        return value
    return parse


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("generate", help="sample text from a finished run's weights")
    p.add_argument("--run", default="runs/default", help="the run's out_dir")
    p.add_argument("--prompt", default="def ", help="text to continue")
    p.add_argument("--tokens", type=_not_negative(int), default=200,
                   help="tokens to generate")
    p.add_argument("--temperature", type=_not_negative(float), default=0.8,
                   help="0 = greedy")
    p.add_argument("--top-k", type=_not_negative(int), default=0,
                   help="sample among the k likeliest (0 = all)")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from partita.sampling import generate_text

    print(generate_text(args.run, args.prompt, args.tokens, args.temperature, args.top_k,
                        args.seed))
    return 0
