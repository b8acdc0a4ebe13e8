"""activation recomputation: partita's against torch.utils.checkpoint on the same blocks

One process, one thread, partita's Llama-style Transformer in float32. Each side trains
the same model (same weights, same batch) a step at a time, forward + loss + backward:

- full: partita's `recompute=full` (partita.memory.recompute) against
  `torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)` around each block;
- selective: partita's `recompute=selective` (the attention core reruns) against the
  same checkpoint with torch's selective-checkpoint contexts
  (`create_selective_checkpoint_contexts`), whose policy recomputes the attention
  kernel and saves every other op's output.

Step time: paired alternating rounds (partita.bench.paired), the median ratio with its
99% interval. Held bytes: the storages created during forward that are still alive when
the loss is formed (a dispatch-mode count, so both sides are measured the same way,
whatever saved-tensor hooks they use), next to the same model without recompute. The
gradients of both sides are compared once (they must agree to float32 rounding).

Last line: `recompute: worst partita/peer step-time ratio R` (target R <= 1.0).
"""

from __future__ import annotations

import argparse
import copy
import functools
import time
import weakref

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from partita.arg_types import count
from partita.bench.paired import estimate_times, paired_rounds, print_legend


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dim", type=count, default=256)
    parser.add_argument("--layers", type=count, default=4)
    parser.add_argument("--heads", type=count, default=8)
    parser.add_argument("--seq", type=count, default=256)
    parser.add_argument("--batch", type=count, default=4, help="sequences per step")
    parser.add_argument("--rounds", type=count, default=10, help="paired rounds at first")
    parser.add_argument("--max-rounds", type=count, default=40,
                        help="rounds at most (doubling while the verdict is unsure)")
    parser.add_argument("--threads", type=count, default=1)


class _HeldBytes(TorchDispatchMode):
    """Bytes of the storages created inside the mode that are still alive."""

    def __init__(self, exclude: set[int]) -> None:
        super().__init__()
        self.live, self.exclude, self.seen = 0, exclude, set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().nbytes():
                storage = t.untyped_storage()
                key, nbytes = storage.data_ptr(), storage.nbytes()
                if key not in self.seen and key not in self.exclude:
                    self.seen.add(key)
                    self.live += nbytes
                    weakref.finalize(storage, self._release, key, nbytes)
        return out

    def _release(self, key: int, nbytes: int) -> None:
        self.seen.discard(key)
        self.live -= nbytes


def _torch_checkpoint(model: nn.Module, mode: str) -> None:
    """Wrap each block's forward in torch's checkpoint (selective: SAC contexts)."""
    from torch.utils.checkpoint import (
        CheckpointPolicy,
        checkpoint,
        create_selective_checkpoint_contexts,
    )

    attention = {op for op in (getattr(torch.ops.aten, name, None) for name in (
        "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
        "_scaled_dot_product_attention_math")) if op is not None}
    attention = {getattr(op, "default", op) for op in attention}

    def policy(ctx, op, *args, **kwargs):
        return (CheckpointPolicy.PREFER_RECOMPUTE if op in attention
                else CheckpointPolicy.MUST_SAVE)

    for block in model.blocks.values():
        forward = block.forward
        if mode == "full":
            block.forward = functools.partial(checkpoint, forward, use_reentrant=False)
        else:
            # RMSNorm's CPU kernel adds eps in place to the saved mean; every op but
            # attention is saved (not rerun), so replaying the saved, updated tensor is
            # exact, and torch must be told the mutation is expected.
            context = functools.partial(create_selective_checkpoint_contexts, policy,
                                        allow_cache_entry_mutation=True)
            block.forward = functools.partial(checkpoint, forward, use_reentrant=False,
                                              context_fn=context)


def _models(args: argparse.Namespace, mode: str) -> tuple[nn.Module, nn.Module, nn.Module]:
    from partita.memory import RecomputePolicy, apply_recompute
    from partita.models.model_config import ModelConfig
    from partita.models.transformer import build_model

    cfg = ModelConfig(dim=args.dim, n_layers=args.layers, n_heads=args.heads,
                      n_kv_heads=args.heads, vocab_size=512, max_seq_len=args.seq)
    plain = build_model(cfg)
    ours, peer = copy.deepcopy(plain), copy.deepcopy(plain)
    apply_recompute(ours, ours.plan(), RecomputePolicy(mode))
    _torch_checkpoint(peer, mode)
    return plain, ours, peer


def _loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())


def _step(model: nn.Module, tokens: torch.Tensor) -> float:
    start = time.perf_counter()
    _loss(model, tokens).backward()
    took = time.perf_counter() - start
    model.zero_grad(set_to_none=True)
    return took


def _held(model: nn.Module, tokens: torch.Tensor) -> int:
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    with _HeldBytes(params) as mode:
        loss = _loss(model, tokens)
        held = mode.live
    loss.backward()
    model.zero_grad(set_to_none=True)
    return held


def _max_grad_diff(a: nn.Module, b: nn.Module, tokens: torch.Tensor) -> float:
    _loss(a, tokens).backward()
    _loss(b, tokens).backward()
    diff = max((pa.grad - pb.grad).abs().max().item() / (pb.grad.abs().max().item() or 1.0)
               for pa, pb in zip(a.parameters(), b.parameters()))
    a.zero_grad(set_to_none=True)
    b.zero_grad(set_to_none=True)
    return diff


def run(args: argparse.Namespace) -> int:
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(512, (args.batch, args.seq + 1), generator=gen)
    print(f"recompute: llama dim={args.dim} layers={args.layers} heads={args.heads} "
          f"seq={args.seq} batch={args.batch}, float32, {args.threads} thread(s); peer: "
          f"torch {torch.__version__} torch.utils.checkpoint (non-reentrant)")
    head = (f"{'mode':<10} {'held none':>10} {'partita':>10} {'torch':>10} "
            f"{'partita ms':>10} {'torch ms':>9} {'ratio':>6} {'interval':>13} "
            f"{'rounds':>6} {'grad diff':>9}")
    print(head)
    print("-" * len(head))
    worst = 0.0
    estimates = []
    for mode in ("full", "selective"):
        plain, ours, peer = _models(args, mode)
        diff = _max_grad_diff(ours, peer, tokens)
        held = [_held(m, tokens) for m in (plain, ours, peer)]
        for m in (ours, peer):  # warm-up
            _step(m, tokens)
        sides = (ours, peer)
        times = paired_rounds(lambda k, sides=sides: _step(sides[k], tokens), args.rounds,
                              args.max_rounds, threshold=1.0)
        est = estimate_times(times)
        estimates.append(est)
        worst = max(worst, est.median)
        ms = [sorted(t)[len(t) // 2] * 1e3 for t in times]
        print(f"{mode:<10} {held[0] / 2**20:>8.2f}Mi {held[1] / 2**20:>8.2f}Mi "
              f"{held[2] / 2**20:>8.2f}Mi {ms[0]:>10.1f} {ms[1]:>9.1f} {est.median:>6.3f} "
              f"{est.span:>13} {est.rounds:>6} {diff:>9.1e}")
    print("held: bytes created in forward still alive when the loss is formed "
          "(model without recompute, partita, torch); times: medians of paired rounds")
    print_legend(estimates)
    print(f"recompute: worst partita/peer step-time ratio {worst:.3f}")
    return 0
