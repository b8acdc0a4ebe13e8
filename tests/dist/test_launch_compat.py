"""`launch` on a torch whose LaunchConfig lacks the newer fields partita sets.

torch 2.11 has neither `shutdown_timeout` nor `signals_to_handle`; passing either
failed every `partita train` there with a TypeError (seen on a GPU machine's image).
"""

from __future__ import annotations

import dataclasses

import torch.distributed.launcher.api as launcher_api

from partita.launch import LaunchSpec, launch

NEWER_FIELDS = ("shutdown_timeout", "signals_to_handle")


def _answer() -> int:
    return 42


def test_launch_runs_with_a_launch_config_that_lacks_the_newer_fields(monkeypatch):
    real = launcher_api.LaunchConfig
    kept = [(f.name, f.type, f) for f in dataclasses.fields(real)
            if f.name not in NEWER_FIELDS]
    # The removed names stay readable as class attributes with the values an old torch
    # behaves by (this torch's agent reads them); what an old torch lacks is the
    # constructor argument.
    defaults = {"shutdown_timeout": 30, "signals_to_handle": "SIGTERM,SIGINT,SIGHUP,SIGQUIT"}
    old = dataclasses.make_dataclass("LaunchConfig", kept, namespace=defaults)
    assert not set(NEWER_FIELDS) & set(old.__dataclass_fields__)
    monkeypatch.setattr(launcher_api, "LaunchConfig", old)
    assert launch(LaunchSpec(nproc=1, forward_sigterm=True), _answer) == [42]
