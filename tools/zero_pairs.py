"""Step-time ratios between partita's own ZeRO settings, timed in alternating rounds.

    PYTHONPATH=src python tools/zero_pairs.py hf-llama-20m --world 1 3/0 2/0
    PYTHONPATH=src python tools/zero_pairs.py llama-20m --world 2 --rounds 16 3/2 "3 keep/2"
    PYTHONPATH=src python tools/zero_pairs.py llama-100m --world 4 --rounds 8 "3 shm/3 gloo"

Each pair "A/B" times setting A against setting B on the same model, world and batches
as `partita bench zero` (`partita.bench.dp`: warm-up, then alternating rounds; the median
of per-round ratios with its 99% interval). A setting is a stage number, optionally
with "keep" (stage 3 keeps every unit gathered from forward into backward), "one"
(stage 3 with every block in one gather unit), "shm" (the stage's gathers,
reduce-scatters and all-reduces of 4 MiB and more through shared memory,
`Mesh(shm_collectives=True)`, as by default) or "gloo" (all of them over gloo's TCP,
`Mesh(shm_collectives=False)`).
`bench zero` times the stages against their peers; this tool compares the stages with
each other, at any world size, 1 included.
"""

from __future__ import annotations

import argparse
import dataclasses

from partita.bench import dp as harness
from partita.local_world import run_distributed

VARIANTS = {"": {}, "keep": {"keep_gathered": 1024}, "one": {"bucket_mb": 1e4}, "shm": {},
            "gloo": {}}
_MESHES: dict = {}  # the mesh of each transport setting, made on first use (collectively)


def build(name: str, model, mesh) -> harness.Step:
    stage, _, variant = name.partition(" ")
    if variant in ("shm", "gloo"):
        if variant not in _MESHES:
            from partita.mesh import Mesh

            _MESHES[variant] = Mesh(mesh.dims, mesh.rank, mesh.world_size,
                                    shm_collectives=variant == "shm")
        mesh = _MESHES[variant]
    return harness.partita_step(model, mesh, int(stage), **VARIANTS[variant])


def _worker(rank: int, world: int, setup: harness.Setup, pairs) -> list[dict]:
    return harness.time_pairs(rank, world, setup, pairs, build, {})


def _setting(text: str) -> str:
    stage, _, variant = text.strip().partition(" ")
    if stage not in ("0", "1", "2", "3") or variant not in VARIANTS:
        raise argparse.ArgumentTypeError(
            f"'{text}' is not a setting: a stage 0-3, optionally followed by "
            f"{' or '.join(repr(v) for v in VARIANTS if v)}")
    return text.strip()


def _pair(text: str) -> tuple[str, str]:
    ours, slash, peer = text.partition("/")
    if not slash:
        raise argparse.ArgumentTypeError(f"'{text}' is not a pair: write A/B, e.g. 3/2")
    return _setting(ours), _setting(peer)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("model")
    parser.add_argument("pairs", type=_pair, nargs="+", help="A/B, e.g. 3/0 or '3 keep/2'")
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=12)
    args = parser.parse_args()
    setup = dataclasses.replace(harness.Setup(model=args.model, rounds=args.rounds,
                                              max_rounds=args.rounds), steps=2)
    rows = run_distributed(_worker, args.world, timeout=7200,
                           args=(setup, args.pairs))[0]
    print(f"{args.model}, {args.world} rank(s), {args.rounds} rounds, "
          f"{setup.batch} x {setup.seq} tokens per rank:")
    for r in rows:
        e = r["estimate"]
        print(f"  stage {r['ours']} / stage {r['peer']}: {e.median:.3f} "
              f"({e.low:.3f}-{e.high:.3f})")


if __name__ == "__main__":
    main()
