"""The model card (README.md) of an export folder, so the folder uploads to the Hugging Face hub as is
(`huggingface-cli upload ORG/NAME EXPORT_DIR`).

Everything in it comes from the artifact's manifest (target fingerprint, training data, the evaluation
draftsmith ran after training: α and τ per domain) and from the export itself (format, stack, the serve
command of serve.md). A number the manifest does not hold is not written: an artifact never evaluated
says so instead of showing a table.
"""

from __future__ import annotations

import re
from pathlib import Path

from draftsmith.formatting import fmt_num, md_cell
from draftsmith.outputs import atomic_write_text

CARD = "README.md"
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def card_text(manifest: dict, what: str, tag: str, stack: str, fmt: str, verifier: str, serve_body: str) -> str:
    """`what`: the drafter in words, as its method says it ("an EAGLE-3 head"); `tag`: its layout family, a hub
    tag beside the stack's."""
    target = manifest.get("target") or {}
    arch = target.get("architecture") or {}
    front = ["---", "library_name: draftsmith", "tags:", "- speculative-decoding", f"- {tag}", f"- {stack}"]
    if _HUB_ID.match(verifier or ""):
        front.append(f"base_model: {verifier}")
    front.append("---")
    lines = front + ["", f"# {what} for {verifier}", "",
                     f"Speculative-decoding drafter trained with draftsmith {manifest.get('draftsmith_version', '')} "
                     f"on the frozen target `{verifier}`, exported in the `{fmt}` layout for {stack}.", "",
                     "## Target", "",
                     f"- model type `{arch.get('model_type', '?')}`, {arch.get('num_hidden_layers', '?')} layers, "
                     f"hidden size {arch.get('hidden_size', '?')}, vocabulary {target.get('vocab_size', '?')}",
                     "- `draftsmith.json` holds the target's full fingerprint (tokenizer, special tokens, chat "
                     "template, config); `draftsmith check --artifact THIS_FOLDER --target YOUR_TARGET` compares it",
                     ""]
    data = manifest.get("data") or {}
    if data:
        lines += ["## Training data", ""]
        lines += [f"- {md_cell(k.replace('_', ' '))}: {md_cell(v)}" for k, v in data.items()
                  if isinstance(v, int | float | str)]
        lines.append("")
    ev = manifest.get("eval") or {}
    domains = ev.get("domains") or {}
    lines += ["## Evaluation", ""]
    if domains:
        lines += ["Greedy speculative decoding with draftsmith's own decoder on the target (every output is "
                  "the target's own greedy output, checked); α = acceptance rate, τ = tokens per target forward.",
                  "", "| domain | prompts | α | τ | lossless |", "|---|---|---|---|---|"]
        rows = list(domains.items()) + ([("overall", ev["overall"])] if ev.get("overall") else [])
        for name, r in rows:
            lines.append(f"| {md_cell(name)} | {fmt_num(r.get('n_prompts'))} | {fmt_num(r.get('alpha'))} | "
                         f"{fmt_num(r.get('tau'), '.2f')} | {fmt_num(r.get('lossless'))} |")
        lines.append("")
    else:
        lines += ["Not evaluated by draftsmith (no evaluation in the artifact's manifest).", ""]
    lines += ["## Serving", "", serve_body.strip(), ""]
    return "\n".join(lines)


def write_card(out: Path, manifest: dict, what: str, tag: str, stack: str, fmt: str, verifier: str,
               serve_body: str) -> None:
    atomic_write_text(Path(out) / CARD, card_text(manifest, what, tag, stack, fmt, verifier, serve_body))
