"""Names that say what they hold (issue 67): the shared base's file modules each hold one topic under a name a
reader looks for. storage.py held nine (atomic writes, output folders, JSON reading with its caps, bounded
lines, integers as JSON spells them, hashing, weight checksums, the cache root, the shipped prompt sets)."""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

from repo_scripts import load_script

ROOT = Path(__file__).resolve().parents[1]
HOMES = {
    "outputs": {"atomic_write_bytes", "atomic_write_text", "atomic_write_json", "open_output", "save_figure",
                "atomic_dir", "check_replaceable", "output_kind", "clean_stale", "raise_if_full", "fsync_dir"},
    "reading": {"read_json", "json_depth", "jsonl_records", "is_int", "bounded_lines", "gzip_budget", "TooMuch"},
    "checksums": {"sha256_text", "sha256_json", "sha256_file", "weight_checksums", "checksum_problems",
                  "verify_checksums"},
    "paths": {"cache_dir", "shared_data_dir", "data_path", "data_stem", "open_data"},
}


def test_the_shared_base_file_modules_say_what_they_hold():
    """Each file module of the base holds its topic, each name is defined in one of them only, they sit in the
    base layer (and targets/ may import them), and no module is left under the old catch-all name."""
    checker = load_script("check_imports")
    defined: dict[str, str] = {}
    for name, held in HOMES.items():
        path = ROOT / f"{name}.py"
        tree = ast.parse(path.read_text(encoding="utf-8"))
        top = {n.name for n in tree.body if isinstance(n, ast.FunctionDef | ast.ClassDef)}
        assert held <= top, f"{name}.py lacks {sorted(held - top)}"
        for n in top:
            assert n not in defined or n.startswith("_"), f"{n} is defined in {defined.get(n)}.py and {name}.py"
            defined[n] = name
        assert name in checker.LAYERS[0] and f"draftsmith.{name}" in checker.BOTTOM_MAY_IMPORT
    assert importlib.util.find_spec("draftsmith.storage") is None and not (ROOT / "storage.py").exists()
