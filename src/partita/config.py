"""Typed run configuration: a TOML file plus `--section.key=value` overrides.

Every setting has a type and a default here. Unknown sections or keys are errors that
name the closest valid key; values are converted to the field's type with an error
that names the key. The resolved configuration is written next to the run's outputs,
so any run can be repeated from its own directory.
"""

from __future__ import annotations

import copy
import dataclasses
import tomllib
import typing
from dataclasses import dataclass, field
from pathlib import Path

from partita.config_ranges import CANONICAL_DTYPE, check_ranges
from partita.config_sections import (
    DataSection,
    MetricsSection,
    ModelSection,
    ParallelSection,
    PrecisionSection,
    TrainSection,
)
from partita.config_values import bare_flag, convert_value, read_user_file
from partita.errors import PartitaError, did_you_mean, process_count_option
from partita.layout import SCHEDULE_ALIASES, Layout, canonical_schedule
from partita.models.catalog import get_model_config
from partita.models.model_config import ModelConfig


@dataclass
class Config:
    model: ModelSection = field(default_factory=ModelSection)
    data: DataSection = field(default_factory=DataSection)
    train: TrainSection = field(default_factory=TrainSection)
    parallel: ParallelSection = field(default_factory=ParallelSection)
    precision: PrecisionSection = field(default_factory=PrecisionSection)
    metrics: MetricsSection = field(default_factory=MetricsSection)

    @property
    def param_dtype_name(self) -> str:
        """The dtype parameters train in, by its full name (`bf16` -> `bfloat16`):
        precision.param_dtype, else train.dtype."""
        name = self.precision.param_dtype or self.train.dtype
        return CANONICAL_DTYPE.get(name, name)

    @property
    def reduce_dtype_name(self) -> str:
        """The dtype gradients are reduced in, by its full name: precision.reduce_dtype,
        else the parameters' dtype."""
        name = self.precision.reduce_dtype
        return CANONICAL_DTYPE.get(name, name) if name else self.param_dtype_name

    def model_config(self) -> ModelConfig:
        changes = {
            f.name: getattr(self.model, f.name)
            for f in dataclasses.fields(self.model)
            if f.name not in ("name", "init_from") and getattr(self.model, f.name) is not None
        }
        if self.model.init_from:
            from partita.models.hf_config import model_config_from_hf

            base = model_config_from_hf(self.model.init_from)
            # vocab_multiple pads the imported vocabulary with zero rows (hf_weights):
            # the folder's model, computed on aligned GEMMs.
            shape = sorted(set(changes) - {"dropout", "seed", "max_seq_len", "vocab_multiple",
                                           "attention"})
            if shape:
                raise PartitaError(
                    f"model.{shape[0]} cannot be set with model.init_from: the shape comes "
                    f"from '{self.model.init_from}'. Remove model.{shape[0]}, or edit the "
                    "folder's config.json."
                )
        else:
            base = get_model_config(self.model.name)
        cfg = dataclasses.replace(base, **changes)
        if self.data.seq_len > cfg.max_seq_len:
            cfg = dataclasses.replace(cfg, max_seq_len=self.data.seq_len)
        if cfg.attention_window is not None and self.data.seq_len > cfg.attention_window:
            source = (f"'{self.model.init_from}' (sliding_window in its config.json)"
                      if self.model.init_from else "model.attention_window")
            raise PartitaError(
                f"data.seq_len={self.data.seq_len} exceeds the model's attention window of "
                f"{cfg.attention_window} positions from {source}: each token attends only "
                "to that many, which partita's full causal attention computes only on "
                f"sequences that short. Train at data.seq_len <= {cfg.attention_window}.")
        return cfg

    def layout(self, world_size: int) -> Layout:
        """The `[parallel]` and `[train]` settings as a Layout for `world_size` processes.

        dp=0 becomes what the world leaves after tp*pp*cp; virtual_stages=0 the schedule's
        default; train.microbatches (a count) the microbatch size in sequences. Raises
        only when those cannot be resolved; `partita.layout_rules.validate` judges the rest.
        """
        # Zero or negative degrees would otherwise surface as a product that "does not
        # divide" the world; each is named at once instead.
        check_ranges(self, section_only="parallel")
        p, t = self.parallel, self.train
        other = p.tp * p.pp * p.cp
        dp = p.dp
        if dp == 0:
            if other < 1 or world_size % other:
                raise PartitaError(
                    f"tp*pp*cp={other} does not divide the world size {world_size}; start "
                    f"a multiple of {other} processes ({process_count_option(other)}) or choose degrees "
                    "whose product divides the number of processes."
                )
            dp = world_size // other
        elif dp * other != world_size:
            # Named before the batch: a batch that dp does not divide is a consequence.
            from partita.layout import Degrees
            from partita.layout_rules import world_size_message

            raise PartitaError(world_size_message(
                Degrees(dp=dp, tp=p.tp, pp=p.pp, cp=p.cp, ep=p.ep), world_size))
        schedule = canonical_schedule(p.schedule)
        virtual = p.virtual_stages or (2 if schedule == "interleaved-1f1b" and p.pp > 1 else 1)
        if dp < 1 or t.global_batch % dp:
            raise PartitaError(
                f"train.global_batch={t.global_batch} is not divisible by the {dp} "
                f"data-parallel replicas; choose a multiple of {dp}, or a number of "
                f"processes that leaves a data-parallel degree dividing {t.global_batch} "
                "(a resumed run keeps its global batch)."
            )
        local = t.global_batch // dp
        if t.microbatches < 1 or local % t.microbatches:
            raise PartitaError(
                f"each replica's batch of {local} sequences cannot be cut into "
                f"train.microbatches={t.microbatches} equal microbatches; choose a divisor "
                f"of {local}."
            )
        return Layout(dp=dp, tp=p.tp, pp=p.pp, cp=p.cp, ep=p.ep, zero_stage=p.zero_stage,
                      schedule=schedule, virtual_stages=virtual,
                      microbatch_size=local // t.microbatches,
                      sequence_parallel=p.sequence_parallel,
                      recompute=p.recompute, recompute_layers=p.recompute_layers,
                      offload=p.offload, tp_comm_overlap=p.tp_comm_overlap,
                      overlap_grad_reduce=p.overlap_grad_reduce,
                      overlap_param_gather=p.overlap_param_gather, cp_kind=p.cp_kind,
                      moe_tp=p.moe_tp)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_toml(self) -> str:
        """The settings as TOML; a deprecated schedule name as its current one (the
        launched processes read this, and the run's config.toml is written from it)."""
        data = self.to_dict()
        old = str(data["parallel"]["schedule"]).strip().lower()
        data["parallel"]["schedule"] = SCHEDULE_ALIASES.get(old, data["parallel"]["schedule"])
        lines = []
        for section, values in data.items():
            lines.append(f"[{section}]")
            for key, value in values.items():
                if value is not None:
                    lines.append(f"{key} = {_toml_value(value)}")
            lines.append("")
        return "\n".join(lines)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_toml())


