"""Targets: load a frozen target model from anywhere, fingerprint it, place it for training (frozen.py).

What it computes is captured by capture/, the layer above. Its names are imported on first use (lazy.py)."""

from __future__ import annotations

from draftsmith import lazy

__getattr__ = lazy.names(__name__, {
    "DEFAULT_TARGET": "draftsmith.targets.embedded",
    "EMBEDDED": "draftsmith.targets.embedded",
    "Target": "draftsmith.targets.loading",
    "check_compatible": "draftsmith.targets.fingerprint",
    "differences": "draftsmith.targets.fingerprint",
    "fingerprint": "draftsmith.targets.fingerprint",
    "freeze": "draftsmith.targets.loading",
    "list_targets": "draftsmith.targets.loading",
    "load_target": "draftsmith.targets.loading",
    "target_name": "draftsmith.targets.loading",
    "materialize_gguf": "draftsmith.targets.loading",
    "select_device": "draftsmith.targets.device",
    "select_dtype": "draftsmith.targets.device",
})
__all__ = [
    "DEFAULT_TARGET", "EMBEDDED", "Target", "check_compatible", "differences", "fingerprint", "freeze",
    "list_targets", "load_target", "target_name", "materialize_gguf", "select_device", "select_dtype"
]
