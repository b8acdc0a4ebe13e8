"""A small random Llama folder with its own tokenizer, and a JSONL file to fine-tune on:
a stand-in for a published checkpoint on a machine that cannot download one.

    python tools/make_small_llama.py --out llama-small --jsonl stdlib.jsonl
    python tools/make_small_llama.py --family mixtral --out mixtral-small

Writes `--jsonl` (one record {"text": ...} per standard-library module, unless the file
exists), trains a byte-level BPE tokenizer on it (`--vocab` tokens with <s>, </s>) and
saves a randomly initialised transformers LlamaForCausalLM (or `--family`'s model:
Mistral, Qwen2, Mixtral with 4 experts, top-2) of that vocabulary with `save_pretrained`,
next to tokenizer.json and tokenizer_config.json: the same layout as a folder from the
Hugging Face Hub.
"""

from __future__ import annotations

import argparse
import json
import sysconfig
from pathlib import Path

# --family: transformers' config and model classes, and the settings that make the model
# one partita imports (full attention; Mixtral's experts).
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": None}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                {"sliding_window": None, "num_local_experts": 4, "num_experts_per_tok": 2}),
}


def write_stdlib_jsonl(path: Path, max_docs: int) -> None:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.glob("*.py"))[:max_docs]
    with open(path, "w") as out:
        for p in files:
            text = p.read_text(encoding="utf-8", errors="replace")
            out.write(json.dumps({"text": text, "source": p.name}) + "\n")


def train_tokenizer(jsonl: Path, vocab: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    def texts():
        with open(jsonl) as fh:
            for line in fh:
                yield json.loads(line)["text"]

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts(), trainer)
    # Like a released Llama tokenizer, add BOS when asked for special tokens (transformers'
    # default), so a prompt starts the way partita framed every training document.
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(single="<s> $A",
                                                       special_tokens=[("<s>", bos)])
    return tok


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="llama-small")
    parser.add_argument("--jsonl", default="stdlib.jsonl")
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--docs", type=int, default=200, help="modules in the JSONL file")
    parser.add_argument("--family", choices=sorted(FAMILIES), default="llama")
    args = parser.parse_args()

    import torch
    import transformers

    jsonl, out = Path(args.jsonl), Path(args.out)
    if not jsonl.exists():
        write_stdlib_jsonl(jsonl, args.docs)
    tok = train_tokenizer(jsonl, args.vocab)
    torch.manual_seed(0)
    config_class, model_class, extra = FAMILIES[args.family]
    config = getattr(transformers, config_class)(
        vocab_size=tok.get_vocab_size(), hidden_size=args.dim,
        intermediate_size=_round_up(8 * args.dim // 3, 64), num_hidden_layers=args.layers,
        num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
        max_position_embeddings=1024, rope_theta=10000.0, tie_word_embeddings=False,
        bos_token_id=tok.token_to_id("<s>"), eos_token_id=tok.token_to_id("</s>"), **extra)
    getattr(transformers, model_class)(config).save_pretrained(out)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
        "model_max_length": 1024}, indent=2))
    print(f"wrote {out} ({sum(1 for _ in open(jsonl))} documents in {jsonl}, vocabulary "
          f"{tok.get_vocab_size()})")


def _round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


if __name__ == "__main__":
    main()
