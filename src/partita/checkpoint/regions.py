"""Which elements of a global tensor a rank holds, as runs of the global flat order.

Every piece of training state a rank holds is described by two cuts of one global
tensor: the tensor-parallel cut (`narrow(dim, start, stop)`, from the parameter's
ShardInfo) and then the ZeRO cut (elements [lo, hi) of that narrowed tensor, flattened).
A `Region` is that description. `runs()` turns it into contiguous runs of the *global*
tensor's flat order, which is what makes resharding simple: two regions written and
read under different layouts overlap exactly where their runs intersect.

Why runs are few: view the global tensor as [P, D, Q] around the split dimension
(P = product of the dims before it, Q = of the dims after). The narrowed tensor is
[P, stop - start, Q], and for each p its elements are one contiguous stretch of the
global order. So a row split (dim 0) or no split is one run, and a column split of an
[out, in] matrix is at most `out` runs. A tensor cut along several dimensions (`more`)
is the same with D the innermost cut: one stretch per index of the (cut) dims before it.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # sharding imports torch; a Region is plain numbers
    from partita.sharding import ShardInfo

Run = tuple[int, int, int]  # (global start, global stop, offset within the piece)


@dataclass(frozen=True)
class Region:
    """global.narrow(dim, start, stop - start) (then each of `more`'s cuts)
    .reshape(-1)[lo:hi]; dim None = no split."""

    global_shape: tuple[int, ...]
    dim: int | None
    start: int
    stop: int
    lo: int
    hi: int
    more: tuple[tuple[int, int, int], ...] = ()  # further (dim, start, stop) cuts

    @classmethod
    def of(cls, info: ShardInfo, lo: int, hi: int) -> Region:
        """Elements [lo, hi) of the shard a `partita.sharding.ShardInfo` describes."""
        return cls(tuple(info.global_shape), info.dim, info.start, info.stop, lo, hi,
                   tuple(info.more))

    @property
    def numel(self) -> int:
        return self.hi - self.lo

    def runs(self) -> list[Run]:
        """The region as increasing, non-touching runs of the global flat order."""
        if self.dim is None:
            return [(self.lo, self.hi, 0)] if self.hi > self.lo else []
        shape = self.global_shape
        cuts = {self.dim: (self.start, self.stop), **{d: (a, b) for d, a, b in self.more}}
        inner = max(cuts)  # each index of the dims before it is one contiguous stretch
        q = math.prod(shape[inner + 1:])
        width = (cuts[inner][1] - cuts[inner][0]) * q  # local elements per stretch
        # The dims before `inner`: their local extents, first global index and strides.
        outer = [(cuts[d][1] - cuts[d][0], cuts[d][0]) if d in cuts else (shape[d], 0)
                 for d in range(inner)]
        strides = [math.prod(shape[d + 1:]) for d in range(inner)]
        out: list[Run] = []
        for p in range(self.lo // width, -(-self.hi // width)):
            g, rest = cuts[inner][0] * q, p
            for (extent, first), stride in zip(reversed(outer), reversed(strides)):
                rest, i = divmod(rest, extent)
                g += (first + i) * stride
            a, b = max(self.lo, p * width), min(self.hi, (p + 1) * width)
            g += a - p * width
            if out and out[-1][1] == g:  # a full-width split: the runs touch
                out[-1] = (out[-1][0], g + b - a, out[-1][2])
            else:
                out.append((g, g + b - a, a - self.lo))
        return out


@dataclass(frozen=True)
class Overlap:
    """`length` elements at offset `dst` of the wanted region come from offset `src` of
    source piece number `source`."""

    source: int
    src: int
    dst: int
    length: int


class RunIndex:
    """Pieces of one global tensor (not overlapping each other), indexed by their runs,
    to find where the elements of any other region of it are held."""

    def __init__(self, sources: Iterable[Region]) -> None:
        self.table: list[tuple[int, int, int, int]] = []  # (g0, g1, source, offset)
        for index, region in enumerate(sources):
            self.table.extend((g0, g1, index, off) for g0, g1, off in region.runs())
        self.table.sort()
        self.starts = [row[0] for row in self.table]

    def find(self, wanted: Region) -> list[Overlap]:
        """Where each element of `wanted` sits among the sources. Elements no source
        holds are absent: compare the total length with `wanted.numel` to find gaps."""
        table, out = self.table, []
        for w0, w1, woff in wanted.runs():
            # The source run starting at or before w0, then every one starting before w1.
            i = max(bisect.bisect_right(self.starts, w0) - 1, 0)
            while i < len(table) and table[i][0] < w1:
                g0, g1, source, soff = table[i]
                a, b = max(w0, g0), min(w1, g1)
                if a < b:
                    out.append(Overlap(source, soff + a - g0, woff + a - w0, b - a))
                i += 1
        return out
