"""Export entry points: `export_artifact` (any kind, any stack) and `import_export` (back into draftsmith).

One writer per stack (export/vllm.py, sglang.py, trtllm.py, hf.py) says which layout an artifact kind
takes there and how to launch it; the layouts themselves live in export/medusa.py and export/eagle.py
(heads) and export/hf.py (draft models, the same HF folder for every stack). Every export is verified
by re-reading it (export/verify.py) unless verify=False.

The export is written to a temporary sibling of `out`, verified there, and only then swapped in: an export
that fails verification leaves the previous one exactly as it was. An existing `out` is replaced only if it
is a draftsmith export (or empty), unless overwrite=True.
"""

from __future__ import annotations

import importlib
from pathlib import Path

from draftsmith import artifact
from draftsmith.errors import ConfigError
from draftsmith.export import eagle, medusa
from draftsmith.export.card import write_card
from draftsmith.export.common import (
    STACKS,
    ExportResult,
    read_guard,
    record_checksums,
    write_guard,
    write_serve,
)
from draftsmith.export.verify import run_verifier
from draftsmith.storage import atomic_dir, atomic_write_json, check_replaceable
from draftsmith.targets.families import FAMILIES
from draftsmith.targets.fingerprint import check_compatible


def stack_module(stack: str):
    if stack not in STACKS:
        raise ConfigError(f"unknown stack '{stack}' (known: {', '.join(STACKS)})")
    return importlib.import_module(f"draftsmith.export.{stack}")


def verifier_ref(target, verifier: str | None) -> str:
    """How config.json and serve.md name the target: the user's hub id when given (`--verifier`), else the
    folder it was loaded from."""
    if verifier:
        return verifier
    return str(target.folder or target.spec) if target is not None else "<target HF folder>"


def export_artifact(artifact_dir: str | Path, stack: str, out: str | Path, target=None,
                    num_speculative_tokens: int = 4, verify: bool = True, *, overwrite: bool = False,
                    verifier: str | None = None) -> ExportResult:
    """Export a draftsmith artifact for `stack` into `out`: written to a temporary folder, verified there,
    then swapped in.

    `verifier`: the target's name where the export will be served (a hub id such as
    meta-llama/Llama-3.1-8B-Instruct); written into config.json, serve.md and the model card instead of
    the local folder the target was loaded from."""
    artifact_dir, out = Path(artifact_dir), Path(out)
    module = stack_module(stack)
    check_replaceable(out, "export", overwrite)  # before any work: a folder that is not ours stays untouched
    kind = artifact.load_manifest(artifact_dir)["kind"]
    if kind == "draft":
        from draftsmith.export.hf import export_draft

        return export_draft(artifact_dir, out, stack, target, num_speculative_tokens, verify,
                            overwrite=overwrite, verifier=verifier)
    if kind == "medusa":
        manifest, cfg, state, tree = medusa.read_medusa_artifact(artifact_dir, target)
        sub, names = "medusa", None
    else:
        manifest, cfg, state, names = eagle.read_eagle_artifact(artifact_dir, target)
        sub, tree = f"eagle{cfg['version']}", None
        if not getattr(FAMILIES.get(cfg["layer_model_type"]), "llama_layer", False):
            raise ConfigError(f"{artifact_dir}: this EAGLE head's decoder layer is a {cfg['layer_model_type']} layer; "
                              "the EAGLE drafters of vLLM, SGLang, TensorRT-LLM and speculators are Llama layers: "
                              "retrain it with draft_layer: llama")
    formats = module.FORMATS if stack != "hf" else module._head_formats()
    if sub not in formats:
        reason = getattr(module, "UNSUPPORTED", {}).get(sub, f"{stack} does not take {sub} heads")
        raise ConfigError(reason)
    refuse = getattr(module, "refuse", None)
    if refuse is not None and refuse(sub, cfg):
        raise ConfigError(f"{artifact_dir}: {refuse(sub, cfg)}")
    fmt = formats[sub]
    if target is not None:
        check_compatible(manifest["target"], target.fingerprint(), what=f"artifact {artifact_dir}")
    target_ref = verifier_ref(target, verifier)
    target_arch = list(getattr(target.config, "architectures", None) or []) if target is not None else []
    result = ExportResult(out, stack, fmt)

    def verified(tmp: Path) -> None:
        result.files = sorted(p.name for p in tmp.iterdir())
        if verify:
            result.checks = run_verifier(tmp, fmt, target, shown=out)

    with atomic_dir(out, overwrite=overwrite, kind="export", verify=verified) as tmp:
        if sub == "medusa":
            from draftsmith.heads.medusa2 import adapted_target, has_adapter

            if has_adapter(artifact_dir):  # Medusa-2: the heads belong to the adapted target; ship it merged
                if target is None:
                    raise ConfigError(f"{artifact_dir} is a Medusa-2 artifact: give the target, whose adapted "
                                      "(merged) copy is exported next to the heads")
                merged = adapted_target(target, artifact_dir)
                merged.model.save_pretrained(tmp / "adapted_target", safe_serialization=True)
                target.tokenizer.save_pretrained(tmp / "adapted_target")
                target_ref = str(out / "adapted_target")
            medusa.write_layout(tmp, fmt, cfg, state, target_ref)
        else:
            eagle.write_layout(tmp, fmt, cfg, state, target_ref, target_arch, num_speculative_tokens)
        extra = {"kind": kind, "num_speculative_tokens": num_speculative_tokens}
        if tree is not None:
            extra["medusa_choices"] = tree
            atomic_write_json(tmp / "tree.json", {"paths": tree})
        if names is not None:
            extra["eagle"] = {"version": cfg["version"], "source_names": names,
                              "aux_layers_draftsmith": cfg.get("aux_layers"), "target_rope_theta": cfg["rope_theta"]}
        if target is not None and target.folder is not None:
            extra["target_folder"] = str(target.folder)  # where verification finds the weights it needs
        write_guard(tmp, manifest, stack, fmt, extra)
        body = module.serve(sub, out, target_ref, num_speculative_tokens, cfg, tree)
        write_serve(tmp, f"Serving these {sub} heads with {stack}", body)
        write_card(tmp, manifest, sub, stack, fmt, target_ref, body)
        record_checksums(tmp)
    return result


