"""A drafter swapped into a running `vllm serve` in place (fleet/drafter_swap.py, fleet/drafter_route.py,
retrain/promote.py), on a tiny Llama with an EAGLE-3 head: the swap takes effect without a restart and keeps the
output the target's; a damaged export, one of another shape and one made for another target are refused while the
old drafter serves on; the route takes no call without the token. One server, on 127.0.0.1, every request
bounded; stopped by its `with`."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from served_family import PROMPTS, K, TinyFamily, require_vllm

pytestmark = pytest.mark.vllm

TOKEN = "promote-test-token"


@pytest.fixture(scope="module")
def family(tiny_tokenizer, tmp_path_factory):
    require_vllm()
    return TinyFamily("llama", tiny_tokenizer, tmp_path_factory.mktemp("promote"), kinds=("eagle3",))


def _variant(export: Path, name: str, change) -> Path:
    """A copy of `export` whose tensors `change(dict)` altered, its checksums recomputed (a valid export)."""
    from safetensors.torch import load_file, save_file

    from draftsmith.layouts.common import record_checksums

    out = export.with_name(name)
    shutil.copytree(export, out)
    for f in out.glob("*.safetensors"):
        tensors = load_file(str(f))
        change(tensors)
        save_file(tensors, str(f))
    record_checksums(out)
    return out


def _wrong_head(tensors: dict) -> None:
    import torch

    g = torch.Generator().manual_seed(0)
    for name, t in tensors.items():
        if name.startswith("lm_head") and t.is_floating_point():
            tensors[name] = t[torch.randperm(t.shape[0], generator=g)].contiguous()


def _greedy(srv, version: str) -> tuple[list[str], dict]:
    """Greedy answers to PROMPTS, and vLLM's per-request counters summed over them."""
    from draftsmith import net

    texts, drafted, accepted = [], 0, 0
    for p in PROMPTS:
        body = {"model": srv.served_name, "prompt": p, "max_tokens": 24, "temperature": 0.0}
        doc = net.request(f"{srv.base_url}/completions", json.dumps(body).encode(), deadline=120.0,
                          max_bytes=net.ANSWER_MAX_BYTES, headers={"Content-Type": "application/json"}).json()
        texts.append(doc["choices"][0]["text"])
        sd = (doc.get("metrics") or {}).get("speculative_decoding") or {}
        drafted += int(sd.get("num_draft_tokens", 0))
        accepted += int(sd.get("num_accepted_draft_tokens", 0))
    return texts, {"version": version, "drafted": drafted, "accepted": accepted,
                   "alpha": accepted / drafted if drafted else None}


def _post(srv, body: dict, token: str | None = TOKEN) -> tuple[int, dict]:
    """The route's status and answer (retrain/promote.py's client, which keeps a failed answer's status)."""
    from draftsmith.retrain.promote import _call

    answer = _call(srv.url, token or "", 60.0, body)
    return answer.get("status", 200), answer


def test_a_drafter_is_swapped_in_place_and_a_bad_one_is_refused(family, tmp_path, monkeypatch):
    from draftsmith.data.engines.vllm_server import VllmServer
    from draftsmith.errors import ArtifactError
    from draftsmith.export.serve_check import speculative_config
    from draftsmith.layouts.common import read_guard
    from draftsmith.planning.production import log_alpha
    from draftsmith.retrain.promote import _call, check_against, push

    good = family.export("eagle3").out
    wrong = _variant(good, "wrong-head", _wrong_head)
    damaged = _variant(good, "damaged", lambda t: None)
    (damaged / "model.safetensors").write_bytes((damaged / "model.safetensors").read_bytes()[:-4] + b"\0\0\0\0")
    shape = _variant(good, "other-shape", lambda t: t.update({k: v[:-1].contiguous() for k, v in t.items()
                                                              if k.startswith("fc.")}))
    other_target = _variant(good, "other-target", lambda t: None)
    guard = json.loads((other_target / "draftsmith.json").read_text())
    guard["target"]["config_hash"] = "0" * 64
    (other_target / "draftsmith.json").write_text(json.dumps(guard))

    traffic = tmp_path / "traffic"
    env = {"DRAFTSMITH_PROMOTE_TOKEN": TOKEN, "DRAFTSMITH_DRAFTER_VERSION": "good", "DRAFTSMITH_TRAFFIC_DIR":
           str(traffic)}
    extra = ("--worker-extension-cls", "draftsmith.fleet.drafter_swap.DrafterSwap", "--middleware",
             "draftsmith.fleet.drafter_route.DrafterRoute", "--middleware", "draftsmith.fleet.middleware.TrafficLog",
             "--per-request-spec-decode-metrics", "detailed")
    monkeypatch.setenv("DRAFTSMITH_PROMOTE_TOKEN", TOKEN)
    srv = VllmServer(family.folder, tmp_path / "server.log", speculative_config=speculative_config(good, K),
                     served_name="tiny", max_model_len=256, extra=extra, env=env)
    with srv:
        pid = srv.proc.pid
        assert _post(srv, {"path": str(wrong), "version": "x"}, token=None)[0] == 401
        assert _post(srv, {"path": str(wrong), "version": "x"}, token="not-the-token")[0] == 401
        assert _post(srv, {"path": "relative/path", "version": "x"})[0] == 400
        info = _call(srv.url, TOKEN, 60.0)
        assert info["ok"] and info["version"] == "good" and info["workers"][0]["path"] == str(good.resolve())
        check_against(info, read_guard(good), good, srv.url)  # what it serves: this target, this method
        texts, before = _greedy(srv, "good")

        ok, results = push([srv.url], wrong, "wrong", TOKEN, 120.0)
        assert ok, [r.get("error") for r in results]
        texts_wrong, wrong_counts = _greedy(srv, "wrong")
        assert texts_wrong == texts  # another drafter, the target's own output
        # the swap took effect: the wrong head is accepted less (greedy and seeded, so the counts are exact; a head
        # that learned its domain, and its recovery, in test_vllm_fleet_loop.py)
        assert 0 <= wrong_counts["accepted"] < before["accepted"], (before, wrong_counts)

        for bad, why in ((damaged, "sha256"), (shape, "tensor fc"), (other_target, "target.config_hash")):
            status, answer = _post(srv, {"path": str(bad), "version": "bad"})
            assert status == 422 and why in answer["error"], (bad.name, status, answer)
        with pytest.raises(ArtifactError, match="another target"):
            check_against(_call(srv.url, TOKEN, 60.0), read_guard(other_target), other_target, srv.url)
        assert _call(srv.url, TOKEN, 60.0)["version"] == "wrong"  # the refused ones changed nothing

        ok, _ = push([srv.url], good, "good", TOKEN, 120.0)
        texts_back, back = _greedy(srv, "good")
        assert ok and texts_back == texts and (back["drafted"], back["accepted"]) == (before["drafted"],
                                                                                    before["accepted"])
        assert srv.proc.poll() is None and srv.proc.pid == pid
    per_version = {v: log_alpha(traffic, drafter_version=v)["overall"]["n_prompts"] for v in ("good", "wrong")}
    assert per_version == {"good": 2 * len(PROMPTS), "wrong": len(PROMPTS)}, per_version
