"""A compiled kernel that a killed compile left cut off in inductor's cache is rebuilt.

Inductor's C++ compiler writes each kernel library straight to its place in the cache;
a process killed during that write leaves a short file there, and before
`partita.compile_once` repaired it every later compile needing that kernel failed with
"file too short" until the file was deleted by hand.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

SCRIPT = """
import torch
from partita.compile_once import once_per_machine

def f(x):
    return torch.sin(x) * 3 + x.cos()

x = torch.arange(16, dtype=torch.float64)
got = torch.compile(f, dynamic=False, backend=once_per_machine)(x)
assert torch.allclose(got, f(x)), (got, f(x))
print("matches eager")
"""


def _compile(cache: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                          timeout=300, env=env)


def test_a_cut_off_kernel_library_is_rebuilt_with_a_note(tmp_path):
    cache = tmp_path / "inductor"
    first = _compile(cache)
    assert first.returncode == 0, first.stderr[-3000:]
    kernels = sorted(cache.rglob("*.main.so"))
    assert kernels, sorted(p.name for p in cache.rglob("*"))
    for library in kernels:
        head = library.read_bytes()[:100]
        library.unlink()
        library.write_bytes(head)  # what a compiler killed mid-write leaves

    again = _compile(cache)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "matches eager" in again.stdout
    assert "partita: note: removed a compiled kernel" in again.stderr, again.stderr[-3000:]
    assert all(library.stat().st_size > 100 for library in kernels)  # rebuilt whole
    third = _compile(cache)  # the repaired cache is used as it is, without a note
    assert third.returncode == 0 and "partita: note" not in third.stderr, third.stderr[-3000:]
