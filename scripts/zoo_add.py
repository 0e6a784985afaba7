"""Add a trained artifact to the reference heads shipped with the package (zoo/<target>/<name>).

    python scripts/zoo_add.py runs/eagle/s12 zoo/smollm2-135m/eagle3

The weights are verified against the artifact's checksums, stored in bfloat16 (half the bytes; the heads
draft in bf16 on CPUs that have it, and the target verifies, so decoding stays lossless), and the manifest
keeps the artifact's target fingerprint, training config, data and metrics, with `zoo` saying where it came
from. Proposers load it by name from anywhere: `eagle:zoo/smollm2-135m/eagle3` (artifact.resolve_path).
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

import torch


def main(argv: list[str] | None = None) -> int:
    from draftsmith import artifact

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("artifact", type=Path)
    p.add_argument("dest", type=Path, help="zoo/<target>/<name> under the repository root")
    p.add_argument("--overwrite", action="store_true")
    a = p.parse_args(argv)
    manifest, state = artifact.load_artifact(a.artifact)  # checksums verified
    state = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in state.items()}
    manifest = {k: v for k, v in manifest.items() if k != "checksums"}
    manifest["zoo"] = {"source": str(a.artifact), "source_created": manifest.get("created"), "dtype": "bfloat16"}

    def extra(tmp: Path) -> None:  # everything else the artifact holds (config.json, tree.json, reports)
        for f in a.artifact.iterdir():
            if f.is_file() and f.name not in (artifact.MANIFEST, artifact.WEIGHTS):
                shutil.copy2(f, tmp / f.name)

    out = artifact.save_artifact(a.dest, manifest, state, writer=extra, overwrite=a.overwrite)
    size = sum(f.stat().st_size for f in out.iterdir())
    print(f"{out}: {len(state)} tensors in bfloat16, {size / 2**20:.1f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
