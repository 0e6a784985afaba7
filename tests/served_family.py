"""A tiny random target of one family and an artifact of every kind vLLM takes, trained for a few steps on rows the
target wrote, checked in the real vLLM (`draftsmith serve-check`): shared by tests/test_vllm_serving.py and
scripts/vllm_families.py (the per-family table of what vLLM serves)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tiny_models import build_tiny_family, prompt_rows

PROMPTS = ["What is the capital of France?", "def add(a, b):", "How many clips did Natalia sell?",
           "Translate the sentence into French.", "for i in range(10):", "Summarize the passage in one sentence.",
           "The quick brown fox", "import os"]
K = 3  # chain length on the tiny targets (the Medusa heads trained there are 3)
# what draftsmith exports for vLLM; "ngram": vLLM's control
KINDS = ("eagle3", "eagle31", "eagle1", "medusa", "draft", "dflash")
DRAFT_VOCAB = 128  # of the tiny targets' 320 tokens: the reduced vocabularies (EAGLE-3's, DFlash's "dflash-vocab")


def require_vllm() -> Path:
    """The vLLM environment's python; the test is skipped without one, unless DRAFTSMITH_REQUIRE_VLLM=1 (set by
    `make test-vllm`) makes that a failure."""
    import os

    import pytest

    from draftsmith.data.engines.vllm_server import ServeCheckError, vllm_python

    try:
        return vllm_python()
    except ServeCheckError as e:
        if os.environ.get("DRAFTSMITH_REQUIRE_VLLM") == "1":
            pytest.fail(str(e))
        pytest.skip(str(e))


def _train_cfg(tmp: Path, name: str, steps: int):
    from draftsmith.training.config import TrainConfig

    return TrainConfig(lr=3e-3, max_steps=steps, batch_size=4, warmup_steps=0, output_dir=str(tmp / f"{name}-run"),
                       resume="never", progress=False, log_every=100, eval_every=0, eval_batches=1)


def _prompt_file(tmp: Path) -> str:
    path = tmp / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": p, "domain": "chat"}) + "\n" for p in PROMPTS))
    return str(path)


def _zero_fc_bias(art: Path, target) -> Path:
    """vLLM's EAGLE-1 has no fc bias (its export refuses a non-zero one): the same head with the bias at zero,
    saved as an artifact of its own, is what vLLM and draftsmith both decode."""
    from draftsmith import artifact

    manifest, state = artifact.load_artifact(art, kind="eagle", target=target)
    state = {k: (torch.zeros_like(v) if k.endswith("fc.bias") else v) for k, v in state.items()}
    cfg = json.loads((art / "config.json").read_text())
    out = art.with_name(art.name + "-nobias")
    return artifact.save_artifact(out, artifact.make_manifest("eagle", manifest["target"], manifest.get("data") or {}),
                                  state, cfg)


def _distinct_k_norms(art: Path, target) -> Path:
    """The same DFlash draft with each layer's k_norm weight scaled by its own factor: a few steps of training
    leave them all near 1, where a kernel applying one layer's norm to every layer's keys (vLLM's CPU build,
    dflash/vllm_patches.py) would go unnoticed. Saved as an artifact of its own, decoded by vLLM and draftsmith."""
    from draftsmith import artifact

    manifest, state = artifact.load_artifact(art, kind="dflash", target=target)
    state = {k: (v * (0.6 + 0.5 * int(k.split(".")[1])) if k.endswith("k_norm.weight") else v)
             for k, v in state.items()}
    cfg = json.loads((art / "config.json").read_text())
    out = art.with_name(art.name + "-knorm")
    return artifact.save_artifact(out, artifact.make_manifest("dflash", manifest["target"], manifest.get("data") or {}),
                                  state, cfg)


class TinyFamily:
    """A tiny random target of one family (head_dim 32: vLLM's CPU attention takes no smaller head) and one
    artifact of every kind, trained for a few steps on rows the target wrote."""

    def __init__(self, family: str, tokenizer, tmp: Path, kinds=KINDS, steps: int = 40):
        from draftsmith.distill.job import DistillConfig
        from draftsmith.eagle.job import EagleJob, EagleJobConfig
        from draftsmith.evaluation.after_training import EvalAfterTraining
        from draftsmith.medusa.job import MedusaJob, MedusaJobConfig
        from draftsmith.runner.train import run
        from draftsmith.targets import load_target
        from draftsmith.training import train

        self.tmp = tmp
        self.folder = build_tiny_family(family, tokenizer, tmp / family, hidden=128, layers=4)
        self.target = load_target(str(self.folder))
        rows = prompt_rows(self.target, tmp, PROMPTS)
        no_eval = EvalAfterTraining(enabled=False)
        self.artifacts: dict[str, Path] = {}
        if "medusa" in kinds:
            mcfg = MedusaJobConfig(target=str(self.folder), data="in-memory", output=str(tmp / "medusa"), num_heads=K,
                                   calibration_rows=2, tree_budget=4, max_length=64,
                                   train=_train_cfg(tmp, "medusa", steps), evaluate=no_eval)
            self.artifacts["medusa"] = Path(train(MedusaJob(mcfg, self.target, rows), mcfg.train).artifact)
        for version in ("eagle3", "eagle1"):
            if version not in kinds:
                continue
            # EAGLE-3 features: draftsmith ids 0, 1, 2 (outputs of layers 0-2) = vLLM ids 1, 2, 3
            ecfg = EagleJobConfig(target=str(self.folder), data="in-memory", output=str(tmp / version), version=version,
                                  target_layers=[0, 1, 2] if version == "eagle3" else None,
                                  ttt_steps=2 if version == "eagle3" else 1, draft_vocab_size=DRAFT_VOCAB,
                                  max_length=64,
                                  train=_train_cfg(tmp, version, steps), evaluate=no_eval)
            self.artifacts[version] = Path(train(EagleJob(ecfg, self.target, rows), ecfg.train).artifact)
        if "eagle1" in kinds:
            self.artifacts["eagle1"] = _zero_fc_bias(self.artifacts["eagle1"], self.target)
        if "eagle31" in kinds:  # EAGLE-3.1: a norm per fused layer, later steps read the normalised output
            ecfg = EagleJobConfig(target=str(self.folder), data="in-memory", output=str(tmp / "eagle31"),
                                  target_layers=[0, 1, 2], ttt_steps=2, draft_vocab_size=DRAFT_VOCAB, max_length=64,
                                  fc_norm=True, norm_output=True, train=_train_cfg(tmp, "eagle31", steps),
                                  evaluate=no_eval)
            self.artifacts["eagle31"] = Path(train(EagleJob(ecfg, self.target, rows), ecfg.train).artifact)
        if "dflash" in kinds:
            self.artifacts["dflash"] = self._dflash("dflash", rows, steps)
        if "dflash-vocab" in kinds:  # an own lm_head over a reduced vocabulary, d2t mapping it (not in KINDS)
            self.artifacts["dflash-vocab"] = self._dflash("dflash-vocab", rows, steps, draft_vocab_size=DRAFT_VOCAB)
        if "draft" in kinds:
            dcfg = DistillConfig()
            dcfg.target, dcfg.train = str(self.folder), _train_cfg(tmp, "distill", steps)
            dcfg.train.batch_size, dcfg.evaluate.enabled, dcfg.draft.num_layers = 2, False, 1
            dcfg.data.eval_fraction = 0.25
            self.artifacts["draft"] = Path(run("draft", dcfg, target=self.target, rows=rows).artifact)
        self.prompts = _prompt_file(tmp)
        self.plain: dict | None = None  # vLLM without speculation on these prompts, shared by the kinds

    def _dflash(self, name: str, rows, steps: int, **options) -> Path:
        """A DFlash draft of two layers: vLLM's multi-layer context path (its CPU kernel needed a fix,
        dflash/vllm_patches.py), with distinct k_norms."""
        from draftsmith.dflash.job import DFlashJob, DFlashJobConfig
        from draftsmith.evaluation.after_training import EvalAfterTraining
        from draftsmith.training import train

        cfg = DFlashJobConfig(target=str(self.folder), data="in-memory", output=str(self.tmp / name), num_layers=2,
                              block_size=K + 1, target_layers=[0, 1, 2], anchors_per_row=8, max_length=64,
                              train=_train_cfg(self.tmp, name, steps), evaluate=EvalAfterTraining(enabled=False),
                              **options)
        return _distinct_k_norms(Path(train(DFlashJob(cfg, self.target, rows), cfg.train).artifact), self.target)

    def export(self, kind: str):
        """The artifact exported for vLLM (an ExportResult: its checks and warnings)."""
        from draftsmith.export import export_artifact

        return export_artifact(self.artifacts[kind], "vllm", self.tmp / f"{kind}-vllm", self.target,
                               num_speculative_tokens=K)

    def check(self, kind: str, export: Path | None = None, patches: bool = True) -> dict:
        from draftsmith.export.serve_check import serve_check

        if kind != "ngram" and export is None:
            export = self.export(kind).out
        where = self.tmp / f"{kind}-check{'' if patches else '-raw'}"
        report = serve_check(export, self.target, [self.prompts], where, k=K, max_new_tokens=64,
                             limit_per_domain=None, batch=4, timeout=600, method="ngram" if kind == "ngram" else None,
                             plain=self.plain, patches=patches)
        if self.plain is None:
            self.plain = json.loads((self.tmp / f"{kind}-check" / "vllm-plain.result.json").read_text())
        return report
