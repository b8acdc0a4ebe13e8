"""A single-device decoder-only transformer: Llama-style by default, GPT-2 by config.

Plain PyTorch with no parallel code. Parallel layouts are applied from outside through
`Transformer.plan()`. A pipeline stage may drop the embedding, some blocks, or the head
(set to None / removed from the ModuleDict); forward then takes and returns hidden
states instead of tokens and logits, and block names stay the same ("blocks.7").
"""

from __future__ import annotations

import math
from functools import cache, partial

import torch
import torch.nn as nn
import torch.nn.functional as F

from partita.eager_only import trace_time_constant
from partita.models import plan as roles
from partita.models.attention_kernel import uses_explicit_scores
from partita.models.documents import attention_mask
from partita.models.model_config import ModelConfig
from partita.models.moe import MoE
from partita.models.param_init import InitRule, ParamInit, init_parameters
from partita.models.rotary import (
    pairs_as_halves,
    plain_projection,
    rope_frequencies,
    rotary_constants,
    rotary_tables,
    rotate_halves,
    rotate_pairs,
)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in at least fp32: bf16 sums of squares lose too much precision.
        # torch's rms_norm: one fused kernel (CPU and CUDA), bitwise equal to
        # x * rsqrt(mean(x^2) + eps) here; the scale is applied after the cast, as before.
        xf = x.to(torch.promote_types(x.dtype, torch.float32))
        xf = F.rms_norm(xf, (xf.shape[-1],), None, self.eps)
        return xf.to(x.dtype) * self.weight


def make_norm(cfg: ModelConfig) -> nn.Module:
    if cfg.flavour == "gpt2":
        return nn.LayerNorm(cfg.dim, eps=cfg.norm_eps)
    return RMSNorm(cfg.dim, cfg.norm_eps)


class AttentionCore(nn.Module):
    """Causal softmax(q k^T / sqrt(d)) v: the part of attention selective recompute reruns.

    With `segments` (batch, seq), the document number of every token of packed rows (see
    partita.models.documents), a token attends only within its own document. That mask
    is a tensor argument of scaled_dot_product_attention, which on CUDA then uses its
    math or memory-efficient kernel (the CUDA flash kernel takes no mask; the CPU one
    does); without segments, is_causal lets it use any kernel.

    `kernel` ("auto", "sdpa", "explicit": `model.attention`) picks between that and
    `explicit_attention` per call (`partita.models.attention_kernel`: explicit scores
    for short bf16 sequences on a CPU under "auto").

    Grouped-query attention: k and v come with their own (fewer) heads. torch's CPU
    flash kernel reads a query head's kv head in place (`enable_gqa`), masked or not, so
    no repeated copy of K and V is made, saved for backward or summed back in it (the
    tiny model's attention forward + backward: 0.90 of the time with the copies; its
    eager step: 0.976, docs/benchmarks.md); so does `explicit_attention`. On CUDA the
    heads are repeated first for sdpa: the memory-efficient kernel, which fp32 and masks
    use there, does not take grouped heads, and SDPA would fall back to its math kernel.
    """

    takes_kv_heads = True

    def __init__(self, kernel: str = "auto") -> None:
        super().__init__()
        self.kernel = kernel
        self.bf16_units = cpu_bf16_units()

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                segments: torch.Tensor | None = None) -> torch.Tensor:
        b, heads, s, _ = q.shape
        if k.shape[2] == s and uses_explicit_scores(self.kernel, q.device.type,
                                                    str(q.dtype).removeprefix("torch."),
                                                    b * heads * s * s, self.bf16_units):
            return explicit_attention(q, k, v, segments)
        grouped = k.shape[1] != heads
        if grouped and q.device.type != "cpu":
            k, v = repeat_kv_heads(k, v, heads)
            grouped = False
        if segments is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=grouped)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask(segments),
                                              enable_gqa=grouped)


@cache
def cpu_bf16_units() -> str:
    """This CPU's bf16 units as torch sees them (`attention_kernel.BF16_UNITS`): AMX
    tiles, AVX-512 BF16 or none (`model.attention = "auto"` reads it)."""
    if getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)():
        return "amx"
    return "avx512" if getattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)() \
        else "none"


