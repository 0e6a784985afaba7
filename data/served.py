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
named for another request than its metadata's, fails its checksum, or does not fit the target is named and
skipped (`bad`, the first few with why), and the rest is used. What fits is told from the header first, before
a byte of the tensors is read: the model that served it (its config against the target's fingerprint
`config_hash`, naming the field that differs), hidden size, layers, the target's context; then, one file at a
time, the checksum, finite states and token ids in the vocabulary. Rows are keyed by their token ids (the same
request served twice is one row), so an import resumes into the same folder: the cache's shards skip rows
already in them.

A capture joins the traffic log's row whose response id its engine request id answers (response_id, parsed by
the form of its endpoint). A response id answered by more than one capture (a client that sent one
X-Request-Id with two requests) says nothing of which capture is which row: none of them is joined (`shared`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import re
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch

from draftsmith.capture.cache import ShardWriter, safetensors_header
from draftsmith.config import show
from draftsmith.errors import DataError
from draftsmith.fleet.capture_file import FORMAT, SUFFIX, VERSION, digest, file_stem, request_id_of
from draftsmith.outputs import atomic_write_json
from draftsmith.reading import is_int

log = logging.getLogger(__name__)

MAX_NAMED = 20
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_ST_DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}
_ST_BYTES = {"F32": 4, "BF16": 2, "F16": 2, "I64": 8}
# vLLM's engine request id of an API request, by endpoint (vllm/entrypoints/openai/{completion,
# chat_completion}/serving.py build `cmpl-<id>-<prompt index>` and `chatcmpl-<id>`;
# v1/engine/input_processor.assign_request_id appends `-` and 8 random hex): the response id is the group, and
# nothing else is taken off
ENGINE_IDS = {"completions": re.compile(r"(cmpl-.+)-\d+-[0-9a-f]{8}", re.S),
              "chat.completions": re.compile(r"(chatcmpl-.+)-[0-9a-f]{8}", re.S)}


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


def response_id(engine_id: str) -> str | None:
    """The API response id (the traffic log's `id`) of a vLLM engine request id, parsed by the form of its
    endpoint (ENGINE_IDS): `cmpl-<id>-<prompt index>-<8 hex>` answers `cmpl-<id>`, `chatcmpl-<id>-<8 hex>`
    answers `chatcmpl-<id>` (a chat id `job-0` stays `job-0`). None for any other form (the samples of an
    n > 1 request, `<i>_<id>`): such a capture joins no logged request."""
    for form in ENGINE_IDS.values():
        m = form.fullmatch(engine_id)
        if m:
            return m[1]
    return None


@dataclass
class Expect:
    """What a capture must agree on with the target (and the job), computed once for a whole folder."""

    summary: dict  # the target's config summary (targets/fingerprint.py), whose hash is its config_hash
    hidden_size: int
    vocab_size: int
    context: int | None
    needed: list[int]  # vLLM layer ids the job reads

    @classmethod
    def of(cls, target, needed: list[int]) -> Expect:
        from draftsmith.targets.context import context_window
        from draftsmith.targets.fingerprint import config_summary

        return cls(config_summary(target.model.config), int(target.hidden_size), int(target.vocab_size),
                   context_window(target), [int(i) for i in needed])


def _meta(path: Path, header: dict) -> dict:
    from draftsmith.fleet.capture_file import MAX_ID

    try:
        meta = json.loads((header.get("__metadata__") or {})["draftsmith"])
    except (KeyError, TypeError, ValueError, RecursionError):
        raise DataError(f"{path}: not a draftsmith capture (no draftsmith metadata)") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise DataError(f"{path}: not a draftsmith capture (field 'format' is not {FORMAT!r})")
    if meta.get("version") != VERSION:
        raise DataError(f"{path}: field 'version' is {json.dumps(meta.get('version'))[:20]}, this draftsmith reads "
                        f"version {VERSION} (earlier captures name no model: capture the traffic again)")
    checks = {
        "request_id": lambda v: isinstance(v, str) and 0 < len(v) <= MAX_ID,
        "layers": lambda v: isinstance(v, list) and 0 < len(v) <= 1024 and all(is_int(i, 0, 1 << 20) for i in v)
        and len(set(v)) == len(v),
        "n_tokens": lambda v: is_int(v, 2, 1 << 31),
        "prompt_tokens": lambda v: is_int(v, 1, 1 << 31),
        "hidden_size": lambda v: is_int(v, 1, 1 << 20),
        "dtype": lambda v: v in _DTYPES,
        "model": lambda v: isinstance(v, dict) and isinstance(v.get("config"), dict)
        and isinstance(v.get("name"), str),
        "sha256": lambda v: isinstance(v, str) and re.fullmatch(r"[0-9a-f]{64}", v) is not None,
    }
    for key, check in checks.items():
        if not check(meta.get(key)):
            raise DataError(f"{path}: field '{key}' is {json.dumps(meta.get(key))[:60]}, not what the connector "
                            "writes")
    if meta["prompt_tokens"] >= meta["n_tokens"]:
        raise DataError(f"{path}: field 'prompt_tokens' is {meta['prompt_tokens']} of {meta['n_tokens']} tokens: "
                        "no answer")
    if file_stem(meta["request_id"]) + SUFFIX != path.name:
        raise DataError(f"{path}: field 'request_id' is {show(meta['request_id'])}, whose capture is named "
                        f"{show(file_stem(meta['request_id']) + SUFFIX)}: another request's file, refused")
    return meta


