"""Where a step's time goes, eager against `train.compile=model`: the floor under C.

    PYTHONPATH=src python tools/compile_profile.py [--model tiny] [--batch 4] [--rounds 4]
        [--precision fp32|bf16] [--world 1]

Gloo ranks of one thread (rank 0 reports), fp32 or bf16 with fp32 master weights,
partita's stage 0 (`partita.bench.compile`'s runners).
Each round profiles a few steps of each runner with torch's profiler (the compiled
one's C++ kernels named, `cpp.enable_kernel_profile`) and sorts their self time into
GEMMs, the attention kernel, inductor's fused kernels, the compiled graphs' Python
wrappers, the optimizer step and clipping, and everything else (eager elementwise
operations, autograd, the engine). Printed: the median milliseconds per step of each
part over the rounds, and the floor of the compiled/eager ratio that compiling leaves
the GEMMs and the attention kernel unchanged implies: (GEMMs + attention) / eager
step, and the largest operations left in "other". The profiler adds a few
microseconds to every operation, most to eager's many small ones; the parts are for
comparing, the ratios of `tools/compile_steps.py` and `partita bench compile` are the
step times.
"""

from __future__ import annotations

import argparse
import copy
import statistics

import torch

from partita.local_world import run_distributed

PARTS = ("GEMMs", "attention", "fused kernels", "graph wrappers", "optimizer + clip",
         "other")
STEPS = 4
TOP = 8  # the largest operations of "other" printed per runner


def part_of(name: str) -> str:
    """The part of a step an operator's self time belongs to (the profiler's names)."""
    if name in ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm"):
        return "GEMMs"
    if "scaled_dot_product" in name:
        return "attention"
    if name.startswith(("graph_", "cpp_fused")):  # inductor's C++ kernels
        return "fused kernels"
    if name.startswith("## Call CompiledFxGraph"):  # the generated Python around them
        return "graph wrappers"
    if name in ("aten::_fused_adamw_", "aten::linalg_vector_norm", "aten::_foreach_mul_"):
        return "optimizer + clip"
    return "other"


def _profiled(step, tokens: torch.Tensor) -> tuple[dict[str, float], list[tuple[float, str]]]:
    """Milliseconds per step of each part, and the largest events of "other"."""
    from torch.profiler import profile

    with profile() as prof:
        for _ in range(STEPS):
            step(tokens)
    ms = dict.fromkeys(PARTS, 0.0)
    other = []
    for event in prof.key_averages():
        part = part_of(event.key)
        ms[part] += event.self_cpu_time_total / 1e3 / STEPS
        if part == "other":
            other.append((event.self_cpu_time_total / 1e3 / STEPS, event.key))
    return ms, sorted(other, reverse=True)[:TOP]


def _worker(rank: int, world: int, name: str, batch: int, seq: int, rounds: int,
            precision: str) -> None:
    import torch._inductor.config as inductor

    from partita.bench import dp as harness
    from partita.bench.compile import EAGER, OURS0_MODEL, build_step
    from partita.layout import Layout
    from partita.mesh import Mesh

    torch.set_num_threads(1)
    inductor.cpp.enable_kernel_profile = True  # each fused kernel a profiler event
    mesh = Mesh(Layout(dp=world), rank, world)
    tops: dict[str, list[tuple[float, str]]] = {}
    template, vocab = harness.bench_model(name, "cpu")
    steps = {"eager": build_step(EAGER, copy.deepcopy(template), mesh, precision),
             "compiled": build_step(OURS0_MODEL, copy.deepcopy(template), mesh, precision)}
    tokens = torch.randint(0, vocab, (batch, seq + 1),
                           generator=torch.Generator().manual_seed(0))
    for step in steps.values():  # the first compiles
        for _ in range(4):
            step(tokens)
    parts = {k: {p: [] for p in PARTS} for k in steps}
    for _ in range(rounds):
        for key, step in steps.items():
            ms_of, tops[key] = _profiled(step, tokens)
            for part, ms in ms_of.items():
                parts[key][part].append(ms)
    harness.release(list(steps.values()))
    if rank:
        return
    median = {k: {p: statistics.median(v) for p, v in d.items()} for k, d in parts.items()}
    print(f"{name}, {precision}, {batch}x{seq} tokens, {rounds} rounds of {STEPS} profiled steps; "
          "median ms per step (self time):")
    print(f"  {'part':<18}{'eager':>9}{'compiled':>10}")
    for part in PARTS:
        print(f"  {part:<18}{median['eager'][part]:9.2f}{median['compiled'][part]:10.2f}")
    total = {k: sum(d.values()) for k, d in median.items()}
    print(f"  {'step':<18}{total['eager']:9.2f}{total['compiled']:10.2f}")
    kept = median["eager"]["GEMMs"] + median["eager"]["attention"]
    print(f"  compiled/eager {total['compiled'] / total['eager']:.3f}; floor with GEMMs and "
          f"attention unchanged (their eager {kept:.2f} ms / eager step): "
          f"{kept / total['eager']:.3f}")
    for key, top in tops.items():
        print(f"  largest of 'other', {key} (last round): "
              + ", ".join(f"{name} {ms:.2f}" for ms, name in top))
    print(flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny", help="a bench model (default tiny)")
    parser.add_argument("--batch", type=int, default=4, help="sequences (default 4)")
    parser.add_argument("--seq", type=int, default=128, help="tokens each (default 128)")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--world", type=int, default=1, help="ranks (default 1; rank 0 "
                        "prints)")
    parser.add_argument("--precision", choices=("fp32", "bf16"), default="fp32",
                        help="bf16: bf16 training with fp32 master weights, as "
                        "`partita bench compile --precision bf16`")
    args = parser.parse_args()
    run_distributed(_worker, args.world, timeout=3600,
                    args=(args.model, args.batch, args.seq, args.rounds, args.precision))


if __name__ == "__main__":
    main()