@trace_time_constant
def causal_bias(seq_len: int, dtype: torch.dtype, device: torch.device
                ) -> tuple[torch.Tensor]:
    """(seq_len, seq_len): 0 on and below the diagonal, -inf above. A constant of compiled
    graphs (`partita.eager_only`): traced, the softmax's kernel computed the mask per
    element with 64-bit index compares (one tiny-model layer's attention, bf16, forward
    + backward: 1.53-1.63 ms against 1.45 with the constant). In a tuple: dynamo took a
    bare tensor from a second call in one graph for a duplicate constant and failed."""
    return (torch.full((seq_len, seq_len), float("-inf"), dtype=dtype, device=device).triu(1),)


def explicit_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       segments: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention as two batched GEMMs around a softmax, for q (batch, heads, seq,
    head_dim) and k, v with kv_heads dividing heads (query heads 0..g-1 share kv head 0).

    The query heads of one kv head are stacked as rows of one GEMM, so K and V are never
    copied per query head and their gradients need no summing. The mask is added (0 or
    -inf) rather than filled in, so nothing but the softmax output is saved for it:
    masked scores get probability 0 and so no gradient. torch's softmax on bf16 input
    accumulates in fp32 and rounds its output to bf16, as the flash kernels do.
    """
    b, heads, s, d = q.shape
    kv_heads = k.shape[1]
    group = heads // kv_heads
    q = (q * d ** -0.5).reshape(b, kv_heads, group * s, d)
    scores = (q @ k.transpose(-1, -2)).view(b, kv_heads, group, s, s)
    if segments is None:  # -inf above the diagonal
        (bias,) = causal_bias(s, q.dtype, q.device)
    else:  # (batch, 1, 1, seq, seq): every head of every group
        bias = torch.zeros((), dtype=q.dtype, device=q.device).masked_fill(
            ~attention_mask(segments)[:, :, None], float("-inf"))
    probs = torch.softmax(scores + bias, dim=-1)
    return (probs.view(b, kv_heads, group * s, s) @ v).view(b, heads, s, d)


def repeat_kv_heads(k: torch.Tensor, v: torch.Tensor, heads: int
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """k and v of shape (batch, kv_heads, seq, head_dim) with each kv head repeated for
    the query heads that share it: (batch, heads, seq, head_dim)."""
    repeat = heads // k.shape[1]
    return k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        kv_dim = cfg.kv_heads * cfg.head_dim
        self.head_dim = cfg.head_dim
        self.rotary = cfg.flavour == "llama"
        self.rope_theta = cfg.rope_theta
        # A plain float64 CPU tensor, not a buffer: a constant of the config that meta
        # builds, to_empty and dtype casts must not touch.
        self.inv_freq = rope_frequencies(cfg) if self.rotary else None
        # The same frequencies as plain floats, the key of `rotary_constants`.
        self.rope_freqs = tuple(self.inv_freq.tolist()) if self.rotary else ()
        self.wq = nn.Linear(cfg.dim, cfg.dim, bias=cfg.has_qkv_bias)
        self.wk = nn.Linear(cfg.dim, kv_dim, bias=cfg.has_qkv_bias)
        self.wv = nn.Linear(cfg.dim, kv_dim, bias=cfg.has_qkv_bias)
        self.wo = nn.Linear(cfg.dim, cfg.dim, bias=cfg.has_bias)
        self.core = AttentionCore(cfg.attention)

    def forward(self, x: torch.Tensor, position_offset: int = 0,
                segments: torch.Tensor | None = None) -> torch.Tensor:
        b, s, _ = x.shape
        # Head counts come from the projections' widths, so a tensor-parallel shard that
        # holds fewer heads works unchanged.
        halves = self.rotary and torch.compiler.is_compiling() and all(
            plain_projection(m) for m in (self.wq, self.wk))
        if halves:  # compiled: q and k come out with their pairs as halves, see there
            q, k = (pairs_as_halves(m, x, self.head_dim).view(b, s, -1, self.head_dim)
                    for m in (self.wq, self.wk))
        else:
            q = self.wq(x).view(b, s, -1, self.head_dim)
            k = self.wk(x).view(b, s, -1, self.head_dim)
        v = self.wv(x).view(b, s, -1, self.head_dim)
        if self.rotary:
            if isinstance(position_offset, torch.Tensor):  # context parallelism's shards
                cos, sin = rotary_tables(s, self.head_dim, self.rope_theta, x.device,
                                         q.dtype, position_offset, self.inv_freq)
            else:
                cos, sin = rotary_constants(s, position_offset, self.rope_freqs, x.device,
                                            q.dtype)
            q, k = rotate_halves((q, k), cos, sin) if halves else rotate_pairs((q, k), cos, sin)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        # Grouped-query attention: the cores take the kv heads as they are (ours, and
        # context parallelism's, which moves only those); another core gets them repeated.
        if k.shape[1] != q.shape[1] and not getattr(self.core, "takes_kv_heads", False):
            k, v = repeat_kv_heads(k, v, q.shape[1])
        # Passed only when given: a core swapped in by a parallel layout need not take it.
        out = self.core(q, k, v) if segments is None else self.core(q, k, v, segments=segments)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gated = cfg.gated_mlp
        if self.gated:
            self.w_gate = nn.Linear(cfg.dim, cfg.ffn_hidden, bias=False)
        self.w_up = nn.Linear(cfg.dim, cfg.ffn_hidden, bias=cfg.has_bias)
        self.w_down = nn.Linear(cfg.ffn_hidden, cfg.dim, bias=cfg.has_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gated:  # SwiGLU
            return self.w_down(F.silu(self.w_gate(x)) * self.w_up(x))
        return self.w_down(F.gelu(self.w_up(x)))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int = 0) -> None:
        super().__init__()
        self.attn_norm = make_norm(cfg)
        self.attn = Attention(cfg)
        self.mlp_norm = make_norm(cfg)
        self.mlp = MoE(cfg) if cfg.is_moe_layer(index) else MLP(cfg)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor, segments: torch.Tensor | None = None) -> torch.Tensor:
        """`segments`: documents of packed rows (see AttentionCore), None: one per row."""
        h = self.attn_norm(x)
        a = self.attn(h) if segments is None else self.attn(h, segments=segments)
        x = x + self.dropout(a)
        return x + self.dropout(self.mlp(self.mlp_norm(x)))


def _embedding(rows: int, dim: int) -> nn.Embedding:
    # Uninitialised: `init_weights` fills every parameter. nn.Embedding's own normal_ on
    # the meta device (where models are built) would import dynamo, about a second of
    # every process's start-up.
    return nn.Embedding(rows, dim, _weight=torch.empty(rows, dim))


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        # padded_vocab_size rows (cfg.vocab_multiple): the head's GEMM stays aligned; the
        # rows past vocab_size are never a token, and the loss and sampling ignore
        # their logits.
        self.tok_embeddings: nn.Module | None = _embedding(cfg.padded_vocab_size, cfg.dim)
        self.pos_embeddings: nn.Module | None = (
            _embedding(cfg.max_seq_len, cfg.dim) if cfg.flavour == "gpt2" else None
        )
        self.blocks = nn.ModuleDict({str(i): Block(cfg, i) for i in range(cfg.n_layers)})
        self.norm: nn.Module | None = make_norm(cfg)
        # Tied embeddings: logits use tok_embeddings.weight, there is no separate head.
        self.output: nn.Module | None = (
            None if cfg.tie_embeddings
            else nn.Linear(cfg.dim, cfg.padded_vocab_size, bias=False)
        )
        self.dropout = nn.Dropout(cfg.dropout)
        if not any(p.is_meta for p in self.parameters()):
            init_weights(self)

    def forward(self, x: torch.Tensor, segments: torch.Tensor | None = None) -> torch.Tensor:
        """tokens (b, s) -> logits (b, s, padded vocab); a pipeline stage maps hidden
        states. Logit columns at or past cfg.vocab_size are padding (never a token).

        `segments` (b, s): the document of every token when rows pack several (see
        partita.models.documents); attention then stays within each document.
        """
        if self.tok_embeddings is not None:
            x = self.embed(x)
        for block in self.blocks.values():
            x = block(x) if segments is None else block(x, segments=segments)
        return self.head(x) if self.has_head else x

    @property
    def has_head(self) -> bool:
        return self.norm is not None

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """The input side: token (+ learned position) embeddings, then dropout."""
        x = self.tok_embeddings(tokens)
        if self.pos_embeddings is not None:
            positions = torch.arange(tokens.shape[1], device=tokens.device)
            x = x + self.pos_embeddings(positions)[None]
        return self.dropout(x)

    def head(self, h: torch.Tensor) -> torch.Tensor:
        """The output side: final norm, then logits."""
        return self.logits(self.norm(h))

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        if self.output is not None:
            return self.output(h)
        return F.linear(h, self.tok_embeddings.weight)

    def plan(self) -> roles.ModelPlan:
        return transformer_plan(self.cfg)


def transformer_plan(cfg: ModelConfig) -> roles.ModelPlan:
    mlp_col = ["blocks.*.mlp.w_up"] + (["blocks.*.mlp.w_gate"] if cfg.gated_mlp else [])
    # MoE blocks first: their feed-forward is one unit (its experts are not colwise).
    table = {f"blocks.{i}.mlp": roles.MOE for i in range(cfg.n_layers) if cfg.is_moe_layer(i)}
    table.update({f"blocks.*.attn.{n}": roles.COLWISE for n in ("wq", "wk", "wv")})
    table.update({name: roles.COLWISE for name in mlp_col})
    table.update({"blocks.*.attn.wo": roles.ROWWISE, "blocks.*.mlp.w_down": roles.ROWWISE})
    table["tok_embeddings"] = roles.VOCAB_EMBEDDING
    if not cfg.tie_embeddings:
        table["output"] = roles.VOCAB_HEAD
    table["blocks.*.attn.core"] = roles.ATTENTION_CORE
    table.update({"blocks.*.attn_norm": roles.NORM, "blocks.*.mlp_norm": roles.NORM,
                  "norm": roles.NORM})
    if cfg.flavour == "gpt2":
        table["pos_embeddings"] = roles.POSITIONS
    return roles.ModelPlan(roles=table, tied_head="output" if cfg.tie_embeddings else None,
                           init=transformer_init(cfg), shape=cfg)


def transformer_init(cfg: ModelConfig) -> ParamInit:
    """The model's initialisation, as parallel code reads it (through the plan)."""
    return ParamInit(partial(init_rule, cfg), cfg.seed)


