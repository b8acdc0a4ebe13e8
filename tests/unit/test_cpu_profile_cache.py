"""`partita plan --gpu-type cpu` keeps this machine's profile for a day: plans of one
sitting agree and skip the measurement; a stale, foreign, damaged or unwritable file
only costs a new measurement."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from partita.planner.cpu_profile import cached_local_cpu
from partita.planner.hardware import GPUS

DAY = 24 * 3600.0


class Clock:
    def __init__(self, t: float = 1_800_000_000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


class Measure:
    """A stand-in measurement: a different profile each call, counted."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self):
        self.calls += 1
        return replace(GPUS["H100"], name="cpu", peak_flops=1e9 * self.calls, source="probe")


def test_a_kept_profile_is_reused_within_a_day_and_measured_again_after(tmp_path):
    path, clock, measure = tmp_path / "cpu-profile.json", Clock(), Measure()
    first, said = cached_local_cpu(path, measure=measure, now=clock)
    assert measure.calls == 1 and "measured now" in said and str(path) in said
    clock.t += DAY - 60
    again, said = cached_local_cpu(path, measure=measure, now=clock)
    assert measure.calls == 1 and again == first and "--remeasure" in said
    clock.t += 120  # a day and a minute after the measurement
    later, _ = cached_local_cpu(path, measure=measure, now=clock)
    assert measure.calls == 2 and later.peak_flops == 2e9


def test_remeasure_replaces_the_kept_profile(tmp_path):
    path, clock, measure = tmp_path / "cpu-profile.json", Clock(), Measure()
    cached_local_cpu(path, measure=measure, now=clock)
    fresh, _ = cached_local_cpu(path, remeasure=True, measure=measure, now=clock)
    kept, _ = cached_local_cpu(path, measure=measure, now=clock)
    assert measure.calls == 2 and kept == fresh and kept.peak_flops == 2e9


@pytest.mark.parametrize("damage", ["not json", "{}", '{"machine": 1}', "truncated"])
def test_a_damaged_file_is_measured_over(tmp_path, damage):
    path, clock, measure = tmp_path / "cpu-profile.json", Clock(), Measure()
    cached_local_cpu(path, measure=measure, now=clock)
    text = path.read_text()
    path.write_text(text[: len(text) // 2] if damage == "truncated" else damage)
    spec, _ = cached_local_cpu(path, measure=measure, now=clock)
    assert measure.calls == 2 and spec.peak_flops == 2e9
    assert json.loads(path.read_text())["profile"]["peak_flops"] == 2e9  # whole again


def test_a_profile_of_another_machine_is_not_used(tmp_path):
    path, clock, measure = tmp_path / "cpu-profile.json", Clock(), Measure()
    cached_local_cpu(path, measure=measure, now=clock)
    data = json.loads(path.read_text())
    data["machine"]["host"] += "-elsewhere"
    path.write_text(json.dumps(data))
    cached_local_cpu(path, measure=measure, now=clock)
    assert measure.calls == 2


def test_an_unwritable_folder_only_costs_the_measurement(tmp_path):
    blocked = tmp_path / "file-not-folder"
    blocked.write_text("")
    measure = Measure()
    spec, said = cached_local_cpu(blocked / "cpu-profile.json", measure=measure, now=Clock())
    assert measure.calls == 1 and spec.peak_flops == 1e9 and "kept in" not in said
