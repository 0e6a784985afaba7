"""draftsmith as users install it: a wheel built from this tree, installed into a fresh virtual environment with
no checkout on its path, run from an empty folder — data generation from a shipped preset, training with the
method's default preset, evaluation on the shipped eval sets, export — and the tracked tree small enough for
every node that installs it.

The fresh environment takes draftsmith from the wheel alone; its dependencies (torch, transformers, ...) come
from this test's own environment through a path line, so that the test installs nothing from an index. Only
that environment's site-packages folder is added: the editable install of the checkout that lives there is
a `.pth` hook, which a path line does not run, and the test checks where `draftsmith` was imported from.
"""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TREE_BUDGET = 48 * 2**20  # what a GPU node takes of a working tree, with room for its build outputs


def _run(cmd: list[str], cwd: Path, env: dict, timeout: int = 600) -> str:
    done = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, (f"{' '.join(map(str, cmd))} -> {done.returncode}\n{done.stdout[-3000:]}\n"
                                  f"{done.stderr[-3000:]}")
    return done.stdout


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel of this tree, built without an index (setuptools from this environment)."""
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
                    "-q", "-w", str(out), str(ROOT)], check=True, capture_output=True, timeout=600)
    wheels = list(out.glob("draftsmith-*.whl"))
    assert len(wheels) == 1, wheels
    return wheels[0]


def test_the_wheel_carries_what_the_package_reads_at_run_time(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    for needed in ("draftsmith/configs/smollm2-135m/medusa.yaml", "draftsmith/configs/retrain.yaml",
                   "draftsmith/prompts/eval/dev/gsm8k.jsonl", "draftsmith/prompts/eval/test/gsm8k.jsonl",
                   "draftsmith/prompts/train/gsm8k_train.jsonl.gz", "draftsmith/prompts/LICENSES/gsm8k-MIT",
                   "draftsmith/zoo/smollm2-135m/eagle3-broad/model.safetensors", "draftsmith/cli.py"):
        assert needed in names, f"{wheel.name} lacks {needed}"
    # what only the checkout needs stays out of every user's install
    assert not [n for n in names if n.startswith(("draftsmith/tests/", "draftsmith/results/", "draftsmith/scripts/"))]
    # every subpackage of the tree is in the wheel (pyproject.toml lists them one by one)
    tree = {"draftsmith/" + p.parent.relative_to(ROOT).as_posix() + "/__init__.py"
            for p in ROOT.glob("*/**/__init__.py")
            if p.relative_to(ROOT).parts[0] not in {"tests", "scripts", "results", "build", "runs", "docs"}
            and not p.relative_to(ROOT).parts[0].startswith(".")}
    assert tree - names == set(), f"subpackages missing from pyproject.toml's package list: {sorted(tree - names)}"


@pytest.fixture(scope="module")
def installed(wheel, tmp_path_factory) -> dict:
    """A fresh virtual environment with the wheel installed (no dependencies from an index: see the module
    docstring), and an environment for its commands without the checkout anywhere on the path."""
    venv = tmp_path_factory.mktemp("venv") / "env"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, capture_output=True, timeout=300)
    bin_dir = venv / ("Scripts" if os.name == "nt" else "bin")
    py = bin_dir / "python"
    subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)], check=True,
                   capture_output=True, timeout=600)
    site = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    (Path(site) / "draftsmith_test_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "DRAFTSMITH_DATA", "VIRTUAL_ENV")}
    env.update(PATH=f"{bin_dir}{os.pathsep}{env.get('PATH', '')}", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    return {"bin": bin_dir, "site": Path(site), "env": env}


def test_installed_draftsmith_runs_every_stage_from_an_empty_folder(installed, tiny_target, tmp_path):
    work = tmp_path / "work"  # an empty folder: no configs/, prompts/ or zoo/ beside the commands
    work.mkdir()
    env, ds = installed["env"], str(installed["bin"] / "draftsmith")
    where = _run([str(installed["bin"] / "python"), "-c", "import draftsmith; print(draftsmith.__file__)"], work, env)
    assert Path(where.strip()).is_relative_to(installed["site"]), f"draftsmith imported from {where}"
    target = str(tiny_target.folder)

    # data from a shipped preset, by name: its prompt sets and the eval sets it holds out come from the package
    _run([ds, "data", "generate", "--config", "smollm2-135m/data", f"target={target}", "max_rows=8",
          "generation.max_new_tokens=8", "generation.batch_size=8"], work, env)
    assert (work / "runs/data/smollm2-135m/provenance.json").is_file()
    # training with the method's default preset (no --config), on the rows just written
    _run([ds, "train", "medusa", f"target={target}", "train.max_steps=3", "train.batch_size=2", "train.log_every=1",
          "calibration_rows=4", "evaluate.limit_per_domain=1", "evaluate.max_new_tokens=6"], work, env)
    head = work / "runs/medusa/smollm2-135m"
    assert (head / "manifest.json").is_file()
    # evaluation on the shipped dev split
    _run([ds, "evaluate", "--target", target, "--proposer", f"medusa:{head}", "--limit-per-domain", "1",
          "--max-new-tokens", "6", "--repeats", "1", "--remeasure", "0", "--out", "eval"], work, env)
    report = (work / "eval/report.json").read_text()
    assert '"gsm8k' in report or '"math"' in report
    # export for vLLM, verified by reloading
    _run([ds, "export", "--artifact", str(head), "--target", target, "--to", "vllm", "--out", "export"], work, env)
    assert (work / "export/config.json").is_file()
    assert sorted(p.name for p in work.iterdir()) == ["eval", "export", "runs"]  # nothing written elsewhere


def test_an_unknown_preset_is_one_line_naming_the_shipped_ones(installed, tmp_path):
    done = subprocess.run([str(installed["bin"] / "draftsmith"), "train", "medusa", "--config", "medusa"],
                          cwd=tmp_path, env=installed["env"], capture_output=True, text=True, timeout=300)
    assert done.returncode != 0 and "smollm2-135m/medusa" in done.stderr and "Traceback" not in done.stderr


def test_the_tracked_tree_stays_under_48_mib():
    """Every GPU node installs the wheel and takes the working tree; heads a newer one replaced leave it (git
    history keeps them), so the tree holds what a user needs and the reports behind BENCHMARKS.md."""
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    total = sum((ROOT / f).stat().st_size for f in files.decode().split("\0") if f and (ROOT / f).is_file())
    assert total <= TREE_BUDGET, f"tracked tree {total / 2**20:.1f} MiB > 48 MiB"
