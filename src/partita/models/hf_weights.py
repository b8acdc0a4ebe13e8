"""Hugging Face Llama weights (Mistral's, Qwen2's and Mixtral's too) under partita's
names: the name map, the rotary permutation, and a reader that serves any slice of any
parameter from memory-mapped safetensors files.

Two conventions differ. Names: `model.layers.3.self_attn.q_proj.weight` is partita's
`blocks.3.attn.wq.weight` (see `hf_name`). Rotary pairs: partita rotates interleaved
pairs (x[2i], x[2i+1]) of each head while transformers rotates halves (x[i],
x[i + head_dim/2]), so the rows of every query and key head are permuted: partita's row
2i+t of a head is Hugging Face's row i + t*head_dim/2. Without it the model runs almost
right (loss equal to the third decimal) with logits visibly off. Mixtral's experts are
one tensor per expert and projection in the files and one stacked tensor per projection
in partita (`file_keys`).

`HFWeights` has the methods of a plan's `ParamInit` (`flat_slice`, `slice`, `full`), so
it replaces the random init in a model's plan: every rank then reads from the files only
the rows (tensor parallelism), stages (pipeline), experts (expert parallelism) and flat
ranges (ZeRO-3) it owns, via
safetensors' `safe_open(...).get_slice`, never a whole file.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import torch

from partita.errors import PartitaError
from partita.models.hf_config import check_exportable
from partita.models.model_config import ModelConfig

_ATTENTION = {
    "attn.wq": "self_attn.q_proj", "attn.wk": "self_attn.k_proj",
    "attn.wv": "self_attn.v_proj", "attn.wo": "self_attn.o_proj",
    "attn_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm",
}
_DENSE_MLP = {"mlp.w_gate": "mlp.gate_proj", "mlp.w_up": "mlp.up_proj",
              "mlp.w_down": "mlp.down_proj"}
# A mixture-of-experts block (Mixtral's files): the router, and each expert's SwiGLU
# projections as tensors of their own, where partita stacks every expert's into one
# tensor per projection (`file_keys`).
_ROUTER = {"mlp.router": "block_sparse_moe.gate"}
_EXPERTS = {"w_gate": "w1", "w_up": "w3", "w_down": "w2"}
_EXPERT_NAME = re.compile(r"blocks\.(\d+)\.mlp\.experts\.(w_gate|w_up|w_down)")


def _stacked_experts(name: str) -> bool:
    """Whether partita parameter `name` stacks every expert's projection (one file tensor
    per expert)."""
    return _EXPERT_NAME.fullmatch(name) is not None
_BLOCK = {**_ATTENTION, **_DENSE_MLP, **_ROUTER}
_TOP = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight"}
_BLOCK_NAME = re.compile(r"blocks\.(\d+)\.(.+)\.(weight|bias)")
# The projections that have biases in a model with model.qkv_bias (Qwen2's).
_BIASED = ("attn.wq", "attn.wk", "attn.wv")


def hf_name(name: str) -> str:
    """The Hugging Face name of partita parameter `name`."""
    if name in _TOP:
        return _TOP[name]
    m = _BLOCK_NAME.fullmatch(name)
    if m is None or m.group(2) not in _BLOCK or (m.group(3) == "bias"
                                                 and m.group(2) not in _BIASED):
        raise PartitaError(f"parameter '{name}' has no Hugging Face Llama equivalent.")
    return f"model.layers.{m.group(1)}.{_BLOCK[m.group(2)]}.{m.group(3)}"


def file_keys(name: str, cfg: ModelConfig) -> list[str]:
    """The Hugging Face tensors partita parameter `name` is made of: one, or for the
    stacked experts of a mixture-of-experts block one per expert, in expert order."""
    m = _EXPERT_NAME.fullmatch(name)
    if m is None:
        return [hf_name(name)]
    layer, file = m.group(1), _EXPERTS[m.group(2)]
    return [f"model.layers.{layer}.block_sparse_moe.experts.{e}.{file}.weight"
            for e in range(cfg.n_experts)]


def partita_names(cfg: ModelConfig) -> list[str]:
    """Every parameter name of partita's llama transformer of `cfg`."""
    names = ["tok_embeddings.weight"]
    for i in range(cfg.n_layers):
        moe = cfg.is_moe_layer(i)
        names += [f"blocks.{i}.{part}.weight"
                  for part in {**_ATTENTION, **(_ROUTER if moe else _DENSE_MLP)}]
        if moe:
            names += [f"blocks.{i}.mlp.experts.{part}" for part in _EXPERTS]
        if cfg.qkv_bias:
            names += [f"blocks.{i}.{part}.bias" for part in _BIASED]
    names.append("norm.weight")
    if not cfg.tie_embeddings:
        names.append("output.weight")
    return names


