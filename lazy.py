"""A package's public names imported on first use (PEP 562), so that `draftsmith --help`, a command's `--help`
and its argument errors answer without loading torch or transformers (tests/test_cli_help.py asserts it):

    __getattr__ = lazy.names(__name__, {"evaluate": "draftsmith.evaluation.evaluate", ...})
    __all__ = [...]
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def names(package: str, where: dict[str, str]) -> Callable[[str], Any]:
    """The module-level `__getattr__` of `package`: each name of `where` from its module, imported when first
    read and then kept in the package's namespace."""

    def __getattr__(name: str) -> Any:
        if name not in where:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        import sys

        value = getattr(importlib.import_module(where[name]), name)
        setattr(sys.modules[package], name, value)
        return value

    return __getattr__
