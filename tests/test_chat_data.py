"""Chat data as users have it (ShareGPT, OpenAI messages; jsonl, parquet, `datasets` folders), kept responses,
and teacher-forced capture over finished rows (`draftsmith data capture`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from draftsmith.capture.cache import ShardReader
from draftsmith.capture.config import CaptureConfig
from draftsmith.capture.offline import length_batches
from draftsmith.data import generate_dataset, load_distilled, load_prompts
from draftsmith.data.config import DataConfig, GenerationConfig, SourceConfig
from draftsmith.data.generate import capture_dataset_dir
from draftsmith.data.masks import masked_spans
from draftsmith.errors import DataError

SHAREGPT = [
    {"id": "a", "conversations": [{"from": "system", "value": "You are terse."},
                                  {"from": "human", "value": "What is 2+2?"},
                                  {"from": "gpt", "value": "4."},
                                  {"from": "human", "value": "And times 3?"},
                                  {"from": "gpt", "value": "It is 12."}]},
    {"id": "b", "conversations": [{"from": "human", "value": "Name a colour."}, {"from": "gpt", "value": "Blue."}]},
]
MESSAGES = [
    {"messages": [{"role": "system", "content": "Answer in French."},
                  {"role": "user", "content": "What is the capital of France?"},
                  {"role": "assistant", "content": [{"type": "text", "text": "Paris est la capitale."}]}]},
    {"messages": [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "Hi!"},
                  {"role": "user", "content": "Again, louder."}]},  # the last question was never answered
]


def _jsonl(path: Path, rows) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def _cfg(tmp_path, sources, **kw) -> DataConfig:
    kw.setdefault("generation", GenerationConfig(max_new_tokens=8, batch_size=4, flush_every=2))
    return DataConfig(sources=sources, output_dir=str(tmp_path / kw.pop("name", "out")), **kw)


def _sources(tmp_path):
    return [SourceConfig(name="sg", path=str(_jsonl(tmp_path / "sg.jsonl", SHAREGPT)), conversations="conversations",
                         id_field="id", domain="chat"),
            SourceConfig(name="oa", path=str(_jsonl(tmp_path / "oa.jsonl", MESSAGES)), messages="messages",
                         domain="chat")]


def test_sharegpt_and_messages_rows(tmp_path):
    keep = load_prompts(_cfg(tmp_path, _sources(tmp_path), responses="keep")).rows
    a, b, fr, hi = keep
    assert (a.system, a.turns, a.responses) == ("You are terse.", ["What is 2+2?", "And times 3?"], ["4.", "It is 12."])
    assert b.system is None and b.responses == ["Blue."]
    assert fr.system == "Answer in French." and fr.responses == ["Paris est la capitale."]
    assert hi.turns == ["Say hi."] and hi.responses == ["Hi!"]  # keep: the unanswered question is dropped
    regen = load_prompts(_cfg(tmp_path, _sources(tmp_path))).rows
    assert regen[3].turns == ["Say hi.", "Again, louder."] and regen[3].responses is None  # the target answers both
    assert [r.row_id for r in regen] == [r.row_id for r in keep]


def test_parquet_and_datasets_folder_sources(tmp_path):
    import datasets

    ds = datasets.Dataset.from_list([{"conversations": c["conversations"]} for c in SHAREGPT])
    ds.to_parquet(str(tmp_path / "sg.parquet"))
    ds.save_to_disk(str(tmp_path / "sg_ds"))
    (tmp_path / "hub" / "data").mkdir(parents=True)  # a dataset folder as the hub downloads it
    ds.to_parquet(str(tmp_path / "hub" / "data" / "train-00000-of-00001.parquet"))
    for path in ("sg.parquet", "sg_ds", "hub"):
        src = SourceConfig(name="sg", type="hf", path=str(tmp_path / path), conversations="conversations", domain="c")
        rows = load_prompts(_cfg(tmp_path, [src], responses="keep")).rows
        assert [r.responses for r in rows] == [["4.", "It is 12."], ["Blue."]], path
        assert rows[0].system == "You are terse."


BAD = [
    json.dumps(SHAREGPT[1]),  # 1 ok
    json.dumps({"conversations": [{"from": "human", "value": "hi"}, {"from": "wizard", "value": "x"}]}),  # 2
    json.dumps({"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "  "}]}),  # 3
    b'{"conversations": [{"from": "human", "value": "caf\xe9"}, {"from": "gpt", "value": "ok"}]}',  # 4 latin-1
    '{"conversations": [{"from": "human", "value": "a\\ud800b"}, {"from": "gpt", "value": "ok"}]}',  # 5 surrogate
    json.dumps({"conversations": [{"from": "gpt", "value": "Hello!"}, {"from": "human", "value": "hi"}]}),  # 6
    json.dumps({"conversations": [{"from": "human", "value": "a"}, {"from": "system", "value": "b"}]}),  # 7
    json.dumps({"conversations": "not a list"}),  # 8
]


def _bad(tmp_path) -> Path:
    p = tmp_path / "bad.jsonl"
    with open(p, "wb") as f:
        for line in BAD:
            f.write((line if isinstance(line, bytes) else line.encode()) + b"\n")
    return p


def test_bad_rows_are_counted_and_named(tmp_path):
    p = _bad(tmp_path)
    ps = load_prompts(_cfg(tmp_path, [SourceConfig(name="x", path=str(p), conversations="conversations",
                                                   domain="d")], responses="keep"))
    assert len(ps.rows) == 1 and ps.rows[0].responses == ["Blue."]
    why = {o.rsplit(":", 1)[1]: r for o, r in ps.malformed.items}
    assert all(o.startswith(str(p) + ":") for o, _ in ps.malformed.items)
    assert set(why) == {"2", "3", "4", "5", "6", "7", "8"}
    assert why["2"] == "unknown role 'wizard' (message 1)"
    assert why["3"].startswith("empty turn (message 1")
    assert why["4"] == f"not UTF-8 (byte 0xe9 at column {BAD[3].index(bytes([0xE9])) + 1})"
    assert why["5"].startswith("not UTF-8 (message 0 content holds")
    assert why["6"].startswith("turns out of order") and why["7"].startswith("system message after")
    assert why["8"] == "not a list of messages (field 'conversations')"
    assert ps.malformed.counts() == {"unknown role": 1, "empty turn": 1, "not UTF-8": 2, "turns out of order": 1,
                                     "system message after the first message": 1, "not a list of messages": 1}
    assert "7 malformed rows skipped" in ps.malformed.summary()
    with pytest.raises(DataError, match=rf"{p.name}:2: unknown role 'wizard'"):
        load_prompts(_cfg(tmp_path, [SourceConfig(name="x", path=str(p), conversations="conversations",
                                                  domain="d")], malformed="fail"))


def test_keep_needs_sources_with_responses(tmp_path):
    with pytest.raises(ValueError,
                       match="responses: keep needs conversations, messages, a response field or type stdlib"):
        _cfg(tmp_path, [SourceConfig(name="p", path="x.jsonl", prompt="q", domain="d")], responses="keep")
    with pytest.raises(ValueError, match="give exactly one of"):
        SourceConfig(name="p", path="x.jsonl", prompt="q", messages="messages", domain="d")
    with pytest.raises(ValueError, match="roles.bing"):
        SourceConfig(name="p", path="x.jsonl", messages="messages", roles={"bing": "bot"}, domain="d")


def test_keep_dataset_masks_every_assistant_turn(tmp_path, tiny_target):
    out = generate_dataset(_cfg(tmp_path, _sources(tmp_path), responses="keep"), tiny_target, progress=False)
    ds = load_distilled(out, tiny_target)
    tok = tiny_target.tokenizer
    want = {"4.\n\nIt is 12.": ["4.<|im_end|>", "It is 12.<|im_end|>"], "Blue.": ["Blue.<|im_end|>"],
            "Paris est la capitale.": ["Paris est la capitale.<|im_end|>"], "Hi!": ["Hi!<|im_end|>"]}
    for row in ds:
        spans = [tok.decode(row["input_ids"][a:b], skip_special_tokens=False)
                 for a, b in masked_spans(row["input_ids"], row["loss_mask"])]
        assert spans == want[row["response"]]
    first = tok.decode(ds[0]["input_ids"], skip_special_tokens=False)
    assert first.startswith("<|im_start|>system\nYou are terse.<|im_end|>")
    prov = json.loads((out / "provenance.json").read_text())
    assert prov["timing"]["kept_rows"] == 4 and prov["timing"]["generated_tokens"] == 0
    # regenerate: the target answers every user turn itself (the unanswered one too)
    regen = load_distilled(generate_dataset(_cfg(tmp_path, _sources(tmp_path), name="regen"), tiny_target,
                                            progress=False))
    assert regen["n_turns"] == [2, 1, 1, 2]
    assert [len(masked_spans(i, m)) for i, m in zip(regen["input_ids"], regen["loss_mask"])] == [2, 1, 1, 2]


def test_length_batches_bound_padded_tokens():
    lengths = [5, 40, 7, 38, 6, 12]
    batches = length_batches(lengths, 80)
    assert sorted(i for b in batches for i in b) == list(range(6))
    assert all(len(b) * max(lengths[i] for i in b) <= 80 for b in batches)
    assert batches[0][:2] == [1, 3]  # longest first, like lengths together


def _full(target, ids, layer):
    from draftsmith.capture.forward import capture_forward

    cap = capture_forward(target.model, torch.tensor([ids]), layers=[layer])
    return cap.layers[layer][0], cap.logits[0].float()


def test_capture_equals_a_full_forward_and_resumes(tmp_path, tiny_target):
    cc = CaptureConfig(layers=[0, -1], topk=5, last_hidden=True, batch_tokens=64, dtype="float32")
    cfg = _cfg(tmp_path, _sources(tmp_path), responses="keep", capture=cc)
    out = generate_dataset(cfg, tiny_target, progress=False)  # keep without capture.enabled: no shards yet
    assert not (out / "capture").exists()
    calls = []

    def kill(n):
        calls.append(n)
        if len(calls) == 2:
            raise KeyboardInterrupt("simulated kill")

    with pytest.raises(KeyboardInterrupt):
        capture_dataset_dir(cfg, tiny_target, progress=False, on_batch=kill)
    stored = len(ShardReader(out / "capture"))
    assert 0 < stored < 4  # the batches before the kill are on disk
    st = capture_dataset_dir(cfg, tiny_target, progress=False)
    assert st["cached_rows"] == stored and st["rows"] == 4 - stored
    reader = ShardReader(out / "capture")
    assert len(reader) == 4 and reader.fingerprint == tiny_target.fingerprint()
    for row in load_distilled(out):
        got = reader.get(row["row_id"])
        hidden, logits = _full(tiny_target, row["input_ids"], -1)
        torch.testing.assert_close(got["layer.-1"].float(), hidden, rtol=2e-2, atol=2e-2)  # stored as bf16
        first = row["loss_mask"].index(1) - 1
        torch.testing.assert_close(got["topk_logsumexp"][first:], torch.logsumexp(logits[first:], -1),
                                   rtol=1e-4, atol=1e-4)
        assert torch.equal(got["topk_indices"][first:], torch.topk(logits[first:], 5).indices)
        assert not got["topk_values"][:first].any()  # positions no loss reads
    assert json.loads((out / "provenance.json").read_text())["timing"]["capture"]["rows"] == 4 - stored
    from draftsmith.capture.offline import capture_rows

    other = load_distilled(out)[0]  # the same key with other tokens: not silently taken from the cache
    other = {**other, "input_ids": other["input_ids"][:-1], "loss_mask": other["loss_mask"][:-1]}
    with pytest.raises(DataError, match="captured from other data"):
        capture_rows(tiny_target, [other], out / "capture", cc, progress=False)


def test_teacher_forced_capture_matches_capture_while_generating(tmp_path, tiny_target):
    """Generated rows captured again by a prefill give what the engine kept while it wrote them."""
    from draftsmith.cli import main

    p = _jsonl(tmp_path / "q.jsonl", [{"q": f"Question {i}: what is {i} plus {i}?"} for i in range(5)])
    gen = _cfg(tmp_path, [SourceConfig(name="q", path=str(p), prompt="q", domain="d")], name="gen",
               capture=CaptureConfig(enabled=True, layers=[-1], topk=4))
    out = generate_dataset(gen, tiny_target, progress=False)
    preset = tmp_path / "again.yaml"
    preset.write_text(f"kind: data\ntarget: {tiny_target.folder}\noutput_dir: {out}\n"
                      f"sources: [{{name: q, path: {p}, prompt: q, domain: d}}]\n"
                      "capture: {layers: [-1], topk: 4, dtype: float32}\n")
    (out / "capture").rename(out / "while_generating")
    assert main(["data", "capture", "--config", str(preset), "--no-progress"]) == 0
    a, b = ShardReader(out / "while_generating"), ShardReader(out / "capture")
    assert a.rows == b.rows and len(b) == 5
    for row in load_distilled(out):
        x, y = a.get(row["row_id"]), b.get(row["row_id"])
        first = row["loss_mask"].index(1) - 1  # the engine may keep a few earlier rows too
        torch.testing.assert_close(x["layer.-1"].float(), y["layer.-1"].float(), rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(x["topk_logsumexp"][first:], y["topk_logsumexp"][first:], rtol=1e-4, atol=1e-4)
        assert torch.equal(x["topk_indices"][first:], y["topk_indices"][first:])


def test_heads_train_from_kept_rows_and_their_capture(tmp_path, tiny_target, monkeypatch):
    """`responses: keep` + capture is data like any other: an EAGLE head trains from the offline cache alone,
    reloads against the target and decodes losslessly."""
    from draftsmith.capture.online import CaptureSource
    from draftsmith.decoding.factory import build_proposer
    from draftsmith.decoding.generate import speculative_generate
    from draftsmith.eagle.job import EagleJob, EagleJobConfig
    from draftsmith.eagle.model import load_eagle
    from draftsmith.evaluation.after_training import EvalAfterTraining
    from draftsmith.training import TrainConfig, train

    convos = [{"conversations": [{"from": "human", "value": f"Question {i}: what is {i} plus {i}?"},
                                 {"from": "gpt", "value": f"The answer is {2 * i}. " * (1 + i % 3)}]}
              for i in range(24)]
    src = SourceConfig(name="sg", path=str(_jsonl(tmp_path / "sg.jsonl", convos)), conversations="conversations",
                       domain="chat")
    cfg = _cfg(tmp_path, [src], responses="keep", capture=CaptureConfig(enabled=True, layers=[1], dtype="float32"))
    out = generate_dataset(cfg, tiny_target, progress=False)
    rows = load_distilled(out, tiny_target).to_list()
    job_cfg = EagleJobConfig(
        target="tiny", data=str(out), output=str(tmp_path / "eagle"), version="eagle1", ttt_steps=2,
        capture_cache=str(out / "capture"), evaluate=EvalAfterTraining(enabled=False),
        train=TrainConfig(lr=3e-3, max_steps=6, batch_size=8, warmup_steps=1, output_dir=str(tmp_path / "run"),
                          resume="never", progress=False, eval_every=0))
    job = EagleJob(job_cfg, tiny_target, rows)
    assert job.features.offline

    def no_online(self, batch):
        raise AssertionError("the target ran although its features are cached")

    with monkeypatch.context() as m:
        m.setattr(CaptureSource, "online_features", no_online)
        result = train(job, job_cfg.train)
    head, _ = load_eagle(result.artifact, tiny_target)
    assert head.config.version == 1
    prompt = rows[0]["input_ids"][: rows[0]["loss_mask"].index(1)]
    ref = tiny_target.model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, pad_token_id=0)
    got = speculative_generate(tiny_target, build_proposer(f"eagle:{result.artifact}", tiny_target), [prompt],
                               max_new_tokens=12, k=3, eos_ids=[])
    assert got.tokens[0] == ref[0, len(prompt):].tolist()


def test_a_response_field_keeps_single_turn_answers(tmp_path, tiny_target):
    """Alpaca / GSM8K-style rows (a prompt and its answer in fields): `response:` keeps the answer, masked
    exactly; a row whose answer is missing, not text or empty is a counted, named bad row."""
    rows = [{"instruction": "Add the numbers.", "input": "2 and 3", "output": "5"},
            {"instruction": "Name a fruit.", "input": "", "output": " An apple. "},
            {"instruction": "No answer here.", "input": ""},
            {"instruction": "A list answer.", "input": "", "output": ["x"]},
            {"instruction": "Blank answer.", "input": "", "output": "  "}]
    src = SourceConfig(name="alpaca", path=str(_jsonl(tmp_path / "alpaca.jsonl", rows)),
                       prompt_template="{instruction}\n\n{input}", response="output", domain="general")
    loaded = load_prompts(_cfg(tmp_path, [src], responses="keep"))
    assert [(r.turns, r.responses) for r in loaded.rows] == [(["Add the numbers.\n\n2 and 3"], ["5"]),
                                                             (["Name a fruit."], ["An apple."])]
    reasons = [why for _, why in loaded.malformed.items]
    assert reasons == ["missing field 'output' (response)", "field 'output' (response) is not text (got a list)",
                       "field 'output' (response) is empty"]
    out = generate_dataset(_cfg(tmp_path, [src], responses="keep", name="kept"), tiny_target, progress=False)
    ds = load_distilled(out, tiny_target)
    tok = tiny_target.tokenizer
    spans = [[tok.decode(r["input_ids"][a:b], skip_special_tokens=False)
              for a, b in masked_spans(r["input_ids"], r["loss_mask"])] for r in ds]
    assert spans == [["5<|im_end|>"], ["An apple.<|im_end|>"]]
    with pytest.raises(ValueError, match="response goes with prompt or prompt_template"):
        SourceConfig(name="p", path="x.jsonl", turns="t", response="a", domain="d")


# --- standard chat sets by name (data/hub_sets.py), read offline from local copies ------------------------------

SETS_ROWS = {  # each set's real columns (the extra ones too), a few rows of each
    ("Aeala/ShareGPT_Vicuna_unfiltered", "train"): [
        {"id": "QWJhYvA_0", "conversations": SHAREGPT[0]["conversations"]},
        {"id": "QWJhYvA_1", "conversations": [{"from": "human", "value": "Search the news."},
                                              {"from": "bing", "value": "Here are three stories."}]},
        {"id": "i6IyJda_0", "conversations": [{"from": "gpt", "value": "Hello!"}]}],  # no user turn: malformed
    ("HuggingFaceH4/ultrachat_200k", "train_sft"): [
        {"prompt": "Plan a picnic.", "prompt_id": "p1", "messages": [
            {"role": "user", "content": "Plan a picnic."}, {"role": "assistant", "content": "Bring bread."},
            {"role": "user", "content": "And drinks?"}, {"role": "assistant", "content": "Lemonade."}]},
        {"prompt": "Define entropy.", "prompt_id": "p2", "messages": [
            {"role": "user", "content": "Define entropy."}, {"role": "assistant", "content": "Disorder."}]}],
    ("mlabonne/open-perfectblend", "train"): [
        {"source": "meta-math/MetaMathQA", "conversations": [{"from": "human", "value": "What is 3*4?"},
                                                            {"from": "gpt", "value": "12"}]},
        {"source": "ise-uiuc/Magicoder-Evol-Instruct-110K", "conversations": [
            {"from": "human", "value": "Write a loop."}, {"from": "gpt", "value": "for i in range(3): pass"}]},
        {"source": "HuggingFaceH4/ultrachat_200k", "conversations": [{"from": "human", "value": "Hello there."},
                                                                    {"from": "gpt", "value": "Hi."}]}],
}


@pytest.fixture
def offline_sets(tmp_path, monkeypatch):
    """The three standard sets in a datasets cache, the machine offline: `load_dataset(id)` finds only these."""
    import datasets
    from tiny_models import cache_hub_dataset

    cache = tmp_path / "hf-datasets"
    for (repo, split), rows in SETS_ROWS.items():
        cache_hub_dataset(cache, repo, rows, split)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", cache)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    return cache


def test_standard_sets_load_by_name_with_their_mapping(tmp_path, offline_sets, tiny_target):
    """`preset: sharegpt | ultrachat | perfectblend` reads each set by its hub id and split (UltraChat's
    train_sft: the cache holds no `train`), maps ShareGPT's from/value turns (human / gpt / bing) and UltraChat's
    role/content messages, labels PerfectBlend's rows by the set they came from, and the rows format into
    masked conversations with the target's chat template."""
    sources = [SourceConfig(name=n, preset=n) for n in ("sharegpt", "ultrachat", "perfectblend")]
    ps = load_prompts(_cfg(tmp_path, sources, responses="keep"))
    by = {s: [r for r in ps.rows if r.source == s] for s in ps.per_source}
    assert [r.responses for r in by["sharegpt"]] == [["4.", "It is 12."], ["Here are three stories."]]
    assert by["sharegpt"][0].system == "You are terse."
    assert [o for o, _ in ps.malformed.items] == ["Aeala/ShareGPT_Vicuna_unfiltered[2]"]  # starts with gpt
    assert [(r.turns, r.responses) for r in by["ultrachat"]] == [
        (["Plan a picnic.", "And drinks?"], ["Bring bread.", "Lemonade."]), (["Define entropy."], ["Disorder."])]
    assert [r.domain for r in by["perfectblend"]] == ["math", "code", "chat"]
    cfg = _cfg(tmp_path, sources, responses="keep", name="rows")
    generate_dataset(cfg, tiny_target, progress=False)
    ds = load_distilled(tmp_path / "rows", tiny_target)
    assert len(ds) == 7 and sorted(set(ds["domain"])) == ["chat", "code", "math"]
    tok = tiny_target.tokenizer  # every kept answer is a masked span, decoded back to exactly the set's text
    spans = sorted(tok.decode(r["input_ids"][a:b], skip_special_tokens=False)
                   for r in ds for a, b in masked_spans(r["input_ids"], r["loss_mask"]))
    answers = [a for r in ps.rows for a in r.responses]
    assert spans == sorted(a + "<|im_end|>" for a in answers) and len(answers) == 9


