"""metrics.jsonl across a resume: the records up to the checkpoint's step are kept, on
disk, before training continues."""

from __future__ import annotations

import json

from partita.metrics import MetricsLogger


def _records(path) -> list[int]:
    return [json.loads(line)["step"] for line in path.read_text().splitlines()]


def test_a_resume_keeps_the_history_on_disk_before_the_first_new_record(tmp_path):
    first = MetricsLogger(tmp_path, True, 10, progress=False, tensorboard=False)
    for step in range(1, 7):
        first.log(step, {"loss": 1.0 / step}, console=False)
    first._jsonl.write('{"step": 7, "lo')  # a record cut short by the crash
    first.close()
    # Resumed from the checkpoint of step 4: steps 5-7 are trained again.
    resumed = MetricsLogger(tmp_path, True, 10, progress=False, tensorboard=False,
                            resume_at=4)
    path = tmp_path / "metrics.jsonl"
    assert _records(path) == [1, 2, 3, 4]  # already on disk: a kill now loses nothing
    assert not list(tmp_path.glob("*.partial"))
    resumed.log(5, {"loss": 0.2}, console=False)
    resumed.close()
    assert _records(path) == [1, 2, 3, 4, 5]
    # A fresh run (no resume) starts the file over.
    fresh = MetricsLogger(tmp_path, True, 10, progress=False, tensorboard=False)
    fresh.close()
    assert path.read_text() == ""
