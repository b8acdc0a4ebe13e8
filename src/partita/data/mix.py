"""Several sources mixed by weight into one token stream (`data.mix`).

    data.mix = "code.jsonl=0.7, prose/=0.3"      (or a TOML table {"code.jsonl" = 0.7, ...})

Each source is prepared into its own cached token file and split into training tokens
and a validation tail as a single source would be. The training part of the mixture
has as many tokens as all sources' training parts together, T; source i contributes
round(w_i * T) of them (weights normalised to sum to 1): its tokens in order, cut short
when it has more, repeated from its start when it has fewer. The validation part is
built the same way from the validation tails (V tokens in all, round(w_i * V) from
source i, at least one window of each), so that it holds the sources in the mixture's
proportions, and interleaved (`MixtureLayout`): validation evaluates the first
train.eval_batches x train.global_batch windows of it, and every such prefix holds
every source, about in proportion to its weight. The mixture is written once to its own cache file (streamed in
chunks, never held in memory); the sampler's shuffle then mixes the sources within
every batch in the given proportions on average.

Junctions. Where one piece of the stream meets another (one source's part and the
next, or a part repeated from its start) the first usually ends inside a document.
With a tokenizer that marks documents, a boundary token is written there unless one
already is: an end token after a piece that does not end with it, a start token
(`DocumentStart`) before a piece that does not start with it. So the document mask and
the loss never join two sources' text into one document.

A source whose path holds a comma is written as it is ("a,b.jsonl=1, c.jsonl=1"): an
entry ends after its weight, not at any comma.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from partita.errors import PartitaError
from partita.models.documents import starts_documents

CHUNK = 1 << 22  # tokens copied at a time
LAYOUT_VERSION = 2  # part of the mixture's cache key: bump when the layout changes

# "SOURCE = WEIGHT" followed by a comma or the end: the weight anchors each entry, so a
# source may hold commas and "=" (the last "=" before the weight is the separator).
_ENTRY = re.compile(r"(?P<source>.*?)=\s*(?P<weight>[^\s,=]+)\s*(?:,|$)", re.DOTALL)


@dataclass(frozen=True)
class MixPart:
    source: str
    weight: float


def split_mix(text: str) -> list[tuple[str, str]]:
    """(source, weight text) of each entry of `text`, in order, sources stripped; empty
    entries (",,") are skipped. Text that is no SOURCE=WEIGHT entry comes back whole
    with weight "", so the caller can name it."""
    entries, pos = [], 0
    while True:
        while pos < len(text) and text[pos] in " \t\r\n,":
            pos += 1
        if pos == len(text):
            return entries
        match = _ENTRY.match(text, pos)
        source = "" if match is None else match.group("source").strip()
        if match is None or ("," in source and not Path(source).expanduser().exists()):
            # A comma inside a source that names no path: an entry before it lacks
            # its weight ("a.jsonl, b.jsonl=1").
            entries.append(((text[pos:] if match is None else match.group(0)).strip(" ,"), ""))
            return entries
        entries.append((source, match.group("weight")))
        pos = match.end()


def parse_mix(text: str) -> list[MixPart]:
    """'a.jsonl=0.7, b/=0.3' -> parts with weights normalised to sum to 1."""
    parts = []
    for source, weight in split_mix(text):
        try:
            w = float(weight)
        except ValueError:
            w = -1.0
        if not source or not (w > 0 and math.isfinite(w)):
            item = f"{source}={weight}" if weight else source
            raise PartitaError(
                f"data.mix entry '{item}' is not SOURCE=WEIGHT with a positive, finite "
                "weight; write e.g. data.mix=\"code.jsonl=0.7, prose/=0.3\" (a source "
                "whose name holds a comma is read as one only when it exists).")
        parts.append(MixPart(source, w))
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


@dataclass(frozen=True)
class Span:
    """Tokens [lo, hi) of one source's part (`source` indexes the part list)."""

    source: int
    lo: int
    hi: int


def _spans(source: int, size: int, start: int, stop: int) -> Iterator[Span]:
    """Positions [start, stop) of a part of `size` tokens repeated end to end, as spans
    of the part: a take beyond its size starts over from its beginning."""
    while start < stop and size:
        lo = start % size
        n = min(stop - start, size - lo)
        yield Span(source, lo, lo + n)
        start += n


