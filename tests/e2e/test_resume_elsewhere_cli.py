"""Resuming another run's checkpoint: a branch into a new folder works (and names
changed optimizer settings); into a folder holding an earlier run's checkpoints or
results it is refused unless train.overwrite, which clears them first, so resume=auto
never returns to the earlier run's newer checkpoints. A run continued from its own
checkpoints (train.checkpoint_dir) into another run's results is refused the same way,
by their run ids."""

import json
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ONE = ["--nproc", "1"]


def _steps(out: Path) -> list[int]:
    return [json.loads(line)["step"]
            for line in (out / "metrics.jsonl").read_text().splitlines()]


def _checkpoints(out: Path) -> list[str]:
    return sorted(p.name for p in (out / "checkpoints").iterdir() if p.name != "latest")


@pytest.fixture(scope="module")
def runs(tmp_path_factory, cache) -> dict:
    """`source` stops at step 3 with a checkpoint; `earlier` finishes 6 steps with
    checkpoints 4-6 and its results. Then, from source's step 3: into a copy of earlier
    (refused), into a copy of its results alone (refused), into a new folder with other
    AdamW settings, and into a copy of earlier with train.overwrite (stopped at step 4),
    continued there with resume=auto."""
    from tests.conftest import CLI

    cli, root = CLI(cache), tmp_path_factory.mktemp("elsewhere")
    with ThreadPoolExecutor(2) as pool:
        first = {"source": pool.submit(cli.train, root / "source", *ONE,
                                       "--train.stop_after=3"),
                 "earlier": pool.submit(cli.train, root / "earlier", *ONE,
                                        "--train.checkpoint_every=1")}
        done = {name: future.result() for name, future in first.items()}
    assert done["source"].returncode == 75, done["source"].stderr[-2000:]
    assert done["earlier"].returncode == 0, done["earlier"].stderr[-2000:]
    for name in ("mixed", "overwrite"):
        shutil.copytree(root / "earlier", root / name)
    for name in ("results", "moved", "moved_over"):
        shutil.copytree(root / "earlier", root / name,
                        ignore=shutil.ignore_patterns("checkpoints"))
    shutil.copytree(root / "source", root / "source_copy")
    start = f"--train.resume={root / 'source' / 'checkpoints' / 'step-00000003'}"

    def overwrite_then_auto() -> tuple:
        branch = cli.train(root / "overwrite", *ONE, start, "--train.overwrite=true",
                           "--train.checkpoint_every=1", "--train.stop_after=4")
        saved, metrics = _checkpoints(root / "overwrite"), _steps(root / "overwrite")
        auto = cli.train(root / "overwrite", *ONE, "--train.resume=auto",
                         "--train.checkpoint_every=1")
        return branch, saved, metrics, auto

    with ThreadPoolExecutor(3) as pool:
        jobs = {"mixed": pool.submit(cli.train, root / "mixed", *ONE, start,
                                     "--train.checkpoint_every=1", "--train.stop_after=4"),
                "results": pool.submit(cli.train, root / "results", *ONE, start),
                "branch": pool.submit(cli.train, root / "branch", *ONE, start,
                                      "--train.beta2=0.99", "--train.weight_decay=0.05"),
                "overwrite": pool.submit(overwrite_then_auto),
                # source's own checkpoints, continued into earlier's results.
                "moved": pool.submit(cli.train, root / "moved", *ONE, "--train.resume=auto",
                                     f"--train.checkpoint_dir={root / 'source' / 'checkpoints'}"),
                "moved_over": pool.submit(
                    cli.train, root / "moved_over", *ONE, "--train.resume=auto",
                    f"--train.checkpoint_dir={root / 'source_copy' / 'checkpoints'}",
                    "--train.overwrite=true")}
        out = {name: future.result() for name, future in jobs.items()}
    out["info"] = cli("checkpoint", "info", str(root / "source"))
    return {"root": root, **out}


def test_branch_into_a_folder_of_earlier_checkpoints_is_refused(runs):
    result, root = runs["mixed"], runs["root"]
    assert result.returncode == 2, result.stderr[-2000:]
    assert "holds checkpoints of an earlier run (newest: step-00000006)" in result.stderr
    assert "--train.overwrite=true" in result.stderr
    # Nothing of the earlier run was replaced.
    assert _checkpoints(root / "mixed") == _checkpoints(root / "earlier")
    for step in _checkpoints(root / "mixed"):
        manifest = Path(step, "manifest.json")
        assert (root / "mixed" / "checkpoints" / manifest).read_bytes() == \
            (root / "earlier" / "checkpoints" / manifest).read_bytes()
    assert _steps(root / "mixed") == [1, 2, 3, 4, 5, 6]


