"""vLLM as export/ drives it: the measured refusals each method declares (`Method.serving`, read through the
registry) and the warning an export for vLLM carries where the measured vLLM refuses its target family and
layout; and how vLLM serves each export format, for `draftsmith serve-check`.

Each refusal was measured by loading a tiny random target of each family with each kind of head in the real
vLLM (scripts/vllm_families.py; its committed report is results/vllm-families/report.json, and
tests/test_vllm_families.py keeps the methods' tables equal to it). Exporting such a head still works (another
stack, or a later vLLM, may serve it); the export warns.
"""

from __future__ import annotations

from draftsmith import methods
from draftsmith.layouts.serving import Serving, VllmServe

VLLM_VERSION = "0.32.0"  # the vLLM the refusals were measured with


def servings() -> list[tuple[methods.Method, Serving]]:
    return [(m, m.get("serving")) for m in methods.all_methods() if m.serving is not None]


def layout_of(manifest: dict) -> str:
    """The layout family an artifact exports as, as its method names it (the key of the measured refusals)."""
    method = methods.get(manifest["kind"])
    serving = method.get("serving") if method.serving is not None else None
    return serving.layout(manifest) if serving is not None and serving.layout is not None else method.name


def refuses() -> dict[tuple[str, str], str]:
    """(target model_type, layout) -> the error the measured vLLM gave, over every registered method."""
    return {key: why for _, serving in servings() for key, why in serving.vllm_refuses.items()}


def refusal(model_type: str | None, layout: str) -> str | None:
    """The warning an export for vLLM carries when the measured vLLM refuses this family and layout, or None."""
    why = refuses().get((model_type or "", layout))
    if why is None:
        return None
    return (f"vLLM {VLLM_VERSION} refuses a {layout} head for a {model_type} target (measured: {why}); "
            "serve it with another stack or check a newer vLLM with `draftsmith serve-check`")


def formats() -> dict[str, VllmServe]:
    """Export format (draftsmith.json `format`) -> how vLLM serves it, over every registered method."""
    return {fmt: entry for _, serving in servings() for fmt, entry in serving.vllm.items()}
