"""Train your own PyTorch model with partita's data parallelism (ZeRO) from your own script.

    torchrun --nproc-per-node 2 docs/library_example.py --zero-stage 3 --out tiny_lm.pt

docs/library.md explains each step; tests/dist/test_library_example.py runs this file.
"""

import argparse

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from partita.layout import Degrees
from partita.mesh import Mesh
from partita.zero import AdamWConfig, DataParallel, MixedPrecision, ZeroConfig

VOCAB, DIM, SEQ = 64, 32, 16


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.up, self.down = nn.Linear(DIM, 4 * DIM), nn.Linear(4 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList([Block() for _ in range(2)])
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def global_batch(step: int, rows: int = 8) -> torch.Tensor:
    """The same rows on every rank: sequences where next = 5 * token + 3 (mod VOCAB)."""
    gen = torch.Generator().manual_seed(step)
    tokens = torch.empty(rows, SEQ + 1, dtype=torch.long)
    tokens[:, 0] = torch.randint(VOCAB, (rows,), generator=gen)
    for t in range(SEQ):
        tokens[:, t + 1] = (5 * tokens[:, t] + 3) % VOCAB
    return tokens


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--zero-stage", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--microbatches", type=int, default=2)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--out", default="tiny_lm.pt")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)

    dist.init_process_group("gloo")  # GPUs: "nccl", after torch.cuda.set_device(local rank)
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = Mesh(Degrees(dp=world), rank, world)

    torch.manual_seed(0)  # any seed: the engine starts every rank from rank 0's weights
    model = TinyLM().to(dtype)
    dp = DataParallel(model, mesh, zero=ZeroConfig(stage=args.zero_stage),
                      precision=MixedPrecision(param_dtype=dtype),
                      optim=AdamWConfig(lr=1e-2, weight_decay=0.1),
                      blocks=Block)  # what ZeRO-3 gathers one at a time

    for step in range(args.steps):
        mine = global_batch(step).chunk(world)[rank]  # this rank's rows
        total = 0.0
        for i, micro in enumerate(mine.chunk(args.microbatches)):
            with dp.grad_sync(i == args.microbatches - 1):  # reduce after the last one
                logits = dp.module(micro[:, :-1])
                loss = F.cross_entropy(logits.flatten(0, 1), micro[:, 1:].flatten())
                dp.backward(loss / args.microbatches)
            total += loss.item() / args.microbatches
        dp.finish_grad_sync()
        norm = dp.clip_grad_norm_(1.0)  # the global norm, before clipping
        dp.step()  # or dp.step(lr) with a schedule's rate for this step
        dp.zero_grad()
        mean = torch.tensor([total], dtype=torch.float64)
        dist.all_reduce(mean)
        if rank == 0:
            print(f"step {step}: loss {mean.item() / world:.4f}, grad norm {norm:.3f}")

    # Full weights, whatever the stage: gathered (ZeRO-3), cloned before the block ends.
    with dp.gathered_parameters():
        state = {k: v.clone() for k, v in dp.module.state_dict().items()}
    if rank == 0:
        torch.save(state, args.out)
    dp.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