def layout_overrides(layout: Layout, global_batch: int) -> list[str]:
    """The `partita train` settings that run `layout` with `global_batch` sequences per
    step (the inverse of `Config.layout`)."""
    m = layout.microbatches(global_batch)
    if not m:
        raise PartitaError(
            f"global batch {global_batch} does not divide into dp={layout.dp} replicas of "
            f"microbatches of {layout.microbatch_size} sequences."
        )
    out = [f"--parallel.{k}={getattr(layout, k)}" for k in ("dp", "tp", "pp", "cp", "ep",
                                                            "zero_stage")]
    if layout.pp > 1:
        out += [f"--parallel.schedule={layout.schedule}",
                f"--parallel.virtual_stages={layout.virtual_stages}"]
    out += [f"--parallel.sequence_parallel={'true' if layout.sequence_parallel else 'false'}",
            f"--train.global_batch={global_batch}", f"--train.microbatches={m}"]
    if layout.recompute != "none":
        out += [f"--parallel.recompute={layout.recompute}",
                f"--parallel.recompute_layers={layout.recompute_layers}"]
    if layout.offload != "none":
        out.append(f"--parallel.offload={layout.offload}")
    if layout.cp > 1 and layout.cp_kind != "ring":
        out.append(f"--parallel.cp_kind={layout.cp_kind}")
    if layout.moe_tp != "replicate":
        out.append(f"--parallel.moe_tp={layout.moe_tp}")
    # The overlap options where the layout departs from train's defaults (a plan that
    # assumed a reduction after backward must not train with it overlapped).
    defaults = ParallelSection()
    for option in ("tp_comm_overlap", "overlap_grad_reduce", "overlap_param_gather"):
        value = getattr(layout, option)
        if value != getattr(defaults, option):
            out.append(f"--parallel.{option}={'true' if value else 'false'}")
    return out


