"""What metrics.jsonl says about the steps: tokens/s and MFU of the training steps
alone (not of an evaluation or a save between them), and a record for the step a run
stops at."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from partita.data import TokenDataset
from partita.testing import PARITY_MODEL, parity_config, run_distributed

SEQ = 16


def _trainer(out_dir: str, **train):
    import partita.trainer as trainer_module

    tokens = np.random.default_rng(0).integers(
        0, PARITY_MODEL["vocab_size"], 24 * SEQ + 1).astype(np.uint32)
    data = TokenDataset(Path("tokens"), tokens[:16 * SEQ + 1], tokens[16 * SEQ + 1:],
                        PARITY_MODEL["vocab_size"], SEQ, None, None)
    trainer_module.open_dataset = lambda cfg: data  # the tokens above, not a corpus
    cfg = parity_config(train=dict(out_dir=out_dir, progress=False, async_checkpoint=False,
                                   **train),
                        metrics=dict(peak_tflops=1.0, tensorboard=False))
    return trainer_module, trainer_module.Trainer(cfg)


def _slow_evaluation(rank: int, world: int, out_dir: str) -> None:
    """A clock that moves 1 ms per reading, and an evaluation that takes 100 s of it."""
    import types

    module, trainer = _trainer(out_dir, steps=4, log_every=1, eval_every=2)
    now = [0.0]

    def perf_counter() -> float:
        now[0] += 1e-3
        return now[0]

    module.time = types.SimpleNamespace(perf_counter=perf_counter, time=module.time.time,
                                        monotonic=module.time.monotonic,
                                        sleep=module.time.sleep)
    evaluate = trainer.evaluate

    def slow() -> float:
        now[0] += 100.0
        return evaluate()

    trainer.evaluate = slow
    trainer.run()
    trainer.progress.close()


def _records(out_dir: Path) -> dict[int, dict]:
    return {r["step"]: r for r in map(json.loads, (out_dir / "metrics.jsonl").open())}


def test_tokens_per_second_leave_evaluations_out(tmp_path):
    run_distributed(_slow_evaluation, 1, args=(str(tmp_path),), timeout=120)
    records = _records(tmp_path)
    assert records[2]["val_loss"] is not None and records[1]["val_loss"] is None
    # Each step read a few ms of the clock whether or not 100 s of evaluation followed.
    rates = [records[s]["tokens_per_s"] for s in (1, 2, 3, 4)]
    assert min(rates) > 0.2 * max(rates), rates
    assert records[2]["mfu"] > 0.2 * records[1]["mfu"]


def _stop_after(rank: int, world: int, out_dir: str) -> None:
    _, trainer = _trainer(out_dir, steps=6, log_every=5, checkpoint_every=3, stop_after=3,
                          eval_every=100)
    trainer.run()
    trainer.progress.close()


def test_the_step_a_run_stops_at_is_recorded(tmp_path):
    run_distributed(_stop_after, 1, args=(str(tmp_path),), timeout=120)
    assert sorted(_records(tmp_path)) == [1, 3]  # 1: the first step; 3: the stop
