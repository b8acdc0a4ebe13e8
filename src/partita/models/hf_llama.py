"""Hugging Face `transformers` Llama as a partita model: its plan, written once.

    model, plan = llama_model(LlamaConfig(...), seed=0)       # on the meta device
    pm = parallelize(model, plan, cfg, mesh, device)

`LlamaCausalLM` holds the modules of a `LlamaForCausalLM` in the layout partita's plan
reads: the decoder layers in an index-keyed ModuleDict (`layers.0`, `layers.1`, ...,
names that stay the same when a pipeline stage drops the others), the embedding apart
from the final norm and head. The attention, MLP, norm, rotary and decoder-layer code
that runs is transformers' own; this module only calls it in order.

Each attention module gets its rotary position embeddings (and, for the eager
attention, its causal mask) from a forward pre-hook rather than as an argument from the
caller. A pipeline stage then runs a layer with the hidden states alone, and under
sequence parallelism the hook runs after the tensor-parallel region entry, so it sees
the whole sequence.

Initial weights are drawn by partita's rules from each parameter's global name (as for
partita's own transformer: normal(initializer_range), residual projections scaled by
1/sqrt(2 * layers), norms one), not by transformers' init, so every layout and a
single process start from identical values.

Not supported yet (raises PartitaError): tied input/output embeddings, a padding token
(its embedding row gets no gradient in transformers but would under a vocabulary-sharded
embedding), a head_dim other than hidden_size / num_attention_heads.
"""

from __future__ import annotations

import math
from functools import partial

import torch
import torch.nn as nn
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from partita.errors import PartitaError
from partita.models import plan as roles
from partita.models.model_config import ModelConfig
from partita.models.param_init import InitRule, ParamInit