def import_export(export_dir: str | Path, out: str | Path, fingerprint: dict | None = None,
                  overwrite: bool = False) -> Path:
    """Read a vLLM/FasterDecoding Medusa or a speculators/midlayer/EAGLE-1 export back into a draftsmith
    artifact (same weights). The fingerprint comes from draftsmith.json unless given."""
    export_dir = Path(export_dir)
    guard = read_guard(export_dir) if (export_dir / "draftsmith.json").is_file() else {}
    if guard.get("format") in _verifiers():
        run_verifier(export_dir, guard["format"])  # checksums and layout, before reading any weight
    fp = fingerprint or guard.get("target")
    if fp is None:
        raise ConfigError(f"{export_dir}: no draftsmith.json; pass the target fingerprint")
    meta = {"imported_from": str(export_dir), "format": guard.get("format")}
    if guard.get("format") in (medusa.VLLM_FORMAT, medusa.MEDUSA_FORMAT) or (export_dir / medusa.MEDUSA_WEIGHTS).is_file():
        cfg, state = medusa.read_layout(export_dir)
        manifest = artifact.make_manifest("medusa", fp, {}, **meta)
        tree = guard.get("medusa_choices")

        def writer(tmp: Path) -> None:
            if tree is not None:
                atomic_write_json(tmp / "tree.json", {"paths": tree, "expected_length": 0.0})

        return artifact.save_artifact(out, manifest, state, cfg, writer=writer, overwrite=overwrite)
    names = (guard.get("eagle") or {}).get("source_names")
    cfg, state = eagle.read_layout(export_dir, names)
    manifest = artifact.make_manifest("eagle", fp, {}, **meta)
    return artifact.save_artifact(out, manifest, state, cfg, overwrite=overwrite)


def _verifiers() -> dict:  # noqa: N802
    from draftsmith.export import hf, sglang, trtllm, vllm  # noqa: F401  (formats register themselves)
    from draftsmith.export.verify import VERIFIERS

    return VERIFIERS
