"""The reference heads shipped in zoo/: intact, small, loadable by name from any directory, lossless, and
bound to the target they were trained for."""

from __future__ import annotations

from pathlib import Path

import pytest
from safetensors import safe_open

from draftsmith import artifact

ZOO_HEADS = sorted(p.parent for p in artifact.ZOO.glob("*/*/manifest.json"))


def test_the_zoo_ships_intact_bf16_heads_under_32_mib():
    """One head per method, the newest: the broad set's EAGLE-3 head of 18.8 MiB, its DFlash drafter of 8.7 MiB
    and Medusa's 2.5 MiB. A head a newer one replaced leaves the tree (git history keeps it)."""
    assert ZOO_HEADS, f"no reference heads under {artifact.ZOO}"
    total = 0
    for head in ZOO_HEADS:
        manifest, state = artifact.load_artifact(head)  # checksums verified
        assert manifest["zoo"]["dtype"] == "bfloat16" and manifest["target"]["weights_hash"]
        with safe_open(str(head / artifact.WEIGHTS), "pt") as f:
            # floating tensors in bf16 (the draft-vocabulary maps stay integer / boolean)
            assert {str(f.get_slice(k).get_dtype()) for k in f.keys()} - {"BOOL", "I64", "I32"} == {"BF16"}, head
        total += sum(p.stat().st_size for p in head.rglob("*") if p.is_file())
    assert total <= 32 * 2**20, total


def test_a_name_resolves_to_the_zoo_only_where_no_local_folder_has_it(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    name = "zoo/smollm2-135m/eagle3-broad"
    assert artifact.resolve_path(name) == artifact.ZOO / "smollm2-135m" / "eagle3-broad"
    assert artifact.load_manifest(name)["kind"] == "eagle"
    (tmp_path / name).mkdir(parents=True)  # the user's own folder of that name comes first
    assert artifact.resolve_path(name) == Path(name)
    assert artifact.resolve_path("zoo/no-such/head") == Path("zoo/no-such/head")


SHIPPED = ["dflash:zoo/smollm2-135m/dflash-broad", "eagle:zoo/smollm2-135m/eagle3-broad",
           "medusa:zoo/smollm2-135m/medusa"]


def test_every_shipped_head_is_listed_and_carries_its_evaluation():
    assert sorted(f"{artifact.load_manifest(h)['kind']}:zoo/{h.parent.name}/{h.name}" for h in ZOO_HEADS) == SHIPPED
    for head in ZOO_HEADS:
        manifest = artifact.load_manifest(head)
        assert manifest["eval"]["overall"]["lossless"] is True and (head / manifest["eval"]["report"]).is_file()


@pytest.mark.parametrize("spec", SHIPPED)
def test_a_shipped_head_refuses_another_target(tiny_target, spec):
    from draftsmith.decoding.factory import build_proposer
    from draftsmith.errors import DraftsmithError

    with pytest.raises(DraftsmithError, match=spec.split(":")[1]):
        build_proposer(spec, tiny_target)


@pytest.mark.real
@pytest.mark.parametrize("spec", SHIPPED)
def test_a_shipped_head_drafts_losslessly_for_its_target(real_target, tmp_path, monkeypatch, spec):
    from draftsmith.decoding.factory import build_proposer
    from draftsmith.decoding.generate import speculative_generate

    monkeypatch.chdir(tmp_path)  # by name, from a directory that is not the repository
    proposer = build_proposer(spec, real_target)
    tok = real_target.tokenizer
    texts = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
             for q in ("What is 12 times 7?", "Name three colours of the rainbow.")]
    prompts = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    plain = speculative_generate(real_target, None, prompts, 24, k=0)
    fast = speculative_generate(real_target, proposer, prompts, 24, k=None, tree=proposer.default_tree_spec())
    assert fast.tokens == plain.tokens
    assert fast.stats.tau > 1.0  # a trained head: some drafts are accepted
