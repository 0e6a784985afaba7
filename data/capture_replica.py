"""One pass on one machine: a vLLM capture replica that writes a data set's answers and their features.

`capture.backend: vllm` (data/generate.py) has the servers that write the answers keep the hidden states too
(vLLM's extract_hidden_states method and draftsmith's KV connector, fleet/vllm_capture.py). On a fleet the user
starts them (`draftsmith data serve-capture` prints the line) and names them in `generation.base_urls`; with no
base_urls, `generate_with_local_replica` starts one here, on the target's own folder, for the run alone.

`generate_dataset` takes the starter as an argument (`replica=...`, typed `data.generate.Replica`): this
module passes the one built on data/engines/vllm_server.py's VllmServer (`vllm serve` from the vLLM
environment).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path

from draftsmith.data.engines.vllm_server import VllmServer
from draftsmith.data.generate import generate_dataset
from draftsmith.data.served import serving_config
from draftsmith.errors import DataError
from draftsmith.targets.context import context_window

# the connector's own cap on its folder (GB, counted from what is there at start): it stops capturing past it
MAX_GB = 64.0


def local_replica(dtype: str = "float32", log: str | Path | None = None, timeout: float = 600.0):
    """A `data.generate.Replica`: `vllm serve` of the target's folder in `dtype` (vLLM's --dtype) with the
    capture connector writing the given vLLM layer ids into the folder; its log goes to `log` (default
    `<folder>/../vllm-replica.log`). The server is stopped when the block ends, on an error too."""

    @contextlib.contextmanager
    def start(target, vllm_ids: list[int], folder: Path) -> Iterator[tuple[str, str]]:
        if target.folder is None:
            raise DataError(f"target {target.name}: no model folder on disk, so vLLM cannot serve it as a capture "
                            "replica (give the target as a Hugging Face folder)")
        spec, kv = serving_config(vllm_ids, Path(folder).resolve(), max_gb=MAX_GB)
        server = VllmServer(target.folder, Path(log or Path(folder).parent / "vllm-replica.log"),
                            speculative_config=spec, served_name=target.name, dtype=dtype,
                            max_model_len=context_window(target) or 4096,
                            extra=("--kv-transfer-config", json.dumps(kv)))
        server.start(timeout)  # not `with server.start()`: its __enter__ would start a second server
        try:
            yield server.base_url, server.served_name
        finally:
            server.stop()

    return start


def generate_with_local_replica(config, target=None, **kwargs) -> Path:
    """`generate_dataset(config)` with a capture replica started here when the config names no servers
    (`capture.backend: vllm`, no `generation.base_urls`), in the precision the rows are written in
    (`generation.dtype`; auto leaves it to vLLM); other keyword arguments go to generate_dataset."""
    return generate_dataset(config, target, replica=local_replica(config.generation.dtype), **kwargs)