def _check_tensors(path: Path, header: dict, meta: dict) -> None:
    """The tensors the metadata describes, by name, dtype, shape and bytes, before a byte of them is read."""
    want = {"hidden_states": (_ST_DTYPES[meta["dtype"]],
                              [meta["n_tokens"] - 1, len(meta["layers"]), meta["hidden_size"]]),
            "token_ids": ("I64", [meta["n_tokens"]])}
    names = {k for k in header if k != "__metadata__"}
    if names != set(want):
        raise DataError(f"{path}: tensors {sorted(names)[:4]}, a capture holds {sorted(want)}")
    for name, (dtype, shape) in want.items():
        got = header[name]
        if not isinstance(got, dict) or got.get("dtype") != dtype or got.get("shape") != shape:
            raise DataError(f"{path}: tensor '{name}' is {got.get('dtype') if isinstance(got, dict) else got} "
                            f"{got.get('shape') if isinstance(got, dict) else ''}, its metadata says {dtype} {shape}")
        offsets, size = got.get("data_offsets"), math.prod(shape) * _ST_BYTES[dtype]
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(is_int(o, 0) for o in offsets)
                and offsets[1] - offsets[0] == size):
            raise DataError(f"{path}: tensor '{name}' spans {show(offsets)}, its shape needs {size} bytes")


def _fits_header(path: Path, meta: dict, expect: Expect) -> None:
    """The capture against the target from its metadata alone (nothing of its tensors read): the model that
    served it, hidden size, the job's layers, the target's context."""
    from draftsmith.checksums import sha256_json
    from draftsmith.targets.fingerprint import ARCH_FIELDS, summary_of

    theirs = summary_of(meta["model"]["config"])
    if sha256_json(theirs) != sha256_json(expect.summary):
        key = next((k for k in ARCH_FIELDS if sha256_json(theirs.get(k)) != sha256_json(expect.summary.get(k))),
                   "?")
        raise DataError(f"{path}: field 'model.config.{key}' is {show(theirs.get(key))}, the target's is "
                        f"{show(expect.summary.get(key))}: another model ({show(meta['model']['name'])}) "
                        "served it")
    if meta["hidden_size"] != expect.hidden_size:
        raise DataError(f"{path}: field 'hidden_size' is {meta['hidden_size']}, the target's is "
                        f"{expect.hidden_size}: another model served it")
    missing = [i for i in expect.needed if i not in meta["layers"]]
    if missing:
        raise DataError(f"{path}: field 'layers' is {meta['layers']}: layers {meta['layers']} captured, the "
                        f"job needs vLLM ids {missing} (serve with vllm_layer_ids)")
    if expect.context is not None and meta["n_tokens"] > expect.context:
        raise DataError(f"{path}: field 'n_tokens' is {meta['n_tokens']}: {meta['n_tokens']} tokens, past "
                        f"the target's context of {expect.context}")


def check_capture(path: str | Path, expect: Expect | None = None) -> dict:
    """A capture file's metadata, checked from its header alone (module docstring) and, with `expect`, against
    the target: a DataError in one line naming the file and the field."""
    path = Path(path)
    if path.is_symlink() or not path.is_file():
        raise DataError(f"{path}: not a capture file (missing, a link or not a regular file)")
    header = safetensors_header(path)
    meta = _meta(path, header)
    _check_tensors(path, header, meta)
    if expect is not None:
        _fits_header(path, meta, expect)
    return meta


def load_capture(path: str | Path, meta: dict, expect: Expect | None = None) -> ServedRequest:
    """The tensors of a capture check_capture passed: checksum, finite states, token ids in the vocabulary."""
    from safetensors import SafetensorError, safe_open

    path = Path(path)
    try:
        with safe_open(str(path), framework="pt") as f:
            hidden, ids = f.get_tensor("hidden_states"), f.get_tensor("token_ids")
    except (OSError, SafetensorError, MemoryError, RuntimeError) as e:  # RuntimeError: torch's allocator
        first = (str(e).splitlines() or [""])[0][:120]
        raise DataError(f"{path}: unreadable ({type(e).__name__}: {first})") from None
    if digest(hidden, ids) != meta["sha256"]:
        raise DataError(f"{path}: checksum mismatch (the file changed after vLLM wrote it): refused")
    if not torch.isfinite(hidden).all():
        raise DataError(f"{path}: tensor 'hidden_states' holds NaN or inf")
    token_ids = ids.tolist()
    if expect is not None:
        bad = next((t for t in token_ids if not 0 <= t < expect.vocab_size), None)
        if bad is not None:
            raise DataError(f"{path}: tensor 'token_ids' holds token id {bad}, outside the target's "
                            f"vocabulary of {expect.vocab_size}")
    return ServedRequest(path, meta["request_id"], token_ids, meta["prompt_tokens"], list(meta["layers"]),
                         hidden)


