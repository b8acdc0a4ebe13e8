"""Parallel degrees, the rank grid, and the process groups named for their purpose.

Rank layout, fastest-varying axis first: tp, cp, dp, pp. So

    rank = tp + TP * (cp + CP * (dp + DP * pp))

Tensor-parallel peers are neighbours (they exchange the most bytes and belong inside a
node); pipeline stages are furthest apart. Expert parallelism is carved out of the
dp x cp ranks of one (tp, pp) position: within that flattened index (cp fastest) the ep
coordinate varies fastest and the expert-data-parallel coordinate slowest.

The grid functions (`coord`, `rank_at`, `group_ranks`, `all_groups`) are pure arithmetic
over the degrees of a `partita.layout.Layout` and are unit-tested for every combination
without processes. `Mesh` turns them into torch.distributed process groups once a world
exists. The mesh knows degrees only: policies (ZeRO stage, schedule, ...) stay in the
Layout and are read by the code that applies them.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING

from partita import shm_collectives as shm
from partita import shm_share
from partita.comm import CommCounter, GroupComm
from partita.errors import PartitaError
from partita.layout import Degrees, Layout
from partita.layout_rules import world_size_message

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


def coord(dims: Degrees, rank: int) -> Coord:
    """The (tp, cp, dp, pp) position of `rank`."""
    if not 0 <= rank < dims.world_size:
        raise ValueError(f"rank {rank} outside world of {dims.world_size}")
    tp, rest = rank % dims.tp, rank // dims.tp
    cp, rest = rest % dims.cp, rest // dims.cp
    dp, pp = rest % dims.dp, rest // dims.dp
    return Coord(tp=tp, cp=cp, dp=dp, pp=pp)


def rank_at(dims: Degrees, tp: int = 0, cp: int = 0, dp: int = 0, pp: int = 0) -> int:
    """The rank at a position of the grid."""
    return tp + dims.tp * (cp + dims.cp * (dp + dims.dp * pp))


def group_ranks(dims: Degrees, axes: tuple[str, ...]) -> list[list[int]]:
    """Every group of ranks that differ only along `axes` (ascending ranks each)."""
    sizes = dims.sizes()
    fixed = [a for a in AXES if a not in axes]
    groups = []
    for fixed_values in itertools.product(*(range(sizes[a]) for a in fixed)):
        base = dict(zip(fixed, fixed_values))
        members = []
        for varying in itertools.product(*(range(sizes[a]) for a in axes)):
            members.append(rank_at(dims, **base, **dict(zip(axes, varying))))
        groups.append(sorted(members))
    return groups


def expert_group_ranks(dims: Degrees) -> tuple[list[list[int]], list[list[int]]]:
    """(expert-parallel groups, expert-data-parallel groups)."""
    ep_groups, edp_groups = [], []
    for dpcp in group_ranks(dims, ("cp", "dp")):
        # dpcp is sorted, which orders by dp*CP + cp: cp fastest, as documented.
        edp = len(dpcp) // dims.ep
        ep_groups += [dpcp[i * dims.ep:(i + 1) * dims.ep] for i in range(edp)]
        edp_groups += [dpcp[j::dims.ep] for j in range(dims.ep)]
    return ep_groups, edp_groups


def embedding_group_ranks(dims: Degrees) -> list[list[int]]:
    """First and last pipeline stage of each (tp, cp, dp) position: they exchange the
    tied embedding. Middle stages form groups of one, so every rank has the purpose."""
    groups = []
    for stages in group_ranks(dims, ("pp",)):
        groups.append(sorted({stages[0], stages[-1]}))
        groups += [[r] for r in stages[1:-1]]
    return groups


def all_groups(dims: Degrees) -> dict[str, list[list[int]]]:
    """Purpose name -> its groups, in a fixed order every rank agrees on."""
    out = {name: group_ranks(dims, axes) for name, axes in PURPOSES.items()}
    out["expert"], out["expert_grad_reduce"] = expert_group_ranks(dims)
    out["embedding"] = embedding_group_ranks(dims)
    return out


def check_world_size(dims: Degrees, world_size: int) -> None:
    if dims.world_size != world_size:
        raise PartitaError(world_size_message(dims, world_size, library=True))


def check_world_argument(dims: Degrees, world_size: int) -> None:
    """Refuse a `world_size` other than torch.distributed's, once it has a world, before
    the degrees are weighed against it: a layout checked against a wrong count would be
    refused with a false number of processes and advice to change the degrees. A
    one-process mesh (degrees and world_size 1) may be built inside a larger world."""
    if world_size == 1 and dims.world_size == 1:
        return
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return
    actual = dist.get_world_size()
    if world_size != actual:
        default = " (its default)" if world_size == 1 else ""
        raise PartitaError(
            f"Mesh(world_size={world_size}){default} disagrees with torch.distributed, "
            f"whose world has {actual} processes; the mesh's degrees ({dims}) are laid "
            "out over the world size it is given. Build it as Mesh(degrees, "
            "rank=dist.get_rank(), world_size=dist.get_world_size()).")


def check_shm_choice_agrees(use_shm: bool, world_size: int) -> int | None:
    """Refuse, on every process at once, a gloo job whose processes chose differently
    whether their groups use the shared-memory arena, or from what size: they would
    disagree about which collectives go through it and wait for each other until the
    collective timeout. One all-reduce over the world, when the mesh is built. Returns
    the floor (`shm_collectives.floor_bytes`) where the arena is used, for its groups."""
    import torch
    import torch.distributed as dist

    from partita.agreement import over_all_ranks

    use, floor, unreadable = int(use_shm), 0, None
    try:
        floor = shm.floor_bytes() if use_shm else 0
    except PartitaError as exc:  # said everywhere at once, below: no process waits alone
        unreadable = exc
    if world_size == 1 or dist.get_backend() != dist.Backend.GLOO:
        # Nothing to agree on; an unreadable floor is left to ShmGroup, which refuses it.
        return floor if use_shm and unreadable is None else None
    # The largest and the smallest of each, in one all-reduce.
    largest = over_all_ranks([use, floor, -use, -floor, unreadable is not None],
                             dist.ReduceOp.MAX, torch.device("cpu"))
    if largest[4]:
        raise unreadable or PartitaError(
            f"another process's {shm.ENV_MIN_BYTES} is not a byte count: give every "
            "process the same whole number, or unset it.")
    if largest[0] != -largest[2]:
        what = "some processes use the shared-memory collectives and some do not"
    elif largest[1] != -largest[3]:
        what = (f"the processes send collectives through shared memory from different "
                f"sizes ({-int(largest[3])} to {int(largest[1])} bytes)")
    else:
        return floor if use_shm else None
    raise PartitaError(
        f"{what}: give every process the same {shm_share.ENV_SWITCH} and {shm.ENV_MIN_BYTES} (or "
        "the same Mesh(shm_collectives=...)); otherwise their collectives would wait for "
        "each other until they time out.")


def check_process_group(rank: int | None, world_size: int) -> int:
    """The mesh's rank, checked against torch.distributed's world.

    A mesh over several processes creates process groups over the whole world, so its
    rank and world size must be the process group's: a wrong rank (e.g. left at 0 on
    every process) would give several processes the same data and the same shards,
    and train wrong without any error. A one-process mesh (world_size 1) needs no
    process group and may be built inside a larger world."""
    if world_size == 1:
        if rank not in (None, 0):
            raise PartitaError(f"Mesh(rank={rank}, world_size=1): a one-process mesh has "
                               "only rank 0; pass the world size of the job.")
        return 0
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise PartitaError(
            f"Mesh(world_size={world_size}) needs torch.distributed's default process "
            "group: call torch.distributed.init_process_group(...) first (under torchrun, "
            "init_process_group('gloo') or ('nccl') reads RANK and WORLD_SIZE), then build "
            "the Mesh with rank=dist.get_rank(), world_size=dist.get_world_size().")
    actual_rank, actual_world = dist.get_rank(), dist.get_world_size()
    if world_size != actual_world or rank not in (None, actual_rank):
        raise PartitaError(
            f"Mesh(rank={rank}, world_size={world_size}) disagrees with torch.distributed "
            f"(rank {actual_rank} of {actual_world}): every process would compute its "
            "place in the grid from the wrong numbers, and processes sharing a rank train "
            "on the same data. Build it as Mesh(layout, rank=dist.get_rank(), "
            "world_size=dist.get_world_size()).")
    return actual_rank


class Mesh:
    """This rank's place in the grid and its process groups, one per purpose.

    Build it after `torch.distributed.init_process_group` (or with world_size 1 and no
    process group at all). Group handles are None when the group has one member, and
    every collective in `partita.comm` treats None as "nothing to do". `rank` defaults
    to torch.distributed's rank when the mesh spans several processes; a rank or world
    size that disagrees with the process group is refused (`check_process_group`).

    `shm_collectives`: True moves the flat all-gathers and reduce-scatters of a gloo
    group whose members all run on this host through shared memory
    (`partita.shm_collectives`: every size, or from PARTITA_SHM_MIN_BYTES bytes where
    that is set); False keeps gloo's TCP
    forms; None (the default) leaves it to the environment variable
    PARTITA_SHM_COLLECTIVES (0: off; on otherwise).
    Every process must make the same choice: a gloo mesh refuses processes that do not
    (`check_shm_choice_agrees`).
    """

    def __init__(self, layout: Layout | Degrees, rank: int | None = None,
                 world_size: int = 1, timeout_s: float | None = None,
                 shm_collectives: bool | None = None) -> None:
        dims = layout.degrees if isinstance(layout, Layout) else layout
        check_world_argument(dims, world_size)  # before the CLI-worded layout message
        check_world_size(dims, world_size)
        rank = check_process_group(rank, world_size)
        self.dims: Degrees = dims
        self.rank = rank
        self.world_size = world_size
        self.coord = coord(dims, rank)
        self.ranks: dict[str, list[int]] = {}
        self.counter = CommCounter()
        self.groups: dict[str, dist.ProcessGroup | None] = {}
        # Purposes with the same members share one group (with cp=1, "data", "grad_reduce"
        # and "zero_shard" are the same ranks); fewer groups start faster.
        made: dict[tuple, dist.ProcessGroup | None] = {}
        # One shared-memory transport per group of this rank, whatever its purposes.
        self.shm_groups: dict[tuple, shm.ShmGroup] = {}
        self._shm_keys: dict[str, tuple] = {}
        use_shm = shm_share.wanted(shm_collectives) and shm_share.supported()
        floor = check_shm_choice_agrees(use_shm, world_size)
        for purpose, groups in all_groups(dims).items():
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
                    if use_shm and handle is not None and key not in self.shm_groups:
                        self.shm_groups[key] = shm.ShmGroup(handle, members,
                                                            members.index(rank), min_bytes=floor)
                    self._shm_keys[purpose] = key

    def group(self, purpose: str) -> dist.ProcessGroup | None:
        return self.groups[purpose]

    def comm(self, purpose: str) -> GroupComm:
        """Counted collectives over this rank's group for `purpose`."""
        return GroupComm(self.groups[purpose], self.ranks[purpose], self.rank, purpose,
                         self.counter, shm=self.shm_groups.get(self._shm_keys[purpose]))

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
