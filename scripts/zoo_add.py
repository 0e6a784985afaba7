"""Add a trained artifact to the reference heads shipped with the package (zoo/<target>/<name>).

    python scripts/zoo_add.py runs/curve/eagle3-broad/rows13315 zoo/smollm2-135m/eagle3-broad --evaluate
    python scripts/zoo_add.py zoo/smollm2-135m/eagle3-broad --evaluate        # evaluate a shipped head again
    python scripts/zoo_add.py zoo/smollm2-135m/eagle3-broad --evaluate --limit-per-domain 2   # fewer prompts

The weights are verified against the artifact's checksums, stored in bfloat16 (half the bytes; the heads
draft in bf16 on CPUs that have it, and the target verifies, so decoding stays lossless), and the manifest
keeps the artifact's target fingerprint, training config, data and metrics, with `zoo` saying where it came
from. Proposers load it by name from anywhere: `eagle:zoo/smollm2-135m/eagle3-broad` (artifact.resolve_path).
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
    p.add_argument("dest", type=Path, nargs="?", help="zoo/<target>/<name> under the repository root "
                   "(omitted: evaluate the shipped head ARTIFACT in place; needs --evaluate)")
    p.add_argument("--overwrite", action="store_true")
    p.add_argument("--evaluate", action="store_true", help="evaluate the shipped head and write its report")
    p.add_argument("--limit-per-domain", type=int, default=None,
                   help="eval prompts per domain (default: the end-of-training evaluation's)")
    a = p.parse_args(argv)
    if a.dest is None:
        if not a.evaluate:
            p.error("give DEST, or --evaluate to evaluate a shipped head in place")
        return evaluate(a.artifact, a.limit_per_domain)
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
    return evaluate(out, a.limit_per_domain) if a.evaluate else 0


def evaluate(head: Path, limit_per_domain: int | None = None) -> int:
    from draftsmith import artifact
    from draftsmith.evaluation.after_training import EvalAfterTraining, evaluate_into_artifact
    from draftsmith.targets import load_target

    manifest = artifact.load_manifest(head)
    target = load_target(manifest["config"]["target"])
    opts = EvalAfterTraining() if limit_per_domain is None else EvalAfterTraining(limit_per_domain=limit_per_domain)
    limit = "" if limit_per_domain is None else f" --limit-per-domain {limit_per_domain}"
    report = evaluate_into_artifact(head, target, manifest["kind"], opts,
                                    command=f"python scripts/zoo_add.py {head} --evaluate{limit}")
    overall = report["overall"]
    print(f"{head}: tau {overall.get('tau')}, speedup {overall.get('speedup')}, lossless {overall.get('lossless')}; "
          f"report in {head / 'eval'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
