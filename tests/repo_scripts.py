"""The repository's maintainer scripts (scripts/*.py) loaded as modules, for the tests of the rules they check."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]


def load_script(name: str) -> ModuleType:
    """scripts/NAME.py as a module (scripts/ is not a package, and the checks import nothing of draftsmith)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
