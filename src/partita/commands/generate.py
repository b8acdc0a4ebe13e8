"""`partita generate --run DIR --prompt TEXT`."""

from __future__ import annotations

import argparse

from partita.arg_types import at_least


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("generate", help="sample text from a finished run's weights",
                              formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--run", default="runs/default", help="the run's out_dir")
    p.add_argument("--prompt", default="def ", help="text to continue")
    p.add_argument("--tokens", type=at_least(0), default=200,
                   help="tokens to generate")
    p.add_argument("--temperature", type=at_least(0.0, float), default=0.8,
                   help="0 = greedy")
    p.add_argument("--top-k", type=at_least(0), default=0,
                   help="sample among the k likeliest (0 = all)")
    p.add_argument("--seed", type=int, default=0, help="seed of the sampling")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from partita.sampling import generate_text

    print(generate_text(args.run, args.prompt, args.tokens, args.temperature, args.top_k,
                        args.seed))
    return 0
