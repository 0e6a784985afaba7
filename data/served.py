"""Rows and features the fleet already computed: the hidden-state captures fleet/vllm_capture.py writes while
vLLM serves (one file per request), read, checked and turned into a dataset and a capture cache that every
training job reads (`data=OUT`, `capture_cache=OUT/capture`) — without running the target over the rows again.

What a served request gives: the token ids the fleet read and wrote (prompt + answer: the target's own answer
where the fleet decodes greedily or samples from the target, since speculative decoding is lossless), the
prompt/answer boundary, and the outputs of the layers the serving config named (vLLM's ids: id i is the
residual stream entering layer i, i.e. the output of decoder layer i-1; id L is the last layer's output before
the final norm). A job's layers (draftsmith ids, capture/layers.py) are read at vLLM id i+1; the post-norm state
EAGLE-3's teacher reads and its top-k logits are the target's final norm and lm_head applied to id L — the only
part of the target that runs here. The answer's last token was sampled, never an input: its position gets zero
features, which no loss reads (nothing follows it).

A capture folder is written while it is read: temporary files are not captures; a file that is torn, not ours,
fails its checksum, or does not fit the target (vocabulary, context, hidden size, layers) is named and skipped
(`bad`, the first few with why), and the rest is used. Rows are keyed by their token ids (the same request served
twice is one row), so an import resumes into the same folder: the cache's shards skip rows already in them.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch

from draftsmith.capture.cache import ShardWriter, safetensors_header
from draftsmith.errors import DataError
from draftsmith.fleet.capture_file import FORMAT, SUFFIX, VERSION, digest
from draftsmith.storage import atomic_write_json, is_int

log = logging.getLogger(__name__)

MAX_NAMED = 20
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_ST_DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}
_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:-]{1,200}$")
_ENGINE_SUFFIX = re.compile(r"-[0-9a-f]{8}$")


@dataclass
class ServedRequest:
    path: Path
    request_id: str
    token_ids: list[int]
    prompt_tokens: int
    layers: list[int]  # vLLM ids, in the order of hidden_states' second axis
    hidden: torch.Tensor  # [len(token_ids) - 1, len(layers), hidden_size]


def vllm_layer_ids(layers: list[int], num_layers: int) -> list[int]:
    """The `eagle_aux_hidden_state_layer_ids` a serving config captures for a job's layers (draftsmith ids,
    resolved): each at vLLM id i+1, and the last layer's output (id L), from which the post-norm state and the
    target's logits are computed."""
    return sorted({int(i) + 1 for i in layers} | {int(num_layers)})


def serving_config(vllm_ids: list[int], capture_dir: str | Path, max_gb: float = 64.0) -> tuple[dict, dict]:
    """vLLM's `--speculative-config` and `--kv-transfer-config` of a capture replica: the target serves as it
    is (extract_hidden_states drafts nothing) and the connector writes the layers `vllm_ids` of every request it
    serves into `capture_dir` (which draftsmith must be able to read: shared storage in a fleet)."""
    spec = {"method": "extract_hidden_states", "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": [int(i) for i in vllm_ids]}}}
    kv = {"kv_connector": "DraftsmithCaptureConnector", "kv_role": "kv_producer",
          "kv_connector_module_path": "draftsmith.fleet.vllm_capture",
          "kv_connector_extra_config": {"capture_dir": str(capture_dir), "max_gb": float(max_gb)}}
    return spec, kv


def response_ids(request_id: str) -> list[str]:
    """The API response ids an engine request id can belong to: vLLM appends `-<8 hex>` to the id it was given
    (`chatcmpl-<id>`), and a completions request's prompt index before that (`cmpl-<id>-<i>`)."""
    base = _ENGINE_SUFFIX.sub("", request_id)
    out = [base]
    head, _, tail = base.rpartition("-")
    if head and tail.isdigit():
        out.append(head)
    return out


