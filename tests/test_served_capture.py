"""The fleet's hidden states as training data (data/served.py): capture files in the format the KV connector
writes inside vLLM (fleet/capture_file.py, the one definition both sides import) are read back, checked, and
imported into a dataset and a capture cache equal to what draftsmith's own capture of the same tokens holds.

Here the files are written from the tiny target's own teacher-forced forward, in vLLM's layer numbering (id i =
the residual stream entering layer i, i.e. HF's hidden_states[i]; id L = the last layer's output before the
norm); tests/test_vllm_fleet_capture.py writes them with vLLM itself. Damaged, foreign or unfitting files are
named and skipped; a reader never raises anything but one line naming the file.
"""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from draftsmith.capture.cache import ShardReader, capture_dataset
from draftsmith.data.generate import load_distilled
from draftsmith.data.served import import_served, read_capture, response_id, vllm_layer_ids
from draftsmith.errors import DataError
from draftsmith.fleet.capture_file import model_identity, write_capture
from draftsmith.targets.families import text_config
from tests.fuzzing import FUZZ, mutated_doc, refuses_cleanly


@torch.no_grad()
def served_states(target, ids: list[int], vllm_ids: list[int]) -> torch.Tensor:
    """[N-1, len(vllm_ids), H]: what vLLM's extract_hidden_states keeps of `ids` (every token but the last was
    an input), from an HF forward: id i < L is hidden_states[i]; id L the last layer's output before the norm."""
    from draftsmith.targets.families import decoder_layers

    model, L = target.model, target.num_layers
    last = {}
    hook = decoder_layers(model)[L - 1].register_forward_hook(
        lambda m, i, o: last.update(h=o[0] if isinstance(o, tuple) else o))
    try:
        out = model(input_ids=torch.tensor([ids[:-1]]), output_hidden_states=True)
    finally:
        hook.remove()
    cols = [last["h"][0] if i == L else out.hidden_states[i][0] for i in vllm_ids]
    return torch.stack(cols, dim=1).float()


def identity(target) -> dict:
    """What the connector records of the model vLLM serves (fleet/capture_file.model_identity): its text config."""
    return model_identity(text_config(target.model.config).to_dict(), str(target.folder))


