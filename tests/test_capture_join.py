"""Captures join exactly: a fleet capture (fleet/capture_file.py, written by the KV connector inside vLLM) is
read back as the request it names and the model that served it, or not at all (data/served.py,
retrain/run.py).

  * every id the connector accepts (a space, `+`, `=`, `/`, non-ASCII, a leading dot, thousands of characters)
    is written under an escaped file name and read back to the same id; the connector never raises into vLLM;
  * a file whose metadata names another request than its name is refused, naming the field;
  * engine ids are parsed by the form of their endpoint: a chat id `job-0` is not request `job`;
  * a response id two requests share (one client X-Request-Id) trains neither, counted;
  * a capture of another model is refused naming the config field, and the identity a capture records is the
    target fingerprint's `config_hash`;
  * a capture's header is held to the target before any tensor is read: one declaring 65k tokens on a
    512-token target is refused by its `n_tokens`, and a bad file never stops a scan.

The captures are written from the tiny target's own teacher-forced forward in vLLM's layer numbering
(test_served_capture.served_states).
"""

from __future__ import annotations

import json
import shutil
import sys
import types
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from test_served_capture import served_states

from draftsmith.data.served import import_served, read_capture, response_id, scan_captures, vllm_layer_ids
from draftsmith.errors import DataError
from draftsmith.fleet.capture_file import (
    MAX_ID,
    NAME_MAX,
    SUFFIX,
    file_stem,
    model_identity,
    request_id_of,
    write_capture,
)
from draftsmith.targets.families import text_config
from tests.fuzzing import FUZZ

LAYERS = [0]  # draftsmith ids: vLLM ids 1 and 2 (the last layer's output) on the 2-layer target


def _identity(target) -> dict:
    """What the connector records of the model vLLM serves: its text config as loaded."""
    return model_identity(text_config(target.model.config).to_dict(), str(target.folder))


def _ids(target, n: int = 0) -> tuple[list[int], int]:
    g = torch.Generator().manual_seed(n)
    prompt = torch.randint(3, target.vocab_size, (5 + n,), generator=g).tolist()
    return prompt + torch.randint(3, target.vocab_size, (6,), generator=g).tolist(), len(prompt)


def _capture(target, folder: Path, engine_id: str, n: int = 0, model: dict | None = None, ids=None) -> Path:
    vids = vllm_layer_ids(LAYERS, target.num_layers)
    tokens, p = ids or _ids(target, n)
    folder.mkdir(parents=True, exist_ok=True)
    return Path(write_capture(str(folder), engine_id, served_states(target, tokens, vids), tokens, p, vids,
                              _identity(target) if model is None else model))


HOSTILE_IDS = [
    "chatcmpl-a b c-1f2e3d4c",  # a space
    "cmpl-x+y=z-0-1f2e3d4c",  # '+', '='
    "chatcmpl-caf\u00e9-\u4e2d\u6587-1f2e3d4c",  # non-ASCII
    "chatcmpl-../../etc/passwd-1f2e3d4c",  # '/' (the write used to fail with SafetensorError)
    ".chatcmpl-dot-1f2e3d4c",  # a leading dot: a temporary file's name
    "chatcmpl-%41-1f2e3d4c",  # an escape's own spelling
    "chatcmpl-line\nbreak\x00nul-1f2e3d4c",
    "chatcmpl-" + "r" * 300 + "-1f2e3d4c",  # past a name's length
    "chatcmpl-" + "\u00e9/" * 2000 + "-1f2e3d4c",  # thousands of characters, each escaped
    "chatcmpl-" + "x" * (MAX_ID - 18) + "-1f2e3d4c",  # the longest id the connector captures
]


