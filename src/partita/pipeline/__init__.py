"""Pipeline schedules as pure data: generate, validate, simulate, print, draw.

Runtime contract — what a rank does for each action of its list, strictly in order:

- F s.m: run stage s forward on microbatch m. Its input is the microbatch itself
  (stage 0), the output of F(s-1).m on this rank, or the tensor of RF(s-1).m.
  On the last stage F also computes the loss.
- B s.m: full backward of stage s for microbatch m (input and weight gradients).
  Its output gradient comes from the loss (last stage), from B/I(s+1).m on this rank,
  or from RB(s+1).m. Activations of (s, m) may be freed afterwards.
- I s.m: input-gradient half of B only; keep what W needs.
- W s.m: weight-gradient half; after it (s, m) holds nothing more.
- SF s.m: post a non-blocking send of F s.m's output to the rank of stage s+1;
  SB s.m: the same for the gradient made by B/I s.m, to the rank of stage s-1.
  A send never blocks the rank: keep the tensor alive until the send completes and
  wait for all outstanding sends before the step ends (or before reusing the buffer).
- RF s.m / RB s.m: receive that tensor from the peer; the rank blocks until it has
  arrived. Sends and receives carry the *producer's* stage, so SF3.1 matches RF3.1.

A runtime may post a maximal run of consecutive SEND/RECV actions as one
`batch_isend_irecv` and wait only for the receives in it; posting a receive earlier
than listed is also safe. `validate` proves, by simulating exactly this contract,
that no rank waits forever and that every pass finds its input.
"""

from partita.pipeline.actions import Action, Kind, Schedule, ScheduleError, parse_actions
from partita.pipeline.render import draw_timeline, format_grid, legend, summary
from partita.pipeline.schedules import build_schedule, schedule_names
from partita.pipeline.simulate import (
    Costs,
    Timeline,
    in_flight_peaks,
    rank_in_flight_peak,
    simulate,
)
from partita.pipeline.split import split_blocks
from partita.pipeline.validate import find_problems, validate

__all__ = [
    "Action",
    "Costs",
    "Kind",
    "Schedule",
    "ScheduleError",
    "Timeline",
    "build_schedule",
    "draw_timeline",
    "find_problems",
    "format_grid",
    "in_flight_peaks",
    "legend",
    "parse_actions",
    "rank_in_flight_peak",
    "schedule_names",
    "simulate",
    "split_blocks",
    "summary",
    "validate",
]