def test_a_preset_fills_only_what_the_source_leaves_unsaid(tmp_path, offline_sets):
    """The source's own fields win (limit, domain, split); `path` reads a local copy of the set with the preset's
    mapping; an unknown preset is one line naming the known ones."""
    src = SourceConfig(name="uc", preset="ultrachat", limit=1, sample="first", domain="general")
    assert ((src.type, src.id, src.split, src.messages)
            == ("hub", "HuggingFaceH4/ultrachat_200k", "train_sft", "messages"))
    rows = load_prompts(_cfg(tmp_path, [src])).rows
    assert [(r.turns, r.domain) for r in rows] == [(["Plan a picnic.", "And drinks?"], "general")]
    with pytest.raises(DataError, match=r"cannot load hub dataset HuggingFaceH4/ultrachat_200k, split test_sft"):
        load_prompts(_cfg(tmp_path, [SourceConfig(name="uc", preset="ultrachat", split="test_sft")]))
    import datasets  # a local copy as `huggingface-cli download --repo-type dataset` leaves it

    local = tmp_path / "ultrachat_200k" / "data"
    local.mkdir(parents=True)
    datasets.Dataset.from_list(SETS_ROWS[("HuggingFaceH4/ultrachat_200k", "train_sft")]).to_parquet(
        str(local / "train_sft-00000-of-00001.parquet"))
    copy = SourceConfig(name="uc", preset="ultrachat", path=str(local.parent))
    assert (copy.type, copy.id) == ("hf", None)
    assert [r.responses for r in load_prompts(_cfg(tmp_path, [copy], responses="keep")).rows] == [
        ["Bring bread.", "Lemonade."], ["Disorder."]]
    with pytest.raises(ValueError,
                       match=r"source 'x': unknown preset 'vicuna' \(one of sharegpt, ultrachat, perfectblend\)"):
        SourceConfig(name="x", preset="vicuna")


def test_the_chat_sets_preset_mixes_the_three_sets(tmp_path, offline_sets):
    """configs/llama3.1-8b-instruct/data-chat-sets.yaml names the three sets with a limit each; offline it reads
    them from the cache, every set in its share of the mix."""
    from draftsmith.data.generate import load_data_config

    preset = Path(__file__).resolve().parent.parent / "configs" / "llama3.1-8b-instruct" / "data-chat-sets.yaml"
    cfg = load_data_config(preset, [f"output_dir={tmp_path / 'mix'}", "max_rows=5"])
    assert [(s.preset, s.type, s.limit) for s in cfg.sources] == [
        ("sharegpt", "hub", 20000), ("ultrachat", "hub", 20000), ("perfectblend", "hub", 20000)]
    ps = load_prompts(cfg)
    assert ps.per_source == {"sharegpt": 2, "ultrachat": 2, "perfectblend": 3} and len(ps.rows) == 5
