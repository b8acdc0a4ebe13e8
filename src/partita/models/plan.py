"""A model's parallel plan: which of its modules play which role.

Parallel code reads a model only through this plan, so the model stays plain
single-device PyTorch and any model can be parallelised by writing its plan.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field

import torch.nn as nn

from partita.errors import PartitaError
from partita.models.model_config import ModelConfig
from partita.models.param_init import ParamInit

# Roles a module can play.
# A colwise layer and the rowwise layer that adds its split outputs up again are children
# of one module (an attention, an MLP), and every Linear of that module has one of the two.
COLWISE = "colwise"  # Linear split along its output features
ROWWISE = "rowwise"  # Linear split along its input features
VOCAB_EMBEDDING = "vocab_embedding"  # Embedding split along the vocabulary
VOCAB_HEAD = "vocab_head"  # output Linear split along the vocabulary (logits stay sharded)
NORM = "norm"  # replicated; under sequence parallelism its input is sequence-sharded
# A learned position embedding called with positions (0..seq): replicated; under
# sequence parallelism it returns only this rank's sequence slice.
POSITIONS = "positions"
# A parameter-free module called as core(q, k, v): attention scores, softmax (and any
# dropout on them) and the product with V. Selective recomputation reruns it in backward.
ATTENTION_CORE = "attention_core"
# A mixture-of-experts feed-forward (partita.models.moe.MoE): expert parallelism spreads
# its stacked experts over the expert group and swaps its token dispatch for all-to-all.
MOE = "moe"
ROLES = (COLWISE, ROWWISE, VOCAB_EMBEDDING, VOCAB_HEAD, NORM, POSITIONS, ATTENTION_CORE, MOE)


@dataclass(frozen=True)
class ModelPlan:
    """Module-name patterns (fnmatch, '*' matches one or more name parts) -> role."""

    roles: dict[str, str] = field(default_factory=dict)
    blocks: str = "blocks"  # the index-keyed ModuleDict that pipelines split
    embedding: str | None = "tok_embeddings"  # lives on the first pipeline stage
    head: tuple[str, ...] = ("norm", "output")  # live on the last pipeline stage
    # Tied embeddings: the attribute (None on the model) of the output head that reuses
    # the embedding's weight; tensor parallelism builds it from the vocab-parallel
    # embedding. None: untied.
    tied_head: str | None = None
    # How every parameter is drawn, by global name. Required to build the model on the
    # meta device: each rank then draws only its own shards. None: the model arrives
    # with its values (not on meta) and parallel code slices them.
    init: ParamInit | None = None
    # The model's shape (widths, depth, heads, vocabulary, tied embeddings): what layout
    # checks, pipeline balance and the stage-to-stage activation size read. None only for
    # models that run no layout needing it.
    shape: ModelConfig | None = None

    def role_of(self, module_name: str) -> str | None:
        for pattern, role in self.roles.items():
            if fnmatch.fnmatchcase(module_name, pattern):
                return role
        return None

    def block_container(self, model: nn.Module) -> nn.ModuleDict:
        """The model's blocks (`blocks`); PartitaError when it names no ModuleDict, which
        every layout reads the blocks from (ZeRO-3 units, recomputation, compilation,
        pipeline stages)."""
        try:
            container: nn.Module | None = model.get_submodule(self.blocks)
        except AttributeError:
            container = None
        if isinstance(container, nn.ModuleDict):
            return container
        found = "nothing" if container is None else f"a {type(container).__name__}"
        hint = (" (an nn.ModuleList: wrap its blocks as nn.ModuleDict({str(i): block for "
                "i, block in enumerate(blocks)}) and iterate .values() in forward)"
                if isinstance(container, nn.ModuleList) else "")
        raise PartitaError(
            f"the model's plan names its blocks {type(model).__name__}.{self.blocks} "
            f"(ModelPlan.blocks), but there is {found} there{hint}. Keep the blocks in an "
            "nn.ModuleDict with keys '0'..'n-1' and give its attribute name as "
            "ModelPlan.blocks.")

    def block_names(self, model: nn.Module) -> list[str]:
        return [f"{self.blocks}.{key}" for key in self.block_container(model).keys()]


def shared_parameters(model: nn.Module) -> list[list[str]]:
    """The names of each parameter reachable under more than one name (one tensor
    shared by several modules, as `head.weight = embedding.weight` ties them), in
    registration order; [] when every parameter has one name."""
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    return [group for group in names.values() if len(group) > 1]