def read_capture(path: str | Path, target=None, needed: list[int] | None = None) -> ServedRequest:
    """One capture file, checked whole (module docstring) and, given `target`, against it and the job's vLLM
    layer ids `needed`, its header before any tensor is read: a DataError in one line naming the file and what
    is wrong."""
    expect = Expect.of(target, needed or []) if target is not None else None
    return load_capture(path, check_capture(path, expect), expect)


@dataclass
class Capture:
    """A capture whose header passed check_capture: nothing of its tensors read yet."""

    path: Path
    meta: dict
    response_id: str | None


@dataclass
class Scan:
    """The captures of a folder that fit the target, and what could not be used (named, counted)."""

    captures: list[Capture] = field(default_factory=list)
    skipped: int = 0
    bad: list[str] = field(default_factory=list)
    shared: int = 0  # captures left out because another capture answers the same response id
    shared_ids: list[str] = field(default_factory=list)  # the first MAX_NAMED such response ids

    def reject(self, why: str) -> None:
        self.skipped += 1
        if len(self.bad) < MAX_NAMED:
            self.bad.append(why)


def _response_of_name(path: Path) -> str | None:
    rid = request_id_of(path.name[:-len(SUFFIX)])
    return response_id(rid) if rid is not None else None


def scan_captures(folder: str | Path, target, needed: list[int], only: set[str] | None = None,
                  join: bool = False) -> Scan:
    """Every capture file of `folder` whose header fits the target (vLLM ids `needed` present; nothing of a
    file's tensors is read here), sorted by name; with `only`, those of these response ids alone (told by the
    file's name where it holds the id, else by its header). With `join` (or `only`): a response id answered
    by several captures (two requests sent with one client X-Request-Id, or one request of several prompts)
    cannot tell which capture is which request, so none of them is used (counted in `shared`)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise DataError(f"{folder}: no capture folder (the connector's capture_dir)")
    expect = Expect.of(target, needed)
    scan, answers, found = Scan(), Counter(), []
    for path in sorted(p for p in folder.iterdir() if p.name.endswith(SUFFIX) and not p.name.startswith(".")):
        resp = _response_of_name(path)
        if only is not None and resp is not None and resp not in only:
            continue  # told by name: another request's
        try:
            meta = check_capture(path, expect)
        except DataError as e:
            answers[resp] += resp is not None  # a broken file of a response id still tells it was answered
            if only is None or resp is None or resp in only:
                scan.reject(str(e))
            continue
        resp = response_id(meta["request_id"])
        if only is not None and resp not in only:
            continue
        answers[resp] += resp is not None
        found.append(Capture(path, meta, resp))
    for cap in found:
        if (join or only is not None) and cap.response_id is not None and answers[cap.response_id] > 1:
            scan.shared += 1
            if cap.response_id not in scan.shared_ids and len(scan.shared_ids) < MAX_NAMED:
                scan.shared_ids.append(cap.response_id)
        else:
            scan.captures.append(cap)
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
    `default_domain`. `only`: the response ids to take (None: every capture). Joined to `domains` or `only`, a
    response id several captures answer is none of theirs (scan_captures). Each file is read when its turn
    comes (one capture's tensors in memory at a time); one that fails is named and skipped. Resumes into the
    same `out`. Returns the provenance written."""
    from tqdm.auto import tqdm

    from draftsmith.data.output import CAPTURE_DIR, PROVENANCE, claim_output, write_rows
    from draftsmith.data.rows import RowLimits, check_row

    t0 = time.time()
    out = Path(out)
    claim_output(out)
    needed = vllm_layer_ids(layers, target.num_layers)
    scan = scan_captures(folder, target, needed, only, join=domains is not None)
    expect = Expect.of(target, needed)
    if not scan.captures:
        raise DataError(f"{folder}: no capture the target can use ({scan.skipped} skipped, {scan.shared} "
                        f"sharing a response id{'; first: ' + scan.bad[0] if scan.bad else ''})")
    eos, limits = {int(e) for e in target.eos_token_ids}, RowLimits.of(target)
    records: dict[int, dict] = {}
    loaded = 0
    writer = ShardWriter(out / CAPTURE_DIR, layers, topk, hidden_dtype, fingerprint=target.fingerprint())
    with writer:
        for cap in tqdm(scan.captures, desc="import served", unit="request", disable=not progress):
            domain = (domains or {}).get(cap.response_id or "", default_domain)
            try:
                req = load_capture(cap.path, cap.meta, expect)
                rec = check_row(_record(req, target, domain, eos), str(req.path), limits)
            except DataError as e:
                scan.reject(str(e))
                continue
            loaded += 1
            if rec["row_id"] in records:
                continue  # the same tokens served twice: one row
            records[rec["row_id"]] = rec
            if rec["row_id"] not in writer:
                f = features(req, target, layers, topk, last_hidden, logsumexp, logits_from=req.prompt_tokens - 1)
                writer.add(rec["row_id"], f["layers"], f.get("topk_values"), f.get("topk_indices"),
                           f.get("last_hidden"), f.get("logsumexp"))
            del req
    if not records:
        raise DataError(f"{folder}: no capture the target can use ({scan.skipped} skipped"
                        f"{'; first: ' + scan.bad[0] if scan.bad else ''})")
    rows = list(records.values())
    write_rows(out, rows)
    prov = _provenance(target, folder, scan, needed, loaded, rows, time.time() - t0, out / CAPTURE_DIR)
    atomic_write_json(out / PROVENANCE, prov)
    if scan.skipped:
        log.warning("import served: %d capture(s) skipped; first: %s", scan.skipped, scan.bad[0])
    if scan.shared:
        log.warning("import served: %d capture(s) left out: their response ids are answered more than once "
                    "(first: %s)", scan.shared, scan.shared_ids[0])
    return prov


