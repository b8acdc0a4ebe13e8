"""Per-step metrics: a JSONL file, TensorBoard when installed, a console line, a bar.

MFU = (training FLOPs per token x tokens per second) / (peak FLOP/s x devices), with
FLOPs per token = 6N + 12*L*H*Q*T (see ModelConfig.flops_per_token). The peak is the
device's dense bf16 datasheet figure (`partita.device_specs`) on known GPUs
(TF32 for fp32 training would be half: we state bf16 so MFU is comparable across runs),
or, on a CPU, one thread's measured matmul rate per thread (the best measured on this
machine within a day, `partita.machine_cache`): float32's, or for 16-bit training the
16-bit rate where that is higher (a Zen 4 core multiplies bf16 at twice its float32
rate; against the float32 rate a bf16 run read 160% MFU); or `metrics.peak_tflops` when
set.
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path
from typing import Any

import torch

from partita.device_specs import datasheet_peak_flops, matmul_rate
from partita.machine_cache import best_kept_rate
from partita.run_dir import PARTIAL_SUFFIX

# How the CPU rate MFU divides by is measured: float32 512^3 products, one thread.
CPU_RATE_METHOD = "fp32-mm512-1thread"


def device_peak_flops(device: torch.device, configured_tflops: float = 0.0,
                      compute_dtype: str = "float32") -> float:
    """FLOP/s that MFU divides by: the setting, the GPU datasheet table, or on a CPU
    one thread's matmul rate (the best measured here within a day) times the cores this
    process can have: its threads, but no more than its share of the machine's cores
    when the job's processes here want more threads than there are cores. The CPU rate
    is float32's, or `compute_dtype`'s (bfloat16, float16) where that is faster."""
    if configured_tflops > 0:
        return configured_tflops * 1e12
    if device.type == "cuda":
        # An unknown GPU: MFU is reported as 0 until metrics.peak_tflops is set.
        return datasheet_peak_flops(torch.cuda.get_device_name(device)) or 0.0
    rate = _cpu_thread_rate("float32")
    if compute_dtype in ("bfloat16", "float16"):
        rate = max(rate, _cpu_thread_rate(compute_dtype))
    threads = torch.get_num_threads()
    return rate * min(threads, _cores() / int(os.environ.get("LOCAL_WORLD_SIZE", "1")))


def _cpu_thread_rate(dtype_name: str) -> float:
    """One thread's best 512^3 matmul rate in `dtype_name`, the best kept here within a
    day: a start while other work shares the cores measures low (an MFU above 100% was
    seen), so the best rate measured stands for the machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        rate = matmul_rate(512, 0.2, dtype_name)
    finally:
        torch.set_num_threads(threads)
    if dtype_name == "float32":  # the name and method kept since before 16-bit rates
        return best_kept_rate("cpu-matmul-rate.json", rate, CPU_RATE_METHOD)
    return best_kept_rate(f"cpu-matmul-rate-{dtype_name}.json", rate,
                          CPU_RATE_METHOD.replace("fp32", dtype_name))


def _cores() -> int:
    """Cores this process may run on (its affinity, where the platform tells)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def memory_bytes(device: torch.device) -> int:
    """Peak memory of this process: allocated device memory, else resident set size."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


class StepWindow:
    """Training time since the last logged step, for its tokens/s and MFU: the steps
    alone, so that an evaluation or a checkpoint save between them does not make the
    step that runs it read several times slower."""

    def __init__(self, tokens_per_step: float, flops_per_step: float,
                 peak_flops: float) -> None:
        self.tokens_per_step, self.flops_per_step = tokens_per_step, flops_per_step
        self.peak_flops = peak_flops  # of all devices together; 0: unknown (no MFU)
        self.seconds, self.steps = 0.0, 0

    def add(self, seconds: float) -> None:
        self.seconds += seconds
        self.steps += 1

    def take(self) -> tuple[float, float]:
        """(tokens/s, MFU) of the steps since the last take, and start again."""
        seconds = max(self.seconds, 1e-9)
        tps = self.tokens_per_step * self.steps / seconds
        mfu = (self.flops_per_step * self.steps / seconds / self.peak_flops
               if self.peak_flops else 0.0)
        self.seconds, self.steps = 0.0, 0
        return tps, mfu


