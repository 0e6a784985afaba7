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
    # shape(engine, artifact_dir, k, options) -> `Served`: how that engine serves the artifact (decoding/served_shape.py
    # decodes it so, serve.md states it); a shape the engine cannot serve is one ConfigError line. None: no engine
    # profile is known for the method
    shape: Callable[[str, Path, int | None, dict], Served] | None = None


FORMS = ("chain", "block", "tree")  # a chain drafted token by token, a block drafted in one pass, a token tree
ENGINE_NAMES = {"vllm": "vLLM", "sglang": "SGLang", "trtllm": "TensorRT-LLM"}


@dataclass(frozen=True)
class Served:
    """How one serving engine runs one drafter: the exact shape it drafts and verifies each step.

    engine: vllm | sglang | trtllm. method: the engine's own name for the speculative method (vLLM's
    `speculative_config.method`, SGLang's `--speculative-algorithm`, TensorRT-LLM's `decoding_type`).
    form: chain | block | tree (FORMS). k: draft tokens a step (a tree: its depth). branching / max_nodes: a tree's
    children per depth and its verified nodes (None for a chain or block). draft_sampling: how the engine picks
    draft tokens ("greedy": the draft's argmax, its probabilities taken as one-hot by the rejection sampler).
    adaptive_verification: the verified prefix is sized every step by the drafter's confidence (vLLM's DSpark with
    `enable_adaptive_verification`). params: the engine's own settings that give this shape. opts: the options of
    the method's proposer (`METHOD:PATH`) that make draftsmith's decoder draft exactly this shape.
    """

    engine: str
    method: str
    form: str
    k: int
    branching: tuple[int, ...] | None = None
    max_nodes: int | None = None
    draft_sampling: str = "greedy"
    adaptive_verification: bool = False
    params: dict = field(default_factory=dict)
    opts: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        """The report's `shape` field (docs/evaluation.md): engine, method, form, k, and a tree's branching."""
        out = {"engine": self.engine, "method": self.method, "form": self.form, "k": self.k,
               "draft_sampling": self.draft_sampling, "adaptive_verification": self.adaptive_verification,
               "params": dict(self.params), "label": self.label()}
        if self.form == "tree":
            out.update(tree=list(self.branching or ()), tree_max_nodes=self.max_nodes)
        return out

    def label(self) -> str:
        """The shape in a few words, as report tables and headline columns name it ("vLLM eagle3 chain k=4")."""
        text = f"{ENGINE_NAMES.get(self.engine, self.engine)} {self.method} {self.form} k={self.k}"
        if self.form == "tree":
            text += f" ({self.max_nodes} nodes, branching {','.join(map(str, self.branching or ()))})"
        return text + (" adaptive verification" if self.adaptive_verification else "")

    def text(self) -> str:
        """serve.md's statement of the served shape."""
        what = {"chain": f"a chain of {self.k} draft tokens a step, drafted one after another",
                "block": f"a block of {self.k} draft tokens a step, drafted in one pass",
                "tree": f"a token tree of depth {self.k}, {self.max_nodes} draft nodes verified a step "
                        f"(up to {', '.join(map(str, self.branching or ()))} children per depth)"}[self.form]
        extra = (" The verified prefix is sized every step from the confidence head's estimates "
                 "(`enable_adaptive_verification`)." if self.adaptive_verification else "")
        return (f"Served shape: {ENGINE_NAMES.get(self.engine, self.engine)} runs `{self.method}` as {what}, "
                f"{self.draft_sampling} draft tokens, verified by the target's rejection sampler (lossless).{extra} "
                f"`draftsmith evaluate --as-served {self.engine}` decodes this exact shape.")


def vllm_serve(target_ref: str, method: str, out: Path, k: int, extra: dict | None = None) -> str:
    """`vllm serve` with a speculative config (a fenced block); `extra`: more speculative_config fields."""
    spec = json.dumps({"method": method, "model": str(out), "num_speculative_tokens": k, **(extra or {})})
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