def _toml_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return repr(value)


def _sections() -> dict[str, type]:
    return {f.name: f.default_factory().__class__ for f in dataclasses.fields(Config)}


def _all_keys() -> list[str]:
    return [f"{s}.{f.name}" for s, cls in _sections().items() for f in dataclasses.fields(cls)]


def _field_type(section: str, key: str) -> type:
    hints = typing.get_type_hints(_sections()[section])
    return hints[key]


# What other trainers call some settings (Hugging Face's TrainingArguments, Megatron-LM,
# DeepSpeed, torchtitan), for the message that names partita's key instead.
PEER_NAMES = {
    "learning_rate": "train.lr", "max_steps": "train.steps", "train_iters": "train.steps",
    "training_steps": "train.steps", "batch_size": "train.global_batch",
    "global_batch_size": "train.global_batch", "train_batch_size": "train.global_batch",
    "gradient_accumulation_steps": "train.microbatches", "max_grad_norm": "train.grad_clip",
    "clip_grad": "train.grad_clip", "gradient_clipping": "train.grad_clip",
    "warmup": "train.warmup_steps", "lr_warmup_iters": "train.warmup_steps",
    "min_learning_rate": "train.min_lr", "seq_length": "data.seq_len",
    "max_seq_length": "data.seq_len", "seed": "data.seed", "save_steps": "train.checkpoint_every",
    "save_interval": "train.checkpoint_every", "output_dir": "train.out_dir",
    "tensor_model_parallel_size": "parallel.tp", "pipeline_model_parallel_size": "parallel.pp",
    "context_parallel_size": "parallel.cp", "expert_model_parallel_size": "parallel.ep",
    "stage": "parallel.zero_stage",
}


def _unknown_hint(dotted: str) -> str:
    """' Did you mean X?': partita's key for another trainer's name, else the closest."""
    if "." not in dotted:  # one of partita's keys given without its section
        owners = [k for k in _all_keys() if k.partition(".")[2] == dotted]
        if owners:
            return f" Did you mean {' or '.join(repr(k) for k in owners)}?"
    peer = PEER_NAMES.get(dotted.partition(".")[2] or dotted)
    if peer:
        return f" Did you mean '{peer}' (partita's name for it)?"
    return did_you_mean(dotted, _all_keys())


def _set(cfg: Config, dotted: str, raw: object) -> None:
    """Set `dotted` from `raw`: a TOML value, override text, or None for a flag written
    without a value (true for a true-or-false setting, refused for the others)."""
    section, _, key = dotted.partition(".")
    sections = _sections()
    if section not in sections or not key:
        raise PartitaError(
            f"unknown setting '{dotted}'.{_unknown_hint(dotted)} Settings are "
            f"written section.key; the sections are {', '.join(sections)}."
        )
    names = [f.name for f in dataclasses.fields(sections[section])]
    if key not in names:
        raise PartitaError(
            f"unknown setting '{dotted}'.{_unknown_hint(dotted)} Valid keys of "
            f"[{section}]: {', '.join(names)}."
        )
    target = _field_type(section, key)
    value = bare_flag(dotted, target) if raw is None else convert_value(dotted, raw, target)
    setattr(getattr(cfg, section), key, value)


