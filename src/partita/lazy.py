"""Names a package exports but loads only on first use (PEP 562 module `__getattr__`).

A package whose light names (shapes, manifests) are read without torch keeps its
torch-backed names here, so that `import partita.models` or `partita.checkpoint` stays
fast for the planner and for the launcher's checks before it starts any process.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable


def lazy_names(package: str, homes: dict[str, str]) -> Callable[[str], object]:
    """A module `__getattr__` for `package` that imports `homes[name]` the first time
    `name` is read and caches it in the package."""

    def __getattr__(name: str) -> object:
        if name in homes:
            value = getattr(importlib.import_module(homes[name]), name)
            setattr(sys.modules[package], name, value)  # later lookups skip this hook
            return value
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__
