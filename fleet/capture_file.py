"""The capture file format, one file per served request: written by the KV connector (vllm_capture.py) inside
vLLM, read back by draftsmith (data/served.py). Standard library, torch and safetensors only, so that both
environments import the one definition.

    <folder>/<file_stem(engine request id)>.safetensors
    hidden_states  [N-1, n_layers, hidden]  the model's dtype; position t is the forward over token t
    token_ids      [N] int64                 prompt + answer (the last token was sampled, never an input)
    metadata["draftsmith"]: JSON {format, version, request_id (the engine's, whole), layers (vLLM ids),
                                  prompt_tokens, n_tokens, hidden_size, dtype, model {name, config},
                                  sha256 (of both tensors' bytes, in that order)}

The file's name is the engine request id, escaped: vLLM builds that id from the client's `X-Request-Id`, which
may hold any character (a space, `/`, `+`, non-ASCII), so every UTF-8 byte outside [A-Za-z0-9._-], and a
leading `.`, is written `%XX`; a name longer than NAME_MAX keeps its head and ends in `~` and a hash of the
whole id. The name names exactly one id and the reader holds the metadata's `request_id` to it (file_stem of
one must be the other), so a file renamed, copied over another or written for another request is refused.
`model` says which model served the request: `config` is its text config as the engine loaded it (every field
but where it was loaded from), from which the reader computes draftsmith's target fingerprint `config_hash`
(targets/fingerprint.py) and refuses a capture of another model. Version 1 files (names not escaped, no
model) are refused: they cannot be told to belong to the target.

Written under a temporary name in the same folder (a leading `.`, which no capture's name has), synced and
renamed: a reader sees a whole file or none.
"""

from __future__ import annotations

import hashlib
import json
import os
import string
import threading

import torch
from safetensors.torch import save_file

FORMAT, VERSION = "draftsmith.vllm_capture", 2
SUFFIX = ".safetensors"
MAX_ID = 8192  # characters of an engine request id a capture holds; a longer one is not captured (counted)
NAME_MAX = 200  # characters of a file's name before SUFFIX: room for a temporary name's prefix and suffix
_KEPT = frozenset(string.ascii_letters + string.digits + "._-")
_HASHED = 40  # hex characters of the id's sha256 that end a name too long to hold the id
# fields of a config that say where it was loaded from, not what the model is
_NOT_IDENTITY = frozenset({"_name_or_path", "name_or_path", "_commit_hash", "transformers_version"})


def file_stem(request_id: str) -> str:
    """The file name (without SUFFIX) of a request's capture: the id's UTF-8 bytes, each outside
    [A-Za-z0-9._-] (and a leading '.') as `%XX`; past NAME_MAX characters, the head, `~` and 40 hex of the
    id's sha256. A ValueError for an id that is empty, not text or longer than MAX_ID."""
    if not isinstance(request_id, str) or not 0 < len(request_id) <= MAX_ID:
        what = f"{len(request_id)} characters" if isinstance(request_id, str) else type(request_id).__name__
        raise ValueError(f"a request id of {what}: a capture's id is text of 1 to {MAX_ID} characters")
    raw = request_id.encode("utf-8", "surrogatepass")
    stem = "".join(chr(b) if chr(b) in _KEPT and not (i == 0 and b == 0x2E) else f"%{b:02X}"
                   for i, b in enumerate(raw))
    if len(stem) <= NAME_MAX:
        return stem
    head = stem[:NAME_MAX - _HASHED - 1]
    cut = head.rfind("%", len(head) - 2)  # never half an escape
    return (head[:cut] if cut >= 0 else head) + "~" + hashlib.sha256(raw).hexdigest()[:_HASHED]


def request_id_of(stem: str) -> str | None:
    """The request id a file name (without SUFFIX) stands for, read from the name alone: None where the name
    is hashed (the id is in the file's metadata) or is not one file_stem writes."""
    if "~" in stem or not stem:
        return None
    raw, i = bytearray(), 0
    while i < len(stem):
        if stem[i] == "%":
            try:
                raw.append(int(stem[i + 1:i + 3], 16))
            except ValueError:
                return None
            i += 3
        elif stem[i] in _KEPT:
            raw.append(ord(stem[i]))
            i += 1
        else:
            return None
    try:
        rid = raw.decode("utf-8", "surrogatepass")
    except UnicodeDecodeError:
        return None
    try:
        return rid if file_stem(rid) == stem else None  # one name per id: another spelling is not ours
    except ValueError:
        return None


def model_identity(config: dict, name: str = "") -> dict:
    """What a capture records of the model that served it (module docstring): `config` as the engine loaded
    it (a text config's to_dict()), less where it was loaded from; `name` only for messages."""
    kept = {str(k): v for k, v in sorted(config.items()) if k not in _NOT_IDENTITY}
    return {"name": str(name)[:500], "config": json.loads(json.dumps(kept, default=str))}


def digest(hidden: torch.Tensor, token_ids: torch.Tensor) -> str:
    """sha256 of the two tensors' bytes, in this order: what the reader recomputes to tell a damaged file."""
    h = hashlib.sha256()
    for t in (hidden, token_ids):
        if t.numel():
            h.update(t.contiguous().view(torch.uint8).numpy())  # the tensor's own memory, not a copy
    return h.hexdigest()


def write_capture(folder: str, request_id: str, hidden: torch.Tensor, token_ids: list[int], prompt_tokens: int,
                  layers: list[int], model: dict) -> str:
    """Write one request's capture (module docstring); returns the file's path. `model`: model_identity()."""
    stem = file_stem(request_id)
    ids = torch.tensor(token_ids, dtype=torch.int64)
    hidden = hidden.contiguous()
    meta = {"format": FORMAT, "version": VERSION, "request_id": request_id, "layers": [int(i) for i in layers],
            "prompt_tokens": int(prompt_tokens), "n_tokens": len(token_ids), "hidden_size": int(hidden.shape[-1]),
            "dtype": str(hidden.dtype).removeprefix("torch."), "model": model, "sha256": digest(hidden, ids)}
    final = os.path.join(folder, stem + SUFFIX)
    tmp = os.path.join(folder, f".{stem}.tmp-{os.getpid()}-{threading.get_ident()}")
    try:
        save_file({"hidden_states": hidden, "token_ids": ids}, tmp, metadata={"draftsmith": json.dumps(meta)})
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, final)
    finally:
        if os.path.lexists(tmp):
            os.unlink(tmp)
    return final
