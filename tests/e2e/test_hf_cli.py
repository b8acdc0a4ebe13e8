"""The fine-tuning example of docs/usage.md, small: a Llama folder with its tokenizer
(tools/make_small_llama.py), `partita train` at tp=2 on a JSONL file with
`train.export=hf`, transformers loading the export and its tokenizer, and
`partita export` writing the same files."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

TOOL = Path(__file__).parents[2] / "tools" / "make_small_llama.py"


def test_fine_tune_a_llama_folder_at_tp2_and_export_it(tmp_path, cli):
    docs = tmp_path / "docs.jsonl"
    docs.write_text("".join(json.dumps({"text": f"def f{i}(x):\n    return x * {i}\n"}) + "\n"
                            for i in range(400)))
    model = tmp_path / "llama"
    made = subprocess.run([sys.executable, str(TOOL), "--out", str(model), "--jsonl",
                           str(docs), "--vocab", "300", "--dim", "32", "--layers", "2"],
                          capture_output=True, text=True, timeout=120)
    assert made.returncode == 0, made.stderr[-2000:]
    run = tmp_path / "run"
    result = cli("train", "--nproc", "2", f"--model.init_from={model}",
                 f"--data.tokenizer={model}", f"--data.source={docs}", "--data.seq_len=32",
                 "--data.workers=1", f"--data.cache_dir={tmp_path / 'cache'}",
                 "--parallel.tp=2", "--train.steps=3", "--train.global_batch=4",
                 "--train.eval_every=3", "--train.eval_batches=1", "--train.threads=1",
                 "--metrics.tensorboard=false", "--train.export=hf", f"--train.out_dir={run}")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "done: 3 steps" in result.stdout
    hf = run / "hf"
    loaded, info = transformers.AutoModelForCausalLM.from_pretrained(
        hf, output_loading_info=True)
    assert {k: v for k, v in info.items() if v} == {}
    tokenizer = transformers.AutoTokenizer.from_pretrained(hf)
    ids = tokenizer("def f3(x):", return_tensors="pt").input_ids
    assert loaded.generate(ids, max_new_tokens=4, do_sample=False).shape[1] == ids.shape[1] + 4
    assert loaded.config.bos_token_id == tokenizer.bos_token_id is not None
    # A prompt starts with BOS, as partita framed every training document.
    assert ids[0, 0].item() == tokenizer.bos_token_id
    # `partita export` of the same run writes the same files; an existing folder is refused.
    again = cli("export", str(run), "--format", "hf", "--out", str(tmp_path / "again"))
    assert again.returncode == 0, again.stderr
    for path in hf.iterdir():
        assert (tmp_path / "again" / path.name).read_bytes() == path.read_bytes(), path.name
    refused = cli("export", str(run), "--out", str(tmp_path / "again"))
    assert refused.returncode == 2 and "not empty" in refused.stderr
