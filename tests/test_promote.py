"""Promotion in place, without vLLM: the checks before a swap on real exports (fleet/drafter_swap.check_export), a
swap and its undoing on a drafter module (DrafterSwap's phases), the authenticated route (fleet/drafter_route.py)
driven as vLLM's API server drives a middleware, the label each logged request carries, the canary's verdict and
α read per version. The same code inside a real `vllm serve`: tests/test_vllm_promote.py and
tests/test_vllm_fleet_loop.py (make test-vllm)."""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_export import deep_target, make_eagle_artifact  # noqa: F401 - deep_target is a fixture

from draftsmith.export.api import export_artifact
from draftsmith.fleet.drafter_route import DrafterRoute, DrafterState
from draftsmith.fleet.drafter_swap import DrafterSwap, Refused, check_export
from draftsmith.layouts.common import record_checksums


@pytest.fixture(scope="module")
def exports(deep_target, tmp_path_factory):  # noqa: F811 - the fixture imported above
    """Two vLLM exports of EAGLE-3 heads of one shape (other weights) for the deep target."""
    root = tmp_path_factory.mktemp("promote")
    a = make_eagle_artifact(deep_target, root / "a")
    b = make_eagle_artifact(deep_target, root / "b", **{"fc.weight": 0.05 * torch.ones(64, 3 * 64)})
    return (export_artifact(a, "vllm", root / "a-vllm", deep_target).out,
            export_artifact(b, "vllm", root / "b-vllm", deep_target).out)


def _variant(export: Path, out: Path, tensors=None, guard=None, config=None) -> Path:
    shutil.copytree(export, out)
    if tensors:
        t = load_file(str(out / "model.safetensors"))
        tensors(t)
        save_file(t, str(out / "model.safetensors"))
        record_checksums(out)
    for name, change in (("draftsmith.json", guard), ("config.json", config)):
        if change:
            doc = json.loads((out / name).read_text())
            change(doc)
            (out / name).write_text(json.dumps(doc))
    return out


def test_an_export_of_the_same_shape_passes_the_checks(exports):
    a, b = exports
    guard, files = check_export(b, a)
    assert guard["format"] == json.loads((a / "draftsmith.json").read_text())["format"]
    assert [f.name for f in files] == ["model.safetensors"]


@pytest.mark.parametrize("case, change, words", [
    ("shape", {"tensors": lambda t: t.update({"fc.weight": t["fc.weight"][:-1].contiguous()})}, "tensor fc.weight"),
    ("dtype", {"tensors": lambda t: t.update({"fc.weight": t["fc.weight"].half()})}, "tensor fc.weight is F16"),
    ("extra tensor", {"tensors": lambda t: t.update({"extra.weight": torch.zeros(2)})}, "tensors differ"),
    ("vocabulary", {"tensors": lambda t: t.update({"d2t": t["d2t"][:-1].contiguous()})}, "tensor d2t"),
    ("method", {"guard": lambda g: g.update(format="dflash-vllm")}, "format is 'dflash-vllm'"),
    ("target", {"guard": lambda g: g["target"].update(config_hash="0" * 64)}, "target.config_hash differs"),
    ("tokenizer", {"guard": lambda g: g["target"].update(tokenizer_hash="1" * 64)}, "target.tokenizer_hash"),
    ("config", {"config": lambda c: c.update(rms_norm_eps=0.1)}, "rms_norm_eps"),
    ("checksum", {"guard": lambda g: g["checksums"].update({"model.safetensors": "0" * 64})}, "sha256 differs"),
])
def test_each_difference_from_the_served_drafter_is_refused_in_one_line(exports, tmp_path, case, change, words):
    a, b = exports
    bad = _variant(b, tmp_path / "bad", **change)
    with pytest.raises(Refused, match=words) as e:
        check_export(bad, a)
    assert "\n" not in str(e.value)


