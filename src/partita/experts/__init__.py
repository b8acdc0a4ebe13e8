"""Expert parallelism: the experts of every MoE block spread over the expert group,
tokens sent to them and back with all-to-all (see docs/expert_parallel.md)."""

from partita.experts.apply import apply_expert_parallel
from partita.experts.dispatch import ExpertParallelDispatch
from partita.experts.stats import MoERunner, moe_step_stats

__all__ = ["ExpertParallelDispatch", "MoERunner", "apply_expert_parallel", "moe_step_stats"]
