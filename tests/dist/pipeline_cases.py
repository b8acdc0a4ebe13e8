"""The configuration the pipeline tests train: the harness's parity model with 4 blocks
(room for 2 or 4 stages), 4 microbatches of a global batch of 8, and small gradient
buckets (several per stage). Settings keep their config names."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from partita.config import Config
from partita.testing import parity_config


def pipeline_config(pp: int = 2, schedule: str = "1f1b", microbatches: int = 4,
                    global_batch: int = 8, model: Mapping[str, Any] | None = None,
                    train: Mapping[str, Any] | None = None, **parallel: Any) -> Config:
    """`parallel.pp`, `parallel.schedule`, `train.microbatches`, `train.global_batch` and
    any other `parallel.*` setting by keyword; `model` and `train` update those sections."""
    return parity_config(
        model={"n_layers": 4, **(model or {})},
        parallel={"pp": pp, "schedule": schedule, "bucket_mb": 0.01, **parallel},
        train={"microbatches": microbatches, "global_batch": global_batch, **(train or {})},
    )
