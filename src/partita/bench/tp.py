"""Tensor-parallel training step time: partita vs PyTorch DTensor vs megatron-core.

One gloo world of `--tp` ranks builds the same model (partita's Llama-style transformer,
same initial weights) three times: with partita.tensor_parallel, with DTensor
`parallelize_module` (ColwiseParallel/RowwiseParallel, vocab-parallel embedding and
`loss_parallel`, the torchtitan recipe), and, when megatron-core is installed, with
megatron-core's ColumnParallelLinear/RowParallelLinear/VocabParallelEmbedding and
vocab_parallel_cross_entropy. All three start from the same loss (checked and printed).
After a warm-up, each peer is timed against partita in alternating rounds of a few
steps (forward, backward, AdamW), which of the two goes first alternating too; the
verdict is the median of the per-round ratios partita/peer with its 99% interval, and a
pair whose interval spans 1.0 doubles its rounds (`partita.bench.paired`).
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F

from partita.arg_types import count
from partita.bench import paired
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
    parser.add_argument("--layers", type=count, default=4)
    parser.add_argument("--vocab", type=count, default=1024)
    parser.add_argument("--batch", type=count, default=4)
    parser.add_argument("--seq", type=count, default=128)
    parser.add_argument("--rounds", type=count, default=8, help="timed rounds per pair, at least")
    parser.add_argument("--max-rounds", type=count, default=64,
                        help="rounds a pair whose 99%% interval spans 1.0 may double up to")
    parser.add_argument("--steps", type=count, default=3, help="steps per timed round")


def _partita(cfg: ModelConfig, rank: int, world: int):
    mesh = Mesh(Layout(tp=world), rank, world)
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
    pairs = {}
    for peer in (k for k in impls if k != "partita"):
        time_side = _timer([impls["partita"], impls[peer]], [opts["partita"], opts[peer]],
                           tokens, args["steps"])
        pairs[peer] = paired.paired_rounds(time_side, args["rounds"], args["max_rounds"],
                                           1.0)
    return {"first_loss": first, "pairs": pairs}


def _timer(sides: list, opts: list, tokens: torch.Tensor, steps: int):
    """time_side for `paired.paired_rounds`: `steps` steps of side k, the slowest rank's
    seconds per step (the same on every rank)."""
    def time_side(k: int) -> float:
        model, loss_fn, ctx = sides[k]
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(steps):
            _step(model, loss_fn, opts[k], tokens, ctx)
        return paired.slowest_rank(time.perf_counter() - t0) / steps
    return time_side


def run(args: argparse.Namespace) -> int:
    out = run_distributed(_bench, args.tp, args=(vars(args),), timeout=3600)[0]
    pairs, first = out["pairs"], out["first_loss"]
    print(f"model dim={args.dim} heads={args.heads} layers={args.layers} vocab={args.vocab}, "
          f"batch {args.batch} x seq {args.seq}, tp={args.tp}, gloo, 1 thread per rank, "
          f"fp32, AdamW; each peer against partita in alternating rounds of {args.steps} "
          f"steps ({args.rounds}, doubled up to {max(args.rounds, args.max_rounds)} while "
          "the ratio's 99% interval spans 1.0)")
    if "megatron-core" not in first:
        print("megatron-core not installed: its row is skipped "
              "(pip install 'megatron-core==0.16.*')")
    print("first loss (the same model from the same weights): "
          + ", ".join(f"{name} {loss:.6f}" for name, loss in first.items()))
    print(f"{'peer':<16}{'partita ms':>12}{'peer ms':>10}{'ratio':>8}{'interval':>15}"
          f"{'rounds':>8}")
    worst = 0.0
    estimates = []
    for name, times in pairs.items():
        est = paired.estimate_times(times)
        estimates.append(est)
        worst = max(worst, est.median)
        print(f"{name:<16}{statistics.median(times[0]) * 1e3:>12.1f}"
              f"{statistics.median(times[1]) * 1e3:>10.1f}{est.median:>8.3f}"
              f"{est.span:>15}{est.rounds:>8}")
    paired.print_legend(estimates)
    print(f"tp: worst partita/peer step-time ratio {worst:.3f}")
    return 0
