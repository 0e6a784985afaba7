"""Export: any method"s artifact for a serving stack (vLLM, SGLang, TensorRT-LLM, Hugging Face), verified by
reloading, and the export judged by vLLM itself (`draftsmith serve-check`). The layouts are the methods" own
(`Method.export`, `Method.serving`); export/ drives them through the registry.

    from draftsmith.export import export_artifact, import_export
    export_artifact("runs/medusa/smollm2-135m", "vllm", "exports/medusa-vllm", target=target)

Its names are imported on first use (lazy.py).
"""

from __future__ import annotations

from draftsmith import lazy

__getattr__ = lazy.names(__name__, {
    "export_artifact": "draftsmith.export.api",
    "import_export": "draftsmith.export.api",
})
__all__ = ["export_artifact", "import_export"]
