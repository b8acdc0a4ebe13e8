"""`partita train` on CPU refuses, before launch, a job that cannot fit in the machine's
memory, and names the smallest change that would fit (partita.commands.memory_check)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from partita.commands.memory_check import (
    PROCESS_BASELINE_BYTES,
    check_host_memory,
    check_offloaded_states,
    device_memory_advice,
    device_memory_note,
    host_need,
    offloaded_bytes,
    plan_precision,
)
from partita.config import load_config, with_overrides
from partita.errors import PartitaError


def _cfg(*overrides: str):
    return load_config(None, list(overrides))


def test_a_model_far_beyond_the_machine_is_refused_with_its_figures():
    """llama3-8b on two CPU processes started, grew, and ended with "process 1 was
    killed by SIGKILL" after the out-of-memory killer took it."""
    cfg = _cfg("--model.name=llama3-8b")
    with pytest.raises(PartitaError) as err:
        check_host_memory(cfg, 2, 2, available=24e9)
    text = str(err.value)
    assert "needs about" in text and "24.0 GB available" in text
    assert "--train.host_memory_check=false" in text
    # Nothing fits 24 GB even with every change: the message says so, naming them (the
    # largest count of microbatches only).
    assert "Even with --train.microbatches=8 --parallel.zero_stage=3" in text
    assert "smaller model" in text and text.count("microbatches") == 1


def test_the_smallest_change_that_fits_is_named():
    # Four ranks of a 16-sequence batch at one sequence per microbatch already.
    one_each = ("--model.name=llama-100m", "--train.microbatches=4")
    cfg = _cfg(*one_each)
    plain = host_need(cfg, 4, 4).total
    sharded = host_need(_cfg(*one_each, "--parallel.zero_stage=3"), 4, 4).total
    assert sharded < plain
    with pytest.raises(PartitaError, match=r"It would fit with --parallel.zero_stage=3 "
                                           r"\(about"):
        check_host_memory(cfg, 4, 4, available=(plain + sharded) / 2)


def test_activations_too_large_are_cut_into_microbatches_first():
    """A batch whose activations overflow is cut into microbatches (same results, one
    microbatch's activations held at a time) before anything else is suggested; the
    count named is the smallest that fits."""
    cfg = _cfg("--train.global_batch=1024")
    plain = host_need(cfg, 2, 2).total
    by_count = {m: host_need(_cfg("--train.global_batch=1024", f"--train.microbatches={m}"),
                             2, 2).total for m in (2, 4, 8)}
    assert plain > by_count[2] > by_count[4] > by_count[8]
    with pytest.raises(PartitaError, match=r"It would fit with --train.microbatches=4 \(about"):
        check_host_memory(cfg, 2, 2, available=(by_count[2] + by_count[4]) / 2)


def test_a_job_that_fits_starts_and_one_near_the_limit_is_noted():
    cfg = _cfg()
    need = host_need(cfg, 2, 2).total
    assert check_host_memory(cfg, 2, 2, available=10 * need) is None
    note = check_host_memory(cfg, 2, 2, available=1.1 * need)
    assert note is not None and "needs about" in note
    with pytest.raises(PartitaError):
        check_host_memory(cfg, 2, 2, available=0.9 * need)


def test_the_check_can_be_turned_off():
    cfg = _cfg("--model.name=llama3-8b", "--train.host_memory_check=false")
    assert check_host_memory(cfg, 2, 2, available=1e9) is None


def test_zero3_shards_the_states_over_the_processes():
    """The need follows the layout: four ZeRO-3 processes hold a quarter of the states
    four stage-0 processes hold (16 bytes per parameter in fp32 with Adam)."""
    full = host_need(_cfg("--model.name=llama3-8b"), 4, 4)
    sharded = host_need(_cfg("--model.name=llama3-8b", "--parallel.zero_stage=3"), 4, 4)
    params = 8.03e9
    assert full.states_bytes == pytest.approx(4 * 16 * params, rel=0.01)
    assert sharded.states_bytes == pytest.approx(16 * params, rel=0.01)
    assert full.total - full.tensor_bytes - full.shared_bytes == \
        pytest.approx(4 * PROCESS_BASELINE_BYTES)


def test_every_pipeline_stage_is_counted_once_per_rank():
    """A pipeline's stages hold different layers; on one machine each rank is counted
    with its own stage's bytes, so two stages sum to about one replica's states."""
    one = host_need(_cfg("--model.name=llama-100m"), 1, 1)
    two = host_need(_cfg("--model.name=llama-100m", "--parallel.pp=2",
                         "--train.microbatches=2"), 2, 2)
    assert two.states_bytes == pytest.approx(one.states_bytes, rel=0.02)


@pytest.mark.parametrize("overrides, total", [
    ((), 16), (("--train.dtype=float64",), 32),
    (("--precision.param_dtype=bfloat16",), 16),
    (("--precision.param_dtype=bfloat16", "--precision.reduce_dtype=float32"), 18),
    (("--precision.param_dtype=bfloat16", "--precision.master_weights=false"), 8),
])
def test_bytes_per_parameter_follow_the_dtypes(overrides, total):
    assert plan_precision(_cfg(*overrides)).total == total


