"""`partita generate --run DIR --prompt TEXT`."""

from __future__ import annotations

import argparse

from partita.arg_types import at_least


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("generate", help="sample text from a finished run's weights",
                              formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--run", default="runs/default",
                   help="a finished run's out_dir, or a checkpoint (a checkpoint folder, a "
                   "folder of checkpoints or an unfinished run's out_dir: its newest)")
    p.add_argument("--prompt", default="def ", help="text to continue")
    p.add_argument("--tokens", type=at_least(0), default=200,
                   help="tokens to generate (fewer when the run's tokenizer has an end "
                   "of document and it is sampled: the text ends there)")
    p.add_argument("--temperature", type=at_least(0.0, float), default=0.8,
                   help="0 = greedy")
    p.add_argument("--top-k", type=at_least(0), default=0,
                   help="sample among the k likeliest (0 = all)")
    # torch's generator takes 64 bits; larger (or negative) seeds would wrap around.
    p.add_argument("--seed", type=at_least(0, int, 2**64 - 1), default=0,
                   help="seed of the sampling")
    p.set_defaults(func=run, imports_torch=True)


def run(args: argparse.Namespace) -> int:
    import sys

    from partita.sampling import find_weights, generate_text

    source = find_weights(args.run)
    if not (source / "model.safetensors").is_file():
        print(f"partita: sampling from checkpoint {source}", file=sys.stderr, flush=True)
    print(generate_text(source, args.prompt, args.tokens, args.temperature, args.top_k,
                        args.seed))
    return 0
