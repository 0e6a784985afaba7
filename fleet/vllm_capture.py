"""Hidden states from the fleet: a vLLM KV connector that writes, per served request, the target's hidden
states at the layers a drafter reads, with the request's token ids and its prompt/answer boundary.

vLLM's `extract_hidden_states` speculative method runs the target as it serves and stores the outputs of
the layers its draft config names (`eagle_aux_hidden_state_layer_ids`) in a KV-cache group of their own,
one slot per token; a KV connector is handed that cache when a request finishes, before its blocks are
freed. vLLM's example connector copies on CUDA streams into pinned memory, which a CPU engine cannot do
("pin_memory=True requires a CUDA or other accelerator backend"); this one takes the accelerator's
streams where the cache lives on one and a plain copy where it lives in host memory. Serve with

    vllm serve MODEL --speculative-config '{"method": "extract_hidden_states", "num_speculative_tokens": 1,
        "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": [2, 15, 27, 30]}}}'
      --kv-transfer-config '{"kv_connector": "DraftsmithCaptureConnector", "kv_role": "kv_producer",
        "kv_connector_module_path": "draftsmith.fleet.vllm_capture",
        "kv_connector_extra_config": {"capture_dir": "/data/captures", "max_gb": 500}}'

vLLM's layer ids count the residual stream entering a layer (id i = the output of decoder layer i-1, id L =
the last layer's output before the final norm); `draftsmith data serve-capture` prints the flags for a job.

One file per request, `<capture_dir>/<engine request id, escaped>.safetensors`, in the format of
capture_file.py (which escapes any id a client can send and records which model served it). Bounded: past
`max_gb` in the folder (counted from what is there at start), new requests are not captured (one warning).
A guest in the engine: whatever fails in copying or writing one request's states (a full disk, an id no file
can be named for, a tensor that does not save) costs only that request's file, never the request or the
engine: it is caught, counted by kind (`counts`) and logged once per kind. Only tensor-parallel rank 0 writes.
The engine request id is the API response's id plus what vLLM adds (`cmpl-<id>-<prompt index>-<8 hex>`,
`chatcmpl-<id>-<8 hex>`), which is how draftsmith joins a capture to its logged request (data/served.py);
with VLLM_DISABLE_REQUEST_ID_RANDOMIZATION set the random part is missing and a chat id would not split back
exactly, so the connector refuses to start.

This module runs inside vLLM's environment: standard library, torch, safetensors and vllm only.
"""

from __future__ import annotations

import logging
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.config import get_layers_from_vllm_config
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)

from draftsmith.fleet.capture_file import MAX_ID, SUFFIX, file_stem, model_identity, write_capture

log = logging.getLogger("draftsmith.fleet.vllm_capture")


@dataclass
class PendingSave:
    req_id: str
    token_ids: list[int]
    prompt_tokens: int
    block_ids: list[int]


@dataclass
class CaptureMetadata(KVConnectorMetadata):
    saves: list[PendingSave] = field(default_factory=list)


def _folder_bytes(folder: str) -> int:
    total = 0
    with os.scandir(folder) as entries:
        for e in entries:
            if e.name.endswith(SUFFIX) and e.is_file(follow_symlinks=False):
                total += e.stat(follow_symlinks=False).st_size
    return total