def _meta(path: Path, header: dict) -> dict:
    try:
        meta = json.loads((header.get("__metadata__") or {})["draftsmith"])
    except (KeyError, TypeError, ValueError, RecursionError):
        raise DataError(f"{path}: not a draftsmith capture (no draftsmith metadata)") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise DataError(f"{path}: not a draftsmith capture (field 'format' is not {FORMAT!r})")
    if meta.get("version") != VERSION:
        raise DataError(f"{path}: field 'version' is {json.dumps(meta.get('version'))[:20]}, this draftsmith reads "
                        f"version {VERSION}")
    checks = {
        "request_id": lambda v: isinstance(v, str) and _REQUEST_ID.match(v) is not None,
        "layers": lambda v: isinstance(v, list) and 0 < len(v) <= 1024 and all(is_int(i, 0, 1 << 20) for i in v)
        and len(set(v)) == len(v),
        "n_tokens": lambda v: is_int(v, 2, 1 << 31),
        "prompt_tokens": lambda v: is_int(v, 1, 1 << 31),
        "hidden_size": lambda v: is_int(v, 1, 1 << 20),
        "dtype": lambda v: v in _DTYPES,
        "sha256": lambda v: isinstance(v, str) and re.fullmatch(r"[0-9a-f]{64}", v) is not None,
    }
    for key, check in checks.items():
        if not check(meta.get(key)):
            raise DataError(f"{path}: field '{key}' is {json.dumps(meta.get(key))[:60]}, not what the connector "
                            "writes")
    if meta["prompt_tokens"] >= meta["n_tokens"]:
        raise DataError(f"{path}: field 'prompt_tokens' is {meta['prompt_tokens']} of {meta['n_tokens']} tokens: "
                        "no answer")
    return meta


def _check_tensors(path: Path, header: dict, meta: dict) -> None:
    """The tensors the metadata describes, by name, dtype and shape, before a byte of them is loaded."""
    want = {"hidden_states": (_ST_DTYPES[meta["dtype"]], [meta["n_tokens"] - 1, len(meta["layers"]), meta["hidden_size"]]),
            "token_ids": ("I64", [meta["n_tokens"]])}
    names = {k for k in header if k != "__metadata__"}
    if names != set(want):
        raise DataError(f"{path}: tensors {sorted(names)[:4]}, a capture holds {sorted(want)}")
    for name, (dtype, shape) in want.items():
        got = header[name]
        if not isinstance(got, dict) or got.get("dtype") != dtype or got.get("shape") != shape:
            raise DataError(f"{path}: tensor '{name}' is {got.get('dtype') if isinstance(got, dict) else got} "
                            f"{got.get('shape') if isinstance(got, dict) else ''}, its metadata says {dtype} {shape}")


def read_capture(path: str | Path) -> ServedRequest:
    """One capture file, checked whole (module docstring): a DataError in one line naming the file and what
    is wrong."""
    from safetensors import SafetensorError, safe_open

    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: not a capture file (missing or not a regular file)")
    header = safetensors_header(path)
    meta = _meta(path, header)
    _check_tensors(path, header, meta)
    try:
        with safe_open(str(path), framework="pt") as f:
            hidden, ids = f.get_tensor("hidden_states"), f.get_tensor("token_ids")
    except (OSError, SafetensorError) as e:
        raise DataError(f"{path}: unreadable ({type(e).__name__}: {str(e).splitlines()[0][:120]})") from None
    if digest(hidden, ids) != meta["sha256"]:
        raise DataError(f"{path}: checksum mismatch (the file changed after vLLM wrote it): refused")
    if not torch.isfinite(hidden).all():
        raise DataError(f"{path}: tensor 'hidden_states' holds NaN or inf")
    return ServedRequest(path, meta["request_id"], ids.tolist(), meta["prompt_tokens"], list(meta["layers"]), hidden)


@dataclass
class Scan:
    """The readable captures of a folder, and what could not be used (named, counted)."""

    requests: list[ServedRequest] = field(default_factory=list)
    skipped: int = 0
    bad: list[str] = field(default_factory=list)

    def reject(self, why: str) -> None:
        self.skipped += 1
        if len(self.bad) < MAX_NAMED:
            self.bad.append(why)


