"""Measurements of this machine kept between runs, keyed by what they were measured on.

A rate measured in a fraction of a second on a shared machine moves by tens of percent
from one minute to the next. Two things keep one: the planner's CPU profile (so that
the plans of one sitting agree) and the CPU matmul rate MFU divides by (so that a run
started while the machine was busy does not read an MFU above 100%). Each is a small
JSON file in partita's cache folder, valid for this host, processor, core count and
torch and partita versions, and for the way it was measured (`method`).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from contextlib import suppress
from pathlib import Path
from typing import Any

KEPT_S = 24 * 3600.0  # a kept measurement older than this is measured again


def default_cache_dir() -> Path:
    """partita's folder in the user's cache: tokenized corpora (where `data.cache_dir` is
    unset), the planner's measured CPU profile and the CPU's matmul rate."""
    return Path.home() / ".cache" / "partita"


def kept_file(name: str) -> Path:
    """Where a kept measurement named `name` lives: $PARTITA_CACHE_DIR, else
    `default_cache_dir()`."""
    return Path(os.environ.get("PARTITA_CACHE_DIR") or default_cache_dir()) / name


def machine_key(method: str) -> dict[str, str]:
    """What a kept measurement must have been made on: this host, its processor and core
    count, the torch and partita that measured it (read without importing torch), and
    how (`method`)."""
    import platform
    from importlib.metadata import PackageNotFoundError, version

    import partita

    try:
        torch_version = version("torch")
    except PackageNotFoundError:
        torch_version = "none"
    return {"host": platform.node(), "processor": processor_name(),
            "cores": str(os.cpu_count()), "torch": torch_version,
            "partita": partita.__version__, "method": method}


def read_kept(path: Path, key: dict[str, str], max_age_s: float = KEPT_S,
              now: Callable[[], float] = time.time, field: str = "value"
              ) -> tuple[Any, float] | None:
    """(what was kept under `field`, when it was measured) where `path` holds a
    measurement of `key` at most `max_age_s` old; None where it is missing, damaged,
    older or another machine's."""
    try:
        data = json.loads(path.read_text())
        measured_at = float(data["measured_at"])
        current = now()
        if data["machine"] != key or not current - max_age_s <= measured_at <= current:
            return None
        return data[field], measured_at
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def write_kept(path: Path, key: dict[str, str], measured_at: float, value: Any,
               field: str = "value") -> bool:
    """Keep `value` at `path` under `field`, atomically (a reader sees the old file or the
    whole new one); False where the folder cannot be written: that costs a measurement."""
    data = {"machine": key, "measured_at": measured_at, field: value}
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(data, indent=1))
        os.replace(tmp, path)
        return True
    except OSError:
        with suppress(OSError):
            tmp.unlink(missing_ok=True)
        return False


def best_kept_rate(name: str, measured: float, method: str,
                   now: Callable[[], float] = time.time) -> float:
    """The higher of `measured` and the rate kept under `name` (measured the same way on
    this machine within a day), which it replaces when higher. A rate measured while
    other work shared the cores reads low; the best one seen is the machine's."""
    path, key = kept_file(name), machine_key(method)
    kept = read_kept(path, key, now=now)
    if kept is not None and float(kept[0]) >= measured:
        return float(kept[0])
    write_kept(path, key, now(), measured)
    return measured


def processor_name() -> str:
    """This machine's processor as /proc/cpuinfo names it (else what platform says)."""
    name = cpuinfo_value(("model name",))
    if name is not None:
        return name
    import platform

    return platform.processor() or platform.machine()


def cpuinfo_value(keys: tuple[str, ...]) -> str | None:
    """The value of the first /proc/cpuinfo line starting with one of `keys`; None
    where there is no such line or file."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(keys):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def meminfo_bytes(key: str) -> float | None:
    """A /proc/meminfo figure (`MemTotal`, `MemAvailable`, ...) in bytes; None where
    there is no such line or file."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(f"{key}:"):
                    return float(line.split()[1]) * 1024
    except OSError:
        pass
    return None
