"""Sample text from a trained run's weights on one device."""

from __future__ import annotations

from pathlib import Path

import torch

from partita.config import load_config
from partita.data import ByteTokenizer
from partita.errors import PartitaError
from partita.kv_cache import KVCache
from partita.models.transformer import build_model
from partita.weights import load_weights, nonfinite_tensors


def find_weights(run_dir: str | Path) -> Path:
    """Where `load_run_model` reads: the folder itself when it holds a finished run's
    weights (model.safetensors and config.toml), else the checkpoint it names (a
    checkpoint folder, a folder of checkpoints or a run's out_dir: its newest)."""
    from partita.checkpoint.manifest import MANIFEST, resolve

    run = Path(run_dir)
    if (run / "model.safetensors").is_file() and (run / "config.toml").is_file():
        return run
    if not run.exists():
        raise PartitaError(f"'{run}' does not exist; point --run at a run's out_dir or a "
                           "checkpoint folder.")
    try:
        folder = resolve(run, given_as="")
    except PartitaError:
        folder = None
    if folder is None or not (folder / MANIFEST).is_file():
        raise PartitaError(
            f"'{run}' holds no finished run (model.safetensors and config.toml are written "
            "when training completes) and no checkpoint; point --run at a run's out_dir or "
            "a checkpoint folder."
        )
    return folder


def load_run_model(run_dir: str | Path, device: str = "cpu"):
    """The single-device model of a finished run's weights or of a checkpoint (its
    full tensors assembled from every rank's shards), and the run's Config."""
    source = find_weights(run_dir)
    weights, config = source / "model.safetensors", source / "config.toml"
    if weights.is_file():
        cfg, state = load_config(config), load_weights(weights)
        what, model_of, fix = (f"the weights in {weights}", f"the model in {config}",
                               "the run directory is inconsistent")
    else:  # find_weights found a checkpoint
        cfg, state = _checkpoint_state(source)
        what, model_of, fix = (f"checkpoint '{source}'", "the model its manifest names",
                               "the checkpoint is inconsistent")
    model = build_model(cfg.model_config(), device=device)
    try:
        missing, unexpected = model.load_state_dict(state, strict=False)
    except RuntimeError as exc:  # a shape that disagrees with the config
        raise PartitaError(
            f"{what} do not fit {model_of}: {str(exc).splitlines()[-1].strip()}; {fix}."
        ) from None
    if missing or unexpected:
        raise PartitaError(f"{what} do not match {model_of} (missing {missing[:3]}, "
                           f"unexpected {unexpected[:3]}); {fix}.")
    return model.eval(), cfg


def _checkpoint_state(folder: Path):
    """(Config, full tensors) of a checkpoint, refused when a tensor is not finite."""
    from partita.checkpoint.export import full_tensors
    from partita.checkpoint.manifest import read_manifest
    from partita.config import config_from_toml

    cfg = config_from_toml(read_manifest(folder)["config"])
    state = dict(full_tensors(folder))
    bad = nonfinite_tensors(state)
    if bad:
        raise PartitaError(f"checkpoint '{folder}' holds NaN or infinite values in "
                           f"{', '.join(bad[:3])}; sample from an earlier checkpoint.")
    return cfg, state


@torch.no_grad()
def generate(model, prompt_ids: list[int], new_tokens: int, temperature: float = 0.8,
             top_k: int = 0, seed: int = 0, stop_id: int | None = None) -> list[int]:
    """Autoregressive sampling (greedy when temperature is 0), ending early after a
    sampled `stop_id` (the tokenizer's end of document), which is kept in the result.

    Keys and values are kept between tokens (`partita.kv_cache`) while the sequence fits
    the model's length (or its attention window, model.attention_window, when shorter);
    past it every token sees that many last tokens, at positions from 0, which a cache
    cannot give, so each runs the whole window (a model with a sliding window, computed
    by transformers, would keep each token's own position instead). A
    mixture of experts with a capacity (`capacity_factor`) always runs the whole
    sequence: its tokens compete for each expert's places over the sequence."""
    gen = torch.Generator().manual_seed(seed)
    ids, end = list(prompt_ids), len(prompt_ids) + new_tokens
    limit, vocab = model.cfg.longest_sequence, model.cfg.vocab_size

    def pick(logits: torch.Tensor) -> None:
        # Only the real vocabulary: the columns of a padded one (model.vocab_multiple)
        # are no token, whatever their (untrained) rows of the head give them.
        ids.append(_sample(logits[0, -1, :vocab].float(), temperature, top_k, gen))

    def more() -> bool:
        return len(ids) < end and not (stop_id is not None and len(ids) > len(prompt_ids)
                                       and ids[-1] == stop_id)

    if model.cfg.n_experts == 0 or model.cfg.capacity_factor is None:
        with KVCache(model) as cache:
            while more() and len(ids) <= limit:
                pick(cache.logits(torch.tensor([ids[cache.length:]])))
    while more():
        pick(model(torch.tensor([ids[-limit:]])))
    return ids


def _sample(logits: torch.Tensor, temperature: float, top_k: int,
            gen: torch.Generator) -> int:
    if temperature <= 0:
        return int(logits.argmax())
    # The largest logit subtracted first (softmax does not change): divided by a tiny
    # temperature the others then go to -inf, rather than every logit overflowing to
    # inf and the probabilities to NaN.
    logits = (logits.double() - logits.max()) / temperature  # float64: 1e-300 too
    if top_k:
        kth = torch.topk(logits, min(top_k, logits.numel())).values[-1]
        logits[logits < kth] = -float("inf")
    return int(torch.multinomial(torch.softmax(logits, -1), 1, generator=gen))


def generate_text(run_dir: str | Path, prompt: str, new_tokens: int,
                  temperature: float = 0.8, top_k: int = 0, seed: int = 0) -> str:
    model, cfg = load_run_model(run_dir)
    if cfg.data.tokenizer:  # the run's own tokenizer; documents start with its BOS
        from partita.data.hf_tokenizer import HFTokenizer

        tok = HFTokenizer(cfg.data.tokenizer)
        start = [tok.bos_id] if tok.bos_id is not None else []
        prompt_ids = start + tok.encode(prompt).tolist()
        if not prompt_ids:
            raise PartitaError(f"the prompt is empty and the run's tokenizer "
                               f"({cfg.data.tokenizer}) has no BOS token to start from; "
                               "give --prompt some text.")
        # A document ends at the tokenizer's EOS: what it samples after is another one.
        ids = generate(model, prompt_ids, new_tokens, temperature, top_k, seed,
                       stop_id=tok.eos_id)
        if tok.eos_id is not None and len(ids) > len(prompt_ids) and ids[-1] == tok.eos_id:
            ids = ids[:-1]
        return tok.decode(ids[len(start):])
    # The byte tokenizer has no BOS: an empty prompt starts after a newline (a line's
    # start, as the training text has), which is not printed.
    tok = ByteTokenizer()
    prompt_ids = tok.encode(prompt).tolist()
    ids = generate(model, prompt_ids or [ord("\n")], new_tokens, temperature, top_k, seed)
    return tok.decode(ids if prompt_ids else ids[1:])
