"""`partita train` with a pipeline, end to end: the loss curve of pp=2 with the
zero-bubble schedule equals one process's; bad pipeline settings fail with a message that
says what to change. (The 8-process dp x tp x pp run through the command line is in
test_planned_layouts_train.py; the 3D interleaved schedules' parity in
dist/test_pipeline_parity.py.)"""

from __future__ import annotations

import pytest

FLOAT64 = ["--train.dtype=float64", "--train.microbatches=2"]
LAYOUTS = {
    "single": ["--nproc", "1"],
    "pp2-zb": ["--nproc", "2", "--parallel.pp=2", "--parallel.schedule=zb-h1"],
}


def test_pipeline_layouts_match_one_process(tmp_path, cli):
    curves = {}
    for name, extra in LAYOUTS.items():
        out = tmp_path / name
        result = cli.train(out, *FLOAT64, "--model.n_layers=4", *extra, timeout=400)
        assert result.returncode == 0, result.stderr[-3000:]
        curves[name] = cli.losses(out)
    for name, curve in curves.items():
        assert curve == pytest.approx(curves["single"], rel=1e-10), name
    assert curves["single"][-1] < curves["single"][0]


def test_a_bad_pipeline_setting_fails_with_the_reason(run_dir, cli):
    # The other bad settings are covered without processes in dist/test_pipeline.py.
    result = cli.train(run_dir, "--nproc", "2", "--parallel.pp=2",
                       "--parallel.schedule=1f1bb", timeout=120)
    assert result.returncode != 0
    assert "partita: error: unknown pipeline schedule '1f1bb'. Did you mean '1f1b'?" \
        in result.stderr
