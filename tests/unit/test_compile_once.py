"""The lock key of `partita.compile_once`: the same for graphs that compile alike, not for
graphs that differ. That two ranks compile a graph once between them is checked where
they compile anyway, in tests/dist/test_compile_parity.py."""

from __future__ import annotations

import torch

from partita.compile_once import graph_key


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


def test_a_lock_held_elsewhere_is_waited_for_a_bounded_time(tmp_path):
    """A rank stopped while it compiles keeps its lock; the others go on after the
    bound (compiling for themselves) instead of waiting outside any timeout."""
    import fcntl
    import os
    import time

    from partita.compile_once import _exclusive

    path = tmp_path / "graph.lock"
    path.touch()
    held = os.open(path, os.O_RDWR)
    fcntl.flock(held, fcntl.LOCK_EX)  # another open file: as another process's lock
    try:
        start = time.monotonic()
        with _exclusive(path, wait_s=0.3):
            waited = time.monotonic() - start
        assert 0.3 <= waited < 10
    finally:
        os.close(held)
    with _exclusive(path, wait_s=0.3):  # free now: taken at once
        pass