class DraftsmithCaptureConnector(KVConnectorBase_V1, SupportsHMA):
    """Store-only: nothing is ever loaded into the engine (module docstring)."""

    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        spec = vllm_config.speculative_config
        if spec is None or spec.method != "extract_hidden_states":
            raise ValueError("DraftsmithCaptureConnector needs --speculative-config with method "
                             "extract_hidden_states (it stores the hidden states that method caches)")
        if os.environ.get("VLLM_DISABLE_REQUEST_ID_RANDOMIZATION", "0").strip() not in ("", "0"):
            raise ValueError("DraftsmithCaptureConnector: VLLM_DISABLE_REQUEST_ID_RANDOMIZATION is set: "
                             "engine request ids lose the random suffix that tells a chat id from its "
                             "response id (data/served.py)")
        extra = self._kv_transfer_config
        self.folder = str(extra.get_from_extra_config("capture_dir", "") or "")
        if not self.folder:
            raise ValueError("DraftsmithCaptureConnector: kv_connector_extra_config.capture_dir is not set")
        os.makedirs(self.folder, exist_ok=True)
        max_gb = float(extra.get_from_extra_config("max_gb", 64.0))
        if not max_gb > 0:
            raise ValueError(f"DraftsmithCaptureConnector: max_gb is {max_gb}, expected a number > 0")
        self.max_bytes = int(max_gb * (1 << 30))
        self.layers = [int(i) for i in spec.draft_model_config.hf_config.eagle_aux_hidden_state_layer_ids]
        self.hidden_size = int(vllm_config.model_config.get_hidden_size())
        # which model serves: its text config as vLLM loaded it (capture_file.model_identity)
        self.model = model_identity(vllm_config.model_config.hf_text_config.to_dict(),
                                    str(vllm_config.model_config.model))
        self.group = self._group(kv_cache_config)
        self.block_size = (kv_cache_config.kv_cache_groups[self.group].kv_cache_spec.block_size
                           if kv_cache_config is not None else vllm_config.cache_config.block_size)
        # scheduler side: requests seen scheduled (capturable), and saves waiting for the next step's metadata
        self._scheduled: set[str] = set()
        self._pending: list[PendingSave] = []
        # worker side
        self._cache: torch.Tensor | None = None
        self._writer = True  # tensor-parallel rank 0 only; set in register_kv_caches
        self._stream = None
        self._events: dict[str, Any] = {}  # req_id -> the copy's event (accelerator); absent on CPU
        self._finished: set[str] = set()
        self._pool = ThreadPoolExecutor(max_workers=int(extra.get_from_extra_config("writer_threads", 2)),
                                        thread_name_prefix="draftsmith-capture")
        self._lock = threading.Lock()
        self._bytes = _folder_bytes(self.folder) if role == KVConnectorRole.WORKER else 0
        self._full_warned = False
        self.counts: dict[str, int] = {}  # "written" and each kind of failure (never raised into the engine)

    @staticmethod
    def _group(kv_cache_config) -> int:
        """The KV-cache group holding the hidden states (the only one of its spec type)."""
        if kv_cache_config is None:
            return 0
        from vllm.v1.kv_cache_interface import HiddenStateCacheSpec

        groups = kv_cache_config.kv_cache_groups
        ids = [g for g, group in enumerate(groups) if isinstance(group.kv_cache_spec, HiddenStateCacheSpec)]
        if len(ids) == 1:
            return ids[0]
        if not ids and len(groups) == 1:
            return 0
        raise ValueError(f"DraftsmithCaptureConnector: no single hidden-states KV-cache group among {len(groups)}")

    def get_finished_count(self) -> int:
        return 1  # one writer (TP rank 0): waiting for every rank would never free the blocks

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config) -> str | None:
        return "LBNHC"  # a token's hidden states together in memory: [blocks, layers, block_size, hidden]

    # --- scheduler side ---------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
        return 0, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int):
        return None

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        meta = CaptureMetadata(saves=self._pending)
        self._pending = []
        for new in scheduler_output.scheduled_new_reqs:
            self._scheduled.add(new.req_id)
        return meta

    def request_finished(self, request, block_ids: list[int]):
        """Keep the request's blocks until its hidden states are copied out (True), or free them (False)."""
        if request.request_id not in self._scheduled:
            return False, None  # aborted before it ran: nothing was computed
        self._scheduled.discard(request.request_id)
        tokens = list(request.all_token_ids)
        if len(tokens) < 2 or not block_ids:
            return False, None
        if not isinstance(request.request_id, str) or not 0 < len(request.request_id) <= MAX_ID:
            self._count("id_too_long", f"a request id of more than {MAX_ID} characters is not captured")
            return False, None
        self._pending.append(PendingSave(request.request_id, tokens, int(request.num_prompt_tokens), list(block_ids)))
        return True, {"draftsmith_capture": os.path.join(self.folder, file_stem(request.request_id) + SUFFIX)}

    def request_finished_all_groups(self, request, block_ids: tuple[list[int], ...]):
        if not 0 <= self.group < len(block_ids):
            return False, None
        return self.request_finished(request, block_ids[self.group])

    # --- worker side ------------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]):
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank
        from vllm.model_executor.models.extract_hidden_states import CacheOnlyAttentionLayer

        self._writer = get_tensor_model_parallel_rank() == 0
        names = list(get_layers_from_vllm_config(self._vllm_config, CacheOnlyAttentionLayer, list(kv_caches)))
        if len(names) != 1:
            raise ValueError(f"DraftsmithCaptureConnector: expected one hidden-states cache layer, found {len(names)}")
        self._cache = kv_caches[names[0]]
        if self._cache.shape[2] != self.block_size:
            raise ValueError("DraftsmithCaptureConnector: the hidden-states cache has blocks of "
                             f"{self._cache.shape[2]} tokens, its spec says {self.block_size}: "
                             "slots would be read wrong")

    def start_load_kv(self, forward_context, **kwargs) -> None:
        return None

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs) -> None:
        return None  # the states are in the cache already; they are read when the request finishes

    def wait_for_save(self) -> None:
        return None

    def _gather(self, save: PendingSave) -> torch.Tensor:
        """[N-1, layers, hidden] of the request's slots, still on the cache's device."""
        blocks = torch.tensor(save.block_ids, dtype=torch.long)
        slots = (blocks[:, None] * self.block_size + torch.arange(self.block_size)[None, :]).flatten()
        slots = slots[:len(save.token_ids) - 1].to(self._cache.device, non_blocking=True)
        return self._cache[slots // self.block_size, :, slots % self.block_size]

    def _copy(self, save: PendingSave) -> tuple[torch.Tensor, Any]:
        """The states in host memory: a plain copy on CPU; on an accelerator an asynchronous one on a side
        stream into pinned memory (the forward never waits for it), with the event that tells it is done."""
        if self._cache.device.type == "cpu":
            return self._gather(save).clone(), None
        mod = torch.get_device_module(self._cache.device.type)
        if self._stream is None:
            self._stream = mod.Stream()
        ready = mod.Event()
        ready.record()
        self._stream.wait_event(ready)
        with mod.stream(self._stream):
            states = self._gather(save)
            host = torch.empty(states.shape, dtype=states.dtype, device="cpu", pin_memory=True)
            host.copy_(states, non_blocking=True)
        done = mod.Event()
        done.record(self._stream)
        return host, done

    def _count(self, kind: str, detail: str) -> None:
        """One more of `kind`; the first of each kind is logged (a failing disk would flood the log)."""
        with self._lock:
            self.counts[kind] = self.counts.get(kind, 0) + 1
            first = self.counts[kind] == 1
        if first and kind != "written":
            log.error("draftsmith capture: %s (%s; counted from now on, not logged again)", detail, kind)

    def _write(self, save: PendingSave, host: torch.Tensor, event) -> None:
        """Thread: wait for the copy, then write the file (capture_file.py: whole or absent). Nothing it
        raises reaches the engine: a full disk or any other failure costs this request's capture only."""
        try:
            if event is not None:
                event.synchronize()
            write_capture(self.folder, save.req_id, host, save.token_ids, save.prompt_tokens, self.layers,
                          self.model)
        except Exception as e:  # noqa: BLE001 - a guest in the engine's worker: counted, logged, never raised
            self._count(f"not_written:{type(e).__name__}", f"capture of {save.req_id[:200]!r} not written: "
                        f"{str(e).splitlines()[0][:300] if str(e) else type(e).__name__}")
        else:
            self._count("written", "")

    def _room(self, nbytes: int) -> bool:
        with self._lock:
            if self._bytes + nbytes > self.max_bytes:
                if not self._full_warned:
                    log.warning("draftsmith capture folder %s holds %.1f GB of its %.1f GB: new requests are not "
                                "captured until it is emptied", self.folder, self._bytes / 2**30,
                                self.max_bytes / 2**30)
                    self._full_warned = True
                return False
            self._bytes += nbytes
            return True

    def _start(self, save: PendingSave) -> None:
        """Copy one request's states out and hand them to a writer thread; a failure costs its capture."""
        try:
            host, event = self._copy(save)
            future: Future = self._pool.submit(self._write, save, host, event)
        except Exception as e:  # noqa: BLE001 - in the engine's step: counted and logged, never raised
            self._count(f"not_copied:{type(e).__name__}", f"states of {save.req_id[:200]!r} not copied out: "
                        f"{str(e).splitlines()[0][:300] if str(e) else type(e).__name__}")
            return
        if event is not None:
            self._events[save.req_id] = event
        future.add_done_callback(_log_failure(save.req_id))

    def get_finished(self, finished_req_ids: set[str]):
        """Copy out the states of requests that finished last step and start their writes; report as done
        (their blocks may be freed) those whose copy has completed."""
        meta = self._get_connector_metadata() if self.has_connector_metadata() else None
        started: set[str] = set()
        if isinstance(meta, CaptureMetadata) and self._writer and self._cache is not None:
            for save in meta.saves:
                size = (len(save.token_ids) - 1) * len(self.layers) * self.hidden_size * self._cache.element_size()
                if self._room(size):
                    self._start(save)
                started.add(save.req_id)
        self._finished |= finished_req_ids | started
        done = set()
        for req_id in list(self._finished):
            event = self._events.get(req_id)
            if event is not None and not event.query():
                continue
            self._events.pop(req_id, None)
            self._finished.discard(req_id)
            if req_id in started or event is not None:
                done.add(req_id)
        return done or None, None


def _log_failure(req_id: str):
    def check(future: Future) -> None:
        if not future.cancelled() and future.exception() is not None:
            log.error("draftsmith capture of %s failed: %r", req_id, future.exception())
    return check
