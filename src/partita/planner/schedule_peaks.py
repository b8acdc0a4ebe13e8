"""What one pipeline stage holds at its fullest, walked along its schedule's order.

The activation model (`planner.memory.activation_bytes`) knows what one microbatch
keeps per layer; these functions say how many microbatches (and which of their parts)
a stage of a given schedule holds at once: ZB-H1 in closed form, interleaved 1F1B with
a partial recompute unit by unit.
"""

from __future__ import annotations

from partita.layout import Layout


def zero_bubble_peak(pp: int, num_microbatches: int, stage: int, whole: float,
                     deferred: float) -> float:
    """The most a ZB-H1 stage holds, when a microbatch costs `whole` from F to I and
    `deferred` from I to W (after each F, and after each I: deferred may exceed whole).

    Closed form of `partita.pipeline.schedules.zb_h1_order` (the search evaluates it
    for every layout; a test walks the real schedule against it): stage r runs
    w = min(pp - r - 1, m) warm-up forwards, then F, I pairs, and lets r microbatches
    wait for W. After I(i), min(w, m - 1 - i) are running and min(i + 1, r + 1)
    waiting; after a steady-state F, w + 1 running and up to r waiting.
    """
    m, r = num_microbatches, stage
    w = min(pp - r - 1, m)
    if m <= w:  # every forward is warm-up: all m run at once
        after_f = m * whole
    else:
        after_f = (w + 1) * whole + min(m - 1 - w, r) * deferred
    # After I(i): linear in i between these points, so its maximum is at one of them.
    points = {min(max(i, 0), m - 1) for i in (0, r, m - 1 - w, m - 1)}
    after_i = max(min(w, m - 1 - i) * whole + min(i + 1, r + 1) * deferred for i in points)
    return max(after_f, after_i)


def zero_bubble_after_forward(pp: int, num_microbatches: int, stage: int, whole: float,
                              deferred: float) -> float:
    """What a ZB-H1 stage holds after its fullest forward (see `zero_bubble_peak`)."""
    m, r = num_microbatches, stage
    w = min(pp - r - 1, m)
    if m <= w:
        return m * whole
    return (w + 1) * whole + min(m - 1 - w, r) * deferred


def interleaved_peak(layout: Layout, num_microbatches: int, stage: int, layers: int,
                     k: int, per_recomputed: float, per_kept: float, rerun: float,
                     loss_side: float, ids: float, bias: float, released: float) -> float:
    """The most an interleaved 1F1B stage holds when only its first `k` of `layers`
    layers rerun, walked unit by unit in `pipeline.schedules.interleaved_order`'s order.

    Chunk c of the stage holds its share of the layers (an even split, the first chunks
    taking the remainder), and of the rank's first k blocks those that fall in it: a
    microbatch of chunk c keeps `per_recomputed` per rerun layer and `per_kept` per other
    layer from its forward to its backward. Its backward releases the chunk's later,
    kept layers (and, selective, `released`) before its last rerun layer runs, which
    adds `rerun`. The first stage keeps each chunk-0 microbatch's token ids; the last
    holds one microbatch's `loss_side` from its last chunk's forward to its backward."""
    pp, v, m = layout.pp, layout.virtual_stages, num_microbatches
    first, last = stage == 0, stage == pp - 1
    base, extra = divmod(layers, v)
    sizes = [base + (c < extra) for c in range(v)]
    starts = [sum(sizes[:c]) for c in range(v)]
    redo = [min(max(k - starts[c], 0), sizes[c]) for c in range(v)]
    held = [r * per_recomputed + (n - r) * per_kept + (bias if r else 0.0)
            + (ids if first and c == 0 else 0.0)
            for c, (n, r) in enumerate(zip(sizes, redo))]
    total_units = m * v
    warmup = min((pp - stage - 1) * 2 + (v - 1) * pp, total_units)
    now = peak = 0.0

    def forward(unit: int) -> None:
        nonlocal now, peak
        c = (unit // pp) % v
        now += held[c]
        peak = max(peak, now + (loss_side if last and c == v - 1 else 0.0))

    def backward(unit: int) -> None:
        nonlocal now, peak
        c = v - 1 - (unit // pp) % v
        if redo[c] and rerun:
            peak = max(peak, now - (sizes[c] - redo[c]) * per_kept - released + rerun)
        now -= held[c]

    for unit in range(warmup):
        forward(unit)
    for j in range(total_units - warmup):
        forward(warmup + j)
        backward(j)
    for j in range(total_units - warmup, total_units):
        backward(j)
    return peak