def test_every_id_the_connector_accepts_is_written_under_an_escaped_name_and_read_back_to_itself(
        tiny_target, tmp_path):
    folder = tmp_path / "cap"
    needed = vllm_layer_ids(LAYERS, tiny_target.num_layers)
    for n, rid in enumerate(HOSTILE_IDS):
        path = _capture(tiny_target, folder, rid, n)
        assert path.parent == folder and not path.name.startswith("."), rid[:40]
        assert len(path.name.encode()) <= 255, rid[:40]
        assert set(path.name[:-len(SUFFIX)]) <= set("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
                                                    "0123456789._-%~"), path.name
        assert read_capture(path, tiny_target, needed).request_id == rid
    assert sorted(p.name for p in folder.iterdir()) == sorted(file_stem(r) + SUFFIX for r in HOSTILE_IDS)
    scan = scan_captures(folder, tiny_target, needed)
    assert scan.skipped == 0 and sorted(c.meta["request_id"] for c in scan.captures) == sorted(HOSTILE_IDS)
    with pytest.raises(ValueError, match="1 to"):  # an id the connector does not capture has no file name
        file_stem("x" * (MAX_ID + 1))


@FUZZ
@given(rid=st.text(min_size=1, max_size=300))
def test_a_file_name_is_the_escaped_id_and_nothing_else(rid):
    stem = file_stem(rid)
    assert len(stem) <= NAME_MAX and "/" not in stem and not stem.startswith(".")
    assert request_id_of(stem) == rid if "~" not in stem else request_id_of(stem) is None
    # another spelling of the same id (a lower-case escape, an escaped letter) is not a name of ours
    assert request_id_of("%61" + stem) is None and request_id_of("%2e" + stem) is None
    if "%" in stem and "~" not in stem:
        assert request_id_of(stem.lower()) is None if stem.lower() != stem else True


def test_a_capture_named_for_one_request_whose_metadata_names_another_is_refused(tiny_target, tmp_path):
    folder = tmp_path / "cap"
    real = _capture(tiny_target, folder, "chatcmpl-real-0badc0de", 0)
    forged = folder / (file_stem("chatcmpl-other-0badc0de") + SUFFIX)
    shutil.copy(real, forged)  # selected by its name, it would be labelled by its metadata
    _capture(tiny_target, folder, "chatcmpl-third-0badc0de", 2)
    needed = vllm_layer_ids(LAYERS, tiny_target.num_layers)
    with pytest.raises(DataError, match="field 'request_id'") as e:
        read_capture(forged, tiny_target, needed)
    assert str(forged) in str(e.value) and "\n" not in str(e.value)
    domains = {"chatcmpl-other": "code", "chatcmpl-real": "chat", "chatcmpl-third": "math"}
    prov = import_served(folder, tiny_target, tmp_path / "data", LAYERS, progress=False, domains=domains)
    assert prov["served"]["skipped"] == 1 and f"{forged}: field 'request_id'" in prov["served"]["bad"][0]
    assert prov["counts"]["per_domain"] == {"chat": 1, "math": 1}


def test_engine_ids_are_parsed_by_the_form_of_their_endpoint(tiny_target, tmp_path):
    assert response_id("chatcmpl-job-0-1f2e3d4c") == "chatcmpl-job-0"  # a chat id `job-0`: not request `job`
    assert response_id("chatcmpl-job-1f2e3d4c") == "chatcmpl-job"
    assert response_id("cmpl-job-0-1f2e3d4c") == "cmpl-job"  # completions: the prompt index, then 8 hex
    assert response_id("cmpl-job-0-0-1f2e3d4c") == "cmpl-job-0"
    assert response_id("chatcmpl-a\nb-1f2e3d4c") == "chatcmpl-a\nb"
    for foreign in ("cmpl-job-1f2e3d4c", "1_chatcmpl-job-1f2e3d4c", "job-0-1f2e3d4c", "chatcmpl-job"):
        assert response_id(foreign) is None, foreign
    folder = tmp_path / "cap"
    _capture(tiny_target, folder, "chatcmpl-job-0-1f2e3d4c", 0)
    _capture(tiny_target, folder, "chatcmpl-job-aaaabbbb", 1)
    prov = import_served(folder, tiny_target, tmp_path / "data", LAYERS, progress=False,
                         domains={"chatcmpl-job": "code", "chatcmpl-job-0": "math"})
    assert prov["counts"]["per_domain"] == {"code": 1, "math": 1} and prov["served"]["shared"] == 0
    alone = tmp_path / "cap-job-0"  # only chat request `job-0` was captured
    _capture(tiny_target, alone, "chatcmpl-job-0-1f2e3d4c", 0)
    with pytest.raises(DataError, match="no capture the target can use"):  # job-0's capture is not job's
        import_served(alone, tiny_target, tmp_path / "only", LAYERS, progress=False,
                      domains={"chatcmpl-job": "code"}, only={"chatcmpl-job"})