def _fits(req: ServedRequest, target, needed: list[int]) -> str | None:
    from draftsmith.targets.context import context_window

    missing = [i for i in needed if i not in req.layers]
    if missing:
        return f"layers {req.layers} captured, the job needs vLLM ids {missing} (serve with vllm_layer_ids)"
    if req.hidden.shape[-1] != target.hidden_size:
        return f"hidden size {req.hidden.shape[-1]}, the target's is {target.hidden_size}: another model served it"
    bad = next((t for t in req.token_ids if not 0 <= t < target.vocab_size), None)
    if bad is not None:
        return f"token id {bad} outside the target's vocabulary of {target.vocab_size}"
    ctx = context_window(target)
    if ctx is not None and len(req.token_ids) > ctx:
        return f"{len(req.token_ids)} tokens, past the target's context of {ctx}"
    return None


def scan_captures(folder: str | Path, target, needed: list[int], only: set[str] | None = None) -> Scan:
    """Every capture file of `folder` (vLLM ids `needed` present, fitting the target), sorted by name; with
    `only`, those of these response ids alone (told by the file's name, before it is read)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise DataError(f"{folder}: no capture folder (the connector's capture_dir)")
    scan = Scan()
    for path in sorted(p for p in folder.iterdir() if p.name.endswith(SUFFIX) and not p.name.startswith(".")):
        if only is not None and not any(i in only for i in response_ids(path.name[:-len(SUFFIX)])):
            continue
        try:
            req = read_capture(path)
        except DataError as e:
            scan.reject(str(e))
            continue
        why = _fits(req, target, needed)
        if why:
            scan.reject(f"{path}: {why}")
            continue
        scan.requests.append(req)
    return scan


def row_id(token_ids: list[int]) -> int:
    """A row's id from its token ids (60 bits): the same request served twice is one row."""
    return int(hashlib.sha256(json.dumps(token_ids).encode()).hexdigest()[:15], 16)


@torch.no_grad()
def features(req: ServedRequest, target, layers: list[int], topk: int = 0, last_hidden: bool = False,
             logsumexp: bool = False, chunk: int = 512, logits_from: int = 0) -> dict:
    """ShardWriter.add's arguments for one request: the job's layers (draftsmith ids) at vLLM id i+1, and
    from the last layer's output the post-norm state and the top-k logits (final norm + lm_head, in chunks of
    `chunk` positions); the answer's last position is zeros (module docstring). Top-k rows before
    `logits_from` are zeros, as the target's own capture leaves them (capture/cache.py): no loss reads a
    position before the one that predicts the first learned token, and the lm_head is most of the cost."""
    from draftsmith.capture.forward import topk_logits, topk_with_logsumexp
    from draftsmith.targets.families import final_norm, lm_head

    col = {v: j for j, v in enumerate(req.layers)}
    pad = lambda t: torch.cat([t, t.new_zeros(1, *t.shape[1:])])  # noqa: E731
    out: dict = {"layers": {i: pad(req.hidden[:, col[i + 1]]) for i in layers}}
    if not (last_hidden or topk):
        return out
    model, L = target.model, target.num_layers
    final = req.hidden[:, col[L]]
    norm = torch.cat([final_norm(model)(final[s:s + chunk].to(target.device, target.dtype)).float().cpu()
                      for s in range(0, final.shape[0], chunk)])
    if last_hidden:
        out["last_hidden"] = pad(norm)
    if topk:
        head, start = lm_head(model), min(max(int(logits_from), 0), norm.shape[0])
        parts = []
        for s in range(start, norm.shape[0], chunk):
            logits = head(norm[s:s + chunk].to(target.device, target.dtype))
            parts.append(topk_with_logsumexp(logits, topk) if logsumexp else (*topk_logits(logits, topk), None))
        skipped = lambda t: torch.cat([t.new_zeros(start, *t.shape[1:]), t])  # noqa: E731
        n = norm.shape[0] - start
        values = torch.cat([p[0].cpu() for p in parts]) if parts else torch.zeros(n, topk)
        out["topk_values"] = pad(skipped(values))
        out["topk_indices"] = pad(skipped(torch.cat([p[1].cpu() for p in parts]) if parts else
                                          torch.zeros(n, topk, dtype=torch.long)))
        if logsumexp:
            out["logsumexp"] = pad(skipped(torch.cat([p[2].cpu() for p in parts]) if parts else torch.zeros(n)))
    return out


