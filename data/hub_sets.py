"""Standard chat sets by name: `preset: sharegpt | ultrachat | perfectblend` in a data config's source.

Each preset is the hub dataset the EAGLE-3 / DFlash training toolkits start from, with the column and role
mapping its rows need, so that a user names the set instead of spelling out its layout:

  sharegpt      Aeala/ShareGPT_Vicuna_unfiltered (split train): ShareGPT `conversations` of {from, value}
                turns, human / gpt (and the few bing / chatgpt turns) mapped to user / assistant. It is the
                one-file copy of anon8231489123/ShareGPT_Vicuna_unfiltered that `load_dataset` reads as one
                table (the original repository holds several JSON files of different layouts).
  ultrachat     HuggingFaceH4/ultrachat_200k (split train_sft): OpenAI `messages` of {role, content}.
  perfectblend  mlabonne/open-perfectblend (split train): a mix of chat, math, code and instruction-following
                sets in ShareGPT `conversations`; its `source` column (the set each row came from) gives the
                row's domain, so acceptance is reported per domain of the mix.

A preset fills only what the source leaves unsaid: any field the source gives itself wins (a `limit`, a
pinned `revision`, its own `domain`, another split), a source with a mapping of its own keeps it, and a
source that gives `path` reads a local copy of the set (`type: hf`: a `save_to_disk` folder, the folder a
hub download leaves, or a data file) with the preset's mapping instead of asking the hub. Without `path`
the set is a `type: hub` source: `datasets.load_dataset(id)`, which reads the local datasets cache where
the set was downloaded before (offline with HF_DATASETS_OFFLINE=1). Rows are keyed by their index (no
`id_field`: ShareGPT's split conversations and UltraChat's `prompt_id` may repeat, and a repeated key is an
error), so pin `revision` for row ids that survive a rerun.

A mix of sets is a data config with several preset sources, each with its `limit` (its weight in the mix),
and `max_rows` for the total (configs/llama3.1-8b-instruct/data-chat-sets.yaml).
"""

from __future__ import annotations

from dataclasses import MISSING, fields
from typing import Any

# role names the ShareGPT dumps use besides user / assistant (data/sources.py knows the common ones; named
# here too so that the preset says what it maps)
_SHAREGPT_ROLES = {"human": "user", "gpt": "assistant", "chatgpt": "assistant", "bing": "assistant"}

HUB_SETS: dict[str, dict[str, Any]] = {
    "sharegpt": {"id": "Aeala/ShareGPT_Vicuna_unfiltered", "split": "train", "conversations": "conversations",
                 "roles": _SHAREGPT_ROLES, "domain": "chat"},
    "ultrachat": {"id": "HuggingFaceH4/ultrachat_200k", "split": "train_sft", "messages": "messages",
                  "domain": "chat"},
    "perfectblend": {"id": "mlabonne/open-perfectblend", "split": "train", "conversations": "conversations",
                     "roles": _SHAREGPT_ROLES, "domain": "chat",
                     # the `source` column names the set a row came from (e.g. meta-math/MetaMathQA)
                     "domain_rules": [{"field": "source", "pattern": "(?i)math|gsm|numina", "domain": "math"},
                                      {"field": "source", "pattern": "(?i)code|magicoder|coder", "domain": "code"}]},
}

def apply_hub_set(source, mappings: tuple[str, ...]) -> None:
    """Fill `source` (a SourceConfig, before its checks) from the preset it names; ValueError for an unknown one.
    `mappings`: the field-mapping keys, of which a source gives exactly one (data/config.py's MAPPINGS)."""
    preset = HUB_SETS.get(source.preset)
    if preset is None:
        raise ValueError(f"source '{source.name}': unknown preset {source.preset!r} (one of {', '.join(HUB_SETS)})")
    defaults = {f.name: f.default if f.default is not MISSING else f.default_factory()  # type: ignore[misc]
                for f in fields(source) if f.default is not MISSING or f.default_factory is not MISSING}
    if source.type == defaults["type"]:
        source.type = "hf" if source.path else "hub"
    own_mapping = any(getattr(source, k) for k in mappings)
    own_domain = source.domain is not None or bool(source.domain_rules)
    for key, value in preset.items():
        if key == "id" and source.type != "hub":
            continue  # a local copy: the id would only be refused beside a path
        if key in mappings and own_mapping:
            continue
        if key == "roles":
            source.roles = {**value, **source.roles}
        elif key in ("domain", "domain_rules"):
            if not own_domain:  # a source's own domain (or rules) replaces the preset's whole labelling
                setattr(source, key, list(value) if key == "domain_rules" else value)
        elif getattr(source, key) == defaults.get(key):
            setattr(source, key, value)