def test_the_command_refuses_before_anything_starts(tmp_path):
    out = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "partita.cli", "train", "--model.name=llama3-8b",
         "--train.device=cpu", f"--train.out_dir={out}"],
        capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "host_memory_check=false" in proc.stderr
    assert "SIGKILL" not in proc.stderr and not out.exists()


def test_microbatch_counts_divide_each_replicas_batch():
    """Counts double from the current one and must divide the replica's batch; one
    sequence per microbatch is always among them (3 sequences: only 3)."""
    from partita.commands.memory_check import _microbatch_remedies

    def counts(batch: int, world: int, current: int = 1) -> list[int]:
        cfg = _cfg(f"--train.global_batch={batch}", f"--train.microbatches={current}")
        return [int(flag.split("=")[1]) for flag in _microbatch_remedies(cfg, world)]

    assert counts(16, 2) == [2, 4, 8]
    assert counts(6, 2) == [3]
    assert counts(24, 2, current=3) == [6, 12]
    assert counts(16, 2, current=8) == []


def test_short_dtype_names_count_as_their_full_names():
    """`bf16` and `fp16` are accepted spellings: they were counted as 4-byte fp32
    parameters, and a bf16 run's MFU divided by the float32 rate."""
    for short, full in (("bf16", "bfloat16"), ("fp16", "float16")):
        cfg = _cfg(f"--precision.param_dtype={short}", "--precision.reduce_dtype=fp32")
        assert (cfg.param_dtype_name, cfg.reduce_dtype_name) == (full, "float32")
        assert plan_precision(cfg) == plan_precision(
            _cfg(f"--precision.param_dtype={full}", "--precision.reduce_dtype=float32"))
    assert _cfg("--train.dtype=fp64").param_dtype_name == "float64"


def test_the_shared_memory_transports_are_counted_once_per_group(monkeypatch):
    """Each gloo group of two or more on the machine may take a collectives arena in
    /dev/shm (memory), a pipeline its rings per neighbour pair, ring attention its rings
    per pair of ranks: counted once per group, not per process."""
    from partita import shm_channel, shm_collectives
    from partita.commands.memory_check import shared_memory_bytes

    monkeypatch.delenv("PARTITA_SHM_COLLECTIVES", raising=False)
    monkeypatch.delenv("PARTITA_SHM_MIN_BYTES", raising=False)
    arena = shm_collectives.arena_bytes(2)
    assert 32 * 2**20 < arena < 33 * 2**20
    assert shared_memory_bytes(_cfg(), 1) == 0
    assert shared_memory_bytes(_cfg("--parallel.dp=2"), 2) == arena  # one group: the data
    rings = shm_channel.arena_bytes(2)  # stage 0 -> 1 and back
    assert shared_memory_bytes(_cfg("--parallel.pp=2"), 2) == arena + rings
    # dp=2 x pp=2: two pipelines, two data-parallel groups.
    assert shared_memory_bytes(_cfg("--parallel.pp=2", "--parallel.dp=2"), 4) == \
        4 * arena + 2 * rings
    assert shared_memory_bytes(_cfg("--parallel.pp=2", "--model.tie_embeddings=true"), 2) == \
        arena + 2 * rings  # the tied embedding's exchange has rings of its own
    assert shared_memory_bytes(_cfg("--parallel.cp=4"), 4) == \
        shm_collectives.arena_bytes(4) + shm_channel.arena_bytes(12)
    # A floor keeps the transfers on gloo (the arenas stay); the switch, everything.
    monkeypatch.setenv("PARTITA_SHM_MIN_BYTES", "4096")
    assert shared_memory_bytes(_cfg("--parallel.pp=2"), 2) == arena
    monkeypatch.setenv("PARTITA_SHM_COLLECTIVES", "0")
    assert shared_memory_bytes(_cfg("--parallel.pp=2"), 2) == 0
    monkeypatch.delenv("PARTITA_SHM_COLLECTIVES")
    monkeypatch.delenv("PARTITA_SHM_MIN_BYTES")
    # Part of the total and of the refusal's figures.
    cfg = _cfg("--parallel.pp=2")
    need = host_need(cfg, 2, 2)
    assert need.shared_bytes == arena + rings
    assert need.total == pytest.approx(need.tensor_bytes + 2 * PROCESS_BASELINE_BYTES
                                       + arena + rings)
    with pytest.raises(PartitaError, match=r"36 MiB of shared memory \(/dev/shm\) for their"):
        check_host_memory(cfg, 2, 2, available=need.total / 2)


