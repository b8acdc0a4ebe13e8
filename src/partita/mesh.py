"""Parallel degrees, the rank grid, and the process groups named for their purpose.

Rank layout, fastest-varying axis first: tp, cp, dp, pp. So

    rank = tp + TP * (cp + CP * (dp + DP * pp))

Tensor-parallel peers are neighbours (they exchange the most bytes and belong inside a
node); pipeline stages are furthest apart. Expert parallelism is carved out of the
dp x cp ranks of one (tp, pp) position: within that flattened index (cp fastest) the ep
coordinate varies fastest and the expert-data-parallel coordinate slowest.

`ParallelDims` is pure arithmetic and is unit-tested for every combination without
processes. `Mesh` turns it into torch.distributed process groups once a world exists.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

from partita.comm import CommCounter, GroupComm
from partita.errors import PartitaError

if TYPE_CHECKING:
    import torch.distributed as dist

AXES = ("tp", "cp", "dp", "pp")

# Purpose -> the axes whose ranks form that group.
PURPOSES: dict[str, tuple[str, ...]] = {
    "tensor": ("tp",),
    "context": ("cp",),
    "data": ("dp",),
    "pipeline": ("pp",),
    # Dense gradients are reduced, ZeRO shards, and the loss is averaged, over every rank
    # that sees different tokens of the same model replica: data x context.
    "grad_reduce": ("cp", "dp"),
    "zero_shard": ("cp", "dp"),
    "loss_average": ("cp", "dp"),
    # Every rank that holds a slice of the same model replica.
    "model_parallel": ("tp", "pp"),
}


@dataclass(frozen=True)
class Coord:
    tp: int
    cp: int
    dp: int
    pp: int


@dataclass(frozen=True)
class ParallelDims:
    """Degrees of each parallel dimension; their product is the world size."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    zero_stage: int = 0

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name != "zero_stage" and (not isinstance(value, int) or value < 1):
                raise PartitaError(
                    f"parallel.{f.name}={value!r} is invalid: every degree is a positive "
                    "integer (1 turns that dimension off)."
                )
        if self.zero_stage not in (0, 1, 2, 3):
            raise PartitaError(
                f"parallel.zero_stage={self.zero_stage} is invalid: use 0 (plain data "
                "parallel), 1 (shard optimizer state), 2 (+ gradients) or 3 (+ parameters)."
            )
        if (self.dp * self.cp) % self.ep:
            raise PartitaError(
                f"parallel.ep={self.ep} must divide dp*cp={self.dp * self.cp}: expert "
                "parallel ranks are carved out of the data x context ranks. Valid ep: "
                f"{[d for d in range(1, self.dp * self.cp + 1) if self.dp * self.cp % d == 0]}."
            )

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    def __str__(self) -> str:
        extra = "".join(f" {k}={v}" for k, v in (("cp", self.cp), ("ep", self.ep)) if v > 1)
        return f"dp={self.dp} tp={self.tp} pp={self.pp}{extra} zero={self.zero_stage}"

    def sizes(self) -> dict[str, int]:
        return {"tp": self.tp, "cp": self.cp, "dp": self.dp, "pp": self.pp}

    def check_world_size(self, world_size: int) -> None:
        if self.world_size != world_size:
            raise PartitaError(
                f"the layout dp={self.dp} x tp={self.tp} x pp={self.pp} x cp={self.cp} needs "
                f"{self.world_size} processes but {world_size} were started. Start "
                f"{self.world_size} processes (--nproc {self.world_size}), or change the "
                f"degrees so that their product is {world_size} (for example "
                f"--parallel.dp={max(1, world_size // (self.tp * self.pp * self.cp))})."
            )

    @classmethod
    def fill_dp(cls, world_size: int, **degrees: int) -> ParallelDims:
        """Degrees with dp chosen so that the product is `world_size`."""
        other = degrees.get("tp", 1) * degrees.get("pp", 1) * degrees.get("cp", 1)
        if world_size % other:
            raise PartitaError(
                f"tp*pp*cp={other} does not divide the world size {world_size}; choose "
                "degrees whose product divides the number of processes."
            )
        return cls(dp=world_size // other, **degrees)

    # Rank <-> coordinate -------------------------------------------------------------
    def coord(self, rank: int) -> Coord:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside world of {self.world_size}")
        tp, rest = rank % self.tp, rank // self.tp
        cp, rest = rest % self.cp, rest // self.cp
        dp, pp = rest % self.dp, rest // self.dp
        return Coord(tp=tp, cp=cp, dp=dp, pp=pp)

    def rank(self, tp: int = 0, cp: int = 0, dp: int = 0, pp: int = 0) -> int:
        return tp + self.tp * (cp + self.cp * (dp + self.dp * pp))

    def group_ranks(self, axes: tuple[str, ...]) -> list[list[int]]:
        """Every group of ranks that differ only along `axes` (ascending ranks each)."""
        sizes = self.sizes()
        fixed = [a for a in AXES if a not in axes]
        groups = []
        for fixed_values in itertools.product(*(range(sizes[a]) for a in fixed)):
            base = dict(zip(fixed, fixed_values))
            members = []
            for varying in itertools.product(*(range(sizes[a]) for a in axes)):
                members.append(self.rank(**base, **dict(zip(axes, varying))))
            groups.append(sorted(members))
        return groups

    def expert_group_ranks(self) -> tuple[list[list[int]], list[list[int]]]:
        """(expert-parallel groups, expert-data-parallel groups)."""
        ep_groups, edp_groups = [], []
        for dpcp in self.group_ranks(("cp", "dp")):
            # dpcp is sorted, which orders by dp*CP + cp: cp fastest, as documented.
            edp = len(dpcp) // self.ep
            ep_groups += [dpcp[i * self.ep:(i + 1) * self.ep] for i in range(edp)]
            edp_groups += [dpcp[j::self.ep] for j in range(self.ep)]
        return ep_groups, edp_groups

    def all_groups(self) -> dict[str, list[list[int]]]:
        """Purpose name -> its groups, in a fixed order every rank agrees on."""
        out = {name: self.group_ranks(axes) for name, axes in PURPOSES.items()}
        out["expert"], out["expert_grad_reduce"] = self.expert_group_ranks()
        out["embedding"] = self.embedding_group_ranks()
        return out

    def embedding_group_ranks(self) -> list[list[int]]:
        """First and last pipeline stage of each (tp, cp, dp) position: they exchange the
        tied embedding. Middle stages form groups of one, so every rank has the purpose."""
        groups = []
        for stages in self.group_ranks(("pp",)):
            groups.append(sorted({stages[0], stages[-1]}))
            groups += [[r] for r in stages[1:-1]]
        return groups


class Mesh:
    """This rank's place in the grid and its process groups, one per purpose.

    Build it after `torch.distributed.init_process_group` (or with world_size 1 and no
    process group at all). Group handles are None when the group has one member, and
    every collective in `partita.comm` treats None as "nothing to do".
    """

    def __init__(self, dims: ParallelDims, rank: int = 0, world_size: int = 1,
                 timeout_s: float | None = None) -> None:
        dims.check_world_size(world_size)
        self.dims = dims
        self.rank = rank
        self.world_size = world_size
        self.coord = dims.coord(rank)
        self.ranks: dict[str, list[int]] = {}
        self.counter = CommCounter()
        self.groups: dict[str, dist.ProcessGroup | None] = {}
        # Purposes with the same members share one group (with cp=1, "data", "grad_reduce"
        # and "zero_shard" are the same ranks); fewer groups start faster.
        made: dict[tuple, dist.ProcessGroup | None] = {}
        for purpose, groups in dims.all_groups().items():
            for members in groups:
                # The embedding exchange gets a communicator of its own even when the
                # pipeline has the same members (pp=2): p2p matches by order per group.
                key = (purpose == "embedding", *members)
                if key not in made:
                    # new_group is collective over the whole world: every rank creates
                    # every group, in the same order, even those it is not part of.
                    made[key] = _new_group(members, timeout_s) if len(members) > 1 else None
                handle = made[key]
                if rank in members:
                    self.ranks[purpose] = members
                    self.groups[purpose] = handle

    def group(self, purpose: str) -> dist.ProcessGroup | None:
        return self.groups[purpose]

    def comm(self, purpose: str) -> GroupComm:
        """Counted collectives over this rank's group for `purpose`."""
        return GroupComm(self.groups[purpose], self.ranks[purpose], self.rank, purpose,
                         self.counter)

    def size(self, purpose: str) -> int:
        return len(self.ranks[purpose])

    def index(self, purpose: str) -> int:
        """This rank's position within its group for `purpose`."""
        return self.ranks[purpose].index(self.rank)

    def __repr__(self) -> str:
        c = self.coord
        return f"Mesh(rank={self.rank}, tp={c.tp}, cp={c.cp}, dp={c.dp}, pp={c.pp}, {self.dims})"


def _new_group(members: list[int], timeout_s: float | None):
    """A process group over `members`. Without an explicit timeout torch gives each new
    group its 30-minute default, not the world group's: a stalled peer would then hang
    every collective of the group for half an hour."""
    import datetime

    import torch.distributed as dist

    if timeout_s is None:
        return dist.new_group(members)
    return dist.new_group(members, timeout=datetime.timedelta(seconds=timeout_s))
