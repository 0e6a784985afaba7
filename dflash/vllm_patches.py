"""DFlash's fixes of vLLM's own code, applied by `draftsmith serve-check`'s runner before vLLM starts.

This file runs in the OTHER environment (.venv-vllm): export/vllm_run.py loads it by path and calls the
entries of PATCHES its job names, so it imports the standard library at module level and torch and vllm
inside the patches, never draftsmith (scripts/check_imports.py holds it to that). dflash/export.py's serving
entry names each patch with this file (`layouts.serving.VllmPatch`); DSpark, served on DFlash's backbone,
names the same.

Each patch is a measured defect of a CPU kernel: it returns a line saying what it replaced (the serve-check
report lists it), or None where nothing needed it (not the CPU platform).
"""

from __future__ import annotations


def _patch_context_knorm() -> str | None:
    """vLLM 0.32's DFlash drafter normalises the context keys of all its layers in one `rms_norm` call with
    the layers' k_norm weights stacked [L, head_dim], a kernel feature that picks the weight row by the
    outermost index; the CPU kernel applies row 0 to every layer, so the keys of layers 1..L-1 are
    normalised with layer 0's weight (measured: exact for layer 0, off for the others). Same kernel, one
    layer at a time."""
    import torch
    from vllm import _custom_ops as ops
    from vllm.model_executor.models import qwen3_dflash
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return None

    def normalize_context_k(self, all_k: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(all_k)
        for i in range(all_k.shape[0]):
            ops.rms_norm(out[i], all_k[i], self._k_norm_weights[i].contiguous(), self._rms_norm_eps)
        return out

    qwen3_dflash.DFlashQwen3Model._normalize_context_k = normalize_context_k
    return ("qwen3_dflash.DFlashQwen3Model._normalize_context_k: per-layer k_norm "
            "(CPU kernel takes row 0 only)")


PATCHES = {"dflash-context-knorm": _patch_context_knorm}
