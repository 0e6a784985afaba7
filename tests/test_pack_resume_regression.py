"""A row pack written before content keys still resumes: its id-less rows (keyed then by line number, as the shipped
broad pack's gsm8k, t0 and self_instruct rows are) answer the same prompts under today's ids, so `--resume-from`
generates none of them again; a line that moved since is generated again."""

from __future__ import annotations

import json

from draftsmith.data import generate_dataset, load_distilled
from draftsmith.data.config import DataConfig, GenerationConfig, SourceConfig
from draftsmith.data.generate import pack_rows
from draftsmith.data.pack import read_pack, write_pack
from draftsmith.data.sources import make_row_id

PROMPTS = [f"Question number {i}: what is {i} plus {i * 3}?" for i in range(6)]


def _cfg(tmp_path, name: str, lines: list[str]) -> DataConfig:
    path = tmp_path / f"{name}.jsonl"
    path.write_text("".join(json.dumps({"q": q}) + "\n" for q in lines))
    return DataConfig(sources=[SourceConfig(name="p", path=str(path), prompt="q", domain="math")],
                      output_dir=str(tmp_path / name),
                      generation=GenerationConfig(max_new_tokens=6, batch_size=3, flush_every=2))


def _legacy_pack(tmp_path, folder) -> str:
    """The rows of `folder` packed as before content keys: each row's id is that of its line number."""
    pack_rows(folder, tmp_path / "now.jsonl.xz")
    header, rows = read_pack(tmp_path / "now.jsonl.xz")
    legacy = {make_row_id(r["source"], r["origin"].rsplit(":", 1)[1]): {**r} for r in rows}
    for i, r in legacy.items():
        r["row_id"] = i
    write_pack(tmp_path / "legacy.jsonl.xz", header["run"], header["requests"], legacy)
    return str(tmp_path / "legacy.jsonl.xz")


def _rows(folder) -> dict[int, tuple]:
    return {r["row_id"]: (r["prompt"], r["input_ids"], r["loss_mask"]) for r in load_distilled(folder).to_list()}


def test_a_pack_keyed_by_line_numbers_resumes_without_generating(tmp_path, tiny_target):
    clean = generate_dataset(_cfg(tmp_path, "clean", PROMPTS), tiny_target, progress=False)
    pack = _legacy_pack(tmp_path, clean)
    assert not set(_rows(clean)) & {r["row_id"] for r in read_pack(pack)[1]}  # no id in common with today's

    written = []
    out = generate_dataset(_cfg(tmp_path, "same", PROMPTS), tiny_target, progress=False, resume_from=pack,
                           on_row=lambda r: written.append(r["prompt"]))
    assert written == []  # every prompt answered by the pack
    assert _rows(out) == _rows(clean)  # today's ids, the same rows

    swapped = [PROMPTS[1], PROMPTS[0], *PROMPTS[2:]]  # lines 1 and 2 trade places: their former ids name the other
    written.clear()
    out = generate_dataset(_cfg(tmp_path, "swapped", swapped), tiny_target, progress=False, resume_from=pack,
                           on_row=lambda r: written.append(r["prompt"]))
    assert sorted(written) == sorted(PROMPTS[:2])
    assert _rows(out) == _rows(clean)
