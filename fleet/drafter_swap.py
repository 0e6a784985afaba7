"""A new drafter's weights loaded into a running vLLM server, in place: the worker side of `draftsmith promote`.

    vllm serve MODEL --speculative-config '{"method": "eagle3", "model": EXPORT, ...}' \\
        --worker-extension-cls draftsmith.fleet.drafter_swap.DrafterSwap \\
        --middleware draftsmith.fleet.drafter_route.DrafterRoute      (the authenticated trigger)

vLLM mixes the extension class into every worker (`--worker-extension-cls`, v1/worker/worker_base.py), and the
API server reaches the workers' methods through `engine_client.collective_rpc(name, args=...)`, which the engine
core runs between two model steps: no forward pass sees half a swap. The drafter is `worker.model_runner.drafter`
(EAGLE/EAGLE-3, DFlash, a draft model, Medusa: each keeps its nn.Module in `.model`, whose own `load_weights`
maps checkpoint names onto vLLM's fused parameters and copies into them in place, so the tensors' storage, and
any graph captured on it, stays the same).

A swap is four calls, each on every worker, so that a tensor-parallel group never serves two drafters:
    check(path, version)   everything that can be known before a tensor moves, read from disk: the export's
                           draftsmith.json (format, target fingerprint) and config.json equal to the served
                           export's, each weight file's sha256 equal to draftsmith.json's, every tensor's name,
                           shape and dtype equal to the served export's; a tensor of a module the drafter shares
                           with the target (vLLM shares the target's embedding or lm_head with a head whose copy
                           is identical) equal to the served one, and left out of the load (loading it would
                           write into the target). The new tensors and the served export's are then read to the
                           CPU and staged. Nothing of the running drafter changes.
    commit()               the staged tensors loaded as vLLM itself reloads weights in place
                           (model_executor/model_loader/reload: layer by layer through the model's own
                           `load_weights` and weight loaders, each layer processed as at start — the CPU backend
                           repacks its linear weights there — and copied into the original storage, so a captured
                           graph stays valid). Any failure loads the served export's tensors back.
    revert()               another worker's commit failed: this one loads the served export's tensors back.
    forget()               the swap is over (or given up): the staged tensors are released.
Each returns a dict ({"ok": bool, "error": one line, ...}) and never raises into the engine.

`info()` says what the worker serves: the drafter's classes, the export it was loaded from and the version
label the last swap gave it (`DRAFTSMITH_DRAFTER_VERSION` before any swap), the served export's format and
target fingerprint, and the target's text config as vLLM loaded it (capture_file.model_identity), from which
draftsmith's side computes the target's `config_hash` and refuses an export made for another target.

Runs inside vLLM's environment: the standard library, torch and safetensors only (scripts/check_imports.py,
rule 5).
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import struct
import time
from pathlib import Path

import torch

from draftsmith.fleet.capture_file import model_identity

GUARD, CONFIG = "draftsmith.json", "config.json"
MAX_JSON_BYTES = 4 << 20  # draftsmith.json and config.json: a few KiB each; a larger one is no export's
MAX_HEADER_BYTES = 64 << 20  # a safetensors header (JSON of names, dtypes, shapes, offsets)
# config.json fields that say where or by what a file was written, not what the drafter is
_NOT_SHAPE = frozenset({"_name_or_path", "transformers_version", "torch_dtype", "dtype"})
ENV_VERSION = "DRAFTSMITH_DRAFTER_VERSION"


class Refused(Exception):  # noqa: N818 - read as "the swap is refused"
    """One line: why a new drafter is not loaded (the old one keeps serving)."""


def _regular(path: Path, what: str) -> os.stat_result:
    try:
        st = os.stat(path, follow_symlinks=False)
    except OSError as e:
        raise Refused(f"{path}: {what} cannot be read ({e.strerror or type(e).__name__})") from None
    if not stat.S_ISREG(st.st_mode):
        raise Refused(f"{path}: {what} is not a regular file (a link or another kind): refused")
    return st


def read_small_json(path: Path, what: str) -> dict:
    st = _regular(path, what)
    if st.st_size > MAX_JSON_BYTES:
        raise Refused(f"{path}: {st.st_size} bytes, more than a {what} holds ({MAX_JSON_BYTES}): refused")
    try:
        doc = json.loads(path.read_bytes())
    except (ValueError, RecursionError) as e:
        raise Refused(f"{path}: {what} is not JSON ({type(e).__name__})") from None
    if not isinstance(doc, dict):
        raise Refused(f"{path}: {what} is not a JSON object")
    return doc


def weight_files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.name.endswith(".safetensors") and not p.name.startswith("."))


def header(path: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """{tensor name: (dtype, shape)} from a safetensors file's header, read bounded, no tensor loaded."""
    st = _regular(path, "weight file")
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise Refused(f"{path}: not a safetensors file (shorter than its header's length)")
        (n,) = struct.unpack("<Q", raw)
        if n > min(MAX_HEADER_BYTES, st.st_size - 8):
            raise Refused(f"{path}: a safetensors header of {n} bytes in a {st.st_size}-byte file: refused")
        try:
            doc = json.loads(f.read(n))
        except ValueError:
            raise Refused(f"{path}: its safetensors header is not JSON") from None
    if not isinstance(doc, dict):
        raise Refused(f"{path}: its safetensors header is not a JSON object")
    out = {}
    for name, entry in doc.items():
        if name == "__metadata__":
            continue
        if not (isinstance(entry, dict) and isinstance(entry.get("dtype"), str)
                and isinstance(entry.get("shape"), list)):
            raise Refused(f"{path}: tensor {name!r} has no dtype and shape in the header")
        out[name] = (entry["dtype"], tuple(entry["shape"]))
    return out


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def _first_difference(old: dict, new: dict) -> str | None:
    for key in sorted(set(old) | set(new)):
        if key in _NOT_SHAPE:
            continue
        if old.get(key) != new.get(key):
            return f"{key}: {str(old.get(key))[:80]} -> {str(new.get(key))[:80]}"
    return None


