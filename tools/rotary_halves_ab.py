"""Compiled attention with the rotary pairs as halves against the pairs side by side.

    PYTHONPATH=src python tools/rotary_halves_ab.py [--tp 1|2] [--world 2]
        [--compile model|blocks] [--precision fp32|bf16] [--rounds 12]

Three runners in one process per rank, alternating in rounds of `--steps` steps: eager,
compiled with the halves (`models/rotary.py`, `pairs_as_halves`), and compiled from a
second copy of `partita.models.transformer` whose attention never takes them (the form
before). `--tp 1`: `partita bench compile`'s runners (the tiny model, partita's stage 0,
data parallel over `--world` ranks). `--tp 2`: `bench tp`'s model (dim 256, 8 heads, 4
layers, vocab 1024) split by partita's tensor parallelism over 2 ranks, torch's AdamW.
Printed by rank 0: each runner's median step (quartiles), halves/pairs per round, and
compiled/eager of both. Gloo ranks of one thread; 4 x 128 tokens per rank.
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import statistics
import time

import torch

from partita.local_world import run_distributed


def _pairs_module():
    """A second copy of the model module whose compiled attention keeps the pairs."""
    import partita.models.transformer as transformer

    spec = importlib.util.spec_from_file_location("transformer_pairs", transformer.__file__)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.plain_projection = lambda _module: False
    return module


def _data_parallel_steps(rank: int, world: int, mode: str, precision: str) -> dict:
    from partita.bench import dp as harness
    from partita.bench.compile import EAGER, OURS0, OURS0_MODEL, build_step
    from partita.layout import Layout
    from partita.mesh import Mesh

    mesh = Mesh(Layout(dp=world), rank, world)
    template, vocab = harness.bench_model("tiny", "cpu")
    pairs = _pairs_module().Transformer(template.cfg)
    pairs.load_state_dict(template.state_dict())
    compiled = OURS0_MODEL if mode == "model" else OURS0
    steps = {"eager": build_step(EAGER, copy.deepcopy(template), mesh, precision),
             "halves": build_step(compiled, copy.deepcopy(template), mesh, precision),
             "pairs": build_step(compiled, pairs, mesh, precision)}
    tokens = torch.randint(0, vocab, (4, 129), generator=torch.Generator().manual_seed(0))
    return {k: (lambda step=step: step(tokens)) for k, step in steps.items()}


def _tensor_parallel_steps(rank: int, world: int, mode: str, precision: str) -> dict:
    from partita.compile import compile_block_modules, compile_model
    from partita.layout import Layout
    from partita.mesh import Mesh
    from partita.models import transformer
    from partita.models.model_config import ModelConfig
    from partita.tensor_parallel import apply_tensor_parallel

    mesh = Mesh(Layout(tp=world), rank, world)
    cfg = ModelConfig(vocab_size=1024, dim=256, n_layers=4, n_heads=8, max_seq_len=128)
    weights = transformer.build_model(cfg).state_dict()
    tokens = torch.randint(0, 1024, (4, 129), generator=torch.Generator().manual_seed(0))

    def runner(model_class, compiled: bool):
        model = model_class(cfg)
        model.load_state_dict(weights)
        loss_fn = apply_tensor_parallel(model, model.plan(), mesh.comm("tensor")).loss_fn
        if compiled and mode == "blocks":
            compile_block_modules(list(model.blocks.values()))
        elif compiled:
            compile_model(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

        def step() -> None:
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cpu", torch.bfloat16, enabled=precision == "bf16"):
                loss = loss_fn(model(tokens[:, :-1]), tokens[:, 1:])
            loss.backward()
            opt.step()
        return step

    return {"eager": runner(transformer.Transformer, False),
            "halves": runner(transformer.Transformer, True),
            "pairs": runner(_pairs_module().Transformer, True)}


def _worker(rank: int, world: int, tp: int, mode: str, precision: str, rounds: int,
            steps_per_round: int) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    make = _tensor_parallel_steps if tp > 1 else _data_parallel_steps
    steps = make(rank, world, mode, precision)
    for step in steps.values():  # the first compiles
        for _ in range(4):
            step()
    ms: dict[str, list[float]] = {k: [] for k in steps}
    for r in range(rounds):
        for key in (list(steps) if r % 2 == 0 else list(reversed(steps))):
            dist.barrier()
            start = time.perf_counter()
            for _ in range(steps_per_round):
                steps[key]()
            dist.barrier()
            ms[key].append((time.perf_counter() - start) / steps_per_round * 1e3)
    if rank:
        return
    print(f"tp={tp}, {world} ranks, compile={mode}, {precision}, {rounds} rounds of "
          f"{steps_per_round} steps")
    for key, values in ms.items():
        q = statistics.quantiles(values, n=4)
        print(f"  {key:<7} median {statistics.median(values):7.2f} ms "
              f"(quartiles {q[0]:.2f}-{q[2]:.2f})")
    ratios = [h / p for h, p in zip(ms["halves"], ms["pairs"])]
    q = statistics.quantiles(ratios, n=4)
    print(f"  halves/pairs per round: median {statistics.median(ratios):.3f} "
          f"(quartiles {q[0]:.3f}-{q[2]:.3f})")
    eager = statistics.median(ms["eager"])
    print("  compiled/eager: halves {:.3f}, pairs {:.3f}".format(
        statistics.median(ms["halves"]) / eager, statistics.median(ms["pairs"]) / eager),
        flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, choices=(1, 2), default=1)
    parser.add_argument("--world", type=int, default=1,
                        help="ranks for --tp 1 (default 1); --tp 2 runs on 2")
    parser.add_argument("--compile", choices=("model", "blocks"), default="model")
    parser.add_argument("--precision", choices=("fp32", "bf16"), default="bf16")
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--steps", type=int, default=6, help="steps per round (default 6)")
    args = parser.parse_args()
    world = 2 if args.tp == 2 else args.world
    run_distributed(_worker, world, timeout=3600,
                    args=(args.tp, args.compile, args.precision, args.rounds, args.steps))


if __name__ == "__main__":
    main()
