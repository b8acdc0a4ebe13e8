"""Measurements kept per machine: the best rate within a day, only for the same machine
and method, written whole."""

from __future__ import annotations

import json

from partita import machine_cache
from partita.machine_cache import best_kept_rate, kept_file, machine_key, read_kept

DAY = 24 * 3600.0


class Clock:
    def __init__(self) -> None:
        self.t = 1_000_000.0

    def __call__(self) -> float:
        return self.t


def test_the_best_rate_is_kept_for_a_day(monkeypatch, tmp_path):
    monkeypatch.setenv("PARTITA_CACHE_DIR", str(tmp_path))
    clock = Clock()
    assert best_kept_rate("rate.json", 5.0, "m", now=clock) == 5.0
    assert best_kept_rate("rate.json", 3.0, "m", now=clock) == 5.0  # a busy start
    assert best_kept_rate("rate.json", 6.0, "m", now=clock) == 6.0  # a better one
    assert read_kept(kept_file("rate.json"), machine_key("m"), now=clock)[0] == 6.0
    clock.t += DAY + 1  # a day later the machine is measured afresh
    assert best_kept_rate("rate.json", 3.0, "m", now=clock) == 3.0


def test_a_rate_of_another_method_or_machine_is_not_used(monkeypatch, tmp_path):
    monkeypatch.setenv("PARTITA_CACHE_DIR", str(tmp_path))
    clock = Clock()
    best_kept_rate("rate.json", 9.0, "m", now=clock)
    assert best_kept_rate("rate.json", 2.0, "other", now=clock) == 2.0
    monkeypatch.setattr(machine_cache, "processor_name", lambda: "another processor")
    assert best_kept_rate("rate.json", 1.0, "other", now=clock) == 1.0


def test_a_damaged_or_unwritable_file_costs_only_the_measurement(monkeypatch, tmp_path):
    monkeypatch.setenv("PARTITA_CACHE_DIR", str(tmp_path))
    kept_file("rate.json").write_text('{"machine": ')
    assert best_kept_rate("rate.json", 4.0, "m") == 4.0
    assert json.loads(kept_file("rate.json").read_text())["value"] == 4.0
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    monkeypatch.setenv("PARTITA_CACHE_DIR", str(blocked))  # a file, not a folder
    assert best_kept_rate("rate.json", 4.0, "m") == 4.0
    assert not list(tmp_path.glob(".*.tmp"))
