"""Fixtures shared by every kind of test.

Tests are grouped by kind: `unit/` (pure logic, no processes), `dist/` (tests that start
processes: gloo worlds for parity and communication), `e2e/` (the real command line).
Each folder is a package, so files with the same name in two folders do not collide.
The parity harness itself is `partita.testing` (see docs/architecture.md).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from partita.models.model_config import ModelConfig
from partita.testing import PARITY_MODEL

# A `partita train` run that finishes in seconds on one core: the tiny parity-sized
# model on 300 kB of the built-in corpus, 6 steps, an evaluation every 3.
TINY_TRAIN = (
    "--model.dim=32", "--model.n_layers=2", "--model.n_heads=4", "--model.n_kv_heads=2",
    "--data.seq_len=32", "--data.max_bytes=300000", "--train.global_batch=8",
    "--train.steps=6", "--train.log_every=1", "--train.eval_every=3", "--train.eval_batches=1",
    "--train.warmup_steps=2", "--train.threads=1", "--metrics.tensorboard=false",
)


@pytest.fixture(scope="session", autouse=True)
def partita_cache(tmp_path_factory) -> str:
    """Profiles `partita plan --gpu-type cpu` keeps go to a folder of the test session,
    not the user's cache (command-line tests inherit it)."""
    folder = str(tmp_path_factory.mktemp("partita-cache"))
    os.environ["PARTITA_CACHE_DIR"] = folder
    return folder


@pytest.fixture
def tiny_model() -> ModelConfig:
    """The parity model's shape: 64 tokens, width 32, 2 blocks, 4 heads over 2 kv heads."""
    return ModelConfig(**PARITY_MODEL)


@pytest.fixture(scope="session")
def cache(tmp_path_factory) -> str:
    """One data cache for the whole session: the corpus is tokenised once."""
    return str(tmp_path_factory.mktemp("cache"))


@pytest.fixture
def run_dir(tmp_path) -> Path:
    """A fresh directory for one run's outputs."""
    return tmp_path / "run"


@dataclass(frozen=True)
class CLI:
    """The real command line, in a subprocess, as a user runs it."""

    cache: str
    tiny_train: tuple[str, ...] = TINY_TRAIN

    def __call__(self, *args: str, timeout: float = 240) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "partita.cli", *args],
                              capture_output=True, text=True, timeout=timeout,
                              env={**os.environ, "PYTHONUNBUFFERED": "1"})

    def train_args(self, out_dir: Path | str, *args: str) -> list[str]:
        """`train` with the tiny run's settings, the shared cache and `out_dir`."""
        return ["train", *self.tiny_train, f"--data.cache_dir={self.cache}",
                f"--train.out_dir={out_dir}", *args]

    def train(self, out_dir: Path | str, *args: str,
              timeout: float = 240) -> subprocess.CompletedProcess:
        return self(*self.train_args(out_dir, *args), timeout=timeout)

    @staticmethod
    def losses(out_dir: Path | str) -> list[float]:
        """The training loss of every logged step of a finished run."""
        lines = (Path(out_dir) / "metrics.jsonl").read_text().splitlines()
        return [json.loads(line)["loss"] for line in lines]


@pytest.fixture
def cli(cache) -> CLI:
    return CLI(cache)


# The fault-injection and bad-input suite: its files carry `pytestmark =
# pytest.mark.fault_suite("CLASS")` (registered in pyproject.toml), and the run ends
# with its count by class. Each case's report carries its class (`user_properties`), so
# the count also adds up when pytest-xdist runs the tests in worker processes.
SUITE_PROPERTY = "fault_suite"


# The longest files (measured with --durations=0, summed per file), started first: the two
# xdist workers take whole files in this order (`--no-loadscope-reorder` in pyproject.toml),
# so a long file left for the end would run alone.
LONGEST_FIRST = (
    "tests/dist/test_compile_parity.py",  # 4.5 min with a cold inductor cache, as in CI
    "tests/e2e/test_process_faults.py", "tests/e2e/test_checkpoint_cli.py",
    "tests/e2e/test_launch_faults.py", "tests/e2e/test_cli.py",
    "tests/e2e/test_torchrun_faults.py",
    "tests/dist/test_expert_parallel.py", "tests/dist/test_bench_harness.py",
    "tests/dist/test_planner_accuracy.py", "tests/dist/test_pipeline_parity.py",
    "tests/e2e/test_bench_cli.py", "tests/dist/test_pipeline_steps.py",
    "tests/dist/test_planner_compiled_memory.py", "tests/e2e/test_planned_layouts_train.py",
    "tests/e2e/test_moe_cli.py", "tests/e2e/test_cp_cli.py",
)


def _start_order(item) -> int:
    path = item.nodeid.split("::")[0]
    return LONGEST_FIRST.index(path) if path in LONGEST_FIRST else len(LONGEST_FIRST)


def pytest_collection_modifyitems(items) -> None:
    items.sort(key=_start_order)  # stable: the rest keep their order
    for item in items:
        marker = item.get_closest_marker("fault_suite")
        if marker is not None:
            item.user_properties.append((SUITE_PROPERTY, marker.args[0]))


def pytest_terminal_summary(terminalreporter) -> None:
    kinds: dict[str, str] = {}  # test node id -> class
    outcome: dict[str, str] = {}
    for status in ("passed", "failed", "skipped", "error"):
        for report in terminalreporter.stats.get(status, []):
            kind = dict(getattr(report, "user_properties", ())).get(SUITE_PROPERTY)
            if kind is None:
                continue
            kinds[report.nodeid] = kind
            if report.when == "call" or status != "passed":
                outcome[report.nodeid] = status
    if not kinds:
        return
    count: dict[str, int] = {}
    for kind in kinds.values():
        count[kind] = count.get(kind, 0) + 1
    done = sum(1 for s in outcome.values() if s == "passed")
    by_kind = ", ".join(f"{k} {n}" for k, n in sorted(count.items()))
    terminalreporter.write_line(
        f"fault-injection and bad-input suite: {len(kinds)} cases ({by_kind}); "
        f"{done} passed")