# The parameters with a row per vocabulary entry: partita stores cfg.padded_vocab_size
# rows (model.vocab_multiple), a Hugging Face folder cfg.vocab_size.
VOCAB_ROWS = ("tok_embeddings.weight", "output.weight")


def expected_shapes(cfg: ModelConfig, rows: int | None = None) -> dict[str, tuple[int, ...]]:
    """partita's parameter shapes of `cfg`; the vocabulary's `rows` (None: the padded
    vocabulary partita stores; cfg.vocab_size: as a Hugging Face folder holds them)."""
    d, kv, f = cfg.dim, cfg.kv_heads * cfg.head_dim, cfg.ffn_hidden
    v = cfg.padded_vocab_size if rows is None else rows
    e, h = cfg.n_experts, cfg.expert_hidden
    block = {"attn.wq": (d, d), "attn.wk": (kv, d), "attn.wv": (kv, d), "attn.wo": (d, d),
             "mlp.w_gate": (f, d), "mlp.w_up": (f, d), "mlp.w_down": (d, f),
             "attn_norm": (d,), "mlp_norm": (d,), "mlp.router": (e, d)}
    experts = {"w_gate": (e, h, d), "w_up": (e, h, d), "w_down": (e, d, h)}
    out = {"tok_embeddings.weight": (v, d), "norm.weight": (d,), "output.weight": (v, d)}
    for i in range(cfg.n_layers):
        out.update({f"blocks.{i}.{k}.weight": v for k, v in block.items()})
        out.update({f"blocks.{i}.{k}.bias": block[k][:1] for k in _BIASED})
        out.update({f"blocks.{i}.mlp.experts.{k}": v for k, v in experts.items()})
    return {n: out[n] for n in partita_names(cfg)}


def rotary_permuted(name: str) -> bool:
    """Whether the rows of `name` follow the rotary permutation: q and k's weights, and
    their biases, which are added before the rotation."""
    return name.endswith(("attn.wq.weight", "attn.wk.weight", "attn.wq.bias", "attn.wk.bias"))


