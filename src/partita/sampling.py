"""Sample text from a trained run's weights on one device."""

from __future__ import annotations

from pathlib import Path

import torch

from partita.config import load_config
from partita.data import ByteTokenizer
from partita.errors import PartitaError
from partita.models.transformer import build_model
from partita.weights import load_weights


def load_run_model(run_dir: str | Path, device: str = "cpu"):
    run = Path(run_dir)
    weights, config = run / "model.safetensors", run / "config.toml"
    if not weights.is_file() or not config.is_file():
        raise PartitaError(
            f"'{run}' holds no finished run (model.safetensors and config.toml are written "
            "when training completes); point --run at a run's out_dir."
        )
    cfg = load_config(config)
    model = build_model(cfg.model_config(), device=device)
    state = load_weights(weights)
    try:
        missing, unexpected = model.load_state_dict(state, strict=False)
    except RuntimeError as exc:  # a shape that disagrees with config.toml
        raise PartitaError(
            f"the weights in {weights} do not fit the model in {config}: "
            f"{str(exc).splitlines()[-1].strip()}; the run directory is inconsistent."
        ) from None
    if missing or unexpected:
        raise PartitaError(
            f"the weights in {weights} do not match the model in {config} (missing "
            f"{missing[:3]}, unexpected {unexpected[:3]}); the run directory is inconsistent."
        )
    return model.eval(), cfg


@torch.no_grad()
def generate(model, prompt_ids: list[int], new_tokens: int, temperature: float = 0.8,
             top_k: int = 0, seed: int = 0) -> list[int]:
    """Autoregressive sampling (greedy when temperature is 0)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.tensor([prompt_ids], dtype=torch.long)
    limit = model.cfg.max_seq_len
    for _ in range(new_tokens):
        logits = model(ids[:, -limit:])[0, -1].float()
        if temperature <= 0:
            nxt = int(logits.argmax())
        else:
            logits = logits / temperature
            if top_k:
                kth = torch.topk(logits, min(top_k, logits.numel())).values[-1]
                logits[logits < kth] = -float("inf")
            nxt = int(torch.multinomial(torch.softmax(logits, -1), 1, generator=gen))
        ids = torch.cat([ids, torch.tensor([[nxt]])], dim=1)
    return ids[0].tolist()


def generate_text(run_dir: str | Path, prompt: str, new_tokens: int,
                  temperature: float = 0.8, top_k: int = 0, seed: int = 0) -> str:
    model, cfg = load_run_model(run_dir)
    if cfg.data.tokenizer:  # the run's own tokenizer; documents start with its BOS
        from partita.data.hf_tokenizer import HFTokenizer

        tok = HFTokenizer(cfg.data.tokenizer)
        start = [tok.bos_id] if tok.bos_id is not None else []
        ids = generate(model, start + tok.encode(prompt).tolist(), new_tokens, temperature,
                       top_k, seed)
        return tok.decode(ids[len(start):])
    tok = ByteTokenizer()
    ids = generate(model, tok.encode(prompt).tolist() or [10], new_tokens, temperature,
                   top_k, seed)
    return tok.decode(ids)
