"""Random layouts against one process: a search for compositions the parity tests miss.

Draws layouts at random (degrees, ZeRO stage, schedule, recomputation, offload, mixture
of experts, model flavour, q/k/v biases, ...), drops those partita refuses before launch (counting
each refusal's first words), trains the rest in float64 for a few steps on one spawned
world per batch, and checks every rank against one process with the same global batch
(`partita.testing.check_layouts`, 1e-10 relative). A layout the checks accept but
whose ranks disagree with the reference is a bug; so is one that crashes.

    PYTHONPATH=src python tools/parity_fuzz.py --world 4 --layouts 24 --seed 1
    PYTHONPATH=src python tools/parity_fuzz.py --world 4 --seed 25 --gloo-forms

Prints each failing layout's settings (ready to paste into a test) and a summary.
"""

from __future__ import annotations

import argparse
import collections
import os
import random
import sys
import time

from partita import shm_share
from partita.errors import PartitaError
from partita.testing import Case, check_layouts, parity_config


def _degrees(rng: random.Random, world: int) -> dict[str, int]:
    """dp, tp, pp and cp whose product is `world`, each a power of two."""
    out = dict(dp=1, tp=1, pp=1, cp=1)
    left = world
    while left > 1:
        name = rng.choice(["dp", "dp", "tp", "pp", "cp"])
        out[name] *= 2
        left //= 2
    return out


def draw(rng: random.Random, world: int) -> tuple[dict, dict, dict]:
    """(model, parallel, train) settings of one random layout."""
    deg = _degrees(rng, world)
    model: dict = dict(n_layers=rng.choice([2, 4]), flavour=rng.choice(["llama", "llama", "gpt2"]),
                       tie_embeddings=rng.random() < 0.3)
    parallel: dict = dict(deg, zero_stage=rng.randrange(4), bucket_mb=rng.choice([0.02, 25.0]))
    train: dict = dict(lr=1e-2, microbatches=rng.choice([1, 2, 4]), grad_clip=rng.choice([0.0, 1.0]))
    if rng.random() < 0.3 and model["flavour"] == "llama":
        model.update(n_experts=4, top_k=rng.choice([1, 2]), expert_ffn_dim=16,
                     aux_loss_weight=0.1, z_loss_weight=0.01)
        if rng.random() < 0.3:
            model["capacity_factor"] = 1.0
        ep_room = deg["dp"] * deg["cp"]
        parallel["ep"] = rng.choice([e for e in (1, 2, 4) if ep_room % e == 0])
    if deg["tp"] > 1:
        parallel["sequence_parallel"] = rng.random() < 0.6
        if model.get("n_experts"):
            parallel["moe_tp"] = rng.choice(["replicate", "experts", "hidden"])
            if rng.random() < 0.3:
                model["shared_experts"] = 1
    if deg["pp"] > 1:
        parallel["schedule"] = rng.choice(["gpipe", "1f1b", "interleaved-1f1b", "zb-h1"])
        parallel["pp_balance"] = rng.choice(["even", "params", "flops"])
    if deg["cp"] > 1:
        parallel["cp_kind"] = rng.choice(["ring", "allgather"])
    parallel["recompute"] = rng.choice(["none", "none", "selective", "full"])
    if parallel["zero_stage"] == 3:
        parallel["prefetch"] = rng.choice([0, 1, 2])
        parallel["keep_gathered"] = rng.choice([0, 1, 2])
    if parallel["zero_stage"] == 2:
        parallel["accumulation"] = rng.choice(["reduce", "buffer"])
    if rng.random() < 0.15:
        parallel["offload"] = "optimizer"
    if model["flavour"] == "llama" and rng.random() < 0.25:
        model["qkv_bias"] = True  # Qwen2's biases (drawn last: earlier draws unchanged)
    return model, parallel, train


