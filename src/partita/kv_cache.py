"""Keys and values kept between the steps of sampling, so that each new token costs a
forward of one token instead of the whole sequence so far.

The model is not changed for it. While a `KVCache` is open, every block's attention
core is swapped for `CachedCore`, which appends the new tokens' keys and values to the
earlier ones', and forward hooks give the rotary embedding (llama) or the learned
position embedding (gpt2) the new tokens' positions. The logits equal those of a
forward over the whole sequence, to rounding (`tests/unit/test_sampling_prompts.py`).
"""

from __future__ import annotations

from types import TracebackType

import torch
import torch.nn as nn
import torch.nn.functional as F


class CachedCore(nn.Module):
    """An attention core that remembers every key and value it was given."""

    takes_kv_heads = True  # grouped heads go to sdpa as they are (enable_gqa)

    def __init__(self, core: nn.Module) -> None:
        super().__init__()
        self.core = core
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if self.k is not None:
            k, v = torch.cat([self.k, k], dim=2), torch.cat([self.v, v], dim=2)
        self.k, self.v = k, v
        if q.shape[2] == k.shape[2]:  # the prompt: causal within itself, the model's core
            return self.core(q, k, v)
        if q.shape[2] != 1:
            raise ValueError("a KVCache takes the prompt, then one token at a time")
        # One new token: every cached key is in its past, so no mask (is_causal would
        # align the two lengths at their starts, not their ends).
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=k.shape[1] != q.shape[1])


class KVCache:
    """`with KVCache(model) as cache: cache.logits(prompt); cache.logits(next_token)...`

    For partita's single-device `Transformer` in eval mode. `length` is the number of
    tokens seen; positions continue from it."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.length = 0
        self._swapped: list[tuple[nn.Module, nn.Module]] = []
        self._hooks: list[torch.utils.hooks.RemovableHandle] = []

    def __enter__(self) -> KVCache:
        for block in self.model.blocks.values():
            attn = block.attn
            self._swapped.append((attn, attn.core))
            attn.core = CachedCore(attn.core)
            self._hooks.append(attn.register_forward_pre_hook(self._rotary_offset,
                                                              with_kwargs=True))
        if self.model.pos_embeddings is not None:  # gpt2: learned positions
            self._hooks.append(self.model.pos_embeddings.register_forward_pre_hook(
                lambda _module, args: (args[0] + self.length,)))
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        for hook in self._hooks:
            hook.remove()
        for attn, core in self._swapped:
            attn.core = core
        self._hooks, self._swapped = [], []

    def _rotary_offset(self, _module: nn.Module, args: tuple, kwargs: dict
                       ) -> tuple[tuple, dict]:
        return args, {**kwargs, "position_offset": self.length}

    def logits(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits (b, s, padded vocab) of `tokens` (b, s), which follow those seen."""
        out = self.model(tokens)
        self.length += tokens.shape[1]
        return out
