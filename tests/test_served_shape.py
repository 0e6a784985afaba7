"""Engine profiles (decoding/served_shape.py, each method's `Serving.shape`): the shape vLLM, SGLang and TensorRT-LLM
serve each drafter in, on real artifacts trained a few steps on a tiny random target; `evaluate --as-served` decodes
exactly that shape (a chain or block, never a tree, under vLLM) and stays lossless against HF generate; a shape no
engine serves is refused in one line; serve.md states the served shape."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from served_family import K, TinyFamily

from draftsmith.decoding.served_shape import served_shape
from draftsmith.errors import ConfigError

STEPS = 3  # a few steps: the shapes and losslessness do not depend on how well the drafters learned
METHOD = {"eagle3": "eagle", "medusa": "medusa", "dflash": "dflash", "dspark": "dspark", "draft": "draft"}


@pytest.fixture(scope="module")
def fam(tiny_tokenizer, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("served")
    f = TinyFamily("llama", tiny_tokenizer, tmp, kinds=("eagle3", "medusa", "dflash", "draft"), steps=STEPS)
    f.artifacts["dspark"] = _dspark(f, tmp)
    return f


def _dspark(fam: TinyFamily, tmp: Path) -> Path:
    from served_family import PROMPTS, prompt_rows

    from draftsmith.dspark.job import DSparkJob, DSparkJobConfig
    from draftsmith.evaluation.after_training import EvalAfterTraining
    from draftsmith.training import TrainConfig, train

    cfg = DSparkJobConfig(target=str(fam.folder), data="in-memory", output=str(tmp / "dspark"), num_layers=1,
                          block_size=K + 1, target_layers=[0, 1, 2], anchors_per_row=8, max_length=64, markov_rank=8,
                          train=TrainConfig(lr=3e-3, max_steps=STEPS, batch_size=4, warmup_steps=0,
                                            output_dir=str(tmp / "dspark-run"), resume="never", progress=False,
                                            log_every=100, eval_every=0),
                          evaluate=EvalAfterTraining(enabled=False))
    (tmp / "dspark-rows").mkdir()
    rows = prompt_rows(fam.target, tmp / "dspark-rows", PROMPTS)
    return Path(train(DSparkJob(cfg, fam.target, rows), cfg.train).artifact)


def _shape(fam, engine: str, kind: str, k: int | None = None, **options) -> dict:
    return served_shape(engine, _spec(fam, kind), k, options).to_json()


def _spec(fam, kind: str) -> str:
    return "ngram" if kind == "ngram" else f"{METHOD[kind]}:{fam.artifacts[kind]}"


def test_vllm_serves_every_method_alone_as_a_chain_or_block_with_greedy_drafts(fam):
    eagle = _shape(fam, "vllm", "eagle3", 3)
    assert (eagle["method"], eagle["form"], eagle["k"], eagle["params"]) == (
        "eagle3", "chain", 3, {"num_speculative_tokens": 3})
    assert _shape(fam, "vllm", "medusa")["form"] == "chain" and _shape(fam, "vllm", "medusa")["k"] == K
    assert _shape(fam, "vllm", "draft", 5)["method"] == "draft_model"
    dflash = _shape(fam, "vllm", "dflash")
    assert (dflash["method"], dflash["form"], dflash["k"]) == ("dflash", "block", K)
    dspark = _shape(fam, "vllm", "dspark")
    assert (dspark["form"], dspark["adaptive_verification"]) == ("block", True)
    assert dspark["params"]["enable_adaptive_verification"] is True
    assert _shape(fam, "vllm", "dspark", adaptive_verification=False)["adaptive_verification"] is False
    assert all(_shape(fam, "vllm", k)["draft_sampling"] == "greedy" for k in fam.artifacts)
    ngram = served_shape("vllm", "ngram:2", 3).to_json()
    assert ngram["params"] == {"num_speculative_tokens": 3, "prompt_lookup_max": 2, "prompt_lookup_min": 1}
    assert "tree" not in json.dumps([_shape(fam, "vllm", k) for k in fam.artifacts])


def test_sglang_serves_eagle_as_its_tree_and_trtllm_as_export_writes_it(fam):
    tree = _shape(fam, "sglang", "eagle3", 3)
    assert (tree["method"], tree["form"], tree["k"], tree["tree"], tree["tree_max_nodes"]) == (
        "EAGLE3", "tree", 3, [4, 4, 4], 7)  # num_draft_tokens 2k + 2 = 8: the root and 7 drafted nodes
    assert tree["params"] == {"num_steps": 3, "topk": 4, "num_draft_tokens": 8}
    wide = _shape(fam, "sglang", "eagle3", 3, topk=8, num_draft_tokens=16)
    assert (wide["tree"], wide["tree_max_nodes"]) == ([8, 8, 8], 15)
    assert _shape(fam, "sglang", "eagle3", 3, topk=1)["form"] == "chain"
    assert _shape(fam, "sglang", "dflash")["form"] == "block"
    assert _shape(fam, "trtllm", "eagle3", 3)["params"] == {"max_draft_len": 3}
    medusa = _shape(fam, "trtllm", "medusa")
    assert medusa["method"] == "medusa" and medusa["params"]["medusa_choices"]


@pytest.mark.parametrize("engine, proposer, says", [
    ("vllm", "multi:ngram+ngram:2", "vLLM serves one speculative method per engine"),
    ("sglang", "route:policy.json", "SGLang serves one speculative method per engine"),
    ("sglang", "ngram", "SGLang's n-gram"),
    ("tgi", "ngram", "unknown engine 'tgi'"),
])
def test_a_shape_no_engine_serves_is_refused_in_one_line(engine, proposer, says):
    with pytest.raises(ConfigError, match=says) as e:
        served_shape(engine, proposer, 4)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("engine, kind, k, says", [
    ("sglang", "medusa", None, "SGLang has no Medusa"),
    ("trtllm", "dflash", None, "TensorRT-LLM has no DFlash"),
    ("vllm", "dflash", 2, f"served as {K} draft tokens a step"),
    ("vllm", "medusa", K + 1, f"{K} Medusa heads draft at most {K}"),
    ("sglang", "eagle3", 3, "is no tree SGLang builds"),
])
def test_an_engine_refuses_what_it_cannot_serve_naming_itself(fam, engine, kind, k, says):
    options = {"topk": 1, "num_draft_tokens": 9} if kind == "eagle3" else {}
    with pytest.raises(ConfigError, match=f"--as-served {engine}") as e:
        served_shape(engine, _spec(fam, kind), k, options)
    assert says in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("kind", ["eagle3", "medusa", "dflash", "dspark", "draft", "ngram"])
def test_evaluate_as_served_by_vllm_decodes_its_chain_losslessly(fam, kind, tmp_path):
    """The vLLM shape on the tiny target: a chain or block (never a tree, never a GPU-sized tree beside it), the
    report's `shape` naming engine and form, greedy output equal to HF generate's."""
    from draftsmith.evaluation.evaluate import evaluate

    report = evaluate(fam.target, _spec(fam, kind), prompts=[fam.prompts], as_served="vllm", k=K,
                      max_new_tokens=16, limit_per_domain=2, cost_context=16, cost_k_max=K, cost_repeats=1,
                      repeats=1, remeasure=0)
    shape = report["shape"]
    assert shape["engine"] == "vllm" and shape["form"] in ("chain", "block") and shape["k"] == K
    assert report["settings"]["gpu_tree"] is None and report["overall"].get("gpu_tree") is None
    assert report["settings"]["tree"] in (None, [1] * K)  # DSpark's adaptive verification: its chain, cut
    assert report["overall"]["lossless"] is True
    assert report["overall"]["verified_nodes_per_step"] <= K


def test_evaluate_as_served_by_sglang_decodes_its_eagle_tree_uncut(fam):
    from draftsmith.evaluation.evaluate import evaluate

    report = evaluate(fam.target, _spec(fam, "eagle3"), prompts=[fam.prompts], as_served="sglang", k=3,
                      max_new_tokens=16, limit_per_domain=2, cost_model=False, repeats=1, remeasure=0)
    assert report["shape"]["form"] == "tree" and report["settings"]["tree"] == [4, 4, 4]
    assert report["settings"]["prune_tree"] is False and report["overall"]["lossless"] is True
    assert report["overall"]["verified_nodes_per_step"] > 3  # a tree: more nodes than a chain of 3 verifies


def test_without_as_served_the_report_says_draftsmiths_decoder(fam, tmp_path):
    from draftsmith.evaluation.evaluate import evaluate
    from draftsmith.evaluation.report import write_report

    report = evaluate(fam.target, "multi:ngram+ngram:2", prompts=[fam.prompts], tree=[2, 1], max_new_tokens=8,
                      limit_per_domain=1, cost_model=False, prune_tree=False, repeats=1, remeasure=0)
    assert report["shape"]["engine"] == "draftsmith" and report["shape"]["form"] == "tree"
    write_report(report, tmp_path)
    assert "draftsmith's decoder tree k=2" in (tmp_path / "report.md").read_text()


def test_as_served_refuses_draftsmiths_own_shapes_in_one_line(fam):
    from draftsmith.evaluation.evaluate import evaluate

    for extra, says in ((dict(tree=[2, 1]), "drop --tree"), (dict(adaptive=True), "drop --adaptive")):
        with pytest.raises(ConfigError, match=says):
            evaluate(fam.target, "ngram", prompts=[fam.prompts], as_served="vllm", **extra)
    with pytest.raises(ConfigError, match="vLLM serves one speculative method"):
        evaluate(fam.target, "multi:ngram+ngram:2", prompts=[fam.prompts], as_served="vllm")


@pytest.mark.parametrize("stack, says", [("vllm", "Served shape: vLLM runs `eagle3` as a chain of 4"),
                                         ("sglang", "Served shape: SGLang runs `EAGLE3` as a token tree of depth 4"),
                                         ("trtllm", "Served shape: TensorRT-LLM runs `Eagle3` as a chain of 4")])
def test_serve_md_states_the_served_shape(fam, stack, says, tmp_path):
    from draftsmith.export import export_artifact

    out = export_artifact(fam.artifacts["eagle3"], stack, tmp_path / stack, fam.target, num_speculative_tokens=4).out
    assert says in (out / "serve.md").read_text()