def test_two_requests_sharing_one_client_id_put_neither_into_training(tiny_target, tmp_path):
    folder = tmp_path / "cap"
    _capture(tiny_target, folder, "chatcmpl-same-11111111", 0)  # two requests sent with X-Request-Id: same
    _capture(tiny_target, folder, "chatcmpl-same-22222222", 1)
    _capture(tiny_target, folder, "chatcmpl-own-33333333", 2)
    prov = import_served(folder, tiny_target, tmp_path / "data", LAYERS, progress=False,
                         domains={"chatcmpl-same": "code", "chatcmpl-own": "chat"},
                         only={"chatcmpl-same", "chatcmpl-own"})
    assert prov["counts"]["rows"] == 1 and prov["counts"]["per_domain"] == {"chat": 1}
    assert prov["served"]["shared"] == 2 and prov["served"]["shared_ids"] == ["chatcmpl-same"]
    # a plain import joins nothing: both requests are rows of the default domain
    plain = import_served(folder, tiny_target, tmp_path / "plain", LAYERS, progress=False)
    assert plain["counts"]["rows"] == 3 and plain["served"]["shared"] == 0


def test_retraining_joins_no_capture_to_a_response_id_a_held_out_row_shares(tiny_target, tmp_path,
                                                                           monkeypatch):
    """Only the held-out request of the two was captured: by id alone its states would train the candidate."""
    from draftsmith.data.generate import load_distilled
    from draftsmith.retrain import run
    from draftsmith.retrain.config import RetrainConfig
    from draftsmith.retrain.traffic import TrafficRow

    monkeypatch.chdir(Path(__file__).resolve().parents[1])  # the job preset's path is relative to the repo
    folder = tmp_path / "cap"
    held_ids, _ = _ids(tiny_target, 0)
    _capture(tiny_target, folder, "chatcmpl-same-11111111", 0)  # the held-out request's capture
    _capture(tiny_target, folder, "chatcmpl-own-33333333", 2)
    cfg = RetrainConfig(registry=str(tmp_path / "reg"), target=str(tiny_target.folder))
    cfg.traffic.captures, cfg.budget.replay_fraction = str(folder), 0.0
    train = [TrafficRow("p1", "code", 1.0, request_id="chatcmpl-same"), TrafficRow("p2", "chat", 2.0,
                                                                                   request_id="chatcmpl-own")]
    held = [TrafficRow("p0", "code", 0.0, request_id="chatcmpl-same")]
    out = run._served_data(cfg, tiny_target, tmp_path / "work", train, None, held)
    rows = [dict(r) for r in load_distilled(out, tiny_target)]
    assert [r["domain"] for r in rows] == ["chat"] and held_ids not in [r["input_ids"] for r in rows]
    prov = json.loads((out / "provenance.json").read_text())
    assert prov["served"]["shared_in_traffic"] == 1


def test_a_capture_of_another_model_is_refused_naming_the_field(tiny_target, tmp_path):
    from tiny_models import build_tiny_llama

    from draftsmith.checksums import sha256_json
    from draftsmith.targets.fingerprint import summary_of

    # comparable: the identity a capture records hashes to the target fingerprint's config_hash
    recorded = summary_of(_identity(tiny_target)["config"])
    assert sha256_json(recorded) == tiny_target.fingerprint()["config_hash"]
    folder = tmp_path / "cap"
    _capture(tiny_target, folder, "chatcmpl-ours-0badc0de", 0)
    other = build_tiny_llama(tiny_target.vocab_size, rope_theta=500000.0)  # the same shape, another model
    path = _capture(tiny_target, folder, "chatcmpl-theirs-0badc0de", 1,
                    model=model_identity(other.config.to_dict(), "someone/fine-tune"))
    needed = vllm_layer_ids(LAYERS, tiny_target.num_layers)
    with pytest.raises(DataError, match=r"field 'model.config.rope_") as e:
        read_capture(path, tiny_target, needed)
    assert str(path) in str(e.value) and "someone/fine-tune" in str(e.value) and "\n" not in str(e.value)
    scan = scan_captures(folder, tiny_target, needed)
    assert [c.meta["request_id"] for c in scan.captures] == ["chatcmpl-ours-0badc0de"] and scan.skipped == 1


