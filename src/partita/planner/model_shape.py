"""The model as the planner sees it: a `ModelConfig` plus an optional mixture of experts.

`ModelConfig` describes dense models. Expert parallelism needs to know how many
experts replace each MLP, so the planner reads an optional `[moe]` table next to
`[model]` in a config file (`num_experts`, `top_k`, `expert_ffn_dim`). Per-GPU
parameter counts split each block into what tensor parallelism shards, what it
replicates (norms, row-parallel biases) and what lives in experts.
"""

from __future__ import annotations

import dataclasses
import tomllib
import typing
from dataclasses import dataclass
from pathlib import Path

from partita.config_ranges import AT_LEAST_1, POSITIVE, RANGES
from partita.config_values import convert_value, read_user_file
from partita.errors import PartitaError, did_you_mean, pair_hint
from partita.models.catalog import MODELS, get_model_config
from partita.models.model_config import ModelConfig
from partita.planner.memo import memoised


@dataclass(frozen=True)
class MoEShape:
    num_experts: int = 1  # 1: a dense model
    top_k: int = 1
    expert_ffn_dim: int | None = None  # None: the model's ffn_hidden

    def __post_init__(self) -> None:
        if self.num_experts < 1 or not 1 <= self.top_k <= self.num_experts:
            raise PartitaError(
                f"moe: num_experts={self.num_experts}, top_k={self.top_k}: need "
                "1 <= top_k <= num_experts."
            )


