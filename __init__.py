"""draftsmith: train, evaluate and export what makes speculative decoding fast.

Draft models distilled from a target's logits, Medusa heads and EAGLE heads on a frozen target; one
speculative decoder that measures acceptance per domain; exporters for vLLM, SGLang, TensorRT-LLM and
Hugging Face assisted generation. Submodules are imported on demand so that `import draftsmith` stays cheap.
"""

__version__ = "0.1.0"

from draftsmith.errors import DraftsmithError  # noqa: E402

__all__ = ["DraftsmithError", "__version__"]