def test_branch_into_another_runs_results_is_refused(runs):
    result, root = runs["results"], runs["root"]
    assert result.returncode == 2, result.stderr[-2000:]
    assert "already holds another run's results" in result.stderr
    assert "--train.overwrite=true" in result.stderr
    assert (root / "results" / "metrics.jsonl").read_bytes() == \
        (root / "earlier" / "metrics.jsonl").read_bytes()
    assert (root / "results" / "model.safetensors").read_bytes() == \
        (root / "earlier" / "model.safetensors").read_bytes()


def test_branch_into_a_new_folder_names_changed_optimizer_settings(runs):
    result, root = runs["branch"], runs["root"]
    assert result.returncode == 0, result.stderr[-2000:]
    assert _steps(root / "branch") == [4, 5, 6]
    notes = [line for line in result.stderr.splitlines() if "optimizer settings" in line]
    assert len(notes) == 1, result.stderr[-2000:]
    assert "train.beta2 0.95 -> 0.99" in notes[0]
    assert "train.weight_decay 0.1 -> 0.05" in notes[0]
    assert "beta1" not in notes[0] and "eps" not in notes[0]


def test_overwrite_clears_the_earlier_run_so_auto_continues_the_branch(runs):
    branch, saved, metrics, auto = runs["overwrite"]
    root = runs["root"]
    assert branch.returncode == 75, branch.stderr[-2000:]
    assert saved == ["step-00000004"]  # the earlier run's 5 and 6 are gone
    assert metrics == [4]
    assert auto.returncode == 0, auto.stderr[-2000:]
    assert "step-00000004" in auto.stderr or "step-00000004" in auto.stdout
    assert _steps(root / "overwrite") == [4, 5, 6]
    assert _checkpoints(root / "overwrite") == ["step-00000004", "step-00000005",
                                                "step-00000006"]


def test_checkpoint_info_shows_the_optimizer_settings(runs):
    result = runs["info"]
    assert result.returncode == 0, result.stderr
    assert "optimizer: adamw, betas 0.9, 0.95, eps 1e-08, weight_decay 0.1" in result.stdout
    assert f"  run {_run_id(runs['root'] / 'source')}\n" in result.stdout


def _run_id(out: Path) -> str:
    return (out / "run-id").read_text().strip()


def _saved_run_id(checkpoint: Path) -> str:
    return json.loads((checkpoint / "manifest.json").read_text())["training"]["run_id"]


def test_each_run_has_its_own_id_and_its_checkpoints_carry_it(runs):
    root = runs["root"]
    source = _run_id(root / "source")
    assert len(source) == 12 and int(source, 16) >= 0
    assert _saved_run_id(root / "source" / "checkpoints" / "step-00000003") == source
    assert _saved_run_id(root / "earlier" / "checkpoints" / "step-00000006") == \
        _run_id(root / "earlier") != source
    # A branch is a new run: its id is its own, not the checkpoint's it started from.
    assert _run_id(root / "branch") not in (source, _run_id(root / "earlier"))


def test_continuing_into_another_runs_results_is_refused(runs):
    result, root = runs["moved"], runs["root"]
    assert result.returncode == 2, result.stderr[-2000:]
    assert f"holds the results of run {_run_id(root / 'earlier')}" in result.stderr
    assert f"checkpoint of run {_run_id(root / 'source')}" in result.stderr
    assert "--train.overwrite=true" in result.stderr
    for name in ("metrics.jsonl", "model.safetensors", "run-id"):
        assert (root / "moved" / name).read_bytes() == (root / "earlier" / name).read_bytes()


def test_overwrite_replaces_the_other_runs_results_and_the_run_goes_on(runs):
    result, root = runs["moved_over"], runs["root"]
    assert result.returncode == 0, result.stderr[-2000:]
    assert _steps(root / "moved_over") == [4, 5, 6]  # none of earlier's records left
    assert _run_id(root / "moved_over") == _run_id(root / "source")
