"""Full weights gathered from tensor-parallel shards equal the single-device model."""

import torch

from partita.weights import gather_full
from partita.layout import Layout
from partita.mesh import Mesh
from partita.models import ModelConfig, build_model
from partita.tensor_parallel import apply_tensor_parallel
from partita.testing import run_distributed

# Vocabulary 67 and MLP width 90 do not divide by tp=4: shards have unequal sizes.
CFG = ModelConfig(vocab_size=67, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=90,
                  max_seq_len=16)


def _gather_all(rank: int, world: int) -> dict[str, torch.Tensor]:
    mesh = Mesh(Layout(tp=world), rank, world)
    model = build_model(CFG, dtype=torch.float64)
    apply_tensor_parallel(model, model.plan(), mesh.comm("tensor"))
    return {name: gather_full(p, name, mesh.comm("tensor"))
            for name, p in model.named_parameters()}


def test_gathered_tensor_parallel_weights_equal_the_single_device_model():
    reference = dict(build_model(CFG, dtype=torch.float64).named_parameters())
    for gathered in run_distributed(_gather_all, 4):
        assert gathered.keys() == reference.keys()
        for name, full in gathered.items():
            assert torch.equal(full, reference[name].detach()), name
