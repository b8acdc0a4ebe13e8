"""Greedy sampling with kept keys and values against recomputing the whole sequence.

    PYTHONPATH=src python tools/kv_cache_speed.py [MODEL] [TOKENS] [ROUNDS]

A random model of the catalog (default llama-20m), one thread; prints each round's
seconds for `partita.sampling.generate` and for a loop that runs the model over the
last max_seq_len tokens for every new one, alternating, and whether both chose the
same tokens.
"""

from __future__ import annotations

import sys
import time

import torch

from partita.config import load_config
from partita.models.transformer import build_model
from partita.sampling import generate


def recomputed(model, prompt: list[int], new_tokens: int) -> list[int]:
    ids, limit, vocab = list(prompt), model.cfg.max_seq_len, model.cfg.vocab_size
    with torch.no_grad():
        for _ in range(new_tokens):
            ids.append(int(model(torch.tensor([ids[-limit:]]))[0, -1, :vocab].argmax()))
    return ids


def main() -> None:
    name = sys.argv[1] if len(sys.argv) > 1 else "llama-20m"
    tokens = int(sys.argv[2]) if len(sys.argv) > 2 else 200
    rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 2
    torch.set_num_threads(1)
    model = build_model(load_config(None, [f"--model.name={name}"]).model_config()).eval()
    for _ in range(rounds):
        start = time.perf_counter()
        kept = generate(model, [1, 2, 3], tokens, temperature=0.0)
        middle = time.perf_counter()
        whole = recomputed(model, [1, 2, 3], tokens)
        end = time.perf_counter()
        print(f"{name}, {tokens} tokens: kept {middle - start:.2f} s, recomputed "
              f"{end - middle:.2f} s, same tokens: {kept == whole}")


if __name__ == "__main__":
    main()
