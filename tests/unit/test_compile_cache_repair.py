"""A kernel library that a killed compile left cut off in inductor's cache is deleted and
the graph compiled again (`partita.compile_once`), once, and only inside the cache.

Inductor's C++ compiler writes each kernel library straight to its place in the cache;
a process killed during that write leaves a short file there, and every later compile
needing that kernel failed with "file too short" until the file was deleted by hand.
The compiler is stood in for here (a real cold compile costs ~40 s of the suite); the
whole path was checked by hand with inductor: compile, cut the kernel's library to 100
bytes, compile again in a new process (the note, a whole library again, equal results).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from partita.compile_once import _repairing

SYSTEM_LIBRARY = Path("/lib/x86_64-linux-gnu/libm.so.6")


class Compiler:
    """`compile_fx` that fails to load `library` the first `failures` times."""

    def __init__(self, library: Path, failures: int = 1) -> None:
        self.library, self.failures, self.calls = library, failures, 0

    def __call__(self, gm, example_inputs):
        self.calls += 1
        if self.calls <= self.failures:
            raise ImportError(f"{self.library}: file too short", path=str(self.library))
        return "compiled"


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    folder = tmp_path / "inductor"
    folder.mkdir()
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(folder))
    return folder


def _library(cache: Path, whole: bool) -> Path:
    library = cache / "ab" / "cabc123.main.so"
    library.parent.mkdir()
    if whole:
        shutil.copy(SYSTEM_LIBRARY, library)
    else:
        library.write_bytes(SYSTEM_LIBRARY.read_bytes()[:100])  # what a killed write leaves
    return library


@pytest.mark.skipif(not SYSTEM_LIBRARY.exists(), reason="needs a system shared library")
def test_a_cut_off_library_is_deleted_and_compiled_again_with_a_note(cache, capsys):
    library = _library(cache, whole=False)
    compiler = Compiler(library)
    assert _repairing(compiler, None, []) == "compiled"
    assert compiler.calls == 2 and not library.exists()
    assert "partita: note: removed a compiled kernel" in capsys.readouterr().err


@pytest.mark.skipif(not SYSTEM_LIBRARY.exists(), reason="needs a system shared library")
def test_a_library_that_loads_now_is_kept(cache, capsys):
    """Another rank rebuilt it meanwhile: nothing is deleted, the compile reads it."""
    library = _library(cache, whole=True)
    compiler = Compiler(library)
    assert _repairing(compiler, None, []) == "compiled"
    assert library.exists() and "partita: note" not in capsys.readouterr().err


def test_a_second_failure_and_a_library_outside_the_cache_are_raised(cache, tmp_path):
    library = _library(cache, whole=False)
    with pytest.raises(ImportError):
        _repairing(Compiler(library, failures=2), None, [])
    outside = tmp_path / "elsewhere.so"
    outside.write_bytes(b"")
    compiler = Compiler(outside)
    with pytest.raises(ImportError):
        _repairing(compiler, None, [])
    assert outside.exists() and compiler.calls == 1