class LlamaCausalLM(nn.Module):
    """tokens (b, s) -> logits (b, s, vocab) with a LlamaForCausalLM's modules.

    A pipeline stage may hold only some layers (the rest deleted from `layers`) and no
    embedding or head (set to None); forward then maps hidden states.
    """

    def __init__(self, hf: LlamaForCausalLM) -> None:
        super().__init__()
        config = hf.config
        check_config(config)
        self.config = config
        self.embed_tokens: nn.Module | None = hf.model.embed_tokens
        self.layers = nn.ModuleDict({str(i): layer for i, layer in enumerate(hf.model.layers)})
        self.norm: nn.Module | None = hf.model.norm
        self.lm_head: nn.Module | None = hf.lm_head
        # Not a child module: its inv_freq buffer is a constant of the config, built on
        # the CPU, which meta-device builds, to_empty and dtype casts must not touch.
        with torch.device("cpu"):
            self._rotary = (LlamaRotaryEmbedding(config=config),)
        eager = getattr(config, "_attn_implementation", None) in (None, "eager")
        for layer in self.layers.values():
            layer.self_attn.register_forward_pre_hook(
                partial(_attention_inputs, self._rotary[0], eager), with_kwargs=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embed_tokens is not None:
            x = self.embed(x)
        for layer in self.layers.values():
            x = layer(x)
        return self.head(x) if self.lm_head is not None else x

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(tokens)

    def head(self, h: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(h))


def _attention_inputs(rotary: LlamaRotaryEmbedding, eager: bool, module: nn.Module,
                      args: tuple, kwargs: dict):
    """Fill in the attention's position embeddings (and eager causal mask) if absent."""
    h = kwargs.get("hidden_states", args[0] if args else None)
    extra = {}
    if kwargs.get("position_embeddings") is None:
        positions = torch.arange(h.shape[1], device=h.device)[None]
        extra["position_embeddings"] = rotary(h, positions)
    if eager and kwargs.get("attention_mask") is None:
        s = h.shape[1]
        upper = torch.ones(s, s, dtype=torch.bool, device=h.device).triu(1)
        mask = torch.zeros(s, s, dtype=h.dtype, device=h.device)
        extra["attention_mask"] = mask.masked_fill(upper, torch.finfo(h.dtype).min)[None, None]
    return (args, {**kwargs, **extra}) if extra else None


def check_config(config: LlamaConfig) -> None:
    problems = []
    if config.tie_word_embeddings:
        problems.append("tied input/output embeddings (set tie_word_embeddings=False)")
    if config.pad_token_id is not None:
        problems.append("a padding token (set pad_token_id=None)")
    head_dim = getattr(config, "head_dim", None)
    if head_dim not in (None, config.hidden_size // config.num_attention_heads):
        problems.append(f"head_dim={head_dim} other than hidden_size / num_attention_heads")
    if problems:
        raise PartitaError("partita's Llama adapter does not support " + "; ".join(problems)
                           + " yet.")


def llama_shape(config: LlamaConfig, seed: int = 0) -> ModelConfig:
    """The Llama's shape in partita's terms (what layout checks and pipelines read)."""
    rope = getattr(config, "rope_parameters", None) or {}
    return ModelConfig(
        vocab_size=config.vocab_size, dim=config.hidden_size,
        n_layers=config.num_hidden_layers, n_heads=config.num_attention_heads,
        n_kv_heads=config.num_key_value_heads, ffn_dim=config.intermediate_size,
        max_seq_len=config.max_position_embeddings, flavour="llama",
        tie_embeddings=bool(config.tie_word_embeddings),
        rope_theta=float(rope.get("rope_theta", 10000.0)), norm_eps=config.rms_norm_eps,
        init_std=config.initializer_range, seed=seed)


def llama_init_rule(config: LlamaConfig, name: str) -> InitRule:
    """How parameter `name` (a global name such as 'layers.3.mlp.down_proj.weight') is drawn."""
    if name.endswith(".bias"):
        return InitRule("zeros")
    if name.endswith("norm.weight"):
        return InitRule("ones")
    if name.endswith(("self_attn.o_proj.weight", "mlp.down_proj.weight")):
        # Residual projections, scaled as in partita's transformer (GPT-2's rule).
        return InitRule("normal",
                        config.initializer_range / math.sqrt(2 * config.num_hidden_layers))
    return InitRule("normal", config.initializer_range)


def llama_plan(config: LlamaConfig, seed: int = 0) -> roles.ModelPlan:
    """Which of LlamaCausalLM's modules play which parallel role."""
    table = {f"layers.*.self_attn.{n}_proj": roles.COLWISE for n in ("q", "k", "v")}
    table["layers.*.self_attn.o_proj"] = roles.ROWWISE
    table.update({f"layers.*.mlp.{n}_proj": roles.COLWISE for n in ("gate", "up")})
    table["layers.*.mlp.down_proj"] = roles.ROWWISE
    table["embed_tokens"] = roles.VOCAB_EMBEDDING
    table["lm_head"] = roles.VOCAB_HEAD
    table.update({"layers.*.input_layernorm": roles.NORM,
                  "layers.*.post_attention_layernorm": roles.NORM, "norm": roles.NORM})
    return roles.ModelPlan(roles=table, blocks="layers", embedding="embed_tokens",
                           head=("norm", "lm_head"),
                           init=ParamInit(partial(llama_init_rule, config), seed),
                           shape=llama_shape(config, seed))


def llama_model(config: LlamaConfig, seed: int = 0,
                device: str | torch.device = "meta") -> tuple[LlamaCausalLM, roles.ModelPlan]:
    """A LlamaCausalLM of `config` and its plan; on "meta" (for `parallelize`) or, on a
    real device, with its parameters drawn by the plan's init rule (float32)."""
    check_config(config)
    with torch.device("meta"):
        model = LlamaCausalLM(LlamaForCausalLM(config))
    plan = llama_plan(config, seed)
    if str(device) != "meta":
        model.to_empty(device=device)
        with torch.no_grad():
            for name, param in model.named_parameters():
                param.copy_(plan.init.full(name, tuple(param.shape)))
    return model, plan