def init_rule(cfg: ModelConfig, name: str) -> InitRule:
    """How parameter `name` (a global name such as 'blocks.3.attn.wo.weight') is drawn."""
    if name.endswith(".bias"):
        return InitRule("zeros")
    if "norm" in name.rsplit(".", 2)[-2]:
        return InitRule("ones")
    if name.endswith(("attn.wo.weight", "mlp.w_down.weight", "experts.w_down",
                      "shared.w_down.weight")):
        # Residual projections: scaled so the residual stream's variance does not grow
        # with depth (GPT-2's 1/sqrt(2 * layers)).
        return InitRule("normal", cfg.init_std / math.sqrt(2 * cfg.n_layers))
    return InitRule("normal", cfg.init_std)


def init_weights(model: Transformer) -> None:
    """Fill every parameter from its global name (see partita.models.param_init)."""
    init_parameters(model, transformer_init(model.cfg))


def build_model(cfg: ModelConfig, device: str | torch.device = "cpu",
                dtype: torch.dtype = torch.float32) -> Transformer:
    """A fully initialised single-device model (use device='meta' to only count)."""
    with torch.device("meta"):
        model = Transformer(cfg)
    if str(device) == "meta":
        return model.to(dtype)
    model.to_empty(device=device)
    init_weights(model)
    return model.to(dtype)
