"""A Hugging Face Llama, Mistral, Qwen2 or Mixtral `config.json` as partita's ModelConfig,
and back.

Torch-free: the run configuration reads a model folder's shape through this module
before any process starts. Only what partita's transformer computes identically is
accepted (the Llama network: RMSNorm, rotary positions, SwiGLU, grouped-query
attention, tied or untied embeddings, Llama 3.1's RoPE scaling; Mistral is that network
with an optional sliding window, Qwen2 that network with biases on q, k and v, Mixtral
Mistral's with every MLP a mixture of SwiGLU experts under a softmax top-k router); anything
else is an error that names the setting, so a model is never loaded into a network that
would run it differently.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from partita.errors import PartitaError
from partita.models.model_config import ModelConfig

# model_type -> the architecture transformers builds for it. Mistral's weights and
# math are Llama's (its sliding window aside), Qwen2's are Llama's plus q/k/v biases,
# Mixtral's are Mistral's with partita's mixture-of-experts block as every MLP.
FAMILIES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
            "qwen2": "Qwen2ForCausalLM", "mixtral": "MixtralForCausalLM"}


def config_path(folder: str | Path) -> Path:
    """The config.json of a model folder (or the file itself); an error when missing."""
    path = Path(folder)
    if not path.exists():
        # Also reached by `partita export` and `generate` on a run whose model folder
        # was moved after training: the run reads its model's shape from there.
        raise PartitaError(
            f"model.init_from='{folder}' does not exist; partita reads the model's shape "
            "(config.json) and, to train, its weights from that folder. Give the folder a "
            "Hugging Face model was saved to, or, for a run whose model folder was moved or "
            "deleted, restore the folder or set model.init_from in the run's config.toml "
            "to where it is now.")
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise PartitaError(
            f"model.init_from='{folder}' has no config.json; give the folder a Hugging Face "
            "model was saved to (save_pretrained), holding config.json and *.safetensors."
        )
    return path


def read_hf_config(folder: str | Path) -> dict[str, Any]:
    path = config_path(folder)
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise PartitaError(f"'{path}' cannot be read as JSON ({exc}); copy the model "
                           "folder again.") from None
    if not isinstance(data, dict):
        raise PartitaError(f"'{path}' does not hold a JSON object; copy the model folder again.")
    return data


# RoPE kinds whose scaling reads the pretraining length (transformers' default for it:
# max_position_embeddings).
_ORIGINAL_LENGTH_KINDS = ("llama3", "yarn", "longrope")


def _rope_entry(raw: Any, key: str, data: dict[str, Any], path: str) -> dict[str, Any]:
    """One RoPE dict of config.json as transformers completes it (`standardize_rope_params`):
    `type` is the older name of `rope_type`, in either key; theta falls back to the
    top-level rope_theta, then 10000."""
    if not isinstance(raw, dict):
        raise PartitaError(f"'{path}' has {key}={raw!r}, not a JSON object; copy the model "
                           "folder again.")
    entry = {k: v for k, v in raw.items() if k != "type"}
    entry["rope_type"] = raw.get("rope_type") or raw.get("type") or "default"
    if entry.get("rope_theta") is None:
        top = data.get("rope_theta")
        entry["rope_theta"] = 10000.0 if top is None else top
    if entry["rope_type"] in _ORIGINAL_LENGTH_KINDS:
        entry.setdefault("original_max_position_embeddings",
                         data.get("max_position_embeddings", 2048))
    return entry


def rope_settings(data: dict[str, Any], path: str | Path = "config.json") -> dict[str, Any]:
    """RoPE theta and scaling, from either the current `rope_parameters` or the older
    `rope_theta` + `rope_scaling` keys. Where both keys are given they must agree:
    transformers reads `rope_scaling` then and ignores `rope_parameters`, which other
    tools read, so a config whose two keys differ has no one meaning."""
    given = {key: _rope_entry(data[key], key, data, str(path))
             for key in ("rope_parameters", "rope_scaling") if data.get(key)}
    if len(given) == 2 and given["rope_parameters"] != given["rope_scaling"]:
        params, scaling = given["rope_parameters"], given["rope_scaling"]
        differ = [f"{k}={params.get(k)!r} in rope_parameters but {scaling.get(k)!r} in "
                  "rope_scaling" for k in sorted(set(params) | set(scaling))
                  if params.get(k) != scaling.get(k)]
        raise PartitaError(
            f"'{path}' gives RoPE both as rope_parameters and rope_scaling, and they "
            f"disagree: {'; '.join(differ)}. transformers reads rope_scaling, other tools "
            "rope_parameters, so the model's positions are ambiguous; delete the key that "
            "does not describe the model from config.json.")
    entry = given.get("rope_scaling") or given.get("rope_parameters") or _rope_entry(
        {}, "rope_parameters", data, str(path))
    return {"theta": float(entry["rope_theta"]), "kind": entry["rope_type"], **entry}


def model_config_from_hf(folder: str | Path, seed: int = 0) -> ModelConfig:
    """The ModelConfig of the Hugging Face model in `folder`; PartitaError (naming the
    file and the setting) for anything partita would compute differently."""
    data = read_hf_config(folder)
    path = config_path(folder)
    archs = data.get("architectures") or []
    model_type = data.get("model_type")
    if model_type in FAMILIES and any(a != FAMILIES[model_type] for a in archs):
        raise PartitaError(
            f"'{path}' names the architecture {', '.join(archs)} with model_type="
            f"{model_type!r}, which transformers builds as {FAMILIES[model_type]}: the "
            "two keys disagree, so the folder's model is ambiguous. Correct the one that "
            "does not describe the weights.")
    if model_type not in FAMILIES:
        known = ", ".join(f"{arch} (model_type {kind!r})" for kind, arch in FAMILIES.items())
        raise PartitaError(
            f"'{path}' describes {', '.join(archs) or model_type!r} (model_type={model_type!r}); "
            f"partita imports {known}. Convert the model, or train a catalog model "
            "(model.name)."
        )
    need = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
            "num_attention_heads")
    missing = [k for k in need if not isinstance(data.get(k), int)]
    if missing:
        raise PartitaError(f"'{path}' lacks integer {', '.join(missing)}; it is not a "
                           "complete Llama config.")
    problems = []
    if data.get("quantization_config"):
        method = data["quantization_config"]
        method = method.get("quant_method", "?") if isinstance(method, dict) else method
        problems.append(f"quantization_config (quant_method {method!r}: its weights are "
                        "stored quantised with scales, which partita does not apply; "
                        "import the model's unquantised release)")
    if data.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act={data['hidden_act']!r} (partita's MLP is SwiGLU: 'silu')")
    for key in ("attention_bias", "mlp_bias"):
        if data.get(key):
            problems.append(f"{key}=true (partita's Llama has no biases)")
    experts = _mixtral_experts(data, problems) if model_type == "mixtral" else {}
    # A window on every layer (Mistral's, Mixtral's, some Qwen2s') is kept: partita
    # trains at data.seq_len up to it and exports it. A window on some layers is refused.
    window, every_layer = _sliding_window(data, model_type)
    if window and not every_layer:
        problems.append(
            f"sliding-window attention on some layers ({window}: each token of those sees "
            f"only the {window} before it, where partita's attention sees all "
            f"{data.get('max_position_embeddings')} positions; the two agree on sequences "
            "up to the window, so to train at data.seq_len <= the window, set "
            "\"use_sliding_window\": false in a copy of config.json)")
    heads, dim = data["num_attention_heads"], data["hidden_size"]
    head_dim = data.get("head_dim")
    if head_dim not in (None, dim // heads) or dim % heads:
        problems.append(f"head_dim={head_dim} other than hidden_size / num_attention_heads")
    rope = rope_settings(data, path)
    if rope["kind"] not in ("default", "llama3"):
        problems.append(f"RoPE scaling {rope['kind']!r} (supported: none, 'llama3')")
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        problems.append("partial_rotary_factor other than 1")
    if problems:
        raise PartitaError(f"'{path}' uses " + "; ".join(problems) + ", which partita's "
                           "transformer does not compute; it cannot be imported.")
    scaling = {}
    if rope["kind"] == "llama3":
        lacking = [k for k in ("factor", "low_freq_factor", "high_freq_factor")
                   if not isinstance(rope.get(k), (int, float))]
        if lacking:
            raise PartitaError(f"'{path}' asks for llama3 RoPE scaling without "
                               f"{', '.join(lacking)}; the model's config is incomplete "
                               "(copy it again from the model's release).")
        scaling = dict(rope_scaling="llama3", rope_factor=float(rope["factor"]),
                       rope_low_freq_factor=float(rope["low_freq_factor"]),
                       rope_high_freq_factor=float(rope["high_freq_factor"]),
                       rope_original_max_len=int(rope["original_max_position_embeddings"]))
    try:
        return ModelConfig(
            vocab_size=data["vocab_size"], dim=dim, n_layers=data["num_hidden_layers"],
            n_heads=heads, n_kv_heads=data.get("num_key_value_heads") or heads,
            ffn_dim=data["intermediate_size"],
            max_seq_len=int(data.get("max_position_embeddings", 2048)), flavour="llama",
            tie_embeddings=bool(data.get("tie_word_embeddings", False)),
            qkv_bias=model_type == "qwen2", attention_window=window or None,
            rope_theta=rope["theta"], norm_eps=float(data.get("rms_norm_eps", 1e-6)),
            init_std=float(data.get("initializer_range", 0.02)), seed=seed, **scaling,
            **experts)
    except PartitaError as exc:
        raise PartitaError(f"'{path}': {exc}") from None


def _mixtral_experts(data: dict[str, Any], problems: list[str]) -> dict[str, Any]:
    """ModelConfig's expert settings of a Mixtral config: every block a dropless mixture
    of num_local_experts SwiGLU experts of width intermediate_size, each token routed to
    its num_experts_per_tok most probable (softmax over the experts), their gate weights
    rescaled to sum to one, as partita's router does with router_norm_topk. Mixtral has
    no z-loss; its balance loss weight becomes model.aux_loss_weight (partita averages
    the balance loss per sequence, transformers over the batch: the same model,
    trained with a slightly different auxiliary loss)."""
    e, k = data.get("num_local_experts"), data.get("num_experts_per_tok")
    if not (isinstance(e, int) and isinstance(k, int) and 1 <= k <= e):
        problems.append(f"num_local_experts={e!r} and num_experts_per_tok={k!r} (whole "
                        "numbers, the second at most the first)")
        return {}
    if k == 1:
        problems.append("num_experts_per_tok=1 (Mixtral rescales a lone expert's gate "
                        "weight to one; partita keeps its probability, as Switch does)")
    if data.get("router_jitter_noise"):
        problems.append(f"router_jitter_noise={data['router_jitter_noise']} (partita's "
                        "router adds no noise to its input)")
    return dict(n_experts=e, top_k=k, moe_every=1, expert_ffn_dim=data["intermediate_size"],
                router_gating="softmax", router_norm_topk=True, shared_experts=0,
                capacity_factor=None, z_loss_weight=0.0,
                aux_loss_weight=float(data.get("router_aux_loss_coef", 0.02)))


def _mixtral_form(cfg: ModelConfig) -> str:
    """Why a mixture-of-experts `cfg` has no MixtralForCausalLM form ("" when it has)."""
    differ = [f"model.{key}={value!r} (Mixtral: {want!r})" for key, value, want in (
        ("moe_every", cfg.moe_every, 1), ("shared_experts", cfg.shared_experts, 0),
        ("router_gating", cfg.router_gating, "softmax"),
        ("router_norm_topk", cfg.router_norm_topk, True),
        ("capacity_factor", cfg.capacity_factor, None), ("qkv_bias", cfg.qkv_bias, False))
        if value != want]
    if cfg.top_k == 1:
        differ.append("model.top_k=1 (Mixtral rescales a lone expert's weight to one)")
    return "; ".join(differ)


def _sliding_window(data: dict[str, Any], model_type: str) -> tuple[int | None, bool]:
    """The attention window of the config's windowed layers, where it is shorter than the
    model's positions (None: every layer attends to all positions, as partita's do), and
    whether every layer has it. Mistral and Mixtral window every layer when
    sliding_window is set; Qwen2 the layers `layer_types` names "sliding_attention", or
    in configs written before that key, layers from max_window_layers on when
    use_sliding_window is true."""
    window = data.get("sliding_window")
    if model_type == "llama" or not isinstance(window, int) or isinstance(window, bool):
        return None, True
    if window >= int(data.get("max_position_embeddings", 2048)):
        return None, True
    if model_type != "qwen2":
        return window, True
    layers = data["num_hidden_layers"]
    kinds = data.get("layer_types")
    if isinstance(kinds, list):
        windowed = [kind == "sliding_attention" for kind in kinds]
    else:
        first = data.get("max_window_layers", 0)
        first = first if isinstance(first, int) else 0
        windowed = [bool(data.get("use_sliding_window")) and i >= first for i in range(layers)]
    if not any(windowed):
        return None, True
    return window, all(windowed)


def check_exportable(cfg: ModelConfig) -> None:
    """PartitaError unless `cfg` has a transformers LlamaForCausalLM form: a dense
    llama-flavoured model (checked before training when train.export = "hf", and first
    by `partita export`)."""
    why = ""
    if cfg.flavour != "llama":
        why = f"model.flavour='{cfg.flavour}' has no Hugging Face Llama equivalent"
    elif cfg.moe and _mixtral_form(cfg):
        why = (f"a mixture-of-experts model (model.n_experts={cfg.n_experts}) with "
               f"{_mixtral_form(cfg)} has no Hugging Face Mixtral equivalent")
    if why:
        raise PartitaError(
            f"{why}; only llama-flavoured models, dense or with Mixtral's experts, export "
            "to the 'hf' format. The "
            "run's own weights (model.safetensors, or `partita checkpoint export`) hold "
            "every tensor; for a training run, leave train.export unset."
        )


def hf_config_from_model(cfg: ModelConfig, dtype: str = "float32",
                         bos_token_id: int | None = None,
                         eos_token_id: int | list[int] | None = None,
                         pad_token_id: int | None = None) -> dict[str, Any]:
    """The config.json of `cfg` as a transformers LlamaForCausalLM, Qwen2ForCausalLM for a
    model with q/k/v biases, MixtralForCausalLM for one with experts, MistralForCausalLM
    for a dense one with an attention window (an imported Mistral without one exports as
    the Llama it computes)."""
    check_exportable(cfg)
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    older: dict[str, Any] = {}  # the same, for tools that predate rope_parameters
    if cfg.rope_scaling == "llama3":
        rope.update(rope_type="llama3", factor=cfg.rope_factor,
                    low_freq_factor=cfg.rope_low_freq_factor,
                    high_freq_factor=cfg.rope_high_freq_factor,
                    original_max_position_embeddings=cfg.rope_original_max_len)
        older["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
    family: dict[str, Any] = {"attention_bias": False, "mlp_bias": False}
    kind = ("mixtral" if cfg.moe else "qwen2" if cfg.qkv_bias
            else "mistral" if cfg.attention_window else "llama")
    if kind == "qwen2":  # no attention_bias key: Qwen2 always has its q/k/v biases
        windowed = cfg.attention_window is not None  # on every layer
        family = {"use_sliding_window": windowed, "sliding_window": cfg.attention_window,
                  "max_window_layers": 0 if windowed else cfg.n_layers,
                  "layer_types": [("sliding" if windowed else "full") + "_attention"]
                  * cfg.n_layers}
    if kind == "mistral":
        family = {"sliding_window": cfg.attention_window}
    if kind == "mixtral":
        family = {"num_local_experts": cfg.n_experts, "num_experts_per_tok": cfg.top_k,
                  "router_aux_loss_coef": cfg.aux_loss_weight, "router_jitter_noise": 0.0,
                  "output_router_logits": False, "sliding_window": cfg.attention_window}
    return {**older, **family,
        "architectures": [FAMILIES[kind]], "model_type": kind,
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.dim,
        "intermediate_size": cfg.expert_hidden if cfg.moe else cfg.ffn_hidden,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.kv_heads,
        "head_dim": cfg.head_dim, "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm_eps, "rope_parameters": rope,
        "rope_theta": cfg.rope_theta,  # read by tools that predate rope_parameters
        "tie_word_embeddings": cfg.tie_embeddings, "hidden_act": "silu",
        "attention_dropout": 0.0,
        "initializer_range": cfg.init_std, "bos_token_id": bos_token_id,
        "eos_token_id": eos_token_id, "pad_token_id": pad_token_id, "use_cache": True,
        "dtype": dtype, "torch_dtype": dtype,
    }
