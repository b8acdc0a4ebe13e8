"""The planner: memory, communication and step time of a layout from model shapes and a
hardware description alone (no process group, no GPU), and a search for the best one.

Modules, one concept each: `layout` (a point of the space, precision), `assumptions`
(every modelling constant), `hardware` (GPU catalog, clusters), `cpu_profile` (this
machine), `model_shape` (parameter counts per rank), `stage_params` (what a pipeline
stage holds), `zero_buffers` (ZeRO's flat buffers and gather units), `activations`
(saved-for-backward bytes per layer), `memory` (per-GPU breakdown), `compute` (each
kernel's time from its shape), `timing` (step time), `evaluate` (one layout judged),
`search` (all layouts ranked), `advice` (what would fit), `report`.
"""

from partita.layout import Layout, parse_layout
from partita.planner.activation_memory import korthikanti_layer_bytes, layer_activation_terms
from partita.planner.advice import advise_layout, advise_search
from partita.planner.api import evaluate_layout, make_request, plan
from partita.planner.assumptions import Assumptions
from partita.planner.evaluate import Evaluation, Request, evaluate
from partita.planner.hardware import GPUS, Cluster, GPUSpec, get_gpu, load_gpu_profiles
from partita.planner.memory import (
    activation_bytes,
    comm_buffer_bytes,
    memory_breakdown,
    model_state_bytes,
    zero_state_bytes,
)
from partita.planner.model_shape import MoEShape, PlanModel, parse_model_shape, resolve_model
from partita.planner.precision import Precision
from partita.planner.search import SearchResult, SearchSpace, search
from partita.planner.timing import step_time

__all__ = [
    "GPUS", "Assumptions", "Cluster", "Evaluation", "GPUSpec", "Layout", "MoEShape",
    "PlanModel", "Precision", "Request", "SearchResult", "SearchSpace", "activation_bytes",
    "advise_layout", "advise_search", "comm_buffer_bytes", "evaluate", "evaluate_layout",
    "get_gpu", "korthikanti_layer_bytes", "layer_activation_terms", "load_gpu_profiles",
    "make_request", "memory_breakdown", "model_state_bytes", "parse_layout",
    "parse_model_shape", "plan",
    "resolve_model", "search", "step_time", "zero_state_bytes",
]
