"""Targets: load a frozen target model from anywhere, fingerprint it, place it for training (frozen.py).

What it computes is captured by capture/, the layer above."""

from draftsmith.targets.device import select_device, select_dtype
from draftsmith.targets.embedded import DEFAULT_TARGET, EMBEDDED
from draftsmith.targets.fingerprint import check_compatible, differences, fingerprint
from draftsmith.targets.loading import Target, freeze, list_targets, load_target, materialize_gguf

__all__ = [
    "DEFAULT_TARGET", "EMBEDDED", "Target", "check_compatible", "differences", "fingerprint", "freeze",
    "list_targets", "load_target", "materialize_gguf", "select_device", "select_dtype",
]