def test_gpu_jobs_are_judged_by_the_states_they_offload_to_host_memory():
    """A GPU job with ZeRO-Offload keeps master weights, moments and a gradient copy in
    host memory: llama3-70b over 8 GPUs of one machine, stage 2, puts 16 bytes of each
    of its ~70.6 B parameters there, ~1.1 TB, which no 512 GB machine holds."""
    cfg = _cfg("--model.name=llama3-70b", "--parallel.zero_stage=2",
               "--parallel.offload=optimizer", "--train.global_batch=16")
    states = offloaded_bytes(cfg, 8, 8)
    params = cfg.model_config().num_params()
    assert 16 * params <= states <= 16.1 * params  # padding of the flat buffers aside
    with pytest.raises(PartitaError) as err:
        check_offloaded_states(cfg, 8, 8, available=512e9)
    text = str(err.value)
    assert f"about {states / 1e9:.1f} GB of model states" in text and "512.0 GB" in text
    assert "for its 8 processes" in text
    assert "--parallel.offload=optimizer+disk" in text and "--nnodes" in text
    assert "--train.host_memory_check=false" in text
    # Two machines of 8: each holds half of the states (the data-parallel group is 16).
    check_offloaded_states(cfg, 16, 8, available=0.6 * states)
    # Disk offload keeps only the engine's buffers on the host.
    on_disk = with_overrides(cfg, ["--parallel.offload=optimizer+disk"])
    assert offloaded_bytes(on_disk, 8, 8) < 0.01 * states
    check_offloaded_states(on_disk, 8, 8, available=512e9)
    # Nothing offloaded, or the check turned off: nothing judged.
    check_offloaded_states(with_overrides(cfg, ["--parallel.offload=none"]), 8, 8, available=1e9)
    check_offloaded_states(with_overrides(cfg, ["--train.host_memory_check=false"]), 8, 8,
                           available=1e9)


def test_out_of_device_memory_says_what_the_layout_holds_and_what_would_fit():
    """A CUDA out-of-memory error said only "Tried to allocate 2.00 GiB" (and partita
    called it a fault of its own). The advice gives the planner's peak per process and
    the first of the cumulative changes that brings it under the device."""
    cfg = _cfg("--model.name=llama3-8b", "--train.global_batch=8", "--data.seq_len=4096",
               "--precision.param_dtype=bfloat16")
    text = device_memory_advice(cfg, 8, 80e9)
    assert "of the device's 80.0 GB at its peak" in text and "of model states" in text
    fix = text.split("It would fit with ")[1]
    assert fix.startswith("--parallel.zero_stage=3 (about ")
    assert float(fix.split("(about ")[1].split(" GB")[0]) <= 0.9 * 80
    # A device the planner thinks it fits: said so, and the peak can still be lowered.
    small = _cfg("--model.name=llama3.2-1b", "--train.global_batch=8",
                 "--precision.param_dtype=bfloat16")
    within = device_memory_advice(small, 1, 141e9)
    assert "That is within the device" in within and "expandable_segments" in within
    assert "Lowering the peak helps either way: --train.microbatches=2" in within
    # The size unknown: the first change that lowers the peak, not "would fit".
    unknown = device_memory_advice(cfg, 8, None)
    assert "It would hold less with --parallel.zero_stage=3" in unknown
    assert "device's" not in unknown


def test_a_later_setting_of_the_same_key_replaces_the_earlier_one_in_the_advice():
    """Selective, then full recompute: the advice names the one in effect only, and no
    change the job already has (bf16 here)."""
    cfg = _cfg("--model.name=llama3-8b", "--train.global_batch=8", "--data.seq_len=8192",
               "--precision.param_dtype=bfloat16", "--train.microbatches=8")
    text = device_memory_advice(cfg, 1, 10e9)
    assert "--parallel.recompute=selective --parallel.recompute=full" not in text, text
    assert "--parallel.recompute=full" in text, text
    assert "--precision.param_dtype" not in text, text


def test_a_failed_host_allocation_is_told_against_the_machines_memory(monkeypatch):
    """On a CPU the advice weighs this machine's processes against its total memory."""
    import partita.commands.memory_check as memory_check

    monkeypatch.setattr(memory_check, "meminfo_bytes",
                        lambda key: 24e9 if key == "MemTotal" else None)
    big = _cfg("--model.name=llama-100m", "--model.max_seq_len=2048",
               "--data.seq_len=2048", "--train.global_batch=64")
    need = host_need(big, 2, 2).total
    assert need > 0.9 * 24e9  # so the advice has to find a change that fits
    text = memory_check.host_memory_advice(big, 2, 2)
    assert f"to hold about {need / 1e9:.1f} GB of its 24.0 GB" in text
    assert "It would fit with --train.microbatches=" in text
    roomy = memory_check.host_memory_advice(_cfg(), 2, 2)
    assert "That leaves room" in roomy and "Lowering it helps either way:" in roomy


def test_a_gpu_job_the_planner_expects_beyond_its_gpu_gets_a_note_before_launch():
    """A note, not a refusal: llama3-8b at stage 0 over 8 GPUs holds ~176 GB a GPU."""
    cfg = _cfg("--model.name=llama3-8b", "--train.global_batch=8", "--data.seq_len=4096",
               "--precision.param_dtype=bfloat16")
    note = device_memory_note(cfg, 8, 80e9)
    assert note.startswith("partita: note: this job will likely run out of GPU memory.")
    assert "It would fit with --parallel.zero_stage=3" in note
    assert device_memory_note(cfg, 8, 400e9) is None  # room to spare
    assert device_memory_note(cfg, 8, None) is None  # no GPU to compare with
