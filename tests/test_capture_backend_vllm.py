"""`capture.backend: vllm` without vLLM: the servers that write the answers keep the features too, and generation
joins each row to the capture of its last turn's request (data/generate.py, data/served.py).

The capture replica here is a real HTTP server on 127.0.0.1 speaking the OpenAI completions API; after each
answer it writes the capture file the connector would (fleet/capture_file.write_capture, named after the request's
X-Request-Id as vLLM names it), from the tiny target's own teacher-forced forward in vLLM's layer numbering
(test_served_capture.served_states). tests/test_vllm_capture_backend.py does the same with vLLM itself.

  * the config refuses what cannot work, in one line;
  * every request carries its own X-Request-Id naming its row and turn; a two-turn row is joined to its last turn;
  * rows joined to a capture get what draftsmith's own capture of the same rows holds (fp32), and the target's
    decoder layers run only for the rows whose capture is missing or holds other tokens: counted and named;
  * a run stopped midway resumes, and a replica draftsmith starts (`replica=`) is stopped on an error too.
"""

from __future__ import annotations

import contextlib
import http.server
import json
import re
import threading

import pytest
import torch
from local_http import local_server
from test_served_capture import identity, served_states

from draftsmith.capture.cache import ShardReader, capture_dataset
from draftsmith.capture.config import CaptureConfig
from draftsmith.data.config import ChatConfig, DataConfig, GenerationConfig, SourceConfig
from draftsmith.data.generate import generate_dataset, load_distilled, read_provenance
from draftsmith.errors import DataError, DraftsmithError
from draftsmith.fleet.capture_file import write_capture
from draftsmith.targets.families import decoder_layers

LAYERS = [0, -1]  # draftsmith ids: the first layer's output and the last's (pre-norm), vLLM ids 1 and 2
TOPK = 4
PROMPTS = [f"Question number {i}: what is {i} plus {i * 3}" for i in range(6)]
RID = re.compile(r"^ds-(\d+)-t(\d)-[0-9a-f]{12}$")