# What the summary counts among the layouts trained.
FEATURES = {
    "tp": lambda c: c.parallel.tp > 1,
    "sp": lambda c: c.parallel.sequence_parallel,
    "pp": lambda c: c.parallel.pp > 1,
    "cp": lambda c: c.parallel.cp > 1,
    "ZeRO-3": lambda c: c.parallel.zero_stage == 3,
    "recompute": lambda c: c.parallel.recompute != "none",
    "offload": lambda c: c.parallel.offload != "none",
    "MoE": lambda c: bool(c.model.n_experts),
    "ep": lambda c: c.parallel.ep > 1,
    "MoE with cp": lambda c: bool(c.model.n_experts) and c.parallel.cp > 1,
    "MoE with sp": lambda c: bool(c.model.n_experts) and c.parallel.sequence_parallel,
    "experts split over tp": lambda c: c.parallel.moe_tp == "experts" and c.parallel.tp > 1,
    "expert widths split over tp": lambda c: c.parallel.moe_tp == "hidden" and c.parallel.tp > 1,
    "q/k/v biases": lambda c: bool(c.model.qkv_bias),
}


def _refusal(cfg, world: int) -> str | None:
    from partita.parallelize import check_layout

    try:
        check_layout(cfg, cfg.model_config(), cfg.layout(world), world)
    except PartitaError as exc:
        return str(exc)
    return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--layouts", type=int, default=24, help="layouts to train")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--batch", type=int, default=6, help="layouts per spawned world")
    ap.add_argument("--gloo-forms", action="store_true",
                    help="keep every collective on gloo's TCP forms instead of the "
                         "shared-memory arena the ranks of one host use by default")
    args = ap.parse_args(argv)
    if args.gloo_forms:  # read by each spawned rank when it builds its mesh
        os.environ[shm_share.ENV_SWITCH] = "0"
    rng = random.Random(args.seed)
    cases: list[Case] = []
    refused: collections.Counter[str] = collections.Counter()
    tries = 0
    while len(cases) < args.layouts and tries < 100 * args.layouts:
        tries += 1
        model, parallel, train = draw(rng, args.world)
        cfg = parity_config(model=model, parallel=parallel, train=train)
        reason = _refusal(cfg, args.world)
        if reason:
            refused[" ".join(reason.split()[:6])] += 1
            continue
        name = ",".join(f"{k}={v}" for k, v in {**model, **parallel, **train}.items())
        cases.append(Case(id=name, cfg=cfg, params=True))
    failures = []
    start = time.perf_counter()
    for i in range(0, len(cases), args.batch):
        batch = cases[i:i + args.batch]
        try:
            check_layouts(batch, args.world, args.steps, timeout=600)
            print(f"{i + len(batch)}/{len(cases)} layouts agree "
                  f"({time.perf_counter() - start:.0f} s)", flush=True)
        except Exception as exc:  # noqa: BLE001 - a fuzzer reports every kind of failure
            # One failure hides which layouts of the batch were at fault: rerun each alone.
            for case in batch:
                try:
                    check_layouts([case], args.world, args.steps, timeout=600)
                except Exception as one:  # noqa: BLE001
                    failures.append((case.id, f"{type(one).__name__}: {one}"[:2000]))
                    print(f"FAIL {case.id}\n  {failures[-1][1][:600]}", flush=True)
            if not any(f[0] in {c.id for c in batch} for f in failures):
                failures.append(("batch " + str(i), f"{type(exc).__name__}: {exc}"[:2000]))
    print(f"\n{len(cases)} layouts trained on world {args.world} (seed {args.seed}), "
          f"{len(failures)} failed; among them: " + ", ".join(
              f"{name} {sum(1 for c in cases if test(c.cfg))}"
              for name, test in FEATURES.items()))
    print(f"{sum(refused.values())} drawn layouts refused before launch:")
    for reason, n in refused.most_common(12):
        print(f"  {n:4d}  {reason} ...")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
