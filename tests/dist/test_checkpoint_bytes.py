"""Two runs of one configuration write the same checkpoint files, byte for byte.

Every random stream a checkpoint saves (torch's, Python's, numpy's, the model's own)
starts from the run's seed, so nothing in the files depends on the process that wrote
them; a difference between two runs' checkpoints then means their training differed.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from partita.data import TokenDataset
from partita.testing import PARITY_MODEL, parity_config, run_distributed

SEQ = 16


def _train(rank: int, world: int, out_dir: str) -> None:
    import partita.trainer as trainer_module

    tokens = np.random.default_rng(0).integers(
        0, PARITY_MODEL["vocab_size"], 24 * SEQ + 1).astype(np.uint32)
    data = TokenDataset(Path("tokens"), tokens[:16 * SEQ + 1], tokens[16 * SEQ + 1:],
                        PARITY_MODEL["vocab_size"], SEQ, None, None)
    trainer_module.open_dataset = lambda cfg: data  # the tokens above, not a corpus
    cfg = parity_config(train=dict(steps=2, log_every=1, eval_every=100, out_dir=out_dir,
                                   progress=False, checkpoint_every=2,
                                   async_checkpoint=False),
                        metrics=dict(peak_tflops=1.0, tensorboard=False))
    trainer = trainer_module.Trainer(cfg)
    trainer.run()
    trainer.progress.close()


def test_two_runs_write_identical_checkpoint_files(tmp_path):
    files = []
    for name in ("first", "second"):
        run_distributed(_train, 1, args=(str(tmp_path / name),), timeout=120)
        folder = tmp_path / name / "checkpoints" / "step-00000002"
        files.append({p.name: p.read_bytes() for p in sorted(folder.glob("*.safetensors"))})
    assert files[0], "no checkpoint file written"
    assert files[0].keys() == files[1].keys()
    differ = [name for name in files[0] if files[0][name] != files[1][name]]
    assert not differ, f"checkpoint files differ between identical runs: {differ}"
