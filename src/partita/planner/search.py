"""Enumerate every layout of a request, judge each, rank the ones that fit.

The space is dp x tp x pp x cp x ep (product = GPUs) x ZeRO stage x virtual stages x
schedule x microbatch size x recompute x offload; by default only the options
`partita train` runs (`SearchSpace`), and every layout ranked passes `partita.layout`'s
rules. Three prunings keep a 16k-GPU search to
seconds without losing a valid layout:

* structural: degrees that break divisibility (or a support constraint) are rejected
  once, with every inner combination counted under the same reason;
* model states: if parameters, gradients and optimizer states alone overflow a GPU,
  no microbatch or recompute choice can help, so the inner loops are skipped;
* monotonicity: activation memory only grows with the microbatch and shrinks with
  recompute, so once full recompute at microbatch b overflows, larger b are skipped.

And two shortcuts that change no result: the terms a layout shares with its neighbours
(activations with every ZeRO stage and offload, model states with every microbatch and
schedule, ...) are computed once (`planner.memo`), and only the layouts the result
keeps (ranked, modelled, shown as examples) are timed: a step time never decides
whether a layout fits.
"""

from __future__ import annotations

import bisect
import itertools
import time
from collections import Counter
from dataclasses import dataclass, field

from partita.layout import (
    DEGREES,
    MOE_TP,
    OFFLOAD,
    RECOMPUTE,
    Layout,
    default_schedule,
    divisors,
)
from partita.planner.evaluate import (
    CONSTRAINT,
    DIVISIBILITY,
    MEMORY,
    UNAVAILABLE,
    Evaluation,
    Request,
    add_step_time,
    evaluate,
    structural_reasons,
)
from partita.planner.memo import memoising
from partita.planner.memory import model_state_bytes, peak_stages
from partita.planner.stage_params import stage_layers


@dataclass(frozen=True)
class SearchSpace:
    """Which options the search tries (narrow it to pin a choice).

    By default only what `partita train` runs, less what a default answer rarely needs.
    Expert parallelism (mixture-of-experts models) is searched. Context parallelism runs
    and is modelled (checked by `bench plan-accuracy`) but is searched only when asked
    for (`--fix cp=N`, `SearchSpace.everything()`), as it pays off for long sequences;
    offload runs but trades step time for memory the default answers do not need (when
    nothing fits, `advise_search` tries it). `SearchSpace.everything()` adds both; what
    partita cannot train yet (tensor-parallel overlap) is judged and shown as
    rejected, "not available yet", never ranked.
    """

    zero_stages: tuple[int, ...] = (0, 1, 2, 3)
    recompute: tuple[str, ...] = RECOMPUTE
    offload: tuple[str, ...] = ("none",)
    schedules: tuple[str, ...] = ("1f1b", "interleaved-1f1b", "zb-h1")
    max_microbatch: int = 16
    max_virtual_stages: int = 8
    context_parallel: bool = False  # search cp > 1
    expert_parallel: bool = True  # search ep > 1 (mixture-of-experts models)
    # Context-parallel chunks shorter than this are all latency: not worth searching.
    min_tokens_per_cp_rank: int = 512
    # Layout fields pinned to one value (`partita plan --fix tp=8,pp=8`): only layouts
    # with these values are searched. Pairs of (field name, value).
    fixed: tuple[tuple[str, object], ...] = ()

    def allows(self, name: str, value: object) -> bool:
        return all(v == value for k, v in self.fixed if k == name)

    def pinned(self, name: str, default: object) -> object:
        return next((v for k, v in self.fixed if k == name), default)

    @classmethod
    def everything(cls) -> SearchSpace:
        """Every option the planner models, including those partita does not train yet."""
        return cls(recompute=RECOMPUTE, offload=OFFLOAD, context_parallel=True,
                   expert_parallel=True)


DEFAULT_SPACE = SearchSpace()  # immutable, shared as a default argument


@dataclass
class SearchResult:
    request: Request
    ranked: list[Evaluation]  # layouts that fit, fastest first
    # Layouts that would fit but use options `partita train` does not run yet (TP
    # overlap, MoE blocks with sp or cp), fastest first: the model's answer for such runs.
    modelled: list[Evaluation] = field(default_factory=list)
    rejected: Counter = field(default_factory=Counter)  # kind -> layouts
    examples: dict[str, list[Evaluation]] = field(default_factory=dict)  # kind -> a few
    searched: int = 0
    seconds: float = 0.0

    @property
    def best(self) -> Evaluation | None:
        return self.ranked[0] if self.ranked else None


def default_sequence_parallel(tp: int) -> bool:
    """Sequence parallelism whenever tensor parallelism is on (MoE blocks included: they
    compute on the gathered sequence, `partita.tensor_parallel.moe`)."""
    return tp > 1


