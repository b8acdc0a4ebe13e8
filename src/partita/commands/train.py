"""`partita train [CONFIG] [--section.key=value ...]`."""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable

from partita.checkpoint import read_manifest
from partita.checkpoint.resume import resume_target
from partita.commands.memory_check import (
    check_host_memory,
    check_offloaded_states,
    device_memory_advice,
    device_memory_note,
    host_memory_advice,
)
from partita.commands.run_folders import check_run_dir, prepare_run_dir
from partita.commands.train_notes import pipeline_notes, print_notes, threads_note
from partita.compile_rules import model_refusal
from partita.config import Config, config_from_toml, load_config
from partita.errors import (
    CHECKPOINT_STOP_EXIT,
    PEER_FAILURE_EXIT,
    AgreedError,
    OutOfDeviceMemory,
    PartitaError,
    PeerFailure,
    PeerReported,
    Stopped,
    StoppedBeforeStart,
    before_stop_request,
    print_line,
    signals_held,
)
from partita.launch import (
    LaunchSpec,
    launch,
    launched_externally,
    quiet_torch_native_warnings,
    start_worker_server,
    stop_worker_server,
)
from partita.layout import Layout
from partita.layout_rules import validate
from partita.models.hf_config import check_exportable
from partita.run_dir import with_absolute_inputs


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "train", help="train a model (default: the tiny model on built-in data, 2 CPU processes)",
        description="Train a model. Settings come from CONFIG (TOML) and --section.key=value "
                    "overrides, e.g. --train.steps=100 --parallel.zero_stage=2. Under torchrun "
                    "the world comes from the environment and --nproc is ignored.",
    )
    p.add_argument("config", nargs="?", help="TOML config file")
    p.add_argument("--nproc", type=int, default=None,
                   help="processes on this node (default: 2 on CPU, one per GPU)")
    p.add_argument("--nnodes", type=int, default=1, help="nodes in the job")
    p.add_argument("--rdzv-endpoint", default="", help="HOST:PORT of the rendezvous (multi-node)")
    p.add_argument("--rdzv-id", default="", help="job id shared by every node (multi-node)")
    p.add_argument("--rdzv-timeout", type=float, default=120.0,
                   help="seconds the nodes wait for each other before the job stops (multi-node)")
    p.add_argument("--max-restarts", type=int, default=0,
                   help="restart the workers this many times after a failure; each restart "
                        "resumes from the newest checkpoint (set --train.checkpoint_every)")
    p.set_defaults(func=run, accepts_overrides=True)


VICTIM_GRACE_S = 1.0
# Under torchrun, how long a rank other than 0 that refused the layout waits for rank 0
# to say why and leave (torchrun then stops the rest): bounded, should rank 0 not leave.
OTHER_RANKS_WAIT_S = 10.0
# What every worker imports before its first step.
WORKER_IMPORTS = ("torch", "torch.distributed", "partita.trainer", "partita.faults")


def _worker(config_toml: str) -> dict:
    """Entry point of each launched process."""
    try:
        from partita.faults import fault_from_env
        from partita.trainer import train

        cfg = config_from_toml(config_toml)
        return _explaining_memory(cfg, lambda: train(cfg, fault_from_env()))
    # A SIGTERM before the trainer took it over leaves as a stop before the start (exit
    # 75, which the launcher maps back): `launch._run_reporting_errors` sees to it.
    except PartitaError as exc:
        rank = int(os.environ.get("RANK", 0))
        quiet = isinstance(exc, PeerReported) or (rank and isinstance(exc, AgreedError))
        if not quiet:
            where = f" (rank {rank})" if rank else ""
            print_line(f"partita: error{where}: {exc}")
        if isinstance(exc, PeerFailure):
            # Let the launcher see the death that caused this first: it reports one
            # failure, whichever it notices first, and this one is only a consequence.
            time.sleep(VICTIM_GRACE_S)
            raise SystemExit(PEER_FAILURE_EXIT) from None
        raise SystemExit(2) from None


