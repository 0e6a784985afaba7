"""Write the public prompt sets the project ships (prompts/) from their source files, with the manifest.

    python scripts/ship_prompt_sets.py SOURCE_DIR [--out prompts]

SOURCE_DIR holds the upstream files as they were downloaded (train/gsm8k_train.jsonl,
train/t0_prompts.jsonl, train/self_instruct_seed_tasks.jsonl, eval/eagle/{alpaca,gsm8k,humaneval}.jsonl,
eval/user_oriented_instructions.jsonl and their licence files). Training sets are stored gzip-compressed
(mtime 0, so the bytes are reproducible); evaluation sets stay plain jsonl (small, readable in a diff).

Every evaluation file is split in two, fixed here once: a row goes to `dev` or `test` by the parity of the
first byte of sha256("<file stem>:<row key>") (row key: question_id, id, else the line number). `dev` is what
choosing runs on (heads, recipes, trees, policies); `test` only reports (the headline numbers). The rule is
a hash, not a random draw, so a row's split never moves when a file grows.

The manifest records, per file: path, what it is, upstream source, licence file, rows and sha256; the tests
read it back (tests/test_prompt_sets.py) so a changed or truncated file is caught.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import shutil
import sys
from pathlib import Path

TRAIN = {
    "gsm8k_train.jsonl": ("grade-school math word problems: question, answer",
                          "openai/grade-school-math, train split", "LICENSES/gsm8k-MIT"),
    "t0_prompts.jsonl": ("NLP task prompts from 294 P3/T0 templates (QA over passages, summarisation, "
                         "classification, ...): source, prompt, reference",
                         "yizhongw/self-instruct data/finetuning/t0_train_50k (up to 40 rows a template)",
                         "LICENSES/self-instruct-Apache-2.0"),
    "self_instruct_seed_tasks.jsonl": ("hand-written instruction tasks with instances",
                                       "yizhongw/self-instruct data/seed_tasks.jsonl",
                                       "LICENSES/self-instruct-Apache-2.0"),
}
EVAL = {
    "eagle/alpaca.jsonl": ("general instructions (MT-bench style turns)", "SafeAILab/EAGLE eagle/data",
                           "LICENSES/eagle-Apache-2.0"),
    "eagle/gsm8k.jsonl": ("math word problems", "SafeAILab/EAGLE eagle/data", "LICENSES/eagle-Apache-2.0"),
    "eagle/humaneval.jsonl": ("Python function completion", "SafeAILab/EAGLE eagle/data",
                              "LICENSES/eagle-Apache-2.0"),
    "user_oriented_instructions.jsonl": ("user-oriented instructions tagged with the app they serve",
                                         "yizhongw/self-instruct human_eval", "LICENSES/self-instruct-Apache-2.0"),
}
LICENSES = {"train/gsm8k_LICENSE": "gsm8k-MIT", "eval/self_instruct_LICENSE": "self-instruct-Apache-2.0",
            "eval/eagle/LICENSE": "eagle-Apache-2.0"}


def split_of(stem: str, key: str) -> str:
    """'dev' or 'test' for a row: the parity of sha256('<stem>:<key>')'s first byte."""
    return "dev" if hashlib.sha256(f"{stem}:{key}".encode()).digest()[0] % 2 == 0 else "test"


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _gzip(src: Path, dst: Path) -> None:
    with open(src, "rb") as f, open(dst, "wb") as raw, gzip.GzipFile(filename="", mode="wb", fileobj=raw,
                                                                      mtime=0, compresslevel=9) as g:
        shutil.copyfileobj(f, g)


def _entry(out: Path, path: Path, what: str, source: str, licence: str, rows: int) -> dict:
    return {"path": path.relative_to(out).as_posix(), "what": what, "source": source, "licence": licence,
            "rows": rows, "sha256": _sha256(path)}


def ship(src: Path, out: Path) -> dict:
    (out / "train").mkdir(parents=True, exist_ok=True)
    (out / "LICENSES").mkdir(exist_ok=True)
    for split in ("dev", "test"):
        (out / "eval" / split).mkdir(parents=True, exist_ok=True)
    for rel, name in LICENSES.items():
        shutil.copyfile(src / rel, out / "LICENSES" / name)
    files = []
    for name, (what, source, licence) in TRAIN.items():
        dst = out / "train" / f"{name}.gz"
        _gzip(src / "train" / name, dst)
        rows = sum(1 for line in open(src / "train" / name, "rb") if line.strip())
        files.append(_entry(out, dst, what, source, licence, rows))
    for rel, (what, source, licence) in EVAL.items():
        stem = Path(rel).name.removesuffix(".jsonl")
        parts: dict[str, list[str]] = {"dev": [], "test": []}
        for lineno, line in enumerate(open(src / "eval" / rel, encoding="utf-8"), 1):
            if not line.strip():
                continue
            row = json.loads(line)
            key = str(row.get("question_id", row.get("id", lineno)))
            parts[split_of(stem, key)].append(line.rstrip("\n") + "\n")
        for split, lines in parts.items():
            dst = out / "eval" / split / f"{stem}.jsonl"
            dst.write_text("".join(lines), encoding="utf-8")
            files.append(_entry(out, dst, f"{what} ({split} split)", source, licence, len(lines)))
    manifest = {"about": "public prompt sets shipped with draftsmith; written by scripts/ship_prompt_sets.py",
                "split_rule": "eval rows: dev if sha256('<file stem>:<question_id|id|line>')[0] is even, else test",
                "files": files}
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n", encoding="utf-8")
    return manifest


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("source", type=Path)
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "prompts")
    args = ap.parse_args(argv)
    m = ship(args.source, args.out)
    for f in m["files"]:
        print(f"{f['path']:55s} {f['rows']:6d} rows  {f['sha256'][:12]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
