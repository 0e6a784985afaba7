"""How each serving stack is launched, and what export/ asks a method about serving its artifacts.

A method's export.py writes serve.md with the launch helpers below (each stack's command line, whatever the
method) and declares a `Serving` (`Method.serving`): export/'s drivers (`export_artifact`'s vLLM warning,
`draftsmith serve-check`) read it through the registry, so export/ names no method and a new method serves
through the same driver by declaring its own.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from draftsmith.layouts.common import fenced


@dataclass(frozen=True)
class VllmPatch:
    """A fix of vLLM's own code for one method's drafter: the entry `name` of the PATCHES table in `file`, a
    module of the method's folder (e.g. dflash/vllm_patches.py) that imports the standard library, torch
    and vllm only (scripts/check_imports.py rule 5). serve-check's runner, which cannot import draftsmith,
    gets the pair in its job and loads the file by path in vLLM's environment."""

    name: str
    file: Path


@dataclass(frozen=True)
class VllmServe:
    """How vLLM serves one export format.

    method: vLLM's speculative method (`speculative_config["method"]`).
    check(export_dir, k) -> why vLLM would serve a chain of k otherwise than the drafter was trained, or None.
    patches: the fixes of vLLM's CPU kernels serve-check's runner (export/vllm_run.py) applies for this
    format, each a measured defect kept in the method's folder; `draftsmith serve-check` lists what it
    applied.
    proposer(export_dir) -> the proposer spec draftsmith decodes the export with; None: the export is read back
    into an artifact first (`import_export`) and decoded as one.
    """

    method: str
    check: Callable[[Path, int], str | None] | None = None
    patches: tuple[VllmPatch, ...] = ()
    proposer: Callable[[Path], str] | None = None


@dataclass(frozen=True)
class Serving:
    """What export/ asks one method about serving its artifacts.

    vllm: export format -> how vLLM serves it, for each format the method writes for vLLM.
    layout(manifest) -> the layout family an artifact exports as (the name `vllm_refuses` uses); None: the
    method's name.
    vllm_refuses: (target model_type, layout) -> the error the measured vLLM gave (export/vllm.py names the
    version, scripts/vllm_families.py measured it); an export for vLLM of such a pair carries a warning.
    """

    vllm: dict[str, VllmServe] = field(default_factory=dict)
    layout: Callable[[dict], str] | None = None
    vllm_refuses: dict[tuple[str, str], str] = field(default_factory=dict)


def vllm_serve(target_ref: str, method: str, out: Path, k: int) -> str:
    """`vllm serve` with a speculative config (a fenced block)."""
    spec = json.dumps({"method": method, "model": str(out), "num_speculative_tokens": k})
    return fenced(f"vllm serve {target_ref} --speculative-config '{spec}'")


def sglang_serve(target_ref: str, algorithm: str, out: Path, flags: str = "") -> str:
    """`python -m sglang.launch_server` with a speculative algorithm and draft folder (a fenced block); `flags`:
    the algorithm's own speculative options."""
    cmd = (f"python -m sglang.launch_server --model-path {target_ref} \\\n  --speculative-algorithm {algorithm} "
           f"--speculative-draft-model-path {out}")
    return fenced(cmd + (f" \\\n  {flags}" if flags else ""))


def trtllm_serve(target_ref: str, out: Path, options: list[str]) -> str:
    """TensorRT-LLM's LLM-API YAML (`speculative_config`: `options`, then the draft folder) and the
    `trtllm-serve` command that reads it."""
    yaml = "\n".join(["speculative_config:", *(f"  {line}" for line in options), f"  speculative_model_dir: {out}"])
    return (f"TensorRT-LLM (PyTorch backend / LLM API), save as `spec.yaml`:\n\n{fenced(yaml, 'yaml')}\n\n"
            f"{fenced(f'trtllm-serve {target_ref} --extra_llm_api_options spec.yaml')}\n")
