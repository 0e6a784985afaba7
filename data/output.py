"""What a dataset folder (`output_dir`) holds, by name, and the two writes every producer of rows shares: claiming
the folder (a user's folder is never written into) and writing the finished rows. Generation (generate.py) and
the import of the fleet's captures (served.py) both write such folders, and neither imports the other for it."""

from __future__ import annotations

from pathlib import Path

from draftsmith.outputs import atomic_dir, check_replaceable, output_kind
from draftsmith.reading import read_json

COLUMNS = ["row_id", "source", "domain", "prompt", "response", "input_ids", "loss_mask", "origin", "stopped",
           "n_turns"]
DATASET_DIR = "dataset"
PROVENANCE = "provenance.json"
CHUNKS_DIR = "chunks"
CAPTURE_DIR = "capture"
SERVED_DIR = "served"  # capture.backend vllm: where the local replica's connector writes (no served_dir given)
# what generation writes into output_dir (magpie requests come first, from data/magpie.py)
GENERATED = {DATASET_DIR, PROVENANCE, CHUNKS_DIR, CAPTURE_DIR, SERVED_DIR, "run.json", "requests"}


def claim_output(out: Path) -> None:
    """Refuse (one line, nothing touched) an output_dir that is a user's folder: generation writes `dataset/`,
    `provenance.json`, `chunks/` ... into it and replaces a `dataset/` there. Ours is: absent or empty, a
    draftsmith dataset, an interrupted generation (its run.json), or only what generation writes before
    run.json (magpie requests, chunks, capture shards)."""
    if not out.is_dir():
        check_replaceable(out, "dataset")  # a file or a symlink is refused; an absent folder passes
        return
    # a writer's lock inside the folder (locks.py) is no content of its own
    names = {p.name for p in out.iterdir() if not (p.name.startswith(".") and p.name.endswith(".lock"))}
    if not names or output_kind(out) == "dataset":
        return
    try:
        run = read_json(out / "run.json") if "run.json" in names else None
    except (OSError, ValueError):
        run = None
    if isinstance(run, dict) and {"fingerprint", "sampling"} <= set(run) and not names - GENERATED:
        return
    if not names & {DATASET_DIR, PROVENANCE, "run.json"} and not names - GENERATED:
        return
    check_replaceable(out, "dataset")


def write_rows(out: Path, records: list[dict]) -> None:
    """The finished rows as `out/dataset` (replaced whole: a reader sees the old set or the new one), in the
    columns every job reads (load_distilled)."""
    import datasets

    columns = {c: [r[c] for r in records] for c in COLUMNS}
    extra = {}
    if records and all("replay" in r for r in records):  # on-policy rollouts (data/engines/rollout.py)
        columns["replay"] = [r["replay"] for r in records]
        extra["replay"] = datasets.Sequence(datasets.Value("int8"))
    features = datasets.Features({
        "row_id": datasets.Value("int64"), "source": datasets.Value("string"), "domain": datasets.Value("string"),
        "prompt": datasets.Value("string"), "response": datasets.Value("string"),
        "input_ids": datasets.Sequence(datasets.Value("int32")), "loss_mask": datasets.Sequence(datasets.Value("int8")),
        "origin": datasets.Value("string"), "stopped": datasets.Value("bool"), "n_turns": datasets.Value("int32"),
        **extra,
    })
    ds = datasets.Dataset.from_dict(columns, features=features)
    with atomic_dir(out / DATASET_DIR, overwrite=True) as tmp:
        ds.save_to_disk(str(tmp))
