"""What `partita train` says before launch, besides refusing: notes on settings that
will not do what they seem to (a stop_after no step reaches, a timeline without a
pipeline, a pipeline that idles much of its step) and on a resume's changed settings,
and a warning on oversubscribed threads."""

from __future__ import annotations

import os
import sys

from partita.checkpoint import read_manifest
from partita.checkpoint.manifest import routing_changes, skipped_newer
from partita.checkpoint.resume import resume_target
from partita.config import Config, ParallelSection, config_from_toml
from partita.errors import PartitaError


def available_cores() -> int:
    """Cores this process may run on (its affinity, where the platform tells)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def threads_note(cfg: Config, local_processes: int, cores: int | None = None) -> str | None:
    """A warning when train.threads x the local processes exceed this machine's cores:
    oversubscribed threads wait on one another (1000 threads on 2 cores ran 200x
    slower) without any other sign."""
    threads = cfg.train.threads
    cores = cores or available_cores()
    # One thread each is the least there is: more processes than cores is the user's
    # choice of layout (the README's 4-process examples on 2 cores), not the threads'.
    if threads <= 1 or threads * local_processes <= cores:
        return None
    share = max(1, cores // local_processes)
    return (f"partita: warning: train.threads={threads} x {local_processes} process(es) on "
            f"this machine is {threads * local_processes:,} threads for {cores} core(s); "
            "oversubscribed threads wait on one another and every step slows down, many "
            f"times over. Set train.threads to at most {share}, or to 0 (the cores shared "
            "among the local processes).")


def draws_timeline(cfg: Config) -> bool:
    """Whether the run draws train.timeline_png: only a pipeline (pp > 1) records one."""
    return bool(cfg.train.timeline_png) and cfg.parallel.pp > 1


def schedule_changes(manifest: dict, cfg: Config) -> list[str]:
    """The learning-rate schedule's settings (WarmupCosine's) that differ from those the
    checkpoint was trained with, as 'train.lr 0.003 -> 0.001'."""
    if "config" not in manifest:
        return []
    before = config_from_toml(manifest["config"]).train
    return [f"train.{k} {getattr(before, k):g} -> {getattr(cfg.train, k):g}"
            for k in ("steps", "lr", "min_lr", "warmup_steps")
            if getattr(before, k) != getattr(cfg.train, k)]


def optimizer_changes(manifest: dict, cfg: Config) -> list[str]:
    """AdamW's settings that differ from those the manifest records the checkpoint was
    trained with, as 'train.beta2 0.95 -> 0.99' (allowed, like another train.lr)."""
    saved = manifest.get("optimizer", {})
    betas = saved.get("betas") or [None, None]
    before = {"beta1": betas[0], "beta2": betas[1], "eps": saved.get("eps"),
              "weight_decay": saved.get("weight_decay")}
    return [f"train.{k} {float(was):g} -> {getattr(cfg.train, k):g}"
            for k, was in before.items()
            if was is not None and float(was) != getattr(cfg.train, k)]


BUBBLE_NOTE_ABOVE = 0.25  # idle share of a pipeline step worth a note before launch
BUBBLE_SIMULATED_CELLS = 20_000  # stages x microbatches x virtual: ~0.1 s to simulate


def bubble_note(cfg: Config, world_size: int) -> str | None:
    """A note when the pipeline's stages would idle much of every step (few microbatches
    for its stages), with a train.microbatches that would idle less; None otherwise."""
    from partita.pipeline.schedules import build_schedule
    from partita.pipeline.simulate import simulate

    layout = cfg.layout(world_size)
    m, pp, v = layout.microbatches(cfg.train.global_batch), layout.pp, layout.virtual_stages

    def idle(count: int) -> float | None:  # None: no such schedule, or too big to simulate
        if pp * count * v > BUBBLE_SIMULATED_CELLS:
            return None
        try:
            return simulate(build_schedule(layout.schedule, pp, count, v)).bubble_fraction
        except PartitaError:
            return None

    now = idle(m) if pp > 1 and m > 0 else None
    if now is None or now <= BUBBLE_NOTE_ABOVE:
        return None
    per_replica = cfg.train.global_batch // layout.dp
    pick = None  # the fewest microbatches idling at most half the threshold, else the least idle
    for k in (k for k in range(m + 1, per_replica + 1) if per_replica % k == 0):
        b = idle(k)
        if b is not None and b < (pick[1] if pick else now):
            pick = (k, b)
            if b <= BUBBLE_NOTE_ABOVE / 2:
                break
    fix = (f"train.microbatches={pick[0]} would bring it to {pick[1]:.0%}, a larger "
           "train.global_batch lower still" if pick else
           f"each replica's {per_replica} sequences allow no more microbatches: a larger "
           "train.global_batch would")
    return (f"partita: note: the pipeline's {pp} stages run {m} microbatch"
            f"{'es' if m > 1 else ''} a step ({layout.schedule}), so each stage idles "
            f"about {now:.0%} of it (the bubble, simulated with a backward twice a "
            f"forward); {fix}.")


def compiled_zero_bubble_note(cfg: Config) -> str | None:
    """A note when zb-h1 runs compiled blocks that are not fully recomputed: their
    backward is one node, so it has nothing of theirs to defer (docs/performance.md)."""
    p = cfg.parallel
    if (p.pp < 2 or p.schedule != "zb-h1" or cfg.train.compile == "none"
            or p.recompute == "full"):
        return None
    return (f"partita: note: parallel.schedule=zb-h1 with train.compile={cfg.train.compile}: "
            "a compiled block yields its weight gradients with its input gradient, so the "
            "schedule has none of the blocks' to defer into the bubble, and each "
            "microbatch waiting for its weight pass holds them; parallel.schedule=1f1b runs "
            "as fast with less memory.")


def ignored_zero_settings(cfg: Config) -> list[str]:
    """ZeRO settings given a value other than their default at a stage that never reads
    them: parallel.accumulation is stage 2's, prefetch and keep_gathered stage 3's."""
    p, default = cfg.parallel, ParallelSection()
    by_stage = {"accumulation": 2, "prefetch": 3, "keep_gathered": 3}
    return [f"parallel.{key}={getattr(p, key)} (a ZeRO stage {stage} setting)"
            for key, stage in by_stage.items()
            if getattr(p, key) != getattr(default, key) and p.zero_stage != stage]


def ignored_disk_settings(cfg: Config) -> list[str]:
    """Disk offload's settings given a value other than their default under an offload
    mode without disk, which reads neither (host offload keeps whole states in host
    memory, with no budget)."""
    p, default = cfg.parallel, ParallelSection()
    if p.offload.endswith("+disk"):
        return []
    return [f"parallel.{key}={getattr(p, key)}" for key in ("offload_dir", "host_memory_budget_gb")
            if getattr(p, key) != getattr(default, key)]


def pipeline_notes(cfg: Config, world_size: int) -> list[str]:
    """What to say before launch about how the pipeline will spend its step."""
    return [n for n in (bubble_note(cfg, world_size), compiled_zero_bubble_note(cfg)) if n]


def print_notes(cfg: Config) -> None:
    """Say once, before launch, what the run will do other than asked or than before: a
    damaged newer checkpoint passed over, routing, learning-rate schedule or optimizer
    settings changed on resume, a train.stop_after that no step reaches, ZeRO settings of another
    stage, disk offload's settings without disk offload, a train.timeline_png ignored
    without a pipeline, and what preparing the data does (`data_notes`)."""
    from partita.data.dataset import data_notes

    for note in data_notes(cfg.data):
        print(note, file=sys.stderr, flush=True)
    target = resume_target(cfg)
    if target is not None and (skipped := skipped_newer(target)):
        print(skipped, file=sys.stderr, flush=True)
    changed = routing_changes(read_manifest(target), cfg.model_config()) if target else []
    if changed:
        print(f"partita: note: resuming {target.name} with other routing settings than it "
              f"was trained with ({'; '.join(changed)}).", file=sys.stderr, flush=True)
    if target is not None and (schedule := schedule_changes(read_manifest(target), cfg)):
        print(f"partita: note: resuming {target.name} with another learning-rate schedule "
              f"than it was trained with ({'; '.join(schedule)}); the rate follows the new "
              "one from the checkpoint's step on.", file=sys.stderr, flush=True)
    if target is not None and (optimizer := optimizer_changes(read_manifest(target), cfg)):
        print(f"partita: note: resuming {target.name} with other optimizer settings than it "
              f"was trained with ({'; '.join(optimizer)}); they apply from the checkpoint's "
              "step on (its AdamW moments load as saved).", file=sys.stderr, flush=True)
    stop, steps = cfg.train.stop_after, cfg.train.steps
    start = int(read_manifest(target)["step"]) if target is not None else 0
    if stop and (stop > steps or stop <= start):
        why = (f"the run ends at train.steps={steps} first" if stop > steps else
               f"the run starts after step {start}, from its checkpoint")
        print(f"partita: note: train.stop_after={stop} is ignored: {why}.", file=sys.stderr,
              flush=True)
    if ignored := ignored_zero_settings(cfg):
        print(f"partita: note: {'; '.join(ignored)} ignored at "
              f"parallel.zero_stage={cfg.parallel.zero_stage}.", file=sys.stderr, flush=True)
    if ignored := ignored_disk_settings(cfg):
        print(f"partita: note: {'; '.join(ignored)} ignored at parallel.offload="
              f"{cfg.parallel.offload}: only the disk modes (optimizer+disk, "
              "optimizer+params+disk) read them.", file=sys.stderr, flush=True)
    if cfg.train.timeline_png and not draws_timeline(cfg):
        print(f"partita: note: train.timeline_png={cfg.train.timeline_png} is ignored: only "
              "pipeline runs (parallel.pp > 1) record a timeline, and this run has "
              f"parallel.pp={cfg.parallel.pp}.", file=sys.stderr, flush=True)
