"""The capture file format, one file per served request: written by the KV connector (vllm_capture.py) inside
vLLM, read back by draftsmith (data/served.py). Standard library, torch and safetensors only, so that both
environments import the one definition.

    hidden_states  [N-1, n_layers, hidden]  the model's dtype; position t is the forward over token t
    token_ids      [N] int64                 prompt + answer (the last token was sampled, never an input)
    metadata["draftsmith"]: JSON {format, version, request_id, layers (vLLM ids), prompt_tokens, n_tokens,
                                  hidden_size, dtype, sha256 (of both tensors' bytes, in that order)}

Written under a temporary name in the same folder, synced and renamed: a reader sees a whole file or none.
"""

from __future__ import annotations

import hashlib
import json
import os

import torch
from safetensors.torch import save_file

FORMAT, VERSION = "draftsmith.vllm_capture", 1
SUFFIX = ".safetensors"


def digest(hidden: torch.Tensor, token_ids: torch.Tensor) -> str:
    """sha256 of the two tensors' bytes, in this order: what the reader recomputes to tell a damaged file."""
    h = hashlib.sha256()
    for t in (hidden, token_ids):
        h.update(t.contiguous().view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def write_capture(folder: str, request_id: str, hidden: torch.Tensor, token_ids: list[int], prompt_tokens: int,
                  layers: list[int]) -> str:
    """Write one request's capture (module docstring); returns the file's path."""
    ids = torch.tensor(token_ids, dtype=torch.int64)
    hidden = hidden.contiguous()
    meta = {"format": FORMAT, "version": VERSION, "request_id": request_id, "layers": [int(i) for i in layers],
            "prompt_tokens": int(prompt_tokens), "n_tokens": len(token_ids), "hidden_size": int(hidden.shape[-1]),
            "dtype": str(hidden.dtype).removeprefix("torch."), "sha256": digest(hidden, ids)}
    final = os.path.join(folder, request_id + SUFFIX)
    tmp = os.path.join(folder, f".{request_id}.tmp-{os.getpid()}")
    try:
        save_file({"hidden_states": hidden, "token_ids": ids}, tmp, metadata={"draftsmith": json.dumps(meta)})
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, final)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return final