class _Head(torch.nn.Module):
    """A drafter module as vLLM's proposers hold one: its tensors under their dotted names and a `load_weights` that
    copies each given tensor into place (vLLM's default weight loader). `shared`: a module of the target's that the
    head holds as its own (vLLM's sharing of the embedding or lm_head); `fail_once_after`: the next load fails
    after that many tensors."""

    def __init__(self, export: Path, shared: dict[str, torch.nn.Module] | None = None):
        super().__init__()
        for name, module in (shared or {}).items():
            self.add_module(name, module)
        for name, t in load_file(str(export / "model.safetensors")).items():
            *path, leaf = name.split(".")
            owner = self
            for part in path:
                if not hasattr(owner, part):
                    owner.add_module(part, torch.nn.Module())
                owner = getattr(owner, part)
            if leaf not in dict(owner.named_buffers(recurse=False)):
                owner.register_buffer(leaf, t.clone())
        self.fail_once_after: int | None = None

    def load_weights(self, weights):
        for i, (name, t) in enumerate(weights):
            if self.fail_once_after is not None and i >= self.fail_once_after:
                self.fail_once_after = None
                raise RuntimeError("the loader failed half-way")
            self.get_buffer(name).copy_(t)


def _worker(served: Path, head: _Head, target: torch.nn.Module | None = None) -> DrafterSwap:
    w = DrafterSwap()
    w.vllm_config = SimpleNamespace(speculative_config=SimpleNamespace(model=str(served)))
    w.model_runner = SimpleNamespace(drafter=SimpleNamespace(model=head), model=target or torch.nn.Module())
    return w


def _state(head: _Head) -> dict:
    return {k: v.clone() for k, v in head.state_dict().items()}


def test_a_swap_loads_the_new_tensors_and_a_failed_one_puts_every_tensor_back(exports):
    a, b = exports
    head = _Head(a)
    w, old = _worker(a, head), _state(head)
    assert w.draftsmith_drafter_check(str(b), "v2")["ok"]
    head.fail_once_after = 3
    failed = w.draftsmith_drafter_commit()
    assert not failed["ok"] and failed["restored"] and "half-way" in failed["error"]
    assert all(torch.equal(v, old[k]) for k, v in head.state_dict().items())
    assert w.draftsmith_drafter_info()["ok"] is False  # a bare module reports what it can: no vLLM config
    assert w.draftsmith_drafter_check(str(b), "v2")["ok"] and w.draftsmith_drafter_commit()["ok"]
    new = load_file(str(b / "model.safetensors"))
    assert torch.equal(head.fc.weight, new["fc.weight"]) and w._draftsmith_swap["version"] == "v2"
    assert w.draftsmith_drafter_revert()["ok"]  # another worker failed: this one goes back too
    assert all(torch.equal(v, old[k]) for k, v in head.state_dict().items())
    assert w._draftsmith_swap["version"] is None and w._draftsmith_swap["path"] == str(a)
    assert w.draftsmith_drafter_forget()["ok"] and w.draftsmith_drafter_commit()["ok"] is False


def test_a_refused_check_stages_nothing_and_keeps_the_old_drafter(exports, tmp_path):
    a, b = exports
    head = _Head(a)
    w, old = _worker(a, head), _state(head)
    bad = _variant(b, tmp_path / "bad", tensors=lambda t: t.update({"fc.weight": t["fc.weight"][:, :-1].contiguous()}))
    answer = w.draftsmith_drafter_check(str(bad), "v2")
    assert not answer["ok"] and "tensor fc.weight" in answer["error"]
    assert w.draftsmith_drafter_commit()["ok"] is False
    assert all(torch.equal(v, old[k]) for k, v in head.state_dict().items())


def test_a_tensor_shared_with_the_target_is_never_loaded_and_must_be_unchanged(exports, tmp_path):
    a, b = exports
    target = torch.nn.Module()
    target.lm_head = torch.nn.Module()
    target.lm_head.register_buffer("weight", load_file(str(a / "model.safetensors"))["lm_head.weight"].clone())
    before = target.lm_head.weight.clone()
    head = _Head(a, shared={"lm_head": target.lm_head})
    w = _worker(a, head, target)
    same = w.draftsmith_drafter_check(str(b), "v2")  # b's lm_head is a's: not loaded, the rest is
    assert same["ok"] and same["shared_with_target"] == ["lm_head.weight"], same
    assert w.draftsmith_drafter_commit()["ok"] and torch.equal(target.lm_head.weight, before)
    other = _variant(b, tmp_path / "other-head",
                     tensors=lambda t: t.update({"lm_head.weight": t["lm_head.weight"] + 1}))
    answer = w.draftsmith_drafter_check(str(other), "v3")
    assert not answer["ok"] and "shares it with the target" in answer["error"]
    assert torch.equal(target.lm_head.weight, before)


