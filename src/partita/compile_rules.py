"""Which layouts each `train.compile` mode can run: plain rules, no torch.

`partita.compile` refuses a layout with these sentences before launch, and the planner
(which must not import torch) asks the same to know which mode a layout would run.
"""

from __future__ import annotations

from partita.layout import Layout

MODES = ("none", "blocks", "model", "auto")


def model_refusal(layout: Layout) -> str | None:
    """Why `compile=model` cannot wrap this layout's model in one piece (None: it can)."""
    reasons = []
    if layout.pp > 1:
        reasons.append("a pipeline (pp > 1) runs the model stage by stage")
    if layout.zero_stage == 3:
        reasons.append("ZeRO-3 gathers each block's parameters in hooks on the block")
    if layout.cp > 1:
        reasons.append("context parallelism exchanges keys and values inside attention")
    if layout.recompute != "none":
        reasons.append("recomputation reruns blocks from an autograd function")
    if not reasons:
        return None
    return ("train.compile=model compiles the whole model in one piece, but "
            + "; ".join(reasons) + ". Use train.compile=blocks, which compiles each "
            "block and keeps that machinery outside the compiled code.")