def _explaining_memory(cfg: Config, run: Callable[[], dict]) -> dict:
    """`run()`, a process that runs out of device (or host) memory saying what the
    planner expects the layout to hold and what would lower it (`device_memory_advice`,
    `host_memory_advice`)."""
    try:
        return run()
    except OutOfDeviceMemory as exc:
        world_size = int(os.environ.get("WORLD_SIZE", 1))
        local_processes = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
        try:
            advice = (host_memory_advice(cfg, world_size, local_processes) if exc.on_cpu
                      else device_memory_advice(cfg, world_size, exc.device_bytes))
        except PartitaError:  # a layout the planner cannot price: torch's words suffice
            advice = ""
        raise PartitaError(f"{exc} {advice}".strip()) from None


def gpu_bytes(device_name: str) -> float | None:
    """The memory of the GPU `train.device` names (the first for "cuda" or "auto": a
    node's GPUs are alike), None without one."""
    import torch

    if not torch.cuda.is_available():
        return None
    index = int(device_name.split(":")[1]) if ":" in device_name else 0
    return float(torch.cuda.get_device_properties(index).total_memory)


def default_nproc() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 2


def run(args: argparse.Namespace) -> int:
    try:
        return _run(args)
    except Stopped as exc:
        if not (isinstance(exc, StoppedBeforeStart) or _while_starting(exc)):
            raise
        return stopped_before_start()


def stopped_before_start() -> int:
    """Say that a SIGTERM came before the first step; the exit status of a stop on
    request."""
    print("partita: stopped by SIGTERM before the first step: nothing of this run was "
          "trained or saved, and earlier checkpoints are as they were; run the same "
          "command again (with --train.resume=auto to continue from one).",
          file=sys.stderr, flush=True)
    return CHECKPOINT_STOP_EXIT


def _while_starting(exc: Stopped) -> bool:
    """Whether `exc` is a SIGTERM that came while the job was starting
    (`before_stop_request`: in the launcher, or the trainer under torchrun) and, in the
    launcher, before the workers ran (from the launch, a Stopped is the second
    SIGTERM's). Such a stop has nothing to save: a stop on request, exit 75."""
    return before_stop_request(exc) and not getattr(exc, "after_launch", False)


