"""Package names imported from their module when first used (PEP 562)."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping, Sequence

__all__ = ["lazy_exports"]


def lazy_exports(package: str, modules: Mapping[str, Sequence[str]]) -> Callable[[str], object]:
    """A module `__getattr__` for `package`: each name `modules` lists (module -> its names)
    is imported from its module on first use, then kept in the package."""
    where = {name: module for module, names in modules.items() for name in names}

    def getattr_(name: str) -> object:
        module = where.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        setattr(sys.modules[package], name, value)
        return value

    return getattr_
