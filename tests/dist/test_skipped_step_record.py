"""A step the fp16 loss scaler skipped is marked in metrics.jsonl, as strict JSON: its
record said only "grad_norm": Infinity (not JSON), with nothing saying the weights
were left unchanged."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from partita.data.dataset import TokenDataset
from partita.testing import PARITY_MODEL, parity_config, run_distributed

SEQ = 16


def _train_with_overflow(rank: int, world: int, out_dir: str) -> None:
    import partita.trainer as trainer_module

    rng = np.random.default_rng(0)
    tokens = rng.integers(0, PARITY_MODEL["vocab_size"], 24 * SEQ + 1).astype(np.uint32)
    data = TokenDataset(Path("tokens"), tokens[:16 * SEQ + 1], tokens[16 * SEQ + 1:],
                        PARITY_MODEL["vocab_size"], SEQ, None, None)
    trainer_module.open_dataset = lambda cfg: data  # the tokens above, not a corpus
    cfg = parity_config(precision=dict(param_dtype="float16"),
                        train=dict(steps=2, log_every=1, eval_every=100, out_dir=out_dir,
                                   progress=False, max_bad_steps=0),
                        metrics=dict(peak_tflops=1.0, tensorboard=False))
    trainer = trainer_module.Trainer(cfg)
    # A scale no float16 gradient survives: the first step overflows and is skipped
    # (and the scale halved), as a real overflow would be.
    trainer.pm.dp.scaler.scale = 2.0 ** 120
    trainer.run()
    trainer.progress.close()


def test_an_fp16_overflow_step_is_marked_skipped_in_strict_json(tmp_path):
    run_distributed(_train_with_overflow, 1, args=(str(tmp_path),), timeout=120)
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()

    def refuse(constant: str) -> float:
        raise ValueError(f"not JSON: {constant}")

    first, second = (json.loads(line, parse_constant=refuse) for line in lines[:2])
    assert first["step"] == 1 and first["skipped"] is True and first["grad_norm"] is None
    assert first["loss_scale"] == 2.0 ** 120
    assert second["step"] == 2 and second["loss_scale"] == 2.0 ** 119
    # Step 2 ran at the halved scale, still far too large: skipped as well.
    assert second["skipped"] is True
