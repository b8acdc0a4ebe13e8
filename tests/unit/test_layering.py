"""The layer order of src/partita, enforced: every import (at module level, inside
functions, under TYPE_CHECKING) must point down the table below or stay in its layer.

Layers, lowest first (docs/architecture.md explains each):

    base         partita (the package), errors, device_specs, host_memory, local_world, lazy,
                 folder_lock, machine_cache, proc_stat
    models       models.*            single-device PyTorch models and their plans
    layout       layout              a pure description of a parallel layout
    config       config, config_ranges,  the typed run configuration, its valid ranges
                 config_values           and the typing of given values
    core         comm, gloo_collectives, mesh, sharding, loss, saved_tensors, agreement
    optim        optim.*             AdamW, LR schedule, clipping on flat tensors
    dimensions   zero.*, tensor_parallel.*, pipeline.*   (peers: none imports another)
    parallelize  parallelize
    services     checkpoint, data.*, weights, sampling, kv_cache, metrics, run_dir
    trainer      trainer, trainer_checkpoints, launch, worker_watch, faults, watchdog
    bench        bench.*
    commands     commands.*, cli
    testing      testing             the test harness: nothing in the library imports it

    planner.*    a side branch: imports only base, models, layout and config (never the
                 runtime), and only bench, commands and testing import it.

Also: no import cycle between modules (imports under TYPE_CHECKING excepted, since they
never run), and every module has a layer, so a new file has to be placed on purpose.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import partita

CHAIN: list[tuple[str, tuple[str, ...]]] = [
    ("base", ("partita", "partita.errors", "partita.device_specs", "partita.host_memory",
              "partita.local_world", "partita.eager_only", "partita.lazy",
              "partita.arg_types", "partita.folder_lock", "partita.machine_cache",
              "partita.proc_stat", "partita.shm_os")),
    ("models", ("partita.models",)),
    ("layout", ("partita.layout", "partita.layout_rules", "partita.compile_rules")),
    ("config", ("partita.config", "partita.config_ranges", "partita.config_values",
                "partita.config_sections")),
    ("core", ("partita.comm", "partita.gloo_collectives", "partita.shm_share", "partita.shm_channel",
              "partita.shm_collectives",
              "partita.mesh", "partita.sharding", "partita.loss",
              "partita.saved_tensors", "partita.agreement")),
    ("optim", ("partita.optim",)),
    ("memory", ("partita.memory",)),
    ("dimensions", ("partita.zero", "partita.tensor_parallel", "partita.pipeline",
                    "partita.context_parallel", "partita.experts")),
    ("parallelize", ("partita.parallelize", "partita.compile", "partita.compile_once")),
    ("services", ("partita.checkpoint", "partita.data", "partita.weights", "partita.sampling",
                  "partita.kv_cache",
                  "partita.metrics", "partita.run_dir", "partita.export")),
    ("trainer", ("partita.trainer", "partita.trainer_checkpoints", "partita.launch",
                 "partita.worker_watch", "partita.faults", "partita.trainer_failures",
                 "partita.watchdog", "partita.process_setup")),
    ("bench", ("partita.bench",)),
    ("commands", ("partita.commands", "partita.cli")),
    ("testing", ("partita.testing",)),
]
PLANNER = ("planner", ("partita.planner",))
PLANNER_IMPORTS_UP_TO = "config"  # the highest layer the planner may read
PLANNER_USERS_FROM = "bench"  # the lowest layer that may import the planner
PEERS = {"dimensions"}  # layers whose packages must not import one another
RANK = {name: i for i, (name, _) in enumerate(CHAIN)}


def layer_of(module: str) -> tuple[str, str] | None:
    """(layer, the table entry it matched): the longest matching prefix wins."""
    best = None
    for name, prefixes in [*CHAIN, PLANNER]:
        for prefix in prefixes:
            if module == prefix or (prefix != "partita" and module.startswith(prefix + ".")):
                if best is None or len(prefix) > len(best[1]):
                    best = (name, prefix)
    return best


def allowed(src: str, dst: str) -> bool:
    """May a module of layer `src` import one of layer `dst`?"""
    if src == PLANNER[0] or dst == PLANNER[0]:
        if src == dst:
            return True
        if src == PLANNER[0]:
            return RANK[dst] <= RANK[PLANNER_IMPORTS_UP_TO]
        return RANK[src] >= RANK[PLANNER_USERS_FROM]
    return RANK[dst] <= RANK[src]


def module_files(root: Path) -> dict[str, Path]:
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _type_checking_lines(tree: ast.Module) -> set[int]:
    lines = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for inner in node.body:
                lines.update(range(inner.lineno, (inner.end_lineno or inner.lineno) + 1))
    return lines


def imports_of(module: str, path: Path, known: set[str]) -> list[tuple[str, int, bool]]:
    """(imported partita module, line, under TYPE_CHECKING) for every import statement.

    `from package import name` counts as importing the submodule package.name when that
    is a module, else the package itself.
    """
    tree = ast.parse(path.read_text(), str(path))
    typing_only = _type_checking_lines(tree)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parts = parts[:len(parts) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base
                       for a in node.names]
        else:
            continue
        for target in targets:
            if target == "partita" or target.startswith("partita."):
                while target not in known and "." in target:  # `import partita.x.y.Name`
                    target = target.rpartition(".")[0]
                edge = (target, node.lineno, node.lineno in typing_only)
                if edge not in found:
                    found.append(edge)
    return found


def import_graph() -> dict[str, list[tuple[str, int, bool]]]:
    files = module_files(Path(partita.__file__).parent)
    return {m: imports_of(m, p, set(files)) for m, p in files.items()}


def layering_problems(graph: dict[str, list[tuple[str, int, bool]]]) -> list[str]:
    problems = []
    for module in sorted(graph):
        if layer_of(module) is None:
            problems.append(f"{module} has no layer: add it to CHAIN in "
                            "tests/unit/test_layering.py and to docs/architecture.md")
    for module, edges in sorted(graph.items()):
        src = layer_of(module)
        for target, line, _ in edges:
            dst = layer_of(target)
            if src is None or dst is None or target == module:
                continue
            if target == "partita.testing" and module != "partita.testing":
                problems.append(f"{module}:{line} imports the test harness partita.testing "
                                "(library code takes what it needs from partita.local_world)")
            elif not allowed(src[0], dst[0]):
                problems.append(f"{module}:{line} imports {target}: layer '{src[0]}' may not "
                                f"import layer '{dst[0]}'")
            elif src[0] == dst[0] in PEERS and src[1] != dst[1]:
                problems.append(f"{module}:{line} imports {target}: {src[1]} and {dst[1]} are "
                                "peer dimensions; parallelize composes them")
    return problems


def cycles(graph: dict[str, list[tuple[str, int, bool]]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm)."""
    edges = {m: sorted({t for t, _, typing_only in e if not typing_only and t != m})
             for m, e in graph.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


@pytest.fixture(scope="module")
def graph():
    return import_graph()


def test_every_import_follows_the_layer_order(graph):
    problems = layering_problems(graph)
    assert not problems, "imports against the layer order:\n  " + "\n  ".join(problems)


def test_no_import_cycles(graph):
    found = cycles(graph)
    assert not found, "import cycles among:\n  " + "\n  ".join(", ".join(c) for c in found)


def test_the_checker_sees_what_it_must():
    """The rules catch what they exist for, on a made-up graph (a test that can fail)."""
    fake = {
        "partita.metrics": [("partita.planner.hardware", 3, False)],
        "partita.planner.hardware": [("partita.planner.cpu_profile", 4, False)],
        "partita.planner.cpu_profile": [("partita.planner.hardware", 5, False),
                                        ("partita.trainer", 6, False)],
        "partita.launch": [("partita.testing", 7, False)],
        "partita.zero.engine": [("partita.pipeline.stage", 8, False)],
        "partita.trainer": [("partita.zero", 9, False)],
        "partita.zero": [],
        "partita.pipeline.stage": [],
        "partita.testing": [],
        "partita.newthing": [],
    }
    problems = "\n".join(layering_problems(fake))
    assert "partita.metrics:3 imports partita.planner.hardware" in problems
    assert "partita.planner.cpu_profile:6 imports partita.trainer" in problems
    assert "partita.launch:7 imports the test harness" in problems
    assert "peer dimensions" in problems
    assert "partita.newthing has no layer" in problems
    assert "partita.trainer:9" not in problems
    assert cycles(fake) == [["partita.planner.cpu_profile", "partita.planner.hardware"]]
    assert layer_of("partita.models.hf_llama") == ("models", "partita.models")
    assert layer_of("partita.optim.adamw")[0] == "optim"
    assert layer_of("partita.layout")[0] == "layout"


def test_relative_and_submodule_imports_resolve(tmp_path):
    pkg = tmp_path / "partita"
    (pkg / "models").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "models" / "__init__.py").write_text("from .plan import Plan\n")
    (pkg / "models" / "plan.py").write_text(
        "def f():\n    from partita.models import transformer\n"
        "    import partita.models.transformer as t\n")
    (pkg / "models" / "transformer.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..config import C\n")
    (pkg / "config.py").write_text("")
    files = module_files(pkg)
    known = set(files)
    assert imports_of("partita.models", files["partita.models"], known) == [
        ("partita.models.plan", 1, False)]
    assert imports_of("partita.models.plan", files["partita.models.plan"], known) == [
        ("partita.models.transformer", 2, False), ("partita.models.transformer", 3, False)]
    assert imports_of("partita.models.transformer", files["partita.models.transformer"],
                      known) == [("partita.config", 3, True)]
