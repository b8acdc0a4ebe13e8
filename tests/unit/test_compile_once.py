"""Identical graphs compiled by two processes of one machine: the second reads the
first one's result from inductor's caches instead of compiling it again."""

from __future__ import annotations

import torch

from partita.compile_once import graph_key
from partita.testing import run_distributed


def _mlp(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.silu(x @ w).sum()


def _compile_and_step(rank: int, world: int, cache: str) -> dict:
    import os

    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache
    from torch._dynamo.utils import counters

    from partita.compile_once import once_per_machine

    torch.set_num_threads(1)
    w = torch.randn(16, 16, requires_grad=True)
    loss = torch.compile(_mlp, backend=once_per_machine)(torch.randn(8, 16), w)
    loss.backward()
    return {**counters["inductor"], **counters["aot_autograd"]}


def test_the_second_process_reads_the_first_ones_compile(tmp_path):
    ranks = run_distributed(_compile_and_step, 2, args=(str(tmp_path),), timeout=300)
    # One process compiled forward and backward (two FX graphs) and saved the pair; the
    # other, waiting on the graph's lock, found all of it in the caches.
    first, second = sorted(ranks, key=lambda c: c.get("fxgraph_cache_hit", 0))
    assert first.get("fxgraph_cache_miss") == 2 and first.get("autograd_cache_saved") == 1
    assert second.get("autograd_cache_hit") == 1 and not second.get("fxgraph_cache_miss")


def test_the_key_tells_graphs_apart_by_code_inputs_and_constants():
    def traced(fn, *inputs):
        gm = torch.fx.symbolic_trace(fn)
        return graph_key(gm, list(inputs))

    x = torch.randn(4, 8)
    assert traced(lambda a: a * 2, x) == traced(lambda a: a * 2, torch.randn(4, 8))
    assert traced(lambda a: a * 2, x) != traced(lambda a: a * 3, x)
    assert traced(lambda a: a * 2, x) != traced(lambda a: a * 2, torch.randn(4, 9))
    assert traced(lambda a: a * 2, x) != traced(lambda a: a * 2, x.double())

    class Shifted(torch.nn.Module):
        def __init__(self, table: torch.Tensor) -> None:
            super().__init__()
            self.register_buffer("table", table)

        def forward(self, a: torch.Tensor) -> torch.Tensor:
            return a + self.table

    def key(table: torch.Tensor) -> str:
        return graph_key(torch.fx.symbolic_trace(Shifted(table)), [x])

    assert key(torch.zeros(8)) == key(torch.zeros(8)) != key(torch.ones(8))
