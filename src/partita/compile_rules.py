"""Which layouts each `train.compile` mode can run: plain rules, no torch.

`partita.compile` refuses a layout with these sentences before launch, and the planner
(which must not import torch) asks the same to know which mode a layout would run.
"""

from __future__ import annotations

from partita.layout import Layout

MODES = ("none", "blocks", "model", "auto")


def model_refusal(layout: Layout, moe: bool = False) -> str | None:
    """Why `compile=model` cannot wrap this layout's model in one piece (None: it can);
    `moe`: the model has mixture-of-experts blocks.

    Recomputation is allowed where what it reruns traces whole: inside the compiled
    model a recomputed block or attention core is a checkpoint region, which the
    compiler reruns in backward (`memory.recompute`). The attention core always does;
    a whole block does unless it holds eager pieces (tensor parallelism's collectives,
    the expert dispatch), which torch's checkpoint would rerun eagerly, counting an MoE
    block's routing statistics twice and drawing tensor-parallel dropout from the wrong
    generator state. So full recomputation is refused there, selective is not."""
    reasons = []
    if layout.pp > 1:
        reasons.append("a pipeline (pp > 1) runs the model stage by stage")
    if layout.zero_stage == 3 and layout.zero_group > 1:  # one rank: runs as stage 0
        reasons.append("ZeRO-3 gathers each block's parameters in hooks on the block")
    if layout.cp > 1:
        reasons.append("context parallelism exchanges keys and values inside attention")
    if layout.recompute == "full" and (layout.tp > 1 or moe):
        where = " and ".join((["tensor parallelism's collectives"] if layout.tp > 1 else [])
                             + (["the expert dispatch"] if moe else []))
        reasons.append(f"full recomputation would rerun {where}, which stay eager, "
                       "inside the compiled model (recompute=selective can)")
    if not reasons:
        return None
    return ("train.compile=model compiles the whole model in one piece, but "
            + "; ".join(reasons) + ". Use train.compile=blocks, which compiles each "
            "block and keeps that machinery outside the compiled code.")