def _replica_handler(target, folder, vids, spoil: list[str], seen: list[str]):
    """A capture replica's answers: `max_tokens` tokens derived from the prompt, then (after the answer went out)
    the request's capture file. `spoil`: what happens to the capture of the 1st, 2nd ... request ("" = written,
    "skip" = never written, "differ" = written for other tokens); `seen`: every X-Request-Id, in order."""
    lock = threading.Lock()

    class Handler(http.server.BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_GET(self):
            self._send({"object": "list", "data": [{"id": "tiny", "object": "model"}]})

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
            prompt, n = body["prompt"], body["max_tokens"]
            answer = [(prompt[-1] * 7 + 13 * i) % (target.vocab_size - 20) + 10 for i in range(n)]
            with lock:
                seen.append(self.headers["X-Request-Id"])
                fate = spoil[len(seen) - 1] if len(seen) <= len(spoil) else ""
            self._send({"id": "cmpl-x", "model": "tiny", "usage": {"prompt_tokens": len(prompt),
                                                                 "completion_tokens": n},
                        "choices": [{"text": "", "token_ids": answer, "finish_reason": "length"}]})
            ids = prompt + answer[:-1] + [answer[-1] + 1] if fate == "differ" else prompt + answer
            if fate != "skip":
                with lock:  # one forward at a time: served_states hooks the shared model's last layer
                    write_capture(str(folder), f"cmpl-{self.headers['X-Request-Id']}-0-{len(seen):08x}",
                                  served_states(target, ids, vids), ids, len(prompt), vids, identity(target))

        def _send(self, body):
            data = json.dumps(body).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
            self.wfile.flush()

    return Handler


def _replica(target, spoil=(), seen=None):
    """A `data.generate.Replica` starting the server above on the folder and layer ids generation gives it."""
    seen = [] if seen is None else seen

    @contextlib.contextmanager
    def start(tgt, vids, folder):
        assert tgt is target and vids == [1, 2]
        with local_server(_replica_handler(target, folder, vids, list(spoil), seen)) as url:
            start.running = True
            try:
                yield f"{url}/v1", "tiny"
            finally:
                start.running = False

    start.running, start.seen = False, seen
    return start


def _config(tmp_path, name="data", urls=(), served_dir=None, **gen) -> DataConfig:
    p, t = tmp_path / "prompts.jsonl", tmp_path / "turns.jsonl"
    p.write_text("".join(json.dumps({"q": q}) + "\n" for q in PROMPTS))
    t.write_text(json.dumps({"turns": ["Tell me about 7", "And about 8?"]}) + "\n")
    g = {"max_new_tokens": 6, "flush_every": 2, "backend": "openai", "base_urls": list(urls), "concurrency": 1,
         "prompt_as": "token_ids", "extra_body": {"return_token_ids": True}, "max_retries": 0, "request_timeout": 30.0,
         **gen}
    return DataConfig(sources=[SourceConfig(name="p", path=str(p), prompt="q", domain="general"),
                               SourceConfig(name="mt", path=str(t), turns="turns", domain="chat")],
                      output_dir=str(tmp_path / name), chat=ChatConfig(mode="plain", plain_separator=""),
                      generation=GenerationConfig(**g),
                      capture=CaptureConfig(enabled=True, layers=LAYERS, topk=TOPK, last_hidden=True, dtype="float32",
                                            backend="vllm", served_dir=served_dir, served_wait=5.0))


@contextlib.contextmanager
def _decoder_calls(target):
    """Counts the forwards of the target's decoder layers in this (the main) thread: the replica's server thread
    runs the same model to write its captures, which is vLLM's work, not draftsmith's."""
    calls = []
    main = threading.main_thread()
    hooks = [m.register_forward_pre_hook(lambda *a: calls.append(1) if threading.current_thread() is main else None)
             for m in decoder_layers(target.model)]
    try:
        yield calls
    finally:
        for h in hooks:
            h.remove()


def _assert_cache_is_the_targets(target, out, tmp_path):
    """The cache generation wrote holds, row by row, what draftsmith's own capture of the rows holds (fp32);
    a joined row's last position (its last token was never an input) is zeros."""
    rows = [dict(r) for r in load_distilled(out, target)]
    own = capture_dataset(target, rows, tmp_path / "own", LAYERS, TOPK, hidden_dtype=torch.float32,
                          last_hidden=True, progress=False)
    mine = ShardReader(out / "capture")
    assert sorted(mine.rows) == sorted(own.rows) and mine.index["logsumexp"]
    for r in rows:
        a, b, n = mine.get(r["row_id"]), own.get(r["row_id"]), len(r["input_ids"]) - 1
        for key in (*(f"layer.{i}" for i in LAYERS), "last_hidden", "topk_values", "topk_logsumexp"):
            torch.testing.assert_close(a[key][:n].float(), b[key][:n].float(), atol=1e-4, rtol=1e-4)
        assert torch.equal(a["topk_indices"][:n], b["topk_indices"][:n])
    return rows


def test_the_config_refuses_what_capture_by_vllm_cannot_do_in_one_line(tiny_target, tmp_path):
    base = _config(tmp_path)
    cases = [({"generation": GenerationConfig()}, "needs generation.backend: openai"),
             ({"responses": "keep"}, "responses: keep"),
             ({"generation": GenerationConfig(backend="openai", base_urls=["http://a:1"])}, "capture.served_dir"),
             ({"capture": CaptureConfig(enabled=True, layers=[0]), "generation": GenerationConfig(backend="openai")},
              "needs base_urls")]
    for change, why in cases:
        kw = {f: getattr(base, f) for f in ("sources", "output_dir", "chat", "generation", "capture")} | change
        with pytest.raises((DraftsmithError, ValueError)) as e:
            DataConfig(**kw)
        assert why in str(e.value) and "\n" not in str(e.value), (why, str(e.value))
    with pytest.raises((DraftsmithError, ValueError), match="needs capture.enabled"):
        CaptureConfig(backend="vllm")
    with pytest.raises(DataError, match="serve-capture") as e:  # no servers named, and nobody to start one
        generate_dataset(base, tiny_target, progress=False)
    assert "\n" not in str(e.value)


def test_rows_take_their_last_turns_capture_and_the_target_runs_only_where_one_is_missing_or_differs(
        tiny_target, tmp_path):
    replica = _replica(tiny_target, spoil=["skip", "differ"])
    with _decoder_calls(tiny_target) as calls:
        out = generate_dataset(_config(tmp_path), tiny_target, progress=False, replica=replica)
    assert not replica.running  # stopped at the end
    rows = _assert_cache_is_the_targets(tiny_target, out, tmp_path)
    assert len(rows) == len(PROMPTS) + 1
    cap = read_provenance(out)["timing"]["capture"]
    assert cap["backend"] == "vllm" and cap["served_dir"] == str(out / "served")
    assert (cap["from_vllm"], cap["from_target"], cap["fallback"]) == (len(rows) - 2, 2, {"missing": 1, "differs": 1})
    assert len(cap["fallback_rows"]) == 2 and "its tokens are not those of the row" in cap["bad"][0]
    assert len(calls) == 2 * tiny_target.num_layers  # one forward of each fallback row, none for the others
    # every request its own id, naming its row and turn; the two-turn row asked turn 0, then turn 1
    parsed = [RID.match(r).groups() for r in replica.seen]
    assert len(set(replica.seen)) == len(replica.seen) == len(PROMPTS) + 2
    mt = next(r for r in rows if r["n_turns"] == 2)
    assert [t for row, t in parsed if int(row) == mt["row_id"]] == ["0", "1"]
    assert {int(row) for row, _ in parsed} == {r["row_id"] for r in rows}


def test_a_fleets_replicas_are_joined_through_the_shared_folder_and_a_stopped_run_resumes(tiny_target, tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()

    class Stop(Exception):
        pass

    def stop_after(n):
        done = []
        return lambda rec: (done.append(1), len(done) >= n and (_ for _ in ()).throw(Stop()))

    handler = _replica_handler(tiny_target, shared, [1, 2], [], [])
    with local_server(handler) as url:
        cfg = _config(tmp_path, urls=[url], served_dir=str(shared))
        with pytest.raises(Stop):
            generate_dataset(cfg, tiny_target, progress=False, on_row=stop_after(3))
        with _decoder_calls(tiny_target) as calls:
            out = generate_dataset(cfg, tiny_target, progress=False)
    assert not calls  # every row, before and after the stop, had its capture in the shared folder
    _assert_cache_is_the_targets(tiny_target, out, tmp_path)
    prov = read_provenance(out)
    assert prov["timing"]["resumed_rows"] >= 3 and prov["timing"]["capture"]["from_target"] == 0


def test_the_replica_draftsmith_starts_is_stopped_when_generation_fails(tiny_target, tmp_path):
    replica = _replica(tiny_target)

    def boom(rec):
        assert replica.running
        raise RuntimeError("stopped")

    with pytest.raises(RuntimeError, match="stopped"):
        generate_dataset(_config(tmp_path), tiny_target, progress=False, replica=replica, on_row=boom)
    assert not replica.running and replica.seen