def test_a_capture_without_a_model_identity_is_refused(tiny_target, tmp_path):
    """Version 1 captures (no `model`, names not escaped) cannot be told to belong to the target."""
    from safetensors.torch import save_file

    from draftsmith.fleet.capture_file import digest

    ids, p = _ids(tiny_target)
    hidden = served_states(tiny_target, ids, [1, 2])
    tokens = torch.tensor(ids)
    meta = {"format": "draftsmith.vllm_capture", "version": 1, "request_id": "cmpl-a-0-00000000",
            "layers": [1, 2], "prompt_tokens": p, "n_tokens": len(ids), "hidden_size": 64, "dtype": "float32",
            "sha256": digest(hidden, tokens)}
    path = tmp_path / "cmpl-a-0-00000000.safetensors"
    tensors = {"hidden_states": hidden, "token_ids": tokens}
    save_file(tensors, str(path), metadata={"draftsmith": json.dumps(meta)})
    with pytest.raises(DataError, match="field 'version' is 1"):
        read_capture(path, tiny_target, [1, 2])
    meta["version"] = 2
    save_file(tensors, str(path), metadata={"draftsmith": json.dumps(meta)})
    with pytest.raises(DataError, match="field 'model' is null"):
        read_capture(path, tiny_target, [1, 2])


def _declared(folder: Path, engine_id: str, n_tokens: int, target, width: int | None = None) -> Path:
    """A capture whose header declares `n_tokens` tokens of `width` (the target's hidden size), the bytes it
    declares present but never written (a sparse file: nothing is on disk, and reading the tensors would
    allocate them)."""
    width = width or target.hidden_size
    meta = {"format": "draftsmith.vllm_capture", "version": 2, "request_id": engine_id, "layers": [1, 2],
            "prompt_tokens": 1, "n_tokens": n_tokens, "hidden_size": width, "dtype": "float32",
            "model": _identity(target), "sha256": "0" * 64}
    hidden = (n_tokens - 1) * 2 * width * 4
    header = {"__metadata__": {"draftsmith": json.dumps(meta)},
              "hidden_states": {"dtype": "F32", "shape": [n_tokens - 1, 2, width],
                                "data_offsets": [0, hidden]},
              "token_ids": {"dtype": "I64", "shape": [n_tokens],
                            "data_offsets": [hidden, hidden + 8 * n_tokens]}}
    raw = json.dumps(header).encode()
    path = folder / (file_stem(engine_id) + SUFFIX)
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little") + raw)
        f.truncate(8 + len(raw) + hidden + 8 * n_tokens)
    return path


def test_a_capture_past_the_targets_context_is_refused_from_its_header_and_the_scan_goes_on(tiny_target,
                                                                                             tmp_path):
    folder = tmp_path / "cap"
    _capture(tiny_target, folder, "chatcmpl-a-0badc0de", 0)
    huge = _declared(folder, "chatcmpl-huge-0badc0de", 65536, tiny_target)  # 512 positions of context
    zeros = _declared(folder, "chatcmpl-zeros-0badc0de", 20, tiny_target)  # fits: read, its checksum fails
    # 32 GiB declared: read before its hidden size was checked, it stopped the scan with a MemoryError
    wide = _declared(folder, "chatcmpl-wide-0badc0de", 65536, tiny_target, width=1 << 16)
    _capture(tiny_target, folder, "chatcmpl-z-0badc0de", 1)
    needed = vllm_layer_ids(LAYERS, tiny_target.num_layers)
    with pytest.raises(DataError, match="field 'n_tokens' is 65536: .* past the target's context of 512"):
        read_capture(huge, tiny_target, needed)  # told by the header: its tensors would fail the checksum
    prov = import_served(folder, tiny_target, tmp_path / "data", LAYERS, progress=False)
    assert prov["counts"]["rows"] == 2 and prov["served"]["skipped"] == 3
    why = "\n".join(prov["served"]["bad"])
    assert f"{huge}: field 'n_tokens'" in why and f"{zeros}: checksum mismatch" in why
    assert f"{wide}: field 'hidden_size' is 65536" in why


