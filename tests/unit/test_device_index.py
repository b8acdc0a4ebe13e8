"""train.device=cuda:N: checked against the visible GPUs before launch like cuda (no
GPU: the same message; an index past them names how many there are), and one GPU for
the node's one process (NCCL runs one process per GPU)."""

from __future__ import annotations

import pytest

from partita.errors import PartitaError


@pytest.fixture
def gpus(monkeypatch):
    """Pretend this machine has `gpus.count` GPUs (0: none visible)."""
    import torch

    class Visible:
        count = 0
        current = None

    monkeypatch.setattr(torch.cuda, "is_available", lambda: Visible.count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: Visible.count)
    monkeypatch.setattr(torch.cuda, "set_device",
                        lambda index: setattr(Visible, "current", index))
    for name in ("LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    return Visible


@pytest.mark.parametrize("name", ["cuda", "cuda:0", "cuda:3"])
def test_a_cuda_device_without_a_gpu_is_refused_before_launch(gpus, name):
    from partita.process_setup import pick_device_name

    with pytest.raises(PartitaError, match=f"train.device={name} but no CUDA device is "
                                           "visible; use train.device=cpu or auto"):
        pick_device_name(name)


def test_a_gpu_index_past_the_visible_ones_names_how_many_there_are(gpus):
    from partita.process_setup import pick_device_name

    gpus.count = 2
    assert pick_device_name("cuda:1") == "cuda:1"
    with pytest.raises(PartitaError, match=r"train.device=cuda:2 but 2 CUDA device\(s\) are "
                                           r"visible \(cuda:0 to cuda:1\)"):
        pick_device_name("cuda:2")


def test_cuda_n_is_one_gpu_for_the_node_s_one_process(gpus, monkeypatch):
    import torch

    from partita.process_setup import check_local_processes, pick_device

    gpus.count = 4
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert pick_device("cuda:2") == torch.device("cuda", 2) and gpus.current == 2
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    with pytest.raises(PartitaError, match="train.device=cuda:2 puts all 2 processes of this "
                                           "node on one GPU"):
        pick_device("cuda:2")
    with pytest.raises(PartitaError, match="use train.device=cuda"):
        check_local_processes("cuda:0", 2)
    check_local_processes("cuda", 4)  # local rank r on GPU r
    assert pick_device("cuda") == torch.device("cuda", 0)