def check_export(new: Path, served: Path) -> tuple[dict, list[Path]]:
    """Everything known before a tensor moves (module docstring): the new export against the served one.
    Returns (the new draftsmith.json, its weight files) or raises Refused naming the file and field."""
    if not new.is_dir():
        raise Refused(f"{new}: no export folder there")
    guard, old_guard = read_small_json(new / GUARD, GUARD), read_small_json(served / GUARD, GUARD)
    for key in ("format", "stack"):
        if guard.get(key) != old_guard.get(key):
            raise Refused(f"{new / GUARD}: {key} is {guard.get(key)!r}, the server serves {old_guard.get(key)!r}: "
                          "another method needs a restart")
    new_target, old_target = guard.get("target") or {}, old_guard.get("target") or {}
    for key in ("config_hash", "vocab_size", "tokenizer_hash"):
        if new_target.get(key) != old_target.get(key):
            raise Refused(f"{new / GUARD}: target.{key} differs from the served export's ({served / GUARD}): "
                          "made for another target")
    diff = _first_difference(read_small_json(served / CONFIG, CONFIG), read_small_json(new / CONFIG, CONFIG))
    if diff:
        raise Refused(f"{new / CONFIG}: {diff} differs from the served drafter's config: vLLM built the running "
                      "drafter from the served one, so this one needs a restart")
    files, old_files = weight_files(new), weight_files(served)
    if [p.name for p in files] != [p.name for p in old_files]:
        raise Refused(f"{new}: weight files {[p.name for p in files]}, the served export has "
                      f"{[p.name for p in old_files]}")
    sums = guard.get("checksums")
    if not isinstance(sums, dict):
        raise Refused(f"{new / GUARD}: checksums are missing: the weights cannot be checked")
    for path, old_path in zip(files, old_files):
        new_header = header(path)  # first: it refuses a link or another kind of file before a byte is hashed
        if sums.get(path.name) != sha256_file(path):
            raise Refused(f"{path}: sha256 differs from {GUARD}'s checksums.{path.name} (damaged or replaced)")
        _same_tensors(path, new_header, header(old_path))
    return guard, files


def _same_tensors(path: Path, new: dict, old: dict) -> None:
    if set(new) != set(old):
        extra, missing = sorted(set(new) - set(old)), sorted(set(old) - set(new))
        raise Refused(f"{path}: tensors differ from the served drafter's (new: {extra[:3]}, missing: {missing[:3]})")
    for name, (dtype, shape) in new.items():
        if (dtype, shape) != old[name]:
            raise Refused(f"{path}: tensor {name} is {dtype} {list(shape)}, the served drafter's is "
                          f"{old[name][0]} {list(old[name][1])}")


