"""Shape of a decoder-only transformer: the one description every part of partita reads.

The planner counts parameters and FLOPs from it without building anything; the model
builds modules from it; checkpoints save it next to the weights.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields

from partita.errors import PartitaError
from partita.models.attention_kernel import KERNELS


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = 256
    # The embedding and output head hold `padded_vocab_size` rows: vocab_size rounded up
    # to a multiple of this. A tensor-core GEMM whose n or k is not a multiple of 8 runs
    # at about a fifth of the rate (bf16 on an H200), and the head's GEMM has n = the
    # vocabulary: GPT-2's 50,257 -> 50,304 with 64 (Megatron-LM and nanoGPT pad likewise).
    # The extra rows are never a token and never a target: the loss and sampling ignore
    # their logits, data is checked against vocab_size, and a Hugging Face export drops
    # them.
    vocab_multiple: int = 1
    dim: int = 128
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int | None = None  # None: same as n_heads (multi-head attention)
    ffn_dim: int | None = None  # None: a SwiGLU-friendly multiple of dim (see ffn_hidden)
    max_seq_len: int = 256
    # "llama": RMSNorm, rotary positions, SwiGLU, no biases.
    # "gpt2": LayerNorm, learned positions, GELU, biases.
    flavour: str = "llama"
    tie_embeddings: bool = False
    # Biases on the query, key and value projections of a llama-flavoured model (Qwen2's
    # one difference from Llama); gpt2-flavoured models have every bias already.
    qkv_bias: bool = False
    # Sliding-window attention (Mistral's): each token attends to the last
    # attention_window positions. partita computes full causal attention, the same on
    # sequences of at most that many tokens, so such a model trains at data.seq_len up
    # to the window (config.Config.model_config refuses longer ones). None: no window.
    attention_window: int | None = None
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    dropout: float = 0.0
    init_std: float = 0.02
    seed: int = 0  # initialisation seed; every parameter derives its own from its name
    # Attention kernel: "auto", "sdpa" or "explicit" (partita.models.attention_kernel).
    # Not part of the model's shape: a checkpoint resumes under any of them.
    attention: str = "auto"
    # RoPE frequency scaling: "" (none) or "llama3" (Llama 3.1's: low frequencies divided
    # by rope_factor, high ones kept, a smooth ramp between; the wavelength bounds are
    # rope_original_max_len / rope_low_freq_factor and / rope_high_freq_factor).
    rope_scaling: str = ""
    rope_factor: float = 8.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_len: int = 8192
    # Mixture of experts (see partita.models.moe): n_experts=0 keeps every block dense;
    # otherwise every moe_every-th block (blocks moe_every-1, 2*moe_every-1, ...) routes
    # each token to top_k of n_experts SwiGLU experts of width expert_ffn_dim (None: the
    # dense ffn width). capacity_factor None is dropless; a number caps each expert at
    # ceil(capacity_factor * seq_len * top_k / n_experts) tokens of every sequence.
    n_experts: int = 0
    top_k: int = 2
    moe_every: int = 1
    expert_ffn_dim: int | None = None
    capacity_factor: float | None = None
    router_gating: str = "softmax"  # "softmax" or "sigmoid" (DeepSeek-V3)
    router_norm_topk: bool = True  # rescale the top-k gate weights to sum to one
    shared_experts: int = 0  # experts every token runs through (one MLP of that many widths)
    aux_loss_weight: float = 0.01  # Switch/GShard load-balancing loss
    z_loss_weight: float = 0.001  # router z-loss (ST-MoE)

    def __post_init__(self) -> None:
        from partita.models.moe_config import check_moe_config

        check_moe_config(self)
        if self.flavour not in ("llama", "gpt2"):
            raise PartitaError(
                f"model.flavour='{self.flavour}' is unknown; use 'llama' (RMSNorm, rotary, "
                "SwiGLU) or 'gpt2' (LayerNorm, learned positions, GELU)."
            )
        if self.qkv_bias and self.flavour != "llama":
            raise PartitaError(
                f"model.qkv_bias=true is for llama-flavoured models; model.flavour="
                f"'{self.flavour}' has biases on every projection already. Remove "
                "model.qkv_bias."
            )
        if self.attention_window is not None and (
                isinstance(self.attention_window, bool)
                or not isinstance(self.attention_window, int) or self.attention_window < 1):
            raise PartitaError(
                f"model.attention_window must be a positive number of positions (or unset: "
                f"no window), got {self.attention_window!r}."
            )
        if self.attention not in KERNELS:
            raise PartitaError(
                f"model.attention='{self.attention}' is unknown; use 'auto' (explicit scores "
                "for short bf16 sequences on a CPU, torch's fused kernel otherwise), 'sdpa' "
                "(always torch's scaled_dot_product_attention) or 'explicit'."
            )
        if self.rope_scaling not in ("", "llama3"):
            raise PartitaError(
                f"model.rope_scaling='{self.rope_scaling}' is unknown; use '' (no scaling) "
                "or 'llama3' (Llama 3.1's frequency scaling)."
            )
        if self.rope_scaling and not self.rope_high_freq_factor > self.rope_low_freq_factor:
            raise PartitaError(
                "model.rope_high_freq_factor must exceed model.rope_low_freq_factor (got "
                f"{self.rope_high_freq_factor} and {self.rope_low_freq_factor})."
            )
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "max_seq_len"):
            if getattr(self, name) <= 0:
                raise PartitaError(f"model.{name} must be positive, got {getattr(self, name)}.")
        # bool is an int subclass: vocab_multiple=True would silently mean 1.
        if (isinstance(self.vocab_multiple, bool) or not isinstance(self.vocab_multiple, int)
                or self.vocab_multiple < 1):
            raise PartitaError(
                f"model.vocab_multiple must be a positive integer (the vocabulary is padded "
                f"to a multiple of it; 1: no padding), got {self.vocab_multiple!r}. GPUs "
                "want a multiple of 64, e.g. --model.vocab_multiple=64."
            )
        if self.dim % self.n_heads:
            raise PartitaError(
                f"model.dim={self.dim} is not divisible by model.n_heads={self.n_heads}; "
                f"choose n_heads among the divisors of dim, e.g. "
                f"{_nearest(_divisors(self.dim), self.n_heads, self.dim)}."
            )
        if self.flavour == "llama" and self.head_dim % 2:
            even = [h for h in _divisors(self.dim) if (self.dim // h) % 2 == 0]
            raise PartitaError(
                f"model.dim={self.dim} over model.n_heads={self.n_heads} gives heads of "
                f"{self.head_dim} dimensions; rotary embeddings turn pairs of dimensions, so "
                f"a llama-flavoured head needs an even size (n_heads among "
                f"{_nearest(even, self.n_heads, self.dim)})."
            )
        if self.n_heads % self.kv_heads:
            raise PartitaError(
                f"model.n_heads={self.n_heads} is not divisible by model.n_kv_heads="
                f"{self.kv_heads}; grouped-query attention needs every kv head to serve the "
                f"same number of query heads (valid n_kv_heads: {_divisors(self.n_heads)})."
            )

    # Derived shapes -------------------------------------------------------------------
    @property
    def padded_vocab_size(self) -> int:
        """Rows of the embedding and the output head: vocab_size rounded up to a
        multiple of vocab_multiple (the rows past vocab_size are never used)."""
        return padded_vocab(self.vocab_size, self.vocab_multiple)

    @property
    def longest_sequence(self) -> int:
        """The most tokens partita computes this model on as its own: max_seq_len, or the
        attention window when it is shorter (full attention equals the windowed one only
        up to it)."""
        return min(self.max_seq_len, self.attention_window or self.max_seq_len)

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    def shape_text(self) -> str:
        """The shape in a few words, every field filled in: a setting inherited from the
        catalog entry a configuration starts from (its kv heads, its MLP width) shows."""
        every = f", every {self.moe_every} blocks" if self.moe_every > 1 else ""
        experts = (f", {self.n_experts} experts (top {self.top_k}, width "
                   f"{self.expert_hidden}{every})" if self.n_experts else "")
        return (f"{self.flavour}, {self.n_layers} layers, dim {self.dim}, {self.n_heads} "
                f"heads ({self.kv_heads} kv), ffn {self.ffn_hidden}{experts}, vocab "
                f"{self.vocab_size}, max_seq_len {self.max_seq_len}")

    @property
    def ffn_hidden(self) -> int:
        """Hidden width of the MLP.

        Llama: 2/3 of 4*dim rounded up to a multiple of 64 (keeps SwiGLU's parameter count
        close to a 4x GELU MLP); GPT-2: 4*dim.
        """
        if self.ffn_dim is not None:
            return self.ffn_dim
        if self.flavour == "gpt2":
            return 4 * self.dim
        return _round_up(int(8 * self.dim / 3), 64)

    @property
    def gated_mlp(self) -> bool:
        return self.flavour == "llama"

    @property
    def has_bias(self) -> bool:
        return self.flavour == "gpt2"

    @property
    def has_qkv_bias(self) -> bool:
        """Whether the query, key and value projections have biases."""
        return self.has_bias or self.qkv_bias

    # Counting (used by the planner and by MFU) ------------------------------------------
    @property
    def moe(self) -> bool:
        return self.n_experts > 0

    def is_moe_layer(self, index: int) -> bool:
        """Whether block `index` has a mixture-of-experts feed-forward."""
        return self.moe and (index + 1) % self.moe_every == 0

    @property
    def n_moe_layers(self) -> int:
        # Every moe_every-th block (is_moe_layer): the planner asks this ~10^6 times.
        return self.n_layers // self.moe_every if self.moe else 0

    @property
    def expert_hidden(self) -> int:
        return self.expert_ffn_dim or self.ffn_hidden

    def expert_param_count(self) -> int:
        """One routed expert's parameters (a SwiGLU MLP)."""
        return 3 * self.dim * self.expert_hidden

    def moe_block_param_count(self) -> int:
        """A block whose MLP is the router, every routed expert and the shared ones."""
        dense_mlp = (3 if self.gated_mlp else 2) * self.dim * self.ffn_hidden
        moe = (self.n_experts * self.dim + (self.n_experts + self.shared_experts)
               * self.expert_param_count())
        return self.block_param_count() - dense_mlp + moe

    def layer_param_count(self, index: int) -> int:
        return self.moe_block_param_count() if self.is_moe_layer(index) \
            else self.block_param_count()

    def blocks_param_count(self) -> int:
        """Every block's parameters (all experts of every MoE block)."""
        moe = self.n_moe_layers
        return (self.n_layers - moe) * self.block_param_count() + moe * self.moe_block_param_count()

    def active_blocks_param_count(self) -> int:
        """The block parameters one token's forward multiplies with (top_k experts)."""
        idle = (self.n_experts - self.top_k) * self.expert_param_count() if self.moe else 0
        return self.blocks_param_count() - self.n_moe_layers * idle

    def block_param_count(self) -> int:
        d, kv = self.dim, self.kv_heads * self.head_dim
        attn = d * d + 2 * d * kv + d * d
        mlp = (3 if self.gated_mlp else 2) * d * self.ffn_hidden
        norms = 2 * d * (2 if self.flavour == "gpt2" else 1)
        bias = (d + 2 * kv) if self.has_qkv_bias else 0
        bias += (d + self.ffn_hidden + d) if self.has_bias else 0
        return attn + mlp + norms + bias

    # The vocabulary's parameters and FLOPs are those of the stored (padded) rows: the
    # padding is memory every rank holds, and the head's GEMM computes its logits too.
    def embedding_param_count(self) -> int:
        pos = self.max_seq_len * self.dim if self.flavour == "gpt2" else 0
        return self.padded_vocab_size * self.dim + pos

    def head_param_count(self) -> int:
        """Final norm plus output projection (zero extra when tied)."""
        norm = self.dim * (2 if self.flavour == "gpt2" else 1)
        return norm + (0 if self.tie_embeddings else self.padded_vocab_size * self.dim)

    def num_params(self) -> int:
        return (
            self.embedding_param_count()
            + self.blocks_param_count()
            + self.head_param_count()
        )

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token without recompute: 6N + 12*L*H*Q*T.

        N is every parameter of the blocks one token passes through
        (`active_blocks_param_count`: the attention and MLP projections, and also each
        block's norm weights and, for gpt2, the norms' and projections' biases; in a
        mixture-of-experts block the router, the top_k routed experts and the shared
        ones) plus the output head's padded_vocab_size * dim, counted once whether or
        not it is tied to the embedding. The input embedding and gpt2's positional one
        are lookups and are not counted, nor is the final norm. The norms and biases do
        no matmul, so N is slightly above the matmul weights alone (by 0.12% on `tiny`,
        0.8% on `tiny-gpt2`). The second term is attention's score and value matmuls
        (L layers, H heads, Q head dim, T sequence length).
        """
        matmul_params = self.active_blocks_param_count() + self.padded_vocab_size * self.dim
        attention = 12 * self.n_layers * self.n_heads * self.head_dim * seq_len
        return 6 * matmul_params + attention

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> ModelConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            from partita.errors import did_you_mean

            raise PartitaError(
                f"unknown model setting '{unknown[0]}'.{did_you_mean(unknown[0], known)} "
                f"Valid settings: {', '.join(sorted(known))}."
            )
        return cls(**data)


def padded_vocab(vocab_size: int, multiple: int) -> int:
    """Rows a vocabulary of `vocab_size` is stored with at `model.vocab_multiple`."""
    return _round_up(vocab_size, multiple)


def aligned_vocab_multiple(tp: int = 1, align: int = 8) -> int:
    """The model.vocab_multiple to suggest: the smallest multiple of 64 that leaves each
    of `tp` ranks a vocabulary share that is a multiple of `align` (a tensor-core GEMM's
    n or k off a multiple of 8 runs at about a fifth of the rate)."""
    return math.lcm(64, align * tp)


def vocab_alignment_warning(cfg: ModelConfig, tp: int = 1, align: int = 8) -> str | None:
    """A warning when the output head's GEMMs on each of `tp` ranks are `ceil(padded
    vocabulary / tp)` wide, off a multiple of `align`: on a GPU they then run at about a
    fifth of the rate. None when aligned."""
    width = -(-cfg.padded_vocab_size // tp)
    if width % align == 0:
        return None
    multiple = aligned_vocab_multiple(tp, align)
    return (f"partita: warning: the vocabulary of {cfg.vocab_size:,} gives the output "
            f"head GEMMs {width:,} wide{f' (tp={tp})' if tp > 1 else ''}, not a multiple "
            f"of {align}: on a GPU they run at about a fifth of the rate. Pad it to "
            f"{_round_up(cfg.vocab_size, multiple):,} with --model.vocab_multiple={multiple}.")


def _round_up(x: int, multiple: int) -> int:
    return (x + multiple - 1) // multiple * multiple


def _nearest(heads: list[int], wanted: int, dim: int, count: int = 4) -> list[int]:
    """The `count` head counts in `heads` nearest `wanted`, preferring heads of at least
    8 dimensions (a head of 1 or 2 is no model anyone trains), in increasing order."""
    usable = [h for h in heads if dim // h >= 8] or heads
    return sorted(sorted(usable, key=lambda h: abs(h - wanted))[:count])


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]
