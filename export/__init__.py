"""Export: one writer per serving stack (vLLM, SGLang, TensorRT-LLM, Hugging Face), each verified by reloading.

    from draftsmith.export import export_artifact, import_export
    export_artifact("runs/medusa/smollm2-135m", "vllm", "exports/medusa-vllm", target=target)
"""

from draftsmith.export.api import export_artifact, import_export

__all__ = ["export_artifact", "import_export"]