def _rounds(takes: list[int], first: int) -> Iterator[Span]:
    """Every part's `take` tokens, interleaved: in rounds, each part in turn gives the
    tokens up to the same fraction of its take, the fraction doubling each round from
    `first` tokens of the smallest take. Any prefix of the result then holds the parts
    in proportion to their takes (each as far through its take as the others), with
    only about log2(take / first) junctions per part."""
    smallest = min((t for t in takes if t), default=0)
    if smallest == 0:
        return
    fraction, done = min(1.0, first / smallest), [0] * len(takes)
    while True:
        for source, take in enumerate(takes):
            upto = take if fraction >= 1.0 else int(fraction * take)
            yield from _spans(source, take, done[source], upto)
            done[source] = max(done[source], upto)
        if fraction >= 1.0:
            return
        fraction = min(1.0, 2 * fraction)


@dataclass(frozen=True)
class MixtureLayout:
    """What the mixture file holds, in order: the training region, then the validation
    region, each a list of spans of the sources' parts with a boundary token (an int)
    wherever a junction needs one (see the module docstring).

    Training: each source's take in turn (the sampler shuffles windows anyway).
    Validation: the sources' shares interleaved (`_rounds`), because validation
    evaluates the region's first windows: laid out one source after another, a large
    first source filled the whole evaluation budget and the others went unseen."""

    train_takes: list[int]
    val_takes: list[int]
    train: list[Span | int]
    val: list[Span | int]
    trains: list[np.ndarray]
    vals: list[np.ndarray]

    @staticmethod
    def plan(trains: list[np.ndarray], vals: list[np.ndarray], weights: list[float],
             seq_len: int, boundary: int | None) -> MixtureLayout:
        train_takes = mix_plan([len(t) for t in trains], weights)
        # Validation is mixed like training, so its loss weighs the sources as training
        # does; every held-out tail keeps at least one window (split_tokens's minimum).
        val_takes = [max(take, seq_len + 1) if len(v) else 0
                     for take, v in zip(mix_plan([len(v) for v in vals], weights), vals)]
        train = [span for source, take in enumerate(train_takes)
                 for span in _spans(source, len(trains[source]), 0, take)]
        val_sizes = [len(v) for v in vals]
        val = [span for rounded in _rounds(val_takes, seq_len)
               for span in _spans(rounded.source, val_sizes[rounded.source], rounded.lo,
                                  rounded.hi)]
        return MixtureLayout(train_takes, val_takes, _joined(train, trains, boundary),
                             _joined(val, vals, boundary), trains, vals)

    @property
    def train_tokens(self) -> int:
        return _length(self.train)

    @property
    def val_tokens(self) -> int:
        return _length(self.val)


def _joined(spans: list[Span], parts: list[np.ndarray], boundary: int | None
            ) -> list[Span | int]:
    """`spans` with a boundary token at each junction that lacks one; spans that
    continue one another in the same part are no junction."""
    out: list[Span | int] = []
    for before, after in zip([None, *spans], spans):
        joins = (before is not None and boundary is not None
                 and not (before.source == after.source and before.hi == after.lo))
        if joins:
            if starts_documents(boundary):
                present = int(parts[after.source][after.lo]) == boundary
            else:
                present = int(parts[before.source][before.hi - 1]) == boundary
            if not present:
                out.append(int(boundary))
        out.append(after)
    return out


def _length(items: list[Span | int]) -> int:
    return sum(1 if isinstance(item, int) else item.hi - item.lo for item in items)


def write_mixture(path: Path, layout: MixtureLayout, vocab_size: int) -> None:
    """The mixture file: the layout's training region, then its validation region."""
    from partita.data.tokenfile import TokenFileWriter

    with TokenFileWriter(path, vocab_size) as out:
        for items, parts in ((layout.train, layout.trains), (layout.val, layout.vals)):
            for item in items:
                if isinstance(item, int):
                    out.write(np.asarray([item]))
                    continue
                for start in range(item.lo, item.hi, CHUNK):
                    out.write(np.asarray(parts[item.source][start:min(start + CHUNK, item.hi)]))


def mixture_path(cache_dir: str | os.PathLike, prepared: list[Path], weights: list[float],
                 seq_len: int, val_fraction: float, boundary: int | None = None) -> Path:
    desc = [[str(p), p.stat().st_size, p.stat().st_mtime_ns] for p in prepared]
    marks = None if boundary is None else [int(boundary), starts_documents(boundary)]
    key = hashlib.sha256(json.dumps([desc, weights, seq_len, val_fraction, LAYOUT_VERSION,
                                     marks]).encode())
    return Path(cache_dir) / f"mix-{key.hexdigest()[:16]}.tok"


def check_same_vocab(prepared: list[Path], vocabs: list[int]) -> int:
    if len(set(vocabs)) > 1:
        listed = ", ".join(f"'{p}' ({v})" for p, v in zip(prepared, vocabs))
        raise PartitaError(f"the sources of data.mix have different vocabularies: {listed}; "
                           "mix sources tokenized with one tokenizer.")
    return vocabs[0]
