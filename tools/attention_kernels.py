"""torch's fused attention against partita's explicit scores, forward + backward, on CPU.

    PYTHONPATH=src python tools/attention_kernels.py [--repeats 9] [--dtypes bfloat16]
        [--shapes "2,8,384,64;2,8,448,64"]

One thread; causal; kv heads half the query heads. For each shape and dtype, the median
time of `scaled_dot_product_attention` and of `partita.models.transformer.
explicit_attention`, calls of the two alternating. The figures behind
`model.attention = "auto"`'s limit (`partita.models.attention_kernel`).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from partita.models.transformer import explicit_attention

SHAPES = [(4, 4, 128, 32), (1, 8, 256, 64), (1, 4, 512, 128), (4, 8, 256, 64),
          (1, 8, 512, 64), (2, 8, 512, 64), (1, 8, 768, 64), (1, 8, 1024, 64)]


def _fused(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


def _time(fn, q, k, v, grad) -> float:
    start = time.perf_counter()
    fn(q, k, v).backward(grad)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--shapes", default=None,
                        help="shapes to time instead of the built-in list, "
                             "'batch,heads,seq,head_size' separated by ';'")
    parser.add_argument("--dtypes", default="bfloat16,float32")
    args = parser.parse_args()
    shapes = SHAPES if args.shapes is None else [
        tuple(int(x) for x in shape.split(",")) for shape in args.shapes.split(";")]
    dtypes = [getattr(torch, name) for name in args.dtypes.split(",")]
    torch.set_num_threads(1)
    print("batch, heads, seq, head size | scores | dtype | fused ms | explicit ms")
    for b, h, s, d in shapes:
        for dtype in dtypes:
            q = torch.randn(b, h, s, d, dtype=dtype, requires_grad=True)
            k, v = (torch.randn(b, h // 2, s, d, dtype=dtype, requires_grad=True)
                    for _ in range(2))
            grad = torch.randn(b, h, s, d, dtype=dtype)
            times: dict[str, list[float]] = {"fused": [], "explicit": []}
            for i in range(args.repeats + 2):  # two warm-up calls of each
                for name, fn in (("fused", _fused), ("explicit", explicit_attention)):
                    took = _time(fn, q, k, v, grad)
                    if i >= 2:
                        times[name].append(took)
            ms = {name: statistics.median(t) * 1e3 for name, t in times.items()}
            print(f"{b}, {h}, {s}, {d} | {b * h * s * s / 2**20:.2f}M | "
                  f"{str(dtype).removeprefix('torch.')} | {ms['fused']:.2f} | "
                  f"{ms['explicit']:.2f}", flush=True)


if __name__ == "__main__":
    main()
