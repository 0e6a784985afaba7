"""README's "Your model on your GPUs": the commands from a hub id to a served EAGLE-3 head, as written there,
run here one by one with a tiny random Llama (a tokenizer without a pad token, like Llama 3's) in place of
the hub model and a budget of a few rows and steps. What cannot run on this machine is checked instead:
`pip install` (no network), `vllm serve` (no GPU: the README command must be the export's serve.md
command) and the hub upload (the export's model card must be there)."""

from __future__ import annotations

import json
import os
import re
import runpy
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tiny_models import build_tiny_family

ROOT = Path(__file__).resolve().parent.parent
HUB = "meta-llama/Llama-3.1-8B-Instruct"


def readme_commands() -> list[str]:
    """The commands of README's "your model" block: continuation lines joined, trailing comments cut."""
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Your model on your GPUs"):]
    block = section[section.index("```bash") + len("```bash"):]
    block = block[: block.index("```")]
    commands, current = [], ""
    for line in block.strip().splitlines():
        line = re.sub(r"\s+#\s.*$", "", line.rstrip())
        if line.endswith("\\"):
            current += line[:-1]
            continue
        commands.append((current + line).strip())
        current = ""
    return [c for c in commands if c]


def _args(command: str) -> list[str]:
    return shlex.split(command, comments=True)


def _swap_target(args: list[str], folder: str) -> list[str]:
    """The tiny folder where the command loads the target; `--verifier` keeps the hub id (a name only)."""
    return [folder if i and args[i - 1] == "--target" and a == HUB else a for i, a in enumerate(args)]


@pytest.fixture
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_readme_commands_run_from_a_hub_id_to_a_served_eagle3_head(tiny_tokenizer, tmp_path, monkeypatch, capsys,
                                                                 _one_thread):
    from draftsmith.cli import main
    from draftsmith.targets import gemm

    commands = readme_commands()
    assert 1 <= len(commands) <= 10, commands
    folder = str(build_tiny_family("llama", tiny_tokenizer, tmp_path / "tiny-llama"))
    work = tmp_path / "work"  # the user's own folder: the presets come from the package (the `cp` line)
    work.mkdir()
    monkeypatch.chdir(work)
    gsm8k = ROOT / "prompts" / "eval" / "dev" / "gsm8k.jsonl"
    ran, checked = [], []
    export_dir = None
    with gemm.disabled():  # the CPU kernel plan is tested in test_gemm.py; here, the commands
        for command in commands:
            args = _args(command)
            if args[0] == "pip":
                assert ".[deepspeed]" in command
                checked.append("pip")
                continue
            if args[0] == "cp":  # as the shell runs it, with this environment's python first on the PATH
                env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
                subprocess.run(["bash", "-c", command], cwd=work, env=env, check=True, timeout=120)
                assert (work / "configs/llama3.1-8b-instruct/eagle3.yaml").is_file()
                checked.append("cp")
                continue
            if args[:3] == ["draftsmith", "data", "generate"]:
                # the preset's prompt files are not on this machine: the standard library's code prompts are
                extra = [f"target={folder}", "max_rows=6",
                         "sources=[{name: code, type: stdlib, domain: code, limit: 6}]",
                         "generation.max_new_tokens=16", "generation.batch_size=6", "generation.dtype=auto",
                         "generation.threads=1", "--no-progress"]
                assert main(args[1:] + extra) == 0
            elif args[:2] == ["draftsmith", "plan"]:
                assert main(args[1:]) == 0
                assert ": fits" in capsys.readouterr().out
            elif args[:2] == ["accelerate", "launch"]:
                module = args[args.index("-m") + 1]
                rest = args[args.index(module) + 1:]
                extra = [f"target={folder}", "target_layers=null", "ttt_steps=2", "draft_vocab_size=64",
                         "max_length=64", "eval_fraction=0.2", "train.max_steps=3", "train.batch_size=2",
                         "train.grad_accum=1", "train.mixed_precision=auto", "train.eval_every=0", "train.save_every=0",
                         "train.progress=false", "train.loggers=[jsonl]", "evaluate.enabled=false"]
                monkeypatch.setattr(sys, "argv", [module] + rest + extra)
                with pytest.raises(SystemExit) as e:  # the module as accelerate runs it (here one process)
                    runpy.run_module(module, run_name="__main__", alter_sys=True)
                assert e.value.code == 0
            elif args[:2] == ["draftsmith", "evaluate"]:
                extra = ["--prompts", str(gsm8k), "--limit-per-domain", "1", "--max-new-tokens", "8",
                         "--no-cost-model", "--out", str(tmp_path / "eval")]
                assert main(_swap_target(args, folder)[1:] + extra) == 0
                report = json.loads((tmp_path / "eval" / "report.json").read_text())
                assert report["overall"]["lossless"] is True
            elif args[:2] == ["draftsmith", "export"]:
                assert main(_swap_target(args, folder)[1:]) == 0
                export_dir = work / args[args.index("--out") + 1]
                config = json.loads((export_dir / "config.json").read_text())
                assert config["speculators_config"]["verifier"]["name_or_path"] == HUB  # --verifier, not our folder
            elif args[:2] == ["vllm", "serve"]:
                serve = (export_dir / "serve.md").read_text()
                assert command in serve, (command, serve)  # the README's command is the export's own
                checked.append("vllm serve")
                continue
            elif args[0] in ("huggingface-cli", "hf"):
                card = (export_dir / "README.md").read_text()
                assert args[-1] == str(export_dir.relative_to(work)) and f"base_model: {HUB}" in card
                assert "vllm serve" in card
                checked.append("upload")
                continue
            else:
                raise AssertionError(f"README command not covered by this test: {command}")
            ran.append(" ".join(args[:2]))
    assert ran == ["draftsmith data", "draftsmith plan", "accelerate launch", "draftsmith evaluate",
                   "draftsmith export"], ran
    assert checked == ["pip", "cp", "vllm serve", "upload"], checked
