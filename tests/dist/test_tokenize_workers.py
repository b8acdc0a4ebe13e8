"""Documents encoded by spawned worker processes (`data.workers > 1`) come back exactly
as one process encodes them: order kept across many batches, BOS/EOS framing included."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("tokenizers")
from partita.data.hf_tokenizer import HFTokenizer, encode_parallel  # noqa: E402
from tests.unit.test_hf_data import DOCS, make_tokenizer  # noqa: E402


def test_worker_processes_encode_like_one_process(tmp_path):
    tok = HFTokenizer(make_tokenizer(tmp_path / "tok"))
    docs = [f"{i}: {d}" for i, d in enumerate(DOCS * 5)]
    # ~1 kB batches: 2 workers share about 40 of them, more than the 4 kept in flight.
    one = list(encode_parallel(tok, iter(docs), workers=1, batch_bytes=1000))
    two = list(encode_parallel(tok, iter(docs), workers=2, batch_bytes=1000))
    assert len(one) == len(two) == len(docs)
    assert all(np.array_equal(a, b) for a, b in zip(one, two))
    assert one[0][0] == tok.bos_id and one[0][-1] == tok.eos_id


def test_a_worker_process_imports_no_torch():
    """A spawned worker imports the tokenizer's module to unpickle its task; importing
    torch there cost each worker 8-12 s on a loaded 2-core machine, more than the
    built-in corpus takes to encode."""
    import subprocess
    import sys

    probe = "import sys, partita.data.hf_tokenizer; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
