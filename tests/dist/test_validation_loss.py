"""The trainer's validation loss is one number at every layout: the mean cross-entropy
over every counted target of the same held-out windows, with dropout off.

The splits here are packed documents (every target after an end token is not counted, so
windows count different numbers of targets) and the global batch is 8. One split has 11
windows: a full batch and one of 3, which 2 replicas cannot split evenly; the other has
5, fewer than one batch. The model has dropout 0.3. `Trainer.evaluate` of the untrained
model, at one process and at dp=2, dp=2 with ZeRO-3, tp=2 with sequence parallelism,
pp=2 (1F1B and interleaved) and cp=2, must equal the loss computed here directly (the
summed cross-entropy of the one-process model in eval mode over all the split's windows,
divided by their counted targets), float64 within 1e-10.

Each defect this guards against moved the number: evaluation with dropout on (the
loss of random masks, different on every call), a remainder of fewer windows than the
batch left out, 2 replicas evaluating 4 of the small split's 5 windows where one
process evaluated all 5, the mean of per-batch means (the 3-window batch weighted
like the 8-window one), and an interleaved pipeline refusing a batch of rows its
microbatches do not divide.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from partita.data.dataset import TokenDataset
from partita.data.sampler import windows_to_batch
from partita.models.documents import document_ids
from partita.testing import FLOAT64_TOL, PARITY_MODEL, parity_config, relative_error

SEQ, BATCH, TRAIN_WINDOWS, END = 16, 8, 16, 5
SPLITS = (11, 5)  # validation windows
LAYOUTS = {
    "one process": {},
    "dp2": {},
    "dp2-zero3": dict(zero_stage=3, bucket_mb=0.001),
    "tp2-sp": dict(tp=2, sequence_parallel=True),
    "pp2": dict(pp=2),
    "pp2-interleaved": dict(pp=2, schedule="interleaved"),
    "cp2-ring": dict(cp=2, cp_kind="ring"),
}


def _dataset(val_windows: int) -> TokenDataset:
    """Random tokens with an end-of-document token at irregular places."""
    rng = np.random.default_rng(7)
    n_val, n_train = val_windows * SEQ + 1, TRAIN_WINDOWS * SEQ + 1
    tokens = rng.integers(0, PARITY_MODEL["vocab_size"], n_train + n_val).astype(np.uint32)
    tokens[rng.random(len(tokens)) < 0.15] = END
    return TokenDataset(Path("tokens"), tokens[:n_train], tokens[n_train:],
                        PARITY_MODEL["vocab_size"], SEQ, None, END)


def _config(out_dir: str, parallel: dict, dropout: float = 0.3):
    micro = 2 if parallel.get("pp", 1) > 1 else 1
    return parity_config(
        model=dict(dropout=dropout, n_layers=4), parallel=parallel,
        train=dict(global_batch=BATCH, microbatches=micro, eval_batches=4, out_dir=out_dir,
                   progress=False),
        metrics=dict(peak_tflops=1.0, tensorboard=False))


def _evaluate(rank: int, world: int, out_dir: str, layouts: dict[str, dict],
              direct: bool = False) -> dict:
    import partita.trainer as trainer_module

    out = {}
    for split, name in [(split, name) for split in SPLITS for name in layouts]:
        data = _dataset(split)
        trainer_module.open_dataset = lambda cfg, data=data: data  # not a corpus
        trainer = trainer_module.Trainer(_config(f"{out_dir}/{split}/{name}", layouts[name]))
        try:
            gens = [g.get_state() for g in _dropout_generators(trainer.pm.module)]
            first, second = trainer.evaluate(), trainer.evaluate()
            out[split, name] = dict(
                val=first, again=second,
                # Evaluation drew no dropout mask and left every module training.
                streams_kept=all(torch.equal(a, g.get_state()) for a, g in
                                 zip(gens, _dropout_generators(trainer.pm.module))),
                training=all(m.training for m in trainer.pm.module.modules()))
            if direct:
                out[split, "direct"] = _direct_loss(trainer.pm.module, data)
        finally:
            trainer.logger.close()
            trainer.progress.close()
    return out


def _dropout_generators(module: torch.nn.Module) -> list[torch.Generator]:
    return [g for m in module.modules() if hasattr(m, "checkpointed_generators")
            for g in m.checkpointed_generators(torch.device("cpu")).values()]


@torch.no_grad()
def _direct_loss(module: torch.nn.Module, data: TokenDataset) -> float:
    """Summed cross-entropy over every counted target of the split / their number."""
    windows = (len(data.val) - 1) // SEQ
    x, y = windows_to_batch(data.val, np.arange(windows), SEQ, END)
    module.eval()
    logits = module(x, segments=document_ids(x, END))
    module.train()
    total = F.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=-100,
                            reduction="sum")
    return float(total) / int((y != -100).sum())


def test_validation_loss_is_the_token_mean_of_the_same_windows_at_every_layout(tmp_path):
    from partita.testing import run_distributed

    one = run_distributed(_evaluate, 1, args=(str(tmp_path / "one"),
                                              {"one process": LAYOUTS["one process"]}, True),
                          timeout=120)[0]
    two = {k: v for k, v in LAYOUTS.items() if k != "one process"}
    ranks = run_distributed(_evaluate, 2, args=(str(tmp_path / "two"), two), timeout=240)
    failures = []
    for split, name in [(split, name) for split in SPLITS for name in LAYOUTS]:
        want = one[split, "direct"]
        for rank, got in enumerate([one] if name == "one process" else ranks):
            r, what = got[split, name], f"{split} windows, {name} rank {rank}"
            if not (r["streams_kept"] and r["training"]):
                failures.append(f"{what}: evaluation drew dropout masks or left modules in "
                                f"eval mode ({r})")
            for key in ("val", "again"):
                err = relative_error(r[key], want)
                if not err <= FLOAT64_TOL:
                    failures.append(f"{what}: {key} {r[key]!r} vs the token mean {want!r} "
                                    f"(relative {err:.1e})")
    assert not failures, "\n".join(failures)
