"""Recompute keeps generator states only for modules that can draw random numbers."""

from __future__ import annotations

import dataclasses

import torch.nn as nn

from partita.memory.recompute import draws_random_numbers
from partita.models.catalog import get_model_config
from partita.models.transformer import Transformer


def _block(dropout: float) -> nn.Module:
    model = Transformer(dataclasses.replace(get_model_config("tiny"), dropout=dropout))
    return next(iter(model.blocks.values()))


def test_a_block_without_dropout_draws_nothing_and_with_it_draws():
    assert not draws_random_numbers(_block(0.0))
    assert draws_random_numbers(_block(0.1))


def test_a_module_of_another_library_is_taken_to_draw():
    class Foreign(nn.Module):  # defined outside partita and torch.nn: unknown forward
        def forward(self, x):
            return x

    Foreign.__module__ = "transformers.models.llama.modeling_llama"
    assert draws_random_numbers(nn.Sequential(nn.Linear(2, 2), Foreign()))
    assert not draws_random_numbers(nn.Sequential(nn.Linear(2, 2), nn.Dropout(0.0)))