def _record(req: ServedRequest, target, domain: str, eos: set[int]) -> dict:
    ids, p = req.token_ids, req.prompt_tokens
    tok = target.tokenizer
    return {"row_id": row_id(ids), "source": "fleet", "domain": domain,
            "prompt": tok.decode(ids[:p]), "response": tok.decode(ids[p:]), "input_ids": ids,
            "loss_mask": [0] * p + [1] * (len(ids) - p), "origin": f"served:{req.request_id}",
            "stopped": ids[-1] in eos, "n_turns": 1}


def import_served(folder: str | Path, target, out: str | Path, layers: list[int], *, topk: int = 0,
                  last_hidden: bool = False, logsumexp: bool = False, domains: dict[str, str] | None = None,
                  default_domain: str = "served", hidden_dtype: torch.dtype = torch.bfloat16,
                  only: set[str] | None = None, progress: bool = True) -> dict:
    """Captures of `folder` -> a dataset at `out` (load_distilled reads it) and its capture cache at
    `out/capture` holding `layers` (draftsmith ids) and, if asked, the post-norm state and top-k logits.
    `domains`: API response id -> domain (the traffic log's rows); a request it does not name gets
    `default_domain`. `only`: the response ids to take (None: every capture). Resumes into the same `out`.
    Returns the provenance written."""
    from tqdm.auto import tqdm

    from draftsmith.data.output import CAPTURE_DIR, PROVENANCE, claim_output, write_rows
    from draftsmith.data.rows import RowLimits, check_row

    t0 = time.time()
    out = Path(out)
    claim_output(out)
    needed = vllm_layer_ids(layers, target.num_layers)
    scan = scan_captures(folder, target, needed, only)
    if not scan.requests:
        raise DataError(f"{folder}: no capture the target can use ({scan.skipped} skipped"
                        f"{'; first: ' + scan.bad[0] if scan.bad else ''})")
    eos, limits = {int(e) for e in target.eos_token_ids}, RowLimits.of(target)
    records: dict[int, dict] = {}
    writer = ShardWriter(out / CAPTURE_DIR, layers, topk, hidden_dtype, fingerprint=target.fingerprint())
    with writer:
        for req in tqdm(scan.requests, desc="import served", unit="request", disable=not progress):
            domain = next((domains[r] for r in response_ids(req.request_id) if r in (domains or {})), default_domain)
            rec = check_row(_record(req, target, domain, eos), str(req.path), limits)
            if rec["row_id"] in records:
                continue  # the same tokens served twice: one row
            records[rec["row_id"]] = rec
            if rec["row_id"] not in writer:
                f = features(req, target, layers, topk, last_hidden, logsumexp, logits_from=req.prompt_tokens - 1)
                writer.add(rec["row_id"], f["layers"], f.get("topk_values"), f.get("topk_indices"),
                           f.get("last_hidden"), f.get("logsumexp"))
    rows = list(records.values())
    write_rows(out, rows)
    prov = {"target": {"name": target.name, "spec": target.spec, "fingerprint": target.fingerprint(),
                       "folder": str(target.folder) if target.folder else None},
            "served": {"captures": str(folder), "requests": len(scan.requests), "skipped": scan.skipped,
                       "bad": scan.bad, "vllm_layers": needed, "duplicates": len(scan.requests) - len(rows)},
            "counts": {"rows": len(rows), "per_domain": dict(sorted(Counter(r["domain"] for r in rows).items())),
                       "tokens": sum(len(r["input_ids"]) for r in rows),
                       "loss_tokens": sum(sum(r["loss_mask"]) for r in rows)},
            "timing": {"wall_seconds": round(time.time() - t0, 2)},
            "capture": str(out / CAPTURE_DIR), "created": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    atomic_write_json(out / PROVENANCE, prov)
    if scan.skipped:
        log.warning("import served: %d capture(s) skipped; first: %s", scan.skipped, scan.bad[0])
    return prov


# a capture replica's file for one of generation's requests (data/engines/remote.py names them): vLLM's
# `cmpl-<X-Request-Id>-<prompt index>-<8 hex>`, the id being `ds-<row>-t<turn>-<12 hex>`
_GENERATED = re.compile(r"^cmpl-(ds-[A-Za-z0-9._:]+-t\d+)-[0-9a-f]{12}-\d+-[0-9a-f]{8}" + re.escape(SUFFIX) + "$")


def captures_by_turn(folder: str | Path) -> dict[str, list[Path]]:
    """The capture files of `folder` that answer generation's requests, by the row and turn they answer
    (remote.request_key): a retried request leaves several. Told by name alone; nothing is read."""
    out: dict[str, list[Path]] = {}
    folder = Path(folder)
    if not folder.is_dir():
        return out
    for path in sorted(folder.iterdir()):
        m = _GENERATED.match(path.name)
        if m:
            out.setdefault(m[1], []).append(path)
    return out


def wait_for_captures(folder: str | Path, keys: set[str], seconds: float, poll: float = 0.2) -> dict[str, list[Path]]:
    """`captures_by_turn(folder)`, once every key of `keys` has a file or `seconds` (in all) have passed: the
    connector writes a request's file just after its answer went out."""
    end = time.monotonic() + seconds
    while True:
        found = captures_by_turn(folder)
        if keys <= set(found) or time.monotonic() >= end:
            return found
        time.sleep(poll)


def _row_capture(rec: dict, paths: list[Path], target, needed: list[int], bad: list[str]) -> ServedRequest | str:
    """The capture among `paths` whose tokens are the row's input_ids (prompt of its last turn + answer), or why
    none is: a file that cannot be used is named in `bad` (the first MAX_NAMED)."""
    if not paths:
        return "missing"
    for path in paths:
        try:
            req = read_capture(path)
        except DataError as e:
            why = str(e)
        else:
            why = _fits(req, target, needed)
            if why is None and req.token_ids == list(rec["input_ids"]):
                return req
            why = f"{path}: {why or 'its tokens are not those of the row'}"
        if len(bad) < MAX_NAMED:
            bad.append(why)
    return "differs"


def join_captures(records: list[dict], folder: str | Path, target, cc, writer: ShardWriter,
                  found: dict[str, list[Path]]) -> tuple[dict, list[dict]]:
    """Each row not yet in `writer` takes the features of its last turn's capture in `found`
    (captures_by_turn): `cc`'s layers (draftsmith ids, -1 included), top-k with its logsumexp, the post-norm
    state. Returns the counts and the rows no capture fits (missing, or other tokens), which the caller has the
    target capture: counted and named here, never silent."""
    from draftsmith.capture.layers import resolve_layers
    from draftsmith.data.engines.remote import request_key

    resolved = resolve_layers(list(cc.layers), target.num_layers)
    needed = vllm_layer_ids(resolved, target.num_layers)
    todo = [r for r in records if int(r["row_id"]) not in writer]
    fallback, named, why, bad = [], [], Counter(), []
    for rec in todo:
        got = _row_capture(rec, found.get(request_key(rec["row_id"], rec["n_turns"] - 1), []), target, needed, bad)
        if isinstance(got, str):
            fallback.append(rec)
            why[got] += 1
            if len(named) < MAX_NAMED:
                named.append(f"{rec['origin']}: {got}")
            continue
        f = features(got, target, resolved, cc.topk, cc.last_hidden, logsumexp=bool(cc.topk))
        writer.add(int(rec["row_id"]), {i: f["layers"][j] for i, j in zip(cc.layers, resolved)},
                   f.get("topk_values"), f.get("topk_indices"), f.get("last_hidden"), f.get("logsumexp"))
    stats = {"backend": "vllm", "served_dir": str(folder), "rows": len(records),
             "cached_rows": len(records) - len(todo), "from_vllm": len(todo) - len(fallback),
             "from_target": len(fallback), "fallback": dict(why), "fallback_rows": named, "bad": bad}
    if fallback:
        log.warning("capture.backend vllm: %d of %d rows had no capture of their tokens in %s (%s); the target "
                    "captures them (first: %s)", len(fallback), len(todo), folder, dict(why), fallback[0]["origin"])
    return stats, fallback