def _provenance(target, folder, scan: Scan, needed: list[int], loaded: int, rows: list[dict], seconds: float,
                capture: Path) -> dict:
    """What import_served writes beside its rows: the target, what the scan of the captures found, the counts."""
    return {"target": {"name": target.name, "spec": target.spec, "fingerprint": target.fingerprint(),
                       "folder": str(target.folder) if target.folder else None},
            "served": {"captures": str(folder), "requests": loaded, "skipped": scan.skipped, "bad": scan.bad,
                       "shared": scan.shared, "shared_ids": scan.shared_ids, "vllm_layers": needed,
                       "duplicates": loaded - len(rows)},
            "counts": {"rows": len(rows), "per_domain": dict(sorted(Counter(r["domain"] for r in rows).items())),
                       "tokens": sum(len(r["input_ids"]) for r in rows),
                       "loss_tokens": sum(sum(r["loss_mask"]) for r in rows)},
            "timing": {"wall_seconds": round(seconds, 2)},
            "capture": str(capture), "created": time.strftime("%Y-%m-%dT%H:%M:%S%z")}


# a capture replica's request for one of generation's rows (data/engines/remote.py names them): vLLM's engine
# id `cmpl-<X-Request-Id>-<prompt index>-<8 hex>`, the X-Request-Id being `ds-<row>-t<turn>-<12 hex>`
_GENERATED = re.compile(r"cmpl-(ds-[A-Za-z0-9._:]+-t\d+)-[0-9a-f]{12}-\d+-[0-9a-f]{8}")


def captures_by_turn(folder: str | Path) -> dict[str, list[Path]]:
    """The capture files of `folder` that answer generation's requests, by the row and turn they answer
    (remote.request_key): a retried request leaves several. Told by name alone (the engine id it escapes);
    nothing is read."""
    out: dict[str, list[Path]] = {}
    folder = Path(folder)
    if not folder.is_dir():
        return out
    for path in sorted(folder.iterdir()):
        rid = request_id_of(path.name[:-len(SUFFIX)]) if path.name.endswith(SUFFIX) else None
        m = _GENERATED.fullmatch(rid) if rid is not None else None
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


def _row_capture(rec: dict, paths: list[Path], expect: Expect, bad: list[str]) -> ServedRequest | str:
    """The capture among `paths` whose tokens are the row's input_ids (prompt of its last turn + answer), or why
    none is: a file that cannot be used is named in `bad` (the first MAX_NAMED)."""
    if not paths:
        return "missing"
    for path in paths:
        try:
            req = load_capture(path, check_capture(path, expect), expect)
        except DataError as e:
            why = str(e)
        else:
            if req.token_ids == list(rec["input_ids"]):
                return req
            why = f"{path}: its tokens are not those of the row"
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
    expect = Expect.of(target, vllm_layer_ids(resolved, target.num_layers))
    todo = [r for r in records if int(r["row_id"]) not in writer]
    fallback, named, why, bad = [], [], Counter(), []
    for rec in todo:
        got = _row_capture(rec, found.get(request_key(rec["row_id"], rec["n_turns"] - 1), []), expect, bad)
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