# Where the config file goes among the overrides, for the messages about a word that
# is neither.
CONFIG_FORM = "partita train run.toml --section.key=value"


def is_config_file_word(word: str) -> bool:
    """Whether a word of the command line names a config file (it ends in .toml): never
    the value of a setting written as two words ("--parallel.sequence_parallel run.toml"
    is a flag, then the file)."""
    return not word.startswith("-") and word.lower().endswith(".toml")


def parse_overrides(args: list[str]) -> list[tuple[str, str | None]]:
    """['--train.steps=5', '--parallel.tp', '2', '--parallel.sequence_parallel'] ->
    [('train.steps', '5'), ('parallel.tp', '2'), ('parallel.sequence_parallel', None)]:
    None for a flag without a value (`_set` takes it as true, for a true-or-false
    setting). A value may be the next word, unless that is an option or a config file."""
    return [(key, value) for key, value, _ in _override_items(args)]


def _override_items(args: list[str]) -> list[tuple[str, str | None, str]]:
    """parse_overrides's pairs, each with the words it was written as."""
    items, i = [], 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or "." not in arg.split("=")[0]:
            bare = arg.lstrip("-").split("=")[0]  # a key without its section?
            hint = _unknown_hint(bare) if arg.startswith("--") and bare else ""
            if is_config_file_word(arg):
                hint += f" One config file is read, and it goes first: {CONFIG_FORM}."
            elif not arg.startswith("-"):
                hint += f" A config file goes first: {CONFIG_FORM}."
            raise PartitaError(
                f"cannot read the argument '{arg}': settings are given as "
                f"--section.key=value (for example --train.steps=100).{hint}"
            )
        if "=" in arg:
            key, value = arg[2:].split("=", 1)
            items.append((key, value, arg))
        elif (i + 1 < len(args) and not args[i + 1].startswith("--")
              and not is_config_file_word(args[i + 1])):
            items.append((arg[2:], args[i + 1], f"{arg} {args[i + 1]}"))
            i += 1
        else:
            items.append((arg[2:], None, arg))
        i += 1
    return items


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Defaults, then the TOML file at `path`, then the overrides, each checked."""
    cfg = Config()
    if path:
        text = read_user_file(Path(path), "config file", "give the path of a TOML file (for "
                              "example a run's config.toml)")
        _apply_toml(cfg, text, str(path))
    for key, value in parse_overrides(overrides or []):
        _set(cfg, key, value)
    check_ranges(cfg)
    return cfg


def with_overrides(cfg: Config, overrides: list[str]) -> Config:
    """A copy of `cfg` with command-line overrides (`--section.key=value`) applied, each
    checked as `load_config` checks them."""
    out = copy.deepcopy(cfg)
    for key, value in parse_overrides(overrides):
        _set(out, key, value)
    check_ranges(out)
    return out


def config_from_toml(text: str) -> Config:
    """A Config from TOML text (as written by Config.to_toml)."""
    cfg = Config()
    _apply_toml(cfg, text, "the configuration")
    return cfg


def _apply_toml(cfg: Config, text: str, path: str) -> None:
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise PartitaError(f"config file '{path}' is not valid TOML: {exc}.") from None
    for section, values in data.items():
        if not isinstance(values, dict):
            raise PartitaError(
                f"'{section}' in {path} must be a [section] table; settings live in the "
                f"sections {', '.join(_sections())}."
            )
        for key, value in values.items():
            _set(cfg, f"{section}.{key}", value)