@dataclass(frozen=True)
class PlanModel:
    name: str
    config: ModelConfig
    moe: MoEShape = MoEShape()

    def __post_init__(self) -> None:
        # One description of the experts for both: an MoE catalog model (n_experts in its
        # config) gives the [moe] shape; a [moe] table gives the config's experts (so
        # the layout rules, which read the config, see them).
        c = self.config
        if c.n_experts and not self.is_moe:
            object.__setattr__(self, "moe", MoEShape(c.n_experts, c.top_k, c.expert_ffn_dim))
        elif self.is_moe and not c.n_experts:
            object.__setattr__(self, "config", dataclasses.replace(
                c, n_experts=self.moe.num_experts, top_k=self.moe.top_k,
                expert_ffn_dim=self.moe.expert_ffn_dim))

    @property
    def is_moe(self) -> bool:
        return self.moe.num_experts > 1

    @property
    def expert_ffn(self) -> int:
        return self.moe.expert_ffn_dim or self.config.ffn_hidden

    @memoised()  # in a search, one object: memoised terms know a model by identity
    def dense_blocks(self) -> PlanModel:
        """This model as its dense blocks see it (an MoE model with moe_every > 1 has
        both kinds): the same shapes, no experts."""
        if not self.is_moe:
            return self
        return PlanModel(self.name, dataclasses.replace(self.config, n_experts=0), MoEShape())

    def moe_layers(self, first: int, count: int) -> int:
        """How many of blocks first .. first+count-1 are MoE."""
        if not self.is_moe or count <= 0:
            return 0
        c = self.config
        if not c.moe:  # experts from a [moe] table: in every block
            return count
        # Block i is MoE when (i + 1) % moe_every == 0 (`ModelConfig.is_moe_layer`): the
        # multiples of moe_every among first+1 .. first+count, counted without a loop
        # (the search asks for each stage of each layout).
        return (first + count) // c.moe_every - first // c.moe_every

    # Per-block parameter counts, as one tensor-parallel rank holds them -------------
    def mlp_params(self, ffn: int) -> int:
        c = self.config
        return (3 if c.gated_mlp else 2) * c.dim * ffn

    def block_split(self, tp: int, whole_kv: bool = False, moe: bool = True,
                    experts_over_tp: bool = False) -> dict[str, float]:
        """Parameters of one block on one tp rank: sharded, replicated, expert (the
        experts of this tp rank, before ep divides them).

        An MoE block (`moe`, on an MoE model) is replicated over tp except attention, as
        partita's expert parallelism runs it: router, shared experts and experts whole;
        with `experts_over_tp` (parallel.moe_tp "experts" or "hidden") the tp ranks split
        the experts (or their widths) and the shared experts' width, and only the router
        stays whole.

        K/V projections with fewer kv heads than tp ranks are replicated so that each
        rank still holds the kv head its query heads use (`whole_kv`: every kv head, as
        partita's tensor parallelism keeps them).
        """
        c = self.config
        d, hd = c.dim, c.head_dim
        kv_per_rank = -(-c.kv_heads // tp) * hd  # ceil: replicated when tp > kv_heads
        if whole_kv and c.kv_heads % tp:
            kv_per_rank = c.kv_heads * hd
        attn = (2 * d * d) / tp + 2 * d * kv_per_rank
        col_bias = (d / tp + 2 * kv_per_rank) if c.has_qkv_bias else 0.0
        replicated = 2 * d * (2 if c.flavour == "gpt2" else 1)  # two norms (weight[, bias])
        replicated += 2 * d if c.has_bias else 0  # row-parallel biases: out-proj, fc2
        if self.is_moe and moe:
            router = d * self.moe.num_experts
            shared = c.shared_experts * self.mlp_params(self.expert_ffn)
            expert = self.moe.num_experts * (self.mlp_params(self.expert_ffn)
                                             + (self.expert_ffn if c.has_bias else 0))
            if experts_over_tp and tp > 1:
                return {"sharded": attn + col_bias + shared / tp,
                        "replicated": replicated + router, "expert": expert / tp}
            return {"sharded": attn + col_bias, "replicated": replicated + router + shared,
                    "expert": expert}
        mlp = self.mlp_params(c.ffn_hidden) / tp + (c.ffn_hidden / tp if c.has_bias else 0)
        return {"sharded": attn + col_bias + mlp, "replicated": replicated, "expert": 0.0}

    def total_params(self) -> float:
        c = self.config
        blocks = 0.0
        for i in range(c.n_layers):
            b = self.block_split(1, moe=c.is_moe_layer(i) or not c.moe)
            blocks += b["sharded"] + b["replicated"] + b["expert"]
        return c.embedding_param_count() + c.head_param_count() + blocks

    @memoised()  # a search asks for every layout's FLOPs: one number per model
    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token, no recompute: 6 * matmul params + 12*L*H*Q*T."""
        c = self.config
        dense = c.flops_per_token(seq_len)
        if not self.is_moe or c.moe:  # the config counts its own active experts
            return dense
        delta = c.n_layers * (self.moe.top_k * self.mlp_params(self.expert_ffn)
                              - self.mlp_params(c.ffn_hidden))
        return dense + 6 * delta


def resolve_model(name_or_path: str) -> PlanModel:
    """A catalog name (`llama3-70b`), a TOML file with `[model]` (and optional `[moe]`),
    or a Hugging Face model folder (its config.json, as `model.init_from` reads it)."""
    path = Path(name_or_path)
    if path.is_dir() or path.name == "config.json":
        from partita.models.hf_config import model_config_from_hf

        folder = path if path.is_dir() else path.parent
        if not (folder / "config.json").is_file():
            raise PartitaError(
                f"model '{name_or_path}' is a folder without config.json; give a Hugging "
                "Face model folder (config.json and its weights), a TOML file with a "
                f"[model] table, or a catalog name ({', '.join(MODELS)}).")
        return PlanModel(folder.name, model_config_from_hf(folder))
    if name_or_path.endswith(".toml") or path.is_file():
        text = read_user_file(path, "model config file",
                              "give a TOML file with a [model] table, or a catalog name",
                              missing=f"Known models: {', '.join(MODELS)}")
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise PartitaError(f"model config '{name_or_path}' is not valid TOML: {exc}.") from None
        if "model" not in data:
            raise PartitaError(
                f"model config '{name_or_path}' has no [model] table of ModelConfig fields."
            )
        for section in ("model", "moe"):
            if not isinstance(data.get(section, {}), dict):
                raise PartitaError(
                    f"model config '{name_or_path}': '{section}' = {data[section]!r} is "
                    f"{_kind_of(data[section])}, not a [{section}] table; write the "
                    f"settings under a [{section}] line, e.g. [model] then n_layers = 8."
                )
        experts = _experts_from(data.get("moe", {}), name_or_path)
        # Same [model] table as a training config: an optional catalog `name` whose
        # shape the other fields override (so a run's config.toml plans as it trained).
        # Each value is read as `partita train` reads it: its type, then its range.
        table = {k: (_read_value(k, v, f"model config '{name_or_path}', [model] {k} = "
                                       f"{v!r}") if k in _TYPES else v)
                 for k, v in data["model"].items()}
        table = {k: (str(v) if k in ("name", "init_from") else v) for k, v in table.items()}
        init_from = table.pop("init_from", "")  # a run's config.toml always has it
        if init_from:  # the shape of the Hugging Face folder the run started from
            from partita.models.hf_config import model_config_from_hf

            base = model_config_from_hf(init_from)
        elif "name" in table:
            base = get_model_config(table.pop("name"))
        else:  # the whole shape, as --model-shape gives it: no default changes the answer
            missing = [k for k in REQUIRED_SHAPE if k not in table]
            if missing:
                raise PartitaError(
                    f"model config '{name_or_path}' names no catalog model ([model] name) "
                    f"and no init_from, so it gives the whole shape: add "
                    f"{', '.join(missing)} to its [model] table (or name = \"...\", a "
                    "catalog model whose shape the other fields override).")
            base = ModelConfig()
        table.pop("name", None)
        _check_experts(data["model"], data.get("moe", {}), name_or_path, base.moe)
        shape_of_experts = sorted(set(experts) - {"n_experts"})  # top_k, expert_ffn_dim
        if shape_of_experts and not experts.get("n_experts",
                                                table.get("n_experts", base.n_experts)):
            raise PartitaError(
                f"model config '{name_or_path}', [moe] {', '.join(shape_of_experts)}: "
                "this model has no experts for them to describe; give num_experts > 1 "
                "in [moe] (or [model] n_experts).")
        # The [moe] table overrides the base's experts as [model] fields would: one
        # description of them, which PlanModel reads back as its MoEShape.
        return PlanModel(path.stem, ModelConfig.from_dict({**base.to_dict(), **table,
                                                           **experts}))
    return PlanModel(name_or_path, get_model_config(name_or_path))


def _check_experts(model: dict, moe: dict, source: str, base_has_experts: bool) -> None:
    """Experts given once, with their top_k: [model] n_experts and [moe] num_experts
    name the same count (one would silently win), and top_k sets the expert compute and
    traffic, so it is not filled in unseen (a base model with experts has its own)."""
    where = f"model config '{source}'"
    if "n_experts" in model and "num_experts" in moe:
        raise PartitaError(f"{where} gives the experts twice, [model] n_experts = "
                           f"{model['n_experts']!r} and [moe] num_experts = "
                           f"{moe['num_experts']!r}; keep one of them.")
    if "top_k" in model and "top_k" in moe:
        raise PartitaError(f"{where} gives top_k twice, in [model] and [moe]; keep one.")
    for table, count, name in ((moe, "num_experts", "[moe]"), (model, "n_experts", "[model]")):
        experts = table.get(count)
        if (isinstance(experts, int) and experts > 1 and "top_k" not in model
                and "top_k" not in moe and not base_has_experts):
            raise PartitaError(f"{where}, {name} {count} = {experts} without top_k: give "
                               f"top_k in {name} too (the experts each token is routed "
                               "to; it sets the expert compute and traffic).")


def _experts_from(table: dict, source: str) -> dict[str, object]:
    """A [moe] table as the `ModelConfig` fields it sets (num_experts is n_experts; one
    expert is a dense model, n_experts 0)."""
    known = set(MoEShape.__dataclass_fields__)
    unknown = sorted(set(table) - known)
    if unknown:
        raise PartitaError(
            f"model config '{source}', [moe]: unknown setting '{unknown[0]}'."
            f"{did_you_mean(unknown[0], known)} Settings: {', '.join(sorted(known))}."
        )
    values = {k: _read_value(k, v, f"model config '{source}', [moe] {k} = {v!r}")
              for k, v in table.items()}
    if "num_experts" in values:
        experts = values.pop("num_experts")
        values["n_experts"] = experts if experts > 1 else 0
    return values


# `--model-shape` names: short ones first, then every ModelConfig field by its own name.
SHAPE_NAMES = {"layers": "n_layers", "hidden": "dim", "heads": "n_heads",
               "kv_heads": "n_kv_heads", "vocab": "vocab_size", "seq": "max_seq_len",
               "ffn": "ffn_dim", "tie": "tie_embeddings",
               # ModelConfig's name for the expert count: the [moe] one, so that either
               # spelling describes the same experts and needs top_k alike.
               "n_experts": "num_experts"}


# What a shape must give (`--model-shape`, a model file without a catalog name).
REQUIRED_SHAPE = ("n_layers", "dim", "n_heads", "vocab_size", "max_seq_len")


def parse_model_shape(text: str) -> PlanModel:
    """`layers=96,hidden=12288,heads=96,vocab=51200,seq=2048,flavour=gpt2` -> PlanModel.

    layers, hidden, heads, vocab and seq are required (no silent defaults), and top_k
    with num_experts; the rest (kv_heads, ffn, flavour, dropout, tie, expert_ffn_dim)
    optional.
    """
    fields_ = set(ModelConfig.__dataclass_fields__)
    moe_fields = set(MoEShape.__dataclass_fields__)
    known = sorted(set(SHAPE_NAMES) | fields_ | moe_fields)
    model: dict[str, object] = {}
    moe: dict[str, object] = {}
    given: dict[str, str] = {}  # setting -> the item that set it
    for item in text.replace(" ", ",").split(","):
        if not item:
            continue
        key, sep, raw = item.partition("=")
        key = key.strip().lower()
        name = SHAPE_NAMES.get(key, key)
        if not sep or (name not in fields_ and name not in moe_fields):
            raise PartitaError(
                f"--model-shape: cannot read '{item}'.{pair_hint(key, known)} Write "
                f"name=value pairs among {', '.join(known)}."
            )
        if name in given:  # a later value (or another spelling) would silently win
            raise PartitaError(f"--model-shape gives {name} twice ('{given[name]}' and "
                               f"'{item}'); give each setting once, by one name.")
        given[name] = item
        raw = raw.strip()
        if name == "flavour":
            raw = raw.lower()
        value = _read_value(name, raw, f"--model-shape {key}={raw}", key)
        (moe if name in moe_fields else model)[name] = value
    missing = [k for k in ("layers", "hidden", "heads", "vocab", "seq")
               if SHAPE_NAMES[k] not in model]
    if missing:
        raise PartitaError(f"--model-shape: give {', '.join(missing)} too (a shape has no "
                           "defaults, so that none changes the answer unseen).")
    if int(moe.get("num_experts", 1)) > 1 and "top_k" not in moe:
        raise PartitaError(f"--model-shape {given['num_experts']}: give top_k with "
                           "num_experts (the experts each token is routed to; it sets the "
                           "expert compute and traffic).")
    model.setdefault("tie_embeddings", model.get("flavour") == "gpt2")
    name = f"custom-{model['n_layers']}x{model['dim']}"
    return PlanModel(name, ModelConfig(**model), MoEShape(**moe))


# The type of every setting a model table or `--model-shape` may give ([moe] names
# included), and ranges beyond partita train's (config_ranges.RANGES) for the fields
# only the planner reads.
_TYPES: dict[str, object] = {**typing.get_type_hints(ModelConfig),
                             **typing.get_type_hints(MoEShape)}
_KINDS = {bool: "true or false", int: "an integer", float: "a number", str: "text"}


_EXTRA_RANGES = {"init_std": POSITIVE, "num_experts": AT_LEAST_1, "top_k": AT_LEAST_1,
                 "expert_ffn_dim": AT_LEAST_1}


def _kind_of(value: object) -> str:
    """What a TOML value is, in the words of the messages."""
    if isinstance(value, bool):
        return "true or false"
    if isinstance(value, dict):
        return "a table"
    if isinstance(value, list):
        return "a list"
    return _KINDS.get(type(value), "a value")


def _read_value(name: str, raw: object, label: str, key: str = "") -> object:
    """`raw` (a TOML value or `--model-shape` text) as setting `name`'s type, range
    checked: the conversion and ranges `partita train` applies to [model] (partita.config,
    partita.config_ranges), so plan and train accept the same values. `label` names
    the value in the message, `key` the setting as the user wrote it (default `name`)."""
    target = _TYPES[name]
    base = next((t for t in typing.get_args(target) if t is not type(None)), target)
    try:
        value = convert_value(f"model.{name}", raw, target)
    except PartitaError:
        # Text from the command line is all text: name the type only for TOML values.
        got = "" if label.startswith("--") else f" (got {_kind_of(raw)})"
        raise PartitaError(f"{label}: {key or name} must be {_KINDS[base]}{got}.") from None
    rule = RANGES.get(f"model.{name}") or _EXTRA_RANGES.get(name)
    if value is not None and rule is not None and not rule.ok(value):
        raise PartitaError(f"{label} is out of range: use {rule.text}.")
    limit = PLAN_LIMITS.get(name)
    if limit is not None and isinstance(value, int) and value > limit:
        raise PartitaError(f"{label} is out of range for the planner: use at most "
                           f"{limit:,} (far beyond any model trained; larger shapes "
                           "only make the search run for minutes).")
    return value


# Upper bounds of the shapes the planner takes, 16x or more the largest published
# models: a width in the billions makes the search run for minutes, and its per-stage
# sums grow with the square of the layers (2,048 layers on 131,072 GPUs: about 4 s).
# The sequence bound is --seq-len's.
PLAN_LIMITS = {"n_layers": 2048, "dim": 1 << 20, "n_heads": 1 << 16,
               "n_kv_heads": 1 << 16, "vocab_size": 1 << 24, "max_seq_len": 1 << 22,
               "ffn_dim": 1 << 22, "num_experts": 1 << 14, "n_experts": 1 << 14,
               "top_k": 1 << 14, "expert_ffn_dim": 1 << 22, "moe_every": 10_000,
               "shared_experts": 1 << 14}