# --- the connector inside vLLM ------------------------------------------------------------------------
@pytest.fixture
def connector_module(monkeypatch):
    """fleet/vllm_capture.py imported against the few vLLM names it subclasses (vLLM is not installed here;
    tests/test_vllm_fleet_capture.py runs it in vLLM itself)."""
    import enum

    class Base:
        def __init__(self, vllm_config, role, kv_cache_config=None):
            self._vllm_config, self._role = vllm_config, role

    names = {"vllm": {}, "vllm.config": {"get_layers_from_vllm_config": lambda *a: {}},
             "vllm.distributed": {}, "vllm.distributed.kv_transfer": {},
             "vllm.distributed.kv_transfer.kv_connector": {},
             "vllm.distributed.kv_transfer.kv_connector.v1": {},
             "vllm.distributed.kv_transfer.kv_connector.v1.base": {
                 "KVConnectorBase_V1": Base, "KVConnectorMetadata": object, "SupportsHMA": object,
                 "KVConnectorRole": enum.Enum("KVConnectorRole", "SCHEDULER WORKER")}}
    for name, attrs in names.items():
        monkeypatch.setitem(sys.modules, name, types.SimpleNamespace(**attrs))
    monkeypatch.delitem(sys.modules, "draftsmith.fleet.vllm_capture", raising=False)
    import draftsmith.fleet.vllm_capture as mod

    yield mod
    sys.modules.pop("draftsmith.fleet.vllm_capture", None)


def _connector(mod, target, folder: Path):
    import threading

    c = object.__new__(mod.DraftsmithCaptureConnector)
    c.folder, c.layers, c.model = str(folder), [1, 2], _identity(target)
    c.counts, c._lock = {}, threading.Lock()
    c.block_size, c._cache, c._stream = 4, torch.zeros(3, 2, 4, target.hidden_size), None
    return c


def test_the_connector_never_raises_into_vllm_and_counts_what_it_could_not_write(
        connector_module, tiny_target, tmp_path, caplog):
    mod = connector_module
    ids, p = _ids(tiny_target)
    states = served_states(tiny_target, ids, [1, 2])
    c = _connector(mod, tiny_target, tmp_path / "cap")
    (tmp_path / "cap").mkdir()
    c._write(mod.PendingSave("chatcmpl-a/b-0badc0de", ids, p, [0]), states, None)  # was a SafetensorError
    assert c.counts == {"written": 1}
    path = tmp_path / "cap" / (file_stem("chatcmpl-a/b-0badc0de") + SUFFIX)
    assert read_capture(path, tiny_target, [1, 2]).request_id == "chatcmpl-a/b-0badc0de"
    blocked = _connector(mod, tiny_target, tmp_path / "a-file")
    (tmp_path / "a-file").write_text("")  # the capture folder is a file: every write fails
    for n in range(3):
        blocked._write(mod.PendingSave(f"chatcmpl-{n}-0badc0de", ids, p, [0]), states, None)
    # safetensors reports a failed write as its own SafetensorError, not an OSError: both are counted
    assert blocked.counts == {"not_written:SafetensorError": 3}
    assert sum("not written" in r.message for r in caplog.records) == 1  # logged once, counted always
    blocked._start(mod.PendingSave("chatcmpl-x-0badc0de", ids, p, [99]))  # a block the cache does not hold
    assert blocked.counts["not_copied:IndexError"] == 1


def test_the_connector_refuses_to_start_where_engine_ids_do_not_split_back(connector_module, monkeypatch):
    mod = connector_module
    monkeypatch.setenv("VLLM_DISABLE_REQUEST_ID_RANDOMIZATION", "1")
    config = types.SimpleNamespace(speculative_config=types.SimpleNamespace(method="extract_hidden_states"))
    with pytest.raises(ValueError, match="VLLM_DISABLE_REQUEST_ID_RANDOMIZATION") as e:
        mod.DraftsmithCaptureConnector(config, None)
    assert "\n" not in str(e.value)