class DrafterSwap:
    """vLLM worker extension (`--worker-extension-cls draftsmith.fleet.drafter_swap.DrafterSwap`); module
    docstring. Its methods are called by name through collective_rpc; each name is draftsmith's own, so none
    shadows a worker's method (vLLM refuses an extension that would)."""

    def _drafter_state(self) -> dict:
        state = getattr(self, "_draftsmith_swap", None)
        if state is None:
            spec = self.vllm_config.speculative_config
            state = {"path": str(getattr(spec, "model", "") or ""), "version": os.environ.get(ENV_VERSION) or None,
                     "staged": None, "swaps": 0}
            self._draftsmith_swap = state
        return state

    def _drafter_model(self):
        drafter = getattr(self.model_runner, "drafter", None)
        model = getattr(drafter, "model", None)
        if not isinstance(model, torch.nn.Module) or not hasattr(model, "load_weights"):
            raise Refused(f"the server's proposer ({type(drafter).__name__}) has no drafter weights to swap")
        return model

    def draftsmith_drafter_info(self) -> dict:
        try:
            state = self._drafter_state()
            model = self._drafter_model()
            guard = read_small_json(Path(state["path"]) / GUARD, GUARD)
            config = self.vllm_config.model_config.hf_text_config.to_dict()
            return {"ok": True, "version": state["version"], "path": state["path"], "swaps": state["swaps"],
                    "proposer": type(self.model_runner.drafter).__name__, "model": type(model).__name__,
                    "format": guard.get("format"), "stack": guard.get("stack"),
                    "target_fingerprint": guard.get("target"), "served_target": model_identity(config),
                    "rank": getattr(self, "rank", None)}
        except Exception as e:  # noqa: BLE001 - never into the engine
            return {"ok": False, "error": _line(e)}

    def draftsmith_drafter_check(self, path: str, version: str) -> dict:
        """Phase 1 (module docstring): checks, then the new tensors read to the CPU and staged — with the served
        export's, which a revert loads back (never dependent on the disk then)."""
        state = self._drafter_state()
        try:
            model = self._drafter_model()
            guard, files = check_export(Path(path), Path(state["path"]))
            new, old = _read(files), _read(weight_files(Path(state["path"])))
            shared = _shared_names(model, self.model_runner.model, new, old)
            state["staged"] = {"path": str(Path(path)), "version": str(version), "shared": shared,
                               "new": {n: t for n, t in new.items() if n not in shared},
                               "old": {n: t for n, t in old.items() if n not in shared},
                               "before": {"path": state["path"], "version": state["version"]}}
            return {"ok": True, "tensors": len(new), "shared_with_target": sorted(shared),
                    "format": guard.get("format")}
        except Exception as e:  # noqa: BLE001 - never into the engine
            state["staged"] = None
            return {"ok": False, "error": _line(e)}

    def draftsmith_drafter_commit(self) -> dict:
        """Phase 2: the staged tensors loaded as vLLM reloads weights in place; on any failure the served
        export's loaded back."""
        state = self._drafter_state()
        staged, start = state.get("staged"), time.perf_counter()
        if not staged:
            return {"ok": False, "error": "no checked drafter is staged (check first)"}
        try:
            _reload(self._drafter_model(), staged["new"], self.vllm_config)
        except Exception as e:  # noqa: BLE001 - never into the engine: the old tensors go back
            error = _line(e)
            put_back = self.draftsmith_drafter_revert()
            return {"ok": False, "error": error, "restored": put_back.get("ok", False)}
        state.update(path=staged["path"], version=staged["version"], swaps=state["swaps"] + 1, committed=True)
        return {"ok": True, "seconds": round(time.perf_counter() - start, 4), "version": state["version"]}

    def draftsmith_drafter_revert(self) -> dict:
        """The served export's tensors loaded back (another worker's commit failed, or this one's)."""
        state = self._drafter_state()
        staged = state.get("staged")
        if not staged:
            return {"ok": True, "note": "nothing to put back"}
        try:
            _reload(self._drafter_model(), staged["old"], self.vllm_config)
            state.update(**staged["before"])
            return {"ok": True}
        except Exception as e:  # noqa: BLE001 - never into the engine
            return {"ok": False, "error": _line(e)}

    def draftsmith_drafter_forget(self) -> dict:
        state = self._drafter_state()
        state["staged"] = None
        return {"ok": True}


def _read(files: list[Path]) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        tensors.update(load_file(str(f), device="cpu"))
    return tensors


def _shared_names(model: torch.nn.Module, target: torch.nn.Module, new: dict, old: dict) -> set[str]:
    """The export's tensors that belong to a module the drafter shares with the target (vLLM shares the target's
    embedding, or lm_head, with a head whose copy was identical): never loaded — that would write into the
    target — and so they must be what the served export had, else Refused (a restart is needed)."""
    target_modules = {id(m) for m in target.modules()}
    shared = {name.rsplit(".", 1)[-1] for name, m in model.named_modules() if name and id(m) in target_modules}
    out = set()
    for name, tensor in new.items():
        parts = name.split(".")
        if not any(p in shared for p in parts[:-1]):
            continue
        if name not in old or not torch.equal(tensor, old[name]):
            raise Refused(f"tensor {name}: the server shares it with the target (vLLM found the served drafter's "
                          "copy identical to the target's), and the new drafter's differs: a restart is needed")
        out.add(name)
    return out


def _reload(model: torch.nn.Module, tensors: dict[str, torch.Tensor], vllm_config) -> None:
    """Load `tensors` into the running drafter as vLLM reloads weights in place (model_loader/reload: each layer
    put back on its meta description, loaded through its own weight loaders, processed as at start — the CPU
    backend repacks its linear weights there — and copied into the original storage). A vLLM without that
    machinery: the model's load_weights alone."""
    try:
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload
    except ImportError:
        with torch.no_grad():
            model.load_weights(iter(tensors.items()))
        return
    draft_config = vllm_config.speculative_config.draft_model_config
    with set_current_vllm_config(vllm_config), torch.no_grad():
        initialize_layerwise_reload(model)
        try:
            model.load_weights(iter(tensors.items()))
        finally:
            finalize_layerwise_reload(model, draft_config)


def _line(e: Exception) -> str:
    text = str(e).strip().splitlines()
    return (text[0] if isinstance(e, Refused) else f"{type(e).__name__}: {text[0] if text else ''}")[:2000]