def _run(args: argparse.Namespace) -> int:
    cfg = with_absolute_inputs(load_config(args.config, args.overrides))
    if launched_externally():
        world = int(os.environ["WORLD_SIZE"])
        if refused := _checked_by_every_rank(lambda: check_layout_before_torch(cfg, world),
                                             speaker=int(os.environ["RANK"]) == 0):
            return refused
        with signals_held():  # a SIGTERM meanwhile arrives after, not inside torch's import
            from partita.trainer import train
        if refused := _check_memory_under_torchrun(cfg, world):
            return refused

        locks = []  # held by rank 0 until it returns, on one node (folder_lock)
        if int(os.environ["RANK"]) == 0:
            single_node = os.environ.get("LOCAL_WORLD_SIZE") == os.environ["WORLD_SIZE"]
            locks = prepare_run_dir(cfg, lock=single_node)
            print_notes(cfg)
            for note in pipeline_notes(cfg, int(os.environ["WORLD_SIZE"])):
                print(note, file=sys.stderr, flush=True)
        try:
            from partita.faults import fault_from_env

            result = _explaining_memory(cfg, lambda: train(cfg, fault_from_env()))
            return _exit_status([result], speak=int(os.environ["RANK"]) == 0)
        finally:
            for handle in filter(None, locks):
                handle.close()
    for flag, value in (("--nproc", args.nproc), ("--nnodes", args.nnodes)):
        if value is not None and value < 1:
            raise PartitaError(f"{flag} {value} is out of range: give 1 or more processes "
                               "per node and 1 or more nodes.")
    if args.max_restarts < 0:
        raise PartitaError(f"--max-restarts {args.max_restarts} must be 0 or more.")
    if args.rdzv_timeout <= 0:
        raise PartitaError(f"--rdzv-timeout {args.rdzv_timeout:g} must be positive (seconds).")
    check_before_torch(cfg, args.nproc * args.nnodes if args.nproc else None)
    print_notes(cfg)
    quiet_torch_native_warnings()
    with signals_held():  # see there: a SIGTERM meanwhile is taken after the import
        import torch.distributed  # noqa: F401  (the launch needs it)
    try:
        # The worker server is a fork of this process, torch imported (`start_worker_server`);
        # partita's own imports there run while this process checks the rest. Inside the
        # `try`: a stop taken just after its start stops it too.
        start_worker_server(WORKER_IMPORTS)
        nproc = args.nproc or default_nproc()
        from partita.process_setup import check_local_processes, pick_device_name

        # Before the run folder is prepared: a refused job leaves no folder behind.
        device = pick_device_name(cfg.train.device)
        check_local_processes(device, nproc)
        # One node's launcher holds the folders' locks for the whole job, restarts
        # included; with several nodes each prepares the folders and none locks them.
        locks = validate_before_launch(cfg, nproc * args.nnodes, local_processes=nproc,
                                       lock=args.nnodes == 1, on_cpu=device == "cpu")
        for note in pipeline_notes(cfg, nproc * args.nnodes):
            print(note, file=sys.stderr, flush=True)
        spec = LaunchSpec(nproc=nproc, nnodes=args.nnodes, rdzv_endpoint=args.rdzv_endpoint,
                          rdzv_id=args.rdzv_id, max_restarts=args.max_restarts,
                          join_timeout_s=args.rdzv_timeout, forward_sigterm=True,
                          preload=WORKER_IMPORTS,
                          tail_timeout_s=cfg.train.collective_timeout_s)
        try:
            results = launch(spec, _worker, cfg.to_toml())
        except Stopped as exc:
            exc.after_launch = True  # see run()
            raise
        finally:
            for handle in filter(None, locks):
                handle.close()
    finally:
        stop_worker_server()  # the workers are gone, or were never started
    return _exit_status(results)


def _exit_status(results: list[dict], speak: bool = True) -> int:
    """0 for a finished run; CHECKPOINT_STOP_EXIT when it stopped on request (SIGTERM,
    train.stop_after) after writing a checkpoint, said when `speak` (under torchrun,
    every rank returns here and rank 0 says it)."""
    stopped = [r for r in results if isinstance(r, dict) and r.get("stopped")]
    if not stopped:
        return 0
    if speak:
        print(f"partita: stopped after step {stopped[0]['steps']} with checkpoint "
              f"{stopped[0]['checkpoint']}; continue with --train.resume=auto (any "
              "layout).", file=sys.stderr, flush=True)
    return CHECKPOINT_STOP_EXIT


def _checked_by_every_rank(check: Callable[[], None], speaker: bool) -> int:
    """Run `check` on a rank under torchrun, where every rank runs it and refuses alike:
    0 when it passed; a refusal (PartitaError) is raised by the `speaker` only, so it is
    printed once. The others return 2 after a pause: leaving at once would let torchrun
    stop the speaker before it has said why; torchrun stops them when it has left."""
    try:
        check()
    except PartitaError:
        if speaker:
            raise
        time.sleep(OTHER_RANKS_WAIT_S)
        return 2
    return 0


def _check_memory_under_torchrun(cfg: Config, world_size: int) -> int:
    """The launcher's host memory checks (`check_host_memory` on a CPU,
    `check_offloaded_states` on GPUs) for a job that torchrun started: each node's
    processes against that node's available memory, its local rank 0 speaking. 0 when
    the job fits; see `_checked_by_every_rank`."""
    from partita.process_setup import pick_device_name

    on_cpu = pick_device_name(cfg.train.device) == "cpu"
    local_processes = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    speaker = int(os.environ.get("LOCAL_RANK", os.environ["RANK"])) == 0

    def check() -> None:
        if not on_cpu:
            check_offloaded_states(cfg, world_size, local_processes)
            note = speaker and device_memory_note(cfg, world_size, gpu_bytes(cfg.train.device))
        else:
            note = check_host_memory(cfg, world_size, local_processes)
        if note and speaker:
            print(note, file=sys.stderr, flush=True)
    return _checked_by_every_rank(check, speaker)


