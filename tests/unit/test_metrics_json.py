"""metrics.jsonl is strict JSON even when a step's values are not finite, and a step
whose update was skipped says so."""

from __future__ import annotations

import json
import math

from partita.metrics import MetricsLogger, format_line


def strict_json(text: str) -> dict:
    """json.loads that refuses the Infinity / NaN constants only Python writes."""
    def refuse(constant: str) -> float:
        raise ValueError(f"not JSON: {constant}")
    return json.loads(text, parse_constant=refuse)


def test_metrics_jsonl_is_strict_json_with_skipped_steps_marked(tmp_path):
    """Non-finite values were written as bare Infinity / NaN, which only Python's json
    accepts; an fp16 overflow step showed nothing but "grad_norm": Infinity."""
    logger = MetricsLogger(tmp_path, True, 10, progress=False, tensorboard=False)
    logger.log(1, {"loss": 2.5, "grad_norm": math.inf, "skipped": True,
                   "loss_scale": 65536.0, "moe": {"imbalance": math.nan}}, console=False)
    logger.log(2, {"loss": math.nan, "grad_norm": -math.inf}, console=False)
    logger.close()
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    first, second = (strict_json(line) for line in lines)
    assert first == {"step": 1, "loss": 2.5, "grad_norm": None, "skipped": True,
                     "loss_scale": 65536.0, "moe": {"imbalance": None}}
    assert second == {"step": 2, "loss": None, "grad_norm": None}


def test_the_console_line_says_a_step_was_skipped():
    line = format_line({"step": 3, "loss": 2.0, "grad_norm": math.inf, "skipped": True})
    assert "gnorm inf" in line and "skipped" in line
    assert "skipped" not in format_line({"step": 3, "loss": 2.0})

