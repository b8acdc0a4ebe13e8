"""The line every `partita bench` run starts with: what machine its figures come from.

Ratios between partita and a peer measured on one CPU need not hold on another (on an
Intel Xeon with AMX compiling takes a quarter off a bf16 step, on an AMD Zen 4 a sixth),
so an output names the processor, its cores, its bf16 units (what `model.attention =
"auto"` reads), torch's version and, where there is one, the GPU.
"""

from __future__ import annotations

import os


def describe_machine() -> str:
    """`machine: <processor>, <n> cores, bf16 units <kind>, torch <version>[, <GPU>]`."""
    import torch

    from partita.machine_cache import processor_name
    from partita.models.transformer import cpu_bf16_units

    parts = [processor_name(), f"{os.cpu_count()} cores", f"bf16 units {cpu_bf16_units()}",
             f"torch {torch.__version__}"]
    if torch.cuda.is_available():
        parts.append(f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}")
    return "machine: " + ", ".join(parts)