def search(req: Request, space: SearchSpace = DEFAULT_SPACE, keep_examples: int = 3) -> SearchResult:
    """Every layout of `req` judged; the fitting ones ranked by step time."""
    start = time.perf_counter()
    with memoising():
        result = _search(req, space, keep_examples)
    result.seconds = time.perf_counter() - start
    return result


def _search(req: Request, space: SearchSpace, keep_examples: int) -> SearchResult:
    result = SearchResult(req, [])
    n = req.cluster.num_gpus
    closest: list[float] = []  # how far each memory example is from fitting, ascending

    def reject(kind: str, ev: Evaluation | None, count: int) -> None:
        if not count:  # a base with no inner options stands for no layout: nothing to say
            return
        result.rejected[kind] += count
        result.searched += count
        if ev is None:
            return
        examples = result.examples.setdefault(kind, [])
        if kind == MEMORY:  # keep the closest misses (after those as close, kept first)
            miss = _overshoot(req, ev)
            at = bisect.bisect_right(closest, miss)
            if at >= keep_examples:
                return
            closest.insert(at, miss)
            examples.insert(at, ev)
            del closest[keep_examples:], examples[keep_examples:]
        elif len(examples) < keep_examples:
            examples.append(ev)
        else:
            return
        add_step_time(req, ev)  # shown, so timed (rejected ones are judged untimed)

    mbs = [b for b in (1, 2, 4, 8, 16, 32, 64) if b <= space.max_microbatch]
    mbs = [b for b in mbs if space.allows("microbatch_size", b)] or \
        [int(space.pinned("microbatch_size", 1))]
    experts = req.model.moe.num_experts
    ok = space.allows
    any_cp = space.context_parallel or any(k == "cp" for k, _ in space.fixed)
    any_ep = space.expert_parallel or any(k == "ep" for k, _ in space.fixed)
    # Every pin the loops below do not vary is the base's, so that no pin is dropped and
    # the layouts shown (rejected examples, the closest) carry the pinned values; the
    # inner loop varies the schedule, virtual stages, microbatch and recompute, from
    # these pinned values when pinned.
    looped = {*DEGREES, "zero_stage", "offload", "moe_tp", "sequence_parallel"}
    base_pins = {k: v for k, v in space.fixed if k not in looped}
    if "recompute_layers" in base_pins and "recompute" not in base_pins:
        base_pins["recompute"] = "full"  # a count of blocks to recompute needs recompute
    if "virtual_stages" in base_pins and "schedule" not in base_pins:
        base_pins["schedule"] = default_schedule(int(base_pins["virtual_stages"]))

    def interleaved_base(pp: int) -> dict[str, int]:
        """A pinned interleaved-1f1b's base has the fewest virtual stages it runs with
        (the inner loop varies them from there), not 1, which it is refused with."""
        if (pp > 1 and base_pins.get("schedule") == "interleaved-1f1b"
                and "virtual_stages" not in base_pins):
            return {"virtual_stages": 2}
        return {}

    for tp in [d for d in divisors(n) if ok("tp", d)]:
        for cp in divisors(n // tp) if any_cp else [1]:
            if not ok("cp", cp) or (cp > 1 and req.seq_len / cp < space.min_tokens_per_cp_rank
                                    and not space.fixed):
                continue
            for pp in [d for d in divisors(n // (tp * cp)) if ok("pp", d)]:
                dp = n // (tp * cp * pp)
                if not ok("dp", dp):
                    continue
                for ep in divisors(experts) if req.model.is_moe and any_ep else [1]:
                    if (dp * cp) % ep or not ok("ep", ep):
                        continue
                    inner = _inner_options(req, space, pp, dp, mbs)
                    size = len(inner) * len(space.recompute)
                    # MoE blocks under tp: experts replicated over tp, or split between
                    # the tp ranks (partita.tensor_parallel.moe).
                    moe_tps = ([m for m in MOE_TP if ok("moe_tp", m)]
                               if req.model.is_moe and tp > 1
                               else [space.pinned("moe_tp", MOE_TP[0])])
                    for zero, offload, moe_tp in itertools.product(
                            [z for z in space.zero_stages if ok("zero_stage", z)],
                            [o for o in space.offload if ok("offload", o)], moe_tps):
                        if (zero > 0 and dp * cp == 1 and not space.fixed
                                and not (zero == 3 and "+params" in offload)):
                            # Identical to zero=0 with nothing to shard over; only
                            # stage 3 can keep the parameters off the GPU.
                            continue
                        base = Layout(dp=dp, tp=tp, pp=pp, cp=cp, ep=ep, zero_stage=zero,
                                      offload=offload, moe_tp=moe_tp, sequence_parallel=bool(
                                          space.pinned("sequence_parallel",
                                                       default_sequence_parallel(tp))),
                                      **base_pins, **interleaved_base(pp))
                        reasons = structural_reasons(req, base)
                        # Options partita cannot train yet are judged in full only
                        # when pinned (--fix); otherwise counted here, unevaluated.
                        if reasons and (not space.fixed or any(
                                k != UNAVAILABLE for k, _ in reasons)):
                            kind = reasons[0][0]
                            ev = Evaluation(base, reasons, capacity=req.cluster.gpu.memory_bytes)
                            reject(kind, ev, size)
                            continue
                        if _states_overflow(req, base):
                            ev = evaluate(req, base.with_(recompute="full"), timed=False)
                            reject(MEMORY, ev, size)
                            continue
                        _search_inner(req, space, base, inner, result, reject)
    # Equal predictions (cp and mb trade one for one) prefer fewer parallel dimensions,
    # and less recomputation (selective under cp reruns nothing: it ties with none).
    for evals in (result.ranked, result.modelled):
        evals.sort(key=lambda e: (float(f"{e.time['step_s']:.6g}"), round(e.memory["total"]),
                                  e.layout.cp, e.layout.ep, e.layout.pp,
                                  e.layout.virtual_stages, RECOMPUTE.index(e.layout.recompute)))
    return result


def _overshoot(req: Request, ev: Evaluation) -> float:
    """How far a layout is from fitting: the larger of its GPU memory over the GPU's
    and its offloaded host memory over a node's."""
    host = req.cluster.gpu.host_memory_per_node
    return max(ev.memory.get("total", 0.0) / ev.capacity,
               ev.host_bytes_per_node / host if host else 0.0)


def _inner_options(req: Request, space: SearchSpace, pp: int, dp: int,
                   mbs: list[int]) -> list[tuple[int, str, int]]:
    """(virtual stages, schedule, microbatch size) triples worth trying for these degrees."""
    options = []
    per_replica = req.global_batch // dp if req.global_batch % dp == 0 else 0
    valid_mbs = [b for b in mbs if per_replica and per_replica % b == 0] or mbs[:1]
    if pp == 1:
        scheds = [(1, "1f1b")]
    else:
        fewest = min(stage_layers(req.model.config.n_layers, pp))
        scheds = [(1, s) for s in space.schedules if s in ("1f1b", "zb-h1", "gpipe")]
        if "interleaved-1f1b" in space.schedules:
            # Uneven chunks train too, but an even split is the one worth ranking; a
            # pinned count is searched as given while every chunk keeps a block.
            pinned = int(space.pinned("virtual_stages", 0))
            scheds += [(v, "interleaved-1f1b")
                       for v in range(2, min(space.max_virtual_stages, fewest) + 1)
                       if fewest % v == 0 or v == pinned]
    for vpp, sched in scheds:
        if space.allows("virtual_stages", vpp) and space.allows("schedule", sched):
            options += [(vpp, sched, b) for b in valid_mbs]
    return options


def _states_overflow(req: Request, layout: Layout) -> bool:
    """Model states plus the fixed reserve alone exceed the GPU on some stage."""
    a = req.assumptions
    for stage in peak_stages(layout.pp):
        states = sum(model_state_bytes(req.model, layout, req.precision, stage,
                                       req.assumptions).values())
        if states * (1 + a.fragmentation) + req.cluster.gpu.runtime_reserved_bytes > req.cluster.gpu.memory_bytes:
            return True
    return False


def _search_inner(req, space, base: Layout, inner, result: SearchResult, reject) -> None:
    # Recompute from most to least memory-saving: when the most saving overflows, the
    # others do too; microbatches ascending: when the smallest overflows, larger do too.
    order = [r for r in ("full", "selective", "none")
             if r in space.recompute and space.allows("recompute", r)]
    by_schedule: dict[tuple[int, str], list[int]] = {}
    for vpp, sched, mb in inner:
        by_schedule.setdefault((vpp, sched), []).append(mb)
    fields = base.to_dict()  # `base.with_(...)` below, without its walk over the fields
    for (vpp, sched), mbs in by_schedule.items():
        for i, mb in enumerate(mbs):
            overflow_all = False
            for j, rc in enumerate(order):
                layout = Layout(**{**fields, "virtual_stages": vpp, "schedule": sched,
                                   "microbatch_size": mb, "recompute": rc})
                ev = evaluate(req, layout, timed=False)
                if ev.fits:
                    result.ranked.append(add_step_time(req, ev))
                    result.searched += 1
                    continue
                kind = ev.reasons[0][0]
                if kind != MEMORY:
                    if all(k == UNAVAILABLE for k, _ in ev.reasons):
                        result.modelled.append(add_step_time(req, ev))
                    reject(kind, ev, 1)
                    continue
                # More memory-hungry recompute choices overflow as well.
                reject(MEMORY, ev, len(order) - j)
                overflow_all = j == 0
                break
            if overflow_all:
                reject(MEMORY, None, (len(mbs) - i - 1) * len(order))
                break


__all__ = ["CONSTRAINT", "DEFAULT_SPACE", "DIVISIBILITY", "MEMORY", "UNAVAILABLE", "SearchResult",
           "SearchSpace", "search"]
