"""A package's public names imported on first use (PEP 562), so that `draftsmith --help`, a command's `--help`
and its argument errors answer without loading torch or transformers (tests/test_cli_help.py asserts it):

    __getattr__ = lazy.names(__name__, {"evaluate": "draftsmith.evaluation.evaluate", ...})
    __all__ = [...]

A public name may be its module's own name (`evaluation.evaluate` is the function in evaluation/evaluate.py,
`targets.fingerprint` the function in targets/fingerprint.py). Importing such a submodule makes the import
system set the package's attribute to the module, which would hide the function from every later
`from draftsmith.evaluation import evaluate`; the package's module class takes the function instead, as the
eager `from .evaluate import evaluate` of a package's `__init__` used to.
"""

from __future__ import annotations

import importlib
import sys
import types
from collections.abc import Callable
from typing import Any


class _Package(types.ModuleType):
    """A package whose lazily exported names stay the names, not the submodules that share them."""

    def __setattr__(self, name: str, value: Any) -> None:
        where = self.__dict__.get("_lazy_names", {})
        if isinstance(value, types.ModuleType) and value.__name__ == f"{self.__name__}.{name}" and name in where:
            value = getattr(value, name)
        super().__setattr__(name, value)


def names(package: str, where: dict[str, str]) -> Callable[[str], Any]:
    """The module-level `__getattr__` of `package`: each name of `where` from its module, imported when first
    read and then kept in the package's namespace."""
    module = sys.modules[package]
    module.__dict__["_lazy_names"] = dict(where)
    module.__class__ = _Package

    def __getattr__(name: str) -> Any:
        if name not in where:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(where[name]), name)
        setattr(module, name, value)
        return value

    return __getattr__