class _Engine:
    """What the route calls: collective_rpc over a list of workers (vLLM's AsyncLLM.collective_rpc answers a list,
    one result per worker)."""

    def __init__(self, workers):
        self.workers = workers

    async def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        return [getattr(w, method)(*args) for w in self.workers]


def _call(route: DrafterRoute, method: str, body: dict | None = None, token: str | None = "s3cret",
          engine=None) -> tuple[int, dict]:
    headers = [(b"authorization", f"Bearer {token}".encode())] if token else []
    scope = {"type": "http", "method": method, "path": "/draftsmith/drafter", "headers": headers,
             "app": SimpleNamespace(state=SimpleNamespace(engine_client=engine))}
    sent, messages = [], [{"type": "http.request", "body": json.dumps(body or {}).encode(), "more_body": False}]

    async def receive():
        return messages.pop(0)

    async def send(message):
        sent.append(message)

    asyncio.run(route(scope, receive, send))
    if sent[0]["status"] == PASSED:
        return PASSED, {}
    return sent[0]["status"], json.loads(sent[1]["body"])


PASSED = 599  # the status the app below answers: the route let the request through to vLLM


async def _app(scope, receive, send):
    await send({"type": "http.response.start", "status": PASSED, "headers": []})


def test_the_route_needs_its_token_and_swaps_on_every_worker_or_none(exports, tmp_path, monkeypatch):
    import draftsmith.fleet.drafter_route as route_module

    a, b = exports
    monkeypatch.setattr(route_module, "STATE", DrafterState("v1"))
    no_token = DrafterRoute(_app, env={})
    assert _call(no_token, "POST", {"path": str(b), "version": "v2"})[0] == PASSED  # no token: no route
    route = DrafterRoute(_app, env={"DRAFTSMITH_PROMOTE_TOKEN": "s3cret"})
    heads = [_Head(a), _Head(a)]
    engine = _Engine([_worker(a, h) for h in heads])
    assert _call(route, "POST", {"path": str(b), "version": "v2"}, token=None, engine=engine)[0] == 401
    assert _call(route, "POST", {"path": str(b), "version": "v2"}, token="s3cre", engine=engine)[0] == 401
    assert _call(route, "POST", {"path": "b", "version": "v2"}, engine=engine)[0] == 400
    assert _call(route, "POST", {"path": str(b), "version": "v\n2"}, engine=engine)[0] == 400
    heads[1].fail_once_after = 2  # the second worker's commit fails: both go back
    status, doc = _call(route, "POST", {"path": str(b), "version": "v2"}, engine=engine)
    assert status == 500 and "half-way" in doc["error"] and all(r["ok"] for r in doc["phases"]["revert"])
    assert route_module.STATE.snapshot() == (2, "v1")
    assert all(torch.equal(h.fc.weight, load_file(str(a / "model.safetensors"))["fc.weight"]) for h in heads)
    status, doc = _call(route, "POST", {"path": str(b), "version": "v2"}, engine=engine)
    assert status == 200 and doc["version"] == "v2" and doc["previous"] == "v1", doc
    assert route_module.STATE.snapshot() == (4, "v2")
    fenced = DrafterRoute(_app, env={"DRAFTSMITH_PROMOTE_TOKEN": "s3cret", "DRAFTSMITH_PROMOTE_ROOTS": str(tmp_path)})
    assert _call(fenced, "POST", {"path": str(b), "version": "v3"}, engine=engine)[0] == 403
    bad = _variant(b, tmp_path / "bad", guard=lambda g: g["target"].update(config_hash="0" * 64))
    status, doc = _call(route, "POST", {"path": str(bad), "version": "v3"}, engine=engine)
    assert status == 422 and "another target" in doc["error"] and route_module.STATE.snapshot()[1] == "v2"


def test_a_request_during_which_the_drafter_changed_counts_for_no_version():
    s = DrafterState("v1")
    start = s.snapshot()
    assert DrafterState.label(start, s.snapshot()) == {"drafter_version": "v1"}
    s.begin()
    during = s.snapshot()
    assert DrafterState.label(start, during) == {"drafter_swapped": True}
    assert DrafterState.label(during, during) == {"drafter_swapped": True}  # arrived while the swap ran
    s.end("v2")
    assert DrafterState.label(s.snapshot(), s.snapshot()) == {"drafter_version": "v2"}
    assert DrafterState.label((0, None), (0, None)) == {}


