"""One point of the configuration space, and the precision policy it trains under.

A `Layout` is everything the planner varies: the parallel degrees, the ZeRO stage,
the pipeline schedule with its virtual stages, the microbatch size, recompute and
offload. It is written and read in the form `"dp=8 tp=2 pp=2 zero=1 mb=1"`, which is
also what `partita plan --layout` accepts.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

from partita.errors import PartitaError, did_you_mean

RECOMPUTE = ("none", "selective", "full")
OFFLOAD = ("none", "optimizer")
SCHEDULES = ("1f1b", "interleaved", "zb-h1", "gpipe")


@dataclass(frozen=True)
class Precision:
    """Bytes per parameter of each model state (Adam keeps two moments).

    Default: bf16 parameters and gradients with fp32 master weights and fp32 Adam
    moments, the 2 + 2 + 4 + 8 = 16 bytes of the ZeRO paper. `fp32()` trains in fp32
    with no separate master copy: 4 + 4 + 0 + 8.
    """

    param: int = 2
    grad: int = 2
    master: int = 4
    optimizer: int = 8
    activation: int = 2  # bytes per activation element saved for backward

    @classmethod
    def fp32(cls) -> Precision:
        return cls(param=4, grad=4, master=0, optimizer=8, activation=4)

    @classmethod
    def named(cls, name: str) -> Precision:
        if name in ("bf16", "fp16", "mixed"):
            return cls()
        if name == "fp32":
            return cls.fp32()
        raise PartitaError(f"unknown precision '{name}'; use bf16 (mixed, default) or fp32.")

    @property
    def total(self) -> int:
        return self.param + self.grad + self.master + self.optimizer


MIXED = Precision()  # the default policy (immutable, shared as a default argument)


@dataclass(frozen=True)
class Layout:
    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    zero: int = 0
    vpp: int = 1  # virtual pipeline stages (model chunks) per pipeline rank
    mb: int = 1  # microbatch size, sequences
    recompute: str = "none"
    offload: str = "none"
    sp: bool = True  # sequence parallelism alongside tp (no effect at tp=1)
    schedule: str = "1f1b"

    def __post_init__(self) -> None:
        for name in ("dp", "tp", "pp", "cp", "ep", "vpp", "mb"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise PartitaError(f"layout {name}={getattr(self, name)!r}: use an integer >= 1.")
        if self.zero not in (0, 1, 2, 3):
            raise PartitaError(f"layout zero={self.zero}: ZeRO stages are 0, 1, 2 and 3.")
        for name, options in (("recompute", RECOMPUTE), ("offload", OFFLOAD),
                              ("schedule", SCHEDULES)):
            if getattr(self, name) not in options:
                raise PartitaError(
                    f"layout {name}={getattr(self, name)!r}: choose one of {', '.join(options)}."
                )

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    @property
    def zero_group(self) -> int:
        """Ranks ZeRO shards dense model states over (and dense gradients are reduced over)."""
        return self.dp * self.cp

    def describe(self) -> str:
        parts = [f"dp={self.dp}", f"tp={self.tp}", f"pp={self.pp}"]
        parts += [f"{k}={getattr(self, k)}" for k in ("cp", "ep", "vpp") if getattr(self, k) > 1]
        parts += [f"zero={self.zero}", f"mb={self.mb}"]
        if self.pp > 1 and self.schedule != _default_schedule(self.vpp):
            parts.append(f"schedule={self.schedule}")
        if self.recompute != "none":
            parts.append(f"recompute={self.recompute}")
        if self.offload != "none":
            parts.append(f"offload={self.offload}")
        if not self.sp and self.tp > 1:
            parts.append("sp=0")
        return " ".join(parts)

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def with_(self, **changes) -> Layout:
        return replace(self, **changes)


def _default_schedule(vpp: int) -> str:
    return "interleaved" if vpp > 1 else "1f1b"


_ALIASES = {"zero_stage": "zero", "micro_batch": "mb", "microbatch": "mb", "v": "vpp",
            "virtual_stages": "vpp", "sequence_parallel": "sp"}


def parse_layout(text: str, num_gpus: int | None = None) -> Layout:
    """`"dp=8 tp=2 pp=2 zero=1"` (spaces or commas) -> Layout.

    Omitted degrees are 1, except dp, which is filled in from `num_gpus` when given.
    """
    known = {f.name for f in fields(Layout)}
    values: dict[str, object] = {}
    for item in text.replace(",", " ").split():
        key, sep, raw = item.partition("=")
        key = _ALIASES.get(key.strip().lower(), key.strip().lower())
        if not sep or key not in known:
            raise PartitaError(
                f"cannot read '{item}' in layout '{text}'.{did_you_mean(key, known)} Write "
                f"name=value pairs with names among {', '.join(sorted(known))}."
            )
        values[key] = _convert(key, raw.strip(), text)
    if "dp" not in values and num_gpus is not None:
        other = 1
        for k in ("tp", "pp", "cp"):
            other *= int(values.get(k, 1))
        if num_gpus % other:
            raise PartitaError(
                f"layout '{text}': tp*pp*cp={other} does not divide --gpus {num_gpus}."
            )
        values["dp"] = num_gpus // other
    if "schedule" not in values:
        values["schedule"] = _default_schedule(int(values.get("vpp", 1)))
    return Layout(**values)


def _convert(key: str, raw: str, text: str) -> object:
    if key in ("recompute", "offload", "schedule"):
        return raw.lower()
    if key == "sp":
        return raw.lower() in ("1", "true", "yes", "on")
    try:
        return int(raw)
    except ValueError:
        raise PartitaError(f"layout '{text}': {key}={raw} is not an integer.") from None
