"""Tensor-parallel bytes per layer per microbatch, measured vs the Megatron formula.

Per transformer layer and microbatch, forward plus backward, each rank sends

    8 * b * s * h * (t - 1) / t * bytes_per_element

(four all-reduces of the b*s*h activations, each 2(t-1)/t of the tensor; under sequence
parallelism four all-gathers and four reduce-scatters of (t-1)/t each: the same volume).
The counter in partita.comm counts what our collectives send. Bytes per layer are the
difference between a 2-layer and a 1-layer model (so embedding, head and loss cancel).
"""

from __future__ import annotations

import argparse

import torch

from partita.arg_types import count
from partita.layout import Layout
from partita.local_world import run_distributed
from partita.mesh import Mesh
from partita.models.model_config import ModelConfig
from partita.models.transformer import build_model
from partita.tensor_parallel import apply_tensor_parallel


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tp", type=count, default=2)
    parser.add_argument("--dim", type=count, default=256)
    parser.add_argument("--heads", type=count, default=8)
    parser.add_argument("--batch", type=count, default=4)
    parser.add_argument("--seq", type=count, default=128)
    parser.add_argument("--vocab", type=count, default=512)


def theory_bytes(batch: int, seq: int, dim: int, tp: int, element_size: int) -> float:
    return 8 * batch * seq * dim * (tp - 1) / tp * element_size


def _bytes_sent(rank: int, world: int, model_kwargs: dict, batch: int, seq: int,
                sequence_parallel: bool) -> dict[str, float]:
    mesh = Mesh(Layout(tp=world), rank, world)
    out = {}
    for layers in (1, 2):
        cfg = ModelConfig(**model_kwargs, n_layers=layers, max_seq_len=seq)
        model = build_model(cfg)
        report = apply_tensor_parallel(model, model.plan(), mesh.comm("tensor"),
                                       sequence_parallel)
        tokens = torch.randint(cfg.vocab_size, (batch, seq + 1),
                               generator=torch.Generator().manual_seed(0))
        mesh.counter.reset()
        report.loss_fn(model(tokens[:, :-1]), tokens[:, 1:]).backward()
        out[layers] = mesh.counter.total("tensor")
    return out


def measure(tp: int, model_kwargs: dict, batch: int, seq: int,
            sequence_parallel: bool) -> dict[str, float]:
    """Bytes per layer (measured on rank 0) and the formula, for one layout."""
    sent = run_distributed(_bytes_sent, tp, args=(model_kwargs, batch, seq,
                                                  sequence_parallel))[0]
    per_layer = sent[2] - sent[1]
    theory = theory_bytes(batch, seq, model_kwargs["dim"], tp, 4)
    return {"per_layer": per_layer, "theory": theory, "rest": sent[1] - per_layer,
            "ratio": per_layer / theory}


def run(args: argparse.Namespace) -> int:
    kwargs = dict(vocab_size=args.vocab, dim=args.dim, n_heads=args.heads)
    print(f"model dim={args.dim} heads={args.heads} vocab={args.vocab}, microbatch "
          f"b={args.batch} s={args.seq}, tp={args.tp}, fp32; bytes sent per rank")
    print(f"{'layout':<10}{'per layer':>14}{'8bsh(t-1)/t':>14}{'ratio':>8}"
          f"{'embed+head+loss':>18}")
    worst = 1.0
    for sp in (False, True):
        m = measure(args.tp, kwargs, args.batch, args.seq, sp)
        name = "tp+sp" if sp else "tp"
        print(f"{name:<10}{m['per_layer']:>14,.0f}{m['theory']:>14,.0f}{m['ratio']:>8.4f}"
              f"{m['rest']:>18,.0f}")
        if abs(m["ratio"] - 1) >= abs(worst - 1):
            worst = m["ratio"]
    print(f"tp-comm: measured/theory {worst:.4f}")
    return 0