def check_layout_before_torch(cfg: Config, world_size: int | None) -> None:
    """The layout's checks that need no torch and read no folder (the world size's
    when it is known without asking torch for GPUs); every rank under torchrun runs
    them, so that none waits for a rank 0 that refused the layout."""
    layout = None
    if world_size is not None:
        layout = cfg.layout(world_size)
        validate(layout, cfg.model_config(), world_size,
                 seq_len=cfg.data.seq_len, global_batch=cfg.train.global_batch)
    if cfg.train.compile == "model":
        p = cfg.parallel
        # Without the world size the ZeRO group is unknown (ZeRO-3 over one rank runs
        # as stage 0, which compile=model takes): that rule waits for parallelize.
        degrees = layout or Layout(tp=p.tp, pp=p.pp, cp=p.cp, dp=max(p.dp, 1),
                                   zero_stage=p.zero_stage, recompute=p.recompute)
        if refusal := model_refusal(degrees, moe=cfg.model_config().n_experts > 0):
            raise PartitaError(refusal)


def check_before_torch(cfg: Config, world_size: int | None) -> None:
    """The checks that need no torch, run before anything imports it: a job refused for
    its layout (when the world size is known without asking torch for GPUs), its
    checkpoint or its output folder ends in a fraction of a second instead of several.
    `validate_before_launch` repeats them with the rest."""
    check_layout_before_torch(cfg, world_size)
    if cfg.train.export == "hf":  # found now, not after training
        check_exportable(cfg.model_config())
    check_run_dir(cfg)


def validate_before_launch(cfg: Config, world_size: int, local_processes: int | None = None,
                           lock: bool = True, on_cpu: bool = False) -> list:
    """Catch layout and data mistakes here, once, instead of in every process.

    Preparing the data here also means the token cache is written once per node before
    any worker starts; the workers then only open it, and its token count is checked
    against the batches here (too few for one global batch) rather than by every rank
    after launch.
    `local_processes` (this node's, default `world_size`) judge train.threads and, with
    `on_cpu`, whether the job fits in this machine's memory. Returns the run folders'
    locks (`prepare_run_dir`), which the caller holds for the job.
    """
    from partita.parallelize import check_layout
    from partita.trainer import open_dataset

    layout = cfg.layout(world_size)
    check_layout(cfg, cfg.model_config(), layout, world_size)
    if cfg.model.init_from:  # every tensor present with its shape (headers only)
        from partita.models.hf_weights import HFWeights

        HFWeights(cfg.model.init_from, cfg.model_config()).close()
    data = open_dataset(cfg)
    data.check_batches(cfg.train.global_batch)
    if (target := resume_target(cfg)) is not None:  # other data than the checkpoint's
        from partita.data.sampler import check_resumable, num_windows

        check_resumable(read_manifest(target).get("training", {}).get("sampler", {}),
                        {"num_windows": num_windows(len(data.train), cfg.data.seq_len)})
    # After the data's checks: a batch beyond the data is the mistake to name first.
    if on_cpu and (note := check_host_memory(cfg, world_size, local_processes or world_size)):
        print(note, file=sys.stderr, flush=True)
    if not on_cpu:
        check_offloaded_states(cfg, world_size, local_processes or world_size)
        if note := device_memory_note(cfg, world_size, gpu_bytes(cfg.train.device)):
            print(note, file=sys.stderr, flush=True)
    locks = prepare_run_dir(cfg, lock)
    if note := threads_note(cfg, local_processes or world_size):
        print(note, file=sys.stderr, flush=True)
    return locks
