"""Tensor-parallel training step time: partita vs PyTorch DTensor vs megatron-core.

One gloo world of `--tp` ranks builds the same model (partita's Llama-style transformer,
same initial weights) three times: with partita.tensor_parallel, with DTensor
`parallelize_module` (ColwiseParallel/RowwiseParallel, vocab-parallel embedding and
`loss_parallel`, the torchtitan recipe), and, when megatron-core is installed, with
megatron-core's ColumnParallelLinear/RowParallelLinear/VocabParallelEmbedding and
vocab_parallel_cross_entropy. All three start from the same loss (checked and printed).
Steps (forward, backward, AdamW) are timed interleaved A B C A B C ... after a warm-up;
the verdict is the median over rounds of the per-round ratio partita/peer.
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F

from partita.mesh import Mesh, ParallelDims
from partita.models.config import ModelConfig
from partita.models.transformer import build_model
from partita.tensor_parallel import apply_tensor_parallel
from partita.testing import run_distributed


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=3, help="steps per timed round")


def _partita(cfg: ModelConfig, rank: int, world: int):
    mesh = Mesh(ParallelDims(tp=world), rank, world)
    model = build_model(cfg)
    report = apply_tensor_parallel(model, model.plan(), mesh.comm("tensor"))
    return model, report.loss_fn


def _dtensor(cfg: ModelConfig, rank: int, world: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        loss_parallel,
        parallelize_module,
    )

    mesh = init_device_mesh("cpu", (world,))
    model = build_model(cfg)
    # torchtitan's recipe: the attention/MLP input becomes a replicated DTensor once, so
    # the partial input-gradients of wq/wk/wv (w_gate/w_up) are summed before a single
    # all-reduce, as partita's region entry does.
    region = PrepareModuleInput(input_layouts=(Replicate(),),
                                desired_input_layouts=(Replicate(),), use_local_output=False)
    plan = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate()),
        "output": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False),
        "blocks.*.attn": region,
        "blocks.*.mlp": region,
        "blocks.*.attn.wo": RowwiseParallel(),
        "blocks.*.mlp.w_down": RowwiseParallel(),
    }
    plan.update({f"blocks.*.attn.{n}": ColwiseParallel() for n in ("wq", "wk", "wv")})
    plan.update({f"blocks.*.mlp.{n}": ColwiseParallel() for n in ("w_gate", "w_up")})
    parallelize_module(model, mesh, plan)

    def loss_fn(logits, targets):  # runs inside loss_parallel() (see _step); not nested:
        # leaving an inner loss_parallel would switch it off for the backward.
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())

    return model, loss_fn, loss_parallel


def _megatron(cfg: ModelConfig, rank: int, world: int):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core import parallel_state, tensor_parallel
        from megatron.core.model_parallel_config import ModelParallelConfig
        from megatron.core.tensor_parallel import mappings

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
    mcfg = ModelParallelConfig(tensor_model_parallel_size=world, use_cpu_initialization=True,
                               perform_initialization=False, gradient_accumulation_fusion=False)
    model = build_model(cfg)
    keep = torch.nn.init.zeros_  # values are copied from the single-device model below

    class Out(torch.nn.Module):  # megatron layers return (output, bias)
        def __init__(self, layer):
            super().__init__()
            self.layer = layer

        def forward(self, x):
            return self.layer(x)[0]

    def copy_rows(dst, src, dim):
        n = dst.shape[dim]
        with torch.no_grad():
            dst.copy_(src.narrow(dim, rank * n, n))

    for block in model.blocks.values():
        for parent, cols, row in ((block.attn, ("wq", "wk", "wv"), "wo"),
                                  (block.mlp, ("w_gate", "w_up"), "w_down")):
            for col in cols:
                old = getattr(parent, col)
                # Megatron fuses QKV (and gate/up) into one layer with one grad all-reduce;
                # here the layers stay separate, so megatron's own f is applied once on the
                # shared input and the per-layer reduction is disabled.
                new = tensor_parallel.ColumnParallelLinear(
                    old.in_features, old.out_features, config=mcfg, init_method=keep,
                    bias=False, gather_output=False, disable_grad_reduce=True)
                copy_rows(new.weight, old.weight, 0)
                setattr(parent, col, Out(new))
            old = getattr(parent, row)
            new = tensor_parallel.RowParallelLinear(
                old.in_features, old.out_features, config=mcfg, init_method=keep, bias=False,
                input_is_parallel=True, skip_bias_add=False)
            copy_rows(new.weight, old.weight, 1)
            setattr(parent, row, Out(new))
            parent.register_forward_pre_hook(
                lambda m, args: (mappings.copy_to_tensor_model_parallel_region(args[0]),
                                 *args[1:]))
    emb = tensor_parallel.VocabParallelEmbedding(cfg.vocab_size, cfg.dim, init_method=keep,
                                                 config=mcfg)
    copy_rows(emb.weight, model.tok_embeddings.weight, 0)
    head = tensor_parallel.ColumnParallelLinear(cfg.dim, cfg.vocab_size, config=mcfg,
                                                init_method=keep, bias=False,
                                                gather_output=False)
    copy_rows(head.weight, model.output.weight, 0)
    model.tok_embeddings, model.output = emb, Out(head)

    def loss_fn(logits, targets):
        return tensor_parallel.vocab_parallel_cross_entropy(logits, targets).mean()

    return model, loss_fn


def _step(model, loss_fn, opt, tokens, ctx=None) -> float:
    opt.zero_grad(set_to_none=True)
    if ctx is not None:
        with ctx():
            loss = loss_fn(model(tokens[:, :-1]), tokens[:, 1:])
            loss.backward()
    else:
        loss = loss_fn(model(tokens[:, :-1]), tokens[:, 1:])
        loss.backward()
    opt.step()
    loss = loss.detach()
    return (loss.full_tensor() if hasattr(loss, "full_tensor") else loss).item()


def _bench(rank: int, world: int, args: dict) -> dict:
    cfg = ModelConfig(vocab_size=args["vocab"], dim=args["dim"], n_layers=args["layers"],
                      n_heads=args["heads"], max_seq_len=args["seq"])
    impls = {"partita": (*_partita(cfg, rank, world), None)}
    impls["dtensor"] = _dtensor(cfg, rank, world)
    try:
        impls["megatron-core"] = (*_megatron(cfg, rank, world), None)
    except ImportError:
        pass
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(cfg.vocab_size, (args["batch"], args["seq"] + 1), generator=gen)
    opts = {k: torch.optim.AdamW(m.parameters(), lr=1e-4) for k, (m, _, _) in impls.items()}
    first = {k: _step(m, f, opts[k], tokens, c) for k, (m, f, c) in impls.items()}
    for k, (m, f, c) in impls.items():  # warm-up
        _step(m, f, opts[k], tokens, c)
    times: dict[str, list[float]] = {k: [] for k in impls}
    for _ in range(args["rounds"]):
        for k, (m, f, c) in impls.items():
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(args["steps"]):
                _step(m, f, opts[k], tokens, c)
            dist.barrier()
            times[k].append((time.perf_counter() - t0) / args["steps"])
    return {"first_loss": first, "times": times}


def run(args: argparse.Namespace) -> int:
    out = run_distributed(_bench, args.tp, args=(vars(args),), timeout=1800)[0]
    times, first = out["times"], out["first_loss"]
    print(f"model dim={args.dim} heads={args.heads} layers={args.layers} vocab={args.vocab}, "
          f"batch {args.batch} x seq {args.seq}, tp={args.tp}, gloo, 1 thread per rank, "
          f"fp32, AdamW; {args.rounds} interleaved rounds of {args.steps} steps")
    if "megatron-core" not in times:
        print("megatron-core not installed: its column is skipped "
              "(pip install 'megatron-core==0.16.*')")
    print(f"{'implementation':<16}{'first loss':>12}{'median step ms':>16}"
          f"{'partita/peer':>14}")
    worst = 0.0
    for name, ts in times.items():
        ratio = ""
        if name != "partita":
            r = statistics.median(a / b for a, b in zip(times["partita"], ts))
            worst = max(worst, r)
            ratio = f"{r:.3f}"
        print(f"{name:<16}{first[name]:>12.6f}{statistics.median(ts) * 1e3:>16.1f}{ratio:>14}")
    print(f"tp: worst partita/peer step-time ratio {worst:.3f}")
    return 0