def _line(domain: str, version: str | None, drafted: int, accepted: int, t: str = "2026-11-29T10:00:00Z", **extra):
    steps = [accepted // 4 + (i < accepted % 4) for i in range(4)]  # 4 verify steps of k = 4
    hist = [steps.count(j) for j in range(5)]
    sd = {"num_spec_tokens": 4, "num_spec_steps": 4, "num_draft_tokens": drafted,
          "num_accepted_draft_tokens": accepted, "acceptance_histogram": hist}
    rec = {"timestamp": t, "id": None, "request_id": None, "endpoint": "completions", "model": "m", "prompt": "p",
           "stream": False, "status": 200, "domain": domain, "speculative_decoding": sd, **extra}
    if version:
        rec["drafter_version"] = version
    return json.dumps(rec) + "\n"


def test_alpha_is_read_per_version_and_since_a_time(tmp_path):
    from draftsmith.planning.production import log_alpha

    (tmp_path / "traffic-1.jsonl").write_text(
        _line("A", "v1", 16, 12) + _line("A", "v2", 16, 4, "2026-11-29T10:05:00Z") + _line("A", "v2", 16, 8)
        + _line("A", None, 16, 16, drafter_swapped=True) + _line("B", "v2", 16, 2, "2026-11-29T10:06:00Z"))
    assert log_alpha(tmp_path, drafter_version="v1")["domains"]["A"]["alpha"] == pytest.approx(12 / 16)
    v2 = log_alpha(tmp_path, drafter_version="v2")
    assert v2["domains"]["A"]["alpha"] == pytest.approx(12 / 32) and v2["overall"]["n_prompts"] == 3
    import datetime as dt

    since = dt.datetime(2026, 11, 29, 10, 4, tzinfo=dt.timezone.utc).timestamp()
    late = log_alpha(tmp_path, drafter_version="v2", since=since)
    assert late["domains"]["A"]["alpha"] == pytest.approx(4 / 16) and late["domains"]["B"]["alpha"] == 2 / 16
    assert log_alpha(tmp_path)["overall"]["n_prompts"] == 5  # unfiltered: every row, the mixed one too
    # v2's first request by arrival is the 10:00 one (alpha 8/16), whatever the lines' order in the file
    assert log_alpha(tmp_path, drafter_version="v2", first=1)["domains"]["A"]["alpha"] == pytest.approx(8 / 16)


def test_the_canary_keeps_rolls_back_or_says_it_saw_too_little():
    from draftsmith.retrain.config import CanaryConfig
    from draftsmith.retrain.promote import judge

    c = CanaryConfig(requests=8, min_ratio=0.8, alpha_floor=0.1, min_domain_requests=4)

    def table(**domains):
        rows = {d: {"alpha": a, "n_prompts": n} for d, (a, n) in domains.items()}
        return {"domains": rows, "overall": {"n_prompts": sum(n for _, n in domains.values())}}

    assert judge(table(A=(0.70, 5), B=(0.60, 4)), {"A": 0.75, "B": 0.7}, c)["verdict"] == "kept"
    # the evaluator names domains in lower case; a domain the gate did not measure apart: its overall α
    assert judge(table(A=(0.50, 5)), {"a": 0.75}, c)["verdict"] == "rolled_back"
    assert judge(table(C=(0.50, 5)), {"a": 0.75}, c, overall=0.7)["reasons"][0].startswith("C: served alpha 0.500")
    low = judge(table(A=(0.70, 5), B=(0.50, 4)), {"A": 0.75, "B": 0.7}, c)  # 0.50 < 0.8 x 0.7 = 0.56
    assert low["verdict"] == "rolled_back" and low["reasons"] == ["B: served alpha 0.500 below 0.80 x the gate's 0.700"]
    assert judge(table(A=(0.05, 8)), {}, c)["verdict"] == "rolled_back"  # under the absolute floor
    assert judge(table(A=(0.70, 5), B=(0.10, 3)), {"A": 0.75, "B": 0.7}, c)["verdict"] == "kept"  # B too few
    few = judge(table(A=(0.70, 5)), {"A": 0.75}, c)
    assert few["verdict"] == "inconclusive" and "5 of 8" in few["reasons"][0]
    c.rollback_when_inconclusive = True
    assert judge(None, {}, c)["verdict"] == "rolled_back"


def _route_peer(info: dict, answers: list[tuple[int, dict]], seen: list[dict]):
    """A real HTTP peer answering the drafter route as a server would: GET -> `info`, each POST -> the next of
    `answers` (what tests/test_vllm_promote.py has vLLM answer), every POST body kept in `seen`."""
    import http.server

    class Handler(http.server.BaseHTTPRequestHandler):
        def _answer(self, status: int, doc: dict) -> None:
            body = json.dumps(doc).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):  # noqa: N802 - http.server's name
            self._answer(200, info)

        def do_POST(self):  # noqa: N802
            seen.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
            self._answer(*answers.pop(0))

        def log_message(self, *args):
            pass

    return Handler


