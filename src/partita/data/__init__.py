"""The data pipeline: corpora, tokenizers, cached token files and batch samplers.

Typical use (every rank):

    ds = load_dataset(None, cache_dir, seq_len=256)           # built-in corpus
    sampler = ds.train_sampler(global_batch, dp_rank, dp_size, seed)
    inputs, targets = next(sampler)                           # (G/D, seq_len) int64
"""

from partita.data.corpus import DEFAULT_STDLIB_BYTES, Corpus, stdlib_corpus, text_corpus
from partita.data.dataset import (
    TokenDataset,
    cache_path,
    load_dataset,
    load_mixture,
    prepare_tokens,
    split_tokens,
)
from partita.data.sampler import BatchSampler, eval_batches, num_windows
from partita.data.tokenfile import (
    TokenFileWriter,
    dtype_for_vocab,
    is_token_file,
    read_token_file,
    write_token_file,
)
from partita.data.tokenizer import ByteTokenizer, Tokenizer

__all__ = [
    "DEFAULT_STDLIB_BYTES", "BatchSampler", "ByteTokenizer", "Corpus", "TokenDataset",
    "TokenFileWriter", "Tokenizer", "cache_path", "dtype_for_vocab", "eval_batches",
    "is_token_file", "load_dataset", "load_mixture", "num_windows", "prepare_tokens", "read_token_file",
    "split_tokens", "stdlib_corpus", "text_corpus", "write_token_file",
]
