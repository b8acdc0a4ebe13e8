"""Peak host memory of each rank while importing a Hugging Face Llama at ZeRO-3.

    python tools/hf_import_memory.py [--folder /tmp/llama-125m] [--world 4]
    python tools/hf_import_memory.py --mixtral --folder /tmp/mixtral-small --world 2

With --mixtral: a random Mixtral (8 experts, top-2) imported with its experts spread
over the ranks (ep = world) at ZeRO-1, where each rank should touch the dense weights'
pages and only its own experts'.

Saves a random ~125M-parameter Llama (float32, 2 GB shards) with transformers once,
then imports it with `model.init_from` on `--world` ranks (dp=world, ZeRO-3) and
reports, per rank, the resident memory before the build and its peak during the build,
split into anonymous memory (tensors the rank allocated) and file-backed pages (the
memory-mapped safetensors pages it touched, which the kernel may drop at any time), next
to the rank's shard size. RSS is sampled every 2 ms from /proc/self/status.
"""

from __future__ import annotations

import argparse
import threading
import time
from pathlib import Path

import torch

SHAPE = dict(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
             num_attention_heads=12, num_key_value_heads=4, max_position_embeddings=2048)


def rss() -> dict[str, int]:
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("RssAnon", "RssFile"):
            out[key] = int(value.split()[0]) * 1024
    return out


class PeakSampler:
    def __init__(self) -> None:
        self.peak = {"RssAnon": 0, "RssFile": 0, "total": 0}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            now = rss()
            now["total"] = now["RssAnon"] + now["RssFile"]
            for k, v in now.items():
                self.peak[k] = max(self.peak[k], v)
            time.sleep(0.002)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


MIXTRAL = dict(vocab_size=32000, hidden_size=512, intermediate_size=1792,
               num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
               max_position_embeddings=2048, num_local_experts=8, num_experts_per_tok=2,
               sliding_window=None)


def save_model(folder: Path, mixtral: bool = False) -> None:
    import transformers

    if (folder / "config.json").is_file():
        return
    if mixtral:
        model = transformers.MixtralForCausalLM(transformers.MixtralConfig(**MIXTRAL))
    else:
        model = transformers.LlamaForCausalLM(
            transformers.LlamaConfig(**SHAPE, tie_word_embeddings=False))
    model.save_pretrained(folder, max_shard_size="2GB")


RANDOM = ["--model.vocab_size=32000", "--model.dim=768", "--model.ffn_dim=2048",
          "--model.n_layers=12", "--model.n_heads=12", "--model.n_kv_heads=4"]


def load_on_rank(rank: int, world: int, folder: str, imported: bool = True,
                 extra: tuple[str, ...] = ()) -> dict:
    """One build on this rank: imported from `folder`, or (imported=False) the same shape
    drawn at random, the engine's own footprint (shard, master copy, AdamW moments);
    `extra`: more settings (the Mixtral's expert parallelism)."""
    from partita.config import load_config
    from partita.mesh import Mesh
    from partita.parallelize import build_parallel_model, dims_from_config

    model = [f"--model.init_from={folder}"] if imported else RANDOM
    cfg = load_config(None, [*model, "--parallel.zero_stage=3", "--data.seq_len=128",
                             f"--train.global_batch={world}", *extra])
    before = rss()
    with PeakSampler() as sampler:
        pm = build_parallel_model(cfg, Mesh(dims_from_config(cfg, world), rank, world),
                                  torch.device("cpu"))
    shard = sum(u.shard_numel * u.shard.element_size() for u in _units(pm.dp)
                if u.shard is not None)  # ZeRO-3's; none below it
    return {"before": before, "peak": sampler.peak, "shard_bytes": shard,
            "params": pm.model_cfg.num_params()}


def _units(dp):
    """The engine's flat buffers (whatever attribute holds them)."""
    for name in ("buckets",):
        if hasattr(dp, name):
            return list(getattr(dp, name))
    raise AttributeError("no flat buffers found on the engine")


def main() -> None:
    from partita.local_world import run_distributed

    parser = argparse.ArgumentParser()
    parser.add_argument("--folder", default="/tmp/llama-125m")
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--mixtral", action="store_true")
    args = parser.parse_args()
    folder = Path(args.folder)
    save_model(folder, args.mixtral)
    if args.mixtral:
        results = run_distributed(load_on_rank, args.world,
                                  args=(str(folder), True, (f"--parallel.ep={args.world}",
                                                            "--parallel.zero_stage=1")),
                                  timeout=900)
        mib = 2 ** 20
        experts = sum(p.stat().st_size for p in folder.glob("*.safetensors"))
        print(f"model: {results[0]['params'] / 1e6:.1f}M parameters, files {experts / mib:,.0f} "
              f"MiB; ep={args.world}, ZeRO-1 (the dense weights whole on every rank)")
        for r, res in enumerate(results):
            b, p = res["before"], res["peak"]
            print(f"rank {r}: peak file pages during build +{(p['RssFile'] - b['RssFile']) / mib:,.0f}"
                  f" MiB, anon +{(p['RssAnon'] - b['RssAnon']) / mib:,.0f} MiB")
        return
    results = run_distributed(load_on_rank, args.world, args=(str(folder),), timeout=900)
    random = run_distributed(load_on_rank, args.world, args=(str(folder), False), timeout=900)
    mib = 2 ** 20
    print(f"model: {results[0]['params'] / 1e6:.1f}M parameters, float32 "
          f"{results[0]['params'] * 4 / mib:,.0f} MiB; ZeRO-3 on {args.world} ranks")
    for r, res in enumerate(results):
        b, p = res["before"], res["peak"]
        print(f"rank {r}: shard {res['shard_bytes'] / mib:,.0f} MiB; before build: anon "
              f"{b['RssAnon'] / mib:,.0f} MiB, file {b['RssFile'] / mib:,.0f} MiB; peak during "
              f"build: anon {p['RssAnon'] / mib:,.0f} MiB (+{(p['RssAnon'] - b['RssAnon']) / mib:,.0f}), "
              f"file {p['RssFile'] / mib:,.0f} MiB (+{(p['RssFile'] - b['RssFile']) / mib:,.0f})")
    for r, res in enumerate(random):
        b, p = res["before"], res["peak"]
        print(f"rank {r}, the same shape drawn at random: peak anon "
              f"{p['RssAnon'] / mib:,.0f} MiB (+{(p['RssAnon'] - b['RssAnon']) / mib:,.0f})")


if __name__ == "__main__":
    main()