def test_a_server_that_refuses_takes_the_ones_already_swapped_back(exports, deep_target):  # noqa: F811
    from local_http import local_server

    from draftsmith.retrain.promote import push

    a, b = exports
    guard = json.loads((b / "draftsmith.json").read_text())
    config = deep_target.model.config.to_dict()  # the served target's text config, as vLLM reports it
    info = {"ok": True, "version": "v1", "workers": [{"ok": True, "version": "v1", "path": str(a), "format":
            guard["format"], "served_target": {"config": config}}]}
    first, second = [], []
    ok_answer, refused = (200, {"ok": True, "seconds": 0.01}), (422, {"ok": False, "error": "tensor fc.weight is F16"})
    with (local_server(_route_peer(info, [ok_answer, ok_answer], first)) as one,
          local_server(_route_peer(info, [refused], second)) as two):
        ok, results = push([one, two], b, "v2", "s3cret", 10.0)
    assert not ok and results[1]["error"] == "tensor fc.weight is F16"
    assert first == [{"path": str(b.resolve()), "version": "v2"}, {"path": str(a), "version": "v1"}]
    assert results[0]["undone"]["ok"] and second == [{"path": str(b.resolve()), "version": "v2"}]
    info["workers"][0]["served_target"]["config"] = {**config, "hidden_size": 96}  # another target
    with local_server(_route_peer(info, [], first)) as other:
        ok, results = push([other], b, "v2", "s3cret", 10.0)
    assert not ok and "made for another target" in results[0]["error"] and len(first) == 2  # no POST sent


def test_rollback_by_hand_swaps_the_servers_back_and_moves_current_back(exports, deep_target, tmp_path,  # noqa: F811
                                                                        monkeypatch):
    from local_http import local_server

    from draftsmith.retrain.config import PromoteConfig, RetrainConfig
    from draftsmith.retrain.promote import roll_back
    from draftsmith.retrain.registry import Registry

    a, b = exports
    reg = Registry(tmp_path / "registry", deep_target.name, "eagle")
    for name in ("v1", "v2"):
        art = make_eagle_artifact(deep_target, tmp_path / name)
        reg.publish(art, {"parent": None, "reason": "test"})
    reg.set_current("v0002", "promoted in place")
    with pytest.raises(Exception, match="no kept promotion"):
        roll_back(reg, RetrainConfig(target=str(deep_target.folder), registry=str(tmp_path / "registry")))
    seen: list[dict] = []
    monkeypatch.setenv("DRAFTSMITH_PROMOTE_TOKEN", "s3cret")
    with local_server(_route_peer({"ok": True}, [(200, {"ok": True, "seconds": 0.01})], seen)) as url:
        reg.write_promotion({"version": "v0002", "previous": "v0001", "outcome": "kept", "servers": [url],
                             "swap": [{"url": url, "ok": True, "previous": {"version": "v0001", "path": str(a)}}]})
        cfg = RetrainConfig(target=str(deep_target.folder), registry=str(tmp_path / "registry"),
                            promote=PromoteConfig(servers=[url]))
        done = roll_back(reg, cfg)
    assert seen == [{"path": str(a), "version": "v0001"}]
    assert done["outcome"] == "rolled_back" and reg.current() == "v0001"
    assert reg.last_promotion()["undoes"] and reg.last_promotion()["outcome"] == "rolled_back"


def test_a_weight_file_that_is_a_link_is_refused_not_followed(exports, tmp_path):
    a, b = exports
    linked = _variant(b, tmp_path / "linked")
    (linked / "model.safetensors").unlink()
    (linked / "model.safetensors").symlink_to(b / "model.safetensors")
    with pytest.raises(Refused, match="not a regular file"):
        check_export(linked, a)