def to_partita_rows(w: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Hugging Face (halves) row order of whole q/k heads -> partita's (interleaved)."""
    rest = w.shape[1:]
    return w.reshape(-1, 2, head_dim // 2, *rest).transpose(1, 2).reshape(w.shape)


def to_hf_rows(w: torch.Tensor, head_dim: int) -> torch.Tensor:
    """partita's (interleaved) row order of whole q/k heads -> Hugging Face's (halves)."""
    rest = w.shape[1:]
    return w.reshape(-1, head_dim // 2, 2, *rest).transpose(1, 2).reshape(w.shape)


def to_hf_state(state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """A full partita state dict as a transformers LlamaForCausalLM state dict: the
    rows of a padded vocabulary (model.vocab_multiple) past vocab_size are dropped, so
    the export is exactly the unpadded model."""
    # A model with no Llama form (GPT-2 flavour, experts) is named for what it is first;
    # comparing its tensor names below would blame the weights instead.
    check_exportable(cfg)
    expected = expected_shapes(cfg)
    missing = sorted(set(expected) - set(state))
    extra = sorted(set(state) - set(expected))
    if missing or extra:
        raise PartitaError(
            f"the weights do not match the model config: missing {missing[:3]}, unexpected "
            f"{extra[:3]}; export the weights of the run whose config.toml sits beside them."
        )
    out = {}
    for name, tensor in state.items():
        if tuple(tensor.shape) != expected[name]:
            raise PartitaError(f"'{name}' has shape {tuple(tensor.shape)} but the model "
                               f"config gives {expected[name]}.")
        t = to_hf_rows(tensor, cfg.head_dim) if rotary_permuted(name) else tensor
        if name in VOCAB_ROWS:
            t = t[:cfg.vocab_size]
        if _stacked_experts(name):
            out.update(zip(file_keys(name, cfg), (x.contiguous() for x in t)))
        else:
            out[hf_name(name)] = t.contiguous()
    return out


class HFWeights:
    """Slices of a Hugging Face Llama folder's weights under partita's names and layout.

    Opening reads only the safetensors headers: every tensor the config implies must be
    present with its shape (else PartitaError naming the file). Only a config that ties
    the head to the embeddings over files that also hold a head has both read whole at
    opening, to refuse a head that differs (`_check_tied_head`). Tensors are read lazily
    per slice; file handles open on first use in each process (the object pickles as its
    folder and config).
    """

    def __init__(self, folder: str | Path, cfg: ModelConfig) -> None:
        self.folder, self.cfg = Path(folder), cfg
        self.files = _weight_files(self.folder)
        self._handles: dict[Path, object] = {}
        self._check()

    def close(self) -> None:
        """Drop the file handles (and their mappings); later reads reopen them."""
        self._handles.clear()

    def __getstate__(self) -> dict:
        return {"folder": self.folder, "cfg": self.cfg, "files": self.files, "_handles": {}}

    def _open(self, path: Path):
        if path not in self._handles:
            from safetensors import safe_open

            try:
                self._handles[path] = safe_open(str(path), framework="pt")
            except Exception as exc:  # safetensors' own error type, or OSError
                raise PartitaError(f"the weights file '{path}' cannot be read ({exc}); it is "
                                   "missing, truncated or corrupt. Copy the model folder "
                                   "again.") from None
        return self._handles[path]

    def _check(self) -> None:
        for name, shape in expected_shapes(self.cfg, self.cfg.vocab_size).items():
            if _stacked_experts(name):
                shape = shape[1:]
            for key in file_keys(name, self.cfg):
                self._check_tensor(name, key, shape)
        if self.cfg.tie_embeddings and _TOP["output.weight"] in self.files:
            self._check_tied_head()

    def _check_tensor(self, name: str, key: str, shape: tuple[int, ...]) -> None:
        if key not in self.files:
            raise PartitaError(
                f"'{self.folder}' has no tensor '{key}' (partita's '{name}'), which its "
                "config.json implies; the folder is incomplete or its config does not "
                "belong to these weights.")
        part = self._part(key)
        # Floating point only: quantised or integer tensors would be cast as they
        # are, without their scales, and train silently as other weights.
        if part.get_dtype() not in FLOAT_DTYPES:
            raise PartitaError(
                f"'{self.files[key]}' holds '{key}' as {part.get_dtype()}, not floating "
                "point (a quantised or converted checkpoint); import the model's "
                "unquantised release (bf16, fp16 or fp32 weights).")
        got = tuple(part.get_shape())
        if got != shape:
            raise PartitaError(
                f"'{self.files[key]}' holds '{key}' of shape {got} but config.json "
                f"implies {shape}; the config does not belong to these weights.")

    def _part(self, key: str):
        """safetensors' lazy slice of tensor `key` (nothing read yet)."""
        try:
            return self._open(self.files[key]).get_slice(key)
        except Exception as exc:  # safetensors' own error type: the index is wrong
            raise PartitaError(
                f"'{self.files[key]}' does not hold '{key}', which the folder's index "
                f"places there ({exc}); the index does not belong to these files. Copy "
                "the model folder again.") from None

    def _check_tied_head(self) -> None:
        """A config that ties the head to the embeddings, over files that also hold a
        head: transformers computes with the file's head where it differs (it only
        warns), while partita would tie, train and export another model. A head equal
        to the embeddings is the tied model itself. Compared in blocks of rows, stopping
        at the first difference; folders without such a head read nothing here."""
        emb_key, head_key = _TOP["tok_embeddings.weight"], _TOP["output.weight"]
        emb, head = self._part(emb_key), self._part(head_key)
        shape = tuple(emb.get_shape())
        same = tuple(head.get_shape()) == shape
        step = max(1, (1 << 22) // max(1, math.prod(shape[1:])))
        for lo in range(0, shape[0], step):
            if not same:
                break
            same = torch.equal(head[lo:lo + step].to(torch.float64),
                               emb[lo:lo + step].to(torch.float64))
        if not same:
            raise PartitaError(
                f"'{self.folder}' holds '{head_key}', which differs from '{emb_key}', "
                "although its config.json ties them (tie_word_embeddings true): "
                "transformers computes this model with the file's head, partita would "
                "use the embeddings. To train the file's head, set \"tie_word_embeddings\": "
                "false in config.json; to tie the head to the embeddings, remove "
                f"'{head_key}' from the weights.")

    def _experts(self, name: str, lo: int, hi: int, dim: int = 0, start: int = 0,
                 stop: int | None = None) -> torch.Tensor:
        """Experts [lo, hi) of a stacked expert parameter, each cut to [start, stop) along
        its own dimension `dim` (1 or 2; 0: whole), read expert by expert."""
        parts = [self._part(key) for key in file_keys(name, self.cfg)[lo:hi]]
        if dim == 1:
            return torch.stack([part[start:stop] for part in parts])
        if dim == 2:
            return torch.stack([part[:, start:stop] for part in parts])
        return torch.stack([part[:] for part in parts])

    def _rows(self, name: str, lo: int, hi: int) -> torch.Tensor:
        """Rows [lo, hi) of parameter `name` in partita's row order (only those read)."""
        if _stacked_experts(name):
            return self._experts(name, lo, hi)
        key = hf_name(name)
        part = self._open(self.files[key]).get_slice(key)
        if name in VOCAB_ROWS and hi > self.cfg.vocab_size:
            # A padded vocabulary (model.vocab_multiple): its extra rows start at zero
            # (no token uses them; as head rows their logits are ignored).
            real = part[min(lo, self.cfg.vocab_size):self.cfg.vocab_size]
            pad = torch.zeros(hi - max(lo, self.cfg.vocab_size), *real.shape[1:],
                              dtype=real.dtype)
            return torch.cat([real, pad])
        if not rotary_permuted(name):
            return part[lo:hi]
        # A partita row's source lies in the same head: read whole heads, permute, cut.
        hd = self.cfg.head_dim
        h_lo, h_hi = lo // hd * hd, -(-hi // hd) * hd
        return to_partita_rows(part[h_lo:h_hi], hd)[lo - h_lo:hi - h_lo]

    # The ParamInit interface (dtype: the values keep the file's precision; the caller casts).
    def flat_slice(self, name: str, start: int, stop: int,
                   dtype: torch.dtype = torch.float32) -> torch.Tensor:
        shape = expected_shapes(self.cfg)[name]
        row = math.prod(shape[1:])
        lo, hi = start // row, -(-stop // row)
        return self._rows(name, lo, hi).reshape(-1)[start - lo * row:stop - lo * row]

    def slice(self, name: str, shape: tuple[int, ...], dim: int, start: int, stop: int,
              dtype: torch.dtype = torch.float32) -> torch.Tensor:
        if dim == 0:
            return self._rows(name, start, stop)
        if _stacked_experts(name):
            return self._experts(name, 0, shape[0], dim, start, stop)
        if name in VOCAB_ROWS:  # every row, with a padded vocabulary's zero rows
            return self._rows(name, 0, shape[0])[:, start:stop]
        key = hf_name(name)
        part = self._open(self.files[key]).get_slice(key)
        cols = part[:, start:stop]
        return to_partita_rows(cols, self.cfg.head_dim) if rotary_permuted(name) else cols

    def full(self, name: str, shape: tuple[int, ...],
             dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self._rows(name, 0, shape[0])


# safetensors' names of the dtypes a Llama's weights are released in.
FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")


def _weight_files(folder: Path) -> dict[str, Path]:
    """tensor name -> the safetensors file holding it (index or a single file)."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise PartitaError(f"'{index}' cannot be read ({exc}); copy the model folder "
                               "again.") from None
        if not isinstance(weight_map, dict) or not all(
                isinstance(v, str) for v in weight_map.values()):
            raise PartitaError(f"'{index}' has a weight_map that is not an object of tensor "
                               "name -> file name; copy the model folder again.")
        files = {name: folder / file for name, file in weight_map.items()}
        absent = sorted({str(p) for p in files.values() if not p.is_file()})
        if absent:
            raise PartitaError(
                f"'{index}' names {len(absent)} shard file(s) that are missing, e.g. "
                f"'{absent[0]}'; copy the whole model folder (every *.safetensors file).")
        return files
    single = folder / "model.safetensors"
    if not single.is_file():
        raise PartitaError(
            f"'{folder}' has neither model.safetensors nor model.safetensors.index.json; "
            "partita reads Hugging Face weights in the safetensors format only (convert "
            "a pytorch_model.bin with transformers' save_pretrained(safe_serialization=True)).")
    from safetensors import safe_open

    try:
        with safe_open(str(single), framework="pt") as f:
            return {name: single for name in f.keys()}
    except Exception as exc:
        raise PartitaError(f"the weights file '{single}' cannot be read ({exc}); it is "
                           "truncated or corrupt. Copy the model folder again.") from None
