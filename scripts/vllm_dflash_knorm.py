"""vLLM's CPU build against its own DFlash drafter's multi-layer context keys, measured.

vLLM 0.32 normalises the context keys of all draft layers in one `rms_norm` call with the layers' k_norm weights
stacked; on the CPU build the kernel takes layer 0's weight for every layer (dflash/vllm_patches.py's
`dflash-context-knorm` fix runs the same kernel one layer at a time). This script trains a two-layer DFlash draft
on a tiny random Llama (rows it wrote), scales each layer's k_norm differently (training leaves them near 1, where
the defect hides; tests/served_family.py), exports it for vLLM and runs `draftsmith serve-check` twice: with the
fix and with vLLM exactly as installed. Each run: loaded, lossless against vLLM's own output without
speculation, vLLM's per-position acceptance beside draftsmith's on the same weights and prompts.

    .venv/bin/python scripts/vllm_dflash_knorm.py --out results/vllm-dflash-knorm   # needs `make setup-vllm`
"""

from __future__ import annotations

import argparse
import json
import platform
import shlex
import sys
import tempfile
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))  # the tiny family builders the tests use, one definition

KEEP = ("loaded", "error", "lossless", "vllm_patches", "acceptance_matches", "per_position_difference", "vllm",
        "speculative_config", "k", "n_prompts", "max_new_tokens")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--steps", type=int, default=60)
    a = ap.parse_args(argv)
    from served_family import TinyFamily
    from tiny_models import build_tiny_tokenizer

    from draftsmith.outputs import atomic_write_json, atomic_write_text

    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        fam = TinyFamily("llama", build_tiny_tokenizer(), Path(tmp), kinds=("dflash",), steps=a.steps)
        for name, patches in (("with the fix", True), ("vLLM as installed", False)):
            r = fam.check("dflash", patches=patches)
            runs[name] = {k: r.get(k) for k in KEEP} | {"draftsmith": (r.get("draftsmith") or {})}
    report = {"command": "python " + shlex.join(["scripts/vllm_dflash_knorm.py", *(argv or sys.argv[1:])]),
              "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"),
              "machine": platform.processor() or platform.machine(),
              "draft": "DFlash, 2 layers, block 4 (k 3), taps [0, 1, 2] of a 4-layer tiny Llama; k_norm of layer i "
                       "scaled by 0.6 + 0.5 i", "runs": runs}
    a.out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(a.out / "report.json", report)
    lines = ["| vLLM run | loaded | lossless | per-position acceptance, vLLM | draftsmith | largest difference |",
             "|---|---|---|---|---|---|"]
    for name, r in runs.items():
        v = " / ".join(f"{x:.3f}" for x in r["vllm"]["per_position_acceptance"])
        d = " / ".join(f"{x:.3f}" for x in r["draftsmith"]["per_position_acceptance"])
        lines.append(f"| {name} | {r['loaded']} | {r['lossless']} | {v} | {d} | "
                     f"{max(r['per_position_difference']):.3f} |")
    atomic_write_text(a.out / "report.md", f"`{report['command']}` ({report['date']})\n\n" + "\n".join(lines) + "\n")
    print("\n".join(lines))
    print(json.dumps({k: r["vllm_patches"] for k, r in runs.items()}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
