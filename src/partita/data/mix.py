"""Several sources mixed by weight into one token stream (`data.mix`).

    data.mix = "code.jsonl=0.7, prose/=0.3"      (or a TOML table {"code.jsonl" = 0.7, ...})

Each source is prepared into its own cached token file and split into training tokens
and a validation tail as a single source would be. The training part of the mixture
has as many tokens as all sources' training parts together, T; source i contributes
round(w_i * T) of them (weights normalised to sum to 1): its tokens in order, cut short
when it has more, repeated from its start when it has fewer. The validation tails
follow, each whole, so validation covers every source. The mixture is written once to
its own cache file (streamed in chunks, never held in memory); the sampler's shuffle
then mixes the sources within every batch in the given proportions on average.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from partita.errors import PartitaError

CHUNK = 1 << 22  # tokens copied at a time


@dataclass(frozen=True)
class MixPart:
    source: str
    weight: float


def parse_mix(text: str) -> list[MixPart]:
    """'a.jsonl=0.7, b/=0.3' -> parts with weights normalised to sum to 1."""
    parts = []
    for item in (p.strip() for p in text.split(",")):
        if not item:
            continue
        source, sep, weight = item.rpartition("=")
        try:
            w = float(weight)
        except ValueError:
            w = -1.0
        if not sep or not source.strip() or not (w > 0 and math.isfinite(w)):
            raise PartitaError(
                f"data.mix entry '{item}' is not SOURCE=WEIGHT with a positive, finite "
                "weight; write e.g. data.mix=\"code.jsonl=0.7, prose/=0.3\".")
        parts.append(MixPart(source.strip(), w))
    if len(parts) < 2:
        raise PartitaError("data.mix needs at least two SOURCE=WEIGHT entries (for one "
                           "source use data.source).")
    # Scaled by the largest first, so weights near the float limit (1e308 + 1e308) do
    # not sum to infinity and normalise to zero.
    largest = max(p.weight for p in parts)
    scaled = [p.weight / largest for p in parts]
    total = sum(scaled)
    weights = [w / total for w in scaled]
    if not all(w > 0 for w in weights):
        tiny = [p.source for p, w in zip(parts, weights) if not w > 0]
        raise PartitaError(
            f"data.mix weights differ so much that {', '.join(tiny)} would contribute no "
            "tokens (weights are relative: give each source a share such as 0.1, not one "
            "that vanishes next to the largest).")
    return [MixPart(p.source, w) for p, w in zip(parts, weights)]


def mix_plan(train_sizes: list[int], weights: list[float]) -> list[int]:
    """Training tokens taken from each source (see the module docstring)."""
    total = sum(train_sizes)
    return [int(round(w * total)) for w in weights]


def write_mixture(path: Path, trains: list[np.ndarray], vals: list[np.ndarray],
                  takes: list[int], vocab_size: int) -> None:
    """The mixture file: each train part cut or repeated to its take, then every val."""
    from partita.data.tokenfile import TokenFileWriter

    with TokenFileWriter(path, vocab_size) as out:
        for train, take in zip(trains, takes):
            done = 0
            while done < take:
                start = done % len(train)
                n = min(CHUNK, take - done, len(train) - start)
                out.write(np.asarray(train[start:start + n]))
                done += n
        for val in vals:
            for start in range(0, len(val), CHUNK):
                out.write(np.asarray(val[start:start + CHUNK]))


def mixture_path(cache_dir: str | os.PathLike, prepared: list[Path], weights: list[float],
                 seq_len: int, val_fraction: float) -> Path:
    desc = [[str(p), p.stat().st_size, p.stat().st_mtime_ns] for p in prepared]
    key = hashlib.sha256(json.dumps([desc, weights, seq_len, val_fraction]).encode())
    return Path(cache_dir) / f"mix-{key.hexdigest()[:16]}.tok"


def check_same_vocab(prepared: list[Path], vocabs: list[int]) -> int:
    if len(set(vocabs)) > 1:
        listed = ", ".join(f"'{p}' ({v})" for p, v in zip(prepared, vocabs))
        raise PartitaError(f"the sources of data.mix have different vocabularies: {listed}; "
                           "mix sources tokenized with one tokenizer.")
    return vocabs[0]