def _rows(target, n: int = 4, seed: int = 0) -> list[tuple[list[int], int]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        prompt = torch.randint(3, target.vocab_size, (5 + i,), generator=g).tolist()
        answer = torch.randint(3, target.vocab_size, (7 + 2 * i,), generator=g).tolist()
        out.append((prompt + answer, len(prompt)))
    return out


def _write(target, folder, rows, layers=(0, 1), prefix: str = "req") -> list[str]:
    vids = vllm_layer_ids(list(layers), target.num_layers)
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for n, (ids, p) in enumerate(rows):
        paths.append(write_capture(str(folder), f"cmpl-{prefix}{n}-0-{n:08x}", served_states(target, ids, vids), ids, p,
                                   vids, identity(target)))
    return paths


def test_response_id_strips_what_vllm_appends():
    assert response_id("cmpl-abc-0-1f2e3d4c") == "cmpl-abc"
    assert response_id("chatcmpl-abc-1f2e3d4c") == "chatcmpl-abc"
    assert vllm_layer_ids([1, 14, 26], 30) == [2, 15, 27, 30]


def test_imported_served_states_equal_drafsmiths_own_capture_of_the_same_tokens(tiny_target, tmp_path):
    rows = _rows(tiny_target)
    rows.append(rows[0])  # the same request served twice is one row
    _write(tiny_target, tmp_path / "cap", rows)
    domains = {"cmpl-req0": "code", "cmpl-req1": "chat"}
    prov = import_served(tmp_path / "cap", tiny_target, tmp_path / "data", [0, 1], topk=3, last_hidden=True,
                         logsumexp=True, domains=domains, hidden_dtype=torch.float32, progress=False)
    assert prov["counts"]["rows"] == 4 and prov["served"]["duplicates"] == 1 and prov["served"]["skipped"] == 0
    ds = [dict(r) for r in load_distilled(tmp_path / "data", tiny_target)]
    by_ids = {tuple(r["input_ids"]): r for r in ds}
    for n, (ids, p) in enumerate(rows[:4]):
        r = by_ids[tuple(ids)]
        assert r["loss_mask"] == [0] * p + [1] * (len(ids) - p)
        assert r["domain"] == {0: "code", 1: "chat"}.get(n, "served") and r["origin"].startswith("served:cmpl-req")
    own = capture_dataset(tiny_target, ds, tmp_path / "own", [0, 1], 3, hidden_dtype=torch.float32, last_hidden=True,
                          progress=False)
    mine = ShardReader(tmp_path / "data" / "capture")
    assert mine.index["logsumexp"] and sorted(mine.rows) == sorted(own.rows)
    for r in ds:
        a, b, n = mine.get(r["row_id"]), own.get(r["row_id"]), len(r["input_ids"]) - 1
        p = r["loss_mask"].index(1) - 1  # the position that predicts the first learned token: logits from there
        for key in ("layer.0", "layer.1", "last_hidden", "topk_values", "topk_logsumexp"):
            start = p if key.startswith("topk") else 0
            torch.testing.assert_close(a[key][start:n].float(), b[key][start:n].float(), atol=1e-5, rtol=1e-5)
            assert not a[key][n:].any(), f"{key}: the answer's last token was never an input: zeros"
            assert not a[key][:start].any(), f"{key}: no loss reads the prompt's logits: not computed"
        assert torch.equal(a["topk_indices"][p:n], b["topk_indices"][p:n])


def test_an_import_resumes_into_its_own_folder(tiny_target, tmp_path):
    _write(tiny_target, tmp_path / "cap", _rows(tiny_target, 2))
    import_served(tmp_path / "cap", tiny_target, tmp_path / "data", [0], progress=False)
    shards = sorted(p.name for p in (tmp_path / "data" / "capture").glob("shard-*"))
    _write(tiny_target, tmp_path / "cap", _rows(tiny_target, 3, seed=1), prefix="later")  # more traffic since
    prov = import_served(tmp_path / "cap", tiny_target, tmp_path / "data", [0], progress=False)
    assert prov["counts"]["rows"] == 5
    assert sorted(p.name for p in (tmp_path / "data" / "capture").glob("shard-*"))[:len(shards)] == shards
    assert len(ShardReader(tmp_path / "data" / "capture")) == 5


def test_damaged_foreign_or_unfitting_captures_are_named_and_skipped(tiny_target, tmp_path):
    folder = tmp_path / "cap"
    good, flipped, cut, vocab, layers = _write(tiny_target, folder, _rows(tiny_target, 5))
    data = bytearray(open(flipped, "rb").read())
    data[-3] ^= 0xFF  # a byte of token_ids: the checksum tells
    open(flipped, "wb").write(bytes(data))
    open(cut, "r+b").truncate(200)
    ids, p = _rows(tiny_target, 1, seed=3)[0]
    ids[-1] = tiny_target.vocab_size + 5
    vids = vllm_layer_ids([0, 1], 2)
    write_capture(str(folder), vocab.split("/")[-1][:-12], served_states(tiny_target, ids[:-1] + [3], vids), ids, p,
                  vids, identity(tiny_target))
    write_capture(str(folder), layers.split("/")[-1][:-12], served_states(tiny_target, ids[:-1] + [3], [1]),
                  ids[:-1] + [3], p, [1], identity(tiny_target))
    (folder / ".cmpl-x-0-0.tmp-9").write_bytes(b"half")  # a write in flight is not a capture
    prov = import_served(folder, tiny_target, tmp_path / "ok", [0, 1], progress=False)
    assert prov["counts"]["rows"] == 1 and prov["served"]["skipped"] == 4
    assert ([r["origin"] for r in load_distilled(tmp_path / "ok", tiny_target)]
            == [f"served:{good.split('/')[-1][:-12]}"])
    why = "\n".join(prov["served"]["bad"])
    for name, reason in ((flipped, "checksum mismatch"), (cut, "torn"), (vocab, "outside the target's vocabulary"),
                         (layers, "layers [1] captured")):
        assert f"{name}: " in why and reason in why, (name, why)
    with pytest.raises(DataError, match="field 'model.config.hidden_size' is 64, the target's is 96") as e:
        import_served(folder, _wider(tiny_target), tmp_path / "data", [0, 1], progress=False)
    assert "\n" not in str(e.value) and str(folder) in str(e.value)


def _wider(target):
    """A target of another hidden size with the same vocabulary: another model served the captures."""
    from tiny_models import make_target

    return make_target(target.tokenizer, seed=3, hidden=96)


_META = {"format": "draftsmith.vllm_capture", "version": 2, "request_id": "cmpl-a-0-00000000", "layers": [1, 2],
         "prompt_tokens": 3, "n_tokens": 6, "hidden_size": 4, "dtype": "float32",
         "model": {"name": "m", "config": {"model_type": "llama", "hidden_size": 4}}, "sha256": "0" * 64}


@FUZZ
@given(meta=mutated_doc(_META), fix_sum=st.booleans())
def test_capture_metadata_mutations_are_read_or_refused_in_one_line(tmp_path_factory, meta, fix_sum):
    from safetensors.torch import save_file

    from draftsmith.fleet.capture_file import digest

    path = tmp_path_factory.mktemp("fuzz") / "cmpl-a-0-00000000.safetensors"
    hidden, ids = torch.randn(5, 2, 4), torch.arange(6, dtype=torch.int64)
    if fix_sum and isinstance(meta, dict):
        meta["sha256"] = digest(hidden, ids)
    save_file({"hidden_states": hidden, "token_ids": ids}, str(path),
              metadata={"draftsmith": json.dumps(meta, allow_nan=True)})
    got = refuses_cleanly(lambda: read_capture(path), path.name)
    assert got is None or (got.token_ids == ids.tolist() and torch.equal(got.hidden, hidden))
