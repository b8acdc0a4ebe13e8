"""Why a `partita plan` search has nothing to show: pins that leave no layout to
search, and a request whose every layout breaks a rule; each message names the rule
and what to change."""

from __future__ import annotations

import math

from partita.errors import PartitaError
from partita.layout import Layout, default_schedule
from partita.planner.advice import fix_text
from partita.planner.evaluate import Request, layout_text, structural_reasons
from partita.planner.search import SearchResult


def no_layout_to_search(fixed: tuple[tuple[str, object], ...], req: Request) -> str:
    """Why `--fix` pins leave nothing to search."""
    n = req.cluster.num_gpus
    pins = dict(fixed)
    degrees = {k: int(v) for k, v in pins.items() if k in ("dp", "tp", "pp", "cp")}
    product = math.prod(degrees.values())
    named = " x ".join(f"{k}={v}" for k, v in degrees.items())
    if n % product or (len(degrees) == 4 and product != n):
        given = named if len(degrees) == 1 else f"{named} = {product}"
        verb, wanted = ("divide", "divides") if n % product else ("equal", "is")
        why = (f"dp x tp x pp x cp must multiply to the {n} GPUs, and {given} does not "
               f"{verb} {n}; pin degrees whose product {wanted} {n}")
    elif "ep" in pins and not req.model.is_moe:
        why = "ep applies to mixture-of-experts models, and this model has no experts"
    elif "ep" in pins:
        why = (f"ep must divide the model's {req.model.moe.num_experts} experts and "
               f"dp x cp; pin an ep among those divisors")
    elif pins.get("schedule") == "interleaved-1f1b" and int(pins.get("virtual_stages",
                                                                     2)) < 2:
        why = (f"schedule=interleaved-1f1b with virtual_stages={pins['virtual_stages']} has "
               "nothing to interleave (it would be plain 1F1B under another name); pin "
               "virtual_stages=2 or more, or schedule=1f1b")
    elif "schedule" in pins and int(pins.get("pp", 0)) == 1:
        why = (f"schedule={pins['schedule']} is a pipeline schedule, and pp=1 has no "
               "pipeline; pin pp > 1, or drop schedule")
    elif "schedule" in pins and n == math.prod(v for k, v in degrees.items() if k != "pp"):
        why = (f"schedule={pins['schedule']} needs a pipeline (pp > 1), and the pinned "
               f"degrees leave pp=1; pin fewer of them, or drop schedule")
    else:
        why = first_rule_broken(pins, req) or ("no combination of the other degrees "
                                                "completes these to a layout")
    return f"--fix {fix_text(fixed)} leaves no layout to search on {n} GPUs: {why}."


def every_layout_breaks_a_rule(result: SearchResult, fixed: tuple[tuple[str, object], ...],
                               req: Request) -> str:
    """Why a search found nothing trainable: the most common rule broken, with one
    layout that breaks it, and how many layouts each kind of rule rejected."""
    kind = result.rejected.most_common(1)[0][0]
    example = result.examples[kind][0]  # the search keeps examples of every rule kind
    reason = next(text for k, text in example.reasons if k == kind).rstrip(".")
    kinds = ", ".join(f"{k}: {n:,}" for k, n in result.rejected.most_common())
    where = (f"--fix {fix_text(fixed)} leaves no layout partita can train"
             if fixed else "this request leaves no layout partita can train")
    fix = ("change or drop the pins" if fixed
           else "change the model, --seq-len, --global-batch or --gpus")
    return (f"{where} on {req.cluster.num_gpus} GPUs: each of the {result.searched:,} "
            f"layouts searched breaks a rule ({kinds}; none was rejected for memory). "
            f"The most common ({kind}), e.g. {layout_text(example.layout)}: {reason}. "
            f"To get a plan, {fix} so that the rule holds.")


def first_rule_broken(pins: dict[str, object], req: Request) -> str | None:
    """The rule a layout of these pins breaks, the other degrees at 1 and dp taking
    the remaining GPUs."""
    rest = req.cluster.num_gpus
    for name in ("tp", "pp", "cp"):
        rest //= int(pins.get(name, 1))
    schedule = default_schedule(int(pins.get("virtual_stages", 1)))
    try:
        layout = Layout(**{"dp": rest, "schedule": schedule, **pins})
    except PartitaError as err:
        return str(err).rstrip(".")
    reasons = structural_reasons(req, layout)
    return reasons[0][1].rstrip(".") if reasons else None
