"""The training loop's checkpoints: when a step saves, what the log says of a save, and
what a failed save does (`train.checkpoint_failure`).

`Trainer` takes these from `CheckpointSteps`; they read the trainer's writer, sampler,
logger and settings. Every rank decides alike: the flags that choose a branch (a stop
request, a failed save) are or-ed over all ranks first (`_agree`).
"""

from __future__ import annotations

import time

import torch.distributed as dist

from partita.agreement import over_all_ranks
from partita.checkpoint import manifest_fields
from partita.checkpoint.resume import continues_run
from partita.errors import STOP_REQUEST, AgreedError
from partita.run_dir import run_id_for, write_run_id


class CheckpointSteps:
    """The checkpoint part of `partita.trainer.Trainer`."""

    def _start_run_id(self) -> str:
        """The run's id (`partita.run_dir.RUN_ID_FILE`), recorded in out_dir and in every
        checkpoint: the resumed checkpoint's when this run continues it, else a new one."""
        continued = None
        if self.resumed is not None and continues_run(self.cfg, self.resumed.folder):
            continued = self.resumed.training.get("run_id")
        run_id = run_id_for(continued, self.device)
        if self.is_logger:
            write_run_id(self.out_dir, run_id)
        return run_id

    def _checkpoint_after(self, step: int, last: bool) -> bool:
        """Save when due; True when the run stops here (SIGTERM, train.stop_after, or a
        failed save with train.checkpoint_failure=stop). Every rank decides alike."""
        c = self.cfg.train
        signalled, failed = self._agree([STOP_REQUEST.signum > 0, bool(self.writer.failure)])
        if failed:
            self._checkpoint_failed()
        stop = signalled or step == c.stop_after
        every = c.checkpoint_every > 0 and step % c.checkpoint_every == 0
        if stop or every or (last and c.checkpoint_every > 0):
            # A phase of its own: a rank whose earlier save hangs is then behind the
            # others, which wait for it in the copy's collectives, and they name it.
            self._enter(step, "checkpoint wait")
            self.writer.wait()  # the save before this one must have succeeded, or be handled
            self._enter(step, "checkpoint copy")
            (failed,) = self._agree([bool(self.writer.failure)])
            if failed:
                self._checkpoint_failed(must_stop=stop)
            training = {"sampler": self.sampler.state_dict(), "bad_steps": self.bad_steps,
                        "run_id": self.run_id}
            fields = manifest_fields(self.pm, training, self.cfg.to_toml(),
                                     self.cfg.layout(self.mesh.world_size))
            began = time.perf_counter()
            self.writer.save(step, self.pm, fields)
            self.checkpoint_waited += time.perf_counter() - began
            self._report_save()
        return stop and not last

    def _finish_saves(self) -> None:
        """Wait for the save in flight. It is the run's last, which no later save can
        replace, so its failure fails the run under either checkpoint_failure policy."""
        self.writer.wait()
        self._report_save()
        (failed,) = self._agree([bool(self.writer.failure)])
        if failed:
            self._checkpoint_failed(must_stop=True, final=True)

    def _report_save(self) -> None:
        """Log the newest finished save once (with async saves, during the next one)."""
        report = self.writer.last
        if report is None or report.folder is None or report.step == self._reported:
            return
        self._reported = report.step
        how = ("copied beside training" if self.cfg.train.async_checkpoint
               else "written while training waited")
        self.logger.message(
            f"checkpoint {report.folder.name}: complete {report.total_s:.2f} s after it "
            f"began ({report.nbytes / 2**20:,.1f} MiB from rank 0, {how}); training has "
            f"waited {self.checkpoint_waited:.3f} s for checkpoints so far")

    def _checkpoint_failed(self, must_stop: bool = False, final: bool = False) -> None:
        message = self.writer.failure or "another rank could not write its part"
        self.writer.failure = ""
        policy = self.cfg.train.checkpoint_failure
        if policy == "stop" or must_stop:
            what = "the run's last checkpoint" if final else "a checkpoint"
            fix = ("Free disk space or choose another train.checkpoint_dir, then resume "
                   "with --train.resume=auto")
            if final or policy == "continue":  # nothing left to train on to
                fix += " to redo the steps after the newest intact checkpoint."
            else:
                fix += ("; or set train.checkpoint_failure=continue to keep training "
                        "when a save fails.")
            raise AgreedError(f"{what} could not be saved ({message}); earlier checkpoints "
                              f"are intact. {fix}")
        self.logger.message(f"partita: warning: a checkpoint could not be saved ({message}); "
                            "training goes on (train.checkpoint_failure=continue) and "
                            "earlier checkpoints are intact.")

    def _agree(self, flags: list[bool]) -> list[bool]:
        """Flags or-ed over every rank, so that every rank takes the same branch."""
        either = over_all_ranks([float(f) for f in flags], dist.ReduceOp.MAX, self.device)
        return [v > 0 for v in either]