class MetricsLogger:
    """Writes metrics on the logging rank only; other ranks get a silent logger."""

    def __init__(self, out_dir: Path, enabled: bool, total_steps: int, progress: bool,
                 tensorboard: bool, resume_at: int | None = None) -> None:
        """`resume_at`: a run resumed from the checkpoint of that step keeps the records
        up to it and continues the file (records of steps after it, from the attempt
        that was interrupted, are dropped: they are about to be trained again)."""
        self.enabled = enabled
        self.total_steps = total_steps
        self.progress = progress and enabled and sys.stderr.isatty()
        self._jsonl = None
        self._tb = None
        if not enabled:
            return
        out_dir.mkdir(parents=True, exist_ok=True)
        path = out_dir / "metrics.jsonl"
        if resume_at is not None:
            _keep_records_up_to(path, resume_at)
            self._jsonl = path.open("a")
        else:
            self._jsonl = path.open("w")
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(str(out_dir / "tensorboard"))
            except ImportError:
                self._tb = None  # tensorboard not installed: JSONL only

    def log(self, step: int, values: dict, console: bool) -> None:
        if not self.enabled:
            return
        record = {"step": step, **values}
        # Strict JSON: Python's json writes inf and nan as bare Infinity / NaN, which
        # JSON parsers other than Python's reject; null says "no finite value".
        self._jsonl.write(json.dumps(json_safe(record), allow_nan=False) + "\n")
        self._jsonl.flush()
        if self._tb is not None:
            for key, value in values.items():
                if isinstance(value, int | float):
                    self._tb.add_scalar(key, value, step)
        if console:
            self._clear_bar()
            print(format_line(record), flush=True)
        if self.progress:
            self._bar(step)

    def message(self, text: str) -> None:
        if self.enabled:
            self._clear_bar()
            print(text, flush=True)

    def _bar(self, step: int) -> None:
        width = 30
        done = int(width * step / max(self.total_steps, 1))
        sys.stderr.write(f"\r[{'#' * done}{'.' * (width - done)}] {step}/{self.total_steps}")
        sys.stderr.flush()

    def _clear_bar(self) -> None:
        if self.progress:
            sys.stderr.write("\r" + " " * 50 + "\r")

    def close(self) -> None:
        self._clear_bar()
        if self._jsonl is not None:
            self._jsonl.close()
        if self._tb is not None:
            self._tb.close()


def _keep_records_up_to(path: Path, step: int) -> None:
    """Cut the file to its records up to `step` by writing them to a new file that then
    takes its name: the history survives a job killed at any moment of the resume (a
    truncate-and-rewrite would leave it empty until the first flush)."""
    if not path.exists():
        return
    kept = _records_up_to(path, step)
    tmp = path.with_name(path.name + PARTIAL_SUFFIX)
    with tmp.open("w") as f:
        f.writelines(kept)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _records_up_to(path: Path, step: int) -> list[str]:
    kept = []
    for line in path.read_text().splitlines(keepends=True):
        try:
            if json.loads(line).get("step", 0) <= step:
                kept.append(line if line.endswith("\n") else line + "\n")
        except ValueError:
            continue  # a line cut short by the crash that ended the earlier attempt
    return kept


def json_safe(value: Any) -> Any:
    """`value` with every non-finite float (in nested dicts and lists too) as None."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(v) for v in value]
    return value


def format_line(record: dict) -> str:
    parts = [f"step {record['step']:>5}"]
    formats = {"loss": "loss {:.4f}", "val_loss": "val {:.4f}", "lr": "lr {:.2e}",
               "grad_norm": "gnorm {:.3f}", "tokens_per_s": "tok/s {:,.0f}",
               "mfu": "mfu {:.1%}", "memory_gb": "mem {:.2f}GB", "aux_loss": "aux {:.4f}",
               "z_loss": "z {:.3f}", "imbalance": "imb {:.2f}"}
    for key, fmt in formats.items():
        if key in record and record[key] is not None:
            parts.append(fmt.format(record[key]))
    if record.get("skipped"):
        parts.append("step skipped")
    return " | ".join(parts)
